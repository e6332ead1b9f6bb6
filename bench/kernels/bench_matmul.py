"""Linear layers at GPT-2 124M shapes, B=64, T=1024 (M = 65536 rows), bf16, on CUDA.

- forward and backward of each linear (qkv, attproj, fc, fcproj, lm_head) through kernels/matmul.py,
  with TFLOP/s against cuBLAS anchors, and F.linear / the eager backward (and torch.compile) as baseline;
  the backward's two GEMMs also on their own (dweight accumulates with beta = 1: kernels counted);
- the deterministic bias-gradient reduction's bandwidth against dout.sum(0);
- the GELU fusion choices: fc forward (-ge 0: addmm + gelu kernel, 1: Triton GEMM with the
  GELU_AUX epilogue over a sweep of tile configs, torch's _addmm_activation that writes only the
  activation), fcproj's dinp with dGELU (separate pass, Triton DGELU epilogue),
  and bias_gelu_backward (dGELU + fc's bias gradient in one pass).

Run: PYTHONPATH=src:. python -m bench.kernels.bench_matmul [--no-compile]
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from bench.timing import copy_bandwidth_gbs, median_ms, row
from llmpy.kernels import matmul as mm
from llmpy.kernels.gelu import gelu_backward_inplace

M = 64 * 1024
BF16 = torch.bfloat16
E = 2  # bytes per bf16 element
# name, C (in), OC (out), has bias, anchor key
LINEARS = [("qkv", 768, 2304, True, "qkv"), ("attproj", 768, 768, True, "proj"), ("fc", 768, 3072, True, "fc"),
           ("fcproj", 3072, 768, True, "proj"), ("lm_head", 768, 50304, False, "lm_head")]
# cuBLAS TFLOP/s at these shapes on H100-class parts (the reference figures to compare with)
ANCHOR_TFLOPS = {"qkv": 606, "fc": 600, "proj": 667, "lm_head": 618}
# Triton GEMM tiles tried for the fused epilogues (the first is mm.GEMM_CONFIGS["bf16"], the default)
SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=5),
]


def _randn(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=BF16) * scale


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _time(fn) -> float:
    fn()  # compile / pick heuristics outside the timing
    torch.cuda.synchronize()
    return median_ms(fn)


def _time_or_none(fn):
    try:
        return _time(fn), ""
    except Exception as e:  # a tile config that does not fit, an op torch lacks
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def _compiled_ms(fn, *args, enabled=True):
    """Median time of torch.compile(fn)(*args), or None if compilation fails (or is switched off)."""
    if not enabled:
        return None
    try:
        torch._dynamo.reset()  # a fresh cache per baseline: no recompile limit across shapes
        cfn = torch.compile(fn, dynamic=False)
        return _time(lambda: cfn(*args))
    except Exception:
        return None


def _cfg_name(cfg: dict) -> str:
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f" g{cfg['GROUP_M']}" + (" tma" if cfg.get("TMA") else ""))


def _cuda_kernels(fn) -> list[str]:
    """Names of the CUDA kernels (and copies) one call of fn launches."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# ----------------------------------------------------------------------------------------------------

def _eager_backward(dout, inp, w, dweight, dbias):
    dinp = dout @ w
    dweight.add_(dout.t() @ inp)
    if dbias is not None:
        dbias.add_(dout.sum(0))
    return dinp


