"""Training parity on one GPU (issue 4): the same model, init and data in four numeric configurations.

    PYTHONPATH=src:. python -m bench.parity --data DIR [--steps 300] [--json out.json] [--png out.png]

DIR holds tinyshakespeare tokenized with GPT-2's BPE (`llmpy prepare .../tinyshakespeare/input.txt -o DIR
--name tinyshakespeare`). Configurations: fp32; bf16 with fp32 master weights (the default); bf16 without
master weights, stochastic rounding in AdamW (-w 0); and the same with round-to-nearest in AdamW, which
drops every update smaller than half a bf16 ulp. The claim to check: bf16 + master follows fp32 within
2 % of loss, -w 0 with stochastic rounding stays close, -w 0 with round-to-nearest ends measurably worse.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from llmpy.config import parse_descriptor
from llmpy.data import DataLoader, EvalLoader
from llmpy.init import init_parameters
from llmpy.model import GPT2Model
from llmpy.schedulers import LRSchedule

CONFIGS = {
    "fp32": dict(dtype=torch.float32, master_weights=False, stochastic_rounding=True, attention="classic"),
    "bf16 + master": dict(dtype=torch.bfloat16, master_weights=True, stochastic_rounding=True),
    "bf16 -w 0, stochastic rounding": dict(dtype=torch.bfloat16, master_weights=False, stochastic_rounding=True),
    "bf16 -w 0, round-to-nearest": dict(dtype=torch.bfloat16, master_weights=False, stochastic_rounding=False),
}


def run(name, cfg, args, config, params):
    torch.backends.cuda.matmul.allow_tf32 = True  # llm.c's -f 1: fp32 products on TF32 tensor cores
    opts = dict(CONFIGS[name])
    attention = opts.pop("attention", "auto")
    model = GPT2Model(config, params, args.B, args.T, attention=attention, recompute=0, seed=args.seed, **opts)
    train = DataLoader(f"{args.data}/*_train_*.bin", args.B, args.T, vocab_size=config.vocab_size)
    val = EvalLoader(f"{args.data}/*_val_*.bin", args.B, args.T, vocab_size=config.vocab_size)
    sched = LRSchedule("cosine", args.lr, args.warmup, args.steps, args.final_frac)
    losses, vals = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step % args.val_every == 0:
            vals.append((step, sum(model.validate(x, y) for x, y in val.batches(args.val_batches)) / args.val_batches))
        loss, _norm = model.train_step([train.next_batch()], sched(step), step + 1, args.weight_decay, 1.0)
        losses.append(loss)
    vals.append((args.steps, sum(model.validate(x, y) for x, y in val.batches(args.val_batches)) / args.val_batches))
    seconds = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    print(f"{name:34s} train {sum(losses[-20:]) / 20:.4f} (mean of last 20) | val {vals[-1][1]:.4f} | {seconds:.1f} s",
          flush=True)
    return {"train": losses, "val": vals, "seconds": seconds}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="d12")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--final-frac", type=float, default=0.0)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--val-every", type=int, default=25)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    config = parse_descriptor(args.model)
    params = init_parameters(config, seed=args.seed)
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    print(f"parity: {args.model} B={args.B} T={args.T} {args.steps} steps, lr {args.lr} cosine to x{args.final_frac}, "
          f"data {args.data}, {torch.cuda.get_device_name()}", flush=True)
    results = {n: run(n, CONFIGS[n], args, config, params) for n in names}

    base = results.get("fp32")
    print("\nstep  " + "  ".join(f"{n[:20]:>20s}" for n in names))
    for i in list(range(0, args.steps, 50)) + [args.steps - 1]:
        print(f"{i + 1:4d}  " + "  ".join(f"{results[n]['train'][i]:20.4f}" for n in names))
    if base:
        ref = sum(base["train"][-20:]) / 20
        print("\nfinal train loss (mean of the last 20 steps) relative to fp32:")
        for n in names:
            last = sum(results[n]["train"][-20:]) / 20
            print(f"  {n:34s} {last:.4f}  {100 * (last - ref) / ref:+.2f} %  | val {results[n]['val'][-1][1]:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "results": results}, f)
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib missing: no plot")
            return
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for n in names:
            tr = results[n]["train"]
            k = 10  # moving average for readability
            sm = [sum(tr[max(0, i - k + 1):i + 1]) / len(tr[max(0, i - k + 1):i + 1]) for i in range(len(tr))]
            ax[0].plot(range(1, len(tr) + 1), sm, label=n)
            ax[1].plot(*zip(*results[n]["val"]), marker="o", label=n)
        ax[0].set(title="train loss (10-step mean)", xlabel="step", ylabel="loss")
        ax[1].set(title="validation loss", xlabel="step")
        for a in ax:
            a.legend()
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
