"""Profile one GPT-2 training step of llmpy: GPU kernel time per kernel and per group, against the floors.

    PYTHONPATH=src:. python -m bench.profile_step [--model d12] [--B 64] [--T 1024] [--recompute 0] \
        [--attention auto|classic|flash|cudnn|...] [--gelu-fusion N] [--classifier-chunks K] \
        [--warmup 5] [--steps 5] [--graph-steps 20] [--graph-profile-steps 3] [--no-graph-compare] \
        [--json out.json] [--md out.md]

What it does (the "profile first" step of the 100-ms issue):
  1. builds llmpy.model.GPT2Model with cuda_graph=False, so torch.profiler sees every kernel launch;
  2. runs --warmup eager steps (Triton JIT, cuBLAS/cuDNN set-up), then profiles --steps steps
     (ProfilerActivity.CUDA only, to keep host-side overhead small);
  3. sums GPU kernel time (memcpy/memset included) per kernel name, classifies each name by the regex
     table CLASSES below into matrix / attention / memory-bound / optimizer / other, and reports
     "gaps" = wall time of a profiled step minus its kernel time (launch overhead, idle device);
  4. frees that model, builds a second one with cuda_graph=True and reports its median step time, the
     figure bench_step measures, so the eager "gaps" can be read against what the graph removes;
  5. profiles --graph-profile-steps replays of that graph: each kernel's time inside the real step (at
     the power cap, where eager kernels with gaps between them run at higher clocks), and the device
     timeline (`timeline`): busy time, idle stretches inside the graph and their neighbours, and the idle
     time between replays.

Output: a per-kernel table (calls a step, ms a step, share of the step, group), the group summary next
to the floors of shared/ANCHORS.md, the "other" kernels listed by name; --json writes every figure,
--md a markdown section to paste into bench/RESULTS.md.

The aggregation and formatting are pure Python (tests/test_profile_step.py runs them on fake events);
torch, triton and llmpy's model are imported only inside the GPU functions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_step import add_model_switches, check_sizes, json_safe, make_output_folders, model_switches
from llmpy.config import ATTENTION_IMPLS

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------
# classification: (group, regex) searched case-insensitively in the kernel name; the FIRST match wins,
# so order matters (e.g. fmha_cutlassF is attention although it says "cutlass"). Extend here.

CLASSES: list[tuple[str, str]] = [
    # communication: NCCL's kernels (several GPUs); first, so that their copies are not read as memory-bound
    ("communication", r"nccl"),
    # optimizer: our AdamW / norm / clip kernels, torch's fused/foreach Adam
    ("optimizer", r"adamw|global_norm|clip_scale|init_from_master|multi_tensor_apply|fused_adam"),
    # attention before matrix: cuDNN's and torch's fused attention names contain gemm-ish words
    ("attention", r"flash|fmha|sdpa|cudnn|attn|attention|_softmax_(forward|backward)_kernel|softmax_warp"
                  r"|_permute_kernel|_dkdv|_dq_block|_fwd_block"),
    # matrix products: cuBLAS(Lt) (nvjet, sm90_xmma, cutlass, *gemm*), split-K reductions, our Triton matmul
    ("matrix", r"nvjet|cutlass|gemm|xmma|cublas|splitkreduce|s16816|s1688|wgmma|_matmul(_tma)?_kernel|_mm_kernel"),
    # memory-bound: layernorm (its 3-tile forward: _forward_pieces3_kernel), GELU, encoder, residual, classifier,
    # bias reduction, copies / fills
    ("memory-bound", r"layernorm|layer_norm|_forward_pieces|gelu|encoder|_wte_|_wpe_|residual|_fc_|classifier"
                     r"|cross_entropy|bias|memcpy|memset|copy|fill|zero|elementwise|reduce_kernel|round|cat_|index"
                     r"|radix_?sort"),
]
_COMPILED = [(g, re.compile(p, re.IGNORECASE)) for g, p in CLASSES]

GROUPS = ("matrix", "attention", "memory-bound", "optimizer", "communication", "other")

# floors for one GPT-2 124M step at B=64, T=1024 on an H200 (shared/ANCHORS.md), ms: (low, high)
FLOORS: dict[str, tuple[float, float] | None] = {
    "matrix": (76.4, 76.4),        # all linear-layer products fwd+bwd through cuBLAS, CUDA graph
    "attention": (16.2, 16.2),     # cuDNN causal attention fwd+bwd, 12 layers
    "memory-bound": (5.0, 8.0),    # ~20-30 GB of traffic at full bandwidth
    "optimizer": (1.0, 1.0),       # AdamW over 124 M parameters, roughly
    "communication": None,         # one GPU: none; several: overlapped with the backward where it can be
    "other": None,
    "gaps": None,
}


def classify(name: str) -> str:
    for group, rx in _COMPILED:
        if rx.search(name):
            return group
    return "other"


# ----------------------------------------------------------------------------------------------------
# aggregation (pure Python)

def aggregate(events, steps: int, wall_ms_per_step: float | None = None) -> dict:
    """events: iterable of (kernel name, duration in us, calls), all over `steps` profiled steps; the
    same name may appear many times (summed). wall_ms_per_step: the measured wall time of one step;
    None takes the kernel sum (no gaps). Returns rows (per kernel, descending ms), groups, gaps, step_ms.

    step_ms is max(wall, kernel sum): kernels on concurrent streams can overlap and make the sum exceed
    the wall time; then gaps are 0 and the shares still add up to 100 %."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    acc: dict[str, list[float]] = {}
    for name, dur_us, calls in events:
        a = acc.setdefault(name, [0.0, 0])
        a[0] += float(dur_us)
        a[1] += int(calls)
    kernel_ms = sum(us for us, _ in acc.values()) / 1e3 / steps
    wall = kernel_ms if wall_ms_per_step is None else float(wall_ms_per_step)
    step_ms = max(wall, kernel_ms)
    gaps_ms = step_ms - kernel_ms

    def share(ms):
        return ms / step_ms if step_ms > 0 else 0.0

    rows = []
    for name, (us, calls) in acc.items():
        ms = us / 1e3 / steps
        rows.append({"name": name, "group": classify(name), "calls": calls / steps, "ms": ms, "share": share(ms)})
    rows.sort(key=lambda r: (-r["ms"], r["name"]))
    groups = {}
    for g in GROUPS:
        sel = [r for r in rows if r["group"] == g]
        ms = sum(r["ms"] for r in sel)
        groups[g] = {"ms": ms, "share": share(ms), "kernels": len(sel), "calls": sum(r["calls"] for r in sel),
                     "floor_ms": FLOORS[g]}
    groups["gaps"] = {"ms": gaps_ms, "share": share(gaps_ms), "kernels": 0, "calls": 0, "floor_ms": None}
    return {"steps": steps, "wall_ms": wall, "kernel_ms": kernel_ms, "step_ms": step_ms, "gaps_ms": gaps_ms,
            "rows": rows, "groups": groups, "other": [r["name"] for r in rows if r["group"] == "other"]}


