"""bench/bench_step.py's loss comparison on made-up runs (the runs themselves need a GPU)."""
import math
import random

import pytest

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
    assert lines == [f"energy (NVML, steps {args.warmup_median_from}..{args.steps}): torch-compile 94.5 J/step at 700 W"]
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
