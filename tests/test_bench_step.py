"""bench/bench_step.py's loss comparison on made-up runs (the runs themselves need a GPU)."""
import json
import math
import random
import statistics

import pytest

from bench import bench_step
from bench.bench_step import format_losses, llmpy_options, parse_args


def runs(n, offset_at=None, offset=0.0, bad_at=None):
    rng = random.Random(n)
    ref = [10.0 - 0.05 * i + rng.random() * 1e-3 for i in range(n)]
    other = [x + 1e-5 * rng.random() for x in ref]
    if offset_at is not None:
        other[offset_at] += offset
    if bad_at is not None:
        other[bad_at] = math.nan
    return {"torch-compile": {"losses": ref, "norms": [1.0] * n}, "llmpy": {"losses": other, "norms": [1.0] * n}}


def test_the_difference_covers_every_step_not_only_the_printed_ones():
    text = format_losses(runs(40, offset_at=33, offset=3e-3), 10)
    last = text.splitlines()[-1]
    assert "over steps 1..40" in last and "at step 34" in last and last.split(": ")[1].startswith("3.0")
    assert len(text.splitlines()) == 1 + 10 + 1  # header, the 10 printed steps, the comparison


def test_a_nonfinite_loss_is_named_with_its_step():
    last = format_losses(runs(40, bad_at=20), 10).splitlines()[-1]
    assert last.endswith("not finite from step 21")


def test_ln_proj_chunks_flag():
    assert parse_args(["--systems", "llmpy", "--ln-proj-chunks", "1024"]).ln_proj_chunks == 1024
    assert parse_args(["--systems", "llmpy"]).ln_proj_chunks is None  # the module's constant stays
    with pytest.raises(SystemExit):
        parse_args(["--systems", "llmpy", "--ln-proj-chunks", "0"])


def test_classifier_chunks_flag():
    # given: the model gets it (shared with profile_step); not given: the model's automatic choice
    assert llmpy_options(parse_args(["--systems", "llmpy", "--classifier-chunks", "4"]))["classifier_chunks"] == 4
    assert "classifier_chunks" not in llmpy_options(parse_args(["--systems", "llmpy"]))


def test_the_table_names_each_system_s_energy_when_measured():
    from bench.bench_step import format_table, summarize
    args = parse_args(["--systems", "torch-compile,llmpy", "--device", "cpu"])
    results = {}
    for name, ms, joules in (("torch-compile", 135.0, 94.5), ("llmpy", 104.0, None)):
        res = {"system": name, "ok": True, "step_ms": [9000.0] + [ms] * (args.steps - 1)}
        if joules is not None:
            res.update(joules_per_step=joules, watts=joules / ms * 1e3)
        results[name] = summarize(res, args)
    lines = [l for l in format_table(results, args).splitlines() if l.startswith("energy")]
    window = f"steps {args.warmup_median_from}..{args.steps}"
    assert lines == [f"energy (NVML, {window}): torch-compile 94.5 J/step at 700 W"]
    # with the card's state read around the window: its temperatures and the clock after it
    results["torch-compile"].update(celsius_at_window=[41, 47], sm_mhz_at_end=1755)
    lines = [l for l in format_table(results, args).splitlines() if l.startswith("energy")]
    assert lines[0].endswith("torch-compile 94.5 J/step at 700 W, 41->47 C, 1755 MHz")
    # and the share of the window NVML counted the clock held down by the power cap and by temperature
    results["torch-compile"]["throttled_share"] = {"power": 0.973, "thermal": 0.0}
    lines = [l for l in format_table(results, args).splitlines() if l.startswith("energy")]
    assert lines[0].endswith("1755 MHz, held by power 97 % / thermal 0 %")


def test_clock_event_reasons_are_named():
    from bench.energy import reason_names
    assert reason_names(0) == []
    assert reason_names(0x4 | 0x80) == ["sw power cap", "hw power brake"]
    assert reason_names(0x4 | 0x400) == ["sw power cap", "0x400"]  # a bit this table does not name


def test_classifier_config_flag():
    text = '{"variant": "onepass", "keep": "p", "num_warps": 16}'
    assert parse_args(["--systems", "llmpy", "--classifier-config", text]).classifier_config == text
    assert parse_args(["--systems", "llmpy"]).classifier_config is None  # the module's configs stay


def test_cublaslt_workspace_flag(monkeypatch):
    from bench.bench_step import set_kernel_switches
    from llmpy.kernels import cublaslt
    monkeypatch.setattr(cublaslt, "WORKSPACE_BYTES", cublaslt.WORKSPACE_BYTES)
    monkeypatch.setattr(cublaslt, "_devices", {})
    set_kernel_switches(parse_args(["--systems", "llmpy"]))
    assert cublaslt.WORKSPACE_BYTES == 32 << 20, "not given: llm.c's 32 MiB stays"
    set_kernel_switches(parse_args(["--systems", "llmpy", "--cublaslt-workspace-mib", "96"]))
    assert cublaslt.WORKSPACE_BYTES == 96 << 20
    with pytest.raises(SystemExit):
        parse_args(["--systems", "llmpy", "--cublaslt-workspace-mib", "0"])


