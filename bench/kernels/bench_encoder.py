"""Encoder kernels at GPT-2 124M shapes (B=64, T=1024, C=768, Vp=50304, bf16) against PyTorch.

Run on a GPU: PYTHONPATH=src:. python -m bench.kernels.bench_encoder
nbytes counts each input read once and each output written once: for the forward the ids, one wte row
per position (the gather), wpe[:T] and out; for the backward the ids and dout, and dwte's touched rows
and dwpe[:T] each read and written (they accumulate). The backward's sort, its scratch and its second
read of dout (once for dwpe, once for dwte) are extra traffic, not counted.

Two id distributions: uniform over the vocabulary (runs of 1-3) and a skewed one like text, where a few
tokens fill ~8% of the batch (runs of thousands, over many chunks). Baselines: eager PyTorch
(F.embedding + add; index_add_ + sum, which uses atomics: not deterministic) and torch.compile of the
same (None where compiling fails).

The backward is a sort and three short kernels; launched eagerly from Python its time is mostly host
launch overhead, so it is also timed replayed from a CUDA graph (as the model runs it), "(graph)" rows.
Sweep rows (all from graphs): "wpe_backward <cfg>" (dwpe alone: reads dout, reads + writes dwpe[:T])
over encoder.WPE_SWEEP, and "wte <cfg> (<ids>)" (dwte alone, sort excluded: reads the sorted ids, the
permutation and dout, reads + writes the touched dwte rows) over encoder.WTE_SWEEP; the names give the
launcher arguments (c=piece t=tile b=block_c w=num_warps s=stages, philox: sr_hash=False, r=maxnreg).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpy.kernels.common import PIPELINE_FALLBACKS
from bench.timing import compiled_ms, graphed, median_ms, row
from llmpy.kernels.encoder import (WPE_SWEEP, WTE_SWEEP, encoder_backward, encoder_backward_scratch,
                                   encoder_backward_sort, encoder_forward, wpe_backward, wte_backward)

B, T, C = 64, 1024, 768
V, Vp, MAXT = 50257, 50304, 1024
DTYPE = torch.bfloat16




def _graph_ms(fn, label: str = ""):
    """Median time of fn replayed from a CUDA graph (no host launch overhead), or None if it fails."""
    try:
        return median_ms(graphed(fn, 1))  # compiled and warmed up by graphed's first call, outside the capture
    except Exception as e:
        print(f"graph timing failed for {label}: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
        return None


def _gbs(nbytes: int, ms: float) -> str:
    return f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def _fell_back(before: int) -> str:
    """A note when the timed call's pipelined build failed and it ran unpipelined (encoder.PIPELINE_FALLBACKS)."""
    return "; PIPELINED BUILD FAILED, ran with stages=1" if len(PIPELINE_FALLBACKS) > before else ""


def _ids(kind: str, dev: str) -> torch.Tensor:
    ids = torch.randint(0, V, (B, T), device=dev, dtype=torch.int32)
    if kind == "skewed":
        r = torch.rand(B, T, device=dev)
        ids[r < 0.08] = 13     # ~2600 occurrences (4%: the next line takes half of them)
        ids[r < 0.04] = 50256  # ~1300
        ids[r < 0.02] = 11     # ~1300
    return ids


