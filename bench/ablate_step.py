"""What each group of kernels costs the graphed step at the GPU's power cap: the step timed with groups left out.

    PYTHONPATH=src:. python -m bench.ablate_step [--model d12] [--B 64] [--T 1024] [--recompute 0] \
        [--steps 24] [--rounds 2] [--variants full,-classifier,...] [--json out.json]

Why: at the H200's 700 W cap a kernel's time in a profile is not what the step would save without it.
Kernels that move memory draw less power than the products, and the clock the products run at depends
on the whole step's energy (bench/RESULTS.md runs I, O, P), so only the step timed without a group says
what that group really costs - and the step without every memory-bound pass is the floor the products
and attention leave at the cap, what the 100 ms goal has to be read against.

How: one llmpy GPT2Model (the acceptance configuration: B=64, T=1024, bf16, CUDA graph), trained a few
real steps on random tokens so that every buffer holds the values a step really sees (never zeros: the
products' power, and so the clock, depends on the data). Then, round after round, each variant: the
launchers of its groups replaced by functions that launch nothing, the step graph captured again, and
--steps steps timed (median of the last two thirds). Left-out kernels leave their outputs as the last
real step wrote them, so the kernels that remain read realistic values; the losses and the parameters
mean nothing in those steps (the model is thrown away after). Variants are "full" and "-G" / "-G+H..."
for the groups G of GROUPS; "only-products" leaves out everything but the matrix products.

Not a correctness tool: the model's results are wrong by design while a group is left out.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time

from bench.bench_step import check_sizes, make_batches, make_output_folders

# group -> the launchers the model calls for it, as (module, attribute path in it); the model looks them up
# at call time, so replacing one removes its kernels from the next capture. (LANE, name): a call the
# backward issues through llmpy.streams.Lanes.run under that name, skipped.
LANE = "lane"
GROUPS: dict[str, list[tuple[str, str]]] = {
    "classifier": [("llmpy.model", "fused_classifier")],
    "ln-forward": [("llmpy.kernels.layernorm", "fused_residual_forward"),
                   ("llmpy.kernels.layernorm", "layernorm_forward")],
    # the backward zeroes the residual gradient before its first LayerNorm backward accumulates into it:
    # without those, the zero would stay, and every product after would multiply zeros (which draws far
    # less power, and so runs faster, than real data), so the zeroing goes too and the buffer keeps the
    # last real step's values
    "ln-backward": [("llmpy.kernels.layernorm", "layernorm_backward"), (LANE, "zero dresidual")],
    "bias": [("llmpy.kernels.matmul", "_bias_reduce"), ("llmpy.kernels.matmul", "bias_through_weight")],
    "encoder": [("llmpy.kernels.encoder", "encoder_forward"), ("llmpy.kernels.encoder", "encoder_backward")],
    "attention": [("llmpy.kernels.attention", "attention_forward_any"),
                  ("llmpy.kernels.attention", "attention_backward_any")],
    "optimizer": [("llmpy.model", "GPT2Model._adamw"), ("llmpy.model", "GPT2Model._compute_norm"),
                  ("llmpy.model", "GPT2Model._clip")],
    "products": [("llmpy.kernels.matmul", "matmul_forward"), ("llmpy.kernels.matmul", "matmul_backward")],
}
MEMORY_BOUND = ("classifier", "ln-forward", "ln-backward", "bias", "encoder")
DEFAULT_VARIANTS = ("full", "-classifier", "-ln-forward", "-ln-backward", "-bias", "-encoder", "-optimizer",
                    "-attention", "-" + "+".join(MEMORY_BOUND), "-" + "+".join(MEMORY_BOUND) + "+attention",
                    "only-products")


def groups_of(variant: str) -> list[str]:
    """The groups a variant leaves out: "full" none, "-a+b" a and b, "only-products" all but products."""
    if variant == "full":
        return []
    if variant == "only-products":
        return [g for g in GROUPS if g != "products"]
    if not variant.startswith("-"):
        raise ValueError(f"variant {variant!r}: full, only-products or -GROUP[+GROUP...]")
    names = variant[1:].split("+")
    bad = [g for g in names if g not in GROUPS]
    if bad or not names:
        raise ValueError(f"variant {variant!r}: unknown group(s) {bad}; groups: {', '.join(GROUPS)}")
    return names


def _owner(module: str, path: str):
    """(the object holding the launcher, its attribute name) for GROUPS' (module, attribute path)."""
    import importlib
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


