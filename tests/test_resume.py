"""Training-state checkpoints and -y 1: a run stopped after step k and resumed gives the uninterrupted
run's losses bit for bit (CPU reference); bad resumes, damaged files, a full disk and signals end in one
line naming what is wrong, with every earlier checkpoint left loadable."""
import errno
import json
import os
import re
import shutil
import time
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import pytest

from llmpy import trainer, training_state
from llmpy.errors import LlmpyError
from llmpy.data import write_shard
from llmpy.outliers import OutlierDetector
from llmpy.trainer import TrainOptions, train
from llmpy.training_state import checkpoint_steps, latest_complete_step, load_checkpoint, model_path, state_path

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = "layers=1,channels=16,heads=2,seq=32,vocab=257"


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    train_f, val_f = tmp_path / "t_train_000000.bin", tmp_path / "t_val_000000.bin"
    write_shard(train_f, rng.integers(0, 257, 3000))
    write_shard(val_f, rng.integers(0, 257, 600))
    return train_f, val_f


def options(shards, out, **kw):
    train_f, val_f = shards
    base = dict(train_data=str(train_f), val_data=str(val_f), model=TINY, batch_size=2, seq_len=16, max_steps=12,
                val_every=4, val_max_steps=2, sample_every=0, gen_tokens=0, output_dir=str(out), learning_rate=1e-2,
                warmup_steps=2, final_lr_frac=0.1, lr_schedule="cosine", progress=0, device="cpu")
    base.update(kw)
    return TrainOptions(**base)


def quiet(_line):
    pass


def way_back(step: int, earlier: int) -> str:
    """What an error about a damaged checkpoint of `step` adds when an earlier one is there to resume from."""
    return (f"; move model_{step:08d}.bin and state_{step:08d}.safetensors away to resume from the checkpoint of step "
            f"{earlier}")


def stop_after(k, sig=signal.SIGTERM):
    """A log function that signals this process when step k's line is printed: the run stops there as it
    would when a scheduler preempts it."""
    def log(line):
        m = re.match(r"step\s+(\d+)/", line)  # the step lines, not "step k: skipped the update"
        if m and int(m.group(1)) == k:
            os.kill(os.getpid(), sig)
    return log


def logged(out, kind="train"):
    """step -> last logged record of that kind in main.jsonl (a resume may repeat steps after a crash)."""
    recs = {}
    for line in (Path(out) / "main.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == kind:
            recs[r["step"]] = r
    return recs


def assert_same_run(a, b, steps=12):
    ta, tb = logged(a), logged(b)
    assert sorted(ta) == sorted(tb) == list(range(1, steps + 1))
    for s in ta:  # bitwise: the JSON floats are Python's repr, exact round trips
        assert ta[s]["loss"] == tb[s]["loss"], (s, ta[s]["loss"], tb[s]["loss"])
        assert ta[s]["norm"] == tb[s]["norm"] and ta[s]["lr"] == tb[s]["lr"] and ta[s]["skipped"] == tb[s]["skipped"]
        assert ta[s]["loss_z"] == tb[s]["loss_z"] and ta[s]["norm_z"] == tb[s]["norm_z"], s
    va, vb = logged(a, "val"), logged(b, "val")
    # b may hold more (a shorter first leg validates at its own end); every one of a's must match
    assert va.keys() <= vb.keys() and all(va[s]["loss"] == vb[s]["loss"] for s in va)
    # and the final weights are the same bits
    assert model_path(a, steps).read_bytes() == model_path(b, steps).read_bytes()


@pytest.mark.parametrize("extra", [{}, {"total_batch_size": 64}, {"skip_loss_z": 0.3, "skip_grad_z": 0.3}],
                         ids=["plain", "accum2", "outliers"])
def test_interrupted_and_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, shards, monkeypatch, extra):
    # a short window so the detectors score (and decide, with -sl/-sg) in 12 steps, and their state matters
    monkeypatch.setattr(trainer, "OutlierDetector", lambda: OutlierDetector(window=3))
    full, part = tmp_path / "full", tmp_path / "part"
    ref = train(options(shards, full, checkpoint_every=3, **extra), log=quiet)
    assert ref.stopped_by is None and len(ref.train_losses) == 12

    first = train(options(shards, part, checkpoint_every=3, **extra), log=stop_after(5))
    assert first.stopped_by == "SIGTERM" and first.last_step == 5
    assert latest_complete_step(part) == 5 and (part / "DONE_00000005").exists()  # llm.c's: a whole pair
    second = train(options(shards, part, checkpoint_every=3, resume=1, **extra), log=quiet)
    assert second.start_step == 5 and len(second.train_losses) == 7
    assert first.train_losses + second.train_losses == ref.train_losses
    assert_same_run(full, part)
    assert (part / "DONE_00000012").exists()
    if "skip_loss_z" in extra:
        assert any(r["skipped"] for r in logged(full).values())


def z_scores(values, window):
    """The oracle: each value's z-score against the last `window` values, itself included (population std), from
    the first value that finds the window full (llm.c's detector)."""
    out = [None] * min(window, len(values))
    for i in range(window, len(values)):
        w = np.array(values[i + 1 - window:i + 1], dtype=np.float64)
        out.append(float((w[-1] - w.mean()) / w.std()))
    return out


def test_every_step_is_scored_and_a_run_resumed_with_sl_starts_with_full_windows(tmp_path, shards, monkeypatch):
    # the detectors were fed only with -sl/-sg: the step line had no z-scores, and a run resumed with -sl from a
    # checkpoint of a run without it started with empty windows, unprotected for the next 128 steps
    monkeypatch.setattr(trainer, "OutlierDetector", lambda: OutlierDetector(window=3))
    out, lines = tmp_path / "out", []
    first = train(options(shards, out, checkpoint_every=5, max_steps=5), log=lines.append)
    recs = logged(out)
    for key, value in (("loss_z", "loss"), ("norm_z", "norm")):
        want = z_scores([recs[s][value] for s in range(1, 6)], 3)
        got = [recs[s][key] for s in range(1, 6)]
        assert got[:3] == [None] * 3 and got[3:] == pytest.approx(want[3:], rel=1e-9, abs=1e-12), key
    step_lines = [line for line in lines if re.match(r"step\s+\d+/", line)]
    assert len(step_lines) == 5 and "z)" not in step_lines[2]
    assert f"loss {first.train_losses[4]:.6f} ({recs[5]['loss_z']:+.2f}z) | norm " in step_lines[4]
    assert f" ({recs[5]['norm_z']:+.2f}z) | lr " in step_lines[4]
    # resumed with -sl: step 6 is scored against steps 4 and 5 of the first leg
    train(options(shards, out, max_steps=7, resume=1, skip_loss_z=50.0), log=quiet)
    recs = logged(out)
    want = z_scores([recs[s]["loss"] for s in range(1, 8)], 3)
    assert [recs[s]["loss_z"] for s in (6, 7)] == pytest.approx(want[5:], rel=1e-9, abs=1e-12)


