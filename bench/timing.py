"""Timing helpers shared by the benchmarks: median device time and the copy-bandwidth ceiling.

Every figure is a median over repeated runs after warm-up (triton.testing.do_bench, CUDA events).
"""
from __future__ import annotations

import torch
import triton


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of fn() in milliseconds on the current CUDA device."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def mean_ms(fn, calls: int) -> float:
    """Mean ms of `calls` fn() calls back to back, between two CUDA events (no warm-up: the caller's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def calls_to_sustain(fn, sustain_ms: float, estimate_ms: float | None = None) -> int:
    """How many fn() calls back to back take about sustain_ms (at least 3), from estimate_ms a call or,
    without one, from timing 5 calls (after one untimed)."""
    import math
    if estimate_ms is None:
        fn()
        estimate_ms = mean_ms(fn, 5)
    return max(3, math.ceil(sustain_ms / max(estimate_ms, 1e-3)))


def sustained_ms(fn, sustain_ms: float, estimate_ms: float | None = None) -> float:
    """Mean ms of fn() at the card's power cap: enough calls back to back for sustain_ms (from
    estimate_ms a call, else timed over 5 calls), so that the H200 reaches its 700 W cap and lowers its
    clock, then the mean of as many more. The whole step runs at that cap, where a kernel's time follows
    the energy it spends rather than its time at full clock."""
    n = calls_to_sustain(fn, sustain_ms, estimate_ms)
    for _ in range(n):
        fn()
    return mean_ms(fn, n)


def graphed(fn, calls: int):
    """A function that replays `calls` fn() calls captured once in a CUDA graph, as the step's graph runs them:
    without the host's work of making each call (a 0.04 ms product through a ctypes binding, called back to
    back, is bound by that work). fn() runs once first, outside the capture, so that its errors (an
    algorithm cuBLASLt refuses) and its one-time setup (plans, workspaces) happen there."""
    fn()
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # not torch.cuda.graph: its gc and cache flush at every capture slow a search
        graph.capture_begin()
        try:
            for _ in range(calls):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second (GB/s): the memory ceiling."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def row(kernel: str, nbytes: int, ms: float, baseline: str = "", baseline_ms: float | None = None,
        compiled_ms: float | None = None, note: str = "") -> dict:
    """One line of the per-kernel table: the kernel's bytes moved (each input read once, each output
    written once), its median time, and the same operation in plain PyTorch (and torch.compile)."""
    return {"kernel": kernel, "bytes": nbytes, "ms": ms, "baseline": baseline, "baseline_ms": baseline_ms,
            "compiled_ms": compiled_ms, "note": note}


def compiled_ms(fn, *args) -> float | None:
    """Median time of torch.compile(fn)(*args) (compiled outside the timed region), or None when compiling
    or running it fails: a baseline failing must not take the kernel rows down with it."""
    try:
        cfn = torch.compile(fn, dynamic=False)
        cfn(*args)
        torch.cuda.synchronize()
        return median_ms(lambda: cfn(*args))
    except Exception as e:  # noqa: BLE001
        print(f"torch.compile failed for {getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}")
        return None
