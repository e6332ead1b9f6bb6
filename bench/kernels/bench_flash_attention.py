"""Benchmark: Triton flash attention (forward, backward, both) against torch SDPA's flash and cuDNN backends.

Shapes: GPT-2 124M per layer (B=64, T=1024, NH=12, hs=64) and a hs=128 variant (B=32, T=1024, NH=6), bf16,
causal. FLOPs counted as flash-attention papers do: forward 4*B*NH*T*T*hs / 2 (causal half), backward 2.5x.
The torch baselines get q, k, v in their preferred layout ((B, T, NH, hs) storage viewed as (B, NH, T, hs),
no copies) and the backward through autograd (torch.autograd.grad, so no .grad accumulation). torch.compile
is not timed: SDPA compiles to the same flash/cuDNN kernels.

After the headline rows comes a sweep of tile configurations per head size (each checked against SDPA's
output first), to fill in the table in llmpy/kernels/flash_attention.py.

    PYTHONPATH=src:. python -m bench.kernels.bench_flash_attention
"""
from __future__ import annotations

import torch

from bench.timing import median_ms, row
from llmpy.kernels import flash_attention as fa
from llmpy.kernels.flash_attention import FLASH_CONFIGS, flash_attention_backward, flash_attention_forward

SHAPES = [(64, 1024, 12, 64), (32, 1024, 6, 128)]  # (B, T, NH, hs)
DTYPE = torch.bfloat16

FWD_SWEEP = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages, fwd_tma)
    (128, 64, 8, 3, False), (64, 64, 4, 3, False), (128, 128, 8, 3, False),
    (128, 64, 8, 3, True), (128, 64, 8, 2, True), (128, 64, 8, 4, True), (128, 64, 4, 3, True),
    (128, 128, 8, 3, True), (64, 64, 4, 3, True), (64, 64, 4, 2, True), (64, 64, 4, 4, True), (64, 32, 4, 3, True),
    (64, 64, 8, 3, True), (256, 64, 8, 3, True),
    # key tiles larger than query tiles (cuDNN's forward runs 64 x 128)
    (64, 128, 4, 3, True), (64, 128, 4, 2, True), (64, 128, 8, 3, True), (32, 64, 4, 3, True),
]
BWD_SWEEP = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages, bwd_schedule)
    # the dk/dv half's tiles (query x key) need not match the dq half's: 32x64 with 64x64 won at hs 64 (run J)
    (32, 64, 64, 64, 4, 3, "fused"), (32, 64, 64, 64, 4, 2, "fused"), (32, 64, 64, 64, 4, 4, "fused"),
    (16, 64, 64, 64, 4, 3, "fused"), (32, 64, 64, 64, 8, 3, "fused"), (32, 64, 64, 32, 4, 3, "fused"),
    (64, 64, 64, 64, 4, 3, "fused"), (64, 64, 64, 32, 4, 3, "fused"), (64, 64, 64, 64, 4, 2, "fused"),
    (32, 128, 128, 64, 4, 3, "fused"), (32, 128, 128, 64, 8, 3, "fused"), (32, 128, 128, 32, 4, 3, "fused"),
    (64, 128, 128, 64, 8, 3, "fused"), (16, 64, 64, 16, 4, 3, "fused"),
    (32, 64, 64, 64, 4, 3, "split"), (64, 64, 64, 64, 4, 3, "split"), (32, 128, 128, 32, 8, 3, "split"),
    # query tiles larger than key tiles in the dk/dv half, key tiles larger than query tiles in the dq half
    (32, 64, 64, 128, 4, 3, "fused"), (64, 64, 64, 128, 4, 3, "fused"), (128, 64, 64, 64, 4, 3, "fused"),
    (128, 64, 64, 128, 8, 3, "fused"), (64, 32, 32, 64, 4, 3, "fused"), (32, 64, 64, 128, 4, 3, "split"),
    # the streamed tiles through TMA (an 8th field: bwd_tma)
    (32, 64, 64, 64, 4, 3, "fused", True), (32, 64, 64, 64, 4, 2, "fused", True),
    (32, 64, 64, 64, 4, 4, "fused", True), (64, 64, 64, 64, 4, 3, "fused", True),
    (32, 64, 64, 128, 4, 3, "fused", True), (32, 64, 64, 64, 4, 3, "split", True),
    (16, 64, 64, 64, 4, 3, "fused", True), (32, 64, 64, 32, 4, 3, "fused", True),
    (32, 128, 128, 64, 4, 3, "fused", True), (32, 128, 128, 64, 8, 3, "fused", True),
    (64, 64, 64, 32, 4, 3, "fused", True), (16, 32, 32, 32, 4, 3, "fused", True),
]


def flops_fwd(B, T, NH, hs):
    return 4 * B * NH * T * T * hs / 2


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms == ms else float("nan")