def test_a_resumed_run_lets_go_of_the_state_it_loaded(tmp_path, shards, monkeypatch):
    # the loaded state's tensors (about 16 bytes a parameter, on every rank) stayed referenced for the whole run,
    # after the model had copied them
    import gc
    import weakref
    out = tmp_path / "out"
    train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    loaded = []
    load = training_state.load_checkpoint

    def load_and_watch(out_dir, step):
        state = load(out_dir, step)
        loaded.extend(weakref.ref(t) for t in state.tensors.values())
        return state
    monkeypatch.setattr(training_state, "load_checkpoint", load_and_watch)
    alive = []

    def log(line):
        if line.startswith("step     6/"):
            gc.collect()
            alive.extend(ref() is not None for ref in loaded)
    train(options(shards, out, max_steps=6, checkpoint_every=2, resume=1), log=log)
    assert len(loaded) >= 3 and alive == [False] * len(loaded)


def test_short_run_continued_with_a_larger_x(tmp_path, shards):
    # the brief's form: -x 6 -n 3, then -y 1 -x 12 (a constant rate, so the schedule does not depend on -x)
    full, part = tmp_path / "full", tmp_path / "part"
    train(options(shards, full, lr_schedule="constant", warmup_steps=0), log=quiet)
    train(options(shards, part, lr_schedule="constant", warmup_steps=0, max_steps=6, checkpoint_every=3), log=quiet)
    res = train(options(shards, part, lr_schedule="constant", warmup_steps=0, max_steps=12, resume=1), log=quiet)
    assert res.start_step == 6
    assert_same_run(full, part)


def test_state_file_contents(tmp_path, shards):
    out = tmp_path / "o"
    train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    st = load_checkpoint(out, 2)
    meta = st.meta
    assert meta["step"] == 2 and meta["total_steps"] == 4 and meta["model_file"] == "model_00000002.bin"
    assert meta["format_version"] == training_state.STATE_FORMAT_VERSION and meta["llmpy_version"]
    assert meta["options"]["batch_size"] == 2 and meta["options"]["config"]["channels"] == 16
    assert meta["data"]["window_pos"] == 2 and set(meta["outliers"]) == {"loss", "grad"}
    assert {"params", "m", "v"} <= set(st.tensors) and st.tensors["m"].abs().sum() > 0


def test_keep_last_and_major_checkpoints(tmp_path, shards):
    out = tmp_path / "o"
    train(options(shards, out, max_steps=8, checkpoint_every=1, checkpoints_keep=2, major_checkpoint_every=3,
                  val_every=0), log=quiet)
    models = sorted(p.name for p in out.glob("model_*.bin"))
    states = sorted(p.name for p in out.glob("state_*.safetensors"))
    assert models == [f"model_{s:08d}.bin" for s in (3, 6, 7, 8)]
    assert states == [f"state_{s:08d}.safetensors" for s in (3, 6, 7, 8)]
    # llm.c writes DONE after every checkpoint and deletes it with the pair
    assert sorted(p.name for p in out.glob("DONE_*")) == [f"DONE_{s:08d}" for s in (3, 6, 7, 8)]


def test_keep_last_counts_only_complete_checkpoints(tmp_path, shards):
    # a lone model file of a later step (a run killed while writing it, then resumed with -y 1) must not count as one
    # of the last -nk checkpoints: it used to push out every complete one, the run's own last among them
    out = tmp_path / "o"
    train(options(shards, out, max_steps=6, checkpoint_every=3, val_every=0), log=quiet)
    shutil.copy(model_path(out, 6), model_path(out, 9))
    shutil.copy(state_path(out, 3), state_path(out, 2))  # a lone older file: a crash's leftover, pruned with the rest
    train(options(shards, out, max_steps=8, checkpoint_every=1, checkpoints_keep=1, val_every=0, resume=1), log=quiet)
    assert latest_complete_step(out) == 8
    load_checkpoint(out, 8)
    left = sorted(p.name for p in out.iterdir() if p.name.startswith(("model_", "state_")))
    assert left == ["model_00000008.bin", "model_00000009.bin", "state_00000008.safetensors"], left


def test_resume_ignores_an_incomplete_pair(tmp_path, shards):
    out = tmp_path / "o"
    train(options(shards, out, max_steps=6, checkpoint_every=3), log=quiet)
    # a model file without its state, and a state that names another step: neither is complete
    shutil.copy(model_path(out, 6), model_path(out, 9))
    shutil.copy(model_path(out, 6), model_path(out, 8))
    shutil.copy(state_path(out, 6), state_path(out, 8))
    assert latest_complete_step(out) == 6
    lines = []
    res = train(options(shards, out, max_steps=7, resume=1), log=lines.append)
    assert res.start_step == 6 and len(res.train_losses) == 1
    assert ("note: -y 1 resumes from step 6, the latest complete checkpoint; the newer model_00000008.bin, "
            "model_00000009.bin, state_00000008.safetensors (no matching pair) will be replaced if the run "
            "checkpoints those steps") in lines


def test_nothing_to_do_when_the_checkpoint_reaches_x(tmp_path, shards):
    out = tmp_path / "o"
    train(options(shards, out, max_steps=3), log=quiet)
    before = (out / "main.jsonl").read_text()
    res = train(options(shards, out, max_steps=3, resume=1), log=quiet)
    assert res.train_losses == [] and (out / "main.jsonl").read_text() == before


# ---------------------------------------------------------------------------------------------------
# errors: one line (LlmpyError) naming what is wrong, nothing damaged

@pytest.fixture
def saved(tmp_path, shards):
    out = tmp_path / "o"
    train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    return out


