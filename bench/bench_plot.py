"""`llmpy plot` on a long run's log: wall time and peak memory of the command, on the host (no GPU).

Writes a main.jsonl shaped like the trainer's RunLog (train records with loss, norm, lr, ms, skipped, tok_s, mfu;
a validation record every 250 steps; random values from a seeded generator), then runs `python -m llmpy plot` on it
in a subprocess for each source tree given, so a baseline tree (a `git worktree` of an earlier commit) is measured in
the same run:

    python -m bench.bench_plot --steps 1600000 --src src --src /tmp/base/src
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_log(path: Path, steps: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "kind": "train", "loss": 3 + rng.random(), "norm": rng.random(),
                                "lr": 6e-4 * rng.random(), "ms": 100 + rng.random(), "skipped": s % 5000 == 0,
                                "tok_s": 650000.0 + rng.random(), "mfu": 0.5 + 0.01 * rng.random()}) + "\n")
            if s % 250 == 0:
                f.write(json.dumps({"step": s, "kind": "val", "loss": 3 + rng.random()}) + "\n")


def measure(src: str, *llmpy_args: str) -> tuple[float, float]:
    """(seconds, peak resident GB) of `llmpy ARGS` with `src` first on PYTHONPATH, in a fresh process (a
    wrapper that runs nothing else, so its children's peak is the command's)."""
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'llmpy', *sys.argv[1:]], stdout=subprocess.DEVNULL)\n"
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", wrapper, *llmpy_args],
                         capture_output=True, text=True, env=env, check=True).stdout.split()
    seconds = time.perf_counter() - t0
    if out[0] != "0":
        raise SystemExit(f"llmpy {' '.join(llmpy_args)} failed under {src}")
    return seconds, int(out[1]) * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_600_000, help="train records in the log (default 1.6M)")
    parser.add_argument("--src", action="append", default=None,
                        help="a source tree to put on PYTHONPATH (repeatable; default: src)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated (default 2)")
    args = parser.parse_args(argv)
    srcs = args.src or ["src"]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        write_log(run_dir / "main.jsonl", args.steps)
        size = (run_dir / "main.jsonl").stat().st_size
        print(f"log: {args.steps:,} train records, {size / 1e6:.0f} MB")
        for r in range(args.rounds):
            for i, src in enumerate(srcs):
                seconds, peak_gb = measure(src, "plot", str(run_dir), "-o", str(run_dir / f"plots-{i}"))
                print(f"round {r + 1}  {src}: {seconds:.1f} s, peak {peak_gb:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
