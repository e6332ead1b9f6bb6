"""The command line: bad input gets one line naming the file or flag, a non-zero exit and no traceback;
nothing already saved is touched. And a tiny end-to-end run with a checkpoint and a sample."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmpy.checkpoint import load_llmc
from llmpy.data import write_shard

from cli_helpers import SRC, assert_one_line_error, llmpy

TINY = "layers=1,channels=16,heads=2,seq=32,vocab=257"


def tiny_model_file(tmp_path):
    """An llm.c model file of TINY with random weights, for the commands that read one."""
    from llmpy.checkpoint import save_llmc
    from llmpy.config import parse_descriptor
    cfg = parse_descriptor(TINY)
    model = tmp_path / "tiny.bin"
    save_llmc(model, cfg, torch.randn(cfg.num_parameters) * 0.02)
    return model


@pytest.mark.parametrize("command", ["train", "sample", "prepare", "plot", "export"])
def test_help_states_every_default_in_words(command):
    # a default decided at run time (None, "") is explained in the flag's text, never printed raw
    res = llmpy(command, "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # argparse wraps lines
    assert "usage:" in text and "(default: None)" not in text and "(default: )" not in text


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng()
    train = tmp_path / "tiny_train_000000.bin"
    val = tmp_path / "tiny_val_000000.bin"
    write_shard(train, rng.integers(0, 257, 5000))
    write_shard(val, rng.integers(0, 257, 2000))
    return train, val


def test_demo_run_takes_its_settings_unless_given(tmp_path, monkeypatch):
    # without -i and -e the run takes the demo's settings (RUN_DEFAULTS), but never over a value given,
    # even one equal to the usual default (-b 4, -l 3e-4)
    import llmpy
    from llmpy import data
    from llmpy.trainer import RUN_DEFAULTS
    files = data.default_dataset(cache_dir=tmp_path, max_bytes=100_000)
    monkeypatch.setattr(data, "default_dataset", lambda: files)
    demo = {name: cpu for name, (usual, cpu, gpu) in RUN_DEFAULTS.items()}
    for given in ({}, {"batch_size": 4, "learning_rate": 3e-4, "warmup_steps": 0}):
        lines = []
        llmpy.train(log=lines.append, device="cpu", max_steps=1, val_every=0, gen_tokens=1, **given)
        want = {**demo, **given}
        setup = next(line for line in lines if "tokens/step" in line)
        assert f"({want['batch_size'] * want['seq_len']} tokens/step)" in setup, setup
        assert f"lr {want['learning_rate']} cosine warmup {want['warmup_steps']} final x0.1" in setup, setup


def test_samples_print_as_ids_with_a_note_when_gpt2s_files_are_absent(tmp_path, monkeypatch):
    # a GPT-2-vocab run with no local tokenizer files fetches nothing: one note, samples as token ids
    import tiktoken

    import llmpy

    def fetch(name):
        raise AssertionError("tiktoken asked to fetch")
    monkeypatch.setattr(tiktoken, "get_encoding", fetch)
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    train = tmp_path / "g_train_000000.bin"
    write_shard(train, np.random.default_rng().integers(0, 50257, 2000))
    lines = []
    res = llmpy.train(log=lines.append, train_data=str(train), model="layers=1,channels=16,heads=2,seq=32",
                      batch_size=2, seq_len=16, max_steps=1, val_every=0, gen_tokens=5, device="cpu")
    note = [line for line in lines if line.startswith("note: samples print as token ids")]
    assert len(note) == 1 and "LLMPY_GPT2_DIR" in note[0], lines
    ids = res.sample.split()
    assert len(ids) == 5 and all(0 <= int(i) < 50257 for i in ids)


def test_the_cpu_reference_names_the_gpu_options_it_ignores(shards):
    import llmpy
    train, _ = shards
    for given, note in (({}, None), ({"master_weights": 0, "attention": "flash", "recompute": 2},
                                     "note: the CPU reference ignores GPU options: -w 0, -r 2, --attention flash")):
        lines = []
        llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=2, seq_len=16, max_steps=1,
                    val_every=0, gen_tokens=0, device="cpu", **given)
        assert [line for line in lines if line.startswith("note:")] == ([note] if note else []), lines


def test_checkpoint_flags_without_an_output_folder_say_nothing_is_saved(shards):
    import llmpy
    train, _ = shards
    lines = []
    llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=2, seq_len=16, max_steps=2,
                val_every=0, gen_tokens=0, device="cpu", checkpoint_every=1, checkpoints_keep=1)
    assert [line for line in lines if line.startswith("note:")] == [
        "note: -n 1, -nk 1 without -o: no checkpoints are written"]


def test_hellaswag_with_validation_off_says_it_never_runs(shards):
    import llmpy
    train, _ = shards
    lines = []
    llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=4, seq_len=16, max_steps=1,
                val_every=0, hellaswag=1, hellaswag_file="no/such/hellaswag.bin", gen_tokens=0, device="cpu")
    assert [line for line in lines if line.startswith("note:")] == [
        "note: -h 1 with -v 0: HellaSwag runs at each validation, and -v 0 turns validation off, so it never runs"]


def test_hellaswag_flags_without_h_are_noted(shards):
    # --hellaswag-file and --hellaswag-examples without -h 1 ran with no word: a forgotten -h 1 looked like a run
    # that had evaluated
    import llmpy
    train, _ = shards
    for given, note in (({"hellaswag_file": "no/such/hellaswag.bin"}, "--hellaswag-file without -h 1: HellaSwag is "
                         "off, so it goes unused"),
                        ({"hellaswag_file": "x.bin", "hellaswag_examples": 5}, "--hellaswag-file and "
                         "--hellaswag-examples without -h 1: HellaSwag is off, so they go unused"),
                        ({}, None)):
        lines = []
        llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=4, seq_len=16, max_steps=1,
                    val_every=0, gen_tokens=0, device="cpu", **given)
        assert [line for line in lines if line.startswith("note:")] == ([f"note: {note}"] if note else [])


def test_a_warmup_longer_than_the_run_is_noted(shards):
    import llmpy
    train, _ = shards
    for warmup, notes in ((10, ["note: -u 10 is more than the run's 3 steps: the warmup never ends (the learning rate "
                                "reaches 0.0003, not -l 0.001)"]), (3, [])):
        lines = []
        llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=2, seq_len=16, max_steps=3,
                    val_every=0, gen_tokens=0, device="cpu", warmup_steps=warmup, learning_rate=1e-3)
        assert [line for line in lines if line.startswith("note:")] == notes


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
    # llm.c's main.log: a train line is numbered by the updates before it (llm.c's 0-based step) and carries lr and
    # norm; a validation line by the updates before it too, so s:3 trl and s:3 tel are the same weights
    log = (out / "main.log").read_text().splitlines()
    steps = [json.loads(line) for line in (out / "main.jsonl").read_text().splitlines()]
    train_recs, val_recs = [r for r in steps if r["kind"] == "train"], [r for r in steps if r["kind"] == "val"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in val_recs] == [0, 3, 6]
    assert log == ["s:0 tel:%.6f" % val_recs[0]["loss"]] + [
        "s:%d trl:%.6f lr:%.6f norm:%.2f" % (r["step"] - 1, r["loss"], r["lr"], r["norm"]) for r in train_recs[:3]] + [
        "s:3 tel:%.6f" % val_recs[1]["loss"]] + [
        "s:%d trl:%.6f lr:%.6f norm:%.2f" % (r["step"] - 1, r["loss"], r["lr"], r["norm"]) for r in train_recs[3:]] + [
        "s:6 tel:%.6f" % val_recs[2]["loss"]]
    # the checkpoint samples through `llmpy sample`
    res = llmpy("sample", out / "model_00000006.bin", "--prompt", "def\a ", "-g", 5)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("def\\x07 ")  # a control character prints escaped, as the sample's own would


def test_samples_print_control_characters_escaped():
    from llmpy.sampler import printable

    raw = "ab\x1b[2J\rcd\n\te\x00\x7f\x9bf\u00e9\u4e2d"
    assert printable(raw) == "ab\\x1b[2J\\x0dcd\n\te\\x00\\x7f\\x9bf\u00e9\u4e2d"
    # every byte a young byte-level model can draw comes out without a control character but tab and newline
    shown = printable(bytes(range(256)).decode("latin-1"))
    assert not [c for c in shown if c not in "\t\n" and (ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0)]


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
    assert_one_line_error(llmpy("train", "-i", train, "-e", "no/such.bin", "-x", 1), "no/such.bin: no such model file")
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY + ",layers=3", "-x", 1), "layers is given twice")
    assert_one_line_error(llmpy("train", "--no-such-flag", "3"), "--no-such-flag")
    assert_one_line_error(llmpy("train", "-zz", "3"), "-z")  # llm.c-style: -zz reads as -z with value z
    assert_one_line_error(llmpy("train", "-w", "7", "-i", train, "-e", TINY), "-w 7")


@pytest.mark.parametrize("field, value, message", [
    ("learning_rate", float("nan"), "-l nan: must be a finite number"),
    ("learning_rate", float("inf"), "-l inf: must be a finite number"),
    ("final_lr_frac", float("nan"), "-q nan: must be a finite number"),
    # the schedule's own checks, made before any data, model or checkpoint loads
    ("learning_rate", -1e-3, "-l -0.001: must be >= 0"),
    ("warmup_steps", -5, "-u -5: must be >= 0 (0: no warmup)"),
    ("final_lr_frac", 1.5, "-q 1.5: the final learning-rate fraction must be between 0 and 1"),
    ("final_lr_frac", -0.1, "-q -0.1: the final learning-rate fraction must be between 0 and 1"),
    ("learning_rate", 1e38, "-l 1e+38: too large; AdamW's first step (10 x lr) must fit in float32"),
    ("weight_decay", 1e43, "-c 1e+43: too large with -l 0.0003; lr x weight decay must fit in float32"),
    ("weight_decay", -0.1, "-c -0.1: must be >= 0"),
    ("grad_clip", float("nan"), "--grad-clip nan: must be a finite number"),
    ("skip_loss_z", -1.0, "-sl -1.0: must be >= 0 (0: off)"),
    ("skip_grad_z", float("inf"), "-sg inf: must be a finite number"),
    ("temperature", -0.5, "--temperature -0.5: must be >= 0 (0: greedy)"),
    ("top_k", -2, "--top-k -2: must be >= 0 (0: all)"),
    ("val_every", -1, "-v -1: must be >= 0 (0: never)"),
    ("sample_every", -3, "-s -3: must be >= 0 (0: only at the end)"),
    ("val_max_steps", 0, "-m 0: must be positive, or -1 for the whole validation split (-v 0 turns validation off)"),
    ("val_max_steps", -2, "-m -2: must be positive, or -1 for the whole validation split (-v 0 turns validation "
                          "off)"),
    ("max_steps", 0, "-x 0: must be positive, or -1 for one epoch"),
    ("max_steps", -7, "-x -7: must be positive, or -1 for one epoch"),
    ("progress", 2, "--progress 2: must be one of -1, 0, 1"),
    ("shuffle", 3, "--shuffle 3: must be one of 0, 1"),
    ("cuda_graph", -1, "--cuda-graph -1: must be one of 0, 1"),
    ("seed", -1, "--seed -1: must be an integer from 0 to 4294967295"),
    ("seed", 2**64 - 1, "--seed 18446744073709551615: must be an integer from 0"),
    # the API's values, which argparse never sees
    ("batch_size", "2", "-b (batch_size='2'): must be an integer"),
    ("batch_size", 2.5, "-b (batch_size=2.5): must be an integer"),
    ("batch_size", True, "-b (batch_size=True): must be an integer"),
    ("model", 123, "-e (model=123): must be text (a str)"),
    ("learning_rate", "abc", "-l (learning_rate='abc'): must be a number"),
    ("seed", 1.5, "--seed (seed=1.5): must be an integer"),
])
def test_impossible_values_are_refused_before_anything_runs(field, value, message):
    """A NaN passes every `< 0` check unnoticed and an infinite rate trains NaN weights: each such value is
    refused by name, as is every value outside a flag's meanings."""
    import re

    from llmpy.errors import LlmpyError
    from llmpy.trainer import TrainOptions

    TrainOptions().validate()  # the defaults pass
    with pytest.raises(LlmpyError, match=re.escape(message)):
        TrainOptions(**{field: value}).validate()