@contextlib.contextmanager
def left_out(groups: list[str]):
    """Replace the launchers of groups with no-ops for the duration (restored after, even on error)."""
    saved = []
    entries = [e for g in groups for e in GROUPS[g]]
    lane_calls = {name for module, name in entries if module == LANE}
    try:
        for module, path in entries:
            if module == LANE:
                continue
            owner, attr = _owner(module, path)
            saved.append((owner, attr, owner.__dict__[attr]))
            setattr(owner, attr, lambda *a, **k: None)
        if lane_calls:
            from llmpy.streams import Lanes
            run = Lanes.__dict__["run"]
            saved.append((Lanes, "run", run))

            def run_unless_left_out(self, lane, fn, reads=(), writes=(), name=""):
                return None if name in lane_calls else run(self, lane, fn, reads, writes, name)
            Lanes.run = run_unless_left_out
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def summarize(times: dict[str, list[list[float]]]) -> dict:
    """Per variant: each round's median (of the last two thirds of its steps), their mean, and the mean's
    difference from "full" (what the left-out groups cost the step)."""
    out = {}
    for v, rounds in times.items():
        meds = [statistics.median(r[len(r) // 3:]) for r in rounds]
        out[v] = {"medians": meds, "mean": sum(meds) / len(meds)}
    base = out.get("full", {}).get("mean")
    for v in out.values():
        v["saves"] = None if base is None else base - v["mean"]
    return out


def format_table(summary: dict) -> str:
    lines = ["| variant | medians ms | mean ms | the step without it saves ms |", "| --- | --- | ---: | ---: |"]
    for v, s in summary.items():
        saves = "" if v == "full" or s["saves"] is None else f"{s['saves']:.1f}"
        lines.append(f"| {v} | {', '.join(f'{m:.1f}' for m in s['medians'])} | {s['mean']:.1f} | {saves} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ablate_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="d12")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--recompute", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24, help="steps timed per variant and round")
    ap.add_argument("--warmup", type=int, default=12, help="real steps before the first variant")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        try:
            groups_of(v)
        except ValueError as e:
            ap.error(str(e))
    config = check_sizes(ap, args, {"B": 1, "T": 1, "steps": 1, "warmup": 0, "rounds": 1})
    make_output_folders(args.json)

    import torch
    from llmpy.init import init_parameters
    from llmpy.model import GPT2Model
    model = GPT2Model(config, init_parameters(config, args.seed), args.B, args.T, device="cuda",
                      dtype=torch.bfloat16, master_weights=True, recompute=args.recompute, seed=args.seed)
    print(model.describe(), flush=True)
    batches = make_batches(config.vocab_size, args.B, args.T, 8, 1337, pin=True)
    step = 0

    def run(n: int) -> list[float]:
        nonlocal step
        out = []
        for _ in range(n):
            step += 1
            t0 = time.perf_counter()
            model.train_step([batches[step % len(batches)]], 3e-4, step, 0.1, 1.0)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    real = run(args.warmup)
    print(f"real steps: {', '.join(f'{t:.1f}' for t in real)} ms", flush=True)
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            with left_out(groups_of(v)):
                model.release_graphs()
                run(1)  # the capture (and its first replay)
                ts = run(args.steps)
            times[v].append(ts)
            print(f"round {r + 1} {v}: median {statistics.median(ts[len(ts) // 3:]):.2f} ms", flush=True)
    model.release_graphs()
    summary = summarize(times)
    print(format_table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "describe": model.describe(), "real_steps_ms": real, "times_ms": times,
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