def snapshot(out):
    """Every file under the output folder (TensorBoard's events folder included) and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("change, needles", [
    ({"model": "layers=1,channels=32,heads=2,seq=32,vocab=257"}, ["channels=16", "channels=32"]),
    ({"model": "layers=2,channels=16,heads=2,seq=32,vocab=257"}, ["num_layers=1", "num_layers=2"]),
    ({"batch_size": 4}, ["-b 2", "-b 4"]),
    ({"seq_len": 8}, ["-t 16", "-t 8"]),
    ({"total_batch_size": 64}, ["accumulation 1", "2"]),
    # checked before -t and the data, which were blamed against the -e model that the run would not train
    ({"model": "layers=1,channels=16,heads=2,seq=8,vocab=257"}, ["max_seq_len=32", "max_seq_len=8"]),
    ({"model": "layers=1,channels=16,heads=2,seq=32,vocab=50"}, ["vocab_size=257", "vocab_size=50"]),
], ids=["channels", "layers", "B", "T", "accum", "context", "vocab"])
def test_resume_with_a_different_run_is_refused(saved, shards, change, needles):
    before = snapshot(saved)
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1, **change), log=quiet)
    msg = str(e.value)
    assert "\n" not in msg and "model_00000004.bin" in msg
    for n in needles:
        assert n in msg, (n, msg)
    assert snapshot(saved) == before


def test_resume_with_other_data_names_the_shards_and_both_i(saved, shards, tmp_path):
    # "data loader state was saved with shards='7cd4e73979626334', this run has shards='5cac483a9d4b450b'"
    other = tmp_path / "other" / "o_train_000000.bin"
    other.parent.mkdir()
    write_shard(other, np.random.default_rng().integers(0, 257, 2000))
    before = snapshot(saved)
    state = saved / "state_00000004.safetensors"
    with pytest.raises(LlmpyError, match=rf"^-y 1: {re.escape(str(state))}: the position was saved over other shards "
                                         r"than these 1 \(o_train_000000\.bin \.\.\.; 1 then, told apart by name and "
                                         rf"token count\): resume with the data that run trained on \(its run had -i "
                                         rf"{re.escape(str(shards[0]))}, this one -i {re.escape(str(other))}\)$"):
        train(options((other, shards[1]), saved, max_steps=6, resume=1), log=quiet)
    assert snapshot(saved) == before


def test_resume_with_changed_settings_says_which(saved, shards):
    # a schedule's or the outlier detectors' settings may change on resume (llm.c allows it), but not unsaid
    lines = []
    train(options(shards, saved, max_steps=6, resume=1, learning_rate=5e-3, skip_loss_z=3.0, overfit_single_batch=1),
          log=lines.append)
    # -x too: raised to train further, a decaying schedule stretches (the saved run ended at 4)
    note = "note: resuming with changed settings (-l 0.01 -> 0.005, -a 0 -> 1, -sl 0.0 -> 3.0, -x 4 -> 6: the " \
        "cosine schedule now decays over -x 6)"
    assert note in lines
    # after the run's header, beside the line naming the checkpoint (it came before the header)
    at = lines.index(note)
    assert lines[at - 1].startswith("resuming from model_00000004.bin") and lines[0].startswith("llmpy train |")
    lines.clear()
    train(options(shards, saved, max_steps=7, resume=1, lr_schedule="constant"), log=lines.append)
    # -q 1: a schedule that ends where it starts does not stretch either
    state, notes = load_checkpoint(saved, 4), []
    opts = options(shards, saved, max_steps=9, resume=1, final_lr_frac=1.0, dtype="float32", engine="reference")
    trainer._check_resume(state, opts, state.config, 1, notes.append, steps=9)
    assert notes == ["note: resuming with changed settings (-q 0.1 -> 1.0, -x 4 -> 9)"]
    # from that run's checkpoint at 6: a constant schedule does not stretch
    assert "note: resuming with changed settings (-l 0.005 -> 0.01, -k cosine -> constant, -a 1 -> 0, -sl 3.0 -> " \
        "0.0, -x 6 -> 7)" in lines


def test_resume_notes_a_change_of_the_runs_length_not_of_its_x_flag(tmp_path, shards):
    """-x -1 on resume keeps the checkpoint's length, and -x equal to a one-epoch run's steps is that run's length:
    both were noted as "-x A -> B: the cosine schedule now decays over -x B", a change that did not happen."""
    out = tmp_path / "o"
    whole = train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    for p in out.glob("*_00000004*"):
        p.unlink()
    lines = []
    res = train(options(shards, out, max_steps=-1, resume=1), log=lines.append)
    assert res.start_step == 2 and res.last_step == 4 and res.train_losses == whole.train_losses[2:]
    assert not [line for line in lines if "changed settings" in line], lines
    # a run of one epoch (-x -1), resumed with -x its steps, then with more
    epoch = tmp_path / "epoch"
    train(options(shards, epoch, max_steps=-1, checkpoint_every=50, val_every=0), log=quiet)
    state = load_checkpoint(epoch, 50)
    steps = state.meta["total_steps"]
    assert state.meta["options"]["max_steps"] == -1 and steps == (3000 - 1) // 32  # windows of B*T + 1 tokens
    notes = []
    for max_steps in (steps, steps + 7):
        opts = options(shards, epoch, max_steps=max_steps, resume=1, val_every=0, dtype="float32", engine="reference")
        trainer._check_resume(state, opts, state.config, 1, notes.append, steps=max_steps)
    assert notes == [f"note: resuming with changed settings (-x -1 ({steps} steps) -> {steps + 7}: the cosine schedule "
                     f"now decays over -x {steps + 7})"]


def test_resume_given_another_model_file_says_it_keeps_the_checkpoints_weights(saved, shards, tmp_path):
    other = tmp_path / "other.bin"
    shutil.copyfile(saved / "model_00000004.bin", other)  # the same shape, so the resume is allowed
    lines = []
    res = train(options(shards, saved, max_steps=6, resume=1, model=str(other)), log=lines.append)
    assert res.start_step == 4
    assert f"note: -y 1 continues from the weights of model_00000004.bin; -e {other} is not read for them" in lines


def test_resume_removes_the_temporaries_of_a_killed_run(saved, shards):
    from llmpy.files import ORPHAN_MIN_AGE_S
    orphan = saved / ".state_00000005.safetensors.999999999.0123abcd.tmp"  # pid beyond any kernel's pid_max
    orphan.write_bytes(b"half a state file")
    os.utime(orphan, (time.time() - ORPHAN_MIN_AGE_S - 1,) * 2)
    lines = []
    train(options(shards, saved, max_steps=6, resume=1), log=lines.append)
    assert f"note: removed 1 temporary file(s) in {saved} left by a killed llmpy process" in lines
    assert not orphan.exists()


@pytest.mark.parametrize("locks", [True, False])
def test_a_run_holding_its_folders_lock_removes_a_new_checkpoint_temporary(saved, shards, monkeypatch, locks):
    # a job preempted mid-checkpoint and restarted at once left its GB-sized temporary: only one 10 minutes old went
    fresh = [saved / f".{name}.{pid}.0123abcd.tmp" for name, pid in (("state_00000005.safetensors", 999999999),
                                                                      ("model_00000005.bin", 1), ("DONE_00000005", 1))]
    other = saved / ".notes.txt.999999999.0123abcd.tmp"  # not the run's: another writer's, maybe still at work
    for path in fresh + [other]:
        path.write_bytes(b"half a file")
    if not locks:  # a file system without locks: nothing keeps another run's writer out, so its files stay
        import fcntl

        def no_locks(f, op):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        monkeypatch.setattr(fcntl, "flock", no_locks)
    lines = []
    train(options(shards, saved, max_steps=6, resume=1), log=lines.append)
    assert [p.exists() for p in fresh] == [not locks] * 3 and other.exists()
    removed = [line for line in lines if line.startswith("note: removed")]
    assert removed == ([f"note: removed 3 temporary file(s) in {saved} left by a killed llmpy process"] if locks
                       else [])


def test_a_full_disk_while_logging_names_the_log(saved, shards, monkeypatch):
    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(trainer.RunLog, "_write", full_disk)
    with pytest.raises(LlmpyError, match=f"cannot write the log in {re.escape(str(saved))}: No space left"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_at_the_logs_last_flush_names_the_log(saved, shards, capfd):
    # the real buffered files on a device that is always full: the write's error, not the one closing the file
    # raises again as it flushes what is still buffered, is the run's one line
    (saved / "main.log").unlink()
    (saved / "main.log").symlink_to("/dev/full")
    with pytest.raises(LlmpyError, match=f"cannot write the log in {re.escape(str(saved))}: No space left"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("fails_from", [1, 4], ids=["first-event", "mid-run"])
def test_a_full_disk_under_tensorboards_thread_is_one_line(tmp_path, shards, monkeypatch, capfd, fails_from):
    # TensorBoard writes its events on a thread of its own: its failure (at the file's first event, or a later one)
    # must not print that thread's traceback, and reaches the run as the same one line
    from tensorboard.summary.writer.record_writer import RecordWriter
    real_write, writes = RecordWriter.write, []

    def full_disk_from(self, data):
        writes.append(len(data))
        if len(writes) >= fails_from:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)
    monkeypatch.setattr(RecordWriter, "write", full_disk_from)
    hook_before = threading.excepthook
    out = tmp_path / "o"
    with pytest.raises(LlmpyError, match=f"cannot write the log in {re.escape(str(out))}: No space left"):
        train(options(shards, out, max_steps=6), log=quiet)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert len(writes) >= fails_from and threading.excepthook is hook_before


def test_resume_without_a_checkpoint_starts_the_run(tmp_path, shards):
    # llm.c's -y 1: with nothing in -o yet the same command starts the run (and would resume it later)
    fresh = train(options(shards, tmp_path / "fresh", max_steps=4), log=quiet)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "missing"):
        lines = []
        res = train(options(shards, out, max_steps=4, resume=1), log=lines.append)
        assert res.train_losses == fresh.train_losses and res.start_step == 0
        assert f"-y 1: no checkpoint in {out} yet: starting from step 0" in lines
        assert latest_complete_step(out) == 4


def test_a_new_run_never_overwrites_a_runs_checkpoints(tmp_path, shards):
    # without -y 1, an -o holding checkpoints is refused before anything is written (llm.c would overwrite them)
    out = tmp_path / "out"
    train(options(shards, out, max_steps=4), log=quiet)
    before = snapshot(out)
    with pytest.raises(LlmpyError, match=r"-o .*out holds the checkpoints of a run \(model_00000004\.bin.*-y 1"):
        train(options(shards, out, max_steps=4, learning_rate=3e-3), log=quiet)
    assert snapshot(out) == before


def test_resume_after_a_record_cut_off_keeps_the_logs_readable(tmp_path, shards):
    # killed while writing a record: the resumed run drops the partial line instead of gluing its first record to it
    from llmpy.plot import read_log
    out = tmp_path / "out"
    train(options(shards, out, max_steps=4), log=quiet)
    for name, partial in (("main.jsonl", '{"step": 5, "kind": "tr'), ("main.log", "s:5 trl:5.4")):
        with open(out / name, "a") as f:
            f.write(partial)
    train(options(shards, out, max_steps=6, resume=1), log=quiet)
    steps = [(r["step"], r["kind"]) for r in read_log(out / "main.jsonl")]
    assert [s for s, kind in steps if kind == "train"] == [1, 2, 3, 4, 5, 6]
    lines = (out / "main.log").read_text().splitlines()
    assert all(re.fullmatch(r"s:\d+ (tel:\d+\.\d{6}|trl:\d+\.\d{6} lr:\d+\.\d{6} norm:\d+\.\d{2})", line)
               for line in lines), lines
    assert lines[-1].startswith("s:6 ")


def test_tensorboard_draws_a_re_run_step_once(tmp_path, shards):
    # a run killed after step 5, whose last checkpoint is step 4: the resumed run trains steps 5 and 6 again, and
    # TensorBoard drew the first run's step 5 next to the new one (the JSONL log's readers keep the last record)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "out"
    train(options(shards, out, max_steps=5, checkpoint_every=2, lr_schedule="constant", warmup_steps=0),
          log=quiet)
    for path in (model_path(out, 5), state_path(out, 5), out / "DONE_00000005"):
        path.unlink()  # killed before step 5's checkpoint
    res = train(options(shards, out, max_steps=6, checkpoint_every=2, lr_schedule="constant", warmup_steps=0,
                        resume=1), log=quiet)
    assert res.start_step == 4
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    points = acc.Scalars("train/loss")
    assert [p.step for p in points] == [1, 2, 3, 4, 5, 6]
    assert [p.value for p in points[4:]] == pytest.approx(res.train_losses)  # the resumed run's, not the first's


def test_resume_refuses_the_remains_of_a_run(tmp_path, shards):
    # a model file without its state (a run stopped while writing): resuming from scratch would overwrite it
    out = tmp_path / "out"
    train(options(shards, out, max_steps=4), log=quiet)
    state_path(out, 4).unlink()
    before = snapshot(out)
    with pytest.raises(LlmpyError, match=r"no complete checkpoint .*model_00000004\.bin.*move those files away"):
        train(options(shards, out, max_steps=6, resume=1), log=quiet)
    assert snapshot(out) == before


@pytest.mark.parametrize("damage", ["truncate_state", "flip_state", "truncate_model", "flip_model"])
def test_damaged_checkpoint_is_named(saved, shards, damage):
    target = state_path(saved, 4) if damage.endswith("state") else model_path(saved, 4)
    data = bytearray(target.read_bytes())
    if damage.startswith("truncate"):
        target.write_bytes(bytes(data[:len(data) - 100]))
    else:
        data[-50] ^= 0xFF  # a byte inside the last tensor
        target.write_bytes(bytes(data))
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert target.name in str(e.value) and "\n" not in str(e.value)
    # the line says how to go on (it said so only for damaged metadata, and -y 1 never falls back by itself) ...
    assert str(e.value).endswith(way_back(4, 2))
    (saved / "damaged").mkdir()
    for path in (model_path(saved, 4), state_path(saved, 4)):
        path.rename(saved / "damaged" / path.name)
    assert train(options(shards, saved, max_steps=6, resume=1), log=quiet).start_step == 2
    # ... and, with no earlier checkpoint, says nothing of one
    for step in (2, 4, 6):
        for path in (model_path(saved, step), state_path(saved, step)):
            path.unlink(missing_ok=True)
    for path in (saved / "damaged").iterdir():
        path.rename(saved / path.name)
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert target.name in str(e.value) and "move" not in str(e.value)


@pytest.mark.parametrize("name", ["m", "params"])
def test_a_tensor_whose_dtype_was_damaged_is_named(saved, shards, name):
    # F32 -> I32 in the header keeps every size and every checksum of the bytes: the state loaded as integers
    spath = state_path(saved, 4)
    data = spath.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = data[8:8 + header_len]
    entry = f'"{name}":{{"dtype":"F32"'.encode()
    assert header.count(entry) == 1
    spath.write_bytes(data[:8] + header.replace(entry, entry.replace(b"F32", b"I32")) + data[8 + header_len:])
    with pytest.raises(LlmpyError, match=rf"^.*state_00000004\.safetensors: tensor '{name}' is int32, not float32 "
                                         r"or bfloat16: the file is damaged" + re.escape(way_back(4, 2)) + "$"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)


@pytest.mark.parametrize("key, value", [("checksums", [1]), ("options", None), ("rng", 5), ("data", "x"),
                                        ("outliers", []), ("total_steps", "12"), ("step", 4.0)])
def test_state_metadata_of_the_wrong_shape_is_named(saved, shards, key, value):
    """Valid JSON of the wrong shape (an edited file): one line naming the file and the entry."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    spath = state_path(saved, 4)
    with safe_open(str(spath), framework="pt") as f:
        meta = json.loads(f.metadata()[training_state.META_KEY])
    meta[key] = value
    save_file(load_file(str(spath)), str(spath), metadata={training_state.META_KEY: json.dumps(meta)})
    before = snapshot(saved)
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert f"{spath}: malformed training-state metadata ('{key}' should be" in str(e.value)
    assert "\n" not in str(e.value) and snapshot(saved) == before