def test_api_paths_may_be_path_objects(tmp_path):
    from llmpy.trainer import TrainOptions
    opts = TrainOptions(output_dir=tmp_path / "o", train_data=tmp_path / "x_*.bin")
    opts.validate()
    assert opts.output_dir == str(tmp_path / "o") and opts.train_data == str(tmp_path / "x_*.bin")


def test_arguments_that_are_not_utf8_are_one_line(tmp_path, shards):
    """Bytes a terminal passes that are not UTF-8 reach Python as surrogates: a prompt or an output folder
    holding them is refused up front (TensorBoard's writer and the tokenizer cannot take them)."""
    import os
    train, _ = shards
    out = os.fsdecode(bytes(tmp_path) + b"/out_\xff")
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-o", out)
    assert_one_line_error(res, "-o", "UTF-8")
    assert not os.path.exists(out)
    model = tiny_model_file(tmp_path)
    assert_one_line_error(llmpy("sample", model, "--prompt", os.fsdecode(b"ab\xff\xfe")), "--prompt",
                          "UTF-8", "\\xff")


def test_sample_with_stdout_closed_runs_quietly(tmp_path):
    """`llmpy sample ... >&-`: Python's stdout is None; the sample's first write was an AttributeError traceback
    (print writes nothing there, as the other commands' output does)."""
    from cli_helpers import SRC
    model = tiny_model_file(tmp_path)
    res = subprocess.run(f'"{sys.executable}" -m llmpy sample "{model}" -g 3 >&-', shell=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert (res.returncode, res.stderr) == (0, "")


def test_a_total_batch_beyond_the_hosts_memory_is_refused(shards, monkeypatch):
    """-d with a few zeros too many would hold millions of micro-batches on the host before the first step."""
    from llmpy import config, trainer
    from llmpy.errors import LlmpyError
    train, _ = shards
    monkeypatch.setattr(config, "host_memory_available", lambda: 10**9)
    opts = trainer.TrainOptions(train_data=str(train), model=TINY, batch_size=2, seq_len=16, max_steps=1,
                                total_batch_size=2 * 16 * 10**7, val_every=0, gen_tokens=0, progress=0)
    with pytest.raises(LlmpyError, match="-d 320000000: a step of 10,000,000 micro-batches of B=2, T=16 needs "
                                         r"[0-9.]+ GB of host memory .* the 1.0 GB available"):
        trainer.train(opts, log=lambda *_: None)
    # without accumulation the zeros are in -b (the line named a -d -1 the user never gave)
    opts = trainer.TrainOptions(train_data=str(train), model=TINY, batch_size=10**8, seq_len=16, max_steps=1,
                                val_every=0, gen_tokens=0, progress=0)
    with pytest.raises(LlmpyError, match="^-b 100000000: a step of 1 micro-batches of B=100000000, T=16 needs "):
        trainer.train(opts, log=lambda *_: None)


def test_impossible_flag_on_the_command_line(shards):
    train, _ = shards
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY, "-l", "nan", "-x", 1), "-l nan", "finite")
    assert_one_line_error(llmpy("train", "-i", train, "-e", TINY, "-m", 0, "-x", 1), "-m 0")


