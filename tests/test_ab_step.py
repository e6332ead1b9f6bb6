"""bench/ab_step.py without a GPU: the variants alternate round by round, each run gets the common
arguments and its own, and --from-best merges the flash sweep's fastest forward and backward entries."""
import json

import pytest

from bench import ab_step


def fake_runner(calls):
    def run(system, args, argv):
        calls.append(list(argv))
        ms = 100.0 if "--flash-config" in argv else 110.0
        ms += 0.5 * len(calls)  # drift: a later run is slower, whichever variant it is
        return {"system": system, "ok": True, "step_ms": [5000.0] + [ms] * 39, "losses": [], "norms": []}
    return run


def test_variants_alternate_and_report(capsys, tmp_path):
    calls = []
    out = tmp_path / "ab.json"
    rc = ab_step.main(["--variant", """new=--flash-config '{"BLOCK_N2": 64}'""", "--variant", "old=", "--rounds", "2",
                       "--json", str(out), "--", "--recompute", "0"], runner=fake_runner(calls))
    assert rc == 0
    # A B A B, the common arguments in every run, the variant's own only in its runs
    assert [("--flash-config" in c) for c in calls] == [True, False, True, False]
    assert all(c[:2] == ["--systems", "llmpy"] and "--recompute" in c for c in calls)
    assert calls[0][-1] == '{"BLOCK_N2": 64}'
    report = json.loads(out.read_text())
    assert report["medians_ms"] == {"new": [100.5, 101.5], "old": [111.0, 112.0]}
    text = capsys.readouterr().out
    assert "+10.5 ms" in text  # old against new: (111.0 + 112.0) / 2 - (100.5 + 101.5) / 2


def test_from_best_merges_forward_and_fastest_backward(tmp_path):
    best = {"fwd": {"ms": 0.35, "fields": {"BLOCK_M": 64, "fwd_tma": True}},
            "fused": {"ms": 0.99, "fields": {"BLOCK_N2": 64, "bwd_schedule": "fused"}},
            "split": {"ms": 1.03, "fields": {"BLOCK_N2": 32, "bwd_schedule": "split"}}}
    path = tmp_path / "best.json"
    path.write_text(json.dumps(best))
    (name0, args0), (name1, args1) = ab_step.variants_from_best(str(path))
    assert (name0, args0) == ("default", [])
    assert name1 == "best" and args1[0] == "--flash-config"
    assert json.loads(args1[1]) == {"BLOCK_M": 64, "fwd_tma": True, "BLOCK_N2": 64, "bwd_schedule": "fused"}


def test_bad_usage():
    for bad in (["--variant", "only="], ["--variant", "a=", "--variant", "a="],
                ["--variant", "noequals", "--variant", "b="], ["--variant", "a=", "--variant", "b=", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            ab_step.main(bad, runner=fake_runner([]))


def test_a_failed_run_fails_the_call(capsys):
    def failing(system, args, argv):
        return {"system": system, "ok": False, "error": "boom", "step_ms": [], "losses": [], "norms": []}
    assert ab_step.main(["--variant", "a=", "--variant", "b=", "--rounds", "1"], runner=failing) == 1
    assert "FAILED: boom" in capsys.readouterr().out


def test_lower_quartiles_leave_out_slow_spells(capsys, tmp_path):
    """The base run's steps are ~106 ms with a third of them 135 ms (the power cap's slow spells), the
    other variant's ~100 ms throughout: the lower quartiles compare the fast steps of both."""
    def spiky(system, args, argv):
        fast = "--no-graph" in argv  # any bench_step flag marks the other variant
        steps = [(100.0 if fast else 106.0) + 0.1 * (i % 5) for i in range(39)]
        if not fast:
            steps = [135.0 if i % 3 == 0 else s for i, s in enumerate(steps)]
        return {"system": system, "ok": True, "step_ms": [5000.0] + steps, "losses": [], "norms": []}
    out = tmp_path / "ab.json"
    rc = ab_step.main(["--variant", "base=", "--variant", "new=--no-graph", "--rounds", "1", "--json", str(out)],
                      runner=spiky)
    assert rc == 0
    report = json.loads(out.read_text())
    q_base, q_new = report["lower_quartiles_ms"]["base"][0], report["lower_quartiles_ms"]["new"][0]
    assert 106.0 <= q_base <= 106.5 and 100.0 <= q_new <= 100.5
    assert report["medians_ms"]["base"][0] >= 106.0
    text = capsys.readouterr().out
    assert "lower quartiles ms" in text and "(lower quartile 106." in text


def test_energy_per_step_is_compared_when_the_runs_have_it(capsys, tmp_path):
    """Runs that report NVML's J per step get a third table; its difference is in joules."""
    def with_energy(system, args, argv):
        new = "--no-graph" in argv
        return {"system": system, "ok": True, "step_ms": [5000.0] + [100.0] * 39, "losses": [], "norms": [],
                "joules_per_step": 70.0 if new else 73.5, "watts": 700.0}
    out = tmp_path / "ab.json"
    assert ab_step.main(["--variant", "base=", "--variant", "new=--no-graph", "--rounds", "2", "--json", str(out)],
                        runner=with_energy) == 0
    report = json.loads(out.read_text())
    assert report["joules_per_step"] == {"base": [73.5, 73.5], "new": [70.0, 70.0]}
    text = capsys.readouterr().out
    assert "J per step" in text and "-3.5 J" in text and "73.50 J/step at 700 W" in text


def test_no_energy_table_without_energy(capsys):
    assert ab_step.main(["--variant", "a=", "--variant", "b=--no-graph", "--rounds", "1"],
                        runner=fake_runner([])) == 0
    assert "J per step" not in capsys.readouterr().out


def test_json_in_a_folder_that_does_not_exist_yet(tmp_path):
    """The report goes where --json says, its folder made first: not a FileNotFoundError after every round."""
    out = tmp_path / "new" / "deeper" / "ab.json"
    calls = []
    assert ab_step.main(["--variant", "a=", "--variant", "b=--flash-config {}", "--rounds", "1", "--json", str(out)],
                        runner=fake_runner(calls)) == 0
    assert json.loads(out.read_text())["medians_ms"] == {"a": [110.5], "b": [101.0]}


def test_every_variant_s_arguments_are_checked_before_the_first_run(capsys):
    """A bad flag in the second variant ends the call at once, not after the first variant's run."""
    calls = []
    with pytest.raises(SystemExit) as e:
        ab_step.main(["--variant", "a=", "--variant", "b=--B 0", "--rounds", "2"], runner=fake_runner(calls))
    err = capsys.readouterr().err
    assert e.value.code == 2 and calls == []
    assert err.strip().splitlines()[-1].endswith("--B must be at least 1")
