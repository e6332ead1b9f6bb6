"""Token + position embedding forward, and its backward without atomics, as llm.c's llmc/encoder.cuh.

Forward: out[b, t] = wte[inp[b, t]] + wpe[t], a gather and an add over [ROWS, BLOCK_C] tiles (the x128
loads of llm.c become vectorised loads of contiguous column ranges), fp32 add, one store.

Backward, accumulating (dwte += ..., dwpe += ..., as gradient accumulation needs), bitwise reproducible:

- dwpe[t] += sum over b of dout[b, t] (`wpe_backward`): one program per [ROWS_T, BLOCK_C] tile of
  positions, summing the batch in order, UNROLL batches loaded per iteration so loads overlap.
- dwte (`wte_backward`): llm.c sorts the positions into buckets by token id on the CPU and gives each
  bucket a block. Here the sort runs on the device (torch.sort, stable, into preallocated outputs), so
  there is no host sync and the step can be captured in a CUDA graph (torch.sort's temporary storage
  comes from the caching allocator, which capture supports). Then a FIXED grid, whatever the ids:
  * kernel 1, one program per (chunk of CHUNK sorted positions, block of BLOCK_C channels): walks its
    chunk in tiles of TILE positions. A tile's TILE dout rows are gathered at once (their addresses -
    the permutation - are known ahead, so the loads are all in flight together, and tl.range pipelines
    the next tile's loads behind this one's arithmetic), then a segmented inclusive scan over the
    tile's rows (an associative scan keyed by the sorted id) gives, at every row, the sum of its run so
    far; a run open at the end of a tile carries into the next tile of the chunk. At the row where a
    run ends, a run that started in this chunk is finished: dwte[id] = dwte[id] + sum, the row read and
    written once. A run that crosses a chunk boundary leaves fp32 partial sums in a small scratch of two
    slots per chunk: slot 0 for the chunk's first run when it began in an earlier chunk (its part in
    this chunk), slot 1 for the chunk's last run when it began here and goes on past the end.
  * kernel 2 (the fix-up), one program per (chunk, column block), most of which exit at once: the owner
    of a run that crossed its chunk's end adds slot 1 and the slot-0 partials of the following chunks
    the run covers, in chunk order, plus the old dwte row, and writes the row once.
  Every output row is written by one program with a fixed order of additions (fixed by the ids, the
  chunk/tile sizes and num_warps: the scan's combine tree follows the register layout): no atomics, the
  same bits run after run. Runs of any length cost the same per row: a token filling the whole batch is
  N / CHUNK partials summed by the fix-up.

bf16 gradients are written with stochastic rounding keyed by (seed, element index in the [wte; wpe]
concatenation, as in llm.c's flat parameter buffer), fp32 ones with a plain store. The random bits of
dwte come from a cheap integer hash (sr_hash, default; llm.c also rounds with a cheap hash) or from
Philox as common.store_rounded: the chunk kernel rounds every gathered element, finished row or not, and
Philox's ~50 integer operations per element would make it compute-bound. dwpe uses Philox.

The sort depends only on the ids, so a caller can run it early in the step, off the backward's critical
path (encoder_backward_sort), and pass sort=False.

The seed may be a Python int or a 1-element int64 device tensor (read inside the kernel, so a captured
graph picks up a fresh seed written into it each step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import cdiv, interpreting, register_cap, store_rounded, launch_pipelined

# ---- dwte: tuning knobs, launcher defaults (bench/kernels/bench_encoder.py sweeps WTE_SWEEP below: piece,
# tile, channels, warps and stages are its best at C=768 on an H200, 2026-12-01, bench/RESULTS.md "Second
# kernel run"; the fix-up's ENC_COMBINE_* tiles are not swept)
# sorted positions per program of kernel 1 (the name is kept from the earlier piece-wise scheme: the
# model sizes the encoder's partial-sum scratch as 2 * cdiv(B*T, ENC_PIECE) rows of C fp32)
ENC_PIECE = 64
# positions gathered and scanned at once (a power of two): few rows and one warp keep the scan inside a
# warp (registers and shuffles, no shared memory) and let many small programs share an SM
ENC_TILE = 4  # H200 sweep 2026-12-01: c64 t4 b256 w1 s3 0.121 ms, against 0.172 ms for t8 b128
ENC_BLOCK_C = 256   # channels per program (a power of two)
ENC_WARPS = 1
# software-pipelining depth of the tile loop (1: none). The gather is two loads deep (permutation, then
# the rows), and the next tiles' loads wait in shared memory, not registers, while this one is summed.
ENC_STAGES = 3
# stochastic rounding of dwte: a cheap integer hash (True, as llm.c rounds with a cheap hash) or Philox
# as common.store_rounded (False). It runs on every gathered element (masked rows included): ~50 integer
# operations each with Philox, ~10 with the hash, against ~20 for everything else the kernel does.
ENC_SR_HASH = True
ENC_MAXNREG = None  # register cap per thread for kernel 1 (None: ptxas decides)
# the fix-up adds this many slot-0 partials per iteration, over this many channels per program
ENC_COMBINE_TILE = 32
ENC_COMBINE_BLOCK_C = 256

# ---- dwpe (the bits do not depend on these)
ENC_WPE_ROWS = 8        # positions per program
ENC_WPE_BLOCK_C = 256   # channels per program
ENC_WPE_UNROLL = 4      # batches loaded per iteration
ENC_WPE_WARPS = 4
ENC_WPE_STAGES = 1

# Candidates for the benchmark sweep (and the GPU test that checks each of them): keyword arguments of
# wte_backward and of wpe_backward. Names: c=piece t=tile b=block_c w=warps s=stages (+philox rounding, r=maxnreg).
WTE_SWEEP = {
    "c64 t8 b128 w1 s3": dict(piece=64, tile=8, block_c=128, num_warps=1, stages=3),
    "c64 t8 b128 w1 s3 philox": dict(piece=64, tile=8, block_c=128, num_warps=1, stages=3, sr_hash=False),
    "c64 t8 b128 w1 s3 r128": dict(piece=64, tile=8, block_c=128, num_warps=1, stages=3, maxnreg=128),
    "c64 t8 b128 w1 s1": dict(piece=64, tile=8, block_c=128, num_warps=1, stages=1),
    "c64 t4 b256 w1 s3": dict(piece=64, tile=4, block_c=256, num_warps=1, stages=3),
    "c64 t16 b64 w1 s3": dict(piece=64, tile=16, block_c=64, num_warps=1, stages=3),
    "c256 t8 b128 w1 s4": dict(piece=256, tile=8, block_c=128, num_warps=1, stages=4),
    "c64 t16 b128 w2 s3": dict(piece=64, tile=16, block_c=128, num_warps=2, stages=3),
    "c128 t8 b256 w2 s3": dict(piece=128, tile=8, block_c=256, num_warps=2, stages=3),
    "c16 t16 b256 w4 s1": dict(piece=16, tile=16, block_c=256, num_warps=4, stages=1),
    "c32 t32 b256 w8 s1": dict(piece=32, tile=32, block_c=256, num_warps=8, stages=1),
    "c32 t32 b256 w8 s1 philox": dict(piece=32, tile=32, block_c=256, num_warps=8, stages=1, sr_hash=False),
}
WPE_SWEEP = {
    "r8 b256 u4 w4 s1": dict(rows=8, block_c=256, unroll=4, num_warps=4, stages=1),
    "r4 b256 u8 w4 s1": dict(rows=4, block_c=256, unroll=8, num_warps=4, stages=1),
    "r2 b256 u8 w2 s1": dict(rows=2, block_c=256, unroll=8, num_warps=2, stages=1),
    "r8 b128 u8 w4 s1": dict(rows=8, block_c=128, unroll=8, num_warps=4, stages=1),
    "r16 b256 u4 w8 s1": dict(rows=16, block_c=256, unroll=4, num_warps=8, stages=1),
    "r8 b256 u4 w4 s3": dict(rows=8, block_c=256, unroll=4, num_warps=4, stages=3),
    "r4 b256 u4 w4 s3": dict(rows=4, block_c=256, unroll=4, num_warps=4, stages=3),
    "r32 b256 u2 w8 s1": dict(rows=32, block_c=256, unroll=2, num_warps=8, stages=1),
}

# Triton's interpreter runs an associative scan one element at a time in Python: there the segmented
# sums are taken as a masked [TILE, TILE, BLOCK_C] reduction instead (same sums, another order; the
# tests run both forms on small tiles).
ENC_SCAN = not interpreting()


# ----------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _load_seed(seed, SEED_IS_PTR: tl.constexpr):
    if SEED_IS_PTR:
        return tl.load(seed)
    else:
        return seed


@triton.jit
def _hash_round_bf16(x, seed, offsets):
    """fp32 -> bf16 stochastic rounding as stochastic_round_bf16 in common, with the 16 random bits from a
    cheap integer hash of (seed, offset) instead of Philox: a multiply-xorshift finalizer, ~10 integer
    operations per element against Philox's ~50 (in dwte the rounding runs on every gathered element)."""
    s = seed.to(tl.uint32) * 0x85EBCA77 + 0x3C6EF372
    h = offsets.to(tl.uint32) * 0x9E3779B1 + s
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (h & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, x).to(tl.bfloat16)