def test_diverging_run_stops_in_one_line_and_keeps_its_checkpoints(tmp_path, shards):
    """A learning rate of 1e30 is finite but wrecks the weights in one update: the next loss is not finite,
    the run ends in one line naming the step, and the checkpoint written before stays as it was."""
    train, _ = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 4, "-l", 1e30, "-n", 1, "-v", 0,
                "-g", 0, "-o", out, "--progress", 0)
    assert_one_line_error(res, "step 2: the loss is", "lower -l")
    assert sorted(p.name for p in out.glob("*_0000000*")) == ["DONE_00000001", "model_00000001.bin",
                                                             "state_00000001.safetensors"]
    config, flat, _ = load_llmc(out / "model_00000001.bin")
    assert config.num_layers == 1 and flat.numel() == config.num_parameters


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_rank_that_writes_no_checkpoint_makes_no_host_copies(tmp_path, device, dtype):
    # every rank joins a checkpoint's gathers, but only the writer needs the state on the CPU (about 18 bytes a
    # parameter, on every rank of a node before); the others still refuse non-finite weights with the writer
    from llmpy.config import parse_descriptor
    from llmpy.errors import LlmpyError
    from llmpy.init import init_parameters
    from llmpy.trainer import GPUBackend, TrainOptions, _save_checkpoint

    config = parse_descriptor(TINY)
    opts = TrainOptions(batch_size=2, seq_len=8, dtype=dtype)
    backend = GPUBackend(config, init_parameters(config, seed=int(torch.randint(1000, ()))), opts, device=device)
    md = backend.model
    whole = backend.state_tensors()
    kept = {"params", "master"} if dtype == "bfloat16" else {"params"}
    assert set(whole) == kept | {"m", "v"} and all(t.device.type == "cpu" for t in whole.values())
    on_device = backend.state_tensors(host=False)
    assert set(on_device) == kept  # m and v: gathered (under ZeRO-1) and dropped
    assert on_device["params"].data_ptr() == md.params_memory.data_ptr()  # no copy of what is already whole
    assert all(t.device == md.params_memory.device for t in on_device.values())
    assert torch.equal(on_device["params"].cpu(), whole["params"])
    if dtype == "bfloat16":
        assert torch.equal(on_device["master"].cpu(), whole["master"])
    (md.master_memory if md.master_memory is not None else md.params_memory)[3] = float("nan")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LlmpyError, match="step 5: the weights are not finite; no checkpoint written"):
        _save_checkpoint(out, 5, config, backend, opts, {}, write=False)
    assert list(out.iterdir()) == []


