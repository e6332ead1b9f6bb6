"""Causal flash attention, forward and backward, reading q/k/v in place from the QKV matmul's output.

llm.c's classic path permutes qkv (B, T, 3C) into q, k, v (B, NH, T, hs), materialises the (B, NH, T, T)
scores and softmax, and permutes the result back; its cuDNN path calls a fused kernel instead. These
kernels are that fused kernel, written in Triton:

* forward: one program per (query block, batch*head). q is loaded once; key/value blocks stream
  through with an online softmax (running max and sum, fp32, in base 2 with log2(e) folded into the
  scale so each exponential is one exp2). Only key blocks at or below the diagonal are visited, and only
  the diagonal ones pay for the causal mask. The output lands directly in the (B, T, C) layout the
  projection matmul reads, and the log-sum-exp of each row (natural log, fp32) is saved so the backward
  can rebuild the probabilities without another softmax pass.
* backward: a small kernel computes delta = rowsum(dout * out) per (b, h, t); then one kernel whose
  program i owns key block i (accumulating dk, dv over the query blocks at or after it) and query block i
  (accumulating dq over the key blocks up to it, recomputing the scores and dP it needs: 7 matrix products
  a block pair where dk, dv and dq together need 5). Every gradient element is owned by one program, so
  there are no atomics and the result is bitwise reproducible. The halves also even out the causal
  triangle: key block i meets the T - i*BLOCK query rows after it, query block i the i*BLOCK keys before
  it, so every program does about T rows of work. They can run as two launches instead (config
  "bwd_schedule": "split"). Summing dq across key-block programs instead (in a fixed order through
  integer locks, or all key blocks of a head in one program) measured slower on the H200
  (bench/RESULTS.md, run J).
* TMA on sm_90: the tiles the loops stream (keys and values in the forward and in the backward's dq
  half, queries and dout in its dk/dv half) can come through TMA descriptors (configs "fwd_tma",
  "bwd_tma"; when the head size is a power of two and the rows are 16-byte aligned), which the pipeliner
  loads asynchronously. Both use them by default at head size 64 (bench/RESULTS.md, runs J and Q).

Both read q, k, v through the row stride 3C (no permute pass) and write dq, dk, dv into the (B, T, 3C)
gradient the QKV matmul's backward consumes. Head sizes need not be powers of two: the head dimension is
padded to the next power of two with masked loads (80, 96 -> 128; 24 -> 32). Storage is bf16 or fp32;
products accumulate in fp32; in fp32 storage the dots use IEEE fp32 (no TF32) so results match the
reference to ~1e-6.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import DOT_UPCAST, interpreting, tma_descriptor_class, tma_usable
from .flash_backward_wgmma import BLOCK_KEYS, flash_backward_wgmma, wgmma_backward_usable
from .matmul import column_sums_by_blocks

# rows of dq a row of flash_attention_backward's q_sums sums: the wgmma kernel's query block, so that a program
# there sums exactly one row (the tl.dot kernels' pass uses the same blocks)
Q_SUM_ROWS = BLOCK_KEYS

LOG2E = 1.4426950408889634  # (kernels spell their constants out: Triton jit code reads no plain globals)


# ----------------------------------------------------------------------------------------------------
# helpers

@triton.jit
def _mm(a, b, DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    # the interpreter's bf16 dot is broken: upcast there (bf16 values are exact in fp32, same result)
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mma(a, b, acc, DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _load_tile(ptr, rows, cols, row_stride, T, HS: tl.constexpr, CHECK_ROWS: tl.constexpr,
               EVEN_HS: tl.constexpr):
    """(len(rows), len(cols)) tile; rows past T and padded head channels read as 0."""
    ptrs = ptr + rows[:, None] * row_stride + cols[None, :]
    if CHECK_ROWS:
        if EVEN_HS:
            x = tl.load(ptrs, mask=(rows < T)[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows < T)[:, None] & (cols < HS)[None, :], other=0.0)
    else:
        if EVEN_HS:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(cols < HS)[None, :], other=0.0)
    return x


@triton.jit
def _store_tile(ptr, x, rows, cols, row_stride, T, HS: tl.constexpr, EVEN_HS: tl.constexpr):
    ptrs = ptr + rows[:, None] * row_stride + cols[None, :]
    if EVEN_HS:
        tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(rows < T)[:, None])
    else:
        tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(rows < T)[:, None] & (cols < HS)[None, :])


# ----------------------------------------------------------------------------------------------------
# forward

@triton.jit
def _head_bases(qkv_ptr, b, h, T, C, HS: tl.constexpr):
    """Where head h of batch row b starts in the (B, T, 3C) qkv layout: q, k and v, each read in place
    with a row stride of 3C (no permute pass)."""
    q_base = qkv_ptr + b.to(tl.int64) * T * (3 * C) + h * HS
    return q_base, q_base + C, q_base + 2 * C


@triton.jit
def _stream_tile(src, row0, col0, n0, rows, offs_d, row_stride, T, HS: tl.constexpr, CHECK_ROWS: tl.constexpr,
                 EVEN_HS: tl.constexpr, TMA: tl.constexpr):
    """A tile a loop streams (k, v, or in the dk/dv half q and dout): through a TMA descriptor of the 2-D
    (B*T, width) view at [row0 + n0, col0], or through the pointer src (the head's base) at rows (n0 +
    arange). TMA masks no rows: rows past T hold the next batch row's values (or zeros past the tensor's
    end), which the caller must hide (the causal mask does for keys)."""
    if TMA:
        return src.load([row0 + n0, col0])
    else:
        return _load_tile(src, rows, offs_d, row_stride, T, HS, CHECK_ROWS, EVEN_HS)


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_src, v_src, kv_row0, k_col0, v_col0, n0, offs_m, offs_d, row_stride, T,
               scale_log2, HS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_HS: tl.constexpr,
               TMA: tl.constexpr, DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One key/value block of the online softmax. Scores are kept in base 2: s2 = q.k * scale * log2(e)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    # off-diagonal blocks lie entirely below row offs_m[0] < T: no row mask needed there
    k = _stream_tile(k_src, kv_row0, k_col0, n0, offs_n, offs_d, row_stride, T, HS, MASKED, EVEN_HS, TMA)
    s = _mm(q, tl.trans(k), DOT_UPCAST, PREC) * scale_log2
    if MASKED:
        # causal: key n visible from query m iff n <= m; this also hides keys >= T from every row < T
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    # m_i is finite after the first block (key 0 is visible from every row), so no -inf - -inf
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _stream_tile(v_src, kv_row0, v_col0, n0, offs_n, offs_d, row_stride, T, HS, MASKED, EVEN_HS, TMA)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_UPCAST, PREC)
    return acc, l_i, m_new


@triton.jit
def _flash_fwd_kernel(qkv_ptr, qkv_desc, out_ptr, lse_ptr, T, NH, C, scale_log2,
                      HS: tl.constexpr, HS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      TMA: tl.constexpr, DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    """TMA: k and v tiles come through qkv_desc (a descriptor of qkv as (B*T, 3C) with [BLOCK_N, HS] boxes),
    which the pipeliner turns into asynchronous bulk copies; else through pointers (qkv_desc unused)."""
    # the last query blocks have the most keys: schedule them first so the tail of the grid is short
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    EVEN_HS: tl.constexpr = HS == HS_PAD
    row_stride = 3 * C
    q_base, k_base, v_base = _head_bases(qkv_ptr, b, h, T, C, HS)
    if TMA:
        k_src = qkv_desc
        v_src = qkv_desc
    else:
        k_src = k_base
        v_src = v_base
    kv_row0 = b * T  # the batch row's first row in the (B*T, 3C) view, for TMA
    k_col0 = C + h * HS
    v_col0 = 2 * C + h * HS

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HS_PAD)
    q = _load_tile(q_base, offs_m, offs_d, row_stride, T, HS, True, EVEN_HS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HS_PAD], dtype=tl.float32)
    # key blocks wholly at or below every row of this query block: no mask. The tiles are powers of two,
    # so one divides the other: the diagonal starts at the key block holding row m0.
    diag0 = (m0 // BLOCK_N) * BLOCK_N
    for n0 in range(0, diag0, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_src, v_src, kv_row0, k_col0, v_col0, n0, offs_m, offs_d,
                                   row_stride, T, scale_log2, HS, BLOCK_N, False, EVEN_HS, TMA, DOT_UPCAST, PREC)
    # the diagonal blocks, masked (keys after the block's last row, or past T, are hidden from every row)
    for n0 in range(diag0, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_src, v_src, kv_row0, k_col0, v_col0, n0, offs_m, offs_d,
                                   row_stride, T, scale_log2, HS, BLOCK_N, True, EVEN_HS, TMA, DOT_UPCAST, PREC)

    acc = acc / l_i[:, None]
    out_base = out_ptr + b.to(tl.int64) * T * C + h * HS
    _store_tile(out_base, acc, offs_m, offs_d, C, T, HS, EVEN_HS)
    # natural-log LSE of the scaled scores: log(2^m * l) = (m + log2 l) * ln 2
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(lse_ptr + bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


# ----------------------------------------------------------------------------------------------------
# backward

@triton.jit
def _flash_bwd_delta_kernel(out_ptr, dout_ptr, delta_ptr, T, NH, C,
                            HS: tl.constexpr, HS_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d]: the softmax backward's row sum
    sum_j P_tj dP_tj, since dP_tj = dout_t . v_j and sum_j P_tj v_j = out_t."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    EVEN_HS: tl.constexpr = HS == HS_PAD
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HS_PAD)
    base = b.to(tl.int64) * T * C + h * HS
    o = _load_tile(out_ptr + base, offs_t, offs_d, C, T, HS, True, EVEN_HS).to(tl.float32)
    do = _load_tile(dout_ptr + base, offs_t, offs_d, C, T, HS, True, EVEN_HS).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * T + offs_t, tl.sum(o * do, 1), mask=offs_t < T)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_src, do_src, row0, q_col0, do_col0, lse_base, delta_base, m0, offs_n, offs_d,
                row_stride, C, T, scale_log2, HS: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                EVEN_HS: tl.constexpr, TMA: tl.constexpr, EVEN_T: tl.constexpr, DOT_UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    """One query block's contribution to a key block's dk, dv, computed transposed (keys x queries) so
    the products land in dk, dv without transposing the accumulators. q and dout come through pointers
    (q_src, do_src: the head's bases) or TMA descriptors (at [row0 + m0, q_col0 / do_col0]).

    Through pointers, query rows >= T read q = dout = lse = delta = 0, so their p is finite and dv, dk get
    p * 0 from them; through TMA those rows hold the next batch row's q and dout, so their p is zeroed
    (EVEN_T: T is a multiple of BLOCK_M, there are no such rows, and no select an element)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _stream_tile(q_src, row0, q_col0, m0, offs_m, offs_d, row_stride, T, HS, True, EVEN_HS, TMA)
    do = _stream_tile(do_src, row0, do_col0, m0, offs_m, offs_d, C, T, HS, True, EVEN_HS, TMA)
    lse2 = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
    # both score products before the softmax: Triton waits for each at once, and this order leaves the
    # dv product in flight under dS's arithmetic (2 % faster at the power cap than dP^T after dv; run U)
    sT = _mm(k, tl.trans(q), DOT_UPCAST, PREC)
    dpT = _mm(v, tl.trans(do), DOT_UPCAST, PREC)
    # P^T from the saved LSE: p = exp(s - lse) = exp2(s2 - lse * log2 e)
    pT = tl.exp2(sT * scale_log2 - lse2[None, :])
    if MASKED:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    if TMA:
        if not EVEN_T:
            pT = tl.where(offs_m[None, :] < T, pT, 0.0)
    dv = _mma(pT.to(do.dtype), do, dv, DOT_UPCAST, PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = _mma(dsT.to(q.dtype), q, dk, DOT_UPCAST, PREC)
    return dk, dv


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_src, v_src, row0, k_col0, v_col0, n0, offs_m, offs_d, row_stride, T,
              scale_log2, HS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_HS: tl.constexpr,
              TMA: tl.constexpr, DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One key block's contribution to a query block's dq (k, v through pointers or TMA, as _stream_tile)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _stream_tile(k_src, row0, k_col0, n0, offs_n, offs_d, row_stride, T, HS, MASKED, EVEN_HS, TMA)
    v = _stream_tile(v_src, row0, v_col0, n0, offs_n, offs_d, row_stride, T, HS, MASKED, EVEN_HS, TMA)
    s = _mm(q, tl.trans(k), DOT_UPCAST, PREC)
    dp = _mm(do, tl.trans(v), DOT_UPCAST, PREC)  # before the softmax, as in _dkdv_block
    p = tl.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        # also hides keys >= T (read as 0, or the next batch row's through TMA) from the rows < T stored
        p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
    ds = p * (dp - delta[:, None])
    return _mma(ds.to(k.dtype), k, dq, DOT_UPCAST, PREC)


@triton.jit
def _flash_bwd_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, q_desc, do_desc, kv_desc,
                      T, NH, C, sm_scale, scale_log2,
                      HS: tl.constexpr, HS_PAD: tl.constexpr,
                      BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                      BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                      DO_DKDV: tl.constexpr, DO_DQ: tl.constexpr, TMA: tl.constexpr, EVEN_T: tl.constexpr,
                      DOT_UPCAST: tl.constexpr, PREC: tl.constexpr):
    """TMA: the tiles the loops stream (q and dout in the dk/dv half, k and v in the dq half) come through
    descriptors of qkv as (B*T, 3C) and dout as (B*T, C), with [BLOCK_M1, HS] and [BLOCK_N2, HS] boxes."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    EVEN_HS: tl.constexpr = HS == HS_PAD
    row_stride = 3 * C
    q_base, k_base, v_base = _head_bases(qkv_ptr, b, h, T, C, HS)
    do_base = dout_ptr + b.to(tl.int64) * T * C + h * HS
    dq_base = dqkv_ptr + b.to(tl.int64) * T * row_stride + h * HS
    lse_base = lse_ptr + bh.to(tl.int64) * T
    delta_base = delta_ptr + bh.to(tl.int64) * T
    offs_d = tl.arange(0, HS_PAD)
    # where the loops' tiles come from: descriptors (rows from b*T in the 2-D views) or the head's bases
    row0 = b * T
    if TMA:
        q_src = q_desc
        do_src = do_desc
        k_src = kv_desc
        v_src = kv_desc
    else:
        q_src = q_base
        do_src = do_base
        k_src = k_base
        v_src = v_base

    if DO_DKDV:
        # this program's key block; the query blocks that see it start at its first row
        n0 = pid * BLOCK_N1
        offs_n = n0 + tl.arange(0, BLOCK_N1)
        k = _load_tile(k_base, offs_n, offs_d, row_stride, T, HS, True, EVEN_HS)
        v = _load_tile(v_base, offs_n, offs_d, row_stride, T, HS, True, EVEN_HS)
        dk = tl.zeros([BLOCK_N1, HS_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N1, HS_PAD], dtype=tl.float32)
        # query blocks that overlap the key block's rows (the diagonal), masked: from the one holding row
        # n0 to the one holding row n0 + BLOCK_N1 - 1 (powers of two: one tile divides the other)
        diag_end = tl.cdiv(n0 + BLOCK_N1, BLOCK_M1) * BLOCK_M1
        for m0 in range((n0 // BLOCK_M1) * BLOCK_M1, tl.minimum(diag_end, T), BLOCK_M1):
            dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, row0, h * HS, h * HS, lse_base, delta_base, m0,
                                 offs_n, offs_d, row_stride, C, T, scale_log2, HS, BLOCK_M1, True, EVEN_HS, TMA,
                                 EVEN_T, DOT_UPCAST, PREC)
        # query blocks wholly after the key block: every pair visible
        for m0 in range(diag_end, T, BLOCK_M1):
            dk, dv = _dkdv_block(dk, dv, k, v, q_src, do_src, row0, h * HS, h * HS, lse_base, delta_base, m0,
                                 offs_n, offs_d, row_stride, C, T, scale_log2, HS, BLOCK_M1, False, EVEN_HS, TMA,
                                 EVEN_T, DOT_UPCAST, PREC)
        # dS is the gradient of the scaled scores; the scale moves onto dk (and dq below)
        _store_tile(dq_base + C, dk * sm_scale, offs_n, offs_d, row_stride, T, HS, EVEN_HS)
        _store_tile(dq_base + 2 * C, dv, offs_n, offs_d, row_stride, T, HS, EVEN_HS)

    if DO_DQ:
        m0 = pid * BLOCK_M2
        offs_m = m0 + tl.arange(0, BLOCK_M2)
        q = _load_tile(q_base, offs_m, offs_d, row_stride, T, HS, True, EVEN_HS)
        do = _load_tile(do_base, offs_m, offs_d, C, T, HS, True, EVEN_HS)
        lse2 = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
        dq = tl.zeros([BLOCK_M2, HS_PAD], dtype=tl.float32)
        # key blocks wholly at or below row m0, then the diagonal ones from the key block holding row m0
        diag0 = (m0 // BLOCK_N2) * BLOCK_N2
        for n0 in range(0, diag0, BLOCK_N2):
            dq = _dq_block(dq, q, do, lse2, delta, k_src, v_src, row0, C + h * HS, 2 * C + h * HS, n0, offs_m,
                           offs_d, row_stride, T, scale_log2, HS, BLOCK_N2, False, EVEN_HS, TMA, DOT_UPCAST, PREC)
        for n0 in range(diag0, tl.minimum(m0 + BLOCK_M2, T), BLOCK_N2):
            dq = _dq_block(dq, q, do, lse2, delta, k_src, v_src, row0, C + h * HS, 2 * C + h * HS, n0, offs_m,
                           offs_d, row_stride, T, scale_log2, HS, BLOCK_N2, True, EVEN_HS, TMA, DOT_UPCAST, PREC)
        _store_tile(dq_base, dq * sm_scale, offs_m, offs_d, row_stride, T, HS, EVEN_HS)


# ----------------------------------------------------------------------------------------------------
# configuration

# Default tiles for 16-bit storage on H200 (sm_90), keyed by head size (the next key up serves sizes in
# between). Chosen by timing a sweep of candidates on an H200 (2026-12-01, triton 3.6, B=64 T=1024 NH=12
# hs=64 and B=32 NH=6 hs=128; bench/RESULTS.md): forward 128x64 tiles with 8 warps at hs 64 (0.365 ms)
# and 64x64 with 4 warps at hs 128 (0.166 ms); backward 32-row query tiles against 64-key tiles, 4 warps,
# 3 stages for both (1.135 ms and 0.507 ms, against 1.357 and 1.179 ms for the first, untimed guesses).
# `python -m bench.kernels.bench_flash_attention` reruns the sweep. Re-swept at hs 64 (run J): the forward
# takes its keys and values through TMA with 64x64 tiles, 4 warps (0.351 ms against 0.362 for the pointer
# kernel's 128x64; where TMA is unavailable the same tiles run through pointers), and the backward's dq
# half takes 64-key tiles (0.986 ms against 1.143 with 32-key tiles; cuDNN's backward: 1.033 ms). Timed
# cleanly at last (session 11), the backward's streamed tiles through TMA: 0.976 ms against 1.095 for the
# same tiles through pointers in the same sweep, and the whole step 1.8 ms faster (run Q). On sm_90 the
# backward at hs 64 is the Gluon wgmma kernel with the same tiles (flash_backward_wgmma; run V: 0.980 ms
# against 0.998 at the power cap, the step 0.5-0.6 ms faster, gradients bitwise equal).
_CONFIGS_16 = {
    64: dict(BLOCK_M=64, BLOCK_N=64, fwd_warps=4, fwd_stages=3, fwd_tma=True,
             BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_warps=4, bwd_stages=3, bwd_tma=True,
             bwd_kernel="wgmma", wgmma_a_regs=1, wgmma_maxnreg=168),
    128: dict(BLOCK_M=64, BLOCK_N=64, fwd_warps=4, fwd_stages=3,
              BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, bwd_warps=4, bwd_stages=3),
}
# fp32 storage is the correctness configuration: IEEE fp32 dots (CUDA-core FMAs, no TF32), with tiles
# small enough not to spill.
_CONFIGS_32 = {
    64: dict(BLOCK_M=32, BLOCK_N=32, fwd_warps=4, fwd_stages=2,
             BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, bwd_warps=4, bwd_stages=2),
    128: dict(BLOCK_M=32, BLOCK_N=16, fwd_warps=4, fwd_stages=2,
              BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, bwd_warps=4, bwd_stages=2),
}
# The interpreter runs every program in Python: the smallest tiles tl.dot accepts (16).
_CONFIG_INTERPRET = dict(BLOCK_M=16, BLOCK_N=16, fwd_warps=4, fwd_stages=1,
                         BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, bwd_warps=4, bwd_stages=1)
# the fields the tables above leave at their default
_FIELD_DEFAULTS = dict(fwd_tma=False, bwd_schedule="fused", bwd_tma=False, bwd_kernel="tl.dot",
                       wgmma_stages=(3, 3), wgmma_a_regs=0, wgmma_maxnreg=None)
_DELTA_BLOCK_T = 64

# How the backward gets dq: "fused" (program i also owns query block i) or "split" (the same two halves as
# two launches).
BWD_SCHEDULES = ("fused", "split")

# Which kernel runs the backward: "tl.dot" (_flash_bwd_kernel above, every shape and dtype, CPU-tested) or
# "wgmma" (flash_backward_wgmma: the fused schedule with explicit asynchronous wgmma, Gluon, sm_90 only;
# where it does not apply - another GPU, fp32, head size != 64, T not a multiple of 64 - the tl.dot kernel
# serves). wgmma_stages: its TMA rings' depths (dk/dv half, dq half); wgmma_a_regs: which loop-invariant A
# operands of its dk/dv half's score products come from registers instead of shared memory (flash_backward_wgmma's
# A_REGS: 0 none, 1 k, 2 v, 3 both); wgmma_maxnreg: its register cap a thread (None: ptxas's choice). At hs 64
# k comes from registers at 168 registers, three programs an SM (1.4 % faster at the power cap, run AL).
BWD_KERNELS = ("tl.dot", "wgmma")

# Override hook: FLASH_CONFIGS[hs] (or FLASH_CONFIGS[(hs, dtype)], which wins) = dict of the fields above
# to replace, e.g. FLASH_CONFIGS[64] = {"BLOCK_M": 64, "fwd_warps": 8}. Read at every launch; a new value
# compiles a new kernel variant on its next use (so set it before CUDA-graph capture).
FLASH_CONFIGS: dict = {}


def flash_config(hs: int, dtype: torch.dtype) -> dict:
    """The tile configuration for head size hs and storage dtype (table, then FLASH_CONFIGS overrides)."""
    if interpreting():
        cfg = {**_FIELD_DEFAULTS, **_CONFIG_INTERPRET}
    else:
        table = _CONFIGS_32 if dtype == torch.float32 else _CONFIGS_16
        cfg = {**_FIELD_DEFAULTS, **table[min(k for k in table if k >= hs)]}  # hs <= 128: asserted by the launchers
    cfg.update(FLASH_CONFIGS.get(hs, {}))
    cfg.update(FLASH_CONFIGS.get((hs, dtype), {}))
    # the loops split the causal triangle at block boundaries, which needs one tile of each pair to divide
    # the other; tl.arange needs powers of two anyway, and those always do
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
        assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0, f"{key} = {cfg[key]}: a power of two >= 16"
    assert cfg["bwd_schedule"] in BWD_SCHEDULES, f"bwd_schedule {cfg['bwd_schedule']!r}: one of {BWD_SCHEDULES}"
    assert cfg["bwd_kernel"] in BWD_KERNELS, f"bwd_kernel {cfg['bwd_kernel']!r}: one of {BWD_KERNELS}"
    assert len(cfg["wgmma_stages"]) == 2 and min(cfg["wgmma_stages"]) >= 2, \
        f"wgmma_stages {cfg['wgmma_stages']}: two ring depths >= 2"
    assert cfg["wgmma_a_regs"] in (0, 1, 2, 3), f"wgmma_a_regs {cfg['wgmma_a_regs']}: 0-3 (bit 0 k, bit 1 v)"
    assert cfg["bwd_schedule"] != "fused" or cfg["BLOCK_N1"] == cfg["BLOCK_M2"], \
        "fused backward needs BLOCK_N1 == BLOCK_M2"
    return cfg


def _head_dims(C: int, num_heads: int):
    assert C % num_heads == 0, (C, num_heads)
    hs = C // num_heads
    assert 1 <= hs <= 128, f"head size {hs} unsupported (max 128)"
    # tl.dot needs every dimension >= 16
    return hs, max(16, triton.next_power_of_2(hs))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the latter is ignored for 16-bit operands


# ----------------------------------------------------------------------------------------------------
# launchers

def _tma_descriptors(enabled: bool, hs: int, hs_pad: int, *tiles) -> tuple:
    """TMA descriptors for (tensor (B, T, width), tile rows) pairs, each over the 2-D (B*T, width) view with
    [rows, hs] boxes; all None when TMA is off, the head size is padded, or a view is not TMA-addressable
    (then the kernels load through pointers)."""
    views = [(t.view(-1, t.shape[-1]), rows) for t, rows in tiles]
    if not (enabled and hs == hs_pad and tma_usable(*(v for v, _ in views))):
        return (None,) * len(tiles)
    TD = tma_descriptor_class()
    return tuple(TD.from_tensor(v, [rows, hs]) for v, rows in views)


def flash_attention_forward(out: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor, num_heads: int):
    """Causal attention of qkv (B, T, 3C) into out (B, T, C); lse (B, NH, T) fp32 gets each row's
    log-sum-exp of the scaled scores (natural log), kept for the backward. Returns (out, lse)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    assert C3 == 3 * C and out.shape == (B, T, C) and lse.shape == (B, num_heads, T), (qkv.shape, out.shape, lse.shape)
    assert qkv.dtype in (torch.float32, torch.bfloat16) and out.dtype == qkv.dtype and lse.dtype == torch.float32
    assert qkv.is_contiguous() and out.is_contiguous() and lse.is_contiguous()
    assert qkv.device == out.device == lse.device
    hs, hs_pad = _head_dims(C, num_heads)
    cfg = flash_config(hs, qkv.dtype)
    scale = 1.0 / math.sqrt(hs)
    grid = (triton.cdiv(T, cfg["BLOCK_M"]), B * num_heads)
    (qkv_desc,) = _tma_descriptors(cfg["fwd_tma"], hs, hs_pad, (qkv, cfg["BLOCK_N"]))
    _flash_fwd_kernel[grid](qkv, qkv_desc, out, lse, T, num_heads, C, scale * LOG2E,
                            HS=hs, HS_PAD=hs_pad, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                            TMA=qkv_desc is not None, DOT_UPCAST=DOT_UPCAST, PREC=_precision(qkv.dtype),
                            num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"])
    return out, lse


def flash_attention_backward(dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, num_heads: int, delta: torch.Tensor | None = None,
                             q_sums: torch.Tensor | None = None):
    """Gradient of qkv (B, T, 3C) from dout (B, T, C), written over dqkv (B, T, 3C), given the forward's
    out and lse. delta (B, NH, T) fp32 is scratch; pass it preallocated to keep the launcher allocation-free
    (CUDA-graph capture). Deterministic: no atomics. Returns dqkv.

    q_sums: None, or fp32 (q_sum_blocks(B, T), C): row r receives the column sums of dq over rows
    [Q_SUM_ROWS * r, Q_SUM_ROWS * (r + 1)) of the (B*T) rows, the QKV bias gradient's query part in pieces
    (kernels.matmul.qkv_bias_backward adds them up). The wgmma kernel sums its fp32 dq as it stores it, so
    no pass reads dq again; the tl.dot kernels are followed by a pass over dq's columns."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    assert dqkv.shape == qkv.shape and dout.shape == (B, T, C) and out.shape == (B, T, C)
    assert lse.shape == (B, num_heads, T) and lse.dtype == torch.float32
    assert qkv.dtype in (torch.float32, torch.bfloat16)
    assert dqkv.dtype == dout.dtype == out.dtype == qkv.dtype
    for t in (dqkv, dout, qkv, out, lse):
        assert t.is_contiguous() and t.device == qkv.device
    if delta is None:
        delta = torch.empty((B, num_heads, T), dtype=torch.float32, device=qkv.device)
    assert delta.shape == (B, num_heads, T) and delta.dtype == torch.float32 and delta.is_contiguous()
    if q_sums is not None:
        assert q_sums.shape == (q_sum_blocks(B, T), C) and q_sums.dtype == torch.float32 and q_sums.is_contiguous()
        assert q_sums.device == qkv.device
    hs, hs_pad = _head_dims(C, num_heads)
    cfg = flash_config(hs, qkv.dtype)
    scale = 1.0 / math.sqrt(hs)
    prec = _precision(qkv.dtype)

    _flash_bwd_delta_kernel[(triton.cdiv(T, _DELTA_BLOCK_T), B * num_heads)](
        out, dout, delta, T, num_heads, C, HS=hs, HS_PAD=hs_pad, BLOCK_T=_DELTA_BLOCK_T, num_warps=4)
    if cfg["bwd_kernel"] == "wgmma" and wgmma_backward_usable(qkv, T, hs, dout, dqkv):
        return flash_backward_wgmma(dqkv, dout, qkv, lse, delta, num_heads, scale, scale * LOG2E,
                                    cfg["wgmma_stages"], q_sums=q_sums, a_regs=cfg["wgmma_a_regs"],
                                    maxnreg=cfg["wgmma_maxnreg"])

    common = dict(HS=hs, HS_PAD=hs_pad, BLOCK_M1=cfg["BLOCK_M1"], BLOCK_N1=cfg["BLOCK_N1"],
                  BLOCK_M2=cfg["BLOCK_M2"], BLOCK_N2=cfg["BLOCK_N2"], DOT_UPCAST=DOT_UPCAST, PREC=prec,
                  num_warps=cfg["bwd_warps"], num_stages=cfg["bwd_stages"])
    descs = _tma_descriptors(cfg["bwd_tma"], hs, hs_pad, (qkv, cfg["BLOCK_M1"]), (dout, cfg["BLOCK_M1"]),
                             (qkv, cfg["BLOCK_N2"]))
    common["TMA"] = descs[0] is not None
    common["EVEN_T"] = T % cfg["BLOCK_M1"] == 0  # no query rows past T in the dk/dv half's tiles
    args = (qkv, dout, lse, delta, dqkv, *descs, T, num_heads, C, scale, scale * LOG2E)
    if cfg["bwd_schedule"] == "fused":
        # program i: key block i's dk, dv and query block i's dq (BLOCK_N1 == BLOCK_M2)
        _flash_bwd_kernel[(triton.cdiv(T, cfg["BLOCK_N1"]), B * num_heads)](*args, DO_DKDV=True, DO_DQ=True, **common)
    else:
        _flash_bwd_kernel[(triton.cdiv(T, cfg["BLOCK_N1"]), B * num_heads)](*args, DO_DKDV=True, DO_DQ=False, **common)
        _flash_bwd_kernel[(triton.cdiv(T, cfg["BLOCK_M2"]), B * num_heads)](*args, DO_DKDV=False, DO_DQ=True, **common)
    if q_sums is not None:
        column_sums_by_blocks(q_sums, dqkv.view(B * T, C3)[:, :C], Q_SUM_ROWS)
    return dqkv


def q_sum_blocks(B: int, T: int) -> int:
    """Rows of flash_attention_backward's q_sums: blocks of Q_SUM_ROWS of the B*T rows."""
    return triton.cdiv(B * T, Q_SUM_ROWS)
