"""AdamW over the whole flat parameter buffer in one launch (llm.c's adamw.cuh).

One program per BLOCK of elements: read the gradient, scale it (clipping), update m and v (fp32),
apply the bias-corrected step plus decoupled weight decay, write the parameter. With fp32 master
weights the master copy is updated and the bf16 working copy is written from it by stochastic rounding;
without master weights the bf16 parameter itself is updated and rounded stochastically, since
round-to-nearest would drop every update smaller than half a bf16 ulp (the silent A3 bug).

The hyper-parameters that change from step to step (learning rate, bias corrections, gradient scale,
rounding seed) are read from a small device tensor, not passed as kernel arguments, so one CUDA graph
of the whole step replays correctly for every step. The host precomputes the bias corrections
1 - beta^t, as llm.c's launcher does, so the kernel has no pow.

Weight decay applies to the 2-D tensors only: the launcher gets their [start, end) ranges in the flat
buffer (five spans for GPT-2: wte+wpe, qkvw, attprojw, fcw, fcprojw) and each element checks them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import store_rounded

BLOCK = 2048
# adamw_update's launch: 1024 elements a program over 4 warps (8 a thread). On the H200 at GPT-2 124M's
# 124.5 M parameters with master weights (28 bytes an element): 0.852 ms a step against 0.895-0.953 for
# 2048 over 8 warps under triton 3.6, 0.850 against 1.066-1.103 under triton 3.8 (bench/RESULTS.md run AH).
# Elementwise, so the results do not depend on it.
UPDATE_BLOCK, UPDATE_WARPS = 1024, 4
MAX_DECAY_RANGES = 8

# slots of the hyper-parameter tensor (fp32)
LR, BETA1, BETA2, BETA1_CORRECTION, BETA2_CORRECTION, EPS, WEIGHT_DECAY, GRAD_SCALE = range(8)
NUM_HYPER = 8


@triton.jit
def _decay_mask(offs, ranges_ptr, NUM_RANGES: tl.constexpr):
    decay = offs < 0  # all False, of the right shape
    for r in tl.static_range(NUM_RANGES):
        start = tl.load(ranges_ptr + 2 * r)
        end = tl.load(ranges_ptr + 2 * r + 1)
        decay = decay | ((offs >= start) & (offs < end))
    return decay


@triton.jit
def adamw_kernel(params_ptr, master_ptr, grads_ptr, m_ptr, v_ptr, hyper_ptr, seed_ptr, ranges_ptr,
                 n, offset,
                 NUM_RANGES: tl.constexpr, HAS_MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
                 BLOCK: tl.constexpr, WIDE_INDEX: tl.constexpr):
    # WIDE_INDEX, 64-bit indices, where an index can pass 2^31: d60 and larger models have more than 2^31
    # parameters, and a ZeRO-1 shard's global indices (offset + local) can cross 2^31 where its offset and
    # length do not; smaller models keep the 32-bit arithmetic the step was tuned with
    pid = tl.program_id(0)
    if WIDE_INDEX:
        pid = pid.to(tl.int64)
    local = pid * BLOCK + tl.arange(0, BLOCK)
    mask = local < n
    # the element's index in the whole model: decay ranges and rounding streams are defined on it,
    # so a shard (ZeRO-1) updates its elements exactly as the unsharded update would
    offs = local + offset

    lr = tl.load(hyper_ptr + 0)
    beta1 = tl.load(hyper_ptr + 1)
    beta2 = tl.load(hyper_ptr + 2)
    beta1_correction = tl.load(hyper_ptr + 3)
    beta2_correction = tl.load(hyper_ptr + 4)
    eps = tl.load(hyper_ptr + 5)
    weight_decay = tl.load(hyper_ptr + 6)
    grad_scale = tl.load(hyper_ptr + 7)

    grad = tl.load(grads_ptr + local, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * grad_scale
    m = tl.load(m_ptr + local, mask=mask, other=0.0)
    v = tl.load(v_ptr + local, mask=mask, other=0.0)
    if HAS_MASTER:
        param = tl.load(master_ptr + local, mask=mask, other=0.0)
    else:
        param = tl.load(params_ptr + local, mask=mask, other=0.0).to(tl.float32)

    # lerp written as two FMAs so it is exact at its end points: m = beta1 * m + (1 - beta1) * grad
    m = tl.fma(beta1, m - grad, grad)
    v = tl.fma(beta2, v - grad * grad, grad * grad)
    m_hat = m / beta1_correction
    v_hat = v / beta2_correction
    wd = tl.where(_decay_mask(offs, ranges_ptr, NUM_RANGES), weight_decay, 0.0)
    param = param - lr * (m_hat / (tl.sqrt(v_hat) + eps) + wd * param)

    tl.store(m_ptr + local, m, mask=mask)
    tl.store(v_ptr + local, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + local, param, mask=mask)
    # the rounding stream's counter: the index modulo 2^32 (32-bit Philox, the same for either index width)
    store_rounded(params_ptr + local, param, mask, tl.load(seed_ptr), offs.to(tl.int32), STOCHASTIC)


@triton.jit
def init_from_master_kernel(params_ptr, master_ptr, seed_ptr, n, offset, STOCHASTIC: tl.constexpr,
                            BLOCK: tl.constexpr, WIDE_INDEX: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE_INDEX:  # see adamw_kernel
        pid = pid.to(tl.int64)
    local = pid * BLOCK + tl.arange(0, BLOCK)
    mask = local < n
    x = tl.load(master_ptr + local, mask=mask)
    store_rounded(params_ptr + local, x, mask, tl.load(seed_ptr), (local + offset).to(tl.int32), STOCHASTIC)


def decay_ranges_tensor(ranges, device) -> torch.Tensor:
    """[start, end) spans of the flat buffer that get weight decay, as the int64 table the kernel reads."""
    ranges = list(ranges)
    assert len(ranges) <= MAX_DECAY_RANGES
    flat = [x for r in ranges for x in r] or [0, 0]
    return torch.tensor(flat, dtype=torch.int64, device=device)


def hyper_tensor(device) -> torch.Tensor:
    return torch.zeros(NUM_HYPER, dtype=torch.float32, device=device)


def set_hyper(hyper: torch.Tensor, lr: float, step: int, beta1: float, beta2: float, eps: float,
              weight_decay: float, grad_scale: float | None = None, host: torch.Tensor | None = None):
    """Fill the hyper-parameter tensor for AdamW step `step` (from 1). grad_scale None leaves the slot
    as it is (written on the device by global_norm.clip_scale). host: a pinned fp32 (GRAD_SCALE,) buffer
    to stage the values in (the copy from it is asynchronous: the caller must not rewrite it before the
    copy has run); None: a fresh host tensor each call."""
    values = [lr, beta1, beta2, 1.0 - beta1 ** step, 1.0 - beta2 ** step, eps, weight_decay]
    if host is None:
        host = torch.tensor(values, dtype=torch.float32)
    else:
        assert host.dtype == torch.float32 and host.shape == (GRAD_SCALE,)
        host.numpy()[:] = values
    hyper[:GRAD_SCALE].copy_(host, non_blocking=hyper.is_cuda)
    if grad_scale is not None:
        hyper[GRAD_SCALE] = grad_scale


def _wide_index(n: int, offset: int, block: int) -> bool:
    """Whether a kernel's indices (offset + program * block + lane, past n by less than a block) can pass int32."""
    return offset + n + block > 2**31 - 1