def test_no_checkpoint_of_non_finite_weights(tmp_path):
    """The update after the last loss seen can diverge unseen: _save_checkpoint refuses non-finite weights
    before writing anything (every rank checks, so none waits on a rank that stopped)."""
    from llmpy.config import parse_descriptor
    from llmpy.errors import LlmpyError
    from llmpy.trainer import TrainOptions, _save_checkpoint

    config = parse_descriptor(TINY)

    class Diverged:  # bf16 weights with fp32 master weights, which an update made NaN (the bf16 copy kept its value)
        def state_tensors(self, host=True):
            master = torch.randn(config.num_parameters)
            params = master.to(torch.bfloat16)
            master[int(torch.randint(config.num_parameters, ()))] = float("nan")
            return {"params": params, "master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master)}
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LlmpyError, match="step 7: the weights are not finite; no checkpoint written"):
        _save_checkpoint(out, 7, config, Diverged(), TrainOptions(), {})
    assert list(out.iterdir()) == []


def test_sample_command_refuses_impossible_options(tmp_path):
    model = tiny_model_file(tmp_path)
    for flag, value in (("-g", "-3"), ("--temperature", "nan"), ("--temperature", "-1"), ("--top-k", "-1"),
                        ("--seed", "-1"), ("--seed", str(2**64))):
        assert_one_line_error(llmpy("sample", model, flag, value), f"{flag} {value}")
    res = llmpy("sample", model, "-g", 5, "--temperature", 0)
    assert res.returncode == 0, res.stderr
    # a prompt beyond the context is cropped as the tokens come: said, not silent
    res = llmpy("sample", model, "-g", 2, "--prompt", "x" * 40)
    assert res.returncode == 0 and res.stderr.splitlines() == [
        "note: the prompt is 41 tokens with the end-of-text before it, and the model's context 32: each token is "
        "drawn from the last 32 only"], res.stderr


def test_sample_into_a_pipe_closed_early_stops_quietly(tmp_path):
    # `llmpy sample | head`: the reader goes away mid-sample; no error line, SIGPIPE's status as a C program's
    model = tiny_model_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "llmpy", "sample", str(model), "-g", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert len(proc.stdout.read(64)) == 64
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and err == b"", err


def test_sample_of_a_gpt2_model_reads_the_tokenizer_locally(tmp_path, shared_data):
    # GPT-2's BPE from --tokenizer-dir; without it (no $LLMPY_GPT2_DIR, an empty tiktoken cache) one line, no fetch
    from llmpy.checkpoint import save_llmc
    from llmpy.config import parse_descriptor
    gpt2_dir = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe") / "gpt2"
    cfg = parse_descriptor("layers=1,channels=16,heads=2,seq=32")
    assert cfg.vocab_size == 50257
    model = tmp_path / "gpt2_tiny.bin"
    save_llmc(model, cfg, torch.randn(cfg.num_parameters) * 0.02)
    env = {"LLMPY_GPT2_DIR": "", "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache")}
    assert_one_line_error(llmpy("sample", model, "-g", 4, env=env), "GPT-2's tokenizer files are not on this machine")
    res = llmpy("sample", model, "-g", 4, "--prompt", "Hello", "--tokenizer-dir", gpt2_dir, env=env)
    assert res.returncode == 0 and res.stdout.startswith("Hello"), res.stderr


def test_sampling_from_non_finite_logits_is_one_clear_error():
    from llmpy.errors import LlmpyError
    from llmpy.sampler import sample_next

    logits = torch.randn(300)
    assert 0 <= sample_next(logits, 257, torch.Generator().manual_seed(1)) < 257
    logits[5] = float("inf")
    for temperature in (1.0, 0.0):
        with pytest.raises(LlmpyError, match="logits are not finite"):
            sample_next(logits, 257, torch.Generator().manual_seed(1), temperature=temperature)


def test_a_tiny_temperature_samples_among_the_largest_logits():
    """logits / 1e-45 overflow float32: the sample is then greedy's limit, one of the tied largest, never NaN."""
    from llmpy.sampler import sample_next

    logits = torch.randn(300)
    top = int(logits[:257].argmax())
    for temperature in (1e-45, 1e-320, 5e-324):
        for top_k in (0, 3):
            assert sample_next(logits, 257, torch.Generator().manual_seed(1), temperature, top_k) == top
    logits[[7, 11]] = logits.max() + 1  # two tied maxima: each drawn, nothing else
    drawn = {sample_next(logits, 257, torch.Generator().manual_seed(s), 1e-45) for s in range(40)}
    assert drawn == {7, 11}


def test_sample_streams_whole_characters_as_they_come():
    """sample_text's on_text pieces: whole UTF-8 characters although their bytes come one token at a time, joined
    equal to the continuation it returns; bytes that cannot complete a character are let out, as U+FFFD, as soon as
    that is certain, and an incomplete character at the end as one U+FFFD after the last token."""
    from types import SimpleNamespace
    from llmpy.sampler import sample_text
    from llmpy.tokenizer import ByteTokenizer

    script = list("héllo, wörld € 𝄞!".encode()) + [0xE2, 0x41] + [0xF0] * 4 + [0x42, 0xF0, 0x9D]

    class Scripted:  # logits that make greedy sampling follow the script
        config = SimpleNamespace(vocab_size=257, max_seq_len=64)

        def logits_last(self, contexts):
            row = torch.randn(257)
            row[script[len(contexts[0]) - 1]] = 100.0  # context = end-of-text + what came so far
            return row[None]
    pieces = []
    text = sample_text(Scripted(), ByteTokenizer(), "", gen_tokens=len(script), temperature=0, on_text=pieces.append)
    assert text == bytes(script).decode("utf-8", errors="replace") and "".join(pieces) == text
    # E2 then A; F0 four times (each broken by the next), then B; F0 9D, cut off by the sample's end
    assert [p for p in pieces if "\ufffd" in p] == ["\ufffdA"] + ["\ufffd"] * 3 + ["\ufffdB", "\ufffd"]
    assert "€" in pieces and "𝄞" in pieces  # three and four bytes, one piece each


