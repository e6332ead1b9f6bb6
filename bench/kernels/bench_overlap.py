"""Benchmark: can a memory-bound pass run beside a weight-gradient product on another stream, at the power cap?

The question behind GPT2Model(overlap_weight_grads=...): the backward's LayerNorm backward (main lane)
and the fc / qkv weight-gradient products (side lane) are independent; issued on two streams, does the
pair take less than the two one after the other? cuBLAS's Hopper kernels take every SM for their whole
run, so the LayerNorm's blocks may just queue behind them; cuBLASLt's SM_COUNT_TARGET
(kernels.cublaslt.sm_count_target) plans the product for fewer SMs and leaves the rest free.

For each pair (a product at GPT-2 124M, B=64, T=1024 shapes, and the LayerNorm backward that sums the
projection's bias, as the model runs it) this times, as a mean per pair over --sustain-ms of pairs after
as many of warm-up (the card at its 700 W cap, as in a step):

  product alone, LayerNorm alone, both on one stream ("serial"), and both on two streams with the product
  planned for all SMs or for 132 - k of them (k = --carveouts), each pair joined before the next.

    PYTHONPATH=src:. python -m bench.kernels.bench_overlap [--sustain-ms 300] [--carveouts 0,16,32,48] [--json F]
"""
from __future__ import annotations

import argparse
import json

# (name, rows, out features, in features): dweight (out, in) += dout (rows, out).T @ inp (rows, in)
PRODUCTS = [("fc dweight", 65536, 3072, 768), ("qkv dweight", 65536, 2304, 768), ("fcproj dweight", 65536, 768, 3072)]


def measure(sustain_ms: float, carveouts: list[int]) -> list[dict]:
    import torch
    from llmpy.kernels import cublaslt as lt
    from llmpy.kernels import layernorm as kln

    from bench.timing import sustained_ms
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N, C = 65536, 768

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)

    # the LayerNorm backward with the projection's bias, as the model runs it
    dout, inp, w = randn(N, C), randn(N, C), randn(C, scale=0.1) + 1
    mean = inp.float().mean(-1)
    rstd = (inp.float().var(-1, unbiased=False) + 1e-5).rsqrt()
    dinp = randn(N, C)
    dw, db, dproj = (torch.zeros(C, dtype=bf, device="cuda") for _ in range(3))
    scratch = torch.empty(kln.layernorm_backward_scratch_shape(N, C, proj_bias=True), device="cuda")

    def layernorm():
        kln.layernorm_backward(dinp, dw, db, scratch, dout, inp, w, mean, rstd, dproj_bias=dproj)

    side = torch.cuda.Stream()
    lt.reserve_workspace(side)
    main = torch.cuda.current_stream()
    rows = []
    for name, M, OUT, IN in PRODUCTS:
        gout, x, gw = randn(M, OUT), randn(M, IN), randn(OUT, IN)

        def product():
            lt.linear_weight_grad(gw, gout, x)

        row = dict(product=name, sms=sms)
        row["product_ms"] = sustained_ms(product, sustain_ms)
        row["layernorm_ms"] = sustained_ms(layernorm, sustain_ms)
        row["serial_ms"] = sustained_ms(lambda: (product(), layernorm()), sustain_ms)
        for k in carveouts:
            with lt.sm_count_target(sms - k if k else 0):
                product_k = (lambda: lt.linear_weight_grad(gw, gout, x))
                if k:
                    row[f"product_ms_carve{k}"] = sustained_ms(product_k, sustain_ms)

                def pair():
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        product_k()
                    layernorm()
                    main.wait_stream(side)

                row[f"overlap_ms_carve{k}"] = sustained_ms(pair, sustain_ms)
        print(json.dumps(row), flush=True)
        rows.append(row)
        gout = x = gw = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sustain-ms", type=float, default=300.0)
    ap.add_argument("--carveouts", default="0,16,32,48", help="SMs left to the other stream (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    carveouts = [int(k) for k in args.carveouts.split(",") if k.strip()]
    rows = measure(args.sustain_ms, carveouts)
    print(f"\n{'product':16s} {'alone':>7s} {'LN':>7s} {'serial':>7s} " +
          " ".join(f"{'ovl k=' + str(k):>9s}" for k in carveouts) + "   (ms per pair)")
    for r in rows:
        print(f"{r['product']:16s} {r['product_ms']:7.3f} {r['layernorm_ms']:7.3f} {r['serial_ms']:7.3f} " +
              " ".join(f"{r[f'overlap_ms_carve{k}']:9.3f}" for k in carveouts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
