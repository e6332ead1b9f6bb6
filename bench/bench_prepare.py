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

from bench.host_commands import add_tree_arguments, run_rounds

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=110, help="size of the text file in MB (default 110)")
    add_tree_arguments(parser)
    parser.add_argument("--tokenizer-dir", default=os.environ.get("LLMPY_GPT2_DIR", str(SHARED / "gpt2")))
    parser.add_argument("--corpus", default=str(SHARED / "tinyshakespeare" / "input.txt"),
                        help="the text repeated to --mb (default: the shared tinyshakespeare corpus)")
    args = parser.parse_args(argv)
    corpus = Path(args.corpus)
    if not corpus.is_file():
        raise SystemExit(f"{corpus}: not found (the shared data folder beside the checkout, or give --corpus)")
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        block = corpus.read_bytes()
        with open(text, "wb") as f:
            for _ in range(max(1, args.mb * 10**6 // len(block))):
                f.write(block)
        print(f"text: {text.stat().st_size / 1e6:.0f} MB, one document")
        run_rounds(args, lambda i: ("prepare", str(text), "-o", str(Path(tmp) / f"shards-{i}"),
                                    "--tokenizer-dir", args.tokenizer_dir))
        names = sorted(p.name for p in (Path(tmp) / "shards-0").glob("*.bin"))
        same = all(sorted(p.name for p in (Path(tmp) / f"shards-{i}").glob("*.bin")) == names
                   and all(filecmp.cmp(Path(tmp) / "shards-0" / n, Path(tmp) / f"shards-{i}" / n, shallow=False)
                           for n in names) for i in range(1, len(args.src or ["src"])))
        print(f"shards ({', '.join(names)}) byte-identical across the trees: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
