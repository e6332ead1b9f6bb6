"""Linear layers (llm.c's matmul.cuh): GEMMs through cuBLAS(Lt) via torch, the epilogues llm.c gets from
cuBLASLt, and the deterministic bias-gradient reduction.

Weights are (OC, C) as in llm.c: out = inp @ weight.T + bias.

- Plain GEMMs are torch.addmm / torch.mm with `out=`: addmm with a 1-D bias goes to cuBLASLt's BIAS
  epilogue, so the bias costs no extra pass. The weight gradient accumulates with beta = 1 in the same
  GEMM (`dweight.addmm_(dout.T, inp)`: cuBLAS reads C and adds, no temporary, no copy). With
  use_cublaslt, the products of TUNED_ALGOS go to kernels/cublaslt.py with a tuned algorithm instead.
- GELU_AUX_BIAS (fc forward, `gelu_epilogue=True`) and DGELU: with use_cublaslt (the default on CUDA),
  cuBLASLt's own epilogues through kernels/cublaslt.py, as llm.c. Without it: torch has no GEMM that
  writes both the pre-activation and the activation (`_addmm_activation` writes only the latter), so
  `_matmul_kernel` is a Triton GEMM whose epilogue adds the bias, stores pre_gelu, and stores
  gelu(pre_gelu) while the tile is still in registers: one write each instead of a write, a read and a
  write. On sm_90 `_matmul_tma_kernel` is the same GEMM as a persistent grid fed by TMA (config TMA=True).
- DGELU (fcproj backward): the derivative of GELU applied to dinp, either as kernels/gelu.py's pass after
  the GEMM or in the GEMM's epilogue (`dgelu_epilogue=True`, llm.c's DGELU: cuBLASLt's or the Triton
  GEMM's). `bias_gelu_backward` fuses it instead with the *fc* layer's bias gradient: one pass over the
  (B*T, 4C) tensor does dgelu in place and reduces its column sums (what the model does at -ge 0).
- Bias gradient (llm.c's matmul_backward_bias_kernel9 + reduce_add_sum_kernel): no atomics, so the result
  is bitwise reproducible. Level 1: a fixed grid of (column block, row chunk) programs, each summing its
  chunk of rows in fp32 into a scratch row; level 2: one program per column block adds the chunk sums in
  a fixed order into dbias. With a single chunk, level 1 adds into dbias directly.
- QKV bias gradient (`qkv_bias_backward`): the reduction over dq only; the key part is exactly zero and
  the value part is the attention projection's bias gradient through its weight (`bias_through_weight`),
  identities of attention's math (see its docstring).

GELU is the tanh form of kernels/gelu.py (gelu_fp32, gelu_grad_fp32): one definition, so the epilogue's
output has the bits of gelu_forward and a GELU recomputed in the backward equals the stored one.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import LlmpyError
from . import cublaslt
from .common import DOT_UPCAST, cdiv, interpreting, round_to, store_rounded, tma_descriptor_class, tma_usable
from .gelu import gelu_backward_inplace, gelu_forward, gelu_fp32, gelu_grad_fp32

# 2 * sqrt(2 / pi) and 2 * sqrt(2 / pi) * 0.044715: sigmoid(2u) with u = sqrt(2/pi) * (x + 0.044715 x^3)

# epilogues of _matmul_kernel
EPILOGUE_NONE, EPILOGUE_GELU_AUX, EPILOGUE_DGELU = 0, 1, 2

# GEMM tiles. bf16: 128x256x64 with 8 warps lets Triton emit wgmma with a 3-stage cp.async pipeline
# (147 KiB of shared memory). On sm_90 the persistent TMA kernel with the same tiles, a subtiled epilogue
# and a flattened tile loop is faster for both epilogues (H200, fc layer at B=64, T=1024: GELU_AUX 0.693
# against 0.978 ms, DGELU 0.815 against 0.913; bench/kernels/sweep_gemm.py, RESULTS third kernel run).
# fp32 goes through FMA ("ieee"): smaller tiles, it is there for tests. The interpreter runs one Python
# program per tile: small tiles, so that the tests cover several tiles and a K loop of more than one step.
GEMM_CONFIGS = {
    "bf16_sm90": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True,
                      PROGRAMS_PER_SM=1, SUBTILE=True, FLATTEN=True),
    "bf16": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "fp32": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    "interpret": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
}

# bias-gradient reduction tiles: rows x columns per step of a program's loop. From the H200 sweep of
# 2026-12-01 (bench/kernels/sweep_bias.py, bench/RESULTS.md): 32 x 64 with 8 warps is the best at OC = 768
# (0.037 ms, 64 % of copy; 0.041 ms with the former 64 x 128) and as good as any at 2304 and 3072 (81 %, 85 %).
BIAS_BLOCK_M, BIAS_BLOCK_N, BIAS_WARPS = (16, 64, 4) if interpreting() else (32, 64, 8)
# bias_gelu_backward (dGELU in place on the way: two loads and a store an element) wants wider rows: 32 x 128
# with 8 warps, 0.324 ms at (65536, 3072), 87 % of copy, against 0.394 ms for gelu_backward_inplace +
# matmul_backward_bias (same sweep, `sweep_bias --gelu`)
BIAS_GELU_BLOCK_M, BIAS_GELU_BLOCK_N, BIAS_GELU_WARPS = (16, 64, 4) if interpreting() else (32, 128, 8)
BIAS_PROGRAMS_PER_SM = 4
FINISH_BLOCK_CHUNKS, FINISH_BLOCK_N = 64, 64
# the QKV bias gradient's query part from the attention backward's block sums (1024 rows of C at B=64,
# T=1024): 48 programs at C = 768, not 12, each summing 512 rows a step: 7.8 us a call on the H200 against the
# default tiles' 38 (bench/RESULTS.md runs AH, AI)
Q_SUMS_FINISH_TILES = (512, 16, 8) if not interpreting() else (64, 16, 4)


# ----------------------------------------------------------------------------------------------------
# GELU, tanh form

@triton.jit
def _gelu(x):
    return gelu_fp32(x)  # the same bits as kernels/gelu.py, so a recomputed GELU equals the stored one


@triton.jit
def _gelu_grad(x):
    return gelu_grad_fp32(x)


@triton.jit
def _round_like(x, ptr):
    """x rounded to ptr's element type and back to fp32 (round-to-nearest, also in the interpreter)."""
    return round_to(x, ptr).to(tl.float32)