def bench(dev: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    N = B * T
    s = torch.empty((), dtype=DTYPE).element_size()
    wte = torch.randn(Vp, C, device=dev).to(DTYPE)
    wpe = torch.randn(MAXT, C, device=dev).to(DTYPE)
    out = torch.empty(B, T, C, device=dev, dtype=DTYPE)
    dout = torch.randn(B, T, C, device=dev).to(DTYPE)
    dwte = (torch.randn(Vp, C, device=dev) * 0.01).to(DTYPE)
    dwpe = (torch.randn(MAXT, C, device=dev) * 0.01).to(DTYPE)
    scratch = encoder_backward_scratch(B, T, C, dev, torch.int32)
    # one scratch for every swept piece: its partial buffer sized for the smallest
    min_piece = min(cfg["piece"] for cfg in WTE_SWEEP.values())
    sweep_scratch = encoder_backward_scratch(B, T, C, dev, torch.int32, piece=min_piece)
    seed = torch.tensor([1234], dtype=torch.int64, device=dev)
    rows = []

    def fwd_eager(i, w, p):
        return F.embedding(i, w) + p[:T]

    def bwd_eager(gw, gp, g, i):
        gw.index_add_(0, i.reshape(-1), g.reshape(N, C))
        gp[:T] += g.sum(0)
        return gw, gp

    # ---- dwpe alone, every swept configuration (independent of the ids)
    nbytes = N * C * s + 2 * T * C * s
    eager_wpe = median_ms(lambda: dout.sum(0))
    for name, cfg in WPE_SWEEP.items():
        n0 = len(PIPELINE_FALLBACKS)
        ms = _graph_ms(lambda: wpe_backward(dwpe, dout, seed, dwte.numel(), True, **cfg), name)
        if ms is not None:
            rows.append(row(f"wpe_backward {name}", nbytes, ms, "dout.sum(0)", eager_wpe, None,
                            _gbs(nbytes, ms) + _fell_back(n0)))

    for kind in ("uniform", "skewed"):
        inp = _ids(kind, dev)
        touched = int(torch.unique(inp).numel())  # host sync: setup only, outside the timing
        inp64 = inp.long()  # index_add_ wants int64 ids

        # ---- forward: read ids, the gathered wte rows, wpe[:T]; write out
        nbytes = N * 4 + N * C * s + T * C * s + N * C * s
        ms = median_ms(lambda: encoder_forward(out, inp, wte, wpe))
        rows.append(row(f"encoder_forward ({kind} ids)", nbytes, ms, "F.embedding + wpe",
                        median_ms(lambda: fwd_eager(inp, wte, wpe)), compiled_ms(fwd_eager, inp, wte, wpe),
                        _gbs(nbytes, ms)))

        # ---- backward: read ids and dout; read + write the touched dwte rows and dwpe[:T]
        nbytes = N * 4 + N * C * s + 2 * touched * C * s + 2 * T * C * s
        ms = median_ms(lambda: encoder_backward(dwte, dwpe, dout, inp, seed, scratch))
        sort_ms = median_ms(lambda: encoder_backward_sort(inp, scratch))
        rows.append(row(f"encoder_backward ({kind} ids)", nbytes, ms, "index_add_ + sum (atomics)",
                        median_ms(lambda: bwd_eager(dwte, dwpe, dout, inp64)),
                        compiled_ms(bwd_eager, dwte, dwpe, dout, inp64),
                        _gbs(nbytes, ms) + f"; {touched} distinct ids; eager torch.sort alone {sort_ms:.3f} ms"))
        g_ms = _graph_ms(lambda: encoder_backward(dwte, dwpe, dout, inp, seed, scratch), "encoder_backward")
        g_sort = _graph_ms(lambda: encoder_backward_sort(inp, scratch), "sort")
        g_base = _graph_ms(lambda: bwd_eager(dwte, dwpe, dout, inp64), "index_add_")
        if g_ms is not None:
            note = _gbs(nbytes, g_ms) + (f"; torch.sort alone {g_sort:.3f} ms" if g_sort else "")
            rows.append(row(f"encoder_backward (graph, {kind} ids)", nbytes, g_ms,
                            "index_add_ + sum (graph)", g_base, None, note))

        # ---- dwte alone (sort done once here, outside the timing), every swept configuration
        encoder_backward_sort(inp, sweep_scratch)
        nbytes = N * (4 + 8) + N * C * s + 2 * touched * C * s
        for name, cfg in WTE_SWEEP.items():
            n0 = len(PIPELINE_FALLBACKS)
            ms = _graph_ms(lambda: wte_backward(dwte, dout, inp, seed, sweep_scratch, True, sort=False, **cfg),
                           name)
            if ms is not None:
                rows.append(row(f"wte {name} ({kind})", nbytes, ms, "index_add_ (graph)", g_base, None,
                                _gbs(nbytes, ms) + _fell_back(n0)))
    if PIPELINE_FALLBACKS:
        print("encoder: pipelined builds that failed and ran unpipelined:", PIPELINE_FALLBACKS)
    return rows


if __name__ == "__main__":
    print(f"B={B} T={T} C={C} Vp={Vp} {DTYPE}")
    for r in bench():
        print(r)