def timeline(intervals, steps: int, wall_ms_each=None, top: int = 8, host_gap_us: float = 30.0) -> dict:
    """The CUDA-graph step's device timeline. intervals: (name, start us, end us) of every device event
    over `steps` replays, one after the other.

    Idle stretches of at least host_gap_us are the host's (a graph has no host waits inside; its nodes
    follow each other within a few us): they cut the timeline into segments, and each replay's graph is
    the one segment holding most of its kernel time (the others are the small copies the host issues
    between replays: the loss and norm read back, the next batch and the hyper-parameters sent). Returns,
    per step: kernel_ms (sum of durations), busy_ms (their union: concurrent kernels count once), graph_ms
    (a graph segment's first start to last end), graph_idle_ms = graph - busy inside the graphs (launch
    latency and dependency waits between nodes), between_ms (from one graph's end to the next one's
    start: the host's turn, as the device sees it), and the `top` longest idle stretches inside the
    graphs with the events on either side; with wall_ms_each (each replay's wall time), wall_ms (their
    mean) and the per-replay between times."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    ev = sorted((float(st), float(en), n) for n, st, en in intervals)
    kernel_us = sum(en - st for st, en, _ in ev)
    # merge into busy runs; split into segments at host-sized holes
    segments = []  # [start, end, busy us, kernel us, holes [(us, after, before)]]
    run_s = run_e = None
    last = None
    for st, en, n in ev:
        if run_e is not None and st - run_e >= host_gap_us:
            segments[-1][2] += run_e - run_s
            segments[-1][1] = run_e
            run_s = run_e = None
        if run_e is None:
            if not segments or segments[-1][1] is not None:
                segments.append([st, None, 0.0, 0.0, []])
            run_s, run_e, last = st, en, n
        elif st > run_e:
            segments[-1][2] += run_e - run_s
            segments[-1][4].append((st - run_e, last, n))
            run_s, run_e, last = st, en, n
        else:
            if en >= run_e:
                run_e, last = en, n
        segments[-1][3] += en - st
    if run_e is not None:
        segments[-1][2] += run_e - run_s
        segments[-1][1] = run_e
    graphs = sorted(sorted(segments, key=lambda g: -g[3])[:steps], key=lambda g: g[0])
    busy_us = sum(g[2] for g in graphs)
    graph_us = sum(g[1] - g[0] for g in graphs)
    holes = sorted((h for g in graphs for h in g[4]), key=lambda h: -h[0])
    between = [(b[0] - a[1]) / 1e3 for a, b in zip(graphs, graphs[1:])]
    out = {"steps": steps, "kernel_ms": kernel_us / 1e3 / steps, "busy_ms": busy_us / 1e3 / steps,
           "graph_ms": graph_us / 1e3 / steps, "graph_idle_ms": (graph_us - busy_us) / 1e3 / steps,
           "graph_holes": len(holes) / steps, "between_ms": sum(between) / len(between) if between else None,
           "between_ms_each": between, "graph_ms_each": [(g[1] - g[0]) / 1e3 for g in graphs],
           "top_holes": [{"us": us, "after": a, "before": b} for us, a, b in holes[:top]]}
    if wall_ms_each:
        out["wall_ms_each"] = [float(w) for w in wall_ms_each]
        out["wall_ms"] = sum(out["wall_ms_each"]) / len(out["wall_ms_each"])
    return out


def format_timeline(tl: dict, width: int = 60) -> str:
    lines = [f"kernels {tl['kernel_ms']:.2f} ms, busy (union) {tl['busy_ms']:.2f} ms of a {tl['graph_ms']:.2f} ms "
             f"graph: idle inside it {tl['graph_idle_ms']:.2f} ms in {tl['graph_holes']:.0f} stretches"]
    if tl["between_ms"] is not None:
        each = ", ".join(f"{x:.2f}" for x in tl["between_ms_each"])
        lines.append(f"between one graph's end and the next one's start: mean {tl['between_ms']:.2f} ms ({each})")
    if "wall_ms" in tl:
        lines.append("wall per replay: " + ", ".join(f"{x:.2f}" for x in tl["wall_ms_each"])
                     + "; graph per replay: " + ", ".join(f"{x:.2f}" for x in tl["graph_ms_each"]))
    for h in tl["top_holes"]:
        lines.append(f"  {h['us']:8.1f} us idle after {_short(h['after'], width)} before {_short(h['before'], width)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# formatting (pure Python)

def _short(name: str, width: int) -> str:
    """Demangled C++ kernel names run to hundreds of characters: keep the head, mark the cut."""
    name = " ".join(name.split())
    return name if len(name) <= width else name[: width - 3] + "..."


def _floor_str(floor) -> str:
    if floor is None:
        return "-"
    lo, hi = floor
    return f"{lo:.1f}" if lo == hi else f"{lo:g}-{hi:g}"


def _over_str(ms: float, floor) -> str:
    """ms above the floor (above its high end for a range); '-' where there is no floor."""
    if floor is None:
        return "-"
    return f"{ms - floor[1]:+.1f}"


def format_kernels(agg: dict, top: int | None = None, width: int = 72) -> str:
    rows = agg["rows"] if top is None else agg["rows"][:top]
    hdr = f"{'kernel':{width}s} {'calls':>7s} {'ms/step':>9s} {'share':>7s}  group"
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{_short(r['name'], width):{width}s} {r['calls']:7.1f} {r['ms']:9.3f} {r['share']:7.1%}  "
                     f"{r['group']}")
    if top is not None and len(agg["rows"]) > top:
        rest = agg["rows"][top:]
        ms = sum(r["ms"] for r in rest)
        lines.append(f"{f'({len(rest)} more kernels)':{width}s} {sum(r['calls'] for r in rest):7.1f} {ms:9.3f} "
                     f"{ms / agg['step_ms'] if agg['step_ms'] else 0:7.1%}")
    lines.append(f"{'gaps (wall - kernels: launch overhead, idle)':{width}s} {'':7s} {agg['gaps_ms']:9.3f} "
                 f"{agg['groups']['gaps']['share']:7.1%}  gaps")
    lines.append(f"{'step':{width}s} {'':7s} {agg['step_ms']:9.3f} {1.0 if agg['step_ms'] else 0:7.1%}")
    return "\n".join(lines)


def format_groups(agg: dict) -> str:
    hdr = f"{'group':14s} {'ms/step':>9s} {'share':>7s} {'kernels':>8s} {'calls':>8s} {'floor ms':>9s} {'over':>7s}"
    lines = [hdr, "-" * len(hdr)]
    for g, v in agg["groups"].items():
        lines.append(f"{g:14s} {v['ms']:9.3f} {v['share']:7.1%} {v['kernels']:8d} {v['calls']:8.1f} "
                     f"{_floor_str(v['floor_ms']):>9s} {_over_str(v['ms'], v['floor_ms']):>7s}")
    fl = _step_floor()
    lines.append(f"{'step':14s} {agg['step_ms']:9.3f} {1.0 if agg['step_ms'] else 0:7.1%} {len(agg['rows']):8d} "
                 f"{'':8s} {_floor_str(fl):>9s} {_over_str(agg['step_ms'], fl):>7s}")
    if agg["other"]:
        lines.append("unclassified ('other'; extend CLASSES in bench/profile_step.py):")
        lines += [f"  {n}" for n in agg["other"]]
    return "\n".join(lines)


def _step_floor() -> tuple[float, float]:
    """The whole step's floor: the sum of the group floors."""
    fl = [f for f in FLOORS.values() if f is not None]
    return sum(f[0] for f in fl), sum(f[1] for f in fl)


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


