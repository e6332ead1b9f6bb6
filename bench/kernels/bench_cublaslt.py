"""Benchmark: every matrix product of a GPT-2 124M step (bench_blas.PRODUCTS: B=64, T=1024, 8 classifier
chunks, bf16) through torch as the model's "torch" backend calls it, and through kernels/cublaslt.py
with each of the first --algos algorithms cuBLASLt's heuristic ranks (0 is what the "cublaslt" backend
runs); then the fused epilogues against what they replace:

  fc fwd           GELU_AUX_BIAS      vs  addmm (BIAS) + gelu_forward
  fcproj dinp      DGELU              vs  mm + gelu_backward_inplace, and vs mm + bias_gelu_backward
                                          (dGELU + fc's bias gradient, what -ge 0 runs; -ge 2 adds that
                                          bias gradient as its own reduction: "bias 3072" below)
  every dweight    BGRADB (bf16 sums) + the finishing add   vs  addmm_ + matmul_backward_bias

A time is a call's share of 20 calls back to back between two CUDA events (so the host's launch cost,
larger for the ctypes path than for torch's, hides behind the GPU's work as it does in the model's CUDA
graph), the best of 5 such rounds after warm-up; "step" totals are times x calls a step.

With --sustain-ms S every figure is instead the mean over S ms of calls after S ms of the same calls:
the time at the card's power cap, where a whole step runs. With --repeat n the whole measurement runs n
times and every figure is the slowest of the n (a rank has to win in every pass). The JSON's "tuned" lists,
per product the model runs, the fastest rank that beats the model's current call (torch's cuBLAS for plain
products, rank 0 for the fused epilogues) by at least --margin: a candidate kernels.matmul.TUNED_ALGOS that
bench_step --tuned-from FILE runs.

    PYTHONPATH=src:. python -m bench.kernels.bench_cublaslt [--algos 6] [--sustain-ms 0] [--repeat 1] [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.kernels.bench_blas import PRODUCTS


# --sustain-ms: > 0 times each product at the card's power cap instead (see _ms_per_call)
SUSTAIN_MS = 0.0


def _ms_per_call(fn, calls=20, rounds=5):
    """ms a call of fn: the best of `rounds` means over `calls` calls back to back (after 3 warm-up calls).

    With SUSTAIN_MS > 0: then the mean at the card's power cap (timing.sustained_ms)."""
    import torch

    from bench.timing import sustained_ms
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    if SUSTAIN_MS <= 0:
        return min(times)
    return sustained_ms(fn, SUSTAIN_MS, min(times))


def _try(fn):
    """ms a call of fn (_ms_per_call), or None where cuBLASLt has no such algorithm."""
    from llmpy.kernels import cublaslt as lt
    try:
        return _ms_per_call(fn)
    except lt.CublasLtError:
        return None