def _rewrite_meta(spath, edit):
    """Rewrite a state file's llmpy metadata as `edit(meta)` returns it: a table with a checksum of its own (a
    deliberate edit, which the checksum cannot catch), a str as it is."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(spath), framework="pt") as f:
        meta = json.loads(f.metadata()[training_state.META_KEY])
    raw = edit(meta)
    if not isinstance(raw, str):
        raw = json.dumps({**raw, training_state.META_CRC_KEY: training_state._meta_crc(raw)})
    save_file(load_file(str(spath)), str(spath), metadata={training_state.META_KEY: raw})


@pytest.mark.parametrize("seeds", ["x", [1.5], [True], [2**64], {"a": 1}], ids=["str", "float", "bool", "big", "dict"])
def test_malformed_rounding_seeds_are_named(saved, shards, seeds):
    spath = state_path(saved, 4)
    _rewrite_meta(spath, lambda meta: {**meta, "rng": {**meta["rng"], "sr_seeds": seeds}})
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert str(e.value).startswith(f"{spath}: malformed training-state metadata ('rng.sr_seeds' should be a list")


def test_a_state_without_its_parameters_is_named(saved, shards):
    # the checksums cover the tensors a file holds: one re-saved without "params" passes them
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    spath = state_path(saved, 4)
    with safe_open(str(spath), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(spath))
    del tensors["params"]
    save_file(tensors, str(spath), metadata=metadata)
    with pytest.raises(LlmpyError, match=re.escape(f"{spath}: no parameters 'params' tensor")):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)


def test_a_wrong_count_of_rounding_seeds_names_the_state_file(tmp_path, shards, device):
    # the kernel model's stochastic rounding resumes from one seed a call site: another count is a foreign state
    # (the kernels run where the suite runs them: the GPU, with a head size every attention path takes, else
    # Triton's interpreter)
    out = tmp_path / "o"
    kernel_run = dict(engine="kernels", dtype="bfloat16", val_every=0, device=device,
                      model=GPU_MODEL if device == "cuda" else TINY)
    train(options(shards, out, max_steps=2, **kernel_run), log=quiet)
    spath = state_path(out, 2)
    _rewrite_meta(spath, lambda meta: {**meta, "rng": {**meta["rng"], "sr_seeds": [1]}})
    with pytest.raises(LlmpyError, match=re.escape(f"{spath}: checkpoint has 1 rounding seeds, the model ")):
        train(options(shards, out, max_steps=4, resume=1, **kernel_run), log=quiet)


@pytest.mark.parametrize("key, value, what", [
    ("batch_size", "2", "an integer"), ("seed", "42", "an integer"), ("seed", 42.0, "an integer"),
    ("grad_accumulation", True, "an integer"), ("learning_rate", "x", "a finite number"),
    ("skip_loss_z", None, "a finite number"), ("dtype", 32, "text"), ("model", 5, "text or null"),
    ("config", [1], "a table"), ("config.channels", "16", "an integer"),
], ids=["B-str", "seed-str", "seed-float", "accum-bool", "lr-str", "sl-null", "dtype-int", "model-int", "config-list",
        "channels-str"])
def test_saved_options_of_the_wrong_type_are_named(saved, shards, key, value, what):
    """A "2" where 2 belongs was "saved with -b 2 but this run has -b 2"; a learning rate "x" resumed with a note."""
    spath = state_path(saved, 4)

    def edit(meta):
        *tables, leaf = ["options"] + key.split(".")
        target = meta
        for t in tables:
            target = target[t]
        target[leaf] = value
        return meta
    _rewrite_meta(spath, edit)
    before = snapshot(saved)
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert str(e.value) == (f"{spath}: malformed training-state metadata ('options.{key}' should be {what}, not "
                            f"{json.dumps(value)}){way_back(4, 2)}")
    assert snapshot(saved) == before


def test_deeply_nested_state_metadata_is_one_line(saved, shards):
    # json's decoder recurses: '[' * 100000 was a RecursionError traceback
    spath = state_path(saved, 4)
    _rewrite_meta(spath, lambda meta: "[" * 100000)
    before = snapshot(saved)
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(spath))}: corrupt training-state metadata \(maximum "
                                         r"recursion depth exceeded[^\n]*\)" + re.escape(way_back(4, 2)) + "$"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert snapshot(saved) == before


def test_a_state_file_that_is_not_a_file_says_so(saved, shards):
    # a directory was "corrupt or truncated training state (No such device (os error 19))"; a pipe blocked
    spath = state_path(saved, 4)
    spath.unlink()
    spath.mkdir()
    before = snapshot(saved)
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(spath))} is a directory, not a training-state file"
                                         + re.escape(way_back(4, 2)) + "$"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    spath.rmdir()
    os.mkfifo(spath)
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(spath))}: not a regular file, so not a training-state "
                                         r"file" + re.escape(way_back(4, 2)) + "$"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert snapshot(saved) == before


def test_a_checkpoints_non_finite_model_file_is_named(saved, shards):
    # a model file whose weights are NaN (an edited one, its checksum recomputed) is named at load, not at step 5
    mpath, spath = model_path(saved, 4), state_path(saved, 4)
    data = bytearray(mpath.read_bytes())
    data[2000:2004] = np.float32(np.nan).tobytes()  # in wte
    mpath.write_bytes(bytes(data))
    crc = training_state._file_crc(mpath)
    _rewrite_meta(spath, lambda meta: {**meta, "checksums": {**meta["checksums"], "model_file": crc}})
    before = snapshot(saved)
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(mpath))}: tensor wte holds NaN or inf values"):
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert snapshot(saved) == before


def _assert_previous_checkpoint_intact(out, shards):
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert not model_path(out, 4).exists() and not state_path(out, 4).exists()
    assert latest_complete_step(out) == 2
    load_checkpoint(out, 2)  # verifies every checksum
    res = train(options(shards, out, max_steps=4, resume=1), log=quiet)  # and the run can go on
    assert res.start_step == 2 and latest_complete_step(out) == 4


def test_disk_full_while_writing_the_state(tmp_path, shards, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError
    out = tmp_path / "o"
    real = safetensors.torch.save_file
    calls = []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the second checkpoint: half a file, then safetensors' own error, as on a full disk
            Path(filename).write_bytes(b"\0" * 1000)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(LlmpyError, match="No space left") as e:
        train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    assert "\n" not in str(e.value) and "step 4" in str(e.value)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    _assert_previous_checkpoint_intact(out, shards)
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask()) for p in out.glob("state_*"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_disk_full_while_writing_the_model_file(tmp_path, shards, monkeypatch):
    import llmpy.checkpoint as ck
    out = tmp_path / "o"
    real = ck._write_tensor
    calls = []

    def full_disk(f, tensor, dtype="float32"):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, tensor, dtype)
    monkeypatch.setattr(ck, "_write_tensor", full_disk)
    with pytest.raises(LlmpyError, match="No space left"):
        train(options(shards, out, max_steps=4, checkpoint_every=2), log=quiet)
    monkeypatch.setattr(ck, "_write_tensor", real)
    _assert_previous_checkpoint_intact(out, shards)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_and_restores_handlers(tmp_path, shards, sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "o"
    lines = []
    log = stop_after(2, sig)
    res = train(options(shards, out), log=lambda l: (lines.append(l), log(l)))
    assert res.stopped_by == sig.name and res.last_step == 2
    assert any(f"stopped by {sig.name} after step 2/12" in l for l in lines)
    assert latest_complete_step(out) == 2
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def _signal_at(pattern, sig=signal.SIGTERM, nth=1):
    """A log function that signals this process at the nth line that matches `pattern`, and keeps the lines."""
    lines = []

    def log(line):
        lines.append(line)
        if re.match(pattern, line) and sum(bool(re.match(pattern, seen)) for seen in lines) == nth:
            os.kill(os.getpid(), sig)
    return log, lines


def test_a_signal_in_the_last_step_saves_and_skips_the_final_validation_and_sample(tmp_path, shards):
    """The last step's signal was read by no one: the final validation and sample ran on (for minutes with -m -1
    or a long -g), the run ended with status 0, and a scheduler's SIGTERM went unanswered."""
    out = tmp_path / "o"
    log, lines = _signal_at(r"step\s+4/4")
    res = train(options(shards, out, max_steps=4, gen_tokens=4), log=log)
    assert res.stopped_by == "SIGTERM" and res.last_step == 4 and res.sample is None
    assert res.val_losses == [(0, res.val_losses[0][1])]  # step 0's only
    assert f"stopped by SIGTERM at the end of the run (4/4 steps trained): checkpoint of step 4 in {out}; the final " \
        "validation and sample skipped" in lines
    assert latest_complete_step(out) == 4 and not [line for line in lines if line.startswith("--- sample")]


