"""`llmpy plot DIR [DIR ...]`: PNG charts of a run from its main.jsonl (the trainer's RunLog), or of several runs
drawn together (a line and a color each).

One chart per quantity: loss (train raw + smoothed, validation), learning rate, gradient norm, and
tokens/s and MFU when the log carries them ("tok_s", "mfu"; MFU is a fraction, drawn in percent); along the step,
along the tokens trained on (-x tokens: runs of different batch sizes line up), or along the time the steps took
(-x time: the sum of their "ms", without validation, sampling or checkpoints).
matplotlib is an optional dependency (`pip install matplotlib`, or the `plot` extra), imported only here.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from array import array
from pathlib import Path

from .errors import LlmpyError

LOG_NAME = "main.jsonl"
NUMERIC_KEYS = ("loss", "norm", "lr", "ms", "skipped", "tok_s", "mfu", "accuracy", "tokens")
KINDS = ("train", "val", "eval")  # eval: HellaSwag accuracy (-h 1)
# the largest magnitude drawn: matplotlib's limits, margins and log-scale ticks overflow float64 well before the
# float maximum (+-1e308 crashes it, 1e300 warns); no logged quantity comes near it
DRAWABLE = 1e100
# what the charts draw, by kind: a log without any of it has nothing to plot
CHARTED = {"train": ("loss", "lr", "norm", "tok_s", "mfu"), "val": ("loss",), "eval": ("accuracy",)}
X_AXES = ("step", "tokens", "time")
CHART_FILES = ("loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "mfu.png", "hellaswag.png")


def add_arguments(parser: argparse.ArgumentParser):
    parser.description = ("Draw PNG charts of a training run from DIR/main.jsonl; of several runs, charts that "
                          "draw them together, a line and a color each.")
    parser.add_argument("run_dirs", metavar="DIR", nargs="+",
                        help="the run's output directory (train -o), holding main.jsonl; several: one chart each "
                             "quantity, a line each run")
    parser.add_argument("-o", "--output", default=None,
                        help="folder for the PNGs (default: DIR/plots; needed with several runs)")
    parser.add_argument("--smooth", type=float, default=0.9,
                        help="EMA weight of the smoothed train loss, in [0, 1) (default: 0.9)")
    parser.add_argument("-x", "--x-axis", choices=X_AXES, default="step",
                        help="what the charts run along: the step, the tokens trained on (to compare runs of "
                             "different batch sizes), or the time spent in training steps (to compare their speed) "
                             "(default: step)")


def run(args: argparse.Namespace) -> int:
    paths = plot_runs(args.run_dirs, args.output, smooth=args.smooth, x_axis=args.x_axis,
                     warn=lambda msg: print(f"llmpy plot: note: {msg}", file=sys.stderr))
    for p in paths:
        print(p)
    return 0


# ---------------------------------------------------------------------------------------------------
# reading the log

def _validated_records(path: Path):
    """(line number, record) of a main.jsonl in file order, each checked; a bad line is an LlmpyError naming its
    line. A last line without its newline that does not parse is a record still being written (a live run) or
    cut off (a killed one): it is left out."""
    if not path.exists():
        raise LlmpyError(f"{path}: no such file")
    if not path.is_file():  # a folder, or a FIFO that open() would wait on for ever
        raise LlmpyError(f"{path}: not a regular file")
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not line.strip():
                raise LlmpyError(f"{where}: empty line")
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
                if not line.endswith("\n"):  # only the last line can lack it
                    return
                raise LlmpyError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise LlmpyError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            step, kind = rec.get("step"), rec.get("kind")
            if isinstance(step, bool) or not isinstance(step, int) or not -2**63 <= step < 2**63:
                raise LlmpyError(f"{where}: 'step' must be an integer (64-bit), got {_short(step)}")
            if kind not in KINDS:
                raise LlmpyError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
            for key in NUMERIC_KEYS:  # other keys a later trainer adds are carried, not checked
                if key in rec and not _is_number(rec[key]):
                    raise LlmpyError(f"{where}: '{key}' must be a number, got {_short(rec[key])}")
            yield lineno, rec


def read_log(path) -> list[dict]:
    """The records of a main.jsonl, whole; a bad line is an LlmpyError naming its line number.

    A run appends to its log, so a resumed or repeated run logs some steps again: the last record of
    each (kind, step) wins, the records an earlier run logged past the step a later one went back to are
    left out (see superseded), and the result is sorted by step. (plot_run reads through read_columns,
    which keeps only the numbers it draws: a long run's log holds millions of records.)
    """
    path = Path(path)
    records = [rec for _, rec in _validated_records(path)]
    if not records:
        raise LlmpyError(f"{path}: empty log (no steps yet)")
    stale = superseded([r["step"] for r in records], [r["kind"] == "train" for r in records])
    latest = {(rec["kind"], rec["step"]): rec for rec, old in zip(records, stale.tolist()) if not old}
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"] != "train"))


def superseded(steps, is_train):
    """Which records of a log, in file order, a later run's records replace, as a numpy bool array.

    Within one run the steps never go down (step s's train record, then its validation and HellaSwag
    records); a run resumed from the checkpoint of step s logs from step s (validation) or s + 1 (train)
    on, after the records the earlier run wrote past that checkpoint before it stopped. Those belong to
    a line of training that the resumed run abandoned, so they are left out even where the resumed run
    has not (yet) logged their steps again, as TensorBoard's purge_step does for the same run's events:
    a record is superseded by a later one of a lower step, or by a later train record of its step."""
    import numpy as np
    steps = np.asarray(steps, dtype=np.int64)
    is_train = np.asarray(is_train, dtype=bool)
    top = np.iinfo(np.int64).max  # no step is above it: "no record after this one" (a step may equal it)
    later = np.full(len(steps), top, np.int64)  # the lowest step of the records after each
    later_train = np.full(len(steps), top, np.int64)  # the lowest step of the train records after each
    train_after = np.zeros(len(steps), bool)  # whether any train record comes after each
    if len(steps) > 1:
        later[:-1] = np.minimum.accumulate(steps[:0:-1])[::-1]
        later_train[:-1] = np.minimum.accumulate(np.where(is_train, steps, top)[:0:-1])[::-1]
        train_after[:-1] = np.logical_or.accumulate(is_train[:0:-1])[::-1]
    return (later < steps) | (train_after & (later_train <= steps))


def _is_number(v) -> bool:
    # "skipped" is a JSON bool (bool is an int subclass); null stands for a value not measured; an integer too
    # large for a float (JSON's have no bound) is not one the charts can draw
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) <= sys.float_info.max
    return isinstance(v, (bool, float)) or v is None


def _short(value) -> str:
    # a value for an error line: a 400-digit number stays one readable line
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


class LogColumns:
    """A main.jsonl's numbers by kind, as numpy columns: for each kind the steps (sorted, the last record of a
    step winning and superseded records left out, as in read_log), the line of each step's record and, for each
    of NUMERIC_KEYS, the values (float64) and whether the record had one (a missing key or null is absent; a
    logged NaN is present). Eight bytes and a flag a number where read_log's dicts take some hundreds, so a log
    of millions of records plots in a few hundred MB."""

    def __init__(self, steps: dict, values: dict, present: dict, lines: dict, abandoned: int = 0):
        self.steps, self.values, self.present = steps, values, present  # by kind; values, present by (kind, key)
        self.lines = lines  # by kind, for messages that name a record's line
        self.records = sum(len(s) for s in steps.values())
        self.abandoned = abandoned  # records superseded by none of the same kind and step (a note says so)

    def series(self, kind: str, key: str):
        """(steps, values) of `key` over the records of `kind` that have it, as numpy arrays."""
        import numpy as np
        if kind not in self.steps:
            return np.zeros(0, np.int64), np.zeros(0)
        have = self.present[kind, key]
        return self.steps[kind][have], self.values[kind, key][have]

    def charted(self, kind: str, key: str):
        """series(), or none (as for a key no record has) where not one value is finite: a line of NaN and inf only
        draws nothing, and its chart would be an empty frame around a meaningless axis. A series with some finite
        values is kept whole (its NaNs are gaps in the line)."""
        import numpy as np
        steps, values = self.series(kind, key)
        if not np.isfinite(values).any():
            return steps[:0], values[:0]
        return steps, values


def read_columns(path) -> LogColumns:
    """A main.jsonl as LogColumns; the same checks and the same errors as read_log."""
    import numpy as np
    path = Path(path)
    steps = {kind: array("q") for kind in KINDS}
    lines = {kind: array("q") for kind in KINDS}
    at = {kind: array("q") for kind in KINDS}  # each record's place among all the log's records
    values = {(kind, key): array("d") for kind in KINDS for key in NUMERIC_KEYS}
    present = {(kind, key): bytearray() for kind in KINDS for key in NUMERIC_KEYS}
    all_steps, all_train = array("q"), bytearray()  # every record's, in file order, for superseded()
    for lineno, rec in _validated_records(path):
        kind = rec["kind"]
        at[kind].append(len(all_steps))
        all_steps.append(rec["step"])
        all_train.append(kind == "train")
        steps[kind].append(rec["step"])
        lines[kind].append(lineno)
        for key in NUMERIC_KEYS:
            v = rec.get(key)
            values[kind, key].append(math.nan if v is None else float(v))
            present[kind, key].append(v is not None)
    if not all_steps:
        raise LlmpyError(f"{path}: empty log (no steps yet)")
    stale = superseded(np.frombuffer(all_steps, np.int64), np.frombuffer(bytes(all_train), np.uint8))
    out_steps, out_values, out_present, out_lines = {}, {}, {}, {}
    abandoned = 0
    for kind in KINDS:
        kind_steps = np.frombuffer(steps[kind], np.int64) if steps[kind] else np.zeros(0, np.int64)
        kind_stale = stale[np.frombuffer(at[kind], np.int64)] if steps[kind] else np.zeros(0, bool)
        kept = np.flatnonzero(~kind_stale)
        # the last record of each step: the first of the reversed column, kept in step order
        unique, first_reversed = np.unique(kind_steps[kept][::-1], return_index=True)
        rows = kept[len(kept) - 1 - first_reversed]
        out_steps[kind] = unique
        abandoned += int(np.count_nonzero(~np.isin(kind_steps[kind_stale], unique)))
        out_lines[kind] = np.frombuffer(lines[kind], np.int64)[rows] if steps[kind] else np.zeros(0, np.int64)
        for key in NUMERIC_KEYS:
            column = np.frombuffer(values[kind, key], np.float64) if steps[kind] else np.zeros(0)
            out_values[kind, key] = column[rows]
            out_present[kind, key] = np.frombuffer(bytes(present[kind, key]), np.uint8)[rows].astype(bool)
    return LogColumns(out_steps, out_values, out_present, out_lines, abandoned)


def ema(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing); non-finite values are
    passed over so one NaN loss does not blank the rest of the curve."""
    if not 0.0 <= weight < 1.0:
        raise LlmpyError(f"--smooth {weight}: must be in [0, 1)")
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            acc = weight * acc + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        out.append(acc / norm if norm > 0 else float("nan"))
    return out