def test_final_checkpoint_is_written_before_the_final_sample(tmp_path, shards, monkeypatch):
    import llmpy
    from llmpy import sampler
    train, _ = shards

    def broken_sampler(*args, **kwargs):
        raise RuntimeError("the sampler failed")
    monkeypatch.setattr(sampler, "generate", broken_sampler)
    with pytest.raises(RuntimeError, match="the sampler failed"):
        llmpy.train(log=lambda *_: None, train_data=str(train), model=TINY, batch_size=2, seq_len=16, max_steps=2,
                    val_every=0, gen_tokens=4, output_dir=str(tmp_path / "out"), device="cpu")
    assert sorted(p.name for p in (tmp_path / "out").glob("*_00000002*")) == [
        "DONE_00000002", "model_00000002.bin", "state_00000002.safetensors"]


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


def test_train_to_an_output_that_cannot_encode_a_path(tmp_path, shards):
    # stdout in ASCII (PYTHONIOENCODING, a Latin-1 locale): the data's path (or a sample's character) escaped, where
    # it ended the run in a UnicodeEncodeError traceback
    train, _ = shards
    named = train.rename(tmp_path / "donn\u00e9es_train_000000.bin")
    res = llmpy("train", "-i", named, "-e", TINY, "-b", 2, "-t", 16, "-x", 2, "-v", 0, "-s", 1, "-g", 8,
                "--device", "cpu", env={"PYTHONIOENCODING": "ascii"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "donn\\xe9es_train_000000.bin" in res.stdout


def test_paths_after_name_equals_read_a_leading_tilde_as_home(tmp_path, shards):
    # the shell leaves --name=~/x as it is: llmpy reads ~ as the home folder there too, as prepare does
    train, val = shards
    home = tmp_path / "home"
    (home / "d").mkdir(parents=True)
    for f in (train, val):
        f.rename(home / "d" / f.name)
    res = llmpy("train", f"--train-data=~/d/{train.name}", f"--val-data=~/d/{val.name}", "--output-dir=~/run",
                "-e", TINY, "-b", 2, "-t", 16, "-x", 2, "-v", 1, "-m", 1, "-s", 0, "-g", 0, "--device", "cpu",
                env={"HOME": str(home)}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (home / "run" / "main.log").is_file() and not (tmp_path / "~").exists()
    assert_one_line_error(llmpy("train", "--output-dir=~nosuchuser_llmpy/run", "-i", home / "d" / train.name,
                                "-e", TINY, "-x", 1), "-o: ~nosuchuser_llmpy/run: no home folder")


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
    res = llmpy("train", "-i", train, "-e", model, "-b", 2, "-t", 16, "-x", 1, "--device", "cpu")
    assert_one_line_error(res, "tiny_bf16.bin is a bf16 model file and the CPU reference trains in fp32", "export")
    # the way out it names: the fp32 HuggingFace export trains
    assert llmpy("export", model, tmp_path / "hf").returncode == 0
    res = llmpy("train", "-i", train, "-e", tmp_path / "hf", "-b", 2, "-t", 16, "-x", 1, "--device", "cpu", "-v", 0)
    assert res.returncode == 0, res.stderr


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


def test_the_cpu_allocators_failure_is_out_of_memory_in_one_line(monkeypatch, capsys):
    """torch's CPU allocator raises a plain RuntimeError, which ended in its traceback like a bug."""
    import torch

    from llmpy import cli, trainer

    def boom(opts, log=print):
        torch.empty(1 << 60, dtype=torch.uint8)  # an exabyte: no host has it
    monkeypatch.setattr(trainer, "train", boom)
    assert cli.main(["train", "-x", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmpy train: error: out of memory (DefaultCPUAllocator: can't "
                                               "allocate memory: you tried to allocate 1152921504606846976 bytes"), err
    assert "-b" in err[0]


def test_the_cpu_references_activations_beyond_the_hosts_memory_are_refused(monkeypatch):
    """-b too large for the reference's activations passed the batches' check and died in the first forward."""
    from llmpy import config, trainer
    from llmpy.errors import LlmpyError
    cfg = config.parse_descriptor(TINY)
    floats, logits = trainer._reference_step_floats(cfg, 64, 16)
    # the logits, their softmax and gradient dominate at this width
    assert logits == 3 * 64 * 16 * cfg.padded_vocab_size and floats > logits
    need = 4 * floats + 8 * cfg.num_parameters + (8 * (64 * 16 + 1) + 1536 + 16 * 64 * 16)
    opts = trainer.TrainOptions(model=TINY, batch_size=64, seq_len=16, max_steps=1, val_every=0, gen_tokens=0,
                                progress=0, device="cpu")
    monkeypatch.setattr(config, "host_memory_available", lambda: need - 1)
    with pytest.raises(LlmpyError, match=rf"^-b 64: a step of the CPU reference at B=64, T=16 needs at least "
                                         rf"{need / 1e9:.1f} GB of host memory \(its activations, "
                                         rf"{4 * logits / 1e9:.1f} GB of them the logits, their softmax and "
                                         r"gradient\), more than the 0\.0 GB available; lower -b"):
        trainer.train(opts, log=lambda *_: None)
    monkeypatch.setattr(config, "host_memory_available", lambda: need)  # enough: it trains
    assert len(trainer.train(opts, log=lambda *_: None).train_losses) == 1


def test_system_error_is_one_line(monkeypatch, capsys):
    """A read or write the system refuses mid-run (here a full disk at a checkpoint) ends in one line
    naming the file, not a traceback."""
    import errno

    from llmpy import cli, trainer

    def full_disk(opts, log=print):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/state_00000100.safetensors")
    monkeypatch.setattr(trainer, "train", full_disk)
    assert cli.main(["train", "-x", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["llmpy train: error: /runs/x/state_00000100.safetensors: No space left on device"]


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


def test_each_train_record_counts_the_tokens_trained_on(tmp_path, shards):
    # what `llmpy plot -x tokens` runs along: step * B * T * accumulation (* processes)
    train, _ = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-d", 96, "-x", 3, "-v", 0, "-g", 0, "-o", out,
                "--progress", 0)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "main.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens"]) for r in records if r["kind"] == "train"] == [(1, 96), (2, 192), (3, 288)]


def test_z_scores_reach_the_step_line_tensorboard_and_the_log_once_the_window_is_full(tmp_path, shards):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train, val = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-j", val, "-e", TINY, "-b", 2, "-t", 16, "-x", 130, "-v", 0, "-g", 0,
                "-o", out, "--progress", 0)
    assert res.returncode == 0, res.stderr
    records = {r["step"]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())
               if r["kind"] == "train"}
    # the window of 128 is full from the 129th value on
    assert all(records[s]["loss_z"] is None and records[s]["norm_z"] is None for s in range(1, 129))
    assert all(isinstance(records[s][key], float) for s in (129, 130) for key in ("loss_z", "norm_z"))
    line = next(x for x in res.stdout.splitlines() if x.startswith("step   130/130"))
    assert f"({records[130]['loss_z']:+.2f}z) | norm " in line and f"({records[130]['norm_z']:+.2f}z) | lr" in line
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    for key, tag in (("loss_z", "train/loss_z"), ("norm_z", "train/grad_norm_z")):
        events = {e.step: e.value for e in acc.Scalars(tag)}
        assert sorted(events) == [129, 130]
        assert all(abs(events[s] - records[s][key]) < 1e-5 * max(1.0, abs(records[s][key])) for s in events)


def test_llmpys_warnings_print_as_one_note_line(tmp_path):
    """A model file's unusual setting is worth a word, in llmpy's one-line form, not Python's file:line and
    source line."""
    from safetensors.torch import load_file, save_file

    from llmpy.checkpoint import save_hf
    from llmpy.config import parse_descriptor
    cfg = parse_descriptor("layers=1,channels=128,heads=2,seq=32,vocab=257")
    save_hf(tmp_path / "hf", cfg, torch.randn(cfg.num_parameters) * 0.02)
    # the weights alone, as a hub copy without its config.json: the heads are a guess (head size 64)
    weights = tmp_path / "hf" / "model.safetensors"
    (tmp_path / "hf" / "config.json").unlink()
    save_file(load_file(weights), weights, metadata={"format": "pt"})
    res = llmpy("sample", weights, "-g", 3, "--temperature", 0)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines() == [f"llmpy sample: note: {weights}: no config.json beside it: 2 heads "
                                               "assumed (GPT-2's head size 64)"]


def test_commands_that_need_no_torch_do_not_load_it(tmp_path):
    # plot, prepare and the help load only their own module: no half a GB and second of torch import
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "main.jsonl").write_text('{"step": 1, "kind": "train", "loss": 3.5, "lr": 0.001}\n')
    (tmp_path / "text.txt").write_text("some text to tokenize, twice over. " * 20)
    script = (
        "import sys\n"
        "from llmpy import cli\n"
        "from importlib.util import find_spec\n"
        "for argv in [[], ['--help'], ['plot', '--help'], ['prepare', sys.argv[2], '-o', sys.argv[3],"
        " '--tokenizer', 'bytes', '--val-tokens', '100']]"
        " + ([['plot', sys.argv[1]]] if find_spec('matplotlib') else []):\n"
        "    try:\n"
        "        rc = cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        rc = e.code\n"
        "    assert rc in (0, 2), (argv, rc)\n"
        "    assert 'torch' not in sys.modules, argv\n"
        "print('torch-free')\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run"), str(tmp_path / "text.txt"),
                        str(tmp_path / "shards")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "torch-free", r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir())  # prepare did write its shards
    # and a command that needs torch still gets it, with every subcommand's flags when no command is named
    from llmpy.cli import build_parser
    assert build_parser().parse_args(["train", "-b", "2"]).batch_size == 2


