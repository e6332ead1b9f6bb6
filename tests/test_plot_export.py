"""`llmpy plot` (charts from main.jsonl) and `llmpy export` (a transformers GPT2LMHeadModel folder)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpy import plot as pl
from llmpy.checkpoint import load_model_file, save_llmc
from llmpy.config import GPT2Config, parameter_views
from llmpy.errors import LlmpyError
from llmpy.export import export_hf
from llmpy.reference import GPT2Reference

SRC = str(Path(__file__).resolve().parents[1] / "src")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

try:
    import matplotlib
    import matplotlib.colors
    HAS_MPL = True
except ImportError:
    matplotlib = None
    HAS_MPL = False
try:
    import transformers
except ImportError:
    transformers = None
needs_mpl = pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (pip install matplotlib)")


def run_cli(*args, cwd=None, timeout=300, env=None):
    env = {**os.environ, **(env or {}), "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "llmpy", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def write_log(run_dir: Path, steps=60, val_every=10, extra=True) -> Path:
    """A main.jsonl shaped like RunLog's, with a NaN loss, a skipped step and optional tok_s/mfu."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        rec = {"step": s, "kind": "train", "loss": 5.0 * math.exp(-s / 30) + 0.1 * math.sin(s),
               "norm": 10.0 / s, "lr": 3e-4 * min(1.0, s / 10), "ms": 100.0 + s % 3, "skipped": s == 25}
        if s == 40:
            rec["loss"] = float("nan")  # json.dumps writes NaN; the trainer can log one
        if extra:
            rec.update(tok_s=40000.0 + s, mfu=0.4 + 0.001 * s)
        lines.append(json.dumps(rec))
        if s % val_every == 0:
            lines.append(json.dumps({"step": s, "kind": "val", "loss": 5.0 * math.exp(-s / 30) + 0.2}))
    path = run_dir / "main.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_pngs(folder: Path, names):
    found = sorted(p.name for p in folder.glob("*.png"))
    assert found == sorted(names)
    for n in names:
        data = (folder / n).read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_MAGIC, n


# ---------------------------------------------------------------------------------------------------
# plot: reading the log (no matplotlib needed)