def format_markdown(agg: dict, meta: dict | None = None, top: int | None = 30) -> str:
    """A section for bench/RESULTS.md: the settings line, the group table, the top kernels."""
    meta = meta or {}
    out = []
    if meta:
        out.append(f"**{meta.get('date', '?')}, {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
                   f"triton {meta.get('triton', '?')}, commit {str(meta.get('commit') or '?')[:7]}"
                   f"{' (dirty)' if meta.get('dirty') else ''}.**")
        if meta.get("command"):
            out.append(f"Command: `{meta['command']}`.")
        line = (f"Eager step (no CUDA graph) under torch.profiler, {agg['steps']} steps: "
                f"{agg['step_ms']:.1f} ms wall, {agg['kernel_ms']:.1f} ms of kernels.")
        if meta.get("graph_median_ms") is not None:
            line += f" The same model with the CUDA graph: median {meta['graph_median_ms']:.1f} ms a step."
        out.append(line)
        out.append("")
    out += ["| group | ms / step | share | kernels | floor (ANCHORS.md) ms | over floor ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for g, v in agg["groups"].items():
        out.append(f"| {g} | {v['ms']:.2f} | {v['share']:.1%} | {v['kernels']} | {_floor_str(v['floor_ms'])} | "
                   f"{_over_str(v['ms'], v['floor_ms'])} |")
    lo, hi = _step_floor()
    out.append(f"| **step** | **{agg['step_ms']:.2f}** | {1.0 if agg['step_ms'] else 0:.1%} | {len(agg['rows'])} | "
               f"{_floor_str((lo, hi))} | {_over_str(agg['step_ms'], (lo, hi))} |")
    out += ["", "| kernel | calls / step | ms / step | share | group |", "| --- | ---: | ---: | ---: | --- |"]
    rows = agg["rows"] if top is None else agg["rows"][:top]
    for r in rows:
        out.append(f"| `{_md_cell(_short(r['name'], 90))}` | {r['calls']:.1f} | {r['ms']:.3f} | {r['share']:.1%} | "
                   f"{r['group']} |")
    if top is not None and len(agg["rows"]) > top:
        rest = agg["rows"][top:]
        ms = sum(r["ms"] for r in rest)
        out.append(f"| ({len(rest)} more) | {sum(r['calls'] for r in rest):.1f} | {ms:.3f} | "
                   f"{ms / agg['step_ms'] if agg['step_ms'] else 0:.1%} | |")
    out.append(f"| gaps (wall - kernels) | | {agg['gaps_ms']:.3f} | {agg['groups']['gaps']['share']:.1%} | gaps |")
    if agg["other"]:
        out += ["", "Unclassified kernels: " + ", ".join(f"`{_md_cell(_short(n, 90))}`" for n in agg["other"])]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------
# the GPU parts (not called by the tests)

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="d12", help="llm.c model descriptor")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--recompute", type=int, default=0, help="llm.c's -r (0, 1, 2)")
    ap.add_argument("--attention", default="auto", help="auto or one of " + ", ".join(ATTENTION_IMPLS))
    add_model_switches(ap)
    ap.add_argument("--flash-config", default=None, help="JSON of flash attention tile fields to override")
    ap.add_argument("--warmup", type=int, default=5, help="eager steps before profiling")
    ap.add_argument("--steps", type=int, default=5, help="profiled eager steps")
    ap.add_argument("--graph-steps", type=int, default=20, help="timed CUDA-graph steps (after 3 warm-up)")
    ap.add_argument("--no-graph-compare", action="store_true", help="skip the CUDA-graph timing")
    ap.add_argument("--graph-profile-steps", type=int, default=3,
                    help="graphed steps profiled after the timing (0: none): kernels at the power cap, idle inside "
                         "the graph")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--data-seed", type=int, default=1337)
    ap.add_argument("--top", type=int, default=40, help="kernels shown in the printed table (0: all)")
    ap.add_argument("--trace", default=None, help="also export a Chrome trace of the profiled steps here")
    ap.add_argument("--graph-trace", default=None,
                    help="write the profiled graph replays' device events here (JSON: names, [name index, start us, "
                         "end us])")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    check_sizes(ap, args, {"B": 1, "T": 1, "steps": 1, "warmup": 0, "graph_steps": 1, "graph_profile_steps": 0,
                           "top": 0})
    make_output_folders(args.json, args.md, args.trace, args.graph_trace)
    return args