# ----------------------------------------------------------------------------------------------------
# argument checks, the median window, the quartile, the JSON report (review of the benchmark tools)

def _one_usage_line(capsys, argv, parse=parse_args):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_an_unknown_model_is_one_usage_line(capsys):
    from llmpy.config import ConfigError, parse_descriptor
    with pytest.raises(ConfigError) as e:
        parse_descriptor("d13")
    assert str(e.value).startswith("unknown GPT-2 depth d13")
    assert _one_usage_line(capsys, ["--model", "d13"]).endswith(f"--model d13: {e.value}")


def test_the_peak_must_be_positive(capsys):
    # 0 would end the call in a ZeroDivisionError after every system has run
    assert _one_usage_line(capsys, ["--peak-tflops", "0"]).endswith("--peak-tflops must be above 0")


def test_a_system_named_twice_is_refused(capsys):
    # results are keyed by system: the first run would be thrown away unseen
    assert _one_usage_line(capsys, ["--systems", "llmpy,torch-compile,llmpy"]).endswith(
        "--systems: llmpy named twice")


def _fake_steps(n, base, seed):
    rng = random.Random(seed)
    return [30_000.0 + rng.random()] + [base + 5 * rng.random() for _ in range(n - 1)]


def test_a_nan_loss_leaves_the_json_report_valid(tmp_path):
    rng = random.Random(3)

    def runner(system, args, argv):
        losses = [10.9 - 0.01 * i + 1e-3 * rng.random() for i in range(args.steps)]
        norms = [1.0 + rng.random() for _ in range(args.steps)]
        if system == "llmpy":
            losses[6], norms[6] = math.nan, math.inf
        return {"system": system, "ok": True, "step_ms": _fake_steps(args.steps, 100.0, 1), "losses": losses,
                "norms": norms}

    out = tmp_path / "step.json"
    bench_step.main(["--json", str(out)], runner=runner)

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    report = json.loads(out.read_text(), parse_constant=refuse)
    r = report["results"]["llmpy"]
    assert r["losses"][6] is None and r["norms"][6] is None
    assert r["losses"][5] == pytest.approx(10.85, abs=2e-3)


def test_fewer_steps_than_the_warm_up_are_named_in_the_table(capsys):
    """--steps 6 with the median from step 11: the median covers steps 2..6 and the table must say so."""
    def runner(system, args, argv):
        return {"system": system, "ok": True, "step_ms": _fake_steps(args.steps, 100.0, 2),
                "losses": [10.0] * args.steps, "norms": [1.0] * args.steps}

    bench_step.main(["--steps", "6"], runner=runner)
    text = capsys.readouterr().out.split("=== whole step")[1]
    assert "11..6" not in text
    assert text.splitlines()[1].startswith("median of steps 2..6 (--steps 6 ends before --warmup-median-from 11), ")


def test_a_run_cut_short_names_the_steps_of_its_median(capsys):
    def runner(system, args, argv):
        n = 25 if system == "llmpy" else args.steps
        return {"system": system, "ok": system != "llmpy", "error": "timed out after 480 s" if n < 40 else None,
                "step_ms": _fake_steps(n, 100.0, 4), "losses": [10.0] * n, "norms": [1.0] * n}

    bench_step.main([], runner=runner)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.split("=== whole step")[1].splitlines()[1:]}
    assert rows["llmpy"].endswith("FAILED (timed out after 480 s) after 25 steps; median of steps 11..25 only")
    assert rows["torch-compile"].endswith(" ok")


def test_the_lower_quartile_lies_inside_the_steps_it_comes_from():
    rng = random.Random(11)
    args = parse_args(["--steps", "12"])  # a window of two steps: 11 and 12
    res = bench_step.summarize({"step_ms": [9000.0] + [100.0 + 10 * rng.random() for _ in range(11)]}, args)
    assert res["median_steps"] == [11, 12]
    assert res["min_ms"] <= res["p25_ms"] <= res["median_ms"]
    # the 30-step window of the acceptance runs keeps its quartile (statistics.quantiles' default method)
    args = parse_args([])
    steps = [9000.0] + [100.0 + 10 * rng.random() for _ in range(39)]
    res = bench_step.summarize({"step_ms": steps}, args)
    assert res["p25_ms"] == pytest.approx(statistics.quantiles(steps[10:], n=4)[0])
    assert res["min_ms"] <= res["p25_ms"] <= res["median_ms"]