def test_a_signal_in_the_final_validation_saves_and_skips_the_sample(tmp_path, shards, monkeypatch):
    out = tmp_path / "o"
    log, lines = _signal_at("val loss", signal.SIGINT, nth=2)  # the first is step 0's, the second the final one
    res = train(options(shards, out, max_steps=1, gen_tokens=4), log=log)
    assert res.stopped_by == "SIGINT" and res.last_step == 1 and res.sample is None
    assert f"stopped by SIGINT at the end of the run (1/1 steps trained): checkpoint of step 1 in {out}; the final " \
        "sample skipped" in lines
    assert latest_complete_step(out) == 1
    # the run's checkpoint written, only its sample left: a signal stops that at once
    from llmpy import sampler
    real = sampler.generate

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(sampler, "generate", signalled)
    with pytest.raises(KeyboardInterrupt):
        train(options(shards, tmp_path / "p", max_steps=2, gen_tokens=4), log=quiet)
    assert latest_complete_step(tmp_path / "p") == 2


def test_sigterm_to_the_command_line_then_resume(tmp_path, shards):
    train_f, _ = shards
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "llmpy", "train", "-i", train_f, "-e", TINY, "-b", 2, "-t", 16, "-v", 0, "-s", 0,
            "-g", 0, "-k", "constant", "-o", out, "--progress", 0]
    proc = subprocess.Popen([str(a) for a in args + ["-x", 100000]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped by SIGTERM" in rest
    k = latest_complete_step(out)
    assert k is not None and k >= 1 and max(out.glob("DONE_*")).name == f"DONE_{k:08d}"
    load_checkpoint(out, k)
    res = subprocess.run([str(a) for a in args + ["-x", k + 2, "-y", 1]], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"step {k + 1:5d}/{k + 2}" in res.stdout and f"step {k:5d}/" not in res.stdout
    assert latest_complete_step(out) == k + 2 and (out / f"DONE_{k + 2:08d}").exists()


def test_gpu_backend_state_round_trip(device):
    """GPUBackend's state (bf16 working weights, fp32 master weights, m, v, stochastic-rounding seeds)
    comes back bit for bit; on a machine without a GPU GPT2Model runs its kernels in Triton's interpreter."""
    import torch
    from llmpy.config import parse_descriptor
    from llmpy.init import init_parameters
    from llmpy.model import GPT2Model
    from llmpy.trainer import GPUBackend
    cfg = parse_descriptor(TINY)
    params = init_parameters(cfg, seed=1)

    def backend(seed):
        b = object.__new__(GPUBackend)  # its __init__ insists on cuda; the state methods do not care
        b.model = GPT2Model(cfg, params, 2, 16, device=device, dtype=torch.bfloat16, master_weights=True,
                            seed=seed, cuda_graph=False)
        b.config = cfg
        return b
    a, b = backend(1), backend(2)
    md = a.model
    md.master_memory.add_(torch.randn_like(md.master_memory) * 1e-3)
    md.params_memory.copy_((md.master_memory + 1e-4).to(torch.bfloat16))  # not the RNE of the master
    md.m_memory.normal_()
    md.v_memory.uniform_()
    md._advance_seeds()
    tensors, seeds = a.state_tensors(), a.seed_state()
    assert tensors["params"].dtype == torch.bfloat16 and tensors["master"].dtype == torch.float32
    b.load_state(tensors, seeds)
    for name in ("master_memory", "params_memory", "m_memory", "v_memory", "_seeds"):
        assert torch.equal(getattr(a.model, name), getattr(b.model, name)), name


GPU_MODEL = "layers=2,channels=128,heads=2,seq=32,vocab=257"  # head size 64: every attention path works


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, {"total_batch_size": 64, "master_weights": 0}], ids=["plain", "accum2-w0"])
def test_gpu_interrupted_and_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, shards, monkeypatch, extra):
    """The GPU path (bf16 weights, fp32 master weights or stochastic rounding, the whole-step CUDA graph):
    the stopped-and-resumed run gives the uninterrupted run's losses and weights bit for bit."""
    monkeypatch.setattr(trainer, "OutlierDetector", lambda: OutlierDetector(window=3))  # z-scores in 12 steps
    gpu = dict(device="cuda", dtype="bfloat16", model=GPU_MODEL, checkpoint_every=3, **extra)
    full, part = tmp_path / "full", tmp_path / "part"
    ref = train(options(shards, full, **gpu), log=quiet)
    first = train(options(shards, part, **gpu), log=stop_after(5))
    assert first.stopped_by == "SIGTERM" and first.last_step == 5
    second = train(options(shards, part, resume=1, **gpu), log=quiet)
    assert second.start_step == 5
    assert first.train_losses + second.train_losses == ref.train_losses
    assert_same_run(full, part)


