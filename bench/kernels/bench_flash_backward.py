"""Benchmark: the flash attention backward's kernels against each other, alternated, at the power cap.

One layer of GPT-2 124M's attention at B=64, T=1024 (NH=12, hs=64, bf16) by default. Each variant is a
FLASH_CONFIGS entry (flash_attention.flash_config's fields): the tl.dot kernel and the Gluon wgmma kernel
(kernels/flash_backward_wgmma.py) at a few ring depths. First every variant's gradient is compared with
the first variant's (bit for bit, and the largest difference) and its registers and shared memory are
printed (wgmma kernel); then, round after round in turn, each is timed by do_bench and sustained at the
700 W cap with NVML's energy counter (bench/energy.py), which is how it runs inside the step.

    PYTHONPATH=src:. python -m bench.kernels.bench_flash_backward [--rounds 4] [--shape B T NH]
        [--variants '{"name": {fields}, ...}'] [--json F]
"""
from __future__ import annotations

import argparse
import json

DEFAULT_VARIANTS = {
    "tl.dot": {"bwd_kernel": "tl.dot"},
    "wgmma s3/3": {"bwd_kernel": "wgmma", "wgmma_stages": [3, 3]},
    "wgmma s3/2": {"bwd_kernel": "wgmma", "wgmma_stages": [3, 2]},
    "wgmma s4/3": {"bwd_kernel": "wgmma", "wgmma_stages": [4, 3]},
    "wgmma s2/2": {"bwd_kernel": "wgmma", "wgmma_stages": [2, 2]},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 1024, 12], metavar=("B", "T", "NH"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sustain-ms", type=float, default=1500)
    ap.add_argument("--variants", default=None, help="JSON {name: FLASH_CONFIGS fields}, replacing the defaults")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from bench.energy import EnergyCounter, sustained_energy
    from bench.timing import median_ms
    from llmpy.kernels import flash_attention as fa
    from llmpy.kernels import flash_backward_wgmma as fw

    variants = json.loads(args.variants) if args.variants else DEFAULT_VARIANTS
    B, T, NH = args.shape
    hs = 64
    C = NH * hs
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, T, 3 * C, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(B, T, C, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(B, T, C, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, NH, T, device="cuda", dtype=torch.float32)
    fa.flash_attention_forward(out, lse, qkv, NH)
    delta = torch.empty(B, NH, T, device="cuda", dtype=torch.float32)
    dqkv = torch.empty_like(qkv)

    def backward(name):
        fa.FLASH_CONFIGS[hs] = variants[name]
        fa.flash_attention_backward(dqkv, dout, qkv, out, lse, NH, delta=delta)

    results = {name: {"fields": fields} for name, fields in variants.items()}
    first = None
    for name in variants:
        dqkv.fill_(float("nan"))
        fw.last_compiled = None
        backward(name)
        torch.cuda.synchronize()
        r = results[name]
        if first is None:
            first = dqkv.clone()
        r["finite"] = bool(torch.isfinite(dqkv).all())
        r["bitwise_equal_to_first"] = bool(torch.equal(dqkv, first))
        r["max_abs_diff"] = (dqkv.float() - first.float()).abs().max().item()
        kernel = fw.last_compiled
        if kernel is not None:
            r["registers"], r["shared_bytes"] = kernel.n_regs, kernel.metadata.shared
        print(f"{name:>14}: finite {r['finite']}, bitwise equal to {next(iter(variants))} "
              f"{r['bitwise_equal_to_first']} (max |diff| {r['max_abs_diff']:.3e})"
              + (f", {r['registers']} registers, {r['shared_bytes']} B shared" if kernel is not None else ""),
              flush=True)

    counter = EnergyCounter(0)
    for rnd in range(args.rounds):
        for name in variants:
            if not results[name]["finite"]:
                continue
            fn = lambda name=name: backward(name)  # noqa: E731
            bench = median_ms(fn, rep_ms=200)
            cap = sustained_energy(fn, args.sustain_ms, counter)
            results[name].setdefault("rounds", []).append({"do_bench_ms": bench, **cap,
                                                           "celsius": counter.temperature_c()})
            print(f"round {rnd} {name:>14}: do_bench {bench:.4f} ms, at the cap {cap['ms']:.4f} ms "
                  f"{cap['mj']:.0f} mJ {cap['watts']:.0f} W {cap['mhz']} MHz {counter.temperature_c()} C", flush=True)

    print(f"\nmedians over {args.rounds} rounds (B={B} T={T} NH={NH} hs={hs}):")
    print(f"{'variant':>14} {'do_bench ms':>11} {'cap ms':>8} {'cap mJ':>7}")
    for name, r in results.items():
        rows = r.get("rounds", [])
        if not rows:
            continue
        med = lambda key: sorted(x[key] for x in rows)[len(rows) // 2]  # noqa: E731
        r["median"] = {k: med(k) for k in ("do_bench_ms", "ms", "mj")}
        print(f"{name:>14} {r['median']['do_bench_ms']:11.4f} {r['median']['ms']:8.4f} {r['median']['mj']:7.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
