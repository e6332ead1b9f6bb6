"""Fused classifier at GPT-2 124M shapes (B=64, T=1024 rows of Vp=50304 bf16 logits, 6.6 GB) against PyTorch,
and a sweep of the kernel's variants to pick TRAIN_CONFIG / VAL_CONFIG from one GPU run.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_fused_classifier
nbytes counts each input read once and each output written once: training reads the logits and writes
the gradient over them (2 x 6.6 GB; a second read of the row, from L2 or HBM, comes on top: the twopass
and split variants' ideal traffic is 3 x 6.6 GB, reported as "3x GB/s"); validation only reads them.

Every sweep candidate first runs once on a fresh copy of the logits and is checked against the default
configuration's output (itself checked against reference.fused_classifier in fp32): losses to 1e-4
relative, gradients to 1e-2 relative (norm) with zero padding; validation candidates must leave the
logits untouched. A candidate that fails to compile or to match is reported as such and not timed.
The training rows then time the same buffer again and again (it holds gradients after the first call):
the cost does not depend on the values. Sweep rows are named "fc-train <label>" / "fc-val <label>"; the
last two rows ("fc-<mode> BEST: <label>") name the fastest verified candidate of each mode, with the dict
to copy into fused_classifier.py.

Baselines: eager F.cross_entropy(logits[:, :V], reduction="none") forward + autograd backward (which
materialises the log-softmax and a fresh gradient), and torch.compile of the written-out
loss-and-gradient (logsumexp, exp, scatter, pad).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.timing import compiled_ms, median_ms, row
from llmpy import reference as ref
from llmpy.kernels.fused_classifier import TRAIN_CONFIG, VAL_CONFIG, fused_classifier, split_scratch_numel

B, T = 64, 1024
V, Vp = 50257, 50304
DTYPE = torch.bfloat16
CHUNK_ROWS = 4096  # rows compared at a time (fp32 copies of 64K x 50K logits would take 13 GB each)

# (label, launcher keywords). Bytes in flight a program: BLOCK / (32 * warps * 8) 16-byte loads a
# thread an iteration. pps = progs_per_sm (persistent grid). onepass: 16 warps hold 98 values a thread
# (128 registers, one program an SM), 32 warps 49 (64 registers, a few spilled).
TRAIN_SWEEP = [
    ("legacy B2048 w8 (previous default)", dict(variant="legacy", block_size=2048, num_warps=8, stages=1)),
    ("legacy B4096 w16 (previous best)", dict(variant="legacy", block_size=4096, num_warps=16, stages=1)),
    ("twopass B4096 w16", dict(variant="twopass", block_size=4096, num_warps=16, stages=1, progs_per_sm=0)),
    ("twopass B8192 w16", dict(variant="twopass", block_size=8192, num_warps=16, stages=1, progs_per_sm=0)),
    ("twopass B2048 w8", dict(variant="twopass", block_size=2048, num_warps=8, stages=1, progs_per_sm=0)),
    ("twopass B16384 w32 pps1", dict(variant="twopass", block_size=16384, num_warps=32, stages=1, progs_per_sm=1)),
    ("twopass B8192 w16 st3 pps1", dict(variant="twopass", block_size=8192, num_warps=16, stages=3, progs_per_sm=1)),
    ("twopass B8192 w16 pps2", dict(variant="twopass", block_size=8192, num_warps=16, stages=1, progs_per_sm=2)),
    ("onepass p w16", dict(variant="onepass", keep="p", num_warps=16, progs_per_sm=0)),
    ("onepass p w16 pps1 prefetch", dict(variant="onepass", keep="p", num_warps=16, progs_per_sm=1, prefetch=True)),
    ("onepass p w32", dict(variant="onepass", keep="p", num_warps=32, progs_per_sm=0)),
    ("onepass pl w16", dict(variant="onepass", keep="pl", num_warps=16, progs_per_sm=0)),
    ("onepass pw w16", dict(variant="onepass", keep="pw", num_warps=16)),
    ("onepass xw w16", dict(variant="onepass", keep="xw", num_warps=16)),
    ("onepass p w16 pow2-block", dict(variant="onepass", keep="p", num_warps=16, exact=False, progs_per_sm=0)),
    ("split B4096 w8", dict(variant="split", block_size=4096, num_warps=8)),
    ("tma w16 b2", dict(variant="tma", num_warps=16, buffers=2)),
    ("tma w16 b1", dict(variant="tma", num_warps=16, buffers=1)),
]
VAL_SWEEP = [
    ("legacy B1024 w4 (previous best)", dict(variant="legacy", block_size=1024, num_warps=4, stages=1)),
    ("twopass B1024 w4", dict(variant="twopass", block_size=1024, num_warps=4, stages=1, progs_per_sm=0)),
    ("twopass B2048 w4", dict(variant="twopass", block_size=2048, num_warps=4, stages=1, progs_per_sm=0)),
    ("twopass B2048 w8", dict(variant="twopass", block_size=2048, num_warps=8, stages=1, progs_per_sm=0)),
    ("twopass B4096 w8", dict(variant="twopass", block_size=4096, num_warps=8, stages=1, progs_per_sm=0)),
    ("twopass B4096 w4", dict(variant="twopass", block_size=4096, num_warps=4, stages=1, progs_per_sm=0)),
    ("onepass w16", dict(variant="onepass", keep="x", num_warps=16, progs_per_sm=0)),
    ("onepass w16 pps1 prefetch", dict(variant="onepass", keep="x", num_warps=16, progs_per_sm=1, prefetch=True)),
    ("onepass w32", dict(variant="onepass", keep="x", num_warps=32, progs_per_sm=0)),
    ("split B4096 w8", dict(variant="split", block_size=4096, num_warps=8)),
    ("tma w16 b2", dict(variant="tma", num_warps=16, buffers=2)),
]




def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _grad_err(out: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    """Relative error of the gradient over the real columns (row chunks, fp32) and whether the padding
    columns are all zero."""
    num = den = 0.0
    pad_zero = True
    for r0 in range(0, out.shape[0], CHUNK_ROWS):
        o, e = out[r0:r0 + CHUNK_ROWS], expected[r0:r0 + CHUNK_ROWS]
        d = o[:, :V].float() - e[:, :V].float()
        num += float(d.square().sum())
        den += float(e[:, :V].float().square().sum())
        pad_zero &= bool((o[:, V:] == 0).all())
    return (num / max(den, 1e-30)) ** 0.5, pad_zero


def _reference_check(logits, targets, losses, dlogits, dloss) -> str:
    """The default configuration's outputs against reference.fused_classifier in fp32, by row chunks."""
    num = den = 0.0
    loss_err = 0.0
    for r0 in range(0, logits.shape[0], CHUNK_ROWS):
        sl = slice(r0, r0 + CHUNK_ROWS)
        el, ed = ref.fused_classifier(logits[sl].float(), targets[sl], V, dloss)
        loss_err = max(loss_err, _rel(losses[sl], el))
        num += float((dlogits[sl].float() - ed).square().sum())
        den += float(ed.square().sum())
        del el, ed
    grad_err = (num / den) ** 0.5
    ok = loss_err < 1e-4 and grad_err < 1e-2
    return f"{'ok' if ok else 'MISMATCH'} vs reference (loss {loss_err:.1e}, grad {grad_err:.1e})"


