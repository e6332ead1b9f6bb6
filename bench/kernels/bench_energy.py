"""Benchmark: the energy of the step's memory-bound passes by grid size, alone and beside a product.

Why: at the 700 W cap a step's time is its energy over 700 W (bench/RESULTS.md, runs I, M, S), and the
ablation of run S found the memory-bound passes cost the step about their kernel time, i.e. they draw
nearly as much as the products. A memory-bound pass needs far fewer than 132 SMs' worth of issue to
keep HBM busy; SMs left without work are clock-gated. So a pass spread over fewer programs may take about
as long and spend less energy, which the products then get as clock. This measures that, with NVML's
energy counter (bench/energy.py), for each variant:

  alone: ms, mJ and W a call, sustained at the cap;
  paired: the fc weight-gradient product then the pass, one stream, sustained at the cap: ms and mJ a
  pair. The pair's ms minus the product's alone is what the pass costs a step's products.

Variants (GPT-2 124M, B*T = 65536 rows, C = 768, bf16): a plain copy of the same bytes (the floor); the
fused residual + LayerNorm forward at programs_per_sm = 0 (a program per row block, the model's) and
persistent grids of 8, 4, 2, 1 a SM; the LayerNorm backward with the projection's bias at 1024 row chunks
(the model's), 512, 264, 132; fc's bias reduction (65536 x 3072) at its default and at half / a quarter
of its chunks.

With --classifier, the fused classifier's variants on one chunk of logits (classifier_variants()). With
--flash, the same for the flash attention backward (delta kernel included) at several tilings
instead (FLASH_BWD; B=64, T=1024, NH=12, hs=64): larger tiles reuse each loaded tile for more FLOPs.
bench/RESULTS.md run T has both tables. With --ln-forward, the two LayerNorm forwards with a row as one
padded tile or as three (layernorm's pieces), alternated.

    PYTHONPATH=src:. python -m bench.kernels.bench_energy [--flash | --classifier | --ln-forward] [--sustain-ms 1000]
        [--json F]
"""
from __future__ import annotations

import argparse
import json


