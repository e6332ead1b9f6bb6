"""Data-parallel scaling on one node: GPT-2 124M (d12) from llm.c's init, B=64, T=1024 a GPU, the same
number of steps on 1 GPU and on N GPUs under torchrun (-z 0 and -z 1, the reduction overlapped with the
backward or after it; optionally under other NCCL settings, --nccl-env, or other bucket sizes,
--bucket-mb), in one call. The 1-GPU run comes first and last, because the card's clocks drift by a few
% between runs (the H200 x2 medians of one tree once read 113.8 and 118.4 ms at the same minimum): the
scaling is the N-GPU throughput over the 1-GPU throughput of both runs' steps pooled.

Every step draws a global batch of N*B fresh random rows; rank r trains on rows [r*B, (r+1)*B). A last
run on 1 GPU takes the same global batches as N accumulation steps of B rows: its losses must equal
the N-GPU runs' bit for bit (llmpy.distributed's fixed reduction order), and -z 0 must equal -z 1.

    python -m bench.bench_dist --nproc 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="GPUs of the parallel runs")
    ap.add_argument("--model", default="d12")
    ap.add_argument("--B", type=int, default=64, help="micro-batch a GPU")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--median-from", type=int, default=11, help="median over steps median-from..steps")
    ap.add_argument("--exact-steps", type=int, default=10, help="steps of the 1-GPU accumulation check run")
    ap.add_argument("--recompute", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed steps, this many more under torch.profiler (rank 0): kernel time by "
                         "group, NCCL's included, to see what a second GPU costs the step")
    ap.add_argument("--nccl-env", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                    help="also run -z 0 and -z 1 (overlapped) under these NCCL variables, e.g. NCCL_MAX_CTAS=4 "
                         "(fewer NCCL blocks beside the backward's kernels); repeatable")
    ap.add_argument("--bucket-mb", action="append", type=float, default=[], metavar="MB",
                    help="also run -z 0 and -z 1 (overlapped) with reduction buckets of about MB megabytes (the "
                         "model's BUCKET_BYTES, 16: two layers a bucket): fewer, larger NCCL calls; repeatable")
    # worker side (one process of one run)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--overlap", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bucket-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker(args) -> None:
    import torch
    from llmpy.config import parse_descriptor
    from llmpy.distributed import init_data_parallel, shutdown
    from llmpy.init import init_parameters
    from llmpy.model import GPT2Model
    dp = init_data_parallel("cuda", args.zero)
    world, rank = (dp.world_size, dp.rank) if dp else (1, 0)
    rows = max(world, args.accum)  # micro-batches of B rows in a step's global batch
    config = parse_descriptor(args.model)
    model = GPT2Model(config, init_parameters(config, 42), args.B, args.T, device="cuda", dtype=torch.bfloat16,
                      recompute=args.recompute, data_parallel=dp, overlap_reduction=bool(args.overlap))
    if args.bucket_bytes:
        model.BUCKET_BYTES = args.bucket_bytes  # read when the first step plans the buckets
    g = torch.Generator().manual_seed(1337)
    res = {"world": world, "zero": args.zero, "accum": args.accum, "overlap": args.overlap, "step_ms": [],
           "losses": [], "norms": [],
           "describe": model.describe()}
    torch.cuda.reset_peak_memory_stats()

    def step(i):
        # the step's global batch (every rank draws all of it, so all agree), this rank's micro-batches
        buf = torch.randint(0, config.vocab_size, (rows, args.B * args.T + 1), generator=g)
        mine = [rank] if world > 1 else list(range(args.accum))
        batches = [(buf[k, :-1].view(args.B, args.T), buf[k, 1:].view(args.B, args.T)) for k in mine]
        if dp:
            dp.barrier()
        t0 = time.perf_counter()
        loss, norm = model.train_step(batches, args.lr, i, 0.1, 1.0)
        torch.cuda.synchronize()
        return loss, norm, (time.perf_counter() - t0) * 1e3

    for i in range(1, args.steps + 1):
        loss, norm, ms = step(i)
        res["step_ms"].append(ms)
        res["losses"].append(loss)
        res["norms"].append(norm)
        if rank == 0 and (i <= 3 or i % 10 == 0):
            print(f"[{world} GPU z{args.zero} a{args.accum}] step {i:3d} | loss {loss:.6f} | norm {norm:.4f} | "
                  f"{ms:.1f} ms", flush=True)
    if args.profile_steps > 0:
        try:  # the timed steps are what this run is for: a profiler failure must not lose them
            res["profile"] = profile_steps(step, args.steps + 1, args.profile_steps)
        except Exception as e:  # noqa: BLE001
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            res["profile_error"] = f"{type(e).__name__}: {first}"
            print(f"[{world} GPU] profiling failed: {res['profile_error']}", flush=True)
    res["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    if rank == 0 and args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f)
    shutdown()


def profile_steps(step, first: int, count: int) -> dict:
    """`count` more steps under torch.profiler: kernel ms a step by group (bench.profile_step's classes,
    NCCL's kernels as "communication") and the top kernels; the steps' wall times beside them."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from bench.profile_step import _kernel_intervals, aggregate_intervals
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + count):
            walls.append(step(i)[2])
    torch.cuda.synchronize()
    agg = aggregate_intervals(_kernel_intervals(prof), count, walls)
    return {"wall_ms": agg["wall_ms"], "kernel_ms": agg["kernel_ms"],
            "groups": {g: round(v["ms"], 3) for g, v in agg["groups"].items()},
            "top": [{k: r[k] for k in ("name", "group", "calls", "ms")} for r in agg["rows"][:12]]}