# ---------------------------------------------------------------------------------------------------
# drawing

MAX_POINTS = 4000  # a line's points drawn at most: a chart is ~900 pixels wide


def thin(xs, ys, max_points: int = MAX_POINTS):
    """At most max_points (4 at the fewest) of a line (xs ascending) that look the same drawn: in equal runs of
    points, the lowest and the highest of each, in order, so spikes and the noise's band survive where every k-th
    point would lose them; and the first and the last point, so that the line spans the whole run and ends at its last
    value (the final loss). A run of NaN only stays as one NaN (a gap in the line); lines short enough are as
    they are."""
    import numpy as np
    xs, ys = np.asarray(xs), np.asarray(ys, dtype=np.float64)
    if len(xs) <= max_points:
        return xs, ys
    per_run = -(-len(xs) // max(1, (max_points - 2) // 2))  # two points a run, and room for the ends
    runs = -(-len(xs) // per_run)
    padded = np.full(runs * per_run, np.nan)
    padded[:len(ys)] = ys
    blocks = padded.reshape(runs, per_run)
    all_nan = np.isnan(blocks).all(axis=1)
    filled = np.where(all_nan[:, None], 0.0, blocks)  # nanargmin/nanargmax refuse an all-NaN row
    lows, highs = np.nanargmin(filled, axis=1), np.nanargmax(filled, axis=1)
    picks = np.sort(np.stack([lows, highs], axis=1), axis=1) + (np.arange(runs) * per_run)[:, None]
    picks = np.minimum(picks, len(xs) - 1).ravel()  # the last run's padding: never picked unless the run is all NaN
    gap = np.repeat(all_nan, 2)
    # the first and the last point, where their runs' extremes are others
    head, tail = int(picks[0] != 0), int(picks[-1] != len(xs) - 1)
    picks = np.concatenate([[0]] * head + [picks] + [[len(xs) - 1]] * tail)
    gap = np.concatenate([[False]] * head + [gap] + [[False]] * tail)
    out_x, out_y = xs[picks], ys[picks]
    out_y[gap] = np.nan
    return out_x, out_y


def draw(ax, xs, ys, **style):
    """ax.plot of a line, thinned, with a marker on each point that no segment of the line reaches (one with no
    finite value beside it: the only point of a one-step log, a value between NaN or inf ones), which a line
    alone would leave unseen."""
    import numpy as np
    xs, ys = thin(xs, ys)
    if "marker" not in style:
        finite = np.isfinite(ys)
        lone = finite.copy()
        lone[1:] &= ~finite[:-1]
        lone[:-1] &= ~finite[1:]
        if lone.any():
            style.update(marker="o", markersize=3, markevery=lone)
    return ax.plot(xs, ys, **style)


def leave_out_undrawable(columns: LogColumns, log) -> str | None:
    """Set to NaN each charted value too large to draw (finite, magnitude over DRAWABLE): a gap in its line, as a
    logged inf is. Returns a note naming the first such value's line and key, or None where there is none."""
    import numpy as np
    first, count = None, 0
    for kind, keys in CHARTED.items():
        for key in keys:
            values = columns.values[kind, key]
            undrawable = columns.present[kind, key] & np.isfinite(values) & (np.abs(values) > DRAWABLE)
            if not undrawable.any():
                continue
            count += int(undrawable.sum())
            lines = columns.lines[kind][undrawable]
            at = int(np.argmin(lines))  # by line, not step: a resumed run's records are not in step order
            if first is None or lines[at] < first[0]:
                first = (int(lines[at]), key, float(values[undrawable][at]))
            values[undrawable] = np.nan
    if first is None:
        return None
    line, key, value = first
    more = f" ({count} such values in all)" if count > 1 else ""
    return (f"{log}:{line}: '{key}' {_short(value)} is too large to draw (magnitude over {DRAWABLE:g}); "
            f"left out of the charts{more}")


def _figure_class():
    """matplotlib's Figure: drawn to files by its own canvas (Agg for PNG), with no display (servers, CI) and without
    pyplot, so a caller's backend and open figures (a notebook's, a GUI's) stay as they were."""
    try:
        import matplotlib.figure
    except ImportError:
        raise LlmpyError("plotting needs matplotlib: pip install matplotlib") from None
    return matplotlib.figure.Figure


def plot_run(run_dir, out_dir=None, smooth: float = 0.9, warn=None) -> list[Path]:
    """Write the charts of run_dir/main.jsonl as PNGs into out_dir (default run_dir/plots); returns their paths.

    A log with nothing to chart is an LlmpyError; one without any loss, with values too large to draw (left
    out), or with records of a run that a later one went back before (left out, see superseded), gets a line
    through `warn`, if given.
    """
    return plot_runs([run_dir], out_dir, smooth, warn)


def _checked_run_dir(run_dir) -> Path:
    """A run folder given on the command line, as a path, once it holds a log; LlmpyError naming it otherwise."""
    from .files import expand_user
    run_dir = expand_user(run_dir)  # a quoted "~/runs/x" too, as train and prepare take it
    if not run_dir.exists():
        raise LlmpyError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise LlmpyError(f"{run_dir} is not a directory (give the run's output directory)")
    if not (run_dir / LOG_NAME).exists():
        raise LlmpyError(f"{run_dir}: no {LOG_NAME} in it (was it written by `llmpy train -o`?)")
    return run_dir


def _read_run(run_dir: Path, smooth: float, alone: bool, warn) -> LogColumns:
    """A run's log as columns, with its notes; LlmpyError where it has nothing to chart."""
    log = run_dir / LOG_NAME
    columns = read_columns(log)
    if not 0.0 <= smooth < 1.0:
        raise LlmpyError(f"--smooth {smooth}: must be in [0, 1)")
    # before any chart is written (matplotlib would crash mid-way), and before the checks below: a value left out
    # is no finite value
    note = leave_out_undrawable(columns, log)
    charted = [(kind, key) for kind, keys in CHARTED.items() for key in keys]
    if not any(len(columns.charted(kind, key)[0]) for kind, key in charted):
        # checked before the plot folder is made, so a failed plot leaves none behind
        if not any(len(columns.series(kind, key)[0]) for kind, key in charted):
            raise LlmpyError(f"{log}: {columns.records} record(s) but none with a loss, learning rate, gradient norm, "
                             "tok_s, mfu or accuracy: nothing to plot")
        raise LlmpyError(f"{log}: {columns.records} record(s) but no finite loss, learning rate, gradient norm, "
                         "tok_s, mfu or accuracy (only NaN, infinite or too large to draw): nothing to plot")
    if warn is not None and not any(len(columns.charted(kind, "loss")[0]) for kind in ("train", "val")):
        finite = "finite " if any(len(columns.series(kind, "loss")[0]) for kind in ("train", "val")) else ""
        warn(f"{log}: no {finite}loss values in it" + (", so no loss chart" if alone else ""))
    if warn is not None and columns.abandoned:
        warn(f"{log}: a later run resumed from an earlier step; left out {columns.abandoned} record(s) that the "
             "earlier run logged past it and the resumed run has not logged again")
    if note is not None and warn is not None:
        warn(note)
    return columns


def tokens_per_step(columns: LogColumns, log) -> int:
    """The tokens a step of the run trains on (-d), from its train records' "tokens" (the tokens trained on through
    that step), or, in a log from before that field, from a record's throughput and time (tok_s * ms / 1000, exact
    to far below a token). LlmpyError where the log has neither, or where its records disagree."""
    import numpy as np
    steps, tokens = columns.series("train", "tokens")
    if len(steps):
        per_step = tokens[0] / steps[0] if steps[0] > 0 else math.nan
        whole = math.isfinite(per_step) and per_step >= 1 and per_step == round(per_step)
        wrong = np.flatnonzero(tokens != steps * per_step) if whole else [0]
        if len(wrong):
            at, value = wrong[0], float(tokens[wrong[0]])
            line = columns.lines["train"][columns.present["train", "tokens"]][at]
            shown = int(value) if value.is_integer() else value
            raise LlmpyError(f"{log}:{line}: 'tokens' {_short(shown)} at step {steps[at]}: not a whole number of "
                             "tokens a step, the same at every step; plot it by step")
        return int(per_step)
    have = columns.present["train", "tok_s"] & columns.present["train", "ms"]
    rates = columns.values["train", "tok_s"][have] * columns.values["train", "ms"][have] / 1000
    rates = rates[np.isfinite(rates) & (rates >= 0.5)]
    if not len(rates):
        raise LlmpyError(f"{log}: no train record says how many tokens a step takes ('tokens', or 'tok_s' and 'ms'); "
                         "plot it by step")
    return int(np.rint(rates[0]))


def training_seconds(columns: LogColumns, log):
    """(steps, seconds): each train record's step and the time of the steps up to it, the sum of their "ms" (the
    time a step took, validation, sampling and checkpoints not in it). LlmpyError naming the first train record
    without a time, or with one that is not a finite number of milliseconds, where there is one."""
    import numpy as np
    steps, ms = columns.steps["train"], columns.values["train", "ms"]
    if not len(steps):
        raise LlmpyError(f"{log}: no train records, so no time to plot along; plot it by step")
    bad = ~columns.present["train", "ms"] | ~np.isfinite(ms) | (ms < 0)
    if bad.any():
        at = int(np.argmax(bad))
        what = "no 'ms'" if not columns.present["train", "ms"][at] else f"'ms' {_short(float(ms[at]))}"
        raise LlmpyError(f"{log}:{columns.lines['train'][at]}: a train record with {what}, so no time to plot along; "
                         "plot it by step or tokens")
    return steps, np.cumsum(ms) / 1000


def x_positions(x_axis: str, runs: list[LogColumns], dirs: list[Path]):
    """(along, label): along(i, steps) -> the x of run i's steps on the axis, which `label` names: the steps, the
    tokens trained on through them (float: no int64 overflow), or the time in steps up to them (in seconds, minutes
    or hours by the longest run; none yet before the first train record, as a validation at step 0). LlmpyError
    where a run's log cannot tell them."""
    import numpy as np
    if x_axis == "tokens":
        per_step = [float(tokens_per_step(c, d / LOG_NAME)) for c, d in zip(runs, dirs)]
        return (lambda i, steps: steps * per_step[i]), "tokens"
    if x_axis == "time":
        clocks = [training_seconds(c, d / LOG_NAME) for c, d in zip(runs, dirs)]
        longest = max(float(seconds[-1]) for _, seconds in clocks)
        unit, unit_seconds = next((u, k) for u, k, most in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, None))
                                  if most is None or longest <= most)

        def along(i, steps):
            train_steps, seconds = clocks[i]
            k = np.searchsorted(train_steps, steps, side="right") - 1
            return np.where(k >= 0, seconds[np.maximum(k, 0)], 0.0) / unit_seconds
        return along, f"time in training steps ({unit})"
    return (lambda i, steps: steps), "step"


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's name in the legends: the fewest last parts of its full path that tell it from the others
    (its folder's name, unless two runs share it: then "x/run" and "y/run")."""
    parts = [d.resolve().parts for d in run_dirs]
    names = []
    for i, mine in enumerate(parts):
        k = next((k for k in range(1, len(mine)) if all(other[-k:] != mine[-k:] for j, other in enumerate(parts)
                                                        if j != i)), len(mine))
        names.append(str(Path(*mine[-k:])))  # all of them: the whole path, from its root
    return names


def run_colors(count: int) -> list:
    """A color for each of `count` runs: matplotlib's ten, then tab20's twenty; past 20 they repeat."""
    if count <= 10:
        return [f"C{i}" for i in range(count)]
    import matplotlib
    tab20 = matplotlib.colormaps["tab20"]
    return [tab20(i % 20) for i in range(count)]


TITLE_MOST = 60  # characters of run names a title takes, before it says "N runs"


def plot_runs(run_dirs, out_dir=None, smooth: float = 0.9, warn=None, x_axis: str = "step") -> list[Path]:
    """plot_run of one run or several: with several, each chart draws every run that has its quantity, in a color of
    its own named in the legend (a learning-rate sweep, a run against its baseline), into out_dir, which is then
    needed. The runs' folders are checked, then their logs read, before any chart is drawn. x_axis: what the charts
    run along, one of X_AXES (see x_positions)."""
    if x_axis not in X_AXES:
        raise LlmpyError(f"--x-axis {x_axis!r}: one of {', '.join(X_AXES)}")
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise LlmpyError("no run directory given (give the run's output directory, train -o)")
    # Path("") is the current folder: not what was meant
    if any(not str(d).strip() for d in run_dirs):
        raise LlmpyError("an empty run directory name (give the run's output directory, train -o)")
    several = len(run_dirs) > 1
    if out_dir is not None and not str(out_dir).strip():
        raise LlmpyError("-o '': an empty output folder name" + ("" if several else " (leave -o out for DIR/plots)"))
    dirs = [_checked_run_dir(d) for d in run_dirs]
    seen = {}
    for d in dirs:
        if d.resolve() in seen:
            raise LlmpyError(f"{d}: given twice (as {seen[d.resolve()]} too)")
        seen[d.resolve()] = d
    if several and out_dir is None:
        raise LlmpyError(f"{len(dirs)} runs: give -o, the folder for the charts that compare them")
    runs = [_read_run(d, smooth, not several, warn) for d in dirs]
    along, xlabel = x_positions(x_axis, runs, dirs)  # each run's x of a step, the axis's name
    from .files import expand_user
    out = expand_user(out_dir) if out_dir is not None else dirs[0] / "plots"
    if out.exists() and not out.is_dir():
        raise LlmpyError(f"{out} exists and is not a directory")
    Figure = _figure_class()
    import numpy as np
    from matplotlib.lines import Line2D
    from .files import atomic_path, writable_dir
    writable_dir(out, "plot folder")
    names, colors = run_names(dirs), run_colors(len(dirs))
    written = []

    def save(fig, name):
        path = out / name
        try:  # under a temp name, renamed when whole: a full disk leaves the earlier chart as it was
            with atomic_path(path) as tmp:
                fig.savefig(tmp, dpi=110, format="png")
        except OSError as e:  # matplotlib's and PIL's errors name no file
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        written.append(path)

    def new(ylabel, what, drawn):
        """A chart of `drawn` (the indices of the runs with a line in it)."""
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.subplots()
        ax.set_xlabel(xlabel)
        if x_axis == "tokens":
            from matplotlib.ticker import EngFormatter
            ax.xaxis.set_major_formatter(EngFormatter())  # 500 M, 2 G: tokens run to billions
        ax.set_ylabel(ylabel)
        title = " vs ".join(names[i] for i in drawn)
        ax.set_title(f"{title if len(title) <= TITLE_MOST else f'{len(drawn)} runs'}: {what}")
        ax.grid(True, alpha=0.3)
        return fig, ax

    def legend(ax, drawn, extra=()):
        # several runs: a name each, and a line's kind told once (val dashed, skipped updates), small and in columns
        # so that a sweep's legend does not cover the lines
        handles = [Line2D([], [], color=colors[i], linewidth=1.6, label=names[i]) for i in drawn] + list(extra)
        ax.legend(handles=handles, fontsize="small" if len(handles) > 6 else None, ncol=1 + len(handles) // 12)

    # loss: raw train faint, smoothed train (over every step, then thinned), validation as markers + line
    with_loss = [i for i, columns in enumerate(runs)
                 if any(len(columns.charted(kind, "loss")[0]) for kind in ("train", "val"))]
    if with_loss:
        fig, ax = new("loss", "loss", with_loss)
        kinds = set()
        for i in with_loss:
            columns = runs[i]
            tx, ty = columns.charted("train", "loss")  # a kind with no finite loss: no line, no legend entry
            vx, vy = columns.charted("val", "loss")
            tx, vx = along(i, tx), along(i, vx)
            c_train, c_val = (colors[i], colors[i]) if several else ("C0", "C1")
            if len(tx):
                draw(ax, tx, ty, color=c_train, alpha=0.25, linewidth=0.8, label="train")
                if smooth > 0:  # one point too: the faint raw line alone would hardly show it
                    draw(ax, tx, ema(ty, smooth), color=c_train, linewidth=1.6, label=f"train (EMA {smooth:g})")
                skipped = (columns.values["train", "skipped"] != 0) & columns.present["train", "skipped"] \
                    & columns.present["train", "loss"]
                if skipped.any():
                    ax.scatter(along(i, columns.steps["train"][skipped]), columns.values["train", "loss"][skipped],
                               color=c_train if several else "C3", marker="x", zorder=3, label="skipped update")
                    kinds.add("skipped")
            if len(vx):
                draw(ax, vx, vy, color=c_val, marker="o", markersize=3, linewidth=1.4,
                     linestyle="--" if several else "-", label="val")
                kinds.add("val")
        if several:
            what = f"train (EMA {smooth:g})" if smooth > 0 else "train"
            extra = [Line2D([], [], color="gray", linewidth=1.6, label=what)]
            if "val" in kinds:
                extra.append(Line2D([], [], color="gray", linestyle="--", marker="o", markersize=3, label="val"))
            if "skipped" in kinds:
                extra.append(Line2D([], [], color="gray", linestyle="", marker="x", label="skipped update"))
            legend(ax, with_loss, extra)
        else:
            ax.legend()
        save(fig, "loss.png")

    def chart(kind, key, fname, ylabel, what, scale, alone_color, style, logy=False, sci=False):
        lines = [(i, *runs[i].charted(kind, key)) for i in range(len(runs))]
        lines = [(i, xs, ys) for i, xs, ys in lines if len(xs)]
        if not lines:
            return  # no log carries this quantity (older trainer, CPU run): no chart
        fig, ax = new(ylabel, what, [i for i, _, _ in lines])
        for i, xs, ys in lines:
            draw(ax, along(i, xs), ys * scale, color=colors[i] if several else alone_color, label=names[i], **style)
        finite = np.concatenate([ys[np.isfinite(ys)] for _, _, ys in lines])
        if logy and len(finite) and (finite > 0).all():
            ax.set_yscale("log")  # norms span orders of magnitude early in training
        if sci:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if several:
            legend(ax, [i for i, _, _ in lines])
        save(fig, fname)

    chart("train", "lr", "lr.png", "learning rate", "learning rate", 1.0, "C2", {"linewidth": 1.2}, sci=True)
    chart("train", "norm", "grad_norm.png", "gradient norm", "gradient norm (before clipping)", 1.0, "C2",
          {"linewidth": 1.2}, logy=True)
    chart("train", "tok_s", "tokens_per_s.png", "tokens / s", "throughput", 1.0, "C2", {"linewidth": 1.2})
    chart("train", "mfu", "mfu.png", "MFU (%)", "model FLOPs utilization", 100.0, "C2", {"linewidth": 1.2})
    chart("eval", "accuracy", "hellaswag.png", "accuracy (%)", "HellaSwag accuracy", 100.0, "C4",
          {"marker": "o", "markersize": 3, "linewidth": 1.2})
    # a chart of an earlier log this one has nothing for (a GPU run's mfu.png under a CPU run's charts) would pass
    # for this run's: said, not deleted (the folder may be the user's)
    stale = [name for name in CHART_FILES if out / name not in written and (out / name).exists()]
    if stale and warn is not None:
        logs = "these logs have" if several else "this log has"
        warn(f"{out}: {', '.join(stale)} left from an earlier plot; {logs} nothing to chart in them")
    return written
