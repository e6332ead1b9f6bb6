"""What bench_plot and bench_prepare share: an `llmpy` command timed in a fresh process under each source tree
given (a baseline tree being a `git worktree` of an earlier commit), alternated round by round, with its peak
resident memory."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1 (no rounds, or a log of no steps, would measure nothing)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", action="append", default=None,
                        help="a source tree to put on PYTHONPATH (repeatable; default: src)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="runs of each tree, alternated (default 2)")


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


def run_rounds(args: argparse.Namespace, command_for) -> None:
    """args.rounds rounds over the trees of args.src; command_for(i) gives tree i's llmpy arguments."""
    for r in range(args.rounds):
        for i, src in enumerate(args.src or ["src"]):
            seconds, peak_gb = measure(src, *command_for(i))
            print(f"round {r + 1}  {src}: {seconds:.1f} s, peak {peak_gb:.2f} GB")
