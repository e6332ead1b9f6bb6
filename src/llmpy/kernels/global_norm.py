"""Global gradient norm in two deterministic levels (llm.c's global_norm.cuh), and the clip scale.

Level 1: a fixed number of programs, each summing the squares of its grid-strided share of the flat
gradient buffer in fp32 into its own slot of a partials buffer. Level 2: one program sums the
partials in a fixed order. No atomics: the same gradients give the same norm bit for bit, whatever the
GPU's scheduling, which the multi-GPU bit-exactness (A4) needs.

The result stays on the device: `clip_scale` turns it into AdamW's gradient scale without a host
sync, so the whole step, optimizer included, can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting

# Level-1 programs: enough to fill an H200 (132 SMs) several times over, fixed so the summation order
# never depends on the machine. Triton's interpreter runs each program in Python: a few there.
NUM_PARTIALS = 16 if interpreting() else 1024
BLOCK = 4096


@triton.jit
def global_norm_squared_kernel(grads_ptr, partials_ptr, n, NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        g = tl.load(grads_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += g * g
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def global_norm_aggregate_kernel(partials_ptr, out_ptr, num_partials, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    total = tl.sum(tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0), axis=0)
    if ACCUMULATE:  # several buffers (or shards) add into one squared norm, in call order
        total += tl.load(out_ptr)
    tl.store(out_ptr, total)


@triton.jit
def clip_scale_kernel(norm_squared_ptr, scale_ptr, max_norm):
    # llm.c: scale = max_norm / norm when the norm is above max_norm, else 1 (max_norm <= 0: no clip)
    norm = tl.sqrt(tl.load(norm_squared_ptr))
    clip = (max_norm > 0.0) & (norm > max_norm)
    tl.store(scale_ptr, tl.where(clip, max_norm / norm, 1.0))


def global_norm_partials(device) -> torch.Tensor:
    """The fp32 scratch the first level writes into."""
    return torch.empty(NUM_PARTIALS, dtype=torch.float32, device=device)


def global_norm_squared(out: torch.Tensor, grads: torch.Tensor, partials: torch.Tensor, accumulate: bool = False):
    """out (1-element fp32) = sum of grads**2 (+ out when accumulate). grads: a flat bf16/fp32 buffer."""
    assert grads.is_contiguous() and out.dtype == torch.float32 and out.numel() == 1
    assert partials.numel() >= NUM_PARTIALS and partials.dtype == torch.float32
    n = grads.numel()
    global_norm_squared_kernel[(NUM_PARTIALS,)](grads, partials, n, NUM_PROGRAMS=NUM_PARTIALS, BLOCK=BLOCK,
                                                 num_warps=8)
    global_norm_aggregate_kernel[(1,)](partials, out, NUM_PARTIALS, ACCUMULATE=accumulate,
                                       BLOCK=triton.next_power_of_2(NUM_PARTIALS), num_warps=4)
    return out


def clip_scale(scale: torch.Tensor, norm_squared: torch.Tensor, max_norm: float):
    """scale (1-element fp32, on the device) = the gradient scale that clips the norm to max_norm."""
    clip_scale_kernel[(1,)](norm_squared, scale, float(max_norm))
    return scale