def parse_env(text: str) -> dict[str, str]:
    """'KEY=VAL,KEY=VAL' -> {KEY: VAL}; keys must be NCCL_ variables."""
    env = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep or not key.startswith("NCCL_"):
            raise SystemExit(f"--nccl-env {text!r}: expected NCCL_KEY=VALUE items separated by commas")
        env[key] = val
    return env


def launch(args, nproc: int, zero: int, accum: int, steps: int, tag: str, overlap: int = 1,
           extra_env: dict | None = None, bucket_bytes: int = 0) -> dict:
    out = f"/tmp/bench_dist_{tag}_{os.getpid()}.json"
    common = ["-m", "bench.bench_dist", "--worker", "--model", args.model, "--B", str(args.B), "--T", str(args.T),
              "--steps", str(steps), "--recompute", str(args.recompute), "--lr", str(args.lr), "--zero", str(zero),
              "--accum", str(accum), "--overlap", str(overlap), "--result-file", out,
              "--profile-steps", str(args.profile_steps if steps == args.steps else 0),
              "--bucket-bytes", str(bucket_bytes)]
    if nproc == 1:
        cmd = [sys.executable, *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *common]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", **(extra_env or {})}
    t = time.time()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res = {"tag": tag, "nproc": nproc, "rc": rc, "wall_s": time.time() - t, "env": extra_env or {}}
    if os.path.exists(out):
        with open(out) as f:
            res.update(json.load(f))
    return res


