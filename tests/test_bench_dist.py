"""bench/bench_dist.py's report on made-up runs (the GPU runs themselves need the 2-GPU machine)."""
import pytest

from bench.bench_dist import parse_args, parse_env, report


def run(tag, world, ms, losses, accum=1, rc=0):
    return {"tag": tag, "nproc": world, "world": world, "accum": accum, "rc": rc, "step_ms": [ms] * 40,
            "losses": losses, "norms": [1.0] * len(losses), "peak_allocated_bytes": 24e9}


def test_scaling_against_both_one_gpu_runs_pooled_and_bitwise_checks():
    args = parse_args(["--nproc", "2"])
    same = [10.0 + i for i in range(40)]
    first = run("1gpu", 1, 100.0, [9.0] * 40)
    last = run("1gpu_last", 1, 104.0, [9.0] * 40)
    last["step_ms"][:25] = [98.0] * 25  # 15 of its 30 timed steps at 98, 15 at 104: pooled median 100
    runs = [first, run("2gpu_z0", 2, 102.0, same), run("2gpu_z1", 2, 101.0, same),
            run("1gpu_accum2", 1, 200.0, same[:10], accum=2), run("2gpu_z0_after", 2, 101.5, same),
            run("2gpu_z1_after", 2, 101.5, same), run("2gpu_z0_NCCL_MAX_CTAS=4", 2, 100.5, same),
            run("2gpu_z1_bucket64MB", 2, 100.8, same), last]
    lines, checks = report(runs, args)
    assert abs(runs[1]["scaling"] - 2 * 100 / 102) < 1e-9 and abs(runs[2]["scaling"] - 2 * 100 / 101) < 1e-9
    assert abs(runs[3]["scaling"] - 1.0) < 1e-9  # 2 micro-steps of B on one GPU: the 1-GPU throughput
    assert set(checks) == {"z0 == z1 (losses, norms, all steps)", "2 GPUs == 1 GPU x 2 accumulation (first 10 steps)",
                           "2gpu_z0_after == z0", "2gpu_z1_after == z0", "2gpu_z0_NCCL_MAX_CTAS=4 == z0",
                           "2gpu_z1_bucket64MB == z0"}
    assert all(checks.values()) and sum("yes" in l for l in lines) == 6
    assert any("1-GPU baseline: median 100.0 ms over 60 steps" in l for l in lines)


def test_a_failed_or_different_run_reads_no_and_nan():
    args = parse_args(["--nproc", "2"])
    runs = [run("1gpu", 1, 100.0, [9.0] * 40), {"tag": "2gpu_z0", "nproc": 2, "rc": 1},
            run("2gpu_z1", 2, 101.0, [1.0] * 40), {"tag": "1gpu_accum2", "nproc": 1, "rc": "timeout"},
            run("2gpu_z1_after", 2, 101.0, [2.0] * 40), {"tag": "2gpu_z0_NCCL_MAX_CTAS=4", "nproc": 2, "rc": "timeout"}]
    lines, checks = report(runs, args)
    assert not any(checks.values()) and len(checks) == 4
    assert any("2gpu_z0" in l and "nan" in l and "rc=1" in l for l in lines)


def test_nccl_env_variants_parse_and_refuse_other_variables():
    assert parse_env("NCCL_MAX_CTAS=4,NCCL_MIN_CTAS=2") == {"NCCL_MAX_CTAS": "4", "NCCL_MIN_CTAS": "2"}
    for bad in ("MAX_CTAS=4", "NCCL_MAX_CTAS"):
        with pytest.raises(SystemExit, match="--nccl-env"):
            parse_env(bad)


def test_profiled_runs_get_a_line_of_group_times_each():
    args = parse_args(["--nproc", "2", "--profile-steps", "3"])
    same = [10.0 + i for i in range(40)]
    groups = {"matrix": 66.0, "attention": 20.0, "memory-bound": 18.0, "optimizer": 1.0, "communication": 0.0,
              "other": 0.0, "gaps": 3.0}
    one, two = run("1gpu", 1, 100.0, same), run("2gpu_z0", 2, 102.0, same)
    one["profile"] = {"wall_ms": 108.0, "kernel_ms": 105.0, "groups": groups, "top": []}
    two["profile"] = {"wall_ms": 111.5, "kernel_ms": 109.0, "groups": {**groups, "communication": 2.75}, "top": []}
    lines, _ = report([one, two, run("2gpu_z1", 2, 101.0, same)], args)
    header = next(i for i, l in enumerate(lines) if l.startswith("kernel ms a step under the profiler (3 steps"))
    assert "communic" in lines[header + 1] and "matrix" in lines[header + 1]
    assert lines[header + 2].split()[:3] == ["1gpu", "108.0", "66.00"]
    assert lines[header + 3].split()[0] == "2gpu_z0" and "2.75" in lines[header + 3].split()
    assert not any(l.split()[:1] == ["2gpu_z1"] and "66.00" in l for l in lines)  # not profiled: no line


