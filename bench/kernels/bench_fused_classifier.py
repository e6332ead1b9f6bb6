"""Fused classifier at GPT-2 124M shapes (B=64, T=1024 rows of Vp=50304 bf16 logits, 6.6 GB) against PyTorch.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_fused_classifier
nbytes counts each input read once and each output written once: training reads the logits and writes
the gradient over them (2 x 6.6 GB; the kernel's second read of the row, from L2 where it is still there,
comes on top: ideal two-pass traffic is 3 x 6.6 GB, reported as "2-pass GB/s"); validation only reads
them. The training rows time the same buffer again and again (it holds gradients after the first call):
the cost does not depend on the values.

Baselines: eager F.cross_entropy(logits[:, :V], reduction="none") forward + autograd backward (which
materialises the log-softmax and a fresh gradient), and torch.compile of the written-out
loss-and-gradient (logsumexp, exp, scatter, pad). A sweep of (BLOCK, num_warps, stages) follows the
default configuration, to pick the defaults on the real GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.timing import median_ms, row
from llmpy.kernels.fused_classifier import FC_BLOCK, FC_STAGES, FC_WARPS, fused_classifier

B, T = 64, 1024
V, Vp = 50257, 50304
DTYPE = torch.bfloat16
SWEEP = [(1024, 4, 1), (2048, 8, 3), (4096, 8, 1), (4096, 16, 1), (4096, 16, 3), (8192, 16, 1), (2048, 4, 1)]


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
    dloss = 1.0 / N
    logits = (torch.randn(N, Vp, device=dev) * 3).to(DTYPE)
    logits[:, V:] = 0  # the padded rows of wte are zero, so are these logits
    targets = torch.randint(0, V, (N,), device=dev)
    losses = torch.empty(N, device=dev)
    lg = logits.numel() * logits.element_size()
    small = N * 8 + N * 4  # int64 targets read, fp32 losses written
    rows = []

    # ---- baselines on a pristine copy (the kernel rows overwrite `logits`)
    def ce_val(x, t):
        return F.cross_entropy(x[:, :V], t, reduction="none")

    dl = torch.full((N,), dloss, device=dev)
    leaf = logits[:, :V].detach().requires_grad_(True)

    def ce_train():
        leaf.grad = None
        F.cross_entropy(leaf, targets, reduction="none").backward(dl)

    def written_train(x, t):
        xv = x[:, :V].float()
        lse = torch.logsumexp(xv, dim=-1)
        loss = lse - xv.gather(1, t[:, None]).squeeze(1)
        g = torch.exp(xv - lse[:, None]).scatter_add(1, t[:, None], -torch.ones_like(lse)[:, None]) * dloss
        return loss, F.pad(g, (0, Vp - V)).to(x.dtype)

    val_eager = median_ms(lambda: ce_val(logits, targets))
    val_compiled = _compiled_ms(ce_val, logits, targets)
    train_eager = median_ms(ce_train)
    leaf = None  # free the autograd copies before the compiled baseline
    train_compiled = _compiled_ms(written_train, logits, targets)
    torch.cuda.empty_cache()

    # ---- validation: read the logits, write the losses
    nbytes = lg + small
    ms = median_ms(lambda: fused_classifier(logits, losses, dloss, targets, V, write_dlogits=False))
    rows.append(row("fused_classifier (val)", nbytes, ms, "F.cross_entropy", val_eager, val_compiled,
                    _gbs(nbytes, ms) + f"; BLOCK={FC_BLOCK} warps={FC_WARPS} stages={FC_STAGES}"))
    for block, warps, stages in SWEEP:
        ms = median_ms(lambda: fused_classifier(logits, losses, dloss, targets, V, write_dlogits=False,
                                                block_size=block, num_warps=warps, stages=stages))
        rows.append(row(f"fused_classifier (val) BLOCK={block} warps={warps} stages={stages}", nbytes, ms,
                        note=_gbs(nbytes, ms)))

    # ---- training: read the logits, write the gradient in place
    nbytes = 2 * lg + small
    ms = median_ms(lambda: fused_classifier(logits, losses, dloss, targets, V))
    rows.append(row("fused_classifier (train)", nbytes, ms, "F.cross_entropy fwd+bwd", train_eager,
                    train_compiled, f"{_gbs(nbytes, ms)}; 2-pass {_gbs(3 * lg + small, ms)}; "
                                    f"BLOCK={FC_BLOCK} warps={FC_WARPS} stages={FC_STAGES}"))
    for block, warps, stages in SWEEP:
        ms = median_ms(lambda: fused_classifier(logits, losses, dloss, targets, V, block_size=block,
                                                num_warps=warps, stages=stages))
        rows.append(row(f"fused_classifier (train) BLOCK={block} warps={warps} stages={stages}", nbytes, ms,
                        note=f"{_gbs(nbytes, ms)}; 2-pass {_gbs(3 * lg + small, ms)}"))
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} V={V} Vp={Vp} {DTYPE}")
    for r in bench():
        print(r)