def rel_err(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


class Case:
    """Inputs and outputs for one shape: ours in the model's layout, torch's as separate q, k, v."""

    def __init__(self, B, T, NH, hs):
        self.B, self.T, self.NH, self.hs = B, T, NH, hs
        C = NH * hs
        g = torch.Generator(device="cuda").manual_seed(0)
        self.qkv = torch.randn(B, T, 3 * C, device="cuda", dtype=DTYPE, generator=g)
        self.dout = torch.randn(B, T, C, device="cuda", dtype=DTYPE, generator=g)
        self.out = torch.empty(B, T, C, device="cuda", dtype=DTYPE)
        self.lse = torch.empty(B, NH, T, device="cuda", dtype=torch.float32)
        self.delta = torch.empty(B, NH, T, device="cuda", dtype=torch.float32)
        self.dqkv = torch.empty_like(self.qkv)
        # torch: the same numbers, (B, T, NH, hs) storage seen as (B, NH, T, hs), leaves for autograd
        split = self.qkv.view(B, T, 3, NH, hs)
        self.leaves = [split[:, :, i].clone().requires_grad_() for i in range(3)]
        self.qkv_t = [x.transpose(1, 2) for x in self.leaves]
        self.dout_t = self.dout.view(B, T, NH, hs).transpose(1, 2)
        es = self.qkv.element_size()
        n = B * T * C
        self.bytes_fwd = 3 * n * es + n * es + B * NH * T * 4
        self.bytes_bwd = (n + 3 * n + n) * es + B * NH * T * 4 + 3 * n * es + B * NH * T * 4
        self.bytes_fwdbwd = (3 * n + n) * es + n * es + B * NH * T * 4 + 3 * n * es
        self.flops = flops_fwd(B, T, NH, hs)

    # ours
    def fwd(self):
        flash_attention_forward(self.out, self.lse, self.qkv, self.NH)

    def bwd(self):
        flash_attention_backward(self.dqkv, self.dout, self.qkv, self.out, self.lse, self.NH, delta=self.delta)

    def fwdbwd(self):
        self.fwd()
        self.bwd()

    # torch
    def torch_times(self, backend):
        """(fwd, bwd, fwd+bwd) ms of SDPA with one backend, or Nones where it is unavailable."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        q, k, v = self.qkv_t
        try:
            with sdpa_kernel(backend):
                def fwd():
                    with torch.no_grad():
                        sdpa(q, k, v, is_causal=True)

                def fwdbwd():
                    o = sdpa(q, k, v, is_causal=True)
                    torch.autograd.grad(o, self.leaves, self.dout_t)

                o = sdpa(q, k, v, is_causal=True)

                def bwd():
                    torch.autograd.grad(o, self.leaves, self.dout_t, retain_graph=True)

                return median_ms(fwd), median_ms(bwd), median_ms(fwdbwd)
        except Exception as e:  # backend unavailable for this shape/build
            print(f"  sdpa {backend}: {type(e).__name__}: {str(e)[:200]}")
            return None, None, None

    def torch_reference(self):
        """SDPA (flash) output and dqkv, to check each of our configurations."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        q, k, v = self.qkv_t
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = sdpa(q, k, v, is_causal=True)
            grads = torch.autograd.grad(o, self.leaves, self.dout_t)
        B, T, C = self.B, self.T, self.NH * self.hs
        return o.detach().transpose(1, 2).reshape(B, T, C), torch.cat([g.reshape(B, T, C) for g in grads], -1)


def bench(head_sizes=None, sweeps=("fwd", "bwd"), schedules=None) -> list[dict]:
    """The headline rows and the tile sweeps (those named in sweeps; backward entries of the schedules
    named, all by default) for the shapes whose head size is in head_sizes (all by default)."""
    from torch.nn.attention import SDPBackend
    rows = []
    for B, T, NH, hs in SHAPES:
        if head_sizes and hs not in head_sizes:
            continue
        FLASH_CONFIGS.clear()
        case = Case(B, T, NH, hs)
        tag = f"B{B} T{T} NH{NH} hs{hs}"
        ref_out, ref_dqkv = case.torch_reference()
        case.fwdbwd()
        torch.cuda.synchronize()
        check = f"err vs sdpa: out {rel_err(case.out, ref_out):.1e} dqkv {rel_err(case.dqkv, ref_dqkv):.1e}"

        ours = [median_ms(case.fwd), median_ms(case.bwd), median_ms(case.fwdbwd)]
        flash = case.torch_times(SDPBackend.FLASH_ATTENTION)
        cudnn = case.torch_times(SDPBackend.CUDNN_ATTENTION)
        flops = [case.flops, 2.5 * case.flops, 3.5 * case.flops]
        nbytes = [case.bytes_fwd, case.bytes_bwd, case.bytes_fwdbwd]
        cfg = fa.flash_config(hs, DTYPE)
        for i, name in enumerate(["fwd", "bwd", "fwd+bwd"]):
            cudnn_txt = f"{cudnn[i]:.3f} ms" if cudnn[i] is not None else "n/a"
            note = (f"{tag}; TFLOP/s ours {tflops(flops[i], ours[i]):.0f}, flash {tflops(flops[i], flash[i]):.0f}, "
                    f"cudnn {tflops(flops[i], cudnn[i]):.0f}; cudnn {cudnn_txt}")
            if i == 0:
                note += f"; {check}; config {cfg}"
            rows.append(row(f"flash_attention {name} hs{hs}", nbytes[i], ours[i], baseline="sdpa flash",
                            baseline_ms=flash[i], compiled_ms=None, note=note))
            rows.append(row(f"sdpa cudnn {name} hs{hs}", nbytes[i], cudnn[i] if cudnn[i] is not None else float("nan"),
                            baseline="sdpa flash", baseline_ms=flash[i], compiled_ms=None,
                            note=f"{tag}; baseline row: torch cuDNN backend"))

        # ---- tile sweep: forward, then backward (on the default forward's out/lse)
        for bm, bn, w, s, tma in FWD_SWEEP if "fwd" in sweeps else ():
            FLASH_CONFIGS[hs] = dict(BLOCK_M=bm, BLOCK_N=bn, fwd_warps=w, fwd_stages=s, fwd_tma=tma)
            name = f"sweep fwd hs{hs} BM{bm} BN{bn} w{w} s{s}" + (" tma" if tma else "")
            err = lambda case=case: rel_err(case.out, ref_out)  # noqa: E731 (case is deleted below)
            rows.append(_sweep_row(name, case.fwd, err, case.bytes_fwd, flops[0], flash[0]))
            rows[-1]["fields"] = dict(FLASH_CONFIGS[hs])
        FLASH_CONFIGS.clear()
        case.fwd()
        for m1, n1, m2, n2, w, s, schedule, *tma in BWD_SWEEP if "bwd" in sweeps else ():
            if schedules and schedule not in schedules:
                continue
            tma = bool(tma and tma[0])
            # the tiles are the tl.dot kernel's (the wgmma kernel has its own: bench_flash_backward)
            FLASH_CONFIGS[hs] = dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, bwd_warps=w, bwd_stages=s,
                                     bwd_schedule=schedule, bwd_tma=tma, bwd_kernel="tl.dot")
            tiles = f"M1 {m1} N1 {n1} M2 {m2} N2 {n2}"
            name = f"sweep bwd hs{hs} {tiles} w{w} s{s} {schedule}" + (" tma" if tma else "")
            err = lambda case=case: rel_err(case.dqkv, ref_dqkv)  # noqa: E731 (case is deleted below)
            rows.append(_sweep_row(name, case.bwd, err, case.bytes_bwd, flops[1], flash[1]))
            rows[-1]["fields"] = dict(FLASH_CONFIGS[hs])
        FLASH_CONFIGS.clear()
        del case
        torch.cuda.empty_cache()
    return rows


