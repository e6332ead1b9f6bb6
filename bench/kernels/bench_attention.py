"""Attention per layer at GPT-2 124M shapes (B=64, T=1024; NH=12 hs=64, and NH=6 hs=128): forward, and
forward + backward, for each impl of llmpy.kernels.attention (classic, Triton flash, cuDNN, torch flash).

Baselines in plain PyTorch: for the classic path the same math written out in eager torch with
autograd (scores, mask, softmax, att @ v; torch.compile of it as the compiled column); for the fused
paths F.scaled_dot_product_attention with autograd, default backend (and torch.compile of it).

nbytes: each input read once and each output written once at the launchers' interface: fused
forward reads qkv and writes out + lse; fused backward reads dout, qkv, out, lse and writes dqkv.
The classic forward also writes its saved qkvr and att (B, NH, T, T), which its backward reads; its
backward's scratch (dqkvr, datt) is not counted.

Run: PYTHONPATH=src:. python -m bench.kernels.bench_attention   (anchors: cuDNN ~1.35 ms/layer fwd+bwd,
torch flash ~2.20 ms at NH=12 hs=64)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench.timing import median_ms, row
from llmpy.kernels import attention as A

B, T = 64, 1024
CONFIGS = [(12, 64), (6, 128)]  # (NH, hs)
DTYPE = torch.bfloat16


def _try_ms(fn):
    """Median ms of fn, or None (with the error) when it fails: one impl's failure leaves the others."""
    try:
        fn()
        torch.cuda.synchronize()
        return median_ms(fn), ""
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a test
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def _math_attention(qkv, NH):
    """Causal attention written out in eager torch: the classic path's baseline."""
    q, k, v = A._qkv_views(qkv, NH)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    n = qkv.shape[1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=qkv.device).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _sdpa_attention(qkv, NH):
    return F.scaled_dot_product_attention(*A._qkv_views(qkv, NH), is_causal=True)


def _baseline(fn, qkv, dout_h, NH, backward: bool, compiled: bool):
    """ms of fn (forward, or forward + backward through autograd), eager or torch.compile'd."""
    f = fn
    if compiled:
        try:
            f = torch.compile(fn)
        except Exception:  # noqa: BLE001
            return None
    x = qkv.detach().requires_grad_(backward)

    def step():
        if backward:
            x.grad = None
            f(x, NH).backward(dout_h)
        else:
            with torch.no_grad():
                f(x, NH)

    ms, _ = _try_ms(step)
    return ms


def bench() -> list[dict]:
    rows = []
    for NH, hs in CONFIGS:
        C = NH * hs
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3 * C, device="cuda").to(DTYPE)
        dout = torch.randn(B, T, C, device="cuda").to(DTYPE)
        dout_h = A._heads_view(dout, NH)
        out = torch.empty(B, T, C, device="cuda", dtype=DTYPE)
        dqkv = torch.empty_like(qkv)
        e = qkv.element_size()
        fused_fwd_bytes = (3 * B * T * C + B * T * C) * e + B * NH * T * 4
        fused_bwd_bytes = (B * T * C * 2 + 3 * B * T * C * 2) * e + B * NH * T * 4
        classic_fwd_bytes = (3 * B * T * C + B * T * C + 3 * B * T * C + B * NH * T * T) * e
        classic_bwd_bytes = (B * T * C + 3 * B * T * C + B * NH * T * T + 3 * B * T * C) * e

        base = {}
        for name, fn in (("math", _math_attention), ("sdpa", _sdpa_attention)):
            for backward in (False, True):
                for compiled in (False, True):
                    base[name, backward, compiled] = _baseline(fn, qkv, dout_h, NH, backward, compiled)

        for impl in A.ATTENTION_IMPLS:
            buf = {}
            note = ""
            try:
                for name, (shape, kind) in A.attention_buffer_shapes(impl, B, T, C, NH).items():
                    buf[name] = torch.empty(shape, device="cuda", dtype=DTYPE if kind == "floatX" else torch.float32)
            except Exception as ex:  # noqa: BLE001 - e.g. out of memory
                note = f"buffers: {type(ex).__name__}"
            fwd_keys = ("qkvr", "att", "scratch") if impl == "classic" else ("lse",)

            def fwd(impl=impl, buf=buf, fwd_keys=fwd_keys):
                A.attention_forward_any(impl, out, qkv, NH, **{k: buf[k] for k in fwd_keys})

            def bwd(impl=impl, buf=buf):
                A.attention_backward_any(impl, dqkv, dout, qkv, out, NH, **buf)

            def fwd_bwd(fwd=fwd, bwd=bwd):
                fwd()
                bwd()

            ms_f, err_f = _try_ms(fwd)
            ms_fb, err_fb = _try_ms(fwd_bwd)
            note = note or err_f or err_fb
            key = "math" if impl == "classic" else "sdpa"
            bname = "eager math attention (autograd)" if impl == "classic" else "F.sdpa default backend"
            fb, bb = (classic_fwd_bytes, classic_bwd_bytes) if impl == "classic" else (fused_fwd_bytes, fused_bwd_bytes)
            tag = f"NH={NH} hs={hs}"
            rows.append(row(f"attention {impl} fwd {tag}", fb, ms_f, bname, base[key, False, False],
                            base[key, False, True], note))
            rows.append(row(f"attention {impl} fwd+bwd {tag}", fb + bb, ms_fb, bname + " fwd+bwd",
                            base[key, True, False], base[key, True, True], note))
            del buf
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    for r in bench():
        print(r)