def _random_and_copy(N: int, C: int):
    """randn(*shape, scale) of fresh bf16 values on the GPU (seeded), and the floor's workload: [(name, a copy
    of 2 x (N, C) values)]."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    src, dst = randn(2, N, C), randn(2, N, C)
    return randn, [("copy 2x(N,C) -> 2x(N,C)", lambda: dst.copy_(src))]


def workloads():
    """[(name, fn)] of the passes, on fresh random inputs."""
    import torch

    from llmpy.kernels import layernorm as kln
    from llmpy.kernels import matmul as kmm
    bf = torch.bfloat16
    N, C = 65536, 768
    randn, out = _random_and_copy(N, C)

    inp1, inp2, w, b = randn(N, C), randn(N, C), randn(C, scale=0.1) + 1, randn(C, scale=0.1)
    residual, normed = randn(N, C), randn(N, C)
    mean, rstd = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    for ppsm in (0, 8, 4, 2, 1):
        out.append((f"residual+LN fwd, {ppsm or 'all'} programs/SM" if ppsm else "residual+LN fwd, a program a block",
                    lambda p=ppsm: kln.fused_residual_forward(residual, normed, mean, rstd, inp1, inp2, w, b,
                                                              programs_per_sm=p)))

    dout, x = randn(N, C), randn(N, C)
    xm = x.float().mean(-1)
    xr = (x.float().var(-1, unbiased=False) + 1e-5).rsqrt()
    dinp = randn(N, C)
    dw, db, dproj = (torch.zeros(C, dtype=bf, device="cuda") for _ in range(3))
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    for chunks in (1024, 512, 264, 132):
        scratch = torch.empty(kln.layernorm_backward_scratch_shape(N, C, chunks, proj_bias=True), device="cuda")
        out.append((f"LN bwd + proj bias, {chunks} chunks",
                    lambda s=scratch: kln.layernorm_backward(dinp, dw, db, s, dout, x, w, xm, xr, seed=seed,
                                                             dproj_bias=dproj, proj_seed=seed)))

    d4 = randn(N, 4 * C)
    dbias = torch.zeros(4 * C, dtype=bf, device="cuda")
    default_chunks, _ = kmm.bias_backward_chunks(N, 4 * C, d4.device)
    bias_scratch = torch.empty(default_chunks * 4 * C, device="cuda")
    for div in (1, 2, 4):
        chunks = max(1, default_chunks // div)
        out.append((f"fc bias reduction, {chunks} chunks",
                    lambda k=chunks: kmm.matmul_backward_bias(dbias, d4, bias_scratch, seed, num_chunks=k)))
    return out


def layernorm_forward_workloads():
    """--ln-forward: the fused residual + LayerNorm forward and the plain one as the model runs them (ln2's
    rows 8 wider for fc's bias column), a row as one padded tile or as three (pieces), alternated twice."""
    import torch

    from llmpy.kernels import layernorm as kln
    N, C = 65536, 768
    randn, out = _random_and_copy(N, C)
    inp1, inp2, w, b = randn(N, C), randn(N, C), randn(C, scale=0.1) + 1, randn(C, scale=0.1)
    residual, normed = randn(N, C), randn(N, C + 8)[:, :C]
    mean, rstd = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    for _ in range(2):
        for pieces in (1, 3):
            out.append((f"residual+LN fwd, pieces={pieces}",
                        lambda p=pieces: kln.fused_residual_forward(residual, normed, mean, rstd, inp1, inp2, w, b,
                                                                    bias_column=True, pieces=p)))
            out.append((f"LN fwd, pieces={pieces}",
                        lambda p=pieces: kln.layernorm_forward(normed, mean, rstd, inp1, w, b, bias_column=True,
                                                               pieces=p)))
    return out


# flash backward tilings for --flash (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages, schedule, tma):
# the default first, then the runners-up of the time sweeps (bench/RESULTS.md runs J, Q), larger tiles
# (more reuse of each loaded tile a FLOP, so maybe less energy at the cap though slower alone) among them
FLASH_BWD = [(32, 64, 64, 64, 4, 3, "fused", True), (64, 64, 64, 64, 4, 3, "fused", True),
             (32, 64, 64, 64, 4, 3, "split", True), (32, 128, 128, 64, 8, 3, "fused", True),
             (64, 128, 128, 64, 8, 3, "fused", False), (32, 64, 64, 128, 4, 3, "fused", True),
             (32, 64, 64, 64, 4, 2, "fused", True)]


def flash_workloads():
    """[(name, fn)]: the flash backward (delta kernel included) at B=64, T=1024, NH=12, hs=64 per tiling."""
    import torch

    from llmpy.kernels import flash_attention as fa
    g = torch.Generator(device="cuda").manual_seed(2)
    B, T, NH, hs = 64, 1024, 12, 64
    C = NH * hs
    qkv = torch.randn(B, T, 3 * C, generator=g, device="cuda").to(torch.bfloat16)
    dout = torch.randn(B, T, C, generator=g, device="cuda").to(torch.bfloat16)
    out, dqkv = torch.empty(B, T, C, device="cuda", dtype=torch.bfloat16), torch.empty_like(qkv)
    lse, delta = (torch.empty(B, NH, T, device="cuda") for _ in range(2))
    fa.flash_attention_forward(out, lse, qkv, NH)
    rows = []
    for m1, n1, m2, n2, w, st, schedule, tma in FLASH_BWD:
        cfg = dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, bwd_warps=w, bwd_stages=st,
                   bwd_schedule=schedule, bwd_tma=tma, bwd_kernel="tl.dot")  # the tilings are the tl.dot kernel's

        def bwd(cfg=cfg):
            fa.FLASH_CONFIGS[hs] = cfg
            fa.flash_attention_backward(dqkv, dout, qkv, out, lse, NH, delta=delta)
        rows.append((f"flash bwd {m1}x{n1}/{m2}x{n2} w{w} s{st} {schedule}" + (" tma" if tma else ""), bwd))
    return rows


# the classifier's variants for --classifier: the model's TRAIN_CONFIG, then entries of
# bench_fused_classifier's sweep. twopass reads a row twice (the second time mostly from L2) and takes two
# exps an element (run T also timed the one-pass kernels here, which hold the row in registers); tma
# stages the row in shared memory (one read from HBM, two exps, the next row loading meanwhile: into the
# program's other buffer, b2, or into the SM's other program's, b1)
CLASSIFIER_LABELS = ["twopass B8192 w16", "tma w16 b2", "tma w16 b1"]


