"""GELU (tanh form) forward and in-place backward, as llm.c's llmc/gelu.cuh.

Both are elementwise and purely memory-bound: each program streams a contiguous BLOCK of elements
(the x128 vectorised loads of llm.c become Triton's vectorised loads of a contiguous, masked range),
does the math in fp32 and writes back in the storage dtype.

tanh is built from one exp of a non-positive argument, tanh(|z|) = (1 - e) / (1 + e) with
e = exp(-2|z|) in (0, 1], and the sign put back: nothing overflows for any |x| (GELU's cubic makes z
~ 1000 at |x| = 30), and it does not depend on a tanh intrinsic, which older Triton lacks. sech^2 is
1 - tanh^2, as in the reference.

The backward works in place, as llm.c's: d_in_out holds dL/d(gelu out) on entry and dL/d(gelu in) on
return. The launchers only launch (no allocation, no host sync), so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, round_to

# 2048 elements a program: 16 per thread at 4 warps, i.e. two 16-byte vectors in bf16 (one in fp32
# after four), enough bytes in flight per program without too many registers.
GELU_BLOCK = 2048
GELU_WARPS = 4


# ----------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _tanh(z):
    """tanh(z) in fp32 without overflow: exp only ever sees -2|z| <= 0."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(z))  # exp(-2|z|) = 2^(-2 log2(e) |z|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def gelu_fp32(x):
    """GELU, tanh form, of fp32 x. The one definition every kernel uses (this module's and the matmul
    epilogues), so a recomputed GELU has the bits of the stored one."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) * (x + 0.044715 x^3)
    return 0.5 * x * (1.0 + _tanh(z))


@triton.jit
def gelu_grad_fp32(x):
    """d gelu / dx of fp32 x; sech^2 written as 1 - tanh^2 so nothing overflows."""
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    sech2 = 1.0 - t * t
    return 0.5 * (1.0 + t) + x * 0.5 * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)


@triton.jit
def _gelu_forward_kernel(out_ptr, inp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(inp_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + offs, round_to(gelu_fp32(x), out_ptr), mask=mask)


@triton.jit
def _gelu_backward_inplace_kernel(d_ptr, inp_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(inp_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(d_ptr + offs, round_to(gelu_grad_fp32(x) * d, d_ptr), mask=mask)


# ----------------------------------------------------------------------------------------------------
# launchers

def _check(a: torch.Tensor, b: torch.Tensor):
    assert a.shape == b.shape, f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype and a.dtype in (torch.float32, torch.bfloat16), f"dtypes {a.dtype}, {b.dtype}"
    assert a.is_contiguous() and b.is_contiguous(), "gelu needs contiguous tensors"
    assert a.device == b.device


def gelu_forward(out: torch.Tensor, inp: torch.Tensor, block: int = GELU_BLOCK, num_warps: int = GELU_WARPS):
    """out = gelu(inp), elementwise, any shape; out and inp are both bf16 or both fp32. Returns out."""
    _check(out, inp)
    n = inp.numel()
    if n:
        _gelu_forward_kernel[(cdiv(n, block),)](out, inp, n, BLOCK=block, num_warps=num_warps)
    return out


def gelu_backward_inplace(d_in_out: torch.Tensor, inp: torch.Tensor, block: int = GELU_BLOCK,
                          num_warps: int = GELU_WARPS):
    """d_in_out = gelu'(inp) * d_in_out, in place (llm.c's signature). Returns d_in_out."""
    _check(d_in_out, inp)
    n = inp.numel()
    if n:
        _gelu_backward_inplace_kernel[(cdiv(n, block),)](d_in_out, inp, n, BLOCK=block, num_warps=num_warps)
    return d_in_out
