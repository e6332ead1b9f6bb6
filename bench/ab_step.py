"""Whole-step A/B comparison of llmpy settings, alternated so that the GPU's drift does not pick the winner.

The H200 runs our step at its 700 W power cap, and how hot the card is moves a whole step by 1-3 %
(bench/RESULTS.md runs I and J): two settings timed one after the other can swap places from one call to
the next. This runs bench_step's llmpy system for each variant in turn, round after round (A B A B ...),
each in a fresh process, and reports every median and each variant's mean against the first's, and the
same for each run's lower quartile of step times (slow spells at the power cap can take a third of a
run's steps to 130+ ms and swamp a 1 % difference in the median).

    PYTHONPATH=src:. python -m bench.ab_step --variant "new=--flash-config '{\"BLOCK_N2\": 64}'" \
        --variant default= --rounds 2 -- --recompute 0

A variant is NAME=ARGS, ARGS being bench_step arguments (shell-quoted; empty for the defaults); whatever
follows `--` goes to every variant. --from-best FILE adds two variants from a flash sweep's --best-json
file: "default", and "best" (the fastest forward merged with the fastest backward entry).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from bench import bench_step


def variants_from_best(path: str) -> list[tuple[str, list[str]]]:
    """[("default", []), ("best", ["--flash-config", JSON])] from bench_flash_attention --best-json output:
    the fastest forward entry's fields merged with those of the fastest backward entry of any schedule."""
    with open(path) as f:
        best = json.load(f)
    fields: dict = {}
    if "fwd" in best:
        fields.update(best["fwd"]["fields"])
    bwd = [v for k, v in best.items() if k != "fwd"]
    if bwd:
        fields.update(min(bwd, key=lambda v: v["ms"])["fields"])
    return [("default", []), ("best", ["--flash-config", json.dumps(fields)])]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=ARGS")
    return name, shlex.split(rest)


def main(argv=None, runner=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", type=parse_variant, default=[], help="NAME=ARGS (repeatable)")
    ap.add_argument("--from-best", default=None, help="a flash sweep's --best-json file: default vs best")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = list(args.variant) + (variants_from_best(args.from_best) if args.from_best else [])
    if len(variants) < 2:
        ap.error("give at least two variants (--variant NAME=ARGS, or --from-best FILE)")
    if len({name for name, _ in variants}) != len(variants):
        ap.error("variant names must differ")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    bench_step.make_output_folders(args.json)
    # each variant's bench_step arguments, checked before the first run (a bad one ends the call now)
    step_argvs = {name: ["--systems", "llmpy", *common, *extra] for name, extra in variants}
    step_args = {name: bench_step.parse_args(step_argv) for name, step_argv in step_argvs.items()}
    runner = runner or bench_step.run_child_process
    medians: dict[str, list[float | None]] = {name: [] for name, _ in variants}
    quartiles: dict[str, list[float | None]] = {name: [] for name, _ in variants}
    joules: dict[str, list[float | None]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, _ in variants:
            res = bench_step.summarize(runner("llmpy", step_args[name], step_argvs[name]), step_args[name])
            ms = res.get("median_ms") if res.get("ok") else None
            medians[name].append(ms)
            quartiles[name].append(res.get("p25_ms") if ms is not None else None)
            joules[name].append(res.get("joules_per_step") if ms is not None else None)
            shown = (f"{ms:.1f} ms (lower quartile {quartiles[name][-1]:.1f})" if ms is not None
                     else f"FAILED: {res.get('error')}")
            if joules[name][-1] is not None:
                shown += f", {joules[name][-1]:.2f} J/step at {res['watts']:.0f} W{bench_step.card_state(res)}"
            print(f"round {r + 1} {name}: {shown}", flush=True)
    first = variants[0][0]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    # the medians are the acceptance figure; the lower quartiles leave out the slow spells the power cap
    # puts into some runs (steps of 130+ ms among 106-110 ms ones), which can swamp a 1 % difference
    # and the energy of a step (NVML; none where it is missing): at the cap, time is energy over 700 W
    tables = [("medians ms", medians, "ms"), ("lower quartiles ms", quartiles, "ms")]
    if any(x is not None for xs in joules.values() for x in xs):
        tables.append(("J per step", joules, "J"))
    for label, table, unit in tables:
        print(f"\n{'variant':<16} {label:<32} {'mean':>8} {'vs ' + first:>12}")
        base = mean(table[first])
        for name, _ in variants:
            m = mean(table[name])
            runs = " ".join(f"{x:.1f}" if x is not None else "fail" for x in table[name])
            diff = f"{m - base:+.1f} {unit}" if m is not None and base is not None else "-"
            print(f"{name:<16} {runs:<32} {m if m is not None else float('nan'):8.1f} {diff:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": {n: e for n, e in variants}, "common": common, "medians_ms": medians,
                       "lower_quartiles_ms": quartiles, "joules_per_step": joules}, f, indent=1)
    return 0 if all(None not in v for v in medians.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
