"""AdamW over GPT-2 124M's flat buffer (124.5 M parameters), with and without fp32 master weights,
against torch's fused AdamW (fp32 parameters and gradients, one flat tensor)."""
from __future__ import annotations

import torch

from bench.timing import median_ms, row
from llmpy.config import parse_descriptor
from llmpy.kernels.adamw import adamw_update, decay_ranges_tensor, hyper_tensor, set_hyper


def bench() -> list[dict]:
    cfg = parse_descriptor("d12")
    n, dev = cfg.num_parameters, "cuda"
    params = (torch.randn(n, device=dev) * 0.02).bfloat16()
    master = params.float()
    grads = (torch.randn(n, device=dev) * 1e-3).bfloat16()
    m, v = torch.randn(n, device=dev) * 1e-3, torch.rand(n, device=dev) * 1e-6
    hyper, seed = hyper_tensor(dev), torch.tensor([7], dtype=torch.int64, device=dev)
    set_hyper(hyper, 6e-4, 10, 0.9, 0.95, 1e-8, 0.1, 1.0)
    ranges = decay_ranges_tensor([(0, n // 2)], dev)
    rows = []
    ms = median_ms(lambda: adamw_update(params, grads, m, v, hyper, seed, ranges, master=master))
    # read grad (2) m v master (12), write m v master (12) and the bf16 params (2)
    p32, g32 = master.clone().requires_grad_(False), grads.float()
    ex, ex2 = m.clone(), v.clone()
    steps = torch.tensor(10.0, device=dev)

    def torch_fused():
        torch._fused_adamw_([p32], [g32], [ex], [ex2], [], [steps], lr=6e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    base = median_ms(torch_fused)
    rows.append(row("adamw_update (bf16 + fp32 master)", n * 28, ms, "torch _fused_adamw_ fp32", base))
    ms = median_ms(lambda: adamw_update(params, grads, m, v, hyper, seed, ranges))
    rows.append(row("adamw_update (bf16, no master, SR)", n * 22, ms, "torch _fused_adamw_ fp32", base))
    return rows


if __name__ == "__main__":
    for r in bench():
        print(r)
