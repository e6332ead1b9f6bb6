"""`llmpy plot DIR`: PNG charts of a run from its main.jsonl (the trainer's RunLog).

One chart per quantity: loss (train raw + smoothed, validation), learning rate, gradient norm, and
tokens/s and MFU when the log carries them ("tok_s", "mfu"; MFU is a fraction, drawn in percent).
matplotlib is an optional dependency (`pip install matplotlib`, or the `plot` extra), imported only here.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .errors import LlmpyError

LOG_NAME = "main.jsonl"
NUMERIC_KEYS = ("loss", "norm", "lr", "ms", "skipped", "tok_s", "mfu", "accuracy")
KINDS = ("train", "val", "eval")  # eval: HellaSwag accuracy (-h 1)
# what the charts draw, by kind: a log without any of it has nothing to plot
CHARTED = {"train": ("loss", "lr", "norm", "tok_s", "mfu"), "val": ("loss",), "eval": ("accuracy",)}


def add_arguments(parser: argparse.ArgumentParser):
    parser.description = "Draw PNG charts of a training run from DIR/main.jsonl."
    parser.add_argument("run_dir", metavar="DIR", help="the run's output directory (train -o), holding main.jsonl")
    parser.add_argument("-o", "--output", default=None, help="folder for the PNGs (default: DIR/plots)")
    parser.add_argument("--smooth", type=float, default=0.9,
                        help="EMA weight of the smoothed train loss, in [0, 1) (default: 0.9)")


def run(args: argparse.Namespace) -> int:
    paths = plot_run(args.run_dir, args.output, smooth=args.smooth,
                     warn=lambda msg: print(f"llmpy plot: note: {msg}", file=sys.stderr))
    for p in paths:
        print(p)
    return 0


# ---------------------------------------------------------------------------------------------------
# reading the log

def read_log(path) -> list[dict]:
    """The records of a main.jsonl; a bad line is an LlmpyError naming its line number.

    A run appends to its log, so a resumed or repeated run logs some steps again: the last record of
    each (kind, step) wins, and the result is sorted by step. A last line without its newline that does not
    parse is a record still being written (a live run) or cut off (a killed one): it is left out.
    """
    path = Path(path)
    if not path.is_file():
        raise LlmpyError(f"{path}: no such file")
    latest: dict[tuple[str, int], dict] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not line.strip():
                raise LlmpyError(f"{where}: empty line")
            try:
                rec = json.loads(line)
            except ValueError as e:
                if not line.endswith("\n"):  # only the last line can lack it
                    break
                raise LlmpyError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise LlmpyError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            step, kind = rec.get("step"), rec.get("kind")
            if isinstance(step, bool) or not isinstance(step, int):
                raise LlmpyError(f"{where}: 'step' must be an integer, got {step!r}")
            if kind not in KINDS:
                raise LlmpyError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
            for key in NUMERIC_KEYS:  # other keys a later trainer adds are carried, not checked
                if key in rec and not _is_number(rec[key]):
                    raise LlmpyError(f"{where}: '{key}' must be a number, got {rec[key]!r}")
            latest[(kind, step)] = rec
    if not latest:
        raise LlmpyError(f"{path}: empty log (no steps yet)")
    return sorted(latest.values(), key=lambda r: (r["step"], r["kind"] != "train"))


def _is_number(v) -> bool:
    # "skipped" is a JSON bool (bool is an int subclass); null stands for a value not measured
    return isinstance(v, (int, float)) or v is None


def series(records: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the records of `kind` that have it (None and missing left out)."""
    xs, ys = [], []
    for r in records:
        if r["kind"] == kind and r.get(key) is not None:
            xs.append(r["step"])
            ys.append(float(r[key]))
    return xs, ys


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

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise LlmpyError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display needed (servers, CI)
    import matplotlib.pyplot as plt
    return plt