def test_ctrl_c_while_the_parser_loads_torch_is_one_line(monkeypatch, capsys):
    from llmpy import cli

    def interrupted(command=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["prepare", "x.txt"]) == 130
    assert capsys.readouterr().err == "llmpy prepare: interrupted\n"
    # under torchrun each rank says which it is, as its later lines would
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["train", "-b", "2"]) == 130
    assert capsys.readouterr().err == "llmpy train: rank 1 of 2: interrupted\n"
    assert cli.main([]) == 130  # no command named: nothing else to say who it is
    assert capsys.readouterr().err == "llmpy: interrupted\n"


def test_a_new_run_into_a_folder_holding_only_an_earlier_runs_log_is_refused(tmp_path, shards):
    # a run that stopped before its first checkpoint leaves main.log and main.jsonl: a new run would append its steps
    # to them (plot would read both as one run); the same run started again with -y 1 may, and logs its steps again
    train, val = shards
    out = tmp_path / "out"
    out.mkdir()
    rng = np.random.default_rng()
    old = [f'{{"step": {s}, "kind": "train", "loss": {rng.uniform(2, 6):.6f}}}\n' for s in range(1, 7)]
    (out / "main.jsonl").write_text("".join(old))
    (out / "main.log").write_text("".join(f"s:{s} trl:{rng.uniform(2, 6):.6f}\n" for s in range(1, 7)))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ("train", "-i", train, "-j", val, "-e", TINY, "-b", 2, "-t", 16, "-x", 2, "-v", 0, "-g", 0, "-o", out,
            "--progress", 0)
    res = llmpy(*args)
    assert_one_line_error(res, f"-o {out} holds the log of an earlier run (main.log, main.jsonl)", "-y 1")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = llmpy(*args, "-y", 1)
    assert res.returncode == 0, res.stderr
    assert (out / "main.jsonl").read_text().startswith("".join(old))  # appended to, as a resumed run's log is


