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

MODULES = ["encoder", "layernorm", "matmul", "gelu", "attention", "flash_attention", "fused_classifier",
           "adamw", "global_norm"]


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
            for r in got:
                r.setdefault("module", name)
            rows.extend(got)
            print(f"[{name}] {len(got)} rows", flush=True)
        except Exception:
            print(f"[{name}] FAILED", flush=True)
            traceback.print_exc()
            torch.cuda.empty_cache()
    print()
    hdr = f"{'kernel':44s} {'MB':>9s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} | {'baseline':28s} {'ms':>8s} {'compiled':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        gbs = r["bytes"] / (r["ms"] * 1e-3) / 1e9 if r["ms"] and r["bytes"] else 0.0
        r["gbs"], r["pct_copy"] = gbs, 100 * gbs / copy_gbs
        base = f"{r['baseline_ms']:.3f}" if r.get("baseline_ms") else "-"
        comp = f"{r['compiled_ms']:.3f}" if r.get("compiled_ms") else "-"
        pct = f"{r['pct_copy']:.0f}" if r["bytes"] else "-"
        print(f"{r['kernel'][:44]:44s} {r['bytes'] / 1e6:9.1f} {r['ms']:8.3f} {gbs:7.0f} {pct:>6s} | "
              f"{str(r.get('baseline', ''))[:28]:28s} {base:>8s} {comp:>8s}  {r.get('note', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
