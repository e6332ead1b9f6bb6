"""LayerNorm forward and backward, the residual add, and the residual add fused with the next LayerNorm.

The functions are those of `reference.py` (same names), as llm.c's llmc/layernorm.cuh computes them:

- `layernorm_forward`: a row of C channels per (b, t), held in registers while it is normalised, so the
  variance is the two-pass sum of (x - mean)^2 over values already loaded, not E[x^2] - E[x]^2, at the
  cost of one read of the input. Small rows are packed several to a program (a [ROWS, BLOCK_C] tile) so
  every program moves a few KiB, as llm.c's kernel3 gives each warp a row. mean and rstd are fp32 and
  kept for the backward.
- `residual_forward`: an elementwise add in wide vectors.
- `fused_residual_forward`: residual = inp1 + inp2 and its LayerNorm in one pass (llm.c's
  fused_residual_forward5), saving a write and a read of the residual stream at each block boundary.
  The LayerNorm is taken of the residual as STORED (rounded to floatX), not of the fp32 sum: the backward
  recomputes norm from the stored residual and the saved mean/rstd, so the two must describe the same
  numbers, and the result equals residual_forward followed by layernorm_forward bit for bit.
- `layernorm_backward`: accumulates dinp += d(loss)/d(inp) (the residual-stream gradient flows through,
  as llm.c's kernel10 does) and dweight += sum over rows of dout * norm, dbias += sum of dout. The
  parameter gradients are reduced in two fixed levels instead of with atomics, so they are bitwise
  reproducible: kernel 1 runs one program per chunk of consecutive rows (num_chunks = scratch.shape[0],
  by default LN_BACKWARD_CHUNKS: a constant, not a device query, so the split - and so the bits - depend
  only on the row count), each writing dinp for its rows and its chunk's partial sums into an fp32
  scratch row; kernel 2 sums the scratch rows in a fixed order and adds them into dweight/dbias, with
  stochastic rounding when those are bf16 (llm.c's treatment of parameter gradients).

Tuning: the row kernels take rows per program, num_warps and a software-pipelining depth (stages: the
next rows' loads wait in shared memory while these are computed; bandwidth here is bound by the bytes
in flight per SM), the forward also a persistent grid (programs_per_sm); the defaults are module
constants, bench/kernels/bench_layernorm.py sweeps LN_FWD_SWEEP / LN_BWD_SWEEP to choose them. A
pipelined build that fails to compile or to fit runs unpipelined instead (common.PIPELINE_FALLBACKS records it).

Storage ("floatX") is bf16 or fp32; arithmetic is fp32. The launchers only launch: no allocation, no host
sync, shapes decide everything, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..reference import LAYERNORM_EPS
from .common import cdiv, interpreting, launch_pipelined, round_to, store_rounded

# Tuning knobs (launcher defaults; every launcher takes them as optional arguments, and
# bench/kernels/bench_layernorm.py sweeps LN_FWD_SWEEP / LN_BWD_SWEEP below to pick them).
# Row kernels: a program's tile is [ROWS, BLOCK_C], BLOCK_C = C padded to a power of two, with rows
# packed until the tile holds about *_TILE values (at most *_MAX_ROWS rows), *_PER_THREAD values per
# thread deciding the warps. C=768: the forward takes 4 rows in 4 warps (a warp a row: the row sums stay
# in the warp, no shared-memory round trip), the backward 1 row in 2 warps. Defaults picked from the H200
# sweeps of 2026-12-01 (bench/RESULTS.md): forward r4 w4 p8 s3 0.063 ms (74 %; 0.073 for r1 w4), fused
# residual r4 w4 p0 s1 0.104 ms (90 %; 0.108), backward r1 w2 k1024 s3 0.114 ms (83 %; 0.146 before).
FWD_TILE, FWD_MAX_ROWS, FWD_PER_THREAD = 4096, 16, 32
BWD_TILE, BWD_MAX_ROWS, BWD_PER_THREAD = 1024, 4, 16
# Forward: programs per SM of a persistent grid looping over row blocks (0: one program per row block),
# and the software-pipelining depth of that loop (1: none; with more, the next blocks' loads wait in
# shared memory while this one is normalised). layernorm_forward and fused_residual_forward take their
# own: these do not change the per-row reduction order (rows and warps do, and those the two share, so
# that they agree bit for bit).
FWD_PROGRAMS_PER_SM = 8 if not interpreting() else 0
FWD_STAGES = 3
FUSED_PROGRAMS_PER_SM = 0
FUSED_STAGES = 1
# Both forwards: a row as one next_pow2(C) tile (1) or, where C is 3 x a power of two, three tiles without
# padding lanes (3; see layernorm_forward). At C = 768 on the H200 three tiles ran the fused pass as fast alone
# (0.107 against 0.108 ms) and the plain one faster (0.061 against 0.078), but the whole step no faster
# (bench/RESULTS.md run AD): one tile stays.
FWD_PIECES = 1
# Backward: pipelining depth of each chunk's row loop, and the row as one next_pow2(C) tile (1) or, where C
# is 3 x a power of two, three tiles without padding (3). With the projection's bias summed along, three
# tiles: 0.120 against 0.132 ms a call at C = 768 on the H200 (its third accumulator had the one-tile
# kernel at 139 registers a thread, 6 programs an SM; bench/RESULTS.md run S); the plain backward stays
# one tile (0.114 against 0.118).
BWD_STAGES = 3
BWD_PIECES = 1
BWD_PIECES_PROJ = 3
# residual_forward: values per program (32 per thread at 4 warps: a few 16-byte vectors each)
RESIDUAL_BLOCK = 4096
# Chunks of rows in the backward's first level: about 8 programs per SM of a 132-SM H200 - all resident at
# once (56 registers x 128 threads each), enough loads in flight to keep HBM busy - while the second
# level reads only num_chunks * 2 * C fp32 values (6 MiB at C=768, against ~400 MB for the first level at
# B=64, T=1024). A constant, not a device query: the split, and so the bits, depend on the row count only.
LN_BACKWARD_CHUNKS = 1024
# With the projection's bias summed along (a third accumulator a thread): run N's one-tile kernel was
# faster at 2048 chunks (0.132 against 0.146 ms a call), the three-tile kernel is at 1024 (0.120 against
# 0.126, run S).
LN_BACKWARD_PROJ_CHUNKS = 1024
# second level: a program sums [REDUCE_BLOCK_K chunks, REDUCE_BLOCK_C columns] tiles (48 programs at C=768)
REDUCE_BLOCK_K, REDUCE_BLOCK_C, REDUCE_WARPS = 512, 16, 8

# Candidates for the benchmark sweep (and the tests that check each of them), as launcher arguments.
# Forward names: r=rows w=num_warps p=programs_per_sm s=stages; for C=768 (BLOCK_C 1024) warps/rows = 4
# keeps 8 values per thread and the per-row reduction order of the default, other ratios change it
# (for layernorm_forward and fused_residual_forward alike: they stay bitwise equal at any one setting).
LN_FWD_SWEEP = {
    "r2 w8 p0 s1": dict(rows=2, num_warps=8, programs_per_sm=0, stages=1),
    "r4 w16 p0 s1": dict(rows=4, num_warps=16, programs_per_sm=0, stages=1),
    "r1 w4 p0 s1": dict(rows=1, num_warps=4, programs_per_sm=0, stages=1),
    "r4 w8 p0 s1": dict(rows=4, num_warps=8, programs_per_sm=0, stages=1),
    "r8 w16 p0 s1": dict(rows=8, num_warps=16, programs_per_sm=0, stages=1),
    "r2 w8 p4 s2": dict(rows=2, num_warps=8, programs_per_sm=4, stages=2),
    "r2 w8 p4 s3": dict(rows=2, num_warps=8, programs_per_sm=4, stages=3),
    "r1 w4 p8 s3": dict(rows=1, num_warps=4, programs_per_sm=8, stages=3),
    "r4 w16 p2 s2": dict(rows=4, num_warps=16, programs_per_sm=2, stages=2),
    # more bytes in flight an SM (the plain forward has one load a row where the fused one has two)
    "r1 w4 p8 s5": dict(rows=1, num_warps=4, programs_per_sm=8, stages=5),
    "r1 w4 p16 s3": dict(rows=1, num_warps=4, programs_per_sm=16, stages=3),
    "r2 w8 p8 s3": dict(rows=2, num_warps=8, programs_per_sm=8, stages=3),
    "r1 w4 p12 s4": dict(rows=1, num_warps=4, programs_per_sm=12, stages=4),
    # a warp a row (warps == rows): the row sums need no shared-memory round trip between warps
    "r4 w4 p8 s3": dict(rows=4, num_warps=4, programs_per_sm=8, stages=3),
    "r8 w8 p4 s3": dict(rows=8, num_warps=8, programs_per_sm=4, stages=3),
    "r4 w4 p0 s1": dict(rows=4, num_warps=4, programs_per_sm=0, stages=1),
    "r8 w4 p8 s2": dict(rows=8, num_warps=4, programs_per_sm=8, stages=2),
    # session 24: a row as three 256-wide tiles at C = 768 (pieces=3, no padding lanes)
    "r4 w4 p0 s1 pieces3": dict(rows=4, num_warps=4, programs_per_sm=0, stages=1, pieces=3),
    "r4 w4 p8 s3 pieces3": dict(rows=4, num_warps=4, programs_per_sm=8, stages=3, pieces=3),
    "r4 w4 p8 s2 pieces3": dict(rows=4, num_warps=4, programs_per_sm=8, stages=2, pieces=3),
    "r2 w2 p0 s1 pieces3": dict(rows=2, num_warps=2, programs_per_sm=0, stages=1, pieces=3),
    "r8 w8 p0 s1 pieces3": dict(rows=8, num_warps=8, programs_per_sm=0, stages=1, pieces=3),
    "r1 w1 p0 s1 pieces3": dict(rows=1, num_warps=1, programs_per_sm=0, stages=1, pieces=3),
}
# Backward names: r=rows per iteration w=num_warps k=chunks (the scratch's first dim) s=stages p3=pieces=3
# m=maxnreg.
LN_BWD_SWEEP = {
    "r1 w4 k1024 s1": dict(rows=1, num_warps=4, chunks=1024, stages=1),
    "r1 w4 k1024 s3": dict(rows=1, num_warps=4, chunks=1024, stages=3),
    "r2 w8 k1024 s1": dict(rows=2, num_warps=8, chunks=1024, stages=1),
    "r2 w8 k1024 s2": dict(rows=2, num_warps=8, chunks=1024, stages=2),
    "r1 w4 k2048 s2": dict(rows=1, num_warps=4, chunks=2048, stages=2),
    "r2 w8 k512 s3": dict(rows=2, num_warps=8, chunks=512, stages=3),
    "r4 w16 k512 s1": dict(rows=4, num_warps=16, chunks=512, stages=1),
    "r2 w4 k1024 s2": dict(rows=2, num_warps=4, chunks=1024, stages=2),
    "r1 w2 k1024 s3": dict(rows=1, num_warps=2, chunks=1024, stages=3),
    "r1 w2 k1024 s4": dict(rows=1, num_warps=2, chunks=1024, stages=4),
    "r1 w2 k2048 s3": dict(rows=1, num_warps=2, chunks=2048, stages=3),
    "r1 w4 k1024 s2": dict(rows=1, num_warps=4, chunks=1024, stages=2),
    # session 13: a warp a row (rows == warps, the row sums stay in the warp) and deeper pipelines
    "r2 w2 k2048 s3": dict(rows=2, num_warps=2, chunks=2048, stages=3),
    "r2 w2 k2048 s2": dict(rows=2, num_warps=2, chunks=2048, stages=2),
    "r1 w1 k4096 s3": dict(rows=1, num_warps=1, chunks=4096, stages=3),
    "r1 w1 k2048 s4": dict(rows=1, num_warps=1, chunks=2048, stages=4),
    "r4 w4 k2048 s2": dict(rows=4, num_warps=4, chunks=2048, stages=2),
    "r1 w2 k4096 s3": dict(rows=1, num_warps=2, chunks=4096, stages=3),
    "r1 w2 k2048 s4": dict(rows=1, num_warps=2, chunks=2048, stages=4),
    "r2 w4 k2048 s3": dict(rows=2, num_warps=4, chunks=2048, stages=3),
    # the row as three 256-wide tiles at C = 768 (pieces=3: no padding lanes, fewer registers), and
    # register caps (139 registers a thread at r1 w2 with the projection's sum: 6 programs an SM, ncu)
    "r1 w2 k2048 s3 p3": dict(rows=1, num_warps=2, chunks=2048, stages=3, pieces=3),
    "r2 w2 k2048 s3 p3": dict(rows=2, num_warps=2, chunks=2048, stages=3, pieces=3),
    "r2 w4 k2048 s3 p3": dict(rows=2, num_warps=4, chunks=2048, stages=3, pieces=3),
    "r1 w1 k2048 s4 p3": dict(rows=1, num_warps=1, chunks=2048, stages=4, pieces=3),
    "r1 w2 k1024 s3 p3": dict(rows=1, num_warps=2, chunks=1024, stages=3, pieces=3),
    "r1 w2 k2048 s3 p3 m96": dict(rows=1, num_warps=2, chunks=2048, stages=3, pieces=3, maxnreg=96),
    # session 22: with the row sums in one reduction (one exchange between a row's warps, not six)
    "r1 w4 k1024 s3 p3": dict(rows=1, num_warps=4, chunks=1024, stages=3, pieces=3),
    "r1 w2 k1024 s4 p3": dict(rows=1, num_warps=2, chunks=1024, stages=4, pieces=3),
    "r1 w2 k1056 s3 p3": dict(rows=1, num_warps=2, chunks=1056, stages=3, pieces=3),
    "r1 w2 k792 s3 p3": dict(rows=1, num_warps=2, chunks=792, stages=3, pieces=3),
    "r2 w4 k1024 s3 p3": dict(rows=2, num_warps=4, chunks=1024, stages=3, pieces=3),
    "r1 w1 k1024 s3 p3": dict(rows=1, num_warps=1, chunks=1024, stages=3, pieces=3),
    "r1 w2 k2048 s3 m104": dict(rows=1, num_warps=2, chunks=2048, stages=3, maxnreg=104),
    "r2 w4 k2048 s3 m96": dict(rows=2, num_warps=4, chunks=2048, stages=3, maxnreg=96),
}


# ----------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _store_bias_column(pad_ptrs, cols, row_ok, width, like, out_ptr):
    """The padding after each normed row (pad_ptrs: a [ROWS, BLOCK] tile of its addresses, the first `width`
    of each row written): 1 in its first column (fc's bias column), 0 in the rest."""
    ones = tl.where(cols == 0, 1.0, 0.0)
    tl.store(pad_ptrs, round_to(tl.zeros_like(like) + ones[None, :], out_ptr),
             mask=row_ok[:, None] & (cols < width)[None, :])


@triton.jit
def _normalize_rows(x, mask, rows, cols, row_ok, col_ok, out_ptr, out_stride, mean_ptr, rstd_ptr, w, b, C, eps,
                    BIAS_COLUMN: tl.constexpr):
    """x: a [ROWS, BLOCK_C] fp32 tile of rows (zero where masked); w, b: [BLOCK_C] fp32 weight and bias.
    Stores mean, rstd and the normed rows (out_stride apart); with BIAS_COLUMN, also 1 in column C and 0
    in the rest of the row's padding up to out_stride (at most BLOCK_C wide)."""
    mean = tl.sum(x, axis=1) / C
    # two-pass variance from the registers: masked lanes must not contribute (x - mean) there
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_rows, round_to(y, out_ptr), mask=mask)
    if BIAS_COLUMN:
        _store_bias_column(out_rows + C, cols, row_ok, out_stride - C, y, out_ptr)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _layernorm_forward_kernel(out_ptr, mean_ptr, rstd_ptr, inp_ptr, weight_ptr, bias_ptr, N, C, out_stride, eps,
                              BLOCK_C: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                              BIAS_COLUMN: tl.constexpr):
    """Row blocks pid, pid + num_programs, ...: one each unless the grid is persistent."""
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    # weight/bias are shared by every program: loaded once, kept in cache
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    for blk in tl.range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows = blk * ROWS + tl.arange(0, ROWS)
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        # the input is read exactly once here: stream it past the cache
        x = tl.load(inp_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        _normalize_rows(x, mask, rows, cols, row_ok, col_ok, out_ptr, out_stride, mean_ptr, rstd_ptr, w, b, C, eps,
                        BIAS_COLUMN)


@triton.jit
def _fused_residual_forward_kernel(residual_ptr, normed_ptr, mean_ptr, rstd_ptr, inp1_ptr, inp2_ptr,
                                   weight_ptr, bias_ptr, N, C, normed_stride, eps,
                                   BLOCK_C: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                                   BIAS_COLUMN: tl.constexpr):
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    bb = tl.load(bias_ptr + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    for blk in tl.range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows = blk * ROWS + tl.arange(0, ROWS)
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        a = tl.load(inp1_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b = tl.load(inp2_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r = round_to(a + b, residual_ptr)
        tl.store(residual_ptr + offs, r, mask=mask)
        # normalise what was stored (rounded to floatX), so the backward, which reads the stored residual,
        # sees the same numbers the forward normalised
        _normalize_rows(r.to(tl.float32), mask, rows, cols, row_ok, col_ok, normed_ptr, normed_stride, mean_ptr,
                        rstd_ptr, w, bb, C, eps, BIAS_COLUMN)


@triton.jit
def _normalize_rows3(xa, xb, xc, rows, cols, row_ok, mask, out_ptr, out_stride, mean_ptr, rstd_ptr,
                     wa, wb, wc, ba, bb, bc, eps, PIECE: tl.constexpr, BIAS_COLUMN: tl.constexpr):
    """_normalize_rows for a row held as three [ROWS, PIECE] tiles (C = 3 * PIECE, no padding lanes).
    With BIAS_COLUMN the row's padding (out_stride - C, at most PIECE) is 1 then 0s."""
    C: tl.constexpr = 3 * PIECE
    # the pieces added lane by lane, then one reduction a sum (not three)
    mean = tl.sum(xa + xb + xc, axis=1) / C
    ca = xa - mean[:, None]
    cb = xb - mean[:, None]
    cc = xc - mean[:, None]
    var = tl.sum(ca * ca + cb * cb + cc * cc, axis=1) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_rows, round_to(ca * rstd[:, None] * wa[None, :] + ba[None, :], out_ptr), mask=mask)
    tl.store(out_rows + PIECE, round_to(cb * rstd[:, None] * wb[None, :] + bb[None, :], out_ptr), mask=mask)
    tl.store(out_rows + 2 * PIECE, round_to(cc * rstd[:, None] * wc[None, :] + bc[None, :], out_ptr), mask=mask)
    if BIAS_COLUMN:
        _store_bias_column(out_rows + C, cols, row_ok, out_stride - C, xa, out_ptr)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _param_pieces(ptr, cols, PIECE: tl.constexpr):
    """A parameter of C = 3 * PIECE values as three fp32 pieces (shared by every program: kept in cache)."""
    a = tl.load(ptr + cols, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(ptr + PIECE + cols, eviction_policy="evict_last").to(tl.float32)
    c = tl.load(ptr + 2 * PIECE + cols, eviction_policy="evict_last").to(tl.float32)
    return a, b, c


@triton.jit
def _load_piece(ptr, offs, mask):
    """A [ROWS, PIECE] tile of rows read once (streamed past the cache), in fp32."""
    return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _store_residual_piece(residual_ptr, offs, mask, a, b):
    """A piece of the residual sum: stored rounded to floatX, returned as stored (fp32)."""
    r = round_to(a + b, residual_ptr)
    tl.store(residual_ptr + offs, r, mask=mask)
    return r.to(tl.float32)


@triton.jit
def _forward_pieces3_kernel(normed_ptr, mean_ptr, rstd_ptr, inp1_ptr, inp2_ptr, residual_ptr, weight_ptr, bias_ptr,
                            N, normed_stride, eps, PIECE: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                            BIAS_COLUMN: tl.constexpr, RESIDUAL: tl.constexpr):
    """_layernorm_forward_kernel (of inp1) or, with RESIDUAL, _fused_residual_forward_kernel (residual = inp1 +
    inp2, then its LayerNorm) for C = 3 * PIECE (PIECE a power of two: 768 = 3 x 256), each row as three
    PIECE-wide tiles: a next_pow2(C) tile spends a quarter of its lanes' arithmetic on padding at C = 768.
    The two agree bit for bit at the same ROWS and num_warps; their sums run in another order than the
    one-tile kernels' (other bits, equally deterministic)."""
    C: tl.constexpr = 3 * PIECE
    cols = tl.arange(0, PIECE)
    wa, wb, wc = _param_pieces(weight_ptr, cols, PIECE)
    ba, bb, bc = _param_pieces(bias_ptr, cols, PIECE)
    for blk in tl.range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows = blk * ROWS + tl.arange(0, ROWS)
        row_ok = rows < N
        mask = row_ok[:, None] & (cols < PIECE)[None, :]  # columns all valid: this gives the tile's shape
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        xa = _load_piece(inp1_ptr, offs, mask)
        xb = _load_piece(inp1_ptr, offs + PIECE, mask)
        xc = _load_piece(inp1_ptr, offs + 2 * PIECE, mask)
        if RESIDUAL:
            # every load before the first store: the compiler may not move a load past a store that could alias
            ya = _load_piece(inp2_ptr, offs, mask)
            yb = _load_piece(inp2_ptr, offs + PIECE, mask)
            yc = _load_piece(inp2_ptr, offs + 2 * PIECE, mask)
            xa = _store_residual_piece(residual_ptr, offs, mask, xa, ya)
            xb = _store_residual_piece(residual_ptr, offs + PIECE, mask, xb, yb)
            xc = _store_residual_piece(residual_ptr, offs + 2 * PIECE, mask, xc, yc)
        _normalize_rows3(xa, xb, xc, rows, cols, row_ok, mask, normed_ptr, normed_stride, mean_ptr, rstd_ptr,
                         wa, wb, wc, ba, bb, bc, eps, PIECE, BIAS_COLUMN)


@triton.jit
def _residual_forward_kernel(out_ptr, inp1_ptr, inp2_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(inp1_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b = tl.load(inp2_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + offs, round_to(a + b, out_ptr), mask=mask)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _ln_bwd_piece(dout_ptr, inp_ptr, offs, mask, w, mean, rstd):
    """A piece of a row tile (the LayerNorm backward's first loads): (dout, norm, dnorm) in fp32."""
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x = tl.load(inp_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    norm = (x - mean[:, None]) * rstd[:, None]
    return dout, norm, dout * w[None, :]


@triton.jit
def _ln_bwd_piece_update(dinp_ptr, offs, mask, dnorm, norm, dnorm_mean, dnorm_norm_mean, rstd):
    """dinp += a row tile's (or a piece's) input gradient; returns the updated values as stored (fp32)."""
    dval = (dnorm - dnorm_mean[:, None] - norm * dnorm_norm_mean[:, None]) * rstd[:, None]
    old = tl.load(dinp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    new = round_to(old + dval, dinp_ptr)
    tl.store(dinp_ptr + offs, new, mask=mask)
    return new.to(tl.float32)


@triton.jit
def _layernorm_backward_kernel(dinp_ptr, scratch_ptr, dout_ptr, inp_ptr, weight_ptr, mean_ptr, rstd_ptr,
                               N, C, rows_per_chunk, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                               STAGES: tl.constexpr, PROJ_BIAS: tl.constexpr):
    """One program per chunk of consecutive rows: dinp += for each row, the chunk's sums of dout * norm
    and of dout into scratch[chunk, 0, :] and scratch[chunk, 1, :], and with PROJ_BIAS the sums of the
    updated dinp as stored into scratch[chunk, 2, :]. An empty chunk writes zeros."""
    SLOTS: tl.constexpr = 3 if PROJ_BIAS else 2
    chunk = tl.program_id(0)
    start = chunk * rows_per_chunk
    end = tl.minimum(start + rows_per_chunk, N)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    # per-lane partial sums, reduced over the ROWS axis once at the end (not every iteration)
    dw_acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    pb_acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    for r0 in tl.range(start, end, ROWS, num_stages=STAGES):
        rows = r0 + tl.arange(0, ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x = tl.load(inp_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        # masked lanes have dout = 0 and w = 0, so they add nothing to the sums below
        norm = (x - mean[:, None]) * rstd[:, None]
        dnorm = dout * w[None, :]
        dnorm_mean = tl.sum(dnorm, axis=1) / C
        dnorm_norm_mean = tl.sum(dnorm * norm, axis=1) / C
        new = _ln_bwd_piece_update(dinp_ptr, offs, mask, dnorm, norm, dnorm_mean, dnorm_norm_mean, rstd)
        dw_acc += dout * norm
        db_acc += dout
        if PROJ_BIAS:  # the residual gradient as stored is the projection's output gradient
            pb_acc += new
    base = scratch_ptr + chunk.to(tl.int64) * SLOTS * C
    tl.store(base + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    tl.store(base + C + cols, tl.sum(db_acc, axis=0), mask=col_ok)
    if PROJ_BIAS:
        tl.store(base + 2 * C + cols, tl.sum(pb_acc, axis=0), mask=col_ok)


@triton.jit
def _layernorm_backward_pieces3_kernel(dinp_ptr, scratch_ptr, dout_ptr, inp_ptr, weight_ptr, mean_ptr, rstd_ptr,
                                       N, rows_per_chunk, PIECE: tl.constexpr, ROWS: tl.constexpr,
                                       STAGES: tl.constexpr, PROJ_BIAS: tl.constexpr):
    """_layernorm_backward_kernel for C = 3 * PIECE (PIECE a power of two, e.g. 768 = 3 x 256): each row
    as three PIECE-wide tiles, so no lane holds padding (a next_pow2(C) block wastes a quarter of its
    registers at C = 768, and registers bound this kernel's occupancy). Same outputs, same scratch layout;
    its sums run in another order than the one-block kernel's (other bits, equally deterministic)."""
    C: tl.constexpr = 3 * PIECE
    SLOTS: tl.constexpr = 3 if PROJ_BIAS else 2
    chunk = tl.program_id(0)
    start = chunk * rows_per_chunk
    end = tl.minimum(start + rows_per_chunk, N)
    cols = tl.arange(0, PIECE)
    wa = tl.load(weight_ptr + cols).to(tl.float32)
    wb = tl.load(weight_ptr + PIECE + cols).to(tl.float32)
    wc = tl.load(weight_ptr + 2 * PIECE + cols).to(tl.float32)
    dw_a = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    dw_b = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    dw_c = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    db_a = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    db_b = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    db_c = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    pb_a = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    pb_b = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    pb_c = tl.zeros([ROWS, PIECE], dtype=tl.float32)
    for r0 in tl.range(start, end, ROWS, num_stages=STAGES):
        rows = r0 + tl.arange(0, ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & (cols < PIECE)[None, :]  # columns all valid: this gives the tile's shape
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        dout_a, norm_a, dnorm_a = _ln_bwd_piece(dout_ptr, inp_ptr, offs, mask, wa, mean, rstd)
        dout_b, norm_b, dnorm_b = _ln_bwd_piece(dout_ptr, inp_ptr, offs + PIECE, mask, wb, mean, rstd)
        dout_c, norm_c, dnorm_c = _ln_bwd_piece(dout_ptr, inp_ptr, offs + 2 * PIECE, mask, wc, mean, rstd)
        # both row sums in one reduction over the pieces added lane by lane: one exchange between the
        # warps a row instead of six
        dnorm_sum, dnorm_norm_sum = tl.reduce((dnorm_a + dnorm_b + dnorm_c,
                                               dnorm_a * norm_a + dnorm_b * norm_b + dnorm_c * norm_c),
                                              1, _add_pairs)
        dnorm_mean = dnorm_sum / C
        dnorm_norm_mean = dnorm_norm_sum / C
        new_a = _ln_bwd_piece_update(dinp_ptr, offs, mask, dnorm_a, norm_a, dnorm_mean, dnorm_norm_mean, rstd)
        new_b = _ln_bwd_piece_update(dinp_ptr, offs + PIECE, mask, dnorm_b, norm_b, dnorm_mean, dnorm_norm_mean,
                                     rstd)
        new_c = _ln_bwd_piece_update(dinp_ptr, offs + 2 * PIECE, mask, dnorm_c, norm_c, dnorm_mean,
                                     dnorm_norm_mean, rstd)
        dw_a += dout_a * norm_a
        dw_b += dout_b * norm_b
        dw_c += dout_c * norm_c
        db_a += dout_a
        db_b += dout_b
        db_c += dout_c
        if PROJ_BIAS:
            pb_a += new_a
            pb_b += new_b
            pb_c += new_c
    base = scratch_ptr + chunk.to(tl.int64) * SLOTS * C
    tl.store(base + cols, tl.sum(dw_a, axis=0))
    tl.store(base + PIECE + cols, tl.sum(dw_b, axis=0))
    tl.store(base + 2 * PIECE + cols, tl.sum(dw_c, axis=0))
    tl.store(base + C + cols, tl.sum(db_a, axis=0))
    tl.store(base + C + PIECE + cols, tl.sum(db_b, axis=0))
    tl.store(base + C + 2 * PIECE + cols, tl.sum(db_c, axis=0))
    if PROJ_BIAS:
        tl.store(base + 2 * C + cols, tl.sum(pb_a, axis=0))
        tl.store(base + 2 * C + PIECE + cols, tl.sum(pb_b, axis=0))
        tl.store(base + 2 * C + 2 * PIECE + cols, tl.sum(pb_c, axis=0))


@triton.jit(do_not_specialize=["seed", "proj_seed"])  # a new seed every step must not mean a new compilation
def _layernorm_backward_reduce_kernel(dweight_ptr, dbias_ptr, dproj_bias_ptr, dproj_sum_ptr, scratch_ptr, num_chunks,
                                      C, seed, proj_seed, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                                      SEED_IN_MEMORY: tl.constexpr, STOCHASTIC: tl.constexpr,
                                      PROJ_BIAS: tl.constexpr, PROJ_SUM: tl.constexpr):
    """Sum scratch[:, 0|1, cols] over the chunks in a fixed order; dweight/dbias[cols] += the sums (and
    with PROJ_BIAS dproj_bias[cols] += the sum of scratch[:, 2, cols], rounded with proj_seed; with
    PROJ_SUM that sum also goes, in fp32, to dproj_sum[cols])."""
    SLOTS: tl.constexpr = 3 if PROJ_BIAS else 2
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ks = tl.arange(0, BLOCK_K)
    dw_acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    pb_acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    for k0 in range(0, num_chunks, BLOCK_K):
        k = k0 + ks
        mask = (k < num_chunks)[:, None] & col_ok[None, :]
        offs = k.to(tl.int64)[:, None] * SLOTS * C + cols[None, :]
        dw_acc += tl.load(scratch_ptr + offs, mask=mask, other=0.0)
        db_acc += tl.load(scratch_ptr + offs + C, mask=mask, other=0.0)
        if PROJ_BIAS:
            pb_acc += tl.load(scratch_ptr + offs + 2 * C, mask=mask, other=0.0)
    dw = tl.load(dweight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + tl.sum(dw_acc, axis=0)
    db = tl.load(dbias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + tl.sum(db_acc, axis=0)
    # a seed read from device memory lets a captured CUDA graph get a fresh seed every replay
    if SEED_IN_MEMORY:
        s = tl.load(seed)
        ps = tl.load(proj_seed)
    else:
        s = seed
        ps = proj_seed
    # distinct Philox counters for the two tensors; the projection's bias has its own seed and the
    # counters matmul_backward_bias's rounding gives it
    if STOCHASTIC:
        store_rounded(dweight_ptr + cols, dw, col_ok, s, cols, True)
        store_rounded(dbias_ptr + cols, db, col_ok, s, cols + C, True)
    else:
        tl.store(dweight_ptr + cols, round_to(dw, dweight_ptr), mask=col_ok)
        tl.store(dbias_ptr + cols, round_to(db, dbias_ptr), mask=col_ok)
    if PROJ_BIAS:
        pb_sum = tl.sum(pb_acc, axis=0)
        if PROJ_SUM:
            tl.store(dproj_sum_ptr + cols, pb_sum, mask=col_ok)
        pb = tl.load(dproj_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + pb_sum
        store_rounded(dproj_bias_ptr + cols, pb, col_ok, ps, cols, STOCHASTIC)


# ----------------------------------------------------------------------------------------------------
# launchers

_FLOATX = (torch.float32, torch.bfloat16)


def _row_tile(C: int, max_elems: int, max_rows: int, per_thread: int, rows=None, num_warps=None):
    """(BLOCK_C, ROWS, num_warps) for a row kernel (see FWD_TILE above); rows / num_warps given by the
    caller win."""
    block_c = triton.next_power_of_2(C)
    if rows is None:
        rows = max(1, min(max_rows, max_elems // block_c))
    assert rows >= 1 and rows & (rows - 1) == 0, f"rows must be a power of two, got {rows}"
    if num_warps is None:
        num_warps = max(1, min(16, rows * block_c // (32 * per_thread)))
    return block_c, rows, num_warps




@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: no query per launch); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _forward_grid(N: int, rows: int, programs_per_sm: int, device) -> int:
    """One program per row block, or at most programs_per_sm per SM looping over the blocks."""
    blocks = cdiv(N, rows)
    if programs_per_sm > 0:
        return max(1, min(blocks, programs_per_sm * _sm_count(torch.device(device))))
    return blocks


def _in_three_pieces(C: int, pieces: int) -> bool:
    """Whether a row kernel takes a row as three tiles: asked for (pieces=3) and C = 3 x a power of two of
    at least 16; else (pieces=1, or a C that does not split) as one next_pow2(C) tile."""
    assert pieces in (1, 3), f"pieces must be 1 or 3, got {pieces}"
    piece = C // 3
    return pieces == 3 and C % 3 == 0 and piece >= 16 and piece & (piece - 1) == 0


def _forward_in_pieces(C: int, out_stride: int, pieces: int | None) -> bool:
    """_in_three_pieces for the forwards (None: FWD_PIECES, read at the call), where a bias column's padding
    (out_stride - C) must also be no wider than a piece."""
    return _in_three_pieces(C, FWD_PIECES if pieces is None else pieces) and out_stride - C <= C // 3


def _check_rows(t: torch.Tensor, name: str, C: int, dtype=None):
    assert t.is_contiguous(), f"{name} must be contiguous"
    assert t.shape[-1] == C, f"{name}: last dim {t.shape[-1]}, expected C={C}"
    assert dtype is None or t.dtype == dtype, f"{name}: dtype {t.dtype}, expected {dtype}"


def _out_row_stride(out: torch.Tensor, C: int, dtype, bias_column: bool) -> int:
    """The normed output's row stride: C for a contiguous tensor; with bias_column, out is the first C
    columns of a wider row-major buffer (a view [..., :C]) whose next column the kernel sets to 1 and the
    rest of the row to 0 (kernels.matmul.weight_grad_bias_column reads the layer's bias gradient off it)."""
    assert out.shape[-1] == C and out.dtype == dtype, f"out: shape {tuple(out.shape)}, dtype {out.dtype}"
    if not bias_column:
        assert out.is_contiguous(), "out must be contiguous"
        return C
    stride = out.stride(-2) if out.dim() > 1 else C
    assert out.stride(-1) == 1 and C < stride <= 2 * C, f"out: a [..., :C] view of wider rows, strides {out.stride()}"
    assert all(out.stride(d) == out.stride(d + 1) * out.shape[d + 1] for d in range(out.dim() - 2)), \
        f"out: rows evenly spaced, strides {out.stride()}"
    return stride


def _check_stats(t: torch.Tensor, name: str, N: int):
    assert t.is_contiguous() and t.dtype == torch.float32, f"{name} must be contiguous fp32"
    assert t.numel() == N, f"{name}: {t.numel()} elements, expected one per row ({N})"


def _check_param(t: torch.Tensor, name: str, C: int):
    assert t.is_contiguous() and t.numel() == C, f"{name} must be contiguous with C={C} elements"
    assert t.dtype in _FLOATX, f"{name}: dtype {t.dtype}"


def layernorm_forward(out, mean, rstd, inp, weight, bias, eps: float = LAYERNORM_EPS, rows: int | None = None,
                      num_warps: int | None = None, programs_per_sm: int = FWD_PROGRAMS_PER_SM,
                      stages: int = FWD_STAGES, bias_column: bool = False, pieces: int | None = None):
    """out (..., C) = layernorm(inp) * weight + bias; mean, rstd (...) fp32 saved for the backward.
    bias_column: out is a [..., :C] view of wider rows, whose column C is set to 1 and the rest to 0.

    Tuning (defaults: the FWD_* constants): rows per program tile, num_warps, programs_per_sm (> 0: a
    persistent grid), stages (pipelining of the row-block loop), pieces (3: a row as three power-of-two
    tiles where C is 3 x a power of two, e.g. 768, so no lane holds padding; elsewhere, or where the bias
    column's padding is wider than a piece, 1: one next_pow2(C) tile; None: FWD_PIECES). rows, num_warps
    and pieces set the per-row reduction order; fused_residual_forward with the same values gives the
    same bits."""
    C = inp.shape[-1]
    N = inp.numel() // C
    assert inp.dtype in _FLOATX, f"inp: dtype {inp.dtype}"
    _check_rows(inp, "inp", C)
    out_stride = _out_row_stride(out, C, inp.dtype, bias_column)
    assert out.shape == inp.shape, f"out {tuple(out.shape)} vs inp {tuple(inp.shape)}"
    _check_stats(mean, "mean", N)
    _check_stats(rstd, "rstd", N)
    _check_param(weight, "weight", C)
    _check_param(bias, "bias", C)
    block_c, rows, num_warps = _row_tile(C, FWD_TILE, FWD_MAX_ROWS, FWD_PER_THREAD, rows, num_warps)
    grid = (_forward_grid(N, rows, programs_per_sm, inp.device),)
    if _forward_in_pieces(C, out_stride, pieces):
        # inp stands in for the unused second input and residual
        launch_pipelined(_forward_pieces3_kernel, grid, (out, mean, rstd, inp, inp, inp, weight, bias, N, out_stride,
                                                         eps),
                         stages, PIECE=C // 3, ROWS=rows, BIAS_COLUMN=bias_column, RESIDUAL=False,
                         num_warps=num_warps)
    else:
        launch_pipelined(_layernorm_forward_kernel, grid, (out, mean, rstd, inp, weight, bias, N, C, out_stride, eps),
                         stages, BLOCK_C=block_c, ROWS=rows, BIAS_COLUMN=bias_column, num_warps=num_warps)
    return out, mean, rstd


def residual_forward(out, inp1, inp2):
    """out = inp1 + inp2 (elementwise, fp32 sum rounded once to out's dtype)."""
    assert inp1.shape == inp2.shape == out.shape, "residual_forward: shapes differ"
    assert inp1.dtype == inp2.dtype == out.dtype and out.dtype in _FLOATX, "residual_forward: dtypes"
    assert out.is_contiguous() and inp1.is_contiguous() and inp2.is_contiguous(), "must be contiguous"
    numel = out.numel()
    _residual_forward_kernel[(cdiv(numel, RESIDUAL_BLOCK),)](out, inp1, inp2, numel, BLOCK=RESIDUAL_BLOCK, num_warps=4)
    return out


def fused_residual_forward(residual, normed, mean, rstd, inp1, inp2, weight, bias, eps: float = LAYERNORM_EPS,
                           rows: int | None = None, num_warps: int | None = None,
                           programs_per_sm: int = FUSED_PROGRAMS_PER_SM, stages: int = FUSED_STAGES,
                           bias_column: bool = False, pieces: int | None = None):
    """residual = inp1 + inp2 (rounded to floatX), then normed, mean, rstd = layernorm(residual) as stored;
    bias_column as in layernorm_forward (for normed).

    Equals residual_forward then layernorm_forward (with the same tuning arguments, see there) bit for
    bit, with one read of the residual fewer.
    """
    C = inp1.shape[-1]
    N = inp1.numel() // C
    assert inp1.dtype in _FLOATX, f"inp1: dtype {inp1.dtype}"
    for t, name in ((inp1, "inp1"), (inp2, "inp2"), (residual, "residual")):
        _check_rows(t, name, C, inp1.dtype)
        assert t.shape == inp1.shape, f"{name} {tuple(t.shape)} vs inp1 {tuple(inp1.shape)}"
    normed_stride = _out_row_stride(normed, C, inp1.dtype, bias_column)
    assert normed.shape == inp1.shape, f"normed {tuple(normed.shape)} vs inp1 {tuple(inp1.shape)}"
    _check_stats(mean, "mean", N)
    _check_stats(rstd, "rstd", N)
    _check_param(weight, "weight", C)
    _check_param(bias, "bias", C)
    block_c, rows, num_warps = _row_tile(C, FWD_TILE, FWD_MAX_ROWS, FWD_PER_THREAD, rows, num_warps)
    grid = (_forward_grid(N, rows, programs_per_sm, inp1.device),)
    if _forward_in_pieces(C, normed_stride, pieces):
        launch_pipelined(_forward_pieces3_kernel, grid,
                         (normed, mean, rstd, inp1, inp2, residual, weight, bias, N, normed_stride, eps),
                         stages, PIECE=C // 3, ROWS=rows, BIAS_COLUMN=bias_column, RESIDUAL=True, num_warps=num_warps)
    else:
        launch_pipelined(_fused_residual_forward_kernel, grid,
                         (residual, normed, mean, rstd, inp1, inp2, weight, bias, N, C, normed_stride, eps),
                         stages, BLOCK_C=block_c, ROWS=rows, BIAS_COLUMN=bias_column, num_warps=num_warps)
    return residual, normed, mean, rstd


def layernorm_backward_scratch_shape(num_rows: int, C: int, num_chunks: int | None = None,
                                     proj_bias: bool = False):
    """Shape of the fp32 scratch layernorm_backward needs for num_rows = B*T rows: (chunks, 2, C), or
    (chunks, 3, C) to also sum a projection's bias gradient (layernorm_backward's dproj_bias); chunks
    num_chunks, by default LN_BACKWARD_CHUNKS (LN_BACKWARD_PROJ_CHUNKS with proj_bias).

    One buffer serves every layer (each call overwrites it). Its first dim is the number of row chunks
    of the first reduction level; the gradients' bits depend on it, so keep it fixed for reproducibility.
    """
    if num_chunks is None:
        num_chunks = LN_BACKWARD_PROJ_CHUNKS if proj_bias else LN_BACKWARD_CHUNKS
    return (max(1, min(num_chunks, num_rows)), 3 if proj_bias else 2, C)


def layernorm_backward(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd,
                       seed: int | torch.Tensor = 0, stochastic: bool | None = None, rows: int | None = None,
                       num_warps: int | None = None, stages: int = BWD_STAGES, dproj_bias=None,
                       proj_seed: int | torch.Tensor = 0, dproj_sum=None, pieces: int | None = None,
                       maxnreg: int | None = None):
    """Accumulate the LayerNorm gradients: dinp += dL/dinp, dweight += sum(dout * norm), dbias += sum(dout).

    scratch: fp32 (num_chunks, 2, C), contiguous, any num_chunks >= 1 (see layernorm_backward_scratch_shape);
    its contents are overwritten. seed: an int, or a one-element int64/int32 device tensor read by the
    kernel (so a captured CUDA graph can be replayed with a fresh seed). stochastic: round dweight/dbias
    stochastically; by default when they are bf16 (only then allowed). dinp must not alias dout or inp.
    Tuning (defaults: the BWD_* constants): rows per iteration, num_warps, stages (pipelining of each
    chunk's row loop), pieces (3: a row as three power-of-two tiles where C is 3 x a power of two, e.g.
    768, so no lane holds padding; other C run as 1; None: BWD_PIECES_PROJ with dproj_bias, else
    BWD_PIECES), maxnreg (a register cap a thread, None: the compiler's); the number of chunks is
    scratch.shape[0].

    dproj_bias (C,), optional, with a (num_chunks, 3, C) scratch: the bias gradient of the projection
    whose output joined the residual stream just before this LayerNorm (attproj before ln2, fcproj
    before the next ln1 or lnf). The updated dinp is that projection's output gradient, so its column
    sums (of the values as stored) are added into dproj_bias in the same two levels, rounded as
    kernels.matmul's bias reduction rounds with proj_seed (same kind as seed): the pass over dinp that
    matmul_backward's bias reduction would make is saved. dproj_sum (C,) fp32, optional with dproj_bias:
    OVERWRITTEN with what this call adds to dproj_bias, before rounding (kernels.matmul.qkv_bias_backward
    takes the value bias's gradient from it).
    """
    C = inp.shape[-1]
    N = inp.numel() // C
    assert inp.dtype in _FLOATX, f"inp: dtype {inp.dtype}"
    for t, name in ((dinp, "dinp"), (dout, "dout"), (inp, "inp")):
        _check_rows(t, name, C, inp.dtype)
        assert t.shape == inp.shape, f"{name} {tuple(t.shape)} vs inp {tuple(inp.shape)}"
    _check_stats(mean, "mean", N)
    _check_stats(rstd, "rstd", N)
    _check_param(weight, "weight", C)
    _check_param(dweight, "dweight", C)
    _check_param(dbias, "dbias", C)
    assert dweight.dtype == dbias.dtype, "dweight and dbias must share a dtype"
    assert scratch.dtype == torch.float32 and scratch.is_contiguous(), "scratch must be contiguous fp32"
    proj = dproj_bias is not None
    slots = 3 if proj else 2
    assert scratch.dim() == 3 and scratch.shape[1:] == (slots, C), \
        f"scratch {tuple(scratch.shape)}: want (chunks, {slots}, {C})"
    assert dproj_sum is None or (proj and dproj_sum.shape == (C,) and dproj_sum.dtype == torch.float32
                                 and dproj_sum.is_contiguous()), "dproj_sum: fp32 (C,), with dproj_bias"
    if proj:
        _check_param(dproj_bias, "dproj_bias", C)
        assert dproj_bias.dtype == dweight.dtype, "dproj_bias and dweight must share a dtype"
        assert isinstance(proj_seed, torch.Tensor) == isinstance(seed, torch.Tensor), \
            "seed and proj_seed: both ints or both device tensors"
    if stochastic is None:
        stochastic = dweight.dtype == torch.bfloat16
    assert not stochastic or dweight.dtype == torch.bfloat16, "stochastic rounding is for bf16 gradients"
    seed_in_memory = isinstance(seed, torch.Tensor)
    if seed_in_memory:
        assert seed.numel() == 1 and seed.dtype in (torch.int32, torch.int64) and seed.device == inp.device, \
            "seed tensor: one int32/int64 on the kernels' device"

    num_chunks = scratch.shape[0]
    rows_per_chunk = cdiv(N, num_chunks)
    block_c, rows, num_warps = _row_tile(C, BWD_TILE, BWD_MAX_ROWS, BWD_PER_THREAD, rows, num_warps)
    if pieces is None:
        pieces = BWD_PIECES_PROJ if proj else BWD_PIECES
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    if _in_three_pieces(C, pieces):
        args = (dinp, scratch, dout, inp, weight, mean, rstd, N, rows_per_chunk)
        launch_pipelined(_layernorm_backward_pieces3_kernel, (num_chunks,), args, stages, PIECE=C // 3, ROWS=rows,
                         PROJ_BIAS=proj, num_warps=num_warps, **extra)
    else:
        args = (dinp, scratch, dout, inp, weight, mean, rstd, N, C, rows_per_chunk)
        launch_pipelined(_layernorm_backward_kernel, (num_chunks,), args, stages, BLOCK_C=block_c, ROWS=rows,
                         PROJ_BIAS=proj, num_warps=num_warps, **extra)
    _layernorm_backward_reduce_kernel[(cdiv(C, REDUCE_BLOCK_C),)](
        dweight, dbias, dproj_bias if proj else dbias, dproj_sum if dproj_sum is not None else scratch, scratch,
        num_chunks, C, seed, proj_seed if proj else seed,
        BLOCK_K=REDUCE_BLOCK_K, BLOCK_C=REDUCE_BLOCK_C, SEED_IN_MEMORY=seed_in_memory, STOCHASTIC=stochastic,
        PROJ_BIAS=proj, PROJ_SUM=dproj_sum is not None, num_warps=REDUCE_WARPS)
    return dinp, dweight, dbias
