"""Two CUDA streams for the backward pass, ordered by the memory each call touches.

Why: a step runs at the H200's 700 W power cap (bench/RESULTS.md, runs I and M), and its memory-bound
passes (LayerNorm backward, bias reductions) leave part of that budget unused while they run. The
backward has work off the critical path - every weight-gradient product and bias reduction - that
nothing downstream needs until the optimizer. Issued on a second stream, it can run while the chain of
input gradients (dinp products, LayerNorm backward, attention backward) does, instead of between its
links.

How: every call is issued through `Lanes.run(lane, fn, reads, writes)` with the tensors it reads and
writes ("main": the chain, "side": the weight gradients). A call waits for the other lane only where the
two conflict: the latest call issued on the other lane that writes memory this call touches, or reads
memory this call writes (read-after-write, write-after-read, write-after-write), unless an earlier wait
already covers it. Memory is compared as address intervals, so views of one buffer (dqkv over the front
of the (B, T, 4C) scratch) conflict as they should. Within a lane, stream order keeps program order. The
kernels themselves are unchanged, and each buffer is still written by its calls in program order, so
results are bitwise those of one stream (tests/test_gpt2.py checks it on the GPU; tests/test_streams.py
checks the waits against a brute-force happens-before check).

Modes: "off" (everything on the current stream, no bookkeeping), "on" (a side stream of default
priority), "priority" (also the chain on a stream of the highest priority, so that when both lanes have
blocks waiting for an SM the chain's go first). CUDA graphs keep both streams as parallel branches, and
PyTorch instantiates graphs with the nodes' captured priorities. Without CUDA (CPU, the interpreter) the
calls run in order, and the plan of waits is still made and logged (`log`) so it can be checked.
"""
from __future__ import annotations

import torch

OVERLAP_MODES = ("off", "on", "priority")
LANES = ("main", "side")


def spans(tensors) -> list[tuple[int, int]]:
    """[start, end) byte intervals of tensors (None skipped), each from its first to one past its last
    element (a strided view's holes count as touched: conservative)."""
    out = []
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
        start = t.data_ptr()
        out.append((start, start + extent * t.element_size()))
    return out


def _overlap(a: list, b: list) -> bool:
    return any(s0 < e1 and s1 < e0 for s0, e0 in a for s1, e1 in b)


def conflicts(reads_a, writes_a, reads_b, writes_b) -> bool:
    """Whether two calls (their read and write intervals) must not run at the same time."""
    return _overlap(writes_a, reads_b) or _overlap(writes_a, writes_b) or _overlap(reads_a, writes_b)


class Lanes:
    """The backward's two lanes (see the module docstring). Use: begin(); run(...) per call; end()."""

    def __init__(self, device: torch.device, mode: str = "off"):
        if mode not in OVERLAP_MODES:
            raise ValueError(f"overlap mode {mode!r}: one of {OVERLAP_MODES}")
        self.mode = mode
        self.device = torch.device(device)
        self.on_gpu = mode != "off" and self.device.type == "cuda"
        self._side = self._chain = None
        if self.on_gpu:
            self._side = torch.cuda.Stream(self.device)
            if mode == "priority":
                lo, hi = torch.cuda.Stream.priority_range()
                self._chain = torch.cuda.Stream(self.device, priority=min(lo, hi))
        self._streams: dict = {}  # lane -> stream, set by begin()
        self._events: list = []   # a pool, reused from one backward to the next
        self._n_events = 0
        # per call: (lane, name, index in its lane, the other lane's index it waits for or None, reads,
        # writes); wait_side() adds (main, "wait_side", index of main's next call, side's last, [], [])
        self.log: list = []
        self._history = {lane: [] for lane in LANES}  # per lane: (reads, writes) of each call issued
        self._done = {lane: [] for lane in LANES}     # per lane: the event recorded after each call
        self._waited = {lane: -1 for lane in LANES}   # per lane: the other lane's last call it waits for
        self._base = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def side_stream(self):
        """The side lane's CUDA stream (None when off or without CUDA)."""
        return self._side

    def begin(self):
        """Start a backward: both lanes fork from the current stream."""
        self.log.clear()
        for lane in LANES:
            self._history[lane].clear()
            self._done[lane].clear()
            self._waited[lane] = -1
        self._n_events = 0
        if not self.on_gpu:
            return
        self._base = torch.cuda.current_stream(self.device)
        self._streams = {"main": self._chain or self._base, "side": self._side}
        for stream in self._streams.values():
            if stream is not self._base:
                stream.wait_stream(self._base)

    def _event(self):
        if self._n_events == len(self._events):
            self._events.append(torch.cuda.Event())
        ev = self._events[self._n_events]
        self._n_events += 1
        return ev

    def run(self, lane: str, fn, reads=(), writes=(), name: str = ""):
        """Issue fn() on lane, after the other lane's latest conflicting call. Returns fn's result."""
        if not self.enabled:
            return fn()
        other = "side" if lane == "main" else "main"
        r, w = spans(reads), spans(writes)
        hist = self._history[other]
        wait_for = None
        for i in range(len(hist) - 1, self._waited[lane], -1):
            if conflicts(r, w, *hist[i]):
                wait_for = i
                break
        mine = self._history[lane]
        self.log.append((lane, name, len(mine), wait_for, r, w))
        mine.append((r, w))
        if wait_for is not None:
            self._waited[lane] = wait_for
        if not self.on_gpu:
            return fn()
        stream = self._streams[lane]
        if wait_for is not None:
            stream.wait_event(self._done[other][wait_for])
        with torch.cuda.stream(stream):
            out = fn()
        ev = self._event()
        ev.record(stream)
        self._done[lane].append(ev)
        return out

    def wait_side(self):
        """The main lane waits for every side call issued so far (before the host hands gradients to
        work that does not go through run: the data-parallel reduction)."""
        last = len(self._history["side"]) - 1
        if not self.enabled or self._waited["main"] >= last:
            return
        self._waited["main"] = last
        self.log.append(("main", "wait_side", len(self._history["main"]), last, [], []))
        if self.on_gpu:
            self._streams["main"].wait_event(self._done["side"][last])

    def end(self):
        """Finish a backward: the current stream waits for both lanes."""
        if not self.on_gpu:
            return
        for stream in self._streams.values():
            if stream is not self._base:
                self._base.wait_stream(stream)
        self._streams = {}
        self._base = None