def classifier_variants() -> list[tuple[str, dict]]:
    """[(label, fused_classifier keywords)]: the model's configuration, then CLASSIFIER_LABELS."""
    from bench.kernels.bench_fused_classifier import TRAIN_SWEEP
    from llmpy.kernels.fused_classifier import TRAIN_CONFIG
    sweep = dict(TRAIN_SWEEP)
    return [("the model's TRAIN_CONFIG", dict(TRAIN_CONFIG))] + [(label, sweep[label]) for label in CLASSIFIER_LABELS]


def classifier_workloads():
    """[(name, fn)]: one chunk of the model's classifier (8192 rows of 50304 bf16 logits, training: the
    gradient written over them), each call on a fresh copy of the same logits (the copy is a row of its
    own: subtract it), so that every variant and every call sees real logits, not the last gradient."""
    import torch

    from llmpy.kernels.fused_classifier import fused_classifier
    g = torch.Generator(device="cuda").manual_seed(3)
    rows, V, Vp = 8192, 50257, 50304
    pristine = (torch.randn(rows, Vp, generator=g, device="cuda") * 2).to(torch.bfloat16)
    logits = torch.empty_like(pristine)
    targets = torch.randint(0, V, (rows,), generator=g, device="cuda", dtype=torch.int32)
    losses = torch.empty(rows, device="cuda")
    out = [("copy of the logits chunk alone", lambda: logits.copy_(pristine))]
    for name, kw in classifier_variants():
        out.append((f"copy + {name}", lambda kw=kw: (logits.copy_(pristine),
                                                      fused_classifier(logits, losses, 1 / 65536, targets, V, **kw))))
    return out


def measure(sustain_ms: float, workloads_fn=None) -> list[dict]:
    """The product alone, then every (name, fn) of workloads_fn() (default: the memory-bound passes)
    alone and right after the product."""
    import torch

    from bench.energy import EnergyCounter, sustained_energy
    from llmpy.kernels import cublaslt as lt
    counter = EnergyCounter(torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    # fc's weight gradient, as the model runs it (65536 x 3072 by 65536 x 768)
    gout = torch.randn(65536, 3072, generator=g, device="cuda").to(bf)
    xin = torch.randn(65536, 768, generator=g, device="cuda").to(bf)
    gw = torch.randn(3072, 768, generator=g, device="cuda").to(bf)

    def product():
        lt.linear_weight_grad(gw, gout, xin)

    base = sustained_energy(product, sustain_ms, counter)
    rows = [dict(name="fc dweight product", power_limit_w=counter.power_limit_w(),
                 **{f"alone_{k}": v for k, v in base.items()})]
    print(json.dumps(rows[-1]), flush=True)
    for name, fn in (workloads_fn or workloads)():
        alone = sustained_energy(fn, sustain_ms, counter)
        pair = sustained_energy(lambda f=fn: (product(), f()), sustain_ms, counter)
        row = dict(name=name, **{f"alone_{k}": v for k, v in alone.items()},
                   **{f"pair_{k}": v for k, v in pair.items()})
        row["pair_cost_ms"] = pair["ms"] - base["ms"]
        row["pair_cost_mj"] = pair["mj"] - base["mj"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sustain-ms", type=float, default=1000.0)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--flash", action="store_true",
                       help="the flash backward's tilings instead of the memory-bound passes")
    which.add_argument("--classifier", action="store_true", help="the fused classifier's variants instead")
    which.add_argument("--ln-forward", action="store_true", help="the LayerNorm forwards, one tile or three a row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.sustain_ms, flash_workloads if args.flash else classifier_workloads if args.classifier
                   else layernorm_forward_workloads if args.ln_forward else None)
    print(f"\n{'pass':40s} {'ms':>7s} {'mJ':>7s} {'W':>5s} {'MHz':>5s} | "
          f"{'pair ms':>7s} {'pair W':>6s} {'cost ms':>7s} {'cost mJ':>7s}")
    for r in rows:
        line = f"{r['name']:40s} {r['alone_ms']:7.3f} {r['alone_mj']:7.1f} {r['alone_watts']:5.0f} {r['alone_mhz']:5d}"
        if "pair_ms" in r:
            line += f" | {r['pair_ms']:7.3f} {r['pair_watts']:6.0f} {r['pair_cost_ms']:7.3f} {r['pair_cost_mj']:7.1f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