def _linear_rows(compile_: bool) -> list[dict]:
    rows = []
    for name, C, OC, has_bias, anchor_key in LINEARS:
        anchor = ANCHOR_TFLOPS[anchor_key]
        inp, w = _randn(M, C), _randn(OC, C, scale=C ** -0.5)
        b = _randn(OC, scale=0.1) if has_bias else None
        flops = 2.0 * M * C * OC

        # forward: out = inp @ w.T + b
        out = torch.empty(M, OC, device="cuda", dtype=BF16)
        ms = _time(lambda: mm.matmul_forward(out, inp, w, b))
        base = _time(lambda: F.linear(inp, w, b))
        naive = _time(lambda: inp @ w.t() + b) if has_bias else None
        comp = _compiled_ms(F.linear, inp, w, b, enabled=compile_)
        nbytes = (M * C + OC * C + (OC if has_bias else 0) + M * OC) * E
        note = f"{_tflops(flops, ms):.0f} TFLOP/s (anchor {anchor})"
        if naive is not None:
            note += f"; x@W.T + b eager {naive:.3f} ms"
        rows.append(row(f"matmul_forward {name} {C}->{OC}", nbytes, ms, "F.linear", base, comp, note))
        del out

        # backward: dinp = dout @ w, dweight += dout.T @ inp, dbias += sum(dout)
        dout = _randn(M, OC)
        dinp = torch.empty(M, C, device="cuda", dtype=BF16)
        dweight = _randn(OC, C, scale=1e-3)
        dbias = _randn(OC, scale=1e-3) if has_bias else None
        scratch = torch.empty(max(1, mm.bias_scratch_numel(M, OC, "cuda")), device="cuda", dtype=torch.float32)
        ms = _time(lambda: mm.matmul_backward(dinp, dweight, dbias, dout, inp, w, scratch=scratch))
        base = _time(lambda: _eager_backward(dout, inp, w, dweight, dbias))
        comp = _compiled_ms(_eager_backward, dout, inp, w, dweight, dbias, enabled=compile_)
        nbytes = (M * OC + M * C + OC * C + M * C + 2 * OC * C + (2 * OC if has_bias else 0)) * E
        rows.append(row(f"matmul_backward {name} {C}->{OC}", nbytes, ms, "eager mm + add_(mm) + sum", base, comp,
                        f"{_tflops(2 * flops, ms):.0f} TFLOP/s GEMMs+bias (anchor {anchor})"))

        # the two GEMMs on their own
        ms = _time(lambda: torch.mm(dout, w, out=dinp))
        rows.append(row(f"  dinp = dout @ W {name}", (M * OC + OC * C + M * C) * E, ms, "dout @ W",
                        _time(lambda: dout @ w), None, f"{_tflops(flops, ms):.0f} TFLOP/s (anchor {anchor})"))
        ms = _time(lambda: dweight.addmm_(dout.t(), inp))
        try:
            kernels = _cuda_kernels(lambda: dweight.addmm_(dout.t(), inp))
            knote = f"; {len(kernels)} kernel(s): {', '.join(k[:40] for k in kernels)}"
        except Exception as e:
            knote = f"; profiler failed: {type(e).__name__}"
        rows.append(row(f"  dweight.addmm_(dout.T, inp) {name}", (M * OC + M * C + 2 * OC * C) * E, ms,
                        "dweight.add_(dout.T @ inp)", _time(lambda: dweight.add_(dout.t() @ inp)), None,
                        f"{_tflops(flops, ms):.0f} TFLOP/s (anchor {anchor}){knote}"))
        del inp, w, b, dout, dinp, dweight, dbias, scratch
        torch.cuda.empty_cache()
    return rows


def _bias_rows(compile_: bool, copy_gbs: float) -> list[dict]:
    rows = []

    def eager(dbias, dout):
        dbias.add_(dout.sum(0))

    for OC in (768, 2304, 3072):
        dout, dbias = _randn(M, OC), _randn(OC, scale=1e-3)
        scratch = torch.empty(max(1, mm.bias_scratch_numel(M, OC, "cuda")), device="cuda", dtype=torch.float32)
        chunks, _ = mm.bias_backward_chunks(M, OC, "cuda")
        ms = _time(lambda: mm.matmul_backward_bias(dbias, dout, scratch))
        nbytes = (M * OC + 2 * OC) * E
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(row(f"matmul_backward_bias ({M}, {OC})", nbytes, ms, "dbias.add_(dout.sum(0))",
                        _time(lambda: eager(dbias, dout)), _compiled_ms(eager, dbias, dout, enabled=compile_),
                        f"{gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy; {chunks} chunks"))
    return rows