def test_one_epoch_smaller_than_one_step_is_refused(tmp_path, shards):
    # -x -1 trains one epoch; a -d whose step reads more batches than an epoch has would train several epochs a step
    train, val = shards  # 5000 tokens: 156 batches of B=2, T=16
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-d", 32 * 200, "-x", -1, "-v", 0, "-g", 0)
    assert_one_line_error(res, "-d 6400: one step reads 200 batches of B=2 T=16, more than the 156 of one epoch",
                          "-x")


def test_a_tensorboard_file_where_its_folder_goes_is_one_line(tmp_path, shards):
    train, val = shards
    out = tmp_path / "out"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", out)
    assert_one_line_error(res, f"{out / 'tensorboard'}: not a folder (TensorBoard's events go there)")
    assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]  # no log begun


def test_sample_refuses_a_tokenizer_dir_for_the_bytes_tokenizer(tmp_path):
    res = llmpy("sample", tmp_path / "model.bin", "--tokenizer", "bytes", "--tokenizer-dir", tmp_path)
    assert_one_line_error(res, f"--tokenizer-dir '{tmp_path}': the bytes tokenizer has no files; leave it out")


def test_sample_refuses_a_tokenizer_dir_for_a_byte_model_under_auto(tmp_path):
    # --tokenizer auto picks bytes for a 257-token vocab: the folder, even a missing one, was ignored without a word
    model = tiny_model_file(tmp_path)
    res = llmpy("sample", model, "-g", 2, "--tokenizer-dir", tmp_path / "missing")
    assert_one_line_error(res, f"--tokenizer-dir '{tmp_path / 'missing'}': the model's 257-token vocab samples with "
                               "the bytes tokenizer, which has no files; leave it out")
    assert res.stdout == ""


def test_an_output_folder_that_is_a_file_is_named_so(tmp_path, shards):
    # "cannot create or write the output directory (File exists)" left the user to guess
    train, _ = shards
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", taken)
    assert_one_line_error(res, f"-o {taken}: a file is there; the output directory must be a folder")
    res = llmpy("prepare", train, "-o", taken, "--tokenizer", "bytes")
    assert_one_line_error(res, f"{taken}: a file is there; the output folder must be a folder")
    assert taken.read_text() == "mine"
    # a link to nothing was "a file is there" too; and a folder where the log goes was named by its folder alone
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", link)
    assert_one_line_error(res, f"-o {link}: a link to {tmp_path / 'gone'}, which does not exist; the output directory "
                               "must be a folder (create the link's target)")
    (tmp_path / "run" / "main.log").mkdir(parents=True)
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", tmp_path / "run")
    assert_one_line_error(res, f"cannot write the log {tmp_path / 'run' / 'main.log'}: Is a directory")


def test_a_training_state_given_for_a_model_says_which_file_to_give(tmp_path, shards):
    # "unexpected tensor 'm' (and 2 more): not a GPT-2 model" did not say what the file was, nor what to give
    train, _ = shards
    out = tmp_path / "out"
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-n", 1, "-o", out)
    assert res.returncode == 0, res.stderr
    state = out / "state_00000001.safetensors"
    want = (f"{state}: a training state (the optimizer's moments, the data position), not a model; give the model "
            f"file written with it ({out / 'model_00000001.bin'})")
    assert_one_line_error(llmpy("sample", state, "-g", 2), want)
    assert_one_line_error(llmpy("export", state, tmp_path / "hf"), want)
    assert_one_line_error(llmpy("train", "-i", train, "-e", state, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0), want)
    assert not (tmp_path / "hf").exists()


def test_a_second_run_into_an_output_folder_in_use_is_refused(tmp_path, shards):
    # two runs at once into one -o would write their checkpoints over each other's and their steps into one log
    import fcntl
    train, val = shards
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".llmpy.lock", "a+") as held:  # as a run in progress holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", out, "-y", 1)
        assert_one_line_error(res, f"-o {out}: another run is writing there (process 4242); wait for it to end")
        assert sorted(p.name for p in out.iterdir()) == [".llmpy.lock"]  # no log begun
        # the run in progress has logged before its first checkpoint: said so, where the earlier-log check's advice
        # (-y 1) only led to this line; and with its checkpoints too
        (out / "main.log").write_text("s:0 trl:5.5 lr:0.0001 norm:1.00\n")
        for resume in (0, 1):
            res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", out,
                        "-y", resume)
            assert_one_line_error(res, f"-o {out}: another run is writing there (process 4242); wait for it to end")
            assert "starting from step 0" not in res.stdout
        (out / "main.log").unlink()
    res = llmpy("train", "-i", train, "-e", TINY, "-b", 2, "-t", 16, "-x", 1, "-v", 0, "-g", 0, "-o", out, "-y", 1)
    assert res.returncode == 0, res.stderr  # the lock goes with the process that held it