def run(algos: int) -> dict:
    import torch
    from llmpy.kernels import cublaslt as lt
    from llmpy.kernels import matmul as mm
    from llmpy.kernels.gelu import gelu_backward_inplace, gelu_forward
    g = torch.Generator(device="cuda").manual_seed(0)
    bf, f32 = torch.bfloat16, torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)

    rows = []
    for name, calls, kind, M, K, N in PRODUCTS:
        row = dict(name=name, calls=calls, lt={})
        if kind in ("bias", "fwd"):  # out (M, N) = x (M, K) @ w (N, K).T (+ bias)
            x, w, out = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, N)
            bias = randn(N, scale=0.1) if kind == "bias" else None
            row["torch"] = _ms_per_call(lambda: torch.addmm(bias, x, w.t(), out=out) if bias is not None
                                      else torch.mm(x, w.t(), out=out))
            for i in range(algos):
                row["lt"][i] = _try(lambda: lt.linear_forward(out, x, w, bias, algo_index=i))
            if name.startswith("fc "):
                pre = randn(M, N)
                row["torch+gelu"] = _ms_per_call(lambda: (torch.addmm(bias, x, w.t(), out=pre), gelu_forward(out, pre)))
                row["gelu_aux_bias"] = {i: _try(lambda: lt.linear_forward(out, x, w, bias, pre_gelu=pre, algo_index=i))
                                        for i in range(algos)}
        elif kind == "dinp":  # dinp (M, N) = dout (M, K) @ w (K, N)
            dout, w, dinp = randn(M, K), randn(K, N, scale=K ** -0.5), randn(M, N)
            row["torch"] = _ms_per_call(lambda: torch.mm(dout, w, out=dinp))
            for i in range(algos):
                row["lt"][i] = _try(lambda: lt.linear_input_grad(dinp, dout, w, algo_index=i))
            if name.startswith("fcproj "):
                pre = randn(M, N)
                dbias, scratch = torch.zeros(N, device="cuda", dtype=bf), torch.empty(
                    mm.bias_scratch_numel(M, N, "cuda", gelu=True) + N, device="cuda", dtype=f32)
                row["bias 3072"] = _ms_per_call(lambda: mm.matmul_backward_bias(dbias, dinp, scratch))
                row["torch+dgelu"] = _ms_per_call(lambda: (torch.mm(dout, w, out=dinp),
                                                         gelu_backward_inplace(dinp, pre)))
                row["torch+dgelu+bias"] = _ms_per_call(lambda: (torch.mm(dout, w, out=dinp),
                                                              mm.bias_gelu_backward(dbias, scratch, dinp, pre)))
                row["dgelu"] = {i: _try(lambda: lt.linear_input_grad(dinp, dout, w, pre_gelu=pre, algo_index=i))
                                for i in range(algos)}
        else:  # acc: dw (M, N) += dout (K, M).T @ x (K, N)
            dout, x, dw = randn(K, M), randn(K, N), randn(M, N)
            row["torch"] = _ms_per_call(lambda: dw.addmm_(dout.t(), x))
            for i in range(algos):
                row["lt"][i] = _try(lambda: lt.linear_weight_grad(dw, dout, x, algo_index=i))
            if not name.startswith("lm_head"):
                dbias, scratch = torch.zeros(M, device="cuda", dtype=bf), torch.empty(
                    mm.bias_scratch_numel(K, M, "cuda") + M, device="cuda", dtype=f32)
                sums = torch.empty(M, device="cuda", dtype=bf)
                row["torch+bias"] = _ms_per_call(lambda: (dw.addmm_(dout.t(), x),
                                                        mm.matmul_backward_bias(dbias, dout, scratch)))
                row["bgradb"] = {i: _try(lambda: (lt.linear_weight_grad(dw, dout, x, dbias_sums=sums, algo_index=i),
                                                  mm._finish_bias(dbias, sums, None)))
                                 for i in range(algos)}
        rows.append(row)
        dw = dinp = out = None
        torch.cuda.empty_cache()
    return dict(rows=rows)


def _slowest(passes: list[dict]) -> dict:
    """Per figure, the slowest of several passes of run() (None in any pass: None)."""
    def worst(vals):
        if isinstance(vals[0], dict):
            return {k: worst([v[k] for v in vals]) for k in vals[0]}
        if isinstance(vals[0], (int, float)) or vals[0] is None:
            return None if any(v is None for v in vals) else max(vals)
        return vals[0]
    rows = []
    for i, first in enumerate(passes[0]["rows"]):
        row = {k: worst([p["rows"][i][k] for p in passes]) for k in first if k not in ("name", "calls")}
        rows.append(dict(name=first["name"], calls=first["calls"], **row))
    return dict(rows=rows)


# bench kind -> the key kernels.matmul._tuned builds for the model's call: (product, rows, inner, outer)
def _tuned_key(kind: str, M: int, K: int, N: int, fused: str | None) -> tuple:
    if fused == "gelu_aux_bias":
        return ("gelu_aux_bias", M, K, N)
    if fused == "dgelu":
        return ("dinp_dgelu", M, K, N)
    if kind == "bias":
        return ("fwd_bias", M, K, N)
    if kind in ("fwd", "dinp"):
        return (kind, M, K, N)
    return ("dweight", K, M, N)  # acc: dw (M, N) += dout (K, M).T @ x (K, N)


