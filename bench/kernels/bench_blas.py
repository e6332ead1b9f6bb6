"""Benchmark: every matrix product of a GPT-2 124M step (B=64, T=1024, 8 classifier chunks) through the
calls the model makes (torch.addmm / torch.mm / Tensor.addmm_ with out=, bf16), under different cuBLAS
settings, each in its own process (the settings are read when PyTorch creates its cuBLAS handles):

  default                      PyTorch's choice (cuBLAS for mm, cuBLASLt for addmm with a bias)
  prefer-lt                    TORCH_BLAS_PREFER_CUBLASLT=1: every product through cuBLASLt's heuristic
  lt-ws-<MiB>                  CUBLASLT_WORKSPACE_SIZE (KiB): a larger cuBLASLt workspace
  ws-<MiB>                     CUBLAS_WORKSPACE_CONFIG: a larger cuBLAS workspace

Per setting: each product's median time (CUDA events, 30 runs after warm-up) and the step's total (times
its calls a step), plus whether two runs of every product agree bitwise (the step must be deterministic).
Then the backward products in other layouts (a transposed copy of the weight for the input gradient, the
weight gradient computed transposed), timed the same way but not counted in the total.

    PYTHONPATH=src:. python -m bench.kernels.bench_blas [--settings default prefer-lt ...] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

B, T, C, VP, L, CHUNKS = 64, 1024, 768, 50304, 12, 8
BT = B * T
ROWS = BT // CHUNKS

# (name, calls a step, kind, M, K, N), in the model's layouts: "bias" = addmm(bias, x (M, K), w.t()) and
# "fwd" = mm(x, w.t()) with the weight w (N, K) row-major; "dinp" = mm(dout (M, K), w (K, N)); "acc" =
# dw (M, N).addmm_(dout.t(), x) with dout (K, M) and x (K, N) row-major (the weight gradients, accumulated)
PRODUCTS = [
    ("qkv fwd", L, "bias", BT, C, 3 * C),
    ("attproj fwd", L, "bias", BT, C, C),
    ("fc fwd", L, "bias", BT, C, 4 * C),
    ("fcproj fwd", L, "bias", BT, 4 * C, C),
    ("lm_head fwd", CHUNKS, "fwd", ROWS, C, VP),
    ("qkv dinp", L, "dinp", BT, 3 * C, C),
    ("attproj dinp", L, "dinp", BT, C, C),
    ("fc dinp", L, "dinp", BT, 4 * C, C),
    ("fcproj dinp", L, "dinp", BT, C, 4 * C),
    ("lm_head dinp", CHUNKS, "dinp", ROWS, VP, C),
    ("qkv dweight", L, "acc", 3 * C, BT, C),
    ("attproj dweight", L, "acc", C, BT, C),
    ("fc dweight", L, "acc", 4 * C, BT, C),
    ("fcproj dweight", L, "acc", C, BT, 4 * C),
    ("lm_head dweight", CHUNKS, "acc", VP, ROWS, C),
]
# The same products in other layouts (not in the step total): "dinp-wt" = mm(dout, wt.t()) with a
# transposed copy wt (N, K) of the weight; "acc-t" = the weight gradient computed transposed,
# dw.t().addmm_(x.t(), dout) into the (N, M) view of dw.
LAYOUT_VARIANTS = [
    ("qkv dinp wt", 0, "dinp-wt", BT, 3 * C, C),
    ("attproj dinp wt", 0, "dinp-wt", BT, C, C),
    ("fc dinp wt", 0, "dinp-wt", BT, 4 * C, C),
    ("fcproj dinp wt", 0, "dinp-wt", BT, C, 4 * C),
    ("lm_head dinp wt", 0, "dinp-wt", ROWS, VP, C),
    ("qkv dweight t", 0, "acc-t", 3 * C, BT, C),
    ("attproj dweight t", 0, "acc-t", C, BT, C),
    ("fc dweight t", 0, "acc-t", 4 * C, BT, C),
    ("fcproj dweight t", 0, "acc-t", C, BT, 4 * C),
    ("lm_head dweight t", 0, "acc-t", VP, ROWS, C),
]

SETTINGS = {
    "default": {},
    "prefer-lt": {"TORCH_BLAS_PREFER_CUBLASLT": "1"},
    "lt-ws-64": {"CUBLASLT_WORKSPACE_SIZE": str(64 * 1024)},
    "prefer-lt-ws-64": {"TORCH_BLAS_PREFER_CUBLASLT": "1", "CUBLASLT_WORKSPACE_SIZE": str(64 * 1024)},
    "ws-64": {"CUBLAS_WORKSPACE_CONFIG": ":65536:2"},
}


def _operands(kind, M, K, N, gen, device="cuda"):
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    a = randn(K, M).t() if kind in ("acc", "acc-t") else randn(M, K)
    b = randn(N, K).t() if kind in ("bias", "fwd", "dinp-wt") else randn(K, N)
    return a, b, (0.1 * randn(N)), randn(M, N)


def _product(kind, a, b, bias, out):
    """One product as the model calls it (out is overwritten, or accumulated into for the weight gradients)."""
    import torch
    if kind == "bias":
        torch.addmm(bias, a, b, out=out)
    elif kind in ("fwd", "dinp", "dinp-wt"):
        torch.mm(a, b, out=out)
    elif kind == "acc":
        out.addmm_(a, b)
    else:  # acc-t: out^T += b^T a^T
        out.t().addmm_(b.t(), a.t())


def _time_product(kind, M, K, N, gen) -> tuple[float, bool]:
    """(median ms of 30 runs after 5 warm-up runs, whether two runs from the same inputs agree bitwise)."""
    import torch
    a, b, bias, out = _operands(kind, M, K, N, gen)
    out0 = out.clone()
    out.copy_(out0)
    _product(kind, a, b, bias, out)
    first = out.clone()
    out.copy_(out0)
    _product(kind, a, b, bias, out)
    bitwise = bool(torch.equal(first, out))
    for _ in range(5):
        _product(kind, a, b, bias, out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        start.record()
        _product(kind, a, b, bias, out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], bitwise


def child() -> dict:
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, total = [], 0.0
    for name, calls, kind, M, K, N in PRODUCTS + LAYOUT_VARIANTS:
        ms, bitwise = _time_product(kind, M, K, N, gen)
        tflops = 2 * M * K * N / (ms * 1e-3) / 1e12
        rows.append(dict(name=name, calls=calls, ms=ms, tflops=tflops, bitwise=bitwise))
        total += calls * ms
    return dict(rows=rows, total_ms=total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    results = {}
    for name in args.settings:
        env = dict(os.environ, **SETTINGS[name])
        proc = subprocess.run([sys.executable, "-m", "bench.kernels.bench_blas", "--child"], env=env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            print(f"{name}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    names = list(results)
    print(f"{'product':<18} {'calls':>5} " + " ".join(f"{n:>16}" for n in names) + "   (ms, TFLOP/s)")
    for i, (pname, calls, *_rest) in enumerate(PRODUCTS + LAYOUT_VARIANTS):
        cells = []
        for n in names:
            r = results[n]["rows"][i]
            cells.append(f"{r['ms']:7.3f} {r['tflops']:4.0f}{'' if r['bitwise'] else '!'}".rjust(16))
        print(f"{pname:<18} {calls:>5} " + " ".join(cells))
    print(f"{'step total ms':<24} " + " ".join(f"{results[n]['total_ms']:16.2f}" for n in names))
    print("('!' after a time: two runs of that product differed in some bit)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {n: SETTINGS[n] for n in names}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
