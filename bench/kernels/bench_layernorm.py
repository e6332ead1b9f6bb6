"""LayerNorm / residual kernels at GPT-2 124M shapes (B=64, T=1024, C=768, bf16) against PyTorch.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_layernorm
nbytes counts each input read once and each output written once (the backward's fp32 scratch, 2 x 6 MiB
of extra traffic, is not counted). Baselines: eager PyTorch (F.layer_norm, +, autograd's LayerNorm
backward) and the same under torch.compile (None where compiling fails).

Sweep rows, to pick the launchers' defaults: "layernorm_forward <cfg>" and "fused_residual_forward <cfg>"
over layernorm.LN_FWD_SWEEP (the two share their tuning constants: r=rows per program, w=num_warps,
p=programs_per_sm of a persistent grid (0: none), s=stages of pipelining), and "layernorm_backward <cfg>"
over layernorm.LN_BWD_SWEEP (r=rows per iteration, w=num_warps, k=chunks, s=stages); the rows without a
configuration are the current defaults.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpy.kernels.common import PIPELINE_FALLBACKS
from bench.timing import compiled_ms, median_ms, row
from llmpy.kernels.layernorm import (LN_BWD_SWEEP, LN_FWD_SWEEP, fused_residual_forward,
                                     layernorm_backward, layernorm_backward_scratch_shape, layernorm_forward,
                                     residual_forward)
from llmpy.reference import LAYERNORM_EPS

B, T, C = 64, 1024, 768
DTYPE = torch.bfloat16




def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def _fell_back(before: int) -> str:
    """A note when the timed call's pipelined build failed and it ran unpipelined (layernorm.PIPELINE_FALLBACKS)."""
    return "; PIPELINED BUILD FAILED, ran with stages=1" if len(PIPELINE_FALLBACKS) > before else ""


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
    ln_eager_ms = median_ms(lambda: ln_eager(inp, weight, bias))
    ln_compiled_ms = compiled_ms(ln_eager, inp, weight, bias)
    rows.append(row("layernorm_forward", nbytes, ms, "F.layer_norm", ln_eager_ms, ln_compiled_ms, _gbs(nbytes, ms)))
    for name, cfg in LN_FWD_SWEEP.items():
        n0 = len(PIPELINE_FALLBACKS)
        ms = median_ms(lambda: layernorm_forward(out, mean, rstd, inp, weight, bias, **cfg))
        rows.append(row(f"layernorm_forward {name}", nbytes, ms, "F.layer_norm", ln_eager_ms, ln_compiled_ms,
                        _gbs(nbytes, ms) + _fell_back(n0)))

    # ---- residual_forward
    def add_eager(a, b):
        return a + b

    nbytes = 3 * act
    ms = median_ms(lambda: residual_forward(out, inp, inp2))
    rows.append(row("residual_forward", nbytes, ms, "a + b", median_ms(lambda: add_eager(inp, inp2)),
                    compiled_ms(add_eager, inp, inp2), _gbs(nbytes, ms)))

    # ---- fused_residual_forward
    def fused_eager(a, b, w, bb):
        r = a + b
        return r, F.layer_norm(r, (C,), w, bb, LAYERNORM_EPS)

    nbytes = 4 * act + 2 * par + 2 * stat
    ms = median_ms(lambda: fused_residual_forward(out, out2, mean, rstd, inp, inp2, weight, bias))
    fused_eager_ms = median_ms(lambda: fused_eager(inp, inp2, weight, bias))
    fused_compiled_ms = compiled_ms(fused_eager, inp, inp2, weight, bias)
    rows.append(row("fused_residual_forward", nbytes, ms, "a + b; F.layer_norm", fused_eager_ms, fused_compiled_ms,
                    _gbs(nbytes, ms)))
    for name, cfg in LN_FWD_SWEEP.items():
        n0 = len(PIPELINE_FALLBACKS)
        ms = median_ms(lambda: fused_residual_forward(out, out2, mean, rstd, inp, inp2, weight, bias, **cfg))
        rows.append(row(f"fused_residual_forward {name}", nbytes, ms, "a + b; F.layer_norm", fused_eager_ms,
                        fused_compiled_ms, _gbs(nbytes, ms) + _fell_back(n0)))

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

    compiled = compiled_ms(ln_bwd, dout, inp, weight, bias, mean.unsqueeze(-1), rstd.unsqueeze(-1))
    rows.append(row("layernorm_backward", nbytes, ms, "autograd F.layer_norm backward", eager_ms, compiled,
                    _gbs(nbytes, ms) + "; baselines do not accumulate into dinp/dweight/dbias"))
    # the projection's bias gradient summed along (the model's proj_bias_in_layernorm), against the
    # default backward followed by the bias reduction it replaces (kernels.matmul's, over dinp)
    from llmpy.kernels.matmul import bias_scratch_numel, matmul_backward_bias
    dproj = randn(C)
    seed_t = torch.tensor([1234], device=dev)
    proj_scratch = torch.empty(layernorm_backward_scratch_shape(N, C, proj_bias=True), device=dev)
    bias_scratch = torch.empty(bias_scratch_numel(N, C, dev) + C, device=dev)
    fused_ms = median_ms(lambda: layernorm_backward(dinp, dweight, dbias, proj_scratch, dout, inp, weight, mean, rstd,
                                                    seed=seed_t, dproj_bias=dproj, proj_seed=seed_t))
    pair_ms = median_ms(lambda: (layernorm_backward(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd,
                                                    seed=seed_t),
                                 matmul_backward_bias(dproj, dinp, bias_scratch, seed_t)))
    rows.append(row("layernorm_backward + proj bias", nbytes + 2 * par, fused_ms,
                    "layernorm_backward; matmul_backward_bias", pair_ms, None, _gbs(nbytes, fused_ms)))
    for name, cfg in LN_BWD_SWEEP.items():
        cfg = dict(cfg)
        chunks = cfg.pop("chunks")
        sweep_scratch = torch.empty(layernorm_backward_scratch_shape(N, C, chunks), device=dev)
        n0 = len(PIPELINE_FALLBACKS)
        ms = median_ms(lambda: layernorm_backward(dinp, dweight, dbias, sweep_scratch, dout, inp, weight, mean, rstd,
                                                  seed=1234, **cfg))
        rows.append(row(f"layernorm_backward {name}", nbytes, ms, "autograd F.layer_norm backward", eager_ms,
                        compiled, _gbs(nbytes, ms) + _fell_back(n0)))
        # the same tiling with the third accumulator (the model's default since run N), against the pair
        sweep_scratch = torch.empty(layernorm_backward_scratch_shape(N, C, chunks, proj_bias=True), device=dev)
        n0 = len(PIPELINE_FALLBACKS)
        ms = median_ms(lambda: layernorm_backward(dinp, dweight, dbias, sweep_scratch, dout, inp, weight, mean, rstd,
                                                  seed=seed_t, dproj_bias=dproj, proj_seed=seed_t, **cfg))
        rows.append(row(f"layernorm_backward + proj bias {name}", nbytes + 2 * par, ms,
                        "layernorm_backward; matmul_backward_bias", pair_ms, None, _gbs(nbytes, ms) + _fell_back(n0)))
    if PIPELINE_FALLBACKS:
        print("layernorm: pipelined builds that failed and ran unpipelined:", PIPELINE_FALLBACKS)
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} C={C} {DTYPE}")
    for r in bench():
        print(r)
