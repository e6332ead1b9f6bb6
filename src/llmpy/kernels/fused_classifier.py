"""Softmax + cross-entropy + logit gradient in one kernel, as llm.c's fused_classifier_kernel5.

One program per row (b, t) of the (B*T, Vp) logits, so no row is ever split across programs and the
loss is computed from the logits before the same program overwrites them (the race llm.c once had
cannot happen):

1. one pass over the V real columns in BLOCK-wide chunks with an online softmax kept per lane: a
   running max m and sum s of exp(x - m). The update needs one exp per element, not two:
   e = exp(-|x - m|), then s = s * e + 1 when x is the new max, s + e otherwise. The lanes are merged
   once at the end (max, then the rescaled sum). The target's logit is picked up in the same pass,
   from the chunk that holds it, so it is read before anything is written. Everything is
   fp32; exp is exp2 of log2(e)-scaled logits. Loads are masked at Vp, not V: with V = 50257 odd a
   V mask would split every load into scalars; the padding columns are read and dropped in registers.
2. loss = logsumexp - logit[target] (fp32), written to losses.
3. when WRITE_DLOGITS (training), a second pass over the row writes the gradient
   (softmax - onehot(target)) * dloss IN PLACE over the logits, and zeros into the padding columns
   [V, Vp). The first pass asks the cache to keep the row (evict_last) so the second read can hit L2;
   the second streams (evict_first). Ideal traffic: read the logits twice, write them once.
   Validation (WRITE_DLOGITS=False) reads them once and leaves them untouched.

The launcher only launches (no allocation, no host sync), so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# GPU defaults, untuned (bench_fused_classifier sweeps the alternatives): 2048 columns an iteration at
# 8 warps is 8 values a thread (one 16-byte bf16 vector) and two fp32 lane arrays of state (~60
# registers, 4 programs an SM). STAGES > 1 asks Triton to software-pipeline the row loads (cp.async
# into shared memory on sm_90): more bytes in flight per program, at ~90 registers.
FC_BLOCK = 2048
FC_WARPS = 8
FC_STAGES = 1


# ----------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _fused_classifier_kernel(logits_ptr, losses_ptr, targets_ptr, dloss, V, Vp,
                             BLOCK: tl.constexpr, WRITE_DLOGITS: tl.constexpr, STAGES: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * Vp  # B*T*Vp exceeds 2^31 at GPT-2 sizes: 64-bit row offset
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row).to(tl.int32)

    # pass 1: per-lane online max/sum in log2 units. m starts finite so that -inf (masked) lanes give
    # exp2(-inf) = 0, never inf - inf.
    m = tl.full([BLOCK], -3.0e38, dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    xt = 0.0
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        c = start + cols
        # mask with Vp (a multiple of 16 in practice: the loads stay vectorised), then drop [V, Vp)
        x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = tl.where(c < V, x, float("-inf"))
        if (target >= start) & (target < start + BLOCK):  # the same for the whole program: no divergence
            xt += tl.sum(tl.where(c == target, x, 0.0), axis=0)
        x2 = x * LOG2E
        e = tl.exp2(tl.minimum(x2, m) - tl.maximum(x2, m))
        s = tl.where(x2 > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x2)
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp2(m - mx), axis=0)
    lse = (mx + tl.log2(total)) * LN2
    tl.store(losses_ptr + row, lse - xt)

    if WRITE_DLOGITS:
        # pass 2: p = exp(x - lse) straight from the log-sum-exp (no division), gradient in place
        lse2 = mx + tl.log2(total)
        for start in tl.range(0, Vp, BLOCK, num_stages=STAGES):
            c = start + cols
            x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_first").to(tl.float32)
            p = tl.exp2(x * LOG2E - lse2)
            g = (p - tl.where(c == target, 1.0, 0.0)) * dloss
            g = tl.where(c < V, g, 0.0)
            tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < Vp)


# ----------------------------------------------------------------------------------------------------
# launcher

def fused_classifier(logits: torch.Tensor, losses: torch.Tensor, dloss: float, targets: torch.Tensor, V: int,
                     write_dlogits: bool = True, block_size: int = FC_BLOCK, num_warps: int = FC_WARPS,
                     stages: int = FC_STAGES):
    """losses (B, T) fp32 = logsumexp(logits[..., :V]) - logits[target]; when write_dlogits, the logits
    (B, T, Vp) are overwritten by (softmax - onehot(target)) * dloss, with 0 in [V, Vp).

    dloss: the gradient of each loss, 1 / (B * T * grad_accum_steps). targets: int32/int64 in [0, V)
    (not checked: that would need a host sync). Any leading shape works: logits (..., Vp), losses and
    targets (...). block_size / num_warps / stages: tuning knobs (columns per iteration, warps, software
    pipelining depth of the row loops). Returns (losses, logits).
    """
    Vp = logits.shape[-1]
    rows = logits.numel() // Vp if Vp else 0
    assert 0 < V <= Vp, f"V={V} Vp={Vp}"
    assert logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
    assert losses.dtype == torch.float32 and losses.is_contiguous() and losses.numel() == rows
    assert targets.dtype in (torch.int32, torch.int64) and targets.is_contiguous() and targets.numel() == rows
    assert logits.device == losses.device == targets.device
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    if rows:
        _fused_classifier_kernel[(rows,)](logits, losses, targets, float(dloss), V, Vp,
                                          BLOCK=block_size, WRITE_DLOGITS=bool(write_dlogits),
                                          STAGES=stages, num_warps=num_warps)
    return losses, logits
