"""`llmpy prepare` of one large text file: wall time and peak memory of the command, on the host (no GPU).

The file is the shared corpus (tinyshakespeare) repeated to --mb megabytes, one document; GPT-2's tokenizer comes
from the shared files (or $LLMPY_GPT2_DIR). Each source tree given runs `python -m llmpy prepare` on it in a fresh
process, alternated, so a baseline tree (a `git worktree` of an earlier commit) is measured in the same run, and
the shards each tree writes are compared byte for byte:

    python -m bench.bench_prepare --mb 110 --src src --src /tmp/base/src
"""
from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from bench.bench_plot import measure

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=110, help="size of the text file in MB (default 110)")
    parser.add_argument("--src", action="append", default=None,
                        help="a source tree to put on PYTHONPATH (repeatable; default: src)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated (default 2)")
    parser.add_argument("--tokenizer-dir", default=os.environ.get("LLMPY_GPT2_DIR", str(SHARED / "gpt2")))
    args = parser.parse_args(argv)
    corpus = SHARED / "tinyshakespeare" / "input.txt"
    if not corpus.is_file():
        raise SystemExit(f"{corpus}: not found (the shared data folder beside the checkout)")
    srcs = args.src or ["src"]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        block = corpus.read_bytes()
        with open(text, "wb") as f:
            for _ in range(max(1, args.mb * 10**6 // len(block))):
                f.write(block)
        print(f"text: {text.stat().st_size / 1e6:.0f} MB, one document")
        for r in range(args.rounds):
            for i, src in enumerate(srcs):
                out = Path(tmp) / f"shards-{i}"
                seconds, peak_gb = measure(src, "prepare", str(text), "-o", str(out),
                                           "--tokenizer-dir", args.tokenizer_dir)
                print(f"round {r + 1}  {src}: {seconds:.1f} s, peak {peak_gb:.2f} GB")
        names = sorted(p.name for p in (Path(tmp) / "shards-0").glob("*.bin"))
        same = all(sorted(p.name for p in (Path(tmp) / f"shards-{i}").glob("*.bin")) == names
                   and all(filecmp.cmp(Path(tmp) / "shards-0" / n, Path(tmp) / f"shards-{i}" / n, shallow=False)
                           for n in names) for i in range(1, len(srcs)))
        print(f"shards ({', '.join(names)}) byte-identical across the trees: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
