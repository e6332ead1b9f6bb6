"""fc's bias gradient from its weight-gradient product: the layer input with a column of ones appended.

The bias gradient is the column sums of the output gradient dpre (B*T x 4C), a separate pass over 403 MB
a layer (matmul_backward_bias, ~0.11 ms on the H200). The weight-gradient product already reads dpre:
dpre^T @ [ln2 | 1] gives the weight gradient and, in its extra column, the bias gradient, summed in fp32
inside the product. What that costs is the product's wider output (768 -> 776 or more columns), which
cuBLAS may cover with whole tiles. This times, alternated at the power cap: the model's product and
reduction, and the widened product at a few widths (into a scratch output: the gradient buffer keeps its
768 columns, so a real use would add a small fix-up pass).

    python -m bench.kernels.bench_bias_column [--rounds 3] [--widths 776,784,800,832] [--json F]
"""
from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default="776,784,800,832")
    ap.add_argument("--sustain-ms", type=float, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from bench.energy import EnergyCounter, sustained_energy
    from llmpy.kernels import matmul as kmm

    M, C = args.rows, args.channels
    OC = 4 * C
    g = torch.Generator(device="cuda").manual_seed(0)
    dpre = torch.randn(M, OC, device="cuda", generator=g).to(torch.bfloat16)
    widths = [int(w) for w in args.widths.split(",")]
    ln2 = torch.empty(M, max(widths), device="cuda", dtype=torch.bfloat16)
    ln2.normal_(generator=g)
    ln2[:, C:] = 0.0  # the padding as the LayerNorm's bias_column writes it: a 1, then 0s
    ln2[:, C] = 1.0
    dweight = torch.randn(OC, C, device="cuda", generator=g).to(torch.bfloat16)
    dbias = torch.zeros(OC, device="cuda", dtype=torch.bfloat16)
    scratch = torch.empty(max(kmm.bias_scratch_numel(M, OC, "cuda"), 1), device="cuda", dtype=torch.float32)
    wide_out = torch.empty(OC, max(widths), device="cuda", dtype=torch.bfloat16)

    cases = {
        "product (768)": lambda: dweight.addmm_(dpre.t(), ln2[:, :C]),
        "bias reduction": lambda: kmm.matmul_backward_bias(dbias, dpre, scratch=scratch),
    }
    for w in widths:
        cases[f"product ({w})"] = lambda w=w: torch.mm(dpre.t(), ln2[:, :w], out=wide_out[:, :w])

    # the widened product's extra column is the bias gradient (against float64 sums)
    torch.mm(dpre.t(), ln2[:, :widths[0]], out=wide_out[:, :widths[0]])
    exact = dpre.double().sum(0)
    err = ((wide_out[:, C].double() - exact).abs().max() / exact.abs().max()).item()
    print(f"extra column against float64 column sums: max error {err:.2e} of the largest", flush=True)

    counter = EnergyCounter(0)
    results = {name: [] for name in cases}
    for rnd in range(args.rounds):
        for name, fn in cases.items():
            r = sustained_energy(fn, args.sustain_ms, counter)
            results[name].append(r)
            print(f"round {rnd} {name:>16}: {r['ms']:.4f} ms {r['mj']:.0f} mJ {r['watts']:.0f} W {r['mhz']} MHz",
                  flush=True)
    print(f"\nmedians over {args.rounds} rounds at the cap (M={M}, OC={OC}):")
    for name, rows in results.items():
        ms = sorted(r["ms"] for r in rows)[len(rows) // 2]
        mj = sorted(r["mj"] for r in rows)[len(rows) // 2]
        print(f"{name:>16} {ms:8.4f} ms {mj:6.0f} mJ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"error": err, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
