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
import random
import sys
import tempfile
from pathlib import Path

from bench.host_commands import add_tree_arguments, positive_int, run_rounds


def write_log(path: Path, steps: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "kind": "train", "loss": 3 + rng.random(), "norm": rng.random(),
                                "lr": 6e-4 * rng.random(), "ms": 100 + rng.random(), "skipped": s % 5000 == 0,
                                "tok_s": 650000.0 + rng.random(), "mfu": 0.5 + 0.01 * rng.random()}) + "\n")
            if s % 250 == 0:
                f.write(json.dumps({"step": s, "kind": "val", "loss": 3 + rng.random()}) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=1_600_000,
                        help="train records in the log (default 1.6M)")
    add_tree_arguments(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        write_log(run_dir / "main.jsonl", args.steps)
        size = (run_dir / "main.jsonl").stat().st_size
        print(f"log: {args.steps:,} train records, {size / 1e6:.0f} MB")
        run_rounds(args, lambda i: ("plot", str(run_dir), "-o", str(run_dir / f"plots-{i}")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