def test_variant_flags_repeat():
    args = parse_args(["--bucket-mb", "64", "--bucket-mb", "0.5", "--nccl-env", "NCCL_MAX_CTAS=4"])
    assert args.bucket_mb == [64.0, 0.5] and args.nccl_env == ["NCCL_MAX_CTAS=4"]


def test_one_process_smoke_run_makes_no_cross_run_checks():
    """--nproc 1 (a smoke run on one GPU): every run is a 1-GPU run; only the two fixed checks remain."""
    args = parse_args(["--nproc", "1", "--steps", "4", "--median-from", "2", "--exact-steps", "2"])
    same = [10.0, 9.9, 9.8, 9.7]
    runs = [run("1gpu", 1, 15.3, same), run("1gpu_z0", 1, 15.1, same), run("1gpu_z1", 1, 15.5, same),
            run("1gpu_accum1", 1, 32.9, same[:2]), run("1gpu_z0_after", 1, 15.0, same), run("1gpu_last", 1, 15.1, same)]
    for r in runs:
        r["step_ms"] = r["step_ms"][:len(r["losses"])]
    _, checks = report(runs, args)
    assert len(checks) == 2 and all(checks.values())


def test_profile_steps_groups_the_profiled_kernels(monkeypatch):
    """--profile-steps on made-up profiler events (no GPU): kernel time by group a step, against the mean wall
    time of the profiled steps (the kernel time is their sum, as in bench.profile_step)."""
    import random
    import types

    import torch
    import torch.profiler
    from torch.autograd import DeviceType

    from bench import bench_dist
    rng = random.Random(5)
    names = {"nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "matrix", "_flash_fwd_kernel": "attention",
             "ncclDevKernel_AllGather_RING_LL": "communication", "adamw_kernel": "optimizer",
             "_layernorm_forward_kernel": "memory-bound"}
    events, t, expect = [], 0.0, dict.fromkeys(names.values(), 0.0)
    for _ in range(3):  # three profiled steps
        for name, group in names.items():
            us = 100.0 + 900.0 * rng.random()
            events.append(types.SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                                                time_range=types.SimpleNamespace(start=t, end=t + us)))
            expect[group] += us / 1e3 / 3
            t += us + 5.0
    events.append(types.SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU,
                                        time_range=types.SimpleNamespace(start=0.0, end=1e6)))

    class FakeProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    walls = iter([9.0, 9.5, 30.0])
    seen = []

    def step(i):
        seen.append(i)
        return 10.0, 1.0, next(walls)

    out = bench_dist.profile_steps(step, 41, 3)
    assert seen == [41, 42, 43]
    assert out["wall_ms"] == pytest.approx((9.0 + 9.5 + 30.0) / 3)
    assert out["kernel_ms"] == pytest.approx(sum(expect.values()))
    for group, ms in expect.items():
        assert out["groups"][group] == pytest.approx(ms, abs=1e-3)
    assert out["groups"]["other"] == 0.0
    assert out["top"][0]["calls"] == pytest.approx(1.0)


def test_json_in_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch):
    import json
    import random

    from bench import bench_dist
    rng = random.Random(8)

    def launch(args, nproc, zero, accum, steps, tag, overlap=1, extra_env=None, bucket_bytes=0):
        losses = [10.0 - 0.1 * i + 1e-3 * rng.random() for i in range(steps)]
        return {**run(tag, nproc, 100.0 + rng.random(), losses, accum=accum), "step_ms": [100.0] * steps}

    monkeypatch.setattr(bench_dist, "launch", launch)
    out = tmp_path / "new" / "dist.json"
    assert bench_dist.main(["--nproc", "2", "--steps", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["tag"] for r in report["runs"]][:2] == ["1gpu", "2gpu_z0"] and len(report["runs"][1]["losses"]) == 12