@triton.jit
def _store_grad(ptr, x, mask, seed, offsets, STOCHASTIC: tl.constexpr, SR_HASH: tl.constexpr):
    """Store an fp32 gradient into ptr's dtype: stochastic rounding (Philox, common.store_rounded, or the
    cheap hash above) for bf16 when asked, else round to nearest."""
    if STOCHASTIC and SR_HASH:
        tl.store(ptr, _hash_round_bf16(x, seed, offsets), mask=mask)
    else:
        store_rounded(ptr, x, mask, seed, offsets, STOCHASTIC)


@triton.jit
def _encoder_forward_kernel(out_ptr, inp_ptr, wte_ptr, wpe_ptr, N, T, C,
                            ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < N
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    tok = tl.load(inp_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    t = (rows % T).to(tl.int64)
    # wpe rows are shared by every batch element: keep them in cache
    w = tl.load(wte_ptr + tok[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(wpe_ptr + t[:, None] * C + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_last").to(tl.float32)
    out_offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    tl.store(out_ptr + out_offs, (w + p).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])  # a new seed every step must not mean a new compilation
def _wpe_backward_kernel(dwpe_ptr, dout_ptr, seed, B, T, C, stride_b, wte_numel,
                         ROWS_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
                         STAGES: tl.constexpr, STOCHASTIC: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    t = tl.program_id(0) * ROWS_T + tl.arange(0, ROWS_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t < T)[:, None] & (cols < C)[None, :]
    offs = t.to(tl.int64)[:, None] * C + cols[None, :]
    acc = tl.zeros([ROWS_T, BLOCK_C], dtype=tl.float32)
    for b0 in tl.range(0, B, UNROLL, num_stages=STAGES):
        # UNROLL independent loads per iteration, then added in batch order: sum over b in order
        for k in tl.static_range(UNROLL):
            b = b0 + k
            # b < B tested as row b*T + t < B*T: a full-shaped mask (the interpreter mis-types
            # a scalar condition and-ed into a tensor mask)
            bt = b * T + t
            x = tl.load(dout_ptr + b.to(tl.int64) * stride_b + offs, mask=(bt < B * T)[:, None] & mask,
                        other=0.0, eviction_policy="evict_first")
            acc += x.to(tl.float32)
    old = tl.load(dwpe_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _load_seed(seed, SEED_IS_PTR)
    # wpe follows wte in the flat parameter buffer: distinct random streams for the two
    store_rounded(dwpe_ptr + offs, old + acc, mask, s, wte_numel + offs, STOCHASTIC)


@triton.jit
def _segment_add(x_a, id_a, x_b, id_b):
    """Combine of the segmented scan: (a) precedes (b), each the sum of the rows of its last run.
    The ids are sorted, so id_b == id_a means every row of (b) continues (a)'s last run."""
    return tl.where(id_a == id_b, x_a + x_b, x_b), id_b


@triton.jit
def _run_sums(x, ids, TILE: tl.constexpr, SCAN: tl.constexpr):
    """Row i of the result: the sum of rows k <= i of x with ids[k] == ids[i] (x: [TILE, BLOCK_C] fp32,
    ids: [TILE] sorted, so those rows are the run of row i up to i)."""
    if SCAN:
        idb = tl.broadcast_to(ids[:, None], x.shape)
        run, _ = tl.associative_scan((x, idb), 0, _segment_add)
    else:
        r = tl.arange(0, TILE)
        same = (ids[:, None] == ids[None, :]) & (r[None, :] <= r[:, None])  # [i, k]
        run = tl.sum(tl.where(same[:, :, None], x[None, :, :], 0.0), axis=1)
    return run


@triton.jit(do_not_specialize=["seed"])
def _wte_backward_chunks_kernel(dwte_ptr, partial_ptr, dout_ptr, sorted_ptr, perm_ptr, seed, N, C,
                                CHUNK: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
                                STAGES: tl.constexpr, SCAN: tl.constexpr,
                                STOCHASTIC: tl.constexpr, SR_HASH: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, N)
    # the id of a run that began before this chunk (-3: none; no tile row is ever -3 or the pad id -1)
    cont_id = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-3).to(tl.int32)
    s = _load_seed(seed, SEED_IS_PTR)
    ar = tl.arange(0, TILE)
    # the run open at the end of the previous tile of this chunk: its id and its sum so far
    carry = tl.zeros([BLOCK_C], dtype=tl.float32)
    carry_id = cont_id * 0 - 2
    for t0 in tl.range(start, end, TILE, num_stages=STAGES):
        js = t0 + ar
        ok = js < end
        ids = tl.load(sorted_ptr + js, mask=ok, other=-1).to(tl.int32)
        nxt = tl.load(sorted_ptr + js + 1, mask=js + 1 < N, other=-1).to(tl.int32)
        # 32-bit element offsets (the launcher checks every buffer has < 2^31 elements): fewer registers
        src = tl.load(perm_ptr + js, mask=ok, other=0).to(tl.int32)
        m2 = ok[:, None] & col_ok[None, :]
        x = tl.load(dout_ptr + (src[:, None] * C + cols[None, :]), mask=m2, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        run = _run_sums(x, ids, TILE, SCAN)
        # the tile's first run may continue one from the previous tile (ids sorted: only its rows match)
        run += tl.where((ids == carry_id)[:, None], carry[None, :], 0.0)

        is_end = ids != nxt          # the run ends at this row (nxt is -1 past the last position)
        cont = ids == cont_id        # the chunk's first run, begun in an earlier chunk
        at_last = js == end - 1      # the chunk's last position
        # a run begun in this chunk and ending in it: finish the dwte row
        fin = ok & is_end & (ids != cont_id)
        rows = ids[:, None] * C + cols[None, :]
        mf = fin[:, None] & col_ok[None, :]
        old = tl.load(dwte_ptr + rows, mask=mf, other=0.0).to(tl.float32)
        _store_grad(dwte_ptr + rows, old + run, mf, s, rows, STOCHASTIC, SR_HASH)
        # partials: the continued run where it ends (or at the chunk's end) -> slot 0; a run begun here
        # still open at the chunk's end -> slot 1
        part = ok & ((cont & is_end) | (at_last & (nxt == ids)))
        slot = 2 * chunk + tl.where(cont, 0, 1)
        tl.store(partial_ptr + (slot[:, None] * C + cols[None, :]), run,
                 mask=part[:, None] & col_ok[None, :])
        if CHUNK > TILE:
            last = js == tl.minimum(t0 + TILE, end) - 1
            carry = tl.sum(tl.where(last[:, None], run, 0.0), axis=0)
            carry_id = tl.sum(tl.where(last, ids, 0), axis=0)


@triton.jit(do_not_specialize=["seed"])
def _wte_backward_fixup_kernel(dwte_ptr, partial_ptr, sorted_ptr, seed, N, C,
                               CHUNK: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
                               STOCHASTIC: tl.constexpr, SR_HASH: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    first = blk * CHUNK
    end = (blk + 1) * CHUNK
    tok = tl.load(sorted_ptr + tl.minimum(N, end) - 1)  # the run holding the chunk's last position
    before = tl.load(sorted_ptr + first - 1, mask=blk > 0, other=-1)
    after = tl.load(sorted_ptr + end, mask=end < N, other=-1)
    # that run started inside this chunk and goes on past its end: this program owns it
    if (before != tok) & (after == tok):
        acc = tl.zeros([TILE, BLOCK_C], dtype=tl.float32)
        b = blk + 1
        more = b * CHUNK < N
        while more:
            bs = b + tl.arange(0, TILE)
            pos = bs * CHUNK
            ids = tl.load(sorted_ptr + pos, mask=pos < N, other=-1)
            ok = (pos < N) & (ids == tok)  # chunk bs holds a continuation of the run in slot 0
            x = tl.load(partial_ptr + (2 * bs).to(tl.int64)[:, None] * C + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0.0)
            acc += x
            b += TILE
            more = (tl.sum(ok.to(tl.int32), axis=0) == TILE) & (b * CHUNK < N)
        head = tl.load(partial_ptr + (2 * blk + 1).to(tl.int64) * C + cols, mask=col_ok, other=0.0)
        total = head + tl.sum(acc, axis=0)
        row = tok.to(tl.int32) * C + cols
        old = tl.load(dwte_ptr + row, mask=col_ok, other=0.0).to(tl.float32)
        _store_grad(dwte_ptr + row, old + total, col_ok, _load_seed(seed, SEED_IS_PTR), row, STOCHASTIC, SR_HASH)


# ----------------------------------------------------------------------------------------------------
# launchers

def _tiles(C: int, elems: int = 2048):
    """(ROWS, BLOCK_C) for a [ROWS, BLOCK_C] tile of about `elems` elements over rows of C channels."""
    block_c = min(triton.next_power_of_2(C), 256)
    return max(1, elems // block_c), block_c


def _seed_args(seed):
    if isinstance(seed, torch.Tensor):
        assert seed.numel() == 1 and seed.dtype in (torch.int32, torch.int64), "seed: a 1-element int tensor"
        return seed, True
    return int(seed), False


def _pow2(x: int, name: str) -> int:
    assert x >= 1 and x & (x - 1) == 0, f"{name} must be a power of two, got {x}"
    return x



def encoder_forward(out: torch.Tensor, inp: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor):
    """out (B, T, C) = wte[inp] + wpe[:T]; inp (B, T) int32/int64 ids, wte (Vp, C), wpe (maxT, C). Returns out."""
    B, T = inp.shape
    C = wte.shape[1]
    assert out.shape == (B, T, C) and wpe.shape[1] == C and wpe.shape[0] >= T
    assert out.dtype == wte.dtype == wpe.dtype and out.dtype in (torch.float32, torch.bfloat16)
    assert inp.dtype in (torch.int32, torch.int64)
    assert all(x.is_contiguous() for x in (out, inp, wte, wpe))
    N = B * T
    rows, block_c = _tiles(C)
    _encoder_forward_kernel[(cdiv(N, rows), cdiv(C, block_c))](out, inp, wte, wpe, N, T, C,
                                                                ROWS=rows, BLOCK_C=block_c, num_warps=4)
    return out


@dataclass
class EncoderBackwardScratch:
    """Preallocated work buffers of encoder_backward (so a captured step allocates nothing)."""
    sorted_ids: torch.Tensor  # (B*T,) the ids sorted, dtype of inp
    perm: torch.Tensor        # (B*T,) int64: position of each sorted id
    partial: torch.Tensor     # (>= 2 * cdiv(B*T, piece), C) fp32: partial sums of runs crossing chunks


def encoder_backward_scratch(B: int, T: int, C: int, device, ids_dtype=torch.int32,
                             piece: int = ENC_PIECE) -> EncoderBackwardScratch:
    N = B * T
    return EncoderBackwardScratch(
        sorted_ids=torch.empty(N, dtype=ids_dtype, device=device),
        perm=torch.empty(N, dtype=torch.int64, device=device),
        partial=torch.empty(2 * cdiv(N, piece), C, dtype=torch.float32, device=device),
    )


def wpe_backward(dwpe: torch.Tensor, dout: torch.Tensor, seed, wte_numel: int, stochastic: bool = True,
                 rows: int = ENC_WPE_ROWS, block_c: int = ENC_WPE_BLOCK_C, unroll: int = ENC_WPE_UNROLL,
                 num_warps: int = ENC_WPE_WARPS, stages: int = ENC_WPE_STAGES):
    """dwpe (maxT, C)[:T] += dout (B, T, C) summed over B, in batch order. wte_numel: where wpe starts in the
    flat [wte; wpe] parameter buffer (its stochastic-rounding counters follow wte's). rows (positions),
    block_c (channels; both powers of two), unroll (batches loaded per iteration), num_warps, stages
    (pipelining of the batch loop): tuning only, the bits do not depend on them. Returns dwpe."""
    B, T, C = dout.shape
    assert dwpe.shape[1] == C and dwpe.shape[0] >= T and dwpe.dtype == dout.dtype
    assert dout.dtype in (torch.float32, torch.bfloat16) and dwpe.is_contiguous() and dout.is_contiguous()
    assert unroll >= 1
    seed_arg, seed_is_ptr = _seed_args(seed)
    sr = stochastic and dout.dtype == torch.bfloat16
    rows = _pow2(rows, "rows")
    block_c = min(_pow2(block_c, "block_c"), triton.next_power_of_2(C))
    launch_pipelined(_wpe_backward_kernel, (cdiv(T, rows), cdiv(C, block_c)),
            (dwpe, dout, seed_arg, B, T, C, T * C, wte_numel), stages, ROWS_T=rows, BLOCK_C=block_c, UNROLL=unroll,
            STOCHASTIC=sr, SEED_IS_PTR=seed_is_ptr, num_warps=num_warps)
    return dwpe


def encoder_backward_sort(inp: torch.Tensor, scratch: EncoderBackwardScratch):
    """Sort the ids into scratch (sorted_ids, perm) on the device: torch.sort, stable, so equal ids keep
    their position order and every run is summed in the same order every time. The ids are known from the
    start of the step, so a caller may sort early (off the backward's critical path) and pass sort=False
    to encoder_backward."""
    N = inp.numel()
    assert scratch.sorted_ids.shape == (N,) and scratch.sorted_ids.dtype == inp.dtype
    assert scratch.perm.shape == (N,) and scratch.perm.dtype == torch.int64
    torch.sort(inp.reshape(-1), stable=True, out=(scratch.sorted_ids, scratch.perm))


def wte_backward(dwte: torch.Tensor, dout: torch.Tensor, inp: torch.Tensor, seed,
                 scratch: EncoderBackwardScratch, stochastic: bool = True, piece: int = ENC_PIECE,
                 tile: int = ENC_TILE, block_c: int = ENC_BLOCK_C, num_warps: int = ENC_WARPS,
                 stages: int = ENC_STAGES, sr_hash: bool = ENC_SR_HASH, maxnreg: int | None = ENC_MAXNREG,
                 scan: bool | None = None, sort: bool = True):
    """dwte (Vp, C) += scatter of dout (B, T, C) by the ids inp (B, T): the device sort, then the chunk
    kernel and the fix-up (module docstring).

    piece: sorted positions per program (any >= 1; scratch.partial needs 2 * cdiv(B*T, piece) rows);
    tile: positions gathered and scanned at once; block_c: channels per program (both powers of two);
    num_warps; stages: pipelining depth of the tile loop; sr_hash: stochastic rounding with the cheap hash
    instead of Philox; maxnreg: register cap per thread (None: the compiler's choice); scan: segmented
    sums by associative scan (default on the GPU) or by a masked reduction (default in the interpreter);
    sort=False: scratch already holds inp sorted by encoder_backward_sort. The bits depend on piece, tile,
    block_c, num_warps, sr_hash and scan (orders of additions, random bits), not on timing. Returns dwte.
    """
    B, T, C = dout.shape
    N = B * T
    assert inp.shape == (B, T) and inp.dtype in (torch.int32, torch.int64)
    assert dwte.shape[1] == C and dwte.dtype == dout.dtype and dout.dtype in (torch.float32, torch.bfloat16)
    assert dwte.is_contiguous() and dout.is_contiguous() and inp.is_contiguous()
    assert piece >= 1
    assert scratch.sorted_ids.shape == (N,) and scratch.sorted_ids.dtype == inp.dtype
    assert scratch.perm.shape == (N,) and scratch.perm.dtype == torch.int64
    # the kernels read both as contiguous rows (torch.sort would fill strided ones faithfully)
    assert scratch.sorted_ids.is_contiguous() and scratch.perm.is_contiguous(), "scratch: contiguous sort buffers"
    assert scratch.partial.dtype == torch.float32 and scratch.partial.is_contiguous()
    assert scratch.partial.shape[1] == C and scratch.partial.shape[0] >= 2 * cdiv(N, piece), \
        f"scratch.partial {tuple(scratch.partial.shape)}: need >= {2 * cdiv(N, piece)} rows for piece={piece}"
    # the kernels index with 32-bit element offsets
    assert max(dwte.numel(), dout.numel(), 2 * cdiv(N, piece) * C) < 2 ** 31, "tensors too large for int32 offsets"
    seed_arg, seed_is_ptr = _seed_args(seed)
    sr = stochastic and dout.dtype == torch.bfloat16
    tile = _pow2(tile, "tile")
    block_c = min(_pow2(block_c, "block_c"), triton.next_power_of_2(C))
    fix_c = min(ENC_COMBINE_BLOCK_C, triton.next_power_of_2(C))
    scan = ENC_SCAN if scan is None else scan

    if sort:
        encoder_backward_sort(inp, scratch)
    n_chunks = cdiv(N, piece)
    launch_pipelined(_wte_backward_chunks_kernel, (n_chunks, cdiv(C, block_c)),
            (dwte, scratch.partial, dout, scratch.sorted_ids, scratch.perm, seed_arg, N, C), stages,
            CHUNK=piece, TILE=tile, BLOCK_C=block_c, SCAN=scan, STOCHASTIC=sr, SR_HASH=sr_hash,
            SEED_IS_PTR=seed_is_ptr, num_warps=num_warps, **register_cap(maxnreg))
    _wte_backward_fixup_kernel[(n_chunks, cdiv(C, fix_c))](
        dwte, scratch.partial, scratch.sorted_ids, seed_arg, N, C,
        CHUNK=piece, TILE=ENC_COMBINE_TILE, BLOCK_C=fix_c, STOCHASTIC=sr, SR_HASH=sr_hash,
        SEED_IS_PTR=seed_is_ptr, num_warps=4)
    return dwte


def encoder_backward(dwte: torch.Tensor, dwpe: torch.Tensor, dout: torch.Tensor, inp: torch.Tensor, seed,
                     scratch: EncoderBackwardScratch | None = None, stochastic: bool = True,
                     piece: int = ENC_PIECE, wpe_config: dict | None = None, **wte_config):
    """dwte (Vp, C) += scatter of dout (B, T, C) by the ids inp (B, T); dwpe (maxT, C)[:T] += dout summed over B.

    Deterministic and atomic-free (see the module docstring). seed: int or 1-element int64 device tensor
    for the stochastic rounding of bf16 gradients (stochastic=False: round to nearest). scratch: from
    encoder_backward_scratch (allocated here when None, which a captured step must avoid); its partial
    buffer must have room for `piece`. The sort is torch.sort on the device: no host sync. piece: sorted
    positions per program of the dwte kernel (the tests make it small to reach the chunk-crossing paths
    on tiny inputs); wte_config: tile, block_c, num_warps, stages, sr_hash, maxnreg, scan, sort of
    wte_backward (sort=False: the caller ran encoder_backward_sort on these ids earlier in the step);
    wpe_config: keyword arguments of wpe_backward. Returns (dwte, dwpe).
    """
    B, T, C = dout.shape
    assert inp.shape == (B, T) and inp.dtype in (torch.int32, torch.int64)
    assert dwte.shape[1] == C and dwpe.shape[1] == C and dwpe.shape[0] >= T
    assert dwte.dtype == dwpe.dtype == dout.dtype and dout.dtype in (torch.float32, torch.bfloat16)
    assert all(x.is_contiguous() for x in (dwte, dwpe, dout, inp))
    if scratch is None:
        scratch = encoder_backward_scratch(B, T, C, dout.device, inp.dtype, piece)
    wpe_backward(dwpe, dout, seed, dwte.numel(), stochastic, **(wpe_config or {}))
    wte_backward(dwte, dout, inp, seed, scratch, stochastic, piece, **wte_config)
    return dwte, dwpe