def report(runs: list[dict], args) -> tuple[list[str], dict]:
    """The table lines and the bitwise checks of main()'s runs, found by tag (adds median_ms,
    tokens_per_s and scaling to each run that has enough steps). The baseline: the steps of the 1-GPU
    runs without accumulation (first and last), pooled."""
    N, lo, tokens = args.nproc, args.median_from - 1, args.B * args.T
    lines = [f"=== data-parallel scaling: {args.model}, B={args.B} T={args.T} a GPU, median of steps "
             f"{args.median_from}..{args.steps}",
             f"{'run':24} {'GPUs':>4} {'ms/step':>8} {'tok/s':>11} {'scaling':>8} {'alloc GB':>9}  status"]
    timed = lambda r: len(r.get("step_ms", [])) > lo  # noqa: E731
    pooled = [ms for r in runs if r.get("world") == 1 and r.get("accum") == 1 and timed(r)
              for ms in r["step_ms"][lo:]]
    base = tokens / (statistics.median(pooled) / 1e3) if pooled else None
    for r in runs:
        if timed(r):
            ms = statistics.median(r["step_ms"][lo:])
            tok_s = tokens * max(r.get("world", 1), r.get("accum", 1)) / (ms / 1e3)
            r["median_ms"], r["tokens_per_s"] = ms, tok_s
            r["scaling"] = tok_s / base if base else None
        lines.append(f"{r['tag']:24} {r.get('world', '?'):>4} {r.get('median_ms') or float('nan'):8.1f} "
                     f"{r.get('tokens_per_s') or 0:11,.0f} {r.get('scaling') or float('nan'):8.3f} "
                     f"{r.get('peak_allocated_bytes', 0) / 1e9:9.2f}  rc={r['rc']}")
    if pooled:
        lines.append(f"1-GPU baseline: median {statistics.median(pooled):.1f} ms over {len(pooled)} steps of the "
                     f"first and last runs")
    profiled = [r for r in runs if r.get("profile")]
    if profiled:
        groups = list(profiled[0]["profile"]["groups"])
        lines.append(f"kernel ms a step under the profiler ({args.profile_steps} steps, rank 0):")
        lines.append(f"  {'run':24} {'wall':>6} " + " ".join(f"{g[:8]:>8}" for g in groups))
        for r in profiled:
            p = r["profile"]
            cells = " ".join(f"{p['groups'].get(g, 0):8.2f}" for g in groups)
            lines.append(f"  {r['tag']:24} {p['wall_ms']:6.1f} {cells}")
    by_tag = {r["tag"]: r for r in runs}
    z0, z1, acc = by_tag.get(f"{N}gpu_z0", {}), by_tag.get(f"{N}gpu_z1", {}), by_tag.get(f"1gpu_accum{N}", {})
    k = args.exact_steps
    same = lambda a, b, n=None: bool(a.get("losses")) and a.get("losses", [])[:n] == b.get("losses", [])[:n] \
        and a.get("norms", [])[:n] == b.get("norms", [])[:n]  # noqa: E731
    checks = {"z0 == z1 (losses, norms, all steps)": same(z0, z1),
              f"{N} GPUs == 1 GPU x {N} accumulation (first {k} steps)": bool(acc.get("losses")) and same(z0, acc, k)}
    for r in runs:  # every other N-GPU run (after the backward, other NCCL settings) must match -z 0
        other = N > 1 and r.get("nproc") == N and r["tag"] not in (z0.get("tag"), z1.get("tag"))
        if other:
            checks[f"{r['tag']} == z0"] = same(r, z0)
    lines += [f"bitwise {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items()]
    return lines, checks


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    N = args.nproc
    variants = [(text, parse_env(text)) for text in args.nccl_env]
    from bench.bench_step import make_output_folders
    make_output_folders(args.json)
    runs = [launch(args, 1, 0, 1, args.steps, "1gpu"),
            launch(args, N, 0, 1, args.steps, f"{N}gpu_z0"),
            launch(args, N, 1, 1, args.steps, f"{N}gpu_z1"),
            launch(args, 1, 0, N, args.exact_steps, f"1gpu_accum{N}"),
            launch(args, N, 0, 1, args.steps, f"{N}gpu_z0_after", overlap=0),
            launch(args, N, 1, 1, args.steps, f"{N}gpu_z1_after", overlap=0)]
    for text, env in variants:
        runs += [launch(args, N, zero, 1, args.steps, f"{N}gpu_z{zero}_{text}", extra_env=env) for zero in (0, 1)]
    for mb in args.bucket_mb:
        runs += [launch(args, N, zero, 1, args.steps, f"{N}gpu_z{zero}_bucket{mb:g}MB", bucket_bytes=int(mb * 2**20))
                 for zero in (0, 1)]
    runs.append(launch(args, 1, 0, 1, args.steps, "1gpu_last"))
    lines, checks = report(runs, args)
    print("\n" + "\n".join(lines))
    if args.json:
        from bench.bench_step import json_safe  # a NaN loss or norm as null: JSON has no NaN
        with open(args.json, "w") as f:
            json.dump(json_safe({"settings": vars(args), "runs": runs, "bitwise": checks}), f, indent=1,
                      allow_nan=False)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