# ---------------------------------------------------------------------------------------------------
# the metadata's own checksum: a changed digit keeps the JSON valid and resumed another run silently

def _damaged_meta_message(spath) -> str:
    step = int(spath.name[len("state_"):-len(".safetensors")])
    earlier = max(s for s in checkpoint_steps(spath.parent) if s < step)
    return f"{spath}: its metadata fails its checksum (damaged){way_back(step, earlier)}"


def _meta_digit_offsets(data: bytes) -> list[int]:
    """Offsets in a state file's bytes of the digits of its llmpy metadata (a JSON string in the safetensors
    header), but the format version's: another version is named as another format, not as damage."""
    header = data[8:8 + int.from_bytes(data[:8], "little")]
    start = header.index(f'"{training_state.META_KEY}":"'.encode()) + len(training_state.META_KEY) + 4
    end = start
    while header[end:end + 1] != b'"':  # the string's closing quote: the metadata's own are escaped (\")
        end += 2 if header[end:end + 1] == b"\\" else 1
    version = re.compile(rb'\\"format_version\\": *(\d+)').search(header, start, end).span(1)
    return [8 + i for i in range(start, end) if header[i:i + 1].isdigit() and not version[0] <= i < version[1]]


def test_a_digit_changed_in_the_state_metadata_is_named(saved, shards):
    spath = state_path(saved, 4)
    data = bytearray(spath.read_bytes())
    original = training_state._read_meta(spath)
    rng = np.random.default_rng()
    at = int(rng.choice(_meta_digit_offsets(bytes(data))))
    # 1-9 only: a leading digit turned 0 ("10" -> "00") would no longer be JSON
    data[at] = ord(str(rng.choice([d for d in "123456789" if ord(d) != data[at]])))
    spath.write_bytes(bytes(data))
    where = bytes(data[max(at - 30, 0):at + 10])  # what was changed, for a failure's message
    from safetensors import safe_open
    # still a readable file of valid JSON, one value changed (the fixture's numbers are short: a float's 17th digit
    # can change without changing its value, which is no damage)
    with safe_open(str(spath), framework="pt") as f:
        assert json.loads(f.metadata()[training_state.META_KEY]) != original, where
    before = snapshot(saved)
    for read in (lambda: latest_complete_step(saved), lambda: load_checkpoint(saved, 4),
                 lambda: train(options(shards, saved, max_steps=6, resume=1), log=quiet)):
        with pytest.raises(LlmpyError) as e:
            read()
        assert str(e.value) == _damaged_meta_message(spath), where
    assert snapshot(saved) == before