def adamw_update(params, grads, m, v, hyper, seed, decay_ranges, master=None, offset: int = 0,
                 stochastic: bool = True):
    """One AdamW step over flat buffers: params (bf16 or fp32), grads (params' dtype, or fp32: the
    accumulated / reduced gradient of llmpy.distributed), m, v and
    master (fp32, optional). hyper: set_hyper's tensor; seed: a 1-element int tensor on the device (a
    fresh value each step); decay_ranges: decay_ranges_tensor(...); offset: the index of params[0] in
    the whole model (non-zero for a ZeRO-1 shard). stochastic: round bf16 parameters stochastically
    (False only to show what round-to-nearest does)."""
    n = params.numel()
    for t in (params, grads, m, v):
        assert t.numel() == n and t.is_contiguous()
    assert m.dtype == torch.float32 and v.dtype == torch.float32
    if master is not None:
        assert master.dtype == torch.float32 and master.numel() == n and master.is_contiguous()
    sr = stochastic and params.dtype == torch.bfloat16
    adamw_kernel[(triton.cdiv(n, UPDATE_BLOCK),)](
        params, master if master is not None else params, grads, m, v, hyper, seed, decay_ranges, n, offset,
        NUM_RANGES=decay_ranges.numel() // 2, HAS_MASTER=master is not None, STOCHASTIC=sr, BLOCK=UPDATE_BLOCK,
        WIDE_INDEX=_wide_index(n, offset, UPDATE_BLOCK), num_warps=UPDATE_WARPS)


def init_from_master(params, master, seed, offset: int = 0):
    """Write the working-precision parameters from the fp32 master copy (stochastic rounding to bf16):
    used when resuming from a checkpoint that holds master weights."""
    n = params.numel()
    assert master.numel() == n and master.dtype == torch.float32
    assert params.is_contiguous() and master.is_contiguous()
    init_from_master_kernel[(triton.cdiv(n, BLOCK),)](params, master, seed, n, offset,
                                                      STOCHASTIC=params.dtype == torch.bfloat16, BLOCK=BLOCK,
                                                      WIDE_INDEX=_wide_index(n, offset, BLOCK), num_warps=8)