def bench(dev: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    N = B * T
    dloss = 1.0 / N
    pristine = (torch.randn(N, Vp, device=dev) * 3).to(DTYPE)
    pristine[:, V:] = 0  # the padded rows of wte are zero, so are these logits
    targets = torch.randint(0, V, (N,), device=dev)
    losses = torch.empty(N, device=dev)
    lg = pristine.numel() * pristine.element_size()
    small = N * 8 + N * 4  # int64 targets read, fp32 losses written
    rows = []

    # ---- baselines
    def ce_val(x, t):
        return F.cross_entropy(x[:, :V], t, reduction="none")

    dl = torch.full((N,), dloss, device=dev)
    leaf = pristine[:, :V].detach().requires_grad_(True)

    def ce_train():
        leaf.grad = None
        F.cross_entropy(leaf, targets, reduction="none").backward(dl)

    def written_train(x, t):
        xv = x[:, :V].float()
        lse = torch.logsumexp(xv, dim=-1)
        loss = lse - xv.gather(1, t[:, None]).squeeze(1)
        g = torch.exp(xv - lse[:, None]).scatter_add(1, t[:, None], -torch.ones_like(lse)[:, None]) * dloss
        return loss, F.pad(g, (0, Vp - V)).to(x.dtype)

    val_eager = median_ms(lambda: ce_val(pristine, targets))
    val_compiled = compiled_ms(ce_val, pristine, targets)
    train_eager = median_ms(ce_train)
    leaf = None  # free the autograd copies before the compiled baseline
    train_compiled = compiled_ms(written_train, pristine, targets)
    torch.cuda.empty_cache()

    work = torch.empty_like(pristine)
    scratch = torch.empty(split_scratch_numel(N, Vp, 1024), device=dev)  # enough for split blocks >= 1024
    best = {}

    def candidate(mode: str, label: str, kw: dict, nbytes: int, fn_check, extra_note=lambda ms: ""):
        """Verify, then time one configuration; a row either way."""
        kw = dict(kw, scratch=scratch) if kw.get("variant") == "split" else kw
        name = f"fc-{mode} {label}"  # short: the table prints 44 characters of it
        try:
            verdict = fn_check(kw)
        except Exception as e:  # a compile error of one candidate must not end the sweep
            rows.append(row(name, nbytes, None, note=f"FAILED: {type(e).__name__}: {str(e)[:120]}"))
            torch.cuda.synchronize()
            return
        if verdict:
            rows.append(row(name, nbytes, None, note=f"WRONG, not timed: {verdict}"))
            return
        write = mode == "train"
        ms = median_ms(lambda: fused_classifier(work, losses, dloss, targets, V, write_dlogits=write, **kw))
        rows.append(row(name, nbytes, ms, note=_gbs(nbytes, ms) + extra_note(ms)))
        if mode not in best or ms < best[mode][1]:
            best[mode] = (label, ms, {k: v for k, v in kw.items() if k != "scratch"})

    # ---- validation: read the logits, write the losses
    work.copy_(pristine)
    val_ref = torch.empty(N, device=dev)
    fused_classifier(work, val_ref, dloss, targets, V, write_dlogits=False)
    nbytes = lg + small
    ms = median_ms(lambda: fused_classifier(work, losses, dloss, targets, V, write_dlogits=False))
    rows.append(row("fused_classifier (val) default", nbytes, ms, "F.cross_entropy", val_eager, val_compiled,
                    f"{_gbs(nbytes, ms)}; {VAL_CONFIG}"))

    def check_val(kw):
        work.copy_(pristine)
        losses.fill_(float("nan"))
        fused_classifier(work, losses, dloss, targets, V, write_dlogits=False, **kw)
        if not torch.equal(work, pristine):
            return "logits modified"
        err = _rel(losses, val_ref)
        return "" if err < 1e-4 else f"losses off by {err:.1e}"

    for label, kw in VAL_SWEEP:
        candidate("val", label, kw, nbytes, check_val)

    # ---- training: read the logits, write the gradient in place
    work.copy_(pristine)
    train_ref_losses = torch.empty(N, device=dev)
    fused_classifier(work, train_ref_losses, dloss, targets, V)
    train_ref = work.clone()  # the default's gradient
    ref_note = _reference_check(pristine, targets, train_ref_losses, train_ref, dloss)
    nbytes = 2 * lg + small
    ms = median_ms(lambda: fused_classifier(work, losses, dloss, targets, V))
    rows.append(row("fused_classifier (train) default", nbytes, ms, "F.cross_entropy fwd+bwd", train_eager,
                    train_compiled, f"{_gbs(nbytes, ms)}; 3x {_gbs(3 * lg + small, ms)}; {ref_note}; "
                                    f"{TRAIN_CONFIG}"))

    def check_train(kw):
        work.copy_(pristine)
        losses.fill_(float("nan"))
        fused_classifier(work, losses, dloss, targets, V, **kw)
        loss_err = _rel(losses, train_ref_losses)
        grad_err, pad_zero = _grad_err(work, train_ref)
        if loss_err < 1e-4 and grad_err < 1e-2 and pad_zero:
            return ""
        return f"losses {loss_err:.1e}, grad {grad_err:.1e}, padding zero {pad_zero}"

    for label, kw in TRAIN_SWEEP:
        candidate("train", label, kw, nbytes, check_train, lambda ms: f"; 3x {_gbs(3 * lg + small, ms)}")

    for mode, nb in (("val", lg + small), ("train", 2 * lg + small)):
        if mode in best:
            label, ms, kw = best[mode]
            rows.append(row(f"fc-{mode} BEST: {label}", nb, ms,
                            note=f"{'VAL' if mode == 'val' else 'TRAIN'}_CONFIG = {kw}"))
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} V={V} Vp={Vp} {DTYPE}")
    for r in bench():
        print(r)