# ----------------------------------------------------------------------------------------------------
# GEMM with a fused epilogue: c = epilogue(a @ b + bias)

@triton.jit
def _dot_acc(a, b, acc, DOT_UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b in fp32."""
    if DOT_UPCAST:  # the interpreter's tl.dot is wrong on bf16
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # fp32 operands: true fp32 products, not tf32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_offsets(tile, per_group, grid_m, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row, column) offsets of output tile number `tile` in grouped order: consecutive tiles walk down
    GROUP_M row blocks before moving to the next column block, so a band of A and a band of B stay in L2
    while they are reused."""
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = min(grid_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows_in_group) * BLOCK_M, ((tile % per_group) // rows_in_group) * BLOCK_N


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, aux_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, IEEE: tl.constexpr,
                   DOT_UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """a (M, K), b (K, N) (any strides: b is weight.T in the forward, weight in the backward), c and aux
    (M, N) with c's strides. EPILOGUE_GELU_AUX: aux = acc + bias, c = gelu(aux). EPILOGUE_DGELU:
    c = acc * gelu'(aux)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    off_m, off_n = _tile_offsets(tl.program_id(0), GROUP_M * tl.cdiv(N, BLOCK_N), grid_m, GROUP_M, BLOCK_M, BLOCK_N)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Edge tiles re-read valid rows/columns (wrapped) instead of masking every load of the K loop; only
    # the stores are masked.
    a_ptrs = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn % N)[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = _dot_acc(a, b, acc, DOT_UPCAST, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (rm < M)[:, None] & (rn < N)[None, :]
    c_offs = rm[:, None] * stride_cm + rn[None, :] * stride_cn
    x = acc
    if HAS_BIAS:
        x += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        # gelu of the stored (rounded) pre-activation: out == gelu_forward(pre_gelu) exactly as unfused
        x = _round_like(x, aux_ptr)
        tl.store(aux_ptr + c_offs, x.to(aux_ptr.dtype.element_ty), mask=mask)
        x = _gelu(x)
    if EPILOGUE == 2:
        x = x * _gelu_grad(tl.load(aux_ptr + c_offs, mask=mask, other=0.0).to(tl.float32))
    store_rounded(c_ptr + c_offs, x, mask, 0, c_offs, False)


@triton.jit
def _tma_epilogue(x, off_m, off_n, c_desc, aux_desc, bias_ptr, N, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                  BN: tl.constexpr):
    """The epilogue of one [BLOCK_M, BN] (sub)tile at (off_m, off_n): the same arithmetic as
    _matmul_kernel's, stored through the descriptors (TMA clips rows/columns past the edges). bias_ptr
    has the output's dtype (the launcher passes c itself when there is no bias): it names the rounding."""
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BN)
        x += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:
        x = _round_like(x, bias_ptr)
        aux_desc.store([off_m, off_n], x.to(bias_ptr.dtype.element_ty))  # exact: x is already rounded
        x = _gelu(x)
    if EPILOGUE == 2:
        x = x * _gelu_grad(aux_desc.load([off_m, off_n]).to(tl.float32))
    c_desc.store([off_m, off_n], _round_like(x, bias_ptr).to(bias_ptr.dtype.element_ty))


@triton.jit
def _matmul_tma_kernel(a_desc, b_desc, c_desc, aux_desc, bias_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, B_KN: tl.constexpr, IEEE: tl.constexpr,
                       DOT_UPCAST: tl.constexpr, NUM_PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr,
                       FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """_matmul_kernel for sm_90: a persistent grid of NUM_PROGRAMS programs walking the output tiles (in
    the same grouped order), operands brought in by TMA (tensor descriptors) and multiplied with wgmma.
    a (M, K) row-major; b (K, N) row-major when B_KN (weight in the backward), else stored as (N, K)
    (weight in the forward: the tile is transposed in shared memory, not in memory). SUBTILE: the
    epilogue runs on two [BLOCK_M, BLOCK_N/2] halves (fewer live registers, smaller store buffers)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * grid_n
    # the epilogue walks the same tiles with its own counter: no dependency between one tile's epilogue
    # and the next tile's loads, so a flattened (or warp-specialised) loop can overlap them
    tile_out = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        off_m, off_n = _tile_offsets(tile, per_group, grid_m, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            # TMA zero-fills reads past K, M and N: edge tiles need no masks
            a = a_desc.load([off_m, ks * BLOCK_K])
            if B_KN:
                b = b_desc.load([ks * BLOCK_K, off_n])
            else:
                b = b_desc.load([off_n, ks * BLOCK_K]).T
            acc = _dot_acc(a, b, acc, DOT_UPCAST, IEEE)
        tile_out += NUM_PROGRAMS
        off_m, off_n = _tile_offsets(tile_out, per_group, grid_m, GROUP_M, BLOCK_M, BLOCK_N)
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            x0, x1 = tl.split(halves)
            _tma_epilogue(x0, off_m, off_n, c_desc, aux_desc, bias_ptr, N, HAS_BIAS, EPILOGUE, BLOCK_N // 2)
            _tma_epilogue(x1, off_m, off_n + BLOCK_N // 2, c_desc, aux_desc, bias_ptr, N, HAS_BIAS, EPILOGUE,
                          BLOCK_N // 2)
        else:
            _tma_epilogue(acc, off_m, off_n, c_desc, aux_desc, bias_ptr, N, HAS_BIAS, EPILOGUE, BLOCK_N)


@triton.jit
def _seed(seed_ptr, STOCHASTIC: tl.constexpr):
    # the seed tensor is only there (and only read) when rounding stochastically
    if STOCHASTIC:
        return tl.load(seed_ptr)
    else:
        return 0


# ----------------------------------------------------------------------------------------------------
# bias gradient: column sums of (M, N), two deterministic levels; optionally dgelu in place on the way

@triton.jit
def _bias_partial_kernel(d_ptr, pre_ptr, part_ptr, dbias_ptr, seed_ptr, M, N, stride_m, rows_per_chunk, col0,
                         HAS_GELU: tl.constexpr, FINAL: tl.constexpr, STOCHASTIC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (column block, row chunk): sum of d[chunk rows, block cols] in fp32. HAS_GELU: first
    d = d * gelu'(pre), written back in place, and the sum is of the values as stored. FINAL (one chunk):
    dbias += sum; else part[chunk, cols] = sum. col0: where dbias's columns start in the parameter they
    belong to (the stochastic rounding's counters)."""
    pid_n = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    row0 = chunk * rows_per_chunk
    # 2-D accumulator, reduced once at the end: the loop has no cross-thread reduction
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rows_per_chunk, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_m + cols[None, :]
        g = tl.load(d_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_GELU:
            x = tl.load(pre_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = _round_like(g * _gelu_grad(x), d_ptr)
            tl.store(d_ptr + offs, g.to(d_ptr.dtype.element_ty), mask=mask)
        acc += g
    col_sum = tl.sum(acc, axis=0)
    if FINAL:
        total = tl.load(dbias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + col_sum
        store_rounded(dbias_ptr + cols, total, col_mask, _seed(seed_ptr, STOCHASTIC), col0 + cols, STOCHASTIC)
    else:
        tl.store(part_ptr + chunk * N + cols, col_sum, mask=col_mask)


@triton.jit
def _bias_finish_kernel(part_ptr, dbias_ptr, seed_ptr, N, num_chunks, col0, STOCHASTIC: tl.constexpr,
                        BLOCK_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dbias[cols] += sum over chunks of part[chunk, cols], in a fixed order (llm.c's reduce_add_sum);
    col0 as in _bias_partial_kernel."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_CHUNKS, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, num_chunks, BLOCK_CHUNKS):
        chunks = c0 + tl.arange(0, BLOCK_CHUNKS)
        mask = (chunks < num_chunks)[:, None] & col_mask[None, :]
        acc += tl.load(part_ptr + chunks[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.load(dbias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + tl.sum(acc, axis=0)
    store_rounded(dbias_ptr + cols, total, col_mask, _seed(seed_ptr, STOCHASTIC), col0 + cols, STOCHASTIC)


@triton.jit
def _weight_bias_column_finish_kernel(wide_ptr, dweight_ptr, dbias_ptr, seed_ptr, OC, C, wide_stride,
                                      STOCHASTIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dweight[r, :] += wide[r, :C] rounded to nearest (as the product's beta = 1 would), dbias[r] +=
    wide[r, C] rounded like the bias reductions (counter r, as theirs for a whole bias)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < OC
    rows = wide_ptr + r.to(tl.int64)[:, None] * wide_stride
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = r_ok[:, None] & (c < C)[None, :]
        w_offs = r.to(tl.int64)[:, None] * C + c[None, :]
        total = tl.load(dweight_ptr + w_offs, mask=mask, other=0.0).to(tl.float32) + \
            tl.load(rows + c[None, :], mask=mask, other=0.0)
        tl.store(dweight_ptr + w_offs, round_to(total, dweight_ptr), mask=mask)
    column = tl.load(wide_ptr + r.to(tl.int64) * wide_stride + C, mask=r_ok, other=0.0)
    dbias = tl.load(dbias_ptr + r, mask=r_ok, other=0.0).to(tl.float32) + column
    store_rounded(dbias_ptr + r, dbias, r_ok, _seed(seed_ptr, STOCHASTIC), r, STOCHASTIC)


@triton.jit
def _bias_through_weight_kernel(dbias_ptr, grad_ptr, w_ptr, seed_ptr, OC, N, col0, STOCHASTIC: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """dbias[cols] += sum over k of grad[k] * w[k, cols] (grad fp32 (OC,), w row-major (OC, N)), the k
    in a fixed order; rounded like the bias reductions, counters col0 + cols."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, OC, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < OC
        g = tl.load(grad_ptr + ks, mask=k_ok, other=0.0)
        w = tl.load(w_ptr + ks.to(tl.int64)[:, None] * N + cols[None, :], mask=k_ok[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += g[:, None] * w
    total = tl.load(dbias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + tl.sum(acc, axis=0)
    store_rounded(dbias_ptr + cols, total, col_mask, _seed(seed_ptr, STOCHASTIC), col0 + cols, STOCHASTIC)


# ----------------------------------------------------------------------------------------------------
# launchers

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor, cols: int, strided: bool = False) -> torch.Tensor:
    """A contiguous (..., cols) tensor as a 2-D view (rows, cols); strided: its rows may also be evenly
    spaced further apart (the [..., :C] view of a LayerNorm output with its bias column)."""
    assert t.shape[-1] == cols and (t.is_contiguous() or strided and t.stride(-1) == 1), \
        (tuple(t.shape), t.stride(), cols)
    return t.view(-1, cols)


def gemm_config(dtype: torch.dtype, device=None) -> dict:
    """The default tiles for dtype on device (sm_90 and later: the TMA kernel for bf16)."""
    if interpreting():
        return GEMM_CONFIGS["interpret"]
    if dtype != torch.bfloat16:
        return GEMM_CONFIGS["fp32"]
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return GEMM_CONFIGS["bf16_sm90"]
    return GEMM_CONFIGS["bf16"]


def triton_matmul(c, a, b, bias=None, aux=None, epilogue: int = EPILOGUE_NONE, config: dict | None = None):
    """c (M, N) = epilogue(a (M, K) @ b (K, N) + bias) with the Triton GEMM; b may be strided (weight.t()).

    EPILOGUE_GELU_AUX: aux (M, N) gets a @ b + bias, c gets its gelu. EPILOGUE_DGELU: c = (a @ b) * gelu'(aux).
    config: GEMM_CONFIGS-style tiles (default gemm_config(dtype, device)); the benchmark sweeps it. With
    TMA=True in it (and operands TMA can address, see common.tma_usable) the persistent TMA kernel runs, with
    PROGRAMS_PER_SM, SUBTILE and FLATTEN from the config; else the pointer kernel.
    """
    M, K = a.shape
    N = b.shape[1]
    assert b.shape[0] == K and c.shape == (M, N), (tuple(a.shape), tuple(b.shape), tuple(c.shape))
    assert a.dtype == b.dtype == c.dtype and a.dtype in _FLOAT_DTYPES
    assert c.is_contiguous() and a.stride(1) == 1
    # 32-bit offsets in the kernel
    assert max(a.numel(), b.numel(), c.numel()) < 2 ** 31
    if bias is not None:
        assert bias.shape == (N,) and bias.dtype == c.dtype and bias.is_contiguous()
    if epilogue != EPILOGUE_NONE:
        assert aux is not None and aux.shape == (M, N) and aux.dtype == c.dtype and aux.is_contiguous()
    cfg = dict(config or gemm_config(a.dtype, a.device))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    tma = cfg.pop("TMA", False)
    per_sm, subtile, flatten = cfg.pop("PROGRAMS_PER_SM", 1), cfg.pop("SUBTILE", False), cfg.pop("FLATTEN", False)
    warp_spec = cfg.pop("WARP_SPECIALIZE", False) and not interpreting()
    operands = [a, b, c] + ([aux] if aux is not None else [])
    if tma and tma_usable(*operands):
        TD = tma_descriptor_class()
        b_kn = b.stride(1) == 1
        en = bn // 2 if subtile else bn
        a_d = TD.from_tensor(a, [bm, bk])
        b_d = TD.from_tensor(b, [bk, bn]) if b_kn else TD.from_tensor(b.t(), [bn, bk])
        c_d = TD.from_tensor(c, [bm, en])
        aux_d = TD.from_tensor(aux, [bm, en]) if aux is not None else c_d
        tiles = cdiv(M, bm) * cdiv(N, bn)
        programs = min(tiles, 3 if interpreting() else _num_sms(a.device) * per_sm)
        _matmul_tma_kernel[(programs,)](
            a_d, b_d, c_d, aux_d, bias if bias is not None else c, M, N, K,
            HAS_BIAS=bias is not None, EPILOGUE=epilogue, B_KN=b_kn, IEEE=a.dtype == torch.float32 or DOT_UPCAST,
            DOT_UPCAST=DOT_UPCAST, NUM_PROGRAMS=programs, SUBTILE=subtile, FLATTEN=flatten,
            WARP_SPECIALIZE=warp_spec,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
        return c
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    _matmul_kernel[grid](
        a, b, c, bias if bias is not None else c, aux if aux is not None else c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, EPILOGUE=epilogue, IEEE=a.dtype == torch.float32 or DOT_UPCAST,
        DOT_UPCAST=DOT_UPCAST, EVEN_K=K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    return c


def resolve_cublaslt(use: bool | None, device) -> bool:
    """Whether the model's products go through kernels/cublaslt.py where it helps: the GELU epilogues of
    -ge 1 / 2 (cuBLASLt's GELU_AUX_BIAS and DGELU, as llm.c; else our Triton GEMM's) and the products of
    TUNED_ALGOS. None: wherever it binds (a CUDA device and torch's libcublasLt)."""
    usable = torch.device(device).type == "cuda" and not interpreting() and cublaslt.available()
    if use and not usable:
        raise LlmpyError("cuBLASLt: needs a CUDA device and the libcublasLt that torch loads")
    return usable if use is None else bool(use)


# Products whose cuBLASLt algorithm of this rank in the heuristic's list beat torch's cuBLAS choice (and
# cuBLASLt's first) on an H200, cuBLAS 13, at GPT-2 124M B=64 T=1024 (bench/kernels/bench_cublaslt.py,
# bench/RESULTS.md run L). Keyed by (product, rows, inner, outer, GPU capability). A fixed rank, not a
# timed choice at run time: the same problem always gets the same kernel, so the same bits. Timed again at
# the card's power cap (bench_cublaslt --sustain-ms 200, run M) the first three keep their lead; a table
# rebuilt from those at-cap timings ran the step no faster (A/B 110.1 against 109.8 ms).
TUNED_ALGOS = {
    ("fwd", 8192, 768, 50304, (9, 0)): 5,         # lm_head, a chunk of 8192 rows: 0.86 ms against 1.00-1.13
    ("gelu_aux_bias", 65536, 768, 3072, (9, 0)): 4,  # fc: 0.54-0.61 ms against 0.59-0.64 for rank 0
    ("dinp", 65536, 768, 768, (9, 0)): 5,         # attproj input gradient: 0.117 ms against 0.152
    # qkv weight gradient, split-K (run AJ, search_cublaslt --split-k): 3 parts summed in fp32, nvjet 192 x 224
    # tiles (4 x 11 of them, x 3: one wave of 132), at the cap 0.364 ms against 0.402 for run L's rank 5
    ("dweight", 65536, 2304, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=472, stages=35, custom=7, cluster=2,
                                                              splitk=3, reduction=2),
    # named in full (bench/kernels/search_cublaslt.py, run AC): nvjet 128x160 tiles, at the cap 0.349-0.355 ms
    # against torch's 0.378-0.405 (qkv forward), 0.344-0.353 against 0.349-0.362 (qkv input gradient)
    ("fwd_bias", 65536, 768, 2304, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=1, cluster=3),
    ("dinp", 65536, 2304, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=3, cluster=5),
    # session 24 (run AD): the projections' forwards, nvjet 128x160, 1 x 2 clusters: at the cap 0.457 ms against
    # torch's 0.483 (fcproj), 0.124 against 0.136 (attproj)
    ("fwd_bias", 65536, 3072, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=3, cluster=5),
    ("fwd_bias", 65536, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=3, cluster=5),
    # session 35 (run AO): B = 32's products searched (search_cublaslt --B 32), at the cap ms a call against torch's
    # (or, for fc, the heuristic's first): qkv forward 0.179 against 0.200 (nvjet 128x160, 2 x 1 clusters), attproj
    # forward 0.066 against 0.069, fc forward 0.328 against 0.341 (96x128, 2 x 1), attproj input gradient 0.065
    # against 0.068 (128x128, 1 x 2); the step at B = 32 -0.8 ms (medians), -0.5 (lower quartiles). B = 16's search
    # found nothing 2 % faster than torch's calls (its ~0.04 ms attproj products were host-bound in that timing).
    ("fwd_bias", 32768, 768, 2304, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=1, cluster=3),
    ("fwd_bias", 32768, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=29, stages=35, custom=3, cluster=3),
    ("gelu_aux_bias", 32768, 768, 3072, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=28, stages=35, custom=0,
                                                                     cluster=3),
    ("dinp", 32768, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=20, stages=35, custom=2, cluster=5),
    # session 36 (run AP): B = 16's products timed inside CUDA graphs (search_cublaslt --graph-calls 20), at the cap
    # ms a call against torch's: qkv forward 0.0955 against 0.1003, attproj forward 0.0348 against 0.0360, attproj
    # input gradient 0.0341 against 0.0356 (nvjet 128x128), attproj weight gradient 0.0396 against 0.0411 (split 7);
    # the step at B = 16 -0.1 to -0.3 ms. At ~0.04 ms a call's timings scatter by up to 10 %, so attproj's three
    # gains are not established (run AP, call 6); they cost nothing at other shapes.
    ("fwd_bias", 16384, 768, 2304, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=20, stages=35, custom=1, cluster=5),
    ("fwd_bias", 16384, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=20, stages=35, custom=3, cluster=5),
    ("dinp", 16384, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=20, stages=35, custom=3, cluster=5),
    ("dweight", 16384, 768, 768, (9, 0)): cublaslt.AlgoConfig(algo_id=66, tile=20, stages=35, custom=1, cluster=2,
                                                              splitk=7, reduction=2),
}


# True: with use_cublaslt, the bias gradients summed by cuBLASLt in the weight-gradient product (BGRADB,
# sums rounded to the product's dtype, then added into dbias as our reduction adds). Off: on an H200 it
# made the whole step 2.0 ms slower than our two-level reduction after torch's product (BGRADB steers
# cuBLASLt to slower products for three of the four layers; bench/RESULTS.md, run L).
BIAS_GRAD_IN_PRODUCT = False


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _tuned(product: str, rows: int, inner: int, outer: int, device) -> int | cublaslt.AlgoConfig | None:
    """The algorithm TUNED_ALGOS gives this product on this device's GPU (a rank in cuBLASLt's heuristic
    list or a whole AlgoConfig), or None (torch's call)."""
    return TUNED_ALGOS.get((product, rows, inner, outer, _capability(device)))


def _lt(product, *args, algo=None, **kwargs):
    """cuBLASLt's product with the algorithm TUNED_ALGOS gave it (None: the heuristic's first). A whole
    configuration this cuBLASLt refuses (another version of the library, another GPU of the same
    capability) runs the heuristic's first choice instead; a refused rank is an error, as before."""
    if isinstance(algo, cublaslt.AlgoConfig):
        try:
            return product(*args, algo_index=algo, **kwargs)
        except cublaslt.CublasLtError:
            algo = 0
    return product(*args, algo_index=algo or 0, **kwargs)


def matmul_forward(out, inp, weight, bias=None, pre_gelu=None, gelu_epilogue: bool = False,
                   use_cublaslt: bool = False, residual=None):
    """out (..., OC) = inp (..., C) @ weight (OC, C).T + bias (OC) (llm.c's matmul_forward_cublaslt).

    With residual (..., OC) (the attention / MLP projection feeding the residual stream): out = residual +
    inp @ weight.T + bias. use_cublaslt: in the product's epilogue (beta = 1), summed in fp32 and rounded
    once into another buffer (in place, in bf16, cuBLASLt rounds the product first: see
    cublaslt.linear_forward); else torch's addmm onto the residual, then the bias (two roundings).
    residual may be out.

    With pre_gelu (the fc layer): pre_gelu = inp @ weight.T + bias and out = gelu(pre_gelu), both written.
    gelu_epilogue False: cuBLASLt addmm into pre_gelu, then the gelu kernel (kernels/gelu.py); True: one
    product writes both (use_cublaslt: cuBLASLt's GELU_AUX_BIAS; else our Triton GEMM).
    use_cublaslt: also the products of TUNED_ALGOS through cuBLASLt with their tuned algorithm.
    """
    OC, C = weight.shape
    inp2 = _rows(inp, C, strided=True)
    out2 = _rows(out, OC)
    assert out2.shape[0] == inp2.shape[0] and inp.dtype == weight.dtype == out.dtype and weight.is_contiguous()
    if bias is not None:
        assert bias.shape == (OC,) and bias.dtype == out.dtype
    if residual is not None:
        assert pre_gelu is None, "a residual is added after the product, not before a GELU"
        res2 = _rows(residual, OC)
        assert res2.shape == out2.shape and residual.dtype == out.dtype
        if use_cublaslt:
            rank = _tuned("fwd_bias_residual" if bias is not None else "fwd_residual", *inp2.shape, OC, out.device)
            _lt(cublaslt.linear_forward, out2, inp2, weight, bias, residual=res2, algo=rank)
        else:
            if out2.data_ptr() == res2.data_ptr():
                out2.addmm_(inp2, weight.t())
            else:
                torch.addmm(res2, inp2, weight.t(), out=out2)
            if bias is not None:
                out2.add_(bias)
        return out
    if pre_gelu is None:
        rank = _tuned("fwd_bias" if bias is not None else "fwd", *inp2.shape, OC, out.device) if use_cublaslt else None
        if rank is not None:
            _lt(cublaslt.linear_forward, out2, inp2, weight, bias, algo=rank)
        elif bias is not None:
            torch.addmm(bias, inp2, weight.t(), out=out2)  # cuBLASLt BIAS epilogue
        else:
            torch.mm(inp2, weight.t(), out=out2)
        return out
    pre2 = _rows(pre_gelu, OC)
    assert pre2.shape == out2.shape and pre_gelu.dtype == out.dtype
    if gelu_epilogue and use_cublaslt:
        rank = _tuned("gelu_aux_bias" if bias is not None else "gelu_aux", *inp2.shape, OC, out.device)
        _lt(cublaslt.linear_forward, out2, inp2, weight, bias, pre_gelu=pre2, algo=rank)
    elif gelu_epilogue:
        triton_matmul(out2, inp2, weight.t(), bias, aux=pre2, epilogue=EPILOGUE_GELU_AUX)
    else:
        if bias is not None:
            torch.addmm(bias, inp2, weight.t(), out=pre2)
        else:
            torch.mm(inp2, weight.t(), out=pre2)
        gelu_forward(out, pre_gelu)
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _bias_tiles(gelu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the first level, plain or with the dGELU."""
    return (BIAS_GELU_BLOCK_M, BIAS_GELU_BLOCK_N, BIAS_GELU_WARPS) if gelu else (BIAS_BLOCK_M, BIAS_BLOCK_N, BIAS_WARPS)


def bias_backward_chunks(M: int, N: int, device, gelu: bool = False) -> tuple[int, int]:
    """(num_chunks, rows_per_chunk) of the bias-gradient reduction of an (M, N) gradient (gelu: of
    bias_gelu_backward's): enough programs for BIAS_PROGRAMS_PER_SM per SM. The scratch it needs is
    num_chunks * N fp32 (none for one chunk)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    block_m, block_n, _ = _bias_tiles(gelu)
    target = BIAS_PROGRAMS_PER_SM * _num_sms(device)
    chunks = max(1, min(cdiv(M, block_m), cdiv(target, cdiv(N, block_n))))
    return _chunking(M, chunks, block_m)


def _chunking(M: int, chunks: int, block_m: int) -> tuple[int, int]:
    # whole row tiles per chunk (at least one: no rows, M = 0, gives no chunks, not a division by zero)
    rows = max(1, cdiv(cdiv(M, chunks), block_m)) * block_m
    return cdiv(M, rows), rows


def bias_scratch_numel(M: int, N: int, device, gelu: bool = False) -> int:
    """fp32 elements of scratch the default reduction of an (M, N) gradient uses (gelu: bias_gelu_backward's)."""
    chunks, _ = bias_backward_chunks(M, N, device, gelu)
    return chunks * N if chunks > 1 else 0


def _bias_reduce(dbias, scratch, d2, pre2, seed, num_chunks, col0: int = 0):
    M, N = d2.shape
    assert dbias.shape == (N,) and dbias.is_contiguous() and dbias.dtype in _FLOAT_DTYPES
    block_m, block_n, warps = _bias_tiles(pre2 is not None)
    if num_chunks is None:
        chunks, rows = bias_backward_chunks(M, N, d2.device, pre2 is not None)
    else:
        chunks, rows = _chunking(M, num_chunks, block_m)
    if chunks > 1 and scratch is not None and scratch.numel() < chunks * N:
        # a smaller scratch than the default plan: fewer, longer chunks (still a fixed order)
        chunks, rows = _chunking(M, max(1, scratch.numel() // N), block_m)
    if not chunks:  # no rows: nothing to add
        return
    if chunks > 1:
        if scratch is None:
            scratch = torch.empty(chunks * N, dtype=torch.float32, device=d2.device)  # not for CUDA graphs
        assert scratch.dtype == torch.float32 and scratch.is_contiguous()
    stochastic = seed is not None and dbias.dtype == torch.bfloat16
    part = scratch if chunks > 1 else dbias
    _bias_partial_kernel[(cdiv(N, block_n), chunks)](
        d2, pre2 if pre2 is not None else d2, part, dbias, seed if stochastic else dbias, M, N, d2.stride(0), rows,
        col0, HAS_GELU=pre2 is not None, FINAL=chunks == 1, STOCHASTIC=stochastic,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    if chunks > 1:
        _finish_bias(dbias, scratch, seed, chunks, col0)


def column_sums_by_blocks(part: torch.Tensor, d2: torch.Tensor, rows: int) -> torch.Tensor:
    """part[i, :] = the column sums (fp32) of d2's rows [rows * i, rows * (i + 1)): d2 (M, N), any row stride;
    part fp32 (cdiv(M, rows), N). The first level of a bias reduction in blocks of a fixed size (the QKV
    bias gradient's query part where the attention backward does not sum it itself)."""
    M, N = d2.shape
    assert part.shape == (cdiv(M, rows), N) and part.dtype == torch.float32 and part.is_contiguous()
    assert d2.stride(1) == 1
    block_m = min(rows, BIAS_BLOCK_M)
    assert rows % block_m == 0
    _bias_partial_kernel[(cdiv(N, BIAS_BLOCK_N), part.shape[0])](
        d2, d2, part, part, part, M, N, d2.stride(0), rows, 0, HAS_GELU=False, FINAL=False, STOCHASTIC=False,
        BLOCK_M=block_m, BLOCK_N=BIAS_BLOCK_N, num_warps=BIAS_WARPS)
    return part


def _finish_bias(dbias, part, seed, num_chunks: int = 1, col0: int = 0, tiles=None):
    """dbias += the sum of part's num_chunks rows of len(dbias) (any float dtype) in a fixed order, rounded
    stochastically with a seed for bf16 dbias (the reduction's second level; one row: BGRADB's sums).
    tiles: (chunks, columns, warps) a program, default (FINISH_BLOCK_CHUNKS, FINISH_BLOCK_N, 4)."""
    N = dbias.shape[0]
    stochastic = seed is not None and dbias.dtype == torch.bfloat16
    block_chunks, block_n, warps = tiles or (FINISH_BLOCK_CHUNKS, FINISH_BLOCK_N, 4)
    _bias_finish_kernel[(cdiv(N, block_n),)](
        part, dbias, seed if stochastic else dbias, N, num_chunks, col0, STOCHASTIC=stochastic,
        BLOCK_CHUNKS=block_chunks if num_chunks > 1 else 2, BLOCK_N=block_n, num_warps=warps)


def matmul_backward_bias(dbias, dout, scratch=None, seed=None, num_chunks: int | None = None):
    """dbias (OC) += dout (..., OC) summed over rows, deterministically (llm.c's matmul_backward_bias_kernel9
    + reduce_add_sum_kernel).

    scratch: fp32, at least bias_scratch_numel(M, OC, device) elements (allocated here when None: not
    inside CUDA-graph capture); a smaller one means fewer chunks. seed: None rounds bf16 dbias to nearest
    (llm.c); a 1-element int64 device tensor rounds stochastically. num_chunks overrides the chunking.
    """
    OC = dbias.shape[0]
    _bias_reduce(dbias, scratch, _rows(dout, OC), None, seed, num_chunks)
    return dbias


WIDE_FINISH_BLOCK_R, WIDE_FINISH_BLOCK_C = 16, 256


def weight_grad_bias_column(dweight, dbias, dout, inp_wide, wide, seed=None, use_cublaslt: bool = False):
    """dweight (OC, C) += dout.T @ inp and dbias (OC) += dout's column sums, from one product: inp_wide
    (..., Cw) is the layer input with the column C set to 1 and the rest of its row to 0 (the LayerNorm
    forward's bias_column), so the product dout.T @ inp_wide (OC, Cw), summed in fp32 into wide (fp32
    scratch of at least OC * Cw), holds the weight gradient in its first C columns and the bias gradient
    in column C. A small pass then adds those into dweight (rounded to nearest, as the product's beta = 1
    does) and dbias (rounded like the bias reductions: stochastically with seed for bf16).

    This replaces the bias reduction's pass over dout (fc's: 403 MB a layer at GPT-2 124M, B*T = 65536)
    by 8 more output columns of the product (bench/RESULTS.md, run W). use_cublaslt: the product through
    cuBLASLt where TUNED_ALGOS has a "dweight_wide" entry for it, else torch's."""
    OC, C = dweight.shape
    Cw = inp_wide.shape[-1]
    dout2, inp2 = _rows(dout, OC), _rows(inp_wide, Cw)
    assert Cw > C and dbias.shape == (OC,) and dweight.is_contiguous() and dbias.is_contiguous()
    assert dout.dtype == inp_wide.dtype == dweight.dtype and wide.dtype == torch.float32
    assert wide.is_contiguous() and wide.numel() >= OC * Cw, "wide: fp32 scratch of OC * Cw elements"
    wide2 = wide.view(-1)[:OC * Cw].view(OC, Cw)
    algo = _tuned("dweight_wide", dout2.shape[0], OC, Cw, dout.device) if use_cublaslt else None
    if algo is not None and dout.dtype == torch.bfloat16:
        _lt(cublaslt.linear_weight_grad, wide2, dout2, inp2, accumulate=False, algo=algo)
    elif dout.is_cuda and dout.dtype != torch.float32:
        torch.mm(dout2.t(), inp2, out_dtype=torch.float32, out=wide2)  # fp32 sums, no rounding to bf16
    else:
        torch.mm(dout2.t().float(), inp2.float(), out=wide2)
    stochastic = seed is not None and dbias.dtype == torch.bfloat16
    _weight_bias_column_finish_kernel[(cdiv(OC, WIDE_FINISH_BLOCK_R),)](
        wide2, dweight, dbias, seed if stochastic else dbias, OC, C, Cw, STOCHASTIC=stochastic,
        BLOCK_R=WIDE_FINISH_BLOCK_R, BLOCK_C=WIDE_FINISH_BLOCK_C, num_warps=4)
    return dweight, dbias


# qkv_bias_backward's parts from attention's identities (True), or one reduction over all of dqkv as
# llm.c does (False: bench_step --qkv-bias-full-pass, the comparison of bench/RESULTS.md run S)
QKV_BIAS_FROM_IDENTITIES = True
# the query part from the column sums the Triton/Gluon attention backward makes a 64-row block at a time as it
# writes dq (True), or from a pass over dq (False: bench_step --q-sums-from-attention off). On the H200
# (bench/RESULTS.md run AI) the pass and its finish take 0.35 ms a step, the block sums' finish 0.09 and the
# flash backward ~0.13 more; the whole step 0.0 / -0.8 ms (medians) in two alternated A/Bs, energy the same
QKV_QUERY_SUMS_FROM_ATTENTION = True


# bias_through_weight's tiles: [BLOCK_K rows of the weight, BLOCK_N columns] a step, a program per BLOCK_N
# columns (48 programs at C = 768: the 1.2 MB product is bound by latency, not bandwidth). H200, C = 768,
# triton.testing.do_bench: 8.1 us a call (256 x 16 and 256 x 8, 4 warps), 9.7 (128 x 16), 23.0 (64 x 64)
THROUGH_BLOCK_K, THROUGH_BLOCK_N, THROUGH_WARPS = 256, 16, 4


def bias_through_weight(dbias, grad_sum, weight, seed=None, col0: int = 0, block_k: int = THROUGH_BLOCK_K,
                        block_n: int = THROUGH_BLOCK_N, num_warps: int = THROUGH_WARPS):
    """dbias (C) += grad_sum (OC) @ weight (OC, C): the column sums of a linear layer's input gradient
    (dout @ weight) from those of its output gradient (grad_sum, fp32), without a pass over the rows.
    Rounded as matmul_backward_bias rounds (seed), with the counters col0 + column (col0: where dbias
    starts in its parameter). The tiles change the order of the sum, so its bits."""
    OC, C = weight.shape
    assert dbias.shape == (C,) and dbias.is_contiguous() and dbias.dtype in _FLOAT_DTYPES
    assert grad_sum.shape == (OC,) and grad_sum.dtype == torch.float32 and grad_sum.is_contiguous()
    assert weight.is_contiguous() and weight.dtype in _FLOAT_DTYPES
    stochastic = seed is not None and dbias.dtype == torch.bfloat16
    _bias_through_weight_kernel[(cdiv(C, block_n),)](
        dbias, grad_sum, weight, seed if stochastic else dbias, OC, C, col0, STOCHASTIC=stochastic,
        BLOCK_K=block_k, BLOCK_N=block_n, num_warps=num_warps)
    return dbias


def qkv_bias_backward(dbias, dqkv, scratch=None, seed=None, proj_bias_grad=None, proj_weight=None, q_sums=None):
    """dbias (3C) += the QKV projection's bias gradient, from dqkv (..., 3C) and what attention's math gives
    for free (exact identities, whatever the attention kernel):

    - query part: the column sums of dq (a reduction over dqkv's first C columns);
    - key part: zero, exactly. The key bias adds q . b_k to every score of a query's row, and softmax
      ignores a shift of a whole row, so the loss does not depend on it; the column sums of dk are zero
      but for rounding (what llm.c and PyTorch add up), so nothing is added;
    - value part: each row of the attention matrix sums to one, so the column sums of dv are those of
      the attention output's gradient, which is dout @ proj_weight for the output projection's dout:
      proj_bias_grad (fp32, C: the column sums of that dout, the projection's bias gradient of this same
      backward) @ proj_weight, with no pass over the rows. Without them: the column sums of dv.

    Rounded as matmul_backward_bias rounds (seed), each part with the counters of its columns in dbias.
    q_sums: None, or fp32 (blocks, C): the column sums of dq in blocks of rows, from the attention backward
    (flash_attention_backward's q_sums); the query part is then their sum, and no pass reads dq.

    QKV_BIAS_FROM_IDENTITIES = False: one reduction over all of dqkv instead (llm.c's; for comparison)."""
    C3 = dbias.shape[0]
    assert C3 % 3 == 0 and dqkv.shape[-1] == C3, (tuple(dbias.shape), tuple(dqkv.shape))
    assert dbias.dim() == 1 and dbias.is_contiguous() and dbias.dtype in _FLOAT_DTYPES, "dbias: contiguous (3C,)"
    C = C3 // 3
    d2 = _rows(dqkv, C3)
    if not QKV_BIAS_FROM_IDENTITIES:
        _bias_reduce(dbias, scratch, d2, None, seed, None)
        return dbias
    if q_sums is not None:
        assert q_sums.dim() == 2 and q_sums.shape[1] == C and q_sums.is_contiguous(), (tuple(q_sums.shape),
                                                                                        q_sums.stride())
        _finish_bias(dbias[:C], q_sums, seed, q_sums.shape[0], col0=0, tiles=Q_SUMS_FINISH_TILES)
    else:
        _bias_reduce(dbias[:C], scratch, d2[:, :C], None, seed, None, col0=0)
    if proj_bias_grad is not None:
        bias_through_weight(dbias[2 * C:], proj_bias_grad, proj_weight, seed, col0=2 * C)
    else:
        _bias_reduce(dbias[2 * C:], scratch, d2[:, 2 * C:], None, seed, None, col0=2 * C)
    return dbias


def bias_gelu_backward(dbias, scratch, d_in_out, pre_gelu, seed=None, num_chunks: int | None = None):
    """One pass over the fc layer's (..., 4C) gradient: d_in_out *= gelu'(pre_gelu) in place (the gradient
    w.r.t. the GELU output becomes the gradient w.r.t. pre_gelu) and dbias += its column sums.

    The model uses it in the fc layer's backward: fcproj's matmul_backward without pre_gelu writes
    d(gelu output) into d_in_out, this turns it into d(pre_gelu) and fc's bias gradient at once, and fc's
    matmul_backward then runs with dbias=None. Against dgelu + a separate bias reduction it saves one read
    of the (B*T, 4C) tensor; against an unfused dgelu pass it saves a read and a write as well.
    scratch / seed / num_chunks: as in matmul_backward_bias.
    """
    N = dbias.shape[0]
    d2, pre2 = _rows(d_in_out, N), _rows(pre_gelu, N)
    assert d2.shape == pre2.shape and d2.dtype == pre2.dtype
    _bias_reduce(dbias, scratch, d2, pre2, seed, num_chunks)
    return d_in_out, dbias


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, scratch=None, pre_gelu=None,
                    dgelu_epilogue: bool = False, seed=None, use_cublaslt: bool = False):
    """Backward of out = inp @ weight.T + bias (llm.c's matmul_backward).

    dinp (..., C) = dout (..., OC) @ weight: OVERWRITTEN (None skips it).
    dweight (OC, C) += dout.T @ inp: ACCUMULATED, in the GEMM itself (beta = 1) (None skips it: the model
    issues the input gradient and the weight and bias gradients as two calls, on two streams).
    dbias (OC) += column sums of dout: ACCUMULATED, deterministic Triton reduction (None skips it);
    scratch / seed as in matmul_backward_bias.
    pre_gelu (..., C): this layer's input was gelu(pre_gelu) (fcproj), so dinp is turned into the
    gradient w.r.t. pre_gelu: by gelu_backward_inplace of kernels/gelu.py after the GEMM, or with
    dgelu_epilogue in the GEMM's epilogue (llm.c's DGELU: cuBLASLt's with use_cublaslt, else our Triton
    GEMM's). use_cublaslt: also the products of TUNED_ALGOS through cuBLASLt with their tuned algorithm.
    """
    OC, C = weight.shape
    dout2 = _rows(dout, OC)
    inp2 = _rows(inp, C, strided=True)
    assert dout2.shape[0] == inp2.shape[0] and dout.dtype == inp.dtype == weight.dtype
    if dinp is not None:
        dinp2 = _rows(dinp, C)
        assert dinp2.shape == inp2.shape and dinp.dtype == dout.dtype
        if pre_gelu is not None:
            assert pre_gelu.shape == dinp.shape and pre_gelu.dtype == dinp.dtype
        dgelu = pre_gelu is not None and dgelu_epilogue
        rank = _tuned("dinp_dgelu" if dgelu else "dinp", *dout2.shape, C, dout.device) if use_cublaslt else None
        if dgelu and use_cublaslt:
            _lt(cublaslt.linear_input_grad, dinp2, dout2, weight, pre_gelu=_rows(pre_gelu, C), algo=rank)
        elif dgelu:
            triton_matmul(dinp2, dout2, weight, aux=_rows(pre_gelu, C), epilogue=EPILOGUE_DGELU)
        else:
            if rank is not None:
                _lt(cublaslt.linear_input_grad, dinp2, dout2, weight, algo=rank)
            else:
                torch.mm(dout2, weight, out=dinp2)
            if pre_gelu is not None:
                gelu_backward_inplace(dinp, pre_gelu)
    bias_summed = dweight is not None and _weight_grad(dweight, dbias, dout2, inp2, scratch, seed, use_cublaslt)
    if dbias is not None and not bias_summed:
        _bias_reduce(dbias, scratch, dout2, None, seed, None)
    return dinp, dweight, dbias


def _weight_grad(dweight, dbias, dout2, inp2, scratch, seed, use_cublaslt: bool) -> bool:
    """dweight += dout2.T @ inp2 (matmul_backward's); True when cuBLASLt's BGRADB also summed dbias."""
    OC, C = dout2.shape[1], inp2.shape[1]
    assert dweight.shape == (OC, C) and dweight.dtype == dout2.dtype and dweight.is_contiguous()
    if dbias is not None and use_cublaslt and BIAS_GRAD_IN_PRODUCT and scratch is not None \
            and scratch.numel() * scratch.element_size() >= OC * dout2.element_size():
        # BGRADB: the column sums of dout from the weight-gradient product, into scratch (dout's dtype)
        sums = scratch.view(dout2.dtype)[:OC]
        rank = _tuned("dweight_bgradb", *dout2.shape, C, dout2.device)
        try:
            _lt(cublaslt.linear_weight_grad, dweight, dout2, inp2, dbias_sums=sums, algo=rank)
        except cublaslt.CublasLtError:
            pass  # no such algorithm here: the product and our reduction (matmul_backward's)
        else:
            _finish_bias(dbias, sums, seed)
            return True
    rank = _tuned("dweight", *dout2.shape, C, dout2.device) if use_cublaslt else None
    if rank is not None:
        _lt(cublaslt.linear_weight_grad, dweight, dout2, inp2, algo=rank)  # accumulated (beta = 1) as well
    else:
        dweight.addmm_(dout2.t(), inp2)  # beta = 1: cuBLAS accumulates into dweight in the GEMM
    return False

