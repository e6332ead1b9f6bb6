"""Global gradient norm in two deterministic levels (llm.c's global_norm.cuh), and the clip scale.

Level 1: the flat gradient buffer is cut into fixed chunks of NORM_CHUNK elements; one program a chunk
sums the squares of its elements in fp32 into the chunk's slot of a partials buffer. Level 2: one
program sums the partials in a fixed order. No atomics: the same gradients give the same norm bit for
bit, whatever the GPU's scheduling. And since a chunk's partial depends only on the chunk, a buffer
split at chunk boundaries (the ZeRO-1 shards of llmpy.distributed) gives every chunk's partial on the
rank that holds it: gathered in chunk order and summed by level 2, the norm of N shards is bitwise the
norm one GPU computes over the whole buffer (the multi-GPU bit-exactness of A4).

The result stays on the device: `clip_scale` turns it into AdamW's gradient scale without a host
sync, so the whole step, optimizer included, can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting

# Elements a level-1 partial covers (1900 partials for GPT-2 124M). Fixed, so the summation order never
# depends on the machine or the GPU count; the interpreter runs each program in Python: short chunks
# there keep a tiny model at a few dozen partials, so that shards of it hold several.
NORM_CHUNK = 2048 if interpreting() else 65536
BLOCK = min(4096, NORM_CHUNK)
AGGREGATE_BLOCK = 1024


def num_norm_partials(n: int) -> int:
    """Level-1 partials (chunks) of an n-element buffer."""
    return triton.cdiv(n, NORM_CHUNK)


@triton.jit
def global_norm_squared_kernel(grads_ptr, partials_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(0, CHUNK, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        g = tl.load(grads_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += g * g
    tl.store(partials_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def global_norm_aggregate_kernel(partials_ptr, out_ptr, count, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    # blocks of partials added lane-wise in order, then one tree: the order depends on count alone
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < count, other=0.0)
    total = tl.sum(acc, axis=0)
    if ACCUMULATE:  # several buffers add into one squared norm, in call order
        total += tl.load(out_ptr)
    tl.store(out_ptr, total)


@triton.jit
def clip_scale_kernel(norm_squared_ptr, scale_ptr, max_norm):
    # llm.c: scale = max_norm / norm when the norm is above max_norm, else 1 (max_norm <= 0: no clip)
    norm = tl.sqrt(tl.load(norm_squared_ptr))
    clip = (max_norm > 0.0) & (norm > max_norm)
    tl.store(scale_ptr, tl.where(clip, max_norm / norm, 1.0))


def global_norm_partials(device, n: int) -> torch.Tensor:
    """The fp32 scratch the first level writes into: one slot a chunk of an n-element buffer."""
    return torch.empty(num_norm_partials(n), dtype=torch.float32, device=device)


def norm_partials(partials: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Level 1: partials[c] = sum of grads[c*NORM_CHUNK:(c+1)*NORM_CHUNK]**2 in fp32 for every chunk c
    of grads (a flat buffer, or a shard of one that starts at a chunk boundary)."""
    count = num_norm_partials(grads.numel())
    assert grads.is_contiguous() and partials.dtype == torch.float32 and partials.numel() >= count
    assert partials.is_contiguous(), "partials: a contiguous fp32 buffer"
    if count:
        global_norm_squared_kernel[(count,)](grads, partials, grads.numel(), CHUNK=NORM_CHUNK, BLOCK=BLOCK,
                                             num_warps=8)
    return partials


def norm_aggregate(out: torch.Tensor, partials: torch.Tensor, count: int, accumulate: bool = False):
    """Level 2: out (1-element fp32) = the sum of partials[:count] in a fixed order (+ out when
    accumulate)."""
    assert out.dtype == torch.float32 and out.numel() == 1 and partials.numel() >= count
    assert partials.is_contiguous() and partials.dtype == torch.float32, "partials: a contiguous fp32 buffer"
    global_norm_aggregate_kernel[(1,)](partials, out, count, ACCUMULATE=accumulate, BLOCK=AGGREGATE_BLOCK,
                                       num_warps=4)
    return out


def global_norm_squared(out: torch.Tensor, grads: torch.Tensor, partials: torch.Tensor, accumulate: bool = False):
    """out (1-element fp32) = sum of grads**2 (+ out when accumulate). grads: a flat bf16/fp32 buffer;
    partials: global_norm_partials(device, grads.numel()) or larger."""
    norm_partials(partials, grads)
    return norm_aggregate(out, partials, num_norm_partials(grads.numel()), accumulate)


def clip_scale(scale: torch.Tensor, norm_squared: torch.Tensor, max_norm: float):
    """scale (1-element fp32, on the device) = the gradient scale that clips the norm to max_norm."""
    clip_scale_kernel[(1,)](norm_squared, scale, float(max_norm))
    return scale