def _gelu_rows(compile_: bool) -> list[dict]:
    rows = []
    C, OC = 768, 3072
    flops = 2.0 * M * C * OC

    # fc forward with GELU: pre = inp @ W.T + b, out = gelu(pre)
    inp, w, b = _randn(M, C), _randn(OC, C, scale=C ** -0.5), _randn(OC, scale=0.1)
    out, pre = (torch.empty(M, OC, device="cuda", dtype=BF16) for _ in range(2))
    try:
        act = _time(lambda: torch._addmm_activation(b, inp, w.t(), use_gelu=True))
    except Exception:
        act = None

    def eager_fc(x, w, b):
        return F.gelu(F.linear(x, w, b), approximate="tanh")

    comp = _compiled_ms(eager_fc, inp, w, b, enabled=compile_)
    nbytes = (M * C + OC * C + OC + 2 * M * OC) * E  # both pre_gelu and out written
    plain = _time(lambda: mm.matmul_forward(out, inp, w, b))
    for epilogue in (False, True):
        ms = _time(lambda: mm.matmul_forward(out, inp, w, b, pre_gelu=pre, gelu_epilogue=epilogue))
        what = (f"Triton GELU_AUX, default {_cfg_name(mm.gemm_config(BF16, 'cuda'))}" if epilogue
                else "addmm + gelu_forward")
        rows.append(row(f"fc fwd+GELU -ge {int(epilogue)} ({what})", nbytes, ms,
                        "_addmm_activation (writes out only)", act, comp,
                        f"{_tflops(flops, ms):.0f} TFLOP/s; plain addmm (no GELU) {plain:.3f} ms"))
    for cfg in SWEEP:
        ms, err = _time_or_none(lambda: mm.triton_matmul(out, inp, w.t(), b, aux=pre, epilogue=mm.EPILOGUE_GELU_AUX,
                                                          config=cfg))
        rows.append(row(f"  Triton GELU_AUX {_cfg_name(cfg)}", nbytes, ms, "_addmm_activation", act, None,
                        err or f"{_tflops(flops, ms):.0f} TFLOP/s"))
    ms, err = _time_or_none(lambda: mm.triton_matmul(out, inp, w.t(), b))
    rows.append(row("  Triton GEMM + bias, no GELU (raw Triton vs cuBLAS)", (M * C + OC * C + OC + M * OC) * E, ms,
                    "addmm (cuBLASLt BIAS)", plain, None, err or f"{_tflops(flops, ms):.0f} TFLOP/s"))
    del inp, w, b, out

    # fcproj backward's dinp with dGELU: d = (dout @ W) * gelu'(pre), W (768, 3072); pre from the forward
    dout, w_proj = _randn(M, C), _randn(C, OC, scale=OC ** -0.5)
    d = torch.empty(M, OC, device="cuda", dtype=BF16)

    def eager_dgelu(dout, w, pre):
        return torch.ops.aten.gelu_backward(dout @ w, pre, approximate="tanh")

    base = _time(lambda: eager_dgelu(dout, w_proj, pre))
    comp = _compiled_ms(eager_dgelu, dout, w_proj, pre, enabled=compile_)
    nbytes = (M * C + C * OC + 2 * M * OC) * E  # dout, W, pre read; d written
    mm_only = _time(lambda: torch.mm(dout, w_proj, out=d))
    variants = [
        ("mm + gelu_backward_inplace", lambda: gelu_backward_inplace(torch.mm(dout, w_proj, out=d), pre)),
        (f"-ge 2 (Triton DGELU, default {_cfg_name(mm.gemm_config(BF16, 'cuda'))})",
         lambda: mm.triton_matmul(d, dout, w_proj, aux=pre, epilogue=mm.EPILOGUE_DGELU)),
    ]
    for what, fn in variants:
        ms, err = _time_or_none(fn)
        rows.append(row(f"fcproj dinp+dGELU {what}", nbytes, ms, "eager aten.gelu_backward(dout @ W)", base, comp,
                        err or f"{_tflops(flops, ms):.0f} TFLOP/s; mm alone {mm_only:.3f} ms"))
    for cfg in SWEEP[1:]:
        ms, err = _time_or_none(lambda: mm.triton_matmul(d, dout, w_proj, aux=pre, epilogue=mm.EPILOGUE_DGELU,
                                                          config=cfg))
        rows.append(row(f"  Triton DGELU {_cfg_name(cfg)}", nbytes, ms, "eager", base, None,
                        err or f"{_tflops(flops, ms):.0f} TFLOP/s"))

    # dGELU + fc's bias gradient: one pass (bias_gelu_backward) or two (gelu_backward_inplace + bias reduction).
    # Repeated in place the values drift; the bytes moved, and so the time, do not.
    db = _randn(OC, scale=1e-3)
    scratch = torch.empty(max(1, mm.bias_scratch_numel(M, OC, "cuda")), device="cuda", dtype=torch.float32)
    torch.mm(dout, w_proj, out=d)
    ms = _time(lambda: mm.bias_gelu_backward(db, scratch, d, pre))
    unfused = _time(lambda: (gelu_backward_inplace(d, pre), mm.matmul_backward_bias(db, d, scratch)))

    def eager_bias_gelu(d, pre, db):
        g = torch.ops.aten.gelu_backward(d, pre, approximate="tanh")
        db.add_(g.sum(0))
        return g

    base = _time(lambda: eager_bias_gelu(d, pre, db))
    comp = _compiled_ms(eager_bias_gelu, d, pre, db, enabled=compile_)
    nbytes = (3 * M * OC + 2 * OC) * E
    gbs = nbytes / (ms * 1e-3) / 1e9
    rows.append(row(f"bias_gelu_backward ({M}, {OC})", nbytes, ms, "eager gelu_backward + sum(0)", base, comp,
                    f"{gbs:.0f} GB/s; unfused gelu_backward_inplace + matmul_backward_bias {unfused:.3f} ms"))
    return rows


def bench(compile_: bool = True) -> list[dict]:
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows = _linear_rows(compile_)
    rows += _bias_rows(compile_, copy_gbs)
    rows += _gelu_rows(compile_)
    return rows


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, M = B*T = {M}, bf16")
    print(f"{'kernel':<72} {'ms':>8} {'GB/s':>7} {'baseline':>9} {'compiled':>9}  note")

    def fmt(x):
        return f"{x:9.3f}" if isinstance(x, float) else f"{'-':>9}"

    for r in bench(compile_="--no-compile" not in sys.argv):
        gbs = f"{r['bytes'] / (r['ms'] * 1e-3) / 1e9:7.0f}" if r["ms"] else f"{'-':>7}"
        print(f"{r['kernel']:<72} {fmt(r['ms'])[1:]} {gbs} {fmt(r['baseline_ms'])} {fmt(r['compiled_ms'])}  "
              f"[{r['baseline']}] {r['note']}")