def test_a_changed_data_position_is_named_and_the_intact_state_still_resumes_bitwise(tmp_path, shards):
    # the report: window_pos 4 -> 5 resumed with another loss at the next step (5.5449 for 5.5602), no error
    full, part, damaged = tmp_path / "full", tmp_path / "part", tmp_path / "damaged"
    train(options(shards, full, checkpoint_every=3), log=quiet)
    assert train(options(shards, part, checkpoint_every=3), log=stop_after(5)).last_step == 5
    shutil.copytree(part, damaged)
    spath = state_path(damaged, 5)
    data = spath.read_bytes()
    pos = re.search(rb'\\"window_pos\\": (\d+)', data)
    width, rng = len(pos.group(1)), np.random.default_rng()
    other = pos.group(1)
    while other == pos.group(1):  # another position of as many digits: the header keeps its length
        other = str(rng.integers(10 ** (width - 1) if width > 1 else 0, 10 ** width)).encode()
    spath.write_bytes(data[:pos.start(1)] + other + data[pos.end(1):])
    with pytest.raises(LlmpyError) as e:
        train(options(shards, damaged, checkpoint_every=3, resume=1), log=quiet)
    assert str(e.value) == _damaged_meta_message(spath), other
    assert train(options(shards, part, checkpoint_every=3, resume=1), log=quiet).start_step == 5
    assert_same_run(full, part)


def test_a_state_without_its_metadata_checksum_is_named(saved, shards):
    spath = state_path(saved, 4)
    _rewrite_meta(spath, lambda meta: json.dumps({k: v for k, v in meta.items() if k != training_state.META_CRC_KEY}))
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert str(e.value) == _damaged_meta_message(spath)


def test_a_version_digit_damaged_to_the_format_before_the_checksum_is_named(saved, shards):
    # version 1 files have no checksum to check, but one that has a checksum is not a version 1
    spath = state_path(saved, 4)
    _rewrite_meta(spath, lambda meta: json.dumps({**meta, "format_version": 1}))  # the checksum of version 2's
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert str(e.value) == _damaged_meta_message(spath)


def test_a_state_of_the_format_before_the_metadata_checksum_still_resumes(tmp_path, shards):
    # version 1 had no metadata checksum: a run in progress must survive the upgrade, bitwise
    full, part = tmp_path / "full", tmp_path / "part"
    train(options(shards, full, max_steps=8), log=quiet)
    train(options(shards, part, max_steps=8, checkpoint_every=4), log=stop_after(4))
    spath = state_path(part, 4)
    _rewrite_meta(spath, lambda meta: json.dumps({**{k: v for k, v in meta.items() if k != training_state.META_CRC_KEY},
                                                  "format_version": 1}))
    res = train(options(shards, part, max_steps=8, resume=1), log=quiet)
    assert res.start_step == 4
    assert_same_run(full, part, steps=8)


@pytest.mark.parametrize("version", [0, 3, "2", True, 2.0])
def test_a_state_of_an_unknown_format_version_is_refused(saved, shards, version):
    spath = state_path(saved, 4)
    _rewrite_meta(spath, lambda meta: {**meta, "format_version": version})
    before = snapshot(saved)
    with pytest.raises(LlmpyError) as e:
        train(options(shards, saved, max_steps=6, resume=1), log=quiet)
    assert str(e.value) == (f"{spath}: training-state format version {version}; this llmpy reads versions 1, 2 "
                            "(resume it with the llmpy that wrote it, or train on from its model file with -e and "
                            f"another -o){way_back(4, 2)}")
    assert snapshot(saved) == before


