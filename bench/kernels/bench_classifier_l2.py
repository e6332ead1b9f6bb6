"""The classifier section of a training step with the logits kept in L2: lm_head forward and fused classifier
in sub-chunks of S rows, so that a sub-chunk's logits (S x Vp bf16: 25.8 MB at S=256) are still in the
H200's 50 MB L2 when the classifier reads them, and only the logit gradient goes to HBM.

In the model (model._chunked_classifier), for each chunk of 8192 rows the lm_head product writes an 824 MB
buffer (to HBM); the classifier reads it back (HBM) and writes the gradient over it (HBM); then the lm_head
backward (dlnf and dwte) reads the gradient. With sub-chunks the forward product and the
classifier alternate S rows at a time over the same chunk buffer; the backward products still run on the
whole chunk (their efficiency needs the long K of 8192 rows). Same math; whether the
bits stay those of the whole-chunk path (cuBLAS may pick a kernel with another summation order at another
M) is checked against the first configuration, and printed.

Measured (bench/RESULTS.md run R): every sub-chunk size is slower than the whole chunk, also with the best
of cuBLASLt's ranked algorithms for each sub-chunk's product: 27.1-28.4 ms against 25.7 (S = 2048 ... 256).

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_classifier_l2 [--json F]
Every configuration runs the whole classifier section of one step (B*T = 65536 rows in 8 chunks of 8192,
the lm_head backward included) as one CUDA graph, timed as the median of replays and sustained at the power
cap (bench.timing.sustained_ms), against the whole-chunk path in the same process.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.timing import graphed, median_ms, sustained_ms
from llmpy.kernels import cublaslt
from llmpy.kernels import matmul as kmm
from llmpy.kernels.fused_classifier import fused_classifier

ROWS, C, V, Vp, CHUNK = 65536, 768, 50257, 50304, 8192


def forward_product(out, inp, wte, rank: int | None):
    """The lm_head product of some rows: the model's call (rank None: its tuned rank at 8192 rows, cuBLAS's
    heuristic elsewhere) or cuBLASLt's algorithm of that heuristic rank."""
    if rank is None:
        kmm.matmul_forward(out, inp, wte, use_cublaslt=True)
    else:
        cublaslt.linear_forward(out, inp, wte, algo_index=rank)


def section(S: int, lnf, wte, dlnf, dwte, logits, losses, tgt, rank: int | None):
    """The classifier section of a training step: per chunk of CHUNK rows, forward + classifier S rows at a
    time, then dlnf and dwte on the whole chunk."""
    dloss = 1.0 / ROWS
    for r0 in range(0, ROWS, CHUNK):
        for s0 in range(0, CHUNK, S):
            out = logits[s0:s0 + S]
            forward_product(out, lnf[r0 + s0:r0 + s0 + S], wte, rank)
            fused_classifier(out, losses[r0 + s0:r0 + s0 + S], dloss, tgt[r0 + s0:r0 + s0 + S], V)
        kmm.matmul_backward(dlnf[r0:r0 + CHUNK], dwte, None, logits, lnf[r0:r0 + CHUNK], wte, use_cublaslt=True)


def best_rank(S: int, lnf, wte, logits, ranks: int = 8) -> int | None:
    """The fastest of cuBLASLt's first `ranks` algorithms for the S-row forward product (None: none ran)."""
    times = {}
    for rank in range(ranks):
        try:
            forward_product(logits[:S], lnf[:S], wte, rank)
            torch.cuda.synchronize()
        except cublaslt.CublasLtError:
            continue
        times[rank] = median_ms(lambda: forward_product(logits[:S], lnf[:S], wte, rank))
    print(f"S={S}: forward product ms by rank " + ", ".join(f"{r}: {t:.4f}" for r, t in times.items()), flush=True)
    return min(times, key=times.get) if times else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8192,2048,1024,512,256,128", help="sub-chunk rows S to time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    lnf = torch.randn(ROWS, C, device=dev).bfloat16()
    wte = (torch.randn(Vp, C, device=dev) * 0.02).bfloat16()
    wte[V:] = 0
    tgt = torch.randint(0, V, (ROWS,), device=dev, dtype=torch.int32)
    logits = torch.empty(CHUNK, Vp, device=dev, dtype=torch.bfloat16)
    losses = torch.empty(ROWS, device=dev, dtype=torch.float32)
    dlnf = torch.empty(ROWS, C, device=dev, dtype=torch.bfloat16)
    dwte = torch.empty(Vp, C, device=dev, dtype=torch.bfloat16)

    # per S: the model's call, and cuBLASLt's fastest ranked algorithm for that many rows (the model has a
    # tuned rank only for 8192)
    variants = []
    for S in [int(s) for s in args.sizes.split(",")]:
        variants.append((f"S={S} model's product", S, None))
        rank = best_rank(S, lnf, wte, logits)
        if rank is not None:
            variants.append((f"S={S} rank {rank}", S, rank))
    ref = None  # the first variant's (losses, dlnf, dwte): the later ones are checked against its bits
    results = []
    for label, S, rank in variants:
        def run():
            dwte.zero_()
            section(S, lnf, wte, dlnf, dwte, logits, losses, tgt, rank)
        losses.fill_(float("nan"))
        dlnf.fill_(float("nan"))
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"{label}: failed: {type(e).__name__}: {e}")
            continue
        if ref is None:
            ref = (losses.clone(), dlnf.clone(), dwte.clone())
        same = all(torch.equal(got, want) for got, want in zip((losses, dlnf, dwte), ref))
        err = float((losses - ref[0]).abs().max())
        replay = graphed(run, 1)
        replay()
        torch.cuda.synchronize()
        ms = median_ms(replay, warmup_ms=100, rep_ms=500)
        cap_ms = sustained_ms(replay, 3000, ms)
        results.append(dict(label=label, S=S, rank=rank, ms=ms, cap_ms=cap_ms, bitwise=same, loss_err=err))
        print(f"{label:34s} median {ms:7.3f} ms  at the cap {cap_ms:7.3f} ms  bitwise {same}  loss err {err:.2e}",
              flush=True)
        del replay
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