def tuned_table(result: dict, margin: float) -> list[dict]:
    """Per product the model runs at -ge 2 (the fc forward as GELU_AUX_BIAS, fcproj's input gradient as
    DGELU), the fastest cuBLASLt rank if it beats the model's call without a table (torch, or rank 0
    for the fused epilogues) by at least `margin` (a fraction)."""
    shapes = {name: (kind, M, K, N) for name, _, kind, M, K, N in PRODUCTS}
    table = []
    for r in result["rows"]:
        kind, M, K, N = shapes[r["name"]]
        if r["name"].startswith("fc "):
            fused, times, base = "gelu_aux_bias", r.get("gelu_aux_bias", {}), None
        elif r["name"].startswith("fcproj dinp"):
            fused, times, base = "dgelu", r.get("dgelu", {}), None
        else:
            fused, times, base = None, r["lt"], r["torch"]
        times = {int(i): v for i, v in times.items() if v is not None}
        base = times.get(0) if fused else base
        if not times or base is None:
            continue
        rank = min(times, key=times.get)
        if times[rank] <= (1.0 - margin) * base:
            table.append(dict(key=list(_tuned_key(kind, M, K, N, fused)), rank=rank, ms=times[rank],
                              baseline_ms=base, name=r["name"]))
    return table


def _fmt(v):
    return f"{v:7.3f}" if v is not None else "      -"


def report(result: dict, algos: int) -> None:
    rows = result["rows"]
    print(f"{'product':<16} {'calls':>5} {'torch':>7} " + " ".join(f"{'lt' + str(i):>7}" for i in range(algos)))
    tot_torch = tot_lt0 = tot_best = 0.0
    for r in rows:
        lts = [r["lt"].get(i, r["lt"].get(str(i))) for i in range(algos)]
        print(f"{r['name']:<16} {r['calls']:>5} {_fmt(r['torch'])} " + " ".join(_fmt(v) for v in lts))
        tot_torch += r["calls"] * r["torch"]
        tot_lt0 += r["calls"] * (lts[0] if lts[0] is not None else r["torch"])
        tot_best += r["calls"] * min(v for v in lts + [r["torch"]] if v is not None)
    print(f"step: torch {tot_torch:.2f} ms, cuBLASLt first algorithm {tot_lt0:.2f} ms, best of all {tot_best:.2f} ms")
    print("\nfused epilogues (ms a call; lt<i> = heuristic's algorithm i) against the unfused pair:")
    for r in rows:
        for fused, unfused in (("gelu_aux_bias", "torch+gelu"), ("dgelu", "torch+dgelu"), ("bgradb", "torch+bias")):
            if fused in r:
                vals = [r[fused].get(i, r[fused].get(str(i))) for i in range(algos)]
                print(f"{r['name']:<16} {fused:<14} " + " ".join(_fmt(v) for v in vals)
                      + f"   vs {unfused} {_fmt(r[unfused])}")
        if "bias 3072" in r:
            print(f"{'':<16} -ge 0's product + dGELU + fc bias {_fmt(r['torch+dgelu+bias'])}; "
                  f"fc's bias reduction alone {_fmt(r['bias 3072'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", type=int, default=6, help="how many of the heuristic's ranked algorithms to time")
    ap.add_argument("--repeat", type=int, default=1, help="passes; every figure is the slowest of them")
    ap.add_argument("--sustain-ms", type=float, default=0.0,
                    help="time each product over this many ms after as many ms of warming up (at the power cap)")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="a rank enters the suggested table if at least this fraction faster")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench.kernels.bench_cublaslt needs a CUDA device", file=sys.stderr)
        return 1
    global SUSTAIN_MS
    SUSTAIN_MS = args.sustain_ms
    result = _slowest([run(args.algos) for _ in range(max(1, args.repeat))])
    result["capability"] = list(torch.cuda.get_device_capability())
    result["tuned"] = tuned_table(result, args.margin)
    report(result, args.algos)
    print("\nsuggested TUNED_ALGOS (slowest of the passes; bench_step --tuned-from):")
    for t in result["tuned"]:
        print(f"  {tuple(t['key'])}: {t['rank']},  # {t['name']}: {t['ms']:.3f} ms against {t['baseline_ms']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