def test_read_log_sorted_and_last_record_wins(tmp_path):
    path = tmp_path / "main.jsonl"
    # a run killed at step 3 after its checkpoint of step 2, resumed from it: step 2's validation and step 3 again
    recs = [{"step": 1, "kind": "train", "loss": 1.0}, {"step": 2, "kind": "train", "loss": 2.0},
            {"step": 2, "kind": "val", "loss": 9.0}, {"step": 3, "kind": "train", "loss": 5.0},
            {"step": 2, "kind": "val", "loss": 8.0},
            {"step": 3, "kind": "train", "loss": 3.0, "future_key": "text is fine"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = pl.read_log(path)
    assert [(r["step"], r["kind"], r["loss"]) for r in out] == [(1, "train", 1.0), (2, "train", 2.0), (2, "val", 8.0),
                                                                (3, "train", 3.0)]
    assert out[-1]["future_key"] == "text is fine"
    columns = pl.read_columns(path)
    assert columns.records == 4 and columns.abandoned == 0  # each superseded record was logged again
    xs, ys = columns.series("train", "loss")
    assert xs.tolist() == [1, 2, 3] and ys.tolist() == [1.0, 2.0, 3.0]
    assert columns.series("val", "loss")[1].tolist() == [8.0]
    assert [len(a) for a in columns.series("train", "mfu")] == [0, 0]
    assert [len(a) for a in columns.series("eval", "accuracy")] == [0, 0]


def test_read_columns_hold_read_logs_numbers(tmp_path):
    # the columns plot_run draws from against read_log's whole records: the same values, NaN and null told apart
    path = write_log(tmp_path, steps=57, val_every=7)
    with open(path, "a") as f:  # a run resumed from step 49 logs steps 50-51 again, the first without its norm
        f.write(json.dumps({"step": 50, "kind": "train", "loss": 7.5, "norm": None, "lr": 1e-4}) + "\n")
        f.write(json.dumps({"step": 51, "kind": "train", "loss": 7.0, "norm": 0.5, "lr": 1e-4, "mfu": 0.3}) + "\n")
    records = pl.read_log(path)
    columns = pl.read_columns(path)
    assert columns.records == len(records)
    for kind in pl.KINDS:
        for key in pl.NUMERIC_KEYS:
            have = [r for r in records if r["kind"] == kind and r.get(key) is not None]
            xs, ys = columns.series(kind, key)
            assert xs.tolist() == [r["step"] for r in have], (kind, key)
            want = [float(r[key]) for r in have]
            assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(ys.tolist(), want)), (kind, key)
    xs, ys = columns.series("train", "norm")
    assert 50 not in xs.tolist() and 49 in xs.tolist()  # the later record of step 50 has none: it wins
    assert math.isnan(columns.series("train", "loss")[1][39])  # step 40's logged NaN is a value, not a gap
    # the earlier run's steps 52-57 and its validation of step 56: of a run the resumed one abandoned at step 49
    assert columns.series("train", "tok_s")[0].tolist() == list(range(1, 50))
    assert columns.series("val", "loss")[0].tolist() == [7, 14, 21, 28, 35, 42, 49]
    assert columns.abandoned == 7


def test_read_a_resumed_runs_log_without_the_abandoned_steps(tmp_path):
    # killed at step 8, its last checkpoint at step 4, resumed from it with another -l (the trainer allows that, with
    # a note) and still at step 6 (or stopped there): the earlier run's steps 7-8 are of a run no longer followed, as
    # TensorBoard's purge_step has it; they were drawn as part of the resumed run
    path = tmp_path / "main.jsonl"
    recs = [{"step": 0, "kind": "val", "loss": 6.0}]
    for step in range(1, 9):
        recs.append({"step": step, "kind": "train", "loss": 6.0 - 0.1 * step, "lr": 1e-3})
        if step % 4 == 0:
            recs.append({"step": step, "kind": "val", "loss": 6.0 - 0.1 * step})
    recs.append({"step": 4, "kind": "val", "loss": 5.6})
    recs += [{"step": step, "kind": "train", "loss": 5.0 - 0.2 * step, "lr": 5e-4} for step in (5, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    want_train = [(step, 1e-3) for step in range(1, 5)] + [(5, 5e-4), (6, 5e-4)]
    out = pl.read_log(path)
    assert [(r["step"], r["lr"]) for r in out if r["kind"] == "train"] == want_train
    assert [r["step"] for r in out if r["kind"] == "val"] == [0, 4]
    columns = pl.read_columns(path)
    assert list(zip(*(a.tolist() for a in columns.series("train", "lr")))) == want_train
    assert columns.series("val", "loss")[0].tolist() == [0, 4] and columns.abandoned == 3  # steps 7, 8; val 8
    assert pl.superseded([1, 2, 3, 2, 3], [True] * 5).tolist() == [False, True, True, False, False]
    # a run resumed at step 2 logs its validation of step 2 again (which then wins, as the last of its kind and step)
    assert pl.superseded([2, 2, 3, 2, 3], [True, False, True, False, True]).tolist() == [False, False, True, False,
                                                                                         False]
    # HellaSwag's record after the validation of its step: one run; a train record of a step it holds: a resume
    assert pl.superseded([2, 2, 2], [False, False, True]).tolist() == [True, True, False]
    assert pl.superseded([2**63 - 1], [True]).tolist() == [False]  # the last step there is, not "none after"


def test_thin_keeps_each_runs_extremes_in_order():
    rng = torch.Generator().manual_seed(7)
    n = 10_007  # not a multiple of the runs
    xs = torch.arange(n).numpy() * 3
    ys = torch.randn(n, generator=rng, dtype=torch.float64).numpy()
    ys[5000] = 40.0  # a spike every-k-th sampling would likely miss
    tx, ty = pl.thin(xs, ys, max_points=100)
    assert len(tx) <= 100 + 2 and (tx[1:] >= tx[:-1]).all()
    assert 40.0 in ty.tolist() and ty.min() == ys.min()
    assert set(zip(tx.tolist(), ty.tolist())) <= set(zip(xs.tolist(), ys.tolist()))  # real points only
    short_x, short_y = pl.thin(xs[:50], ys[:50], max_points=100)
    assert short_x.tolist() == xs[:50].tolist() and short_y.tolist() == ys[:50].tolist()


def test_thin_keeps_the_first_and_the_last_point():
    # the line must span the whole run and end at the last logged value (the final loss), noisy or not
    rng = torch.Generator().manual_seed(3)
    for n, max_points in ((1_000_000, pl.MAX_POINTS), (10_007, 100), (1001, 10)):
        xs = torch.arange(1, n + 1).numpy()
        ys = torch.randn(n, generator=rng, dtype=torch.float64).numpy()
        tx, ty = pl.thin(xs, ys, max_points=max_points)
        assert len(tx) <= max_points and (tx[1:] > tx[:-1]).all()
        assert (tx[0], ty[0]) == (xs[0], ys[0]) and (tx[-1], ty[-1]) == (xs[-1], ys[-1]), n
        assert ty.min() == ys.min() and ty.max() == ys.max()


def test_thin_keeps_a_run_of_nan_as_a_gap():
    ys = [float(i % 5) for i in range(1000)]
    ys[400:600] = [float("nan")] * 200  # a diverged stretch: all NaN over whole runs of 10
    tx, ty = pl.thin(list(range(1000)), ys, max_points=200)
    gaps = [x for x, y in zip(tx.tolist(), ty.tolist()) if math.isnan(y)]
    assert gaps and all(400 <= x < 600 for x in gaps)
    assert not math.isnan(ty[0]) and not math.isnan(ty[-1])


def test_read_log_leaves_out_a_last_line_still_being_written(tmp_path):
    # a live run's record half written, or a killed run's cut off: the records before it are the log
    path = tmp_path / "main.jsonl"
    done = [{"step": 1, "kind": "train", "loss": 1.0}, {"step": 1, "kind": "val", "loss": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"step": 2, "kind": "tr')
    assert pl.read_log(path) == done


@pytest.mark.parametrize("content, message", [
    ("", "empty log"),
    ('{"step": 1, "kind": "train", "loss": 1}\n\n', ":2: empty line"),
    ('{"step": 1, "kind": "train", "loss": 1}\n{"step": 2, "kind": "tr\n{"step": 3, "kind": "val"}\n',
     ":2: not valid JSON"),  # a line cut off inside the log, not at its end
    ('[1, 2]\n', ":1: expected a JSON object"),
    ('{"kind": "train", "loss": 1}\n', ":1: 'step' must be an integer"),
    ('{"step": 1.5, "kind": "train"}\n', ":1: 'step' must be an integer"),
    ('{"step": 1, "kind": "test"}\n', ":1: 'kind' must be"),
    ('{"step": 1, "kind": "train"}\n{"step": 2, "kind": "val", "loss": "high"}\n', ":2: 'loss' must be a number"),
    ('{"step": 100000000000000000000, "kind": "train", "loss": 1}\n', ":1: 'step' must be an integer (64-bit)"),
    ('{"step": 1, "kind": "train", "skipped": false}\n{"step": 2, "kind": "train", "ms": 1' + "0" * 400 + '}\n',
     ":2: 'ms' must be a number, got 1000000000000000000000000000000000000...$"),  # past a float's range, cut short
    pytest.param('{"step": 1, "kind": "train", "loss": 1}\n' + "[" * 100_000 + "\n",
                 ":2: not valid JSON (maximum recursion depth exceeded", id="nested-deeper-than-the-parser-goes"),
])
def test_read_log_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "main.jsonl"
    path.write_text(content)
    for read in (pl.read_log, pl.read_columns):  # both readers, the same checks
        with pytest.raises(LlmpyError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            read(path)


def test_ema_bias_corrected_and_skips_nan():
    assert pl.ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    out = pl.ema([1.0, float("nan"), 3.0], 0.5)
    # weights after bias correction: 1 then (0.25*1 + 0.5*3) / 0.75
    assert out == pytest.approx([1.0, 1.0, (0.25 + 1.5) / 0.75])
    assert math.isnan(pl.ema([float("nan")], 0.5)[0])
    with pytest.raises(LlmpyError, match="--smooth"):
        pl.ema([1.0], 1.0)


def test_plot_errors(tmp_path):
    with pytest.raises(LlmpyError, match="no such directory"):
        pl.plot_run(tmp_path / "missing")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LlmpyError, match="not a directory"):
        pl.plot_run(tmp_path / "afile")
    with pytest.raises(LlmpyError, match="no main.jsonl"):
        pl.plot_run(tmp_path)
    (tmp_path / "dir_log" / "main.jsonl").mkdir(parents=True)  # there, but a folder: not "no main.jsonl"
    with pytest.raises(LlmpyError, match=r"dir_log/main\.jsonl: not a regular file"):
        pl.plot_run(tmp_path / "dir_log")
    with pytest.raises(LlmpyError, match=r"main\.jsonl: not a regular file"):
        pl.read_columns(tmp_path / "dir_log" / "main.jsonl")
    write_log(tmp_path / "run")
    with pytest.raises(LlmpyError, match="--smooth"):
        pl.plot_run(tmp_path / "run", smooth=-0.1)
    with pytest.raises(LlmpyError, match="not a directory"):
        pl.plot_run(tmp_path / "run", tmp_path / "afile")
    with pytest.raises(LlmpyError, match="afile/charts: cannot create or write the plot folder"):
        pl.plot_run(tmp_path / "run", tmp_path / "afile" / "charts")  # a file where a parent folder must be


def test_plot_log_with_nothing_to_chart_is_an_error(tmp_path):
    # records, but none with a value any chart draws (like an empty main.jsonl: an error, not silence)
    recs = [{"step": 1, "kind": "train", "ms": 90.0, "loss": None}, {"step": 2, "kind": "val", "lr": 0.1}]
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(LlmpyError, match=r"main\.jsonl: 2 record\(s\) but none with a loss, .*nothing to plot"):
        pl.plot_run(tmp_path)
    assert not (tmp_path / "plots").exists()  # no empty plot folder left behind
    r = run_cli("plot", tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"llmpy plot: error: {tmp_path / 'main.jsonl'}: 2 record(s) but none with a loss, learning rate, "
        "gradient norm, tok_s, mfu or accuracy: nothing to plot"]


def test_plot_without_matplotlib_is_one_clear_error(tmp_path, monkeypatch):
    write_log(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(LlmpyError, match="pip install matplotlib"):
        pl.plot_run(tmp_path)


def test_cli_plot_error_is_one_line(tmp_path):
    r = run_cli("plot", tmp_path / "nope")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"llmpy plot: error: {tmp_path / 'nope'}: no such directory"]
    (tmp_path / "main.jsonl").write_text('{"step": 1, "kind": "train"}\nnot json\n')
    r = run_cli("plot", tmp_path)
    assert r.returncode == 1 and "main.jsonl:2: not valid JSON" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "main.jsonl").write_text("[" * 100_000 + "\n")  # was a RecursionError traceback
    r = run_cli("plot", tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"llmpy plot: error: {tmp_path / 'main.jsonl'}:1: not valid JSON (maximum recursion depth exceeded while "
        "decoding a JSON array from a unicode string)"]


def test_cli_plot_log_that_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "main.jsonl")  # opening it would wait for a writer for ever
    r = run_cli("plot", tmp_path, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"llmpy plot: error: {tmp_path / 'main.jsonl'}: not a regular file"]
    assert not (tmp_path / "plots").exists()


def test_plot_refuses_an_empty_path(tmp_path, monkeypatch):
    # Path("") is the current folder: `plot RUN -o ''` wrote its charts there, `plot ''` read ./main.jsonl
    write_log(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LlmpyError, match="^-o '': an empty output folder name"):
        pl.plot_run(tmp_path / "run", "")
    with pytest.raises(LlmpyError, match="^an empty run directory name"):
        pl.plot_run("", tmp_path / "out")
    r = run_cli("plot", tmp_path / "run", "-o", "", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "llmpy plot: error: -o '': an empty output folder name (leave -o out for DIR/plots)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not (tmp_path / "run" / "plots").exists()


def test_leave_out_undrawable_names_the_first_line(tmp_path):
    # the note names the earliest line of any kind (not the first kind checked), and not a superseded record's
    path = tmp_path / "main.jsonl"
    recs = [{"step": 1, "kind": "train", "loss": 9.0},
            {"step": 2, "kind": "train", "norm": -1e200},  # a run resumed from step 1 (next line) abandoned it
            {"step": 1, "kind": "val", "loss": 1e150},
            {"step": 2, "kind": "train", "loss": 3.0, "norm": 1e101, "ms": 1e300}]  # ms: not charted, not changed
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    columns = pl.read_columns(path)
    assert columns.series("train", "norm")[1].tolist() == [1e101]  # the log's numbers as they are
    assert pl.leave_out_undrawable(columns, path) == (f"{path}:3: 'loss' 1e+150 is too large to draw (magnitude "
                                                      "over 1e+100); left out of the charts (2 such values in all)")
    assert all(math.isnan(v) for v in columns.series("train", "norm")[1].tolist())
    assert math.isnan(columns.series("val", "loss")[1][0])
    assert columns.series("train", "ms")[1].tolist() == [1e300]
    assert columns.series("train", "loss")[1].tolist() == [9.0, 3.0]
    assert pl.leave_out_undrawable(columns, path) is None  # nothing left to leave out


# ---------------------------------------------------------------------------------------------------
# plot: drawing

ALL_CHARTS = ["loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "mfu.png"]


@needs_mpl
def test_plot_run_writes_all_charts(tmp_path):
    write_log(tmp_path)
    paths = pl.plot_run(tmp_path)
    assert sorted(p.name for p in paths) == sorted(ALL_CHARTS)
    assert all(p.parent == tmp_path / "plots" for p in paths)
    assert_pngs(tmp_path / "plots", ALL_CHARTS)


@needs_mpl
def test_plot_on_a_full_disk_keeps_the_earlier_charts_and_names_the_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    write_log(tmp_path)
    pl.plot_run(tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "plots").iterdir()}

    def full_disk(self, fname, **kwargs):
        Path(fname).write_bytes(PNG_MAGIC)  # a chart cut short, then PIL's error, which names no file
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError) as e:
        pl.plot_run(tmp_path)
    assert e.value.strerror == "No space left on device" and e.value.filename == str(tmp_path / "plots" / "loss.png")
    assert {p.name: p.read_bytes() for p in (tmp_path / "plots").iterdir()} == before


@needs_mpl
def test_plot_run_leaves_the_callers_matplotlib_backend_and_figures_alone(tmp_path):
    # called from Python (a notebook with its inline backend, a GUI), plot_run switched the whole process to Agg,
    # so the caller's own charts no longer showed
    import matplotlib.pyplot as plt
    write_log(tmp_path)
    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")
        own = plt.figure()
        assert len(pl.plot_run(tmp_path)) == len(ALL_CHARTS)
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [own.number]
    finally:
        plt.close("all")
        matplotlib.use(before)


@needs_mpl
def test_plot_run_skips_what_the_log_lacks(tmp_path):
    write_log(tmp_path, extra=False)
    out = tmp_path / "elsewhere" / "charts"
    pl.plot_run(tmp_path, out)
    assert_pngs(out, ["loss.png", "lr.png", "grad_norm.png"])
    # a run with validation records only still gives its loss chart
    only_val = tmp_path / "val_only"
    only_val.mkdir()
    (only_val / "main.jsonl").write_text(json.dumps({"step": 0, "kind": "val", "loss": 4.0}) + "\n")
    assert [p.name for p in pl.plot_run(only_val)] == ["loss.png"]


@needs_mpl
def test_plot_names_charts_left_from_an_earlier_plot(tmp_path):
    # a GPU run's tokens/s, MFU and HellaSwag charts stayed beside a later CPU run's, as if they were its own
    write_log(tmp_path)
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "hellaswag.png").write_bytes(PNG_MAGIC)
    (tmp_path / "plots" / "notes.png").write_bytes(PNG_MAGIC)  # not a chart of llmpy's: not named
    notes = []
    pl.plot_run(tmp_path, warn=notes.append)
    assert notes[-1:] == [f"{tmp_path / 'plots'}: hellaswag.png left from an earlier plot; this log has nothing "
                          "to chart in them"]
    write_log(tmp_path, extra=False)
    notes.clear()
    written = pl.plot_run(tmp_path, warn=notes.append)
    assert [p.name for p in written] == ["loss.png", "lr.png", "grad_norm.png"]
    assert notes[-1:] == [f"{tmp_path / 'plots'}: tokens_per_s.png, mfu.png, hellaswag.png left from an earlier "
                          "plot; this log has nothing to chart in them"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(pl.CHART_FILES + ("notes.png",))
    # CHART_FILES names every chart plot_run writes: a log with everything gives all of them, and no note
    full = write_log(tmp_path / "full")
    with full.open("a") as f:
        f.write(json.dumps({"step": 60, "kind": "eval", "accuracy": 0.3}) + "\n")
    notes.clear()
    assert [p.name for p in pl.plot_run(full.parent, warn=notes.append)] == list(pl.CHART_FILES) and notes == []


def saved_figures(monkeypatch) -> dict:
    """chart name -> the Figure saved under it, for the plots made after this call."""
    from matplotlib.figure import Figure
    saved, savefig = {}, Figure.savefig

    def keep(self, fname, **kwargs):
        saved[Path(fname).name.split(".")[1]] = self  # the chart's name, from its temporary's ".lr.png.PID.TAG.tmp"
        return savefig(self, fname, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


@needs_mpl
def test_plot_of_several_runs_draws_each_in_its_own_color(tmp_path, monkeypatch):
    a, b = tmp_path / "lr3e-4", tmp_path / "lr1e-3"
    write_log(a)
    write_log(b, steps=40, extra=False)  # no tok_s or mfu: those charts hold a's line alone
    saved = saved_figures(monkeypatch)
    out, notes = tmp_path / "compare", []
    written = pl.plot_runs([a, b], out, warn=notes.append)
    assert [p.name for p in written] == ["loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "mfu.png"]
    assert_pngs(out, [p.name for p in written])
    assert notes == [] and not (a / "plots").exists() and not (b / "plots").exists()
    loss = saved["loss"].axes[0]
    # a name and a color each run, the kinds of line told once, in gray
    handles = loss.get_legend().legend_handles
    assert [h.get_label() for h in handles] == ["lr3e-4", "lr1e-3", "train (EMA 0.9)", "val", "skipped update"]
    assert handles[0].get_color() != handles[1].get_color() and handles[2].get_color() == "gray"
    assert loss.get_title() == "lr3e-4 vs lr1e-3: loss"
    by_color = {}
    for line in loss.lines:
        by_color.setdefault(line.get_color(), []).append(line.get_label())
    assert sorted(by_color.values()) == [["train", "train (EMA 0.9)", "val"]] * 2
    # each run's skipped step (25) in the run's color
    assert [len(c.get_offsets()) for c in loss.collections] == [1, 1]
    assert [matplotlib.colors.to_hex(c.get_facecolor()[0]) for c in loss.collections] == \
        [matplotlib.colors.to_hex(h.get_color()) for h in handles[:2]]
    lr = saved["lr"].axes[0]
    assert [line.get_label() for line in lr.lines] == ["lr3e-4", "lr1e-3"]
    assert [len(line.get_xdata()) for line in lr.lines] == [60, 40]
    assert lr.lines[0].get_color() != lr.lines[1].get_color()
    tok_s = saved["tokens_per_s"].axes[0]  # titled by the run it draws
    assert [line.get_label() for line in tok_s.lines] == ["lr3e-4"] and tok_s.get_title() == "lr3e-4: throughput"


@needs_mpl
def test_plot_of_several_runs_names_each_by_what_tells_it_apart(tmp_path, monkeypatch):
    a, b, c = tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "y" / "other"
    for d in (a, b, c):
        write_log(d, extra=False)
    saved = saved_figures(monkeypatch)
    pl.plot_runs([a, b, c], tmp_path / "out", smooth=0.0)
    assert [line.get_label() for line in saved["lr"].axes[0].lines] == ["x/run", "y/run", "other"]
    assert saved["lr"].axes[0].get_title() == "x/run vs y/run vs other: learning rate"
    # no smoothing: the raw line is the train line of the legend
    assert [h.get_label() for h in saved["loss"].axes[0].get_legend().legend_handles][3] == "train"
    # a sweep of twelve: twelve colors, a legend that leaves the lines room, a title that counts them
    sweep = [tmp_path / "sweep" / f"lr{k:02d}" for k in range(12)]
    for d in sweep:
        write_log(d, extra=False)
    saved.clear()
    pl.plot_runs(sweep, tmp_path / "out12")
    lr = saved["lr"].axes[0]
    assert len({matplotlib.colors.to_hex(line.get_color()) for line in lr.lines}) == 12
    assert lr.get_title() == "12 runs: learning rate"
    assert len(saved["loss"].axes[0].get_legend().legend_handles) == 12 + 3


def test_plot_of_several_runs_errors(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_log(a)
    write_log(b)
    with pytest.raises(LlmpyError, match=r"^2 runs: give -o, the folder for the charts that compare them$"):
        pl.plot_runs([a, b])
    again = tmp_path / "a" / ".." / "a"
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(again))}: given twice \(as {re.escape(str(a))} too\)$"):
        pl.plot_runs([a, b, again], tmp_path / "out")
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(tmp_path / 'c'))}: no such directory$"):
        pl.plot_runs([a, tmp_path / "c"], tmp_path / "out")
    with pytest.raises(LlmpyError, match=r"^-o '': an empty output folder name$"):
        pl.plot_runs([a, b], "")
    assert not (tmp_path / "out").exists() and not (a / "plots").exists()
    r = run_cli("plot", a, b)
    assert r.returncode == 1 and r.stderr.strip() == "llmpy plot: error: 2 runs: give -o, the folder for the charts " \
        "that compare them", r.stderr


def write_batch_log(run_dir: Path, steps: int, per_step: int, tokens=True) -> list[dict]:
    """A main.jsonl of `steps` steps of `per_step` tokens, with the trainer's "tokens" or (tokens=False, as logs
    from before it) only the throughput and time they follow from; a validation every 5 steps."""
    import random
    run_dir.mkdir(parents=True, exist_ok=True)
    recs = []
    for s in range(1, steps + 1):
        ms = random.uniform(50.0, 150.0)
        rec = {"step": s, "kind": "train", "loss": 4.0 - s / steps + random.random() * 0.1, "lr": 1e-3 * s / steps,
               "norm": random.uniform(0.5, 2.0), "ms": ms, "tok_s": per_step / (ms / 1000), "skipped": s == 3}
        if tokens:
            rec["tokens"] = s * per_step
        recs.append(rec)
        if s % 5 == 0:
            recs.append({"step": s, "kind": "val", "loss": 4.1 - s / steps})
    (run_dir / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


@needs_mpl
@pytest.mark.parametrize("logged", ["tokens", "tok_s and ms"])
def test_plot_along_the_tokens_lines_up_runs_of_different_batch_sizes(tmp_path, monkeypatch, logged):
    # by step, a run of 4x the batch ended at a quarter of the other's x, however many tokens it had seen
    small, big = tmp_path / "b8", tmp_path / "b32"
    write_batch_log(small, 40, 8 * 1024, tokens=logged == "tokens")
    write_batch_log(big, 10, 32 * 1024, tokens=logged == "tokens")
    saved = saved_figures(monkeypatch)
    pl.plot_runs([small, big], tmp_path / "cmp", x_axis="tokens")
    lr = saved["lr"].axes[0]
    assert lr.get_xlabel() == "tokens"
    assert [line.get_xdata().tolist() for line in lr.lines] == [[s * 8192.0 for s in range(1, 41)],
                                                               [s * 32768.0 for s in range(1, 11)]]
    loss = saved["loss"].axes[0]
    val = [line for line in loss.lines if line.get_label() == "val"]
    assert [line.get_xdata().tolist() for line in val] == [[s * 8192.0 for s in range(5, 41, 5)],
                                                          [s * 32768.0 for s in (5, 10)]]
    assert [c.get_offsets()[:, 0].tolist() for c in loss.collections] == [[3 * 8192.0], [3 * 32768.0]]
    assert lr.xaxis.get_major_formatter().format_data(327680) == "327.68 k"
    # by step, as before
    saved.clear()
    pl.plot_runs([small, big], tmp_path / "by_step")
    assert saved["lr"].axes[0].get_xlabel() == "step"
    assert saved["lr"].axes[0].lines[1].get_xdata().tolist() == list(range(1, 11))


def test_plot_along_the_tokens_needs_a_log_that_tells_them(tmp_path):
    run = tmp_path / "run"
    recs = write_batch_log(run, 12, 4096)
    recs[7]["tokens"] += 1  # step 7's, on line 8 (the val record of step 5 is line 6)
    (run / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = re.escape(str(run / "main.jsonl"))
    with pytest.raises(LlmpyError, match=rf"^{log}:8: 'tokens' 28673 at step 7: not a whole number of tokens a "
                                         r"step, the same at every step; plot it by step$"):
        pl.plot_runs([run], tmp_path / "p", x_axis="tokens")
    for r in recs:
        r.pop("tokens", None)
        r.pop("tok_s", None)
    (run / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(LlmpyError, match=rf"^{log}: no train record says how many tokens a step takes \('tokens', or "
                                         r"'tok_s' and 'ms'\); plot it by step$"):
        pl.plot_runs([run], tmp_path / "p", x_axis="tokens")
    # along the time: every train record needs its step's
    del recs[9]["ms"]  # step 9's, on line 10
    (run / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(LlmpyError, match=rf"^{log}:10: a train record with no 'ms', so no time to plot along; plot it "
                                         r"by step or tokens$"):
        pl.plot_runs([run], tmp_path / "p", x_axis="time")
    with pytest.raises(LlmpyError, match=r"^--x-axis 'hours': one of step, tokens, time$"):
        pl.plot_runs([run], tmp_path / "p", x_axis="hours")
    assert not (tmp_path / "p").exists()
    r = run_cli("plot", run, "-x", "hours")
    assert r.returncode == 2 and "argument -x/--x-axis: invalid choice: 'hours'" in r.stderr


@needs_mpl
def test_plot_along_the_time_in_training_steps(tmp_path, monkeypatch):
    # each step's x: the sum of the steps' ms up to it (validation time not in it), in the unit the longest run needs
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast_recs, slow_recs = write_batch_log(fast, 40, 8192), write_batch_log(slow, 20, 8192)
    for r in slow_recs:
        if "ms" in r:
            r["ms"] *= 200  # 10-30 s a step, 200-600 s in all: in minutes
    slow_recs.insert(0, {"step": 0, "kind": "val", "loss": 4.5})
    (slow / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slow_recs))
    saved = saved_figures(monkeypatch)
    pl.plot_runs([fast, slow], tmp_path / "cmp", x_axis="time")
    lr = saved["lr"].axes[0]
    assert lr.get_xlabel() == "time in training steps (min)"
    for line, recs in zip(lr.lines, (fast_recs, slow_recs)):
        want = np.cumsum([r["ms"] for r in recs if r["kind"] == "train"]) / 60000
        assert np.allclose(line.get_xdata(), want, rtol=1e-12, atol=0)
    val = [line for line in saved["loss"].axes[0].lines if line.get_label() == "val"]
    slow_ms = np.cumsum([r["ms"] for r in slow_recs if r["kind"] == "train"]) / 60000
    assert np.allclose(val[1].get_xdata(), [0.0, slow_ms[4], slow_ms[9], slow_ms[14], slow_ms[19]], rtol=1e-12)
    saved.clear()
    pl.plot_runs([fast], tmp_path / "alone", x_axis="time")  # 40 steps of up to 0.15 s: in seconds
    assert saved["lr"].axes[0].get_xlabel() == "time in training steps (s)"


@needs_mpl
def test_cli_plot_of_several_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_log(a, extra=False)
    write_log(b, extra=False)
    r = run_cli("plot", a, b, "-o", tmp_path / "out")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.split() == [str(tmp_path / "out" / n) for n in ("loss.png", "lr.png", "grad_norm.png")]


@needs_mpl
def test_plot_log_without_loss_says_so(tmp_path):
    (tmp_path / "main.jsonl").write_text(json.dumps({"step": 1, "kind": "train", "lr": 1e-4}) + "\n")
    notes = []
    assert [p.name for p in pl.plot_run(tmp_path, warn=notes.append)] == ["lr.png"]
    assert notes == [f"{tmp_path / 'main.jsonl'}: no loss values in it, so no loss chart"]
    r = run_cli("plot", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 0 and r.stdout.split() == [str(tmp_path / "out" / "lr.png")]
    assert r.stderr.strip().splitlines() == [
        f"llmpy plot: note: {tmp_path / 'main.jsonl'}: no loss values in it, so no loss chart"]


def _non_finite(rng, n):
    """n random NaN, inf and -inf, as json.dumps writes them (NaN, Infinity, -Infinity)."""
    return [float(v) for v in rng.choice([math.nan, math.inf, -math.inf], n)]


def test_plot_log_whose_charted_values_are_all_nan_or_inf_is_an_error(tmp_path):
    # an empty loss.png around a meaningless axis, exit 0 and no word: a series of NaN and inf draws nothing
    rng = np.random.default_rng()
    n = int(rng.integers(2, 9))
    recs = [{"step": s, "kind": "train", "loss": v, "norm": w}
            for s, v, w in zip(range(1, n + 1), _non_finite(rng, n), _non_finite(rng, n))]
    recs.append({"step": n, "kind": "val", "loss": _non_finite(rng, 1)[0]})
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    message = (f"{tmp_path / 'main.jsonl'}: {n + 1} record(s) but no finite loss, learning rate, gradient norm, "
               "tok_s, mfu or accuracy (only NaN, infinite or too large to draw): nothing to plot")
    with pytest.raises(LlmpyError) as e:
        pl.plot_run(tmp_path)
    assert str(e.value) == message
    assert not (tmp_path / "plots").exists()  # no empty plot folder left behind
    r = run_cli("plot", tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"llmpy plot: error: {message}"]


@needs_mpl
def test_plot_log_whose_losses_are_all_nan_or_inf_says_so(tmp_path, monkeypatch):
    rng = np.random.default_rng()
    n = int(rng.integers(2, 9))
    lrs = rng.uniform(1e-4, 1e-3, n).tolist()
    recs = [{"step": s, "kind": "train", "loss": v, "lr": lr}
            for s, v, lr in zip(range(1, n + 1), _non_finite(rng, n), lrs)]
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    notes = []
    saved = saved_figures(monkeypatch)
    assert [p.name for p in pl.plot_run(tmp_path, warn=notes.append)] == ["lr.png"]  # no empty loss.png
    assert notes == [f"{tmp_path / 'main.jsonl'}: no finite loss values in it, so no loss chart"]
    assert saved["lr"].axes[0].lines[0].get_ydata().tolist() == lrs
    r = run_cli("plot", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 0 and r.stdout.split() == [str(tmp_path / "out" / "lr.png")]
    assert r.stderr.strip().splitlines() == [
        f"llmpy plot: note: {tmp_path / 'main.jsonl'}: no finite loss values in it, so no loss chart"]
    # with several runs, the one whose losses are all NaN or inf has no line in the loss chart, and no legend entry
    other = tmp_path / "other"
    write_log(other, extra=False)
    notes.clear()
    saved.clear()
    pl.plot_runs([tmp_path, other], tmp_path / "cmp", warn=notes.append)
    assert notes == [f"{tmp_path / 'main.jsonl'}: no finite loss values in it"]
    assert saved["loss"].axes[0].get_title() == "other: loss"
    assert {line.get_color() for line in saved["loss"].axes[0].lines} == {"C1"}  # the second run's color only


@needs_mpl
def test_plot_of_a_loss_with_some_finite_values_draws_those(tmp_path, monkeypatch):
    # train loss finite at some steps only, val loss at none: the train line with gaps, no val line, no note
    rng = np.random.default_rng()
    n = int(rng.integers(6, 30))
    losses = _non_finite(rng, n)
    finite_at = rng.choice(n, int(rng.integers(1, n)), replace=False)
    for i in finite_at:
        losses[i] = float(rng.uniform(2, 6))
    recs = [{"step": s, "kind": "train", "loss": v} for s, v in zip(range(1, n + 1), losses)]
    recs.append({"step": n, "kind": "val", "loss": _non_finite(rng, 1)[0]})
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    notes = []
    saved = saved_figures(monkeypatch)
    assert [p.name for p in pl.plot_run(tmp_path, smooth=0.0, warn=notes.append)] == ["loss.png"]
    assert notes == []
    (train,) = saved["loss"].axes[0].lines
    assert train.get_label() == "train"
    ys = np.asarray(train.get_ydata())
    assert np.array_equal(np.isfinite(ys), np.isfinite(losses)) and ys[np.isfinite(ys)].tolist() == \
        [losses[i] for i in sorted(finite_at)]


@needs_mpl
def test_plot_of_a_resumed_run_says_what_it_left_out(tmp_path):
    recs = [{"step": step, "kind": "train", "loss": 5.0 - 0.1 * step, "lr": 1e-3} for step in range(1, 9)]
    recs += [{"step": step, "kind": "train", "loss": 4.0, "lr": 5e-4} for step in (5, 6)]  # resumed from step 4
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    note = (f"{tmp_path / 'main.jsonl'}: a later run resumed from an earlier step; left out 2 record(s) that the "
            "earlier run logged past it and the resumed run has not logged again")
    notes = []
    assert [p.name for p in pl.plot_run(tmp_path, warn=notes.append)] == ["loss.png", "lr.png"]
    assert notes == [note]
    r = run_cli("plot", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 0 and r.stderr.strip().splitlines() == [f"llmpy plot: note: {note}"]


def shown_steps(line):
    """The steps of a drawn line's points that show: those with a marker, and those a segment reaches (a finite
    point beside them)."""
    import numpy as np
    xs, ys = (np.asarray(a, dtype=np.float64) for a in line.get_data())
    finite = np.isfinite(ys)
    joined = np.zeros(len(ys), bool)
    joined[1:] |= finite[:-1]
    joined[:-1] |= finite[1:]
    marked = np.zeros(len(ys), bool)
    if line.get_marker() not in (None, "", "None", " "):
        every = line.get_markevery()
        marked[:] = True if every is None else np.asarray(every, dtype=bool)
    return set(xs[finite & (joined | marked)].tolist())


@needs_mpl
@pytest.mark.parametrize("recs, charted", [
    # one step: a line of one point drew nothing in any chart
    ([{"step": 1, "kind": "train", "loss": 4.0, "lr": 1e-3, "norm": 2.0}], {1.0}),
    # the last value after an inf one: the line ended at step 2 and the last norm was not drawn
    ([{"step": s, "kind": "train", "loss": 4.0, "lr": 1e-3, "norm": math.inf if s == 3 else 2.0} for s in range(1, 5)],
     {1.0, 2.0, 4.0}),
])
def test_plot_shows_points_no_segment_reaches(tmp_path, monkeypatch, recs, charted):
    from matplotlib.figure import Figure
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    saved, savefig = {}, Figure.savefig

    def keep(self, fname, **kwargs):
        saved[Path(fname).name.split(".")[1]] = self  # the chart's name, from its temporary's ".lr.png.PID.TAG.tmp"
        return savefig(self, fname, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    assert sorted(p.name for p in pl.plot_run(tmp_path)) == ["grad_norm.png", "loss.png", "lr.png"]
    assert sorted(saved) == ["grad_norm", "loss", "lr"]
    assert shown_steps(saved["grad_norm"].axes[0].lines[0]) == charted
    assert shown_steps(saved["lr"].axes[0].lines[0]) == {float(r["step"]) for r in recs}
    assert set().union(*map(shown_steps, saved["loss"].axes[0].lines)) == {float(r["step"]) for r in recs}


@needs_mpl
def test_plot_run_draws_hellaswag_accuracy(tmp_path):
    # each step's HellaSwag record after its validation record, as the trainer writes them (not at step 0)
    lines = write_log(tmp_path, extra=False).read_text().splitlines(keepends=True)
    with open(tmp_path / "main.jsonl", "w") as f:
        for line in lines:
            f.write(line)
            rec = json.loads(line)
            if rec["kind"] == "val" and rec["step"] <= 30:
                f.write(json.dumps({"step": rec["step"], "kind": "eval", "accuracy": 0.25 + rec["step"] / 1000,
                                    "correct": 3, "total": 10}) + "\n")
    names = [p.name for p in pl.plot_run(tmp_path)]
    assert "hellaswag.png" in names
    assert_pngs(tmp_path / "plots", ["loss.png", "lr.png", "grad_norm.png", "hellaswag.png"])


@needs_mpl
def test_plot_run_thins_a_long_log_and_marks_skipped_steps(tmp_path, monkeypatch):
    # 30,000 steps: every line drawn with at most pl.MAX_POINTS points, the skipped update still marked
    from matplotlib.axes import Axes
    write_log(tmp_path, steps=30_000, val_every=1000)
    drawn, marked = [], []
    plot, scatter = Axes.plot, Axes.scatter
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: drawn.append((len(a[0]), k.get("label"))) or
                        plot(self, *a, **k))
    monkeypatch.setattr(Axes, "scatter", lambda self, x, y, **k: marked.append((list(x), list(y))) or
                        scatter(self, x, y, **k))
    assert sorted(p.name for p in pl.plot_run(tmp_path)) == sorted(ALL_CHARTS)
    assert len(drawn) == 7 and all(0 < n <= pl.MAX_POINTS for n, _ in drawn), drawn
    assert (30, "val") in drawn
    assert marked == [([25], [pytest.approx(5.0 * math.exp(-25 / 30) + 0.1 * math.sin(25))])]


@needs_mpl
@pytest.mark.filterwarnings("error")  # numpy's overflow warnings inside matplotlib's scales too
def test_plot_leaves_out_values_too_large_to_draw(tmp_path):
    # near the float maximum matplotlib's axis limits overflow: it crashed after writing loss.png, or (1e300 on
    # a log axis) warned on stderr; such values are a gap in their line, as a logged inf is, with one note
    recs = [{"step": 1, "kind": "train", "loss": 5.0, "lr": 1e-4, "norm": 2.0, "mfu": 0.4},
            {"step": 2, "kind": "train", "loss": 1e308, "lr": -1e308, "norm": 1e300, "mfu": 1e99, "skipped": True},
            {"step": 3, "kind": "train", "loss": -1e308, "lr": 1e308, "norm": 0.5, "mfu": -1e99},  # 1e99: drawn
            {"step": 3, "kind": "val", "loss": 1.7e308},
            {"step": 4, "kind": "train", "loss": 4.0, "lr": 1e-4, "norm": 1.0, "mfu": 0.4}]
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    note = (f"{tmp_path / 'main.jsonl'}:2: 'loss' 1e+308 is too large to draw (magnitude over 1e+100); left out of the "
            "charts (6 such values in all)")
    notes = []
    assert sorted(p.name for p in pl.plot_run(tmp_path, warn=notes.append)) == sorted(
        ["loss.png", "lr.png", "grad_norm.png", "mfu.png"])
    assert notes == [note]
    assert_pngs(tmp_path / "plots", ["loss.png", "lr.png", "grad_norm.png", "mfu.png"])
    r = run_cli("plot", tmp_path, "-o", tmp_path / "out")
    assert r.returncode == 0 and len(r.stdout.split()) == 4
    assert r.stderr.strip().splitlines() == [f"llmpy plot: note: {note}"]  # no RuntimeWarning, no traceback


@needs_mpl
def test_cli_plot(tmp_path):
    write_log(tmp_path / "run")
    r = run_cli("plot", tmp_path / "run", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert sorted(Path(line).name for line in r.stdout.split()) == sorted(ALL_CHARTS)
    assert_pngs(tmp_path / "out", ALL_CHARTS)


# ---------------------------------------------------------------------------------------------------
# sample (a command beside plot and export)

def test_cli_sample_to_an_output_that_cannot_encode_the_text(tmp_path):
    # stdout in ASCII (PYTHONIOENCODING, a Latin-1 locale, a Windows console or file) and a prompt or sample with a
    # character it lacks: the sample, with that character escaped, not a UnicodeEncodeError traceback
    config = GPT2Config(num_layers=1, channels=32, num_heads=2, vocab_size=257, max_seq_len=32)
    save_llmc(tmp_path / "m.bin", config, rand_params(config))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([sys.executable, "-m", "llmpy", "sample", str(tmp_path / "m.bin"),
                        "--prompt", "h\u00e9 \U0001F642", "-g", "40", "--seed", "3"], capture_output=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode(errors="replace")
    assert r.stdout.startswith(b"h\\xe9 \\U0001f642")


# ---------------------------------------------------------------------------------------------------
# export

TINY = GPT2Config(num_layers=2, channels=64, num_heads=4, vocab_size=100, max_seq_len=32)  # Vp = 128


def rand_params(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(config.num_parameters, generator=g) * 0.2


def zero_pad(flat):
    """flat with wte's padded rows zeroed: HF keeps the real vocab only, so they come back as zeros."""
    out = flat.clone()
    parameter_views(out, TINY)["wte"][TINY.vocab_size:] = 0
    return out


def test_export_round_trip(tmp_path):
    flat = rand_params(TINY)
    save_llmc(tmp_path / "m.bin", TINY, flat)
    out = export_hf(tmp_path / "m.bin", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"], cfg["n_positions"]) == (2, 64, 4, 100, 32)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] == 99
    config, back, dtype = load_model_file(out)
    assert config == TINY and dtype == "float32"
    assert torch.equal(back, zero_pad(flat))


def test_export_bf16_bin_widens_exactly(tmp_path):
    flat = rand_params(TINY, seed=1)
    save_llmc(tmp_path / "m.bin", TINY, flat, dtype="bfloat16")
    _, stored, dtype = load_model_file(tmp_path / "m.bin")
    assert dtype == "bfloat16"
    _, back, _ = load_model_file(export_hf(tmp_path / "m.bin", tmp_path / "hf"))
    assert torch.equal(back, zero_pad(stored.float()))  # bf16 -> fp32 is exact


def test_export_errors(tmp_path):
    with pytest.raises(LlmpyError, match="no such file"):
        export_hf(tmp_path / "missing.bin", tmp_path / "hf")
    save_llmc(tmp_path / "m.bin", TINY, rand_params(TINY))
    (tmp_path / "taken").write_text("x")
    with pytest.raises(LlmpyError, match="not a directory"):
        export_hf(tmp_path / "m.bin", tmp_path / "taken")
    with pytest.raises(LlmpyError, match="taken/hf: cannot create or write the export folder"):
        export_hf(tmp_path / "m.bin", tmp_path / "taken" / "hf")
    export_hf(tmp_path / "m.bin", tmp_path / "hf")
    with pytest.raises(LlmpyError, match="onto itself"):
        export_hf(tmp_path / "hf", tmp_path / "hf")
    # a folder named like the weights file would be taken for the file's path: refused, nothing made
    with pytest.raises(LlmpyError, match=r"new/x\.safetensors: the export is a folder .* without the \.safetensors"):
        export_hf(tmp_path / "m.bin", tmp_path / "new" / "x.safetensors")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("blocked", ["config.json", "generation_config.json"])
def test_export_over_a_folder_in_the_way_changes_nothing(tmp_path, blocked):
    # the new weights were written before the folder where a config goes failed its rename: a mixed export
    save_llmc(tmp_path / "m.bin", TINY, rand_params(TINY, seed=2))
    out = export_hf(tmp_path / "m.bin", tmp_path / "hf")
    (out / blocked).unlink()
    (out / blocked).mkdir()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    save_llmc(tmp_path / "m2.bin", TINY, rand_params(TINY, seed=3))
    with pytest.raises(LlmpyError, match=re.escape(f"{out / blocked} is a directory, not a file the export may")):
        export_hf(tmp_path / "m2.bin", out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_export_refuses_an_empty_folder_name(tmp_path, monkeypatch):
    # Path("") is the current folder: `export MODEL ''` wrote model.safetensors and the configs there
    save_llmc(tmp_path / "m.bin", TINY, rand_params(TINY))
    monkeypatch.chdir(tmp_path)
    for name in ("", " "):
        with pytest.raises(LlmpyError, match="^an empty export folder name$"):
            export_hf(tmp_path / "m.bin", name)
    r = run_cli("export", tmp_path / "m.bin", "", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["llmpy export: error: an empty export folder name"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


def test_cli_export(tmp_path):
    save_llmc(tmp_path / "m.bin", TINY, rand_params(TINY))
    r = run_cli("export", tmp_path / "m.bin", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "wrote" in r.stdout and "replaced" not in r.stdout
    r = run_cli("export", tmp_path / "m.bin", tmp_path / "hf")  # again: says it replaced the first export
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("; replaced the earlier model.safetensors, config.json, generation_config.json")
    r = run_cli("export", tmp_path / "nope.bin", tmp_path / "hf2")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("llmpy export: error:") and not (tmp_path / "hf2").exists()


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install transformers)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_matches_transformers(tmp_path, dtype):
    flat = rand_params(TINY, seed=2)
    save_llmc(tmp_path / "m.bin", TINY, flat, dtype=dtype)
    export_hf(tmp_path / "m.bin", tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert hf.config.vocab_size == TINY.vocab_size and hf.config.n_layer == TINY.num_layers
    # the reference runs the weights as stored (a bf16 file widened to fp32), as the export does
    _, stored, _ = load_model_file(tmp_path / "m.bin")
    ref = GPT2Reference(TINY, stored.float())
    g = torch.Generator().manual_seed(3)
    for B, T in ((2, TINY.max_seq_len), (1, 7)):
        tokens = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
        with torch.no_grad():
            hf_logits = hf(tokens).logits
        ref.forward(tokens)
        assert hf_logits.shape == (B, T, TINY.vocab_size)
        diff = (hf_logits - ref.logits[..., :TINY.vocab_size]).abs().max().item()
        assert diff < 1e-4, diff


@pytest.mark.parametrize("model, out, message", [
    ("m.bin", None, "export folder None: must be a folder's path (a str)"),
    ("m.bin", 3, "export folder 3: must be a folder's path (a str)"),
    (None, "hf", "model None: must be a model file's path (a str)"),
    (b"m.bin", "hf", "model b'm.bin': must be a model file's path (a str)"),
])
def test_export_refuses_paths_of_the_wrong_type(tmp_path, monkeypatch, model, out, message):
    # a TypeError traceback from Path()
    monkeypatch.chdir(tmp_path)
    save_llmc(tmp_path / "m.bin", TINY, rand_params(TINY))
    with pytest.raises(LlmpyError) as e:
        export_hf(model, out)
    assert str(e.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


def test_export_sample_and_plot_expand_a_quoted_tilde(tmp_path):
    # `llmpy export m.bin "~/hf"` made a folder named "~" in the current one; train and prepare expanded it
    cfg = GPT2Config(num_layers=1, channels=16, num_heads=2, vocab_size=257, max_seq_len=32)
    save_llmc(tmp_path / "m.bin", cfg, torch.randn(cfg.num_parameters) * 0.02)
    work = tmp_path / "work"
    work.mkdir()
    env = {"HOME": str(tmp_path)}
    res = run_cli("export", "~/m.bin", "~/hf", cwd=work, env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (work / "~").exists()
    res = run_cli("sample", "~/hf", "-g", 2, cwd=work, env=env)
    assert res.returncode == 0, res.stderr
    if HAS_MPL:
        write_log(tmp_path / "run")
        res = run_cli("plot", "~/run", "-o", "~/charts", cwd=work, env=env)
        assert res.returncode == 0, res.stderr
        assert_pngs(tmp_path / "charts", ALL_CHARTS)
        assert not (work / "~").exists()
