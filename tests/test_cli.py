"""The command line: bad input gets one line naming the file or flag, a non-zero exit and no traceback;
nothing already saved is touched. And a tiny end-to-end run with a checkpoint and a sample."""
import numpy as np
import pytest
import torch

from llmpy.checkpoint import load_llmc
from llmpy.data import write_shard

from cli_helpers import assert_one_line_error, llmpy

TINY = "layers=1,channels=16,heads=2,seq=32,vocab=257"




@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng()
    train = tmp_path / "tiny_train_000000.bin"
    val = tmp_path / "tiny_val_000000.bin"
    write_shard(train, rng.integers(0, 257, 5000))
    write_shard(val, rng.integers(0, 257, 2000))
    return train, val


def test_tiny_run_trains_writes_checkpoint_and_log(tmp_path, shards):
    train, val = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-j", val, "-e", TINY, "-b", 2, "-t", 16, "-x", 6, "-v", 3, "-m", 2,
                "-g", 8, "-o", out, "-l", 1e-2, "--progress", 0)
    assert res.returncode == 0, res.stderr
    assert "step     6/6" in res.stdout and "val loss" in res.stdout and "sample at step 6" in res.stdout
    config, flat, version = load_llmc(out / "model_00000006.bin")
    # fp32 (version 3) on the CPU; where `llmpy train` picks a GPU it trains and saves bf16 (version 5)
    assert version == (5 if torch.cuda.is_available() else 3)
    assert config.num_layers == 1 and flat.isfinite().all()
    assert (out / "DONE_00000006").exists()
    log = (out / "main.log").read_text().splitlines()
    assert "s:6 trl:" in log[-2] or any(l.startswith("s:6 trl:") for l in log)
    # the checkpoint samples through `llmpy sample`
    res = llmpy("sample", out / "model_00000006.bin", "--prompt", "def ", "-g", 5)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("def ")


def test_bad_shard_magic(tmp_path, shards):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(np.arange(300, dtype=np.int32).tobytes())
    assert_one_line_error(llmpy("train", "-i", bad, "-e", TINY, "-b", 2, "-t", 16, "-x", 1), "bad.bin", "magic")


def test_truncated_shard(tmp_path, shards):
    train, _ = shards
    cut = tmp_path / "cut.bin"
    cut.write_bytes(train.read_bytes()[:-10])
    assert_one_line_error(llmpy("train", "-i", cut, "-e", TINY, "-b", 2, "-t", 16, "-x", 1), "cut.bin")


def test_token_id_beyond_the_vocab(tmp_path):
    big = tmp_path / "big.bin"
    write_shard(big, np.full(2000, 300))
    assert_one_line_error(llmpy("train", "-i", big, "-e", TINY, "-b", 2, "-t", 16, "-x", 1), "big.bin", "300")


def test_batch_larger_than_the_shard(shards):
    train, _ = shards
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY, "-b", 500, "-t", 16, "-x", 1), train.name)


def test_sequence_longer_than_the_context(shards):
    train, _ = shards
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 64, "-x", 1), "-t 64", "32")


def test_unknown_descriptor_and_flag(shards):
    train, _ = shards
    assert_one_line_error(llmpy("train", "-i", train, "-e", "d13", "-x", 1), "d13")
    assert_one_line_error(llmpy("train", "--no-such-flag", "3"), "--no-such-flag")
    assert_one_line_error(llmpy("train", "-zz", "3"), "-z")  # llm.c-style: -zz reads as -z with value z
    assert_one_line_error(llmpy("train", "-w", "7", "-i", train, "-e", TINY), "-w 7")


def test_attention_flag_takes_every_path(shards):
    """--attention accepts each of the model's paths (the flag's check and the dispatcher share one list);
    a GPU-only path on the CPU ends in one line from the model, an unknown name in one line from the flag."""
    from llmpy.config import ATTENTION_IMPLS
    from llmpy.errors import LlmpyError
    from llmpy.trainer import TrainOptions

    for impl in ("auto",) + ATTENTION_IMPLS:
        TrainOptions(attention=impl).validate()
    with pytest.raises(LlmpyError, match=r"--attention nope: must be one of auto, classic, flash, cudnn, cudnn\+flash"):
        TrainOptions(attention="nope").validate()
    train, _ = shards
    # the kernel model on the CPU runs in Triton's interpreter: set it here too, for a GPU machine's run
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-s", 0, "-g", 0,
                "--device", "cpu", "--engine", "kernels", "--attention", "cudnn+flash",
                env={"TRITON_INTERPRET": "1"})
    assert_one_line_error(res, "attention 'cudnn+flash' needs a CUDA device")


def test_wrong_model_file(tmp_path, shards):
    train, _ = shards
    assert_one_line_error(llmpy("train", "-i", train, "-e", train, "-x", 1), train.name, "token shard")


def test_output_dir_that_cannot_be_written(tmp_path, shards):
    train, _ = shards
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-o", blocker / "out"),
                          "-o", "file")
    assert blocker.read_text() == "not a folder"


def test_nothing_written_when_the_run_fails_at_start(tmp_path, shards):
    train, _ = shards
    out = tmp_path / "keep"
    out.mkdir()
    (out / "model_00000005.bin").write_bytes(b"earlier run")
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 64, "-x", 1, "-o", out)
    assert res.returncode != 0
    assert sorted(p.name for p in out.iterdir()) == ["model_00000005.bin"]
    assert (out / "model_00000005.bin").read_bytes() == b"earlier run"


def test_model_file_of_the_wrong_precision(tmp_path, shards):
    """llm.c's rule: a bf16 (version 5) model file does not load into an fp32 run (the CPU trains in fp32)."""
    import torch

    from llmpy.checkpoint import save_llmc
    from llmpy.config import parse_descriptor
    train, _ = shards
    cfg = parse_descriptor(TINY)
    model = tmp_path / "tiny_bf16.bin"
    save_llmc(model, cfg, torch.randn(cfg.num_parameters) * 0.02, dtype="bfloat16")
    assert_one_line_error(llmpy("train", "-i", train, "-e", model, "-b", 2, "-t", 16, "-x", 1, "--device", "cpu"),
                          "tiny_bf16.bin", "bf16")


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    """An allocation failure (here a CUDA out-of-memory raised inside the step) ends in one line with advice."""
    import torch

    from llmpy import cli, trainer

    def boom(opts, log=print):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
    monkeypatch.setattr(trainer, "train", boom)
    assert cli.main(["train", "-x", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0] and "-b" in err[0] and "6.00 GiB" in err[0]


def test_tensorboard_events_match_the_jsonl_log(tmp_path, shards):
    """With the tensorboard package installed (a test extra), the run's scalars are also TensorBoard events."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train, val = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-j", val, "-e", TINY, "-b", 2, "-t", 16, "-x", 4, "-v", 2, "-m", 1, "-g", 0,
                "-o", out, "--progress", 0)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "main.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    train_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    val_loss = {e.step: e.value for e in acc.Scalars("val/loss")}
    for r in records:
        table = train_loss if r["kind"] == "train" else val_loss
        assert abs(table[r["step"]] - r["loss"]) < 1e-6 * max(1.0, abs(r["loss"]))
    assert sorted(train_loss) == [1, 2, 3, 4] and sorted(val_loss) == [0, 2, 4]
    assert {e.step for e in acc.Scalars("train/lr")} == {1, 2, 3, 4}
