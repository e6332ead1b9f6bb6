"""Global norm of GPT-2 124M's bf16 gradient buffer against torch.linalg.vector_norm."""
from __future__ import annotations

import torch

from bench.timing import median_ms, row
from llmpy.config import parse_descriptor
from llmpy.kernels.global_norm import global_norm_partials, global_norm_squared


def bench() -> list[dict]:
    n = parse_descriptor("d12").num_parameters
    grads = (torch.randn(n, device="cuda") * 1e-3).bfloat16()
    out, partials = torch.empty(1, device="cuda"), global_norm_partials("cuda", n)
    ms = median_ms(lambda: global_norm_squared(out, grads, partials))
    base = median_ms(lambda: torch.linalg.vector_norm(grads, dtype=torch.float32))
    return [row("global_norm_squared (bf16 grads)", n * 2, ms, "torch vector_norm", base)]


if __name__ == "__main__":
    for r in bench():
        print(r)
