"""LayerNorm / residual kernels at GPT-2 124M shapes (B=64, T=1024, C=768, bf16) against PyTorch.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_layernorm
nbytes counts each input read once and each output written once (the backward's fp32 scratch, 2 x 6 MiB
of extra traffic, is not counted). Baselines: eager PyTorch (F.layer_norm, +, autograd's LayerNorm
backward) and the same under torch.compile (None where compiling fails).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.timing import median_ms, row
from llmpy.kernels.layernorm import (fused_residual_forward, layernorm_backward,
                                     layernorm_backward_scratch_shape, layernorm_forward, residual_forward)
from llmpy.reference import LAYERNORM_EPS

B, T, C = 64, 1024, 768
DTYPE = torch.bfloat16


def _compiled_ms(fn, *args):
    """Median time of torch.compile(fn)(*args), or None if compiling (or running) it fails."""
    try:
        cfn = torch.compile(fn, dynamic=False)
        cfn(*args)  # compile outside the timed region
        torch.cuda.synchronize()
        return median_ms(lambda: cfn(*args))
    except Exception as e:  # a baseline failing must not take the kernel rows down with it
        print(f"torch.compile failed for {getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}")
        return None


def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def bench(dev: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    N = B * T
    s = torch.empty((), dtype=DTYPE).element_size()
    act = N * C * s  # one (B, T, C) floatX tensor
    par = C * s  # one (C,) floatX parameter
    stat = N * 4  # one (B, T) fp32 statistic

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=dev) * scale + shift).to(DTYPE)

    inp = randn(B, T, C, scale=2.0, shift=0.5)
    inp2 = randn(B, T, C)
    weight = randn(C, scale=0.2, shift=1.0)
    bias = randn(C, scale=0.2)
    out = torch.empty_like(inp)
    out2 = torch.empty_like(inp)
    mean = torch.empty(B, T, device=dev)
    rstd = torch.empty(B, T, device=dev)
    rows = []

    # ---- layernorm_forward
    def ln_eager(x, w, b):
        return F.layer_norm(x, (C,), w, b, LAYERNORM_EPS)

    nbytes = 2 * act + 2 * par + 2 * stat
    ms = median_ms(lambda: layernorm_forward(out, mean, rstd, inp, weight, bias))
    rows.append(row("layernorm_forward", nbytes, ms, "F.layer_norm", median_ms(lambda: ln_eager(inp, weight, bias)),
                    _compiled_ms(ln_eager, inp, weight, bias), _gbs(nbytes, ms)))

    # ---- residual_forward
    def add_eager(a, b):
        return a + b

    nbytes = 3 * act
    ms = median_ms(lambda: residual_forward(out, inp, inp2))
    rows.append(row("residual_forward", nbytes, ms, "a + b", median_ms(lambda: add_eager(inp, inp2)),
                    _compiled_ms(add_eager, inp, inp2), _gbs(nbytes, ms)))

    # ---- fused_residual_forward
    def fused_eager(a, b, w, bb):
        r = a + b
        return r, F.layer_norm(r, (C,), w, bb, LAYERNORM_EPS)

    nbytes = 4 * act + 2 * par + 2 * stat
    ms = median_ms(lambda: fused_residual_forward(out, out2, mean, rstd, inp, inp2, weight, bias))
    rows.append(row("fused_residual_forward", nbytes, ms, "a + b; F.layer_norm",
                    median_ms(lambda: fused_eager(inp, inp2, weight, bias)),
                    _compiled_ms(fused_eager, inp, inp2, weight, bias), _gbs(nbytes, ms)))

    # ---- layernorm_backward (mean/rstd from the forward, as in training)
    layernorm_forward(out, mean, rstd, inp, weight, bias)
    dout = randn(B, T, C)
    dinp = randn(B, T, C)
    dweight = randn(C)
    dbias = randn(C)
    scratch = torch.empty(layernorm_backward_scratch_shape(N, C), device=dev)
    # reads dout, inp, dinp, weight, mean, rstd, dweight, dbias; writes dinp, dweight, dbias
    nbytes = 4 * act + 5 * par + 2 * stat
    ms = median_ms(lambda: layernorm_backward(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd,
                                              seed=1234))

    x = inp.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    b = bias.detach().clone().requires_grad_(True)
    y = F.layer_norm(x, (C,), w, b, LAYERNORM_EPS)
    eager_ms = median_ms(lambda: torch.autograd.grad(y, (x, w, b), dout, retain_graph=True))

    def ln_bwd(g, xx, ww, bb, m, r):
        # aten's LayerNorm backward (what autograd runs), no accumulation into existing gradients
        return torch.ops.aten.native_layer_norm_backward(g, xx, [C], m, r, ww, bb, [True, True, True])

    compiled = _compiled_ms(ln_bwd, dout, inp, weight, bias, mean.unsqueeze(-1), rstd.unsqueeze(-1))
    rows.append(row("layernorm_backward", nbytes, ms, "autograd F.layer_norm backward", eager_ms, compiled,
                    _gbs(nbytes, ms) + "; baselines do not accumulate into dinp/dweight/dbias"))
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} C={C} {DTYPE}")
    for r in bench():
        print(r)
