"""GELU kernels at GPT-2 124M shapes (the MLP's (B, T, 4C) activation, B=64, T=1024, C=768, bf16)
against PyTorch.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_gelu
nbytes counts each input read once and each output written once. Baselines: eager PyTorch
(F.gelu(approximate="tanh"); aten's gelu_backward, what autograd runs) and torch.compile of the same
(None where compiling fails). The in-place backward is timed on the same buffer over and over, so its
values drift (to 0 or inf): GPU arithmetic costs the same for any value.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.timing import compiled_ms, median_ms, row
from llmpy.kernels.gelu import gelu_backward_inplace, gelu_forward

B, T, C = 64, 1024, 768
DTYPE = torch.bfloat16
# (block, num_warps) alternatives timed besides the default
SWEEP = [(1024, 4), (4096, 8), (8192, 8)]




def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def bench(dev: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    shape = (B, T, 4 * C)
    x = (torch.randn(shape, device=dev) * 2).to(DTYPE)
    d = torch.randn(shape, device=dev).to(DTYPE)
    out = torch.empty_like(x)
    act = x.numel() * x.element_size()
    rows = []

    # ---- forward: read inp, write out
    def gelu_eager(a):
        return F.gelu(a, approximate="tanh")

    nbytes = 2 * act
    ms = median_ms(lambda: gelu_forward(out, x))
    rows.append(row("gelu_forward", nbytes, ms, "F.gelu(approximate='tanh')", median_ms(lambda: gelu_eager(x)),
                    compiled_ms(gelu_eager, x), _gbs(nbytes, ms)))
    for block, warps in SWEEP:
        ms = median_ms(lambda: gelu_forward(out, x, block=block, num_warps=warps))
        rows.append(row(f"gelu_forward block={block} warps={warps}", nbytes, ms, note=_gbs(nbytes, ms)))

    # ---- backward, in place: read inp and d, write d
    def gelu_bwd(g, a):
        return torch.ops.aten.gelu_backward(g, a, approximate="tanh")

    nbytes = 3 * act
    ms = median_ms(lambda: gelu_backward_inplace(d, x))
    rows.append(row("gelu_backward_inplace", nbytes, ms, "aten.gelu_backward (autograd's)",
                    median_ms(lambda: gelu_bwd(d, x)), compiled_ms(gelu_bwd, d, x),
                    _gbs(nbytes, ms) + "; baselines write a new tensor"))
    for block, warps in SWEEP:
        ms = median_ms(lambda: gelu_backward_inplace(d, x, block=block, num_warps=warps))
        rows.append(row(f"gelu_backward_inplace block={block} warps={warps}", nbytes, ms, note=_gbs(nbytes, ms)))
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} 4C={4 * C} {DTYPE}")
    for r in bench():
        print(r)