# ---------------------------------------------------------------------------------------------------
# what a resume reads of -e, and what it notes


def test_resume_reads_only_the_header_of_the_e_model_file_and_goes_on_without_it(tmp_path, shards, monkeypatch):
    # -e only gives a resumed run a shape to compare (the weights are the checkpoint's): the whole file was read and
    # checked, GBs for the large models, and a model file cleaned away after the run began blocked its resume
    from llmpy import checkpoint
    from llmpy.config import parse_descriptor
    init = tmp_path / "init.bin"
    checkpoint.save_llmc(init, parse_descriptor(TINY), 0.02 * torch.randn(parse_descriptor(TINY).num_parameters))
    out = tmp_path / "o"
    train(options(shards, out, model=str(init), max_steps=4, checkpoint_every=2), log=quiet)
    loaded = []
    monkeypatch.setattr(checkpoint, "load_llmc", lambda path: loaded.append(path))
    res = train(options(shards, out, model=str(init), max_steps=6, resume=1), log=quiet)
    assert res.start_step == 4 and res.last_step == 6 and loaded == []
    init.unlink()
    lines = []
    res = train(options(shards, out, model=str(init), max_steps=8, resume=1), log=lines.append)
    assert res.start_step == 6 and res.last_step == 8
    assert f"note: -y 1: -e {init} is not there; the run continues from the checkpoint's model model_00000006.bin" \
        in lines


def test_resume_notes_a_change_of_master_weights_tf32_or_engine(saved, shards, monkeypatch):
    # each changes the arithmetic, so the run is no longer the uninterrupted one: a resume said nothing
    lines = []
    train(options(shards, saved, max_steps=6, resume=1, master_weights=0, tf32=0), log=lines.append)
    assert "note: resuming with changed settings (-w 1 -> 0, -f 1 -> 0, -x 4 -> 6: the cosine schedule now decays " \
        "over -x 6)" in lines
    state = load_checkpoint(saved, 6)
    assert state.meta["options"]["engine"] == "reference"
    lines = []
    opts = options(shards, saved, max_steps=6, resume=1, master_weights=0, tf32=0, dtype="float32", engine="kernels")
    trainer._check_resume(state, opts, state.config, 1, lines.append, 1, steps=state.meta["total_steps"])
    assert lines == ["note: resuming with changed settings (engine reference -> kernels)"]


@pytest.mark.parametrize("error, note", [(errno.ENOSYS, True), (errno.ENOLCK, True), (errno.EIO, False)],
                         ids=["ENOSYS", "ENOLCK", "EIO"])
def test_a_file_system_without_locks_is_a_note_and_another_lock_error_one_line(tmp_path, shards, monkeypatch, error,
                                                                             note):
    # Lustre without -o flock, some NFS and FUSE mounts: flock fails with ENOSYS or ENOLCK, and no run could start
    import fcntl

    def no_locks(f, how):
        raise OSError(error, os.strerror(error))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "o"
    lines = []
    if note:
        res = train(options(shards, out, max_steps=2), log=lines.append)
        assert res.last_step == 2
        assert f"note: {out / '.llmpy.lock'}: the file system takes no locks ({os.strerror(error)}); nothing keeps " \
               f"a second run out of -o {out} while this one writes" in lines
    else:
        with pytest.raises(LlmpyError, match=re.escape(f"{out / '.llmpy.lock'}: cannot lock the run's folder "
                                                       f"({os.strerror(error)})")):
            train(options(shards, out, max_steps=2), log=lines.append)


def test_a_bf16_model_file_holds_the_weights_the_run_computes_with(tmp_path, shards, device):
    # llm.c writes its bf16 parameters, stochastically rounded by AdamW; the file held the master weights rounded to
    # nearest, so `-e model_N.bin` or an export reproduced neither the logged losses nor llm.c's file
    from safetensors.torch import load_file
    from llmpy.checkpoint import load_llmc
    out = tmp_path / "o"
    train(options(shards, out, max_steps=2, engine="kernels", dtype="bfloat16", master_weights=1, val_every=0,
                  device=device, model=GPU_MODEL if device == "cuda" else TINY), log=quiet)
    tensors = load_file(state_path(out, 2))
    _, in_file, version = load_llmc(model_path(out, 2))
    assert version == 5 and tensors["params"].dtype == torch.bfloat16
    assert torch.equal(in_file.view(torch.int16), tensors["params"].view(torch.int16))
    assert not torch.equal(in_file, tensors["master"].to(torch.bfloat16))  # stochastic rounding differs somewhere


def test_overfit_single_batch_trains_on_the_validation_datas_first_batch(shards, tmp_path):
    # llm.c's -a 1: one batch, the validation data's first, so the validation loss follows the training loss
    lines = []
    res = train(options(shards, tmp_path / "a", max_steps=8, val_every=1, val_max_steps=1, overfit_single_batch=1,
                        warmup_steps=0), log=lines.append)
    assert f"-a 1: every step trains on the first batch of {shards[1]}" in lines
    # before each update the same batch is validated and trained on: the same loss, step after step
    assert [loss for _, loss in res.val_losses[:8]] == res.train_losses
    assert res.train_losses[-1] < res.train_losses[0] - 0.5  # overfitting, as asked
    fresh = train(options(shards, tmp_path / "b", max_steps=1, val_every=0), log=quiet)
    assert fresh.train_losses[0] != res.train_losses[0]  # not the train data's first batch


def test_overfit_single_batch_without_validation_data_takes_the_train_datas(shards, tmp_path):
    res = train(options(shards, tmp_path / "a", max_steps=3, val_data=None, overfit_single_batch=1), log=quiet)
    fresh = train(options(shards, tmp_path / "b", max_steps=1, val_data=None), log=quiet)
    assert res.train_losses[0] == fresh.train_losses[0]
    assert res.train_losses[1] < res.train_losses[0]


@pytest.mark.parametrize("with_val", [True, False], ids=["val", "no_val"])
def test_overfit_single_batch_is_the_first_batch_under_shuffle(shards, tmp_path, with_val):
    # --shuffle reorders the epochs that -a 1 never reads: its batch is still the first one its log line names
    val = {} if with_val else {"val_data": None}
    lines = []
    res = train(options(shards, tmp_path / "a", max_steps=3, val_every=1, val_max_steps=1, overfit_single_batch=1,
                        shuffle=1, warmup_steps=0, **val), log=lines.append)
    named = shards[1] if with_val else shards[0]
    assert f"-a 1: every step trains on the first batch of {named}" in lines
    if with_val:  # the validation's first batch, which the never shuffled validation loader scores
        assert [loss for _, loss in res.val_losses[:3]] == res.train_losses
    else:
        fresh = train(options(shards, tmp_path / "b", max_steps=1, val_data=None), log=quiet)
        assert res.train_losses[0] == fresh.train_losses[0]