def plot_run(run_dir, out_dir=None, smooth: float = 0.9, warn=None) -> list[Path]:
    """Write the charts of run_dir/main.jsonl as PNGs into out_dir (default run_dir/plots); returns their paths.

    A log with nothing to chart is an LlmpyError; one without any loss gets a line through `warn`, if given.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise LlmpyError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise LlmpyError(f"{run_dir} is not a directory (give the run's output directory)")
    log = run_dir / LOG_NAME
    if not log.is_file():
        raise LlmpyError(f"{run_dir}: no {LOG_NAME} in it (was it written by `llmpy train -o`?)")
    records = read_log(log)
    if not 0.0 <= smooth < 1.0:
        raise LlmpyError(f"--smooth {smooth}: must be in [0, 1)")
    if not any(series(records, kind, key)[0] for kind, keys in CHARTED.items() for key in keys):
        # checked before the plot folder is made, so a failed plot leaves none behind
        raise LlmpyError(f"{log}: {len(records)} record(s) but none with a loss, learning rate, gradient norm, "
                         "tok_s, mfu or accuracy: nothing to plot")
    if warn is not None and not any(series(records, kind, "loss")[0] for kind in ("train", "val")):
        warn(f"{log}: no loss values in it, so no loss chart")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    if out.exists() and not out.is_dir():
        raise LlmpyError(f"{out} exists and is not a directory")
    plt = _pyplot()
    from .checkpoint import atomic_path, writable_dir
    writable_dir(out, "plot folder")
    title = run_dir.resolve().name
    written = []

    def save(fig, name):
        path = out / name
        try:  # under a temp name, renamed when whole: a full disk leaves the earlier chart as it was
            with atomic_path(path) as tmp:
                fig.savefig(tmp, dpi=110, format="png")
        except OSError as e:  # matplotlib's and PIL's errors name no file
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        finally:
            plt.close(fig)
        written.append(path)

    def new(ylabel, what):
        fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {what}")
        ax.grid(True, alpha=0.3)
        return fig, ax

    # loss: raw train faint, smoothed train, validation as markers + line
    tx, ty = series(records, "train", "loss")
    vx, vy = series(records, "val", "loss")
    if tx or vx:
        fig, ax = new("loss", "loss")
        if tx:
            ax.plot(tx, ty, color="C0", alpha=0.25, linewidth=0.8, label="train")
            if len(tx) > 1 and smooth > 0:
                ax.plot(tx, ema(ty, smooth), color="C0", linewidth=1.6, label=f"train (EMA {smooth:g})")
            skipped = [(r["step"], r["loss"]) for r in records
                       if r["kind"] == "train" and r.get("skipped") and r.get("loss") is not None]
            if skipped:
                ax.scatter(*zip(*skipped), color="C3", marker="x", zorder=3, label="skipped update")
        if vx:
            ax.plot(vx, vy, color="C1", marker="o", markersize=3, linewidth=1.4, label="val")
        ax.legend()
        save(fig, "loss.png")

    for key, fname, ylabel, what, scale, logy in (
            ("lr", "lr.png", "learning rate", "learning rate", 1.0, False),
            ("norm", "grad_norm.png", "gradient norm", "gradient norm (before clipping)", 1.0, True),
            ("tok_s", "tokens_per_s.png", "tokens / s", "throughput", 1.0, False),
            ("mfu", "mfu.png", "MFU (%)", "model FLOPs utilization", 100.0, False)):
        xs, ys = series(records, "train", key)
        if not xs:
            continue  # the log does not carry this quantity (older trainer, CPU run): no chart
        fig, ax = new(ylabel, what)
        ax.plot(xs, [y * scale for y in ys], color="C2", linewidth=1.2)
        if logy and all(y > 0 for y in ys if math.isfinite(y)) and any(math.isfinite(y) for y in ys):
            ax.set_yscale("log")  # norms span orders of magnitude early in training
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        save(fig, fname)
    xs, ys = series(records, "eval", "accuracy")
    if xs:
        fig, ax = new("accuracy (%)", "HellaSwag accuracy")
        ax.plot(xs, [100 * y for y in ys], color="C4", marker="o", markersize=3, linewidth=1.2)
        save(fig, "hellaswag.png")
    return written