def _model_options(args, cuda_graph: bool) -> dict:
    opts = {"master_weights": True, "attention": args.attention, "seed": args.seed, "cuda_graph": cuda_graph,
            "recompute": args.recompute}
    opts.update(model_switches(args))
    return opts


def _build(args, cuda_graph: bool):
    import torch
    from llmpy.config import parse_descriptor
    from llmpy.init import init_parameters
    from llmpy.model import GPT2Model
    config = parse_descriptor(args.model)
    flat = init_parameters(config, args.seed)
    from bench.bench_step import set_flash_config, set_kernel_switches
    set_flash_config(args.flash_config, config)
    set_kernel_switches(args)
    model = GPT2Model(config, flat, args.B, args.T, device="cuda", dtype=torch.bfloat16,
                      **_model_options(args, cuda_graph))
    return config, model


def _kernel_intervals(prof):
    """(name, start us, end us) per device-side event of the profile (kernels, memcpy, memset)."""
    from torch.autograd import DeviceType
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]


def aggregate_intervals(intervals, steps: int, walls: list[float]) -> dict:
    """aggregate() of _kernel_intervals over `steps` profiled steps whose wall times (ms) are `walls`: against their
    mean, not their median, since the kernel time is the sum over all of them."""
    return aggregate(((nm, e - s, 1) for nm, s, e in intervals), steps, sum(walls) / len(walls))


