"""Per-kernel benchmark at GPT-2 124M shapes (B=64, T=1024): every kernel module's bench() rows, the
copy-bandwidth ceiling measured in the same run, and a table of % of that ceiling.

    PYTHONPATH=src:. python -m bench.bench_kernels [--only layernorm,gelu] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback

import torch

from bench.timing import copy_bandwidth_gbs

# memory-bound kernels first; the modules with tile sweeps (long to compile) last
MODULES = ["encoder", "layernorm", "gelu", "fused_classifier", "adamw", "global_norm", "attention", "matmul",
           "flash_attention"]

HEADER = (f"{'kernel':44s} {'MB':>9s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} | {'baseline':28s} {'ms':>8s} "
          f"{'compiled':>8s}")


def format_row(r: dict, copy_gbs: float) -> str:
    gbs = r["bytes"] / (r["ms"] * 1e-3) / 1e9 if r.get("ms") and r["bytes"] else 0.0
    r["gbs"], r["pct_copy"] = gbs, 100 * gbs / copy_gbs
    ms = f"{r['ms']:.3f}" if r.get("ms") else "-"
    base = f"{r['baseline_ms']:.3f}" if r.get("baseline_ms") else "-"
    comp = f"{r['compiled_ms']:.3f}" if r.get("compiled_ms") else "-"
    pct = f"{r['pct_copy']:.0f}" if r["bytes"] and r.get("ms") else "-"
    return (f"{r['kernel'][:44]:44s} {r['bytes'] / 1e6:9.1f} {ms:>8s} {gbs:7.0f} {pct:>6s} | "
            f"{str(r.get('baseline', ''))[:28]:28s} {base:>8s} {comp:>8s}  {r.get('note', '')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [m for m in MODULES if not args.only or m in args.only.split(",")]
    copy_gbs = copy_bandwidth_gbs()
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {copy_gbs:.0f} GB/s",
          flush=True)
    rows = []
    for name in names:
        try:
            mod = importlib.import_module(f"bench.kernels.bench_{name}")
            got = mod.bench()
            print(HEADER)
            for r in got:
                r.setdefault("module", name)
                print(format_row(r, copy_gbs), flush=True)
            rows.extend(got)
        except Exception:
            print(f"[{name}] FAILED", flush=True)
            traceback.print_exc()
            torch.cuda.empty_cache()
        if args.json:  # after every module, so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"copy_gbs": copy_gbs, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("\n" + HEADER)
    print("-" * len(HEADER))
    for r in rows:
        print(format_row(r, copy_gbs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
