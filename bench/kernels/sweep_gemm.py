"""Sweep: the Triton GEMM with GELU epilogues against cuBLAS + a separate GELU pass, GPT-2 124M fc layer.

Two places where GELU can ride in a matrix product's epilogue (llm.c's -ge on sm_90):
- fc forward, GELU_AUX: pre = ln2 @ W_fc.T + b (65536 x 768 @ 768 x 3072), out = gelu(pre), both stored;
  against torch.addmm (cuBLASLt, bias epilogue) + gelu_forward.
- fcproj's dinp, DGELU: d = (dout @ W_fcproj) * gelu'(pre) (65536 x 768 @ 768 x 3072); against torch.mm +
  the elementwise dGELU pass.
Each Triton configuration (pointer kernel, and the persistent TMA kernel with several tiles) is checked
against the cuBLAS result first (relative error printed), then timed (median of do_bench). Also the plain
bias GEMM through both, to separate the GEMM's speed from the epilogue's.

    PYTHONPATH=src:. python -m bench.kernels.sweep_gemm [--json out.json] [--budget-s 240]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.timing import median_ms
from llmpy.kernels import matmul as mm
from llmpy.kernels.gelu import gelu_backward_inplace, gelu_forward

M, C, OC = 64 * 1024, 768, 3072
BF16 = torch.bfloat16
FLOPS = 2 * M * C * OC


def cfg(bm, bn, bk, warps, stages, tma=True, per_sm=1, subtile=False, flatten=False, ws=False, group=8):
    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
    if tma:
        c.update(TMA=True, PROGRAMS_PER_SM=per_sm, SUBTILE=subtile, FLATTEN=flatten, WARP_SPECIALIZE=ws)
    return c


# The first run (2026-12-01, c47a372) swept the pointer kernel and TMA 128x256 / 128x128 / 256x128 tiles,
# 3-5 stages, subtiled or not, flattened or not, group 8/16: best 128x256x64 w8 s3 sub flat (GELU_AUX
# 0.698 ms, DGELU 0.815 ms against cuBLAS + pass 0.678 / 0.820). This list is the second round, around it.
CONFIGS = [
    cfg(128, 256, 64, 8, 3, subtile=True, flatten=True),
    cfg(128, 256, 64, 8, 3, subtile=True, flatten=True, ws=True),
    cfg(128, 256, 64, 8, 3, subtile=True, ws=True),
    cfg(128, 256, 64, 8, 4, subtile=True, ws=True),
    cfg(128, 256, 64, 8, 3, flatten=True),
    cfg(128, 128, 64, 8, 4, subtile=True, flatten=True, ws=True),
    cfg(128, 128, 64, 4, 4, flatten=True, ws=True),
    cfg(256, 128, 64, 8, 3, subtile=True, flatten=True),
    cfg(128, 256, 64, 8, 2, subtile=True, flatten=True),
    cfg(128, 256, 32, 8, 6, subtile=True, flatten=True),
]


def name(c: dict) -> str:
    s = f"{'tma' if c.get('TMA') else 'ptr'} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
    s += f" w{c['num_warps']} s{c['num_stages']}"
    if c.get("TMA"):
        s += f" p{c['PROGRAMS_PER_SM']}" + (" sub" if c["SUBTILE"] else "") + (" flat" if c["FLATTEN"] else "")
        s += " ws" if c["WARP_SPECIALIZE"] else ""
    if c["GROUP_M"] != 8:
        s += f" g{c['GROUP_M']}"
    return s


def rel(x, y) -> float:
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    t_start = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, C, device="cuda", dtype=BF16, generator=g)
    w_fc = (torch.randn(OC, C, device="cuda", generator=g) * C ** -0.5).to(BF16)
    b_fc = (torch.randn(OC, device="cuda", generator=g) * 0.5).to(BF16)
    dout = torch.randn(M, C, device="cuda", dtype=BF16, generator=g)
    w_proj = (torch.randn(C, OC, device="cuda", generator=g) * OC ** -0.5).to(BF16)
    pre_ref, out_ref = torch.empty(M, OC, device="cuda", dtype=BF16), torch.empty(M, OC, device="cuda", dtype=BF16)
    d_ref = torch.empty(M, OC, device="cuda", dtype=BF16)
    pre, out, d = (torch.empty(M, OC, device="cuda", dtype=BF16) for _ in range(3))

    def fwd_cublas():
        torch.addmm(b_fc, x, w_fc.t(), out=pre_ref)
        gelu_forward(out_ref, pre_ref)

    def bwd_cublas():
        torch.mm(dout, w_proj, out=d_ref)
        gelu_backward_inplace(d_ref, pre_ref)

    rows = []

    def add(what, ms, err=None, note=""):
        r = dict(what=what, ms=ms, tflops=FLOPS / (ms * 1e-3) / 1e12 if ms else None, rel_err=err, note=note)
        rows.append(r)
        e = f" rel_err {err:.1e}" if err is not None else ""
        print(f"{what:60s} {ms:8.3f} ms {r['tflops'] or 0:6.0f} TFLOP/s{e} {note}", flush=True)

    fwd_cublas()
    add("cuBLAS addmm (bias) alone", median_ms(lambda: torch.addmm(b_fc, x, w_fc.t(), out=pre_ref)))
    add("fc fwd: cuBLAS addmm + gelu_forward", median_ms(fwd_cublas))
    add("fcproj dinp: cuBLAS mm alone", median_ms(lambda: torch.mm(dout, w_proj, out=d_ref)))
    bwd_cublas()
    add("fcproj dinp+dGELU: cuBLAS mm + gelu_backward_inplace", median_ms(bwd_cublas))
    # the references: every timed call above recomputed pre_ref (= x @ w_fc.T + b_fc), out_ref and d_ref

    for c in CONFIGS:
        if time.time() - t_start > args.budget_s:
            print("budget spent; remaining configs skipped", flush=True)
            break
        n = name(c)
        for what, fn, check in (
            ("bias", lambda: mm.triton_matmul(out, x, w_fc.t(), b_fc, config=c), lambda: rel(out, pre_ref)),
            ("GELU_AUX", lambda: mm.triton_matmul(out, x, w_fc.t(), b_fc, aux=pre, epilogue=mm.EPILOGUE_GELU_AUX,
                                                  config=c), lambda: max(rel(pre, pre_ref), rel(out, out_ref))),
            ("DGELU", lambda: mm.triton_matmul(d, dout, w_proj, aux=pre_ref, epilogue=mm.EPILOGUE_DGELU, config=c),
             lambda: rel(d, d_ref)),
        ):
            try:
                fn()
                torch.cuda.synchronize()
                err = check()
                add(f"{what:9s} {n}", median_ms(fn), err)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a row, not a crash
                print(f"{what:9s} {n}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(what=f"{what} {n}", ms=None, note=f"failed: {type(e).__name__}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