def _sweep_row(name, fn, err_fn, nbytes, flops, flash_ms):
    try:
        fn()
        torch.cuda.synchronize()
        err = err_fn()
        ms = median_ms(fn)
        note = f"TFLOP/s {tflops(flops, ms):.0f}; err vs sdpa {err:.1e}" + ("  WRONG" if not err < 2e-2 else "")
    except Exception as e:  # e.g. out of shared memory / registers for this tile
        ms, note = float("nan"), f"failed: {type(e).__name__}: {str(e)[:120]}"
    return row(name, nbytes, ms, baseline="sdpa flash", baseline_ms=flash_ms, compiled_ms=None, note=note)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hs", type=int, nargs="*", default=None, help="head sizes to run (default: all shapes)")
    ap.add_argument("--sweeps", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd"], help="tile sweeps to run")
    ap.add_argument("--schedules", nargs="*", default=None, choices=fa.BWD_SCHEDULES,
                    help="backward schedules to sweep (default: all)")
    ap.add_argument("--best-json", default=None,
                    help="write the fastest correct sweep entry (forward, and each backward schedule) here, as "
                         "FLASH_CONFIGS fields")
    cli = ap.parse_args()
    best: dict = {}
    for r in bench(cli.hs, cli.sweeps, cli.schedules):
        base = f"{r['baseline_ms']:.3f}" if r["baseline_ms"] is not None else "n/a"
        print(f"{r['kernel']:<58} {r['ms']:8.3f} ms  {r['bytes'] / 1e6:8.1f} MB  "
              f"{r['baseline']} {base} ms  | {r['note']}")
        if "fields" in r and r["ms"] == r["ms"] and "WRONG" not in r["note"]:  # a sweep row that ran and was right
            f = r["fields"]
            sched = (f["bwd_schedule"] + (" tma" if f["bwd_tma"] else "")) if "bwd_schedule" in f else "fwd"
            if sched not in best or r["ms"] < best[sched]["ms"]:
                best[sched] = {"ms": r["ms"], "fields": r["fields"]}
    if cli.best_json:
        import json
        with open(cli.best_json, "w") as f:
            json.dump(best, f, indent=1)
        print("best per sweep:", json.dumps(best))