@pytest.mark.parametrize("raised", ["refused", "os"])
def test_a_name_with_a_line_break_stays_on_the_error_line(monkeypatch, capsys, tmp_path, raised):
    """A file named with a newline (or another of the breaks str.splitlines knows) split the error into lines."""
    from llmpy import cli, trainer
    name = str(tmp_path / "a\nb\rc\u2028d\x1be\tf.bin")
    if raised == "os":
        def refused(opts, log=print):
            raise OSError(28, "No space left on device", name)
        monkeypatch.setattr(trainer, "train", refused)
        assert cli.main(["train", "-x", "1"]) == 1
    else:
        assert cli.main(["sample", name, "-g", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err.splitlines()) == 1, err
    assert str(tmp_path / "a\\nb\\rc\\u2028d\\x1be\tf.bin") in err


def test_a_note_with_a_line_break_stays_on_one_line(monkeypatch):
    import warnings

    from llmpy import cli
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # given back after the test
    cli._warnings_as_notes("sample")
    line = warnings.formatwarning(UserWarning("model a\nb.bin: 2 heads assumed"), UserWarning, cli.__file__, 1)
    assert line == "llmpy sample: note: model a\\nb.bin: 2 heads assumed\n"


def test_a_byte_level_run_of_gpt2s_vocab_samples_with_the_bytes_tokenizer(tmp_path):
    # the demo run on a GPU trains GPT-2 124M (vocab 50257) on the embedded byte-level corpus; `llmpy sample` of its
    # checkpoint picked GPT-2's BPE by the vocab and printed nonsense, and --tokenizer bytes was refused
    import llmpy as llmpy_api  # `llmpy` here is the command's helper
    from llmpy.sampler import printable
    out = tmp_path / "run"
    llmpy_api.train(model="layers=1,channels=16,heads=2,seq=16", batch_size=2, seq_len=16, max_steps=1,
                    val_every=0, gen_tokens=0, device="cpu", output_dir=str(out), log=lambda line: None)
    model = out / "model_00000001.bin"
    no_gpt2 = {"LLMPY_GPT2_DIR": "", "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache")}  # BPE would fail: no files
    res = llmpy("sample", model, "-g", 48, "--prompt", "def ", "--seed", 7, env=no_gpt2)
    assert res.returncode == 0 and res.stderr == (f"note: {model}: its run trained on byte-level tokens (the state "
                                                  "file beside it says so): sampled with the bytes tokenizer\n")
    # the bytes' ids only: a draw from all 50257 would be outside the bytes tokenizer and fail its decode
    continuation = llmpy_api.sample(llmpy_api.load_model(str(model)), "def ", gen_tokens=48, seed=7,
                                    tokenizer="bytes")
    assert res.stdout == "def " + printable(continuation) + "\n"  # the command escapes control characters
    explicit = llmpy("sample", model, "-g", 48, "--prompt", "def ", "--seed", 7, "--tokenizer", "bytes", env=no_gpt2)
    assert (explicit.returncode, explicit.stdout, explicit.stderr) == (0, res.stdout, "")
    assert_one_line_error(llmpy("sample", model, "-g", 2, "--tokenizer-dir", tmp_path, env=no_gpt2),
                          "the model's run trained on byte-level tokens")
    (out / "state_00000001.safetensors").unlink()  # without the run's word, the vocab decides: GPT-2's BPE
    assert_one_line_error(llmpy("sample", model, "-g", 2, env=no_gpt2), "GPT-2's tokenizer files are not on")


def test_a_sigterm_while_the_error_line_is_written_leaves_the_line_alone(monkeypatch):
    # torchrun SIGTERMs the other ranks when one fails, often just as they report their own error: the handler that
    # turns SIGTERM into an exception was still in place, and the line ended in a Terminated traceback
    import io
    import os
    import signal

    from llmpy import cli

    class TerminatedOnError(io.StringIO):
        def write(self, text):
            if "error:" in text:
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode, inside the except clause
            return super().write(text)
    err = TerminatedOnError()
    monkeypatch.setattr(sys, "stderr", err)
    old = signal.getsignal(signal.SIGTERM)
    assert cli.main(["sample", "/nonexistent/model.bin"]) == 1
    assert err.getvalue() == "llmpy sample: error: /nonexistent/model.bin: no such file or directory\n"
    assert signal.getsignal(signal.SIGTERM) is old  # given back


@pytest.mark.parametrize("given, notes", [
    ({"major_checkpoint_every": 4, "checkpoint_every": 1, "output_dir": True},
     ["note: -nm 4 without -nk: every checkpoint is kept, so -nm has none to keep apart"]),
    ({"lr_schedule": "constant", "final_lr_frac": 0.1},
     ["note: -q 0.1 with -k constant: the constant schedule does not decay, so -q goes unused"]),
    ({"skip_loss_z": 2.5, "skip_grad_z": 3.0},
     ["note: -sl 2.5, -sg 3: scores begin at step 129, once 128 steps fill their window, and this run has 2 steps, "
      "so none is skipped"]),
    ({"temperature": 0.5, "top_k": 5},
     ["note: --temperature 0.5, --top-k 5 with -g 0: no sample is drawn, so they go unused"]),
    ({"overfit_single_batch": 1, "shuffle": 1},
     ["note: --shuffle 1 with -a 1: the one batch is the data's first, in file order, so --shuffle goes unused"]),
    ({"major_checkpoint_every": 4, "checkpoints_keep": 1, "checkpoint_every": 1, "output_dir": True,
      "lr_schedule": "cosine", "final_lr_frac": 0.1, "temperature": 0.5, "gen_tokens": 4}, []),  # each where it acts
], ids=["nm", "q", "sl-sg", "sampling", "shuffle", "none"])
def test_options_that_others_leave_unused_are_noted(shards, tmp_path, given, notes):
    # each of these ran with no word though it could do nothing: a flag that silently did nothing read as one that
    # had worked
    import llmpy
    train, _ = shards
    if given.get("output_dir"):
        given = {**given, "output_dir": str(tmp_path / "out")}
    lines = []
    llmpy.train(log=lines.append, train_data=str(train), model=TINY, batch_size=4, seq_len=16, max_steps=2,
                val_every=0, device="cpu", **{"gen_tokens": 0, **given})
    assert [line for line in lines if line.startswith("note:")] == notes
