"""What every kernel module shares: the interpreter switch, dtype names and stochastic rounding.

Kernels run on CUDA tensors on a GPU, and on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which is how CI tests them.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's interpreter (3.6 - 3.9) returns garbage for tl.dot on bf16 operands; kernels that use
# tl.dot take this as a constexpr and upcast their operands to fp32 when it is set.
DOT_UPCAST = interpreting()

TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@triton.jit
def stochastic_round_bf16(x, seed, offsets):
    """Round fp32 x to bf16 up or down with probability given by the dropped bits: unbiased.

    The 16 random bits come from Philox keyed by (seed, offsets), a counter-based generator, so the
    result depends only on the seed and the element's index: reproducible, and independent of how
    the work is split into programs. Adding them below the bf16 mantissa and truncating rounds up
    exactly when the random number is under the discarded fraction. Inf and NaN pass through.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rand = tl.randint(seed, offsets).to(tl.uint32) & 0xFFFF
    rounded = ((bits + rand) & 0xFFFF0000).to(tl.float32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, x).to(tl.bfloat16)


@triton.jit
def round_nearest_bf16(x):
    """fp32 -> bf16, round to nearest even, written out in bits. On the GPU this is what .to(bf16)
    does; Triton's interpreter truncates instead, and the difference matters where a test checks that
    round-to-nearest drops small updates. Inf and NaN pass through."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, x).to(tl.bfloat16)


# the interpreter's fp32 -> bf16 cast truncates: there the rounding is written out in bits; on the GPU
# the hardware conversion (round to nearest even) is used, with no extra instructions
EXPLICIT_RNE = tl.constexpr(interpreting())


@triton.jit
def round_to(x, ptr):
    """fp32 x in ptr's element type, rounded to nearest (even) on the GPU and in the interpreter alike:
    the one rounding every kernel stores through."""
    if EXPLICIT_RNE and ptr.dtype.element_ty == tl.bfloat16:
        return round_nearest_bf16(x)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def store_rounded(ptr, x, mask, seed, offsets, STOCHASTIC: tl.constexpr):
    """Store fp32 x into ptr's dtype: stochastic rounding for bf16 when asked, else round-to-nearest."""
    if STOCHASTIC:
        tl.store(ptr, stochastic_round_bf16(x, seed, offsets), mask=mask)
    else:
        tl.store(ptr, round_to(x, ptr), mask=mask)


def tma_descriptor_class():
    """Triton's host-side TensorDescriptor, or None in a Triton without it."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton
        return None
    return TensorDescriptor


def tma_usable(*tensors) -> bool:
    """TMA (tensor descriptors) needs sm_90+ (or the interpreter), and every 2-D operand 16-byte aligned
    in its base and its row stride, with unit column stride (or unit row stride: a transposed view)."""
    if tma_descriptor_class() is None:
        return False
    t0 = tensors[0]
    if t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    if not t0.is_cuda and not interpreting():
        return False
    for t in tensors:
        e = t.element_size()
        lead = t.stride(0) if t.stride(1) == 1 else t.stride(1) if t.stride(0) == 1 else None
        if lead is None or (lead * e) % 16 or t.data_ptr() % 16:
            return False
    return True


# Configurations whose pipelined build failed (to compile, or to fit in shared memory) and ran unpipelined
# instead: {(kernel, stages, meta): error}. The benchmarks print it; a warning says so once per configuration.
PIPELINE_FALLBACKS: dict = {}


def register_cap(maxnreg: int | None) -> dict:
    """A launch's register cap a thread as launch keywords: none where maxnreg is None (the compiler's choice;
    the interpreter drops unknown keywords anyway)."""
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def launch_pipelined(kernel, grid, args, stages: int, **meta):
    """kernel[grid](*args, STAGES=stages, **meta); if a pipelined build (stages > 1) fails to compile or to
    fit, STAGES=1 instead (same results: pipelining only reorders loads). Failures other than the
    pipelining's surface from the second launch."""
    key = (getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)), stages, tuple(sorted(meta.items())))
    if stages > 1 and key not in PIPELINE_FALLBACKS:
        try:
            return kernel[grid](*args, STAGES=stages, **meta)
        except Exception as e:  # noqa: BLE001 - compile / resource errors take many types
            PIPELINE_FALLBACKS[key] = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"{key[0]} with {stages} pipeline stages failed ({PIPELINE_FALLBACKS[key]}); "
                          "running unpipelined")
    return kernel[grid](*args, STAGES=1, **meta)