def _timed_step(model, batch, step: int, args) -> tuple[float, float]:
    """One train_step between two device syncs: (its wall ms, its loss)."""
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss, _ = model.train_step([batch], args.lr, step, args.weight_decay, args.grad_clip)
    loss = float(loss)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, loss


def profile_eager(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from bench.bench_step import make_batches
    config, model = _build(args, cuda_graph=False)
    n = args.warmup + args.steps
    batches = make_batches(config.vocab_size, args.B, args.T, n, args.data_seed, pin=True)

    for i in range(args.warmup):
        _timed_step(model, batches[i], i + 1, args)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        walls, losses = zip(*(_timed_step(model, batches[i], i + 1, args) for i in range(args.warmup, n)))
    walls, losses = list(walls), list(losses)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    intervals = _kernel_intervals(prof)
    span_us = (max(e for _, _, e in intervals) - min(s for _, s, _ in intervals)) if intervals else 0.0
    agg = aggregate_intervals(intervals, args.steps, walls)
    agg.update(wall_ms_each=walls, device_span_ms=span_us / 1e3 / args.steps, losses=losses,
               attention_impl=model.attention, classifier_chunks=model.classifier_chunks,
               gelu_fusion=model.gelu_fusion, recompute=model.recompute, use_cublaslt=model.use_cublaslt)
    if not intervals:
        print("warning: the profiler recorded no device events (CUPTI unavailable?)", file=sys.stderr)
    del model  # frees the buffers before the graphed model's
    torch.cuda.empty_cache()
    return agg


def time_graphed(args, warmup: int = 3) -> dict:
    import torch
    from bench.bench_step import make_batches
    config, model = _build(args, cuda_graph=True)
    n = warmup + args.graph_steps
    batches = make_batches(config.vocab_size, args.B, args.T, n, args.data_seed, pin=True)
    ms = [_timed_step(model, batches[i], i + 1, args)[0] for i in range(n)]
    timed = ms[warmup:] or ms
    out = {"median_ms": statistics.median(timed), "min_ms": min(timed), "step_ms": ms, "warmup": warmup}
    if args.graph_profile_steps:
        # the replays under torch.profiler: each kernel's time inside the real (graphed, power-capped) step
        from torch.profiler import ProfilerActivity, profile
        more = make_batches(config.vocab_size, args.B, args.T, args.graph_profile_steps, args.data_seed + 1, pin=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            walls = [_timed_step(model, batch, n + i + 1, args)[0] for i, batch in enumerate(more)]
        intervals = _kernel_intervals(prof)
        steps = args.graph_profile_steps
        out["timeline"] = timeline(intervals, steps, walls)
        out["profile"] = aggregate_intervals(intervals, steps, walls)
        if args.graph_trace:
            names = sorted({nm for nm, _, _ in intervals})
            index = {nm: i for i, nm in enumerate(names)}
            with open(args.graph_trace, "w") as f:
                json.dump({"names": names, "events": [(index[nm], s, e) for nm, s, e in intervals]}, f)
    del model
    torch.cuda.empty_cache()
    return out


def _meta(argv) -> dict:
    import torch
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    return {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": tv, "commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": "python -m bench.profile_step " + " ".join(argv)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench.profile_step needs a CUDA device", file=sys.stderr)
        return 1
    meta = _meta(argv)
    print(f"=== eager profile: {args.warmup} warm-up + {args.steps} profiled steps, B={args.B} T={args.T}, "
          f"model {args.model}", flush=True)
    agg = profile_eager(args)
    meta.update({k: agg[k] for k in ("attention_impl", "classifier_chunks", "gelu_fusion", "recompute",
                                     "use_cublaslt")})
    graph = None
    if not args.no_graph_compare:
        print(f"=== CUDA graph: {args.graph_steps} timed steps", flush=True)
        graph = time_graphed(args)
        meta["graph_median_ms"] = graph["median_ms"]
    print(f"\nresolved: attention {agg['attention_impl']}, classifier chunks {agg['classifier_chunks']}, "
          f"gelu fusion {agg['gelu_fusion']}, cuBLASLt {int(agg['use_cublaslt'])}, recompute {agg['recompute']}; "
          f"losses {agg['losses']}")
    print(f"\n=== kernels (per step, mean of {args.steps} eager profiled steps)")
    print(format_kernels(agg, top=args.top or None))
    print("\n=== groups (floors: shared/ANCHORS.md, H200, B=64 T=1024 GPT-2 124M)")
    print(format_groups(agg))
    print(f"\neager wall {agg['wall_ms']:.2f} ms/step (device span {agg['device_span_ms']:.2f} ms), "
          f"kernels {agg['kernel_ms']:.2f} ms/step"
          + (f"; CUDA graph median {graph['median_ms']:.2f} ms/step "
             f"(kernels + {graph['median_ms'] - agg['kernel_ms']:+.2f} ms)" if graph else ""), flush=True)
    if graph and "timeline" in graph:
        print(f"\n=== the CUDA-graph step under torch.profiler ({args.graph_profile_steps} replays)")
        print(format_groups(graph["profile"]))
        print(format_timeline(graph["timeline"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe({"meta": meta, "settings": vars(args), "profile": agg, "graph": graph,
                                 "classes": CLASSES, "floors": FLOORS}), f, indent=1, allow_nan=False)
    if args.md:
        text = format_markdown(agg, meta)
        if graph and "timeline" in graph:
            tl = graph["timeline"]
            text += (f"\nThe CUDA-graph step under torch.profiler ({args.graph_profile_steps} replays): "
                     f"{tl['kernel_ms']:.1f} ms of kernels, device busy {tl['busy_ms']:.1f} ms of a "
                     f"{tl['graph_ms']:.1f} ms graph (idle inside it {tl['graph_idle_ms']:.2f} ms), "
                     + (f"{tl['between_ms']:.2f} ms from one graph's end to the next one's start"
                        if tl["between_ms"] is not None else "one replay") + ".\n\n"
                     + format_markdown(graph["profile"], None))
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
