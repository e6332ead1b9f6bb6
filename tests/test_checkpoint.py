"""Model files: llm.c .bin (v3/v5), HF safetensors, llm.c debug state, format detection, atomicity."""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpy import checkpoint as ck
from llmpy import files
from llmpy.config import GPT2Config, parameter_views
from llmpy.errors import LlmpyError

SMALL = GPT2Config(num_layers=2, channels=64, num_heads=2, vocab_size=300, max_seq_len=32)
ODD = GPT2Config(num_layers=3, channels=48, num_heads=3, vocab_size=77, max_seq_len=20)
CONFIGS = pytest.mark.parametrize("config", [SMALL, ODD], ids=["small", "odd"])


def rand_params(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(config.num_parameters, generator=g)


def zero_pad_rows(config, flat):
    out = flat.clone()
    parameter_views(out, config)["wte"][config.vocab_size:] = 0
    return out


def header_of(path):
    return np.fromfile(path, dtype="<i4", count=256)


def write_raw(path, ints, payload=b""):
    h = np.zeros(256, dtype="<i4")
    h[:len(ints)] = ints
    path.write_bytes(h.tobytes() + payload)
    return path


def bf16_rne_bits(x: torch.Tensor) -> np.ndarray:
    """fp32 -> bf16 bits by round-to-nearest-even, done by hand (finite inputs)."""
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


# ---------------------------------------------------------------------------------------------
# llm.c model files


@CONFIGS
def test_llmc_fp32_round_trip(tmp_path, config):
    flat = rand_params(config)
    path = tmp_path / "model.bin"
    ck.save_llmc(path, config, flat)
    h = header_of(path)
    assert list(h[:8]) == [20240326, 3, config.max_seq_len, config.vocab_size, config.num_layers,
                           config.num_heads, config.channels, config.padded_vocab_size]
    assert not h[8:].any()
    assert path.stat().st_size == 1024 + 4 * config.num_parameters
    cfg, loaded, version = ck.load_llmc(path)
    assert (cfg, version) == (config, 3)
    assert loaded.dtype == torch.float32 and torch.equal(loaded, flat)
    assert ck.read_llmc_header(path) == (config, 3)


@CONFIGS
def test_llmc_bf16_round_trip(tmp_path, config):
    flat = rand_params(config, seed=1)
    # values exactly halfway between two bf16 numbers: ties must go to the even one
    flat[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-8 + 2**-16])
    path = tmp_path / "model_bf16.bin"
    ck.save_llmc(path, config, flat, dtype="bfloat16")
    assert header_of(path)[1] == 5
    assert path.stat().st_size == 1024 + 2 * config.num_parameters
    cfg, loaded, version = ck.load_llmc(path)
    assert (cfg, version) == (config, 5)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.view(torch.int16), flat.to(torch.bfloat16).view(torch.int16))
    assert np.array_equal(loaded.view(torch.int16).numpy().view(np.uint16), bf16_rne_bits(flat))
    assert loaded[:4].float().tolist() == [1.0, 1 + 2**-6, -1.0, 2**-8]


def test_llmc_bf16_params_saved_as_fp32_exactly(tmp_path):
    flat = rand_params(SMALL).to(torch.bfloat16)
    ck.save_llmc(tmp_path / "m.bin", SMALL, flat, dtype="fp32")
    _, loaded, version = ck.load_llmc(tmp_path / "m.bin")
    assert version == 3 and torch.equal(loaded, flat.float())


def test_llmc_old_v3_without_padded_vocab(tmp_path):
    unpadded = GPT2Config(num_layers=1, channels=32, num_heads=2, vocab_size=50, max_seq_len=8,
                          padded_vocab_size=50)
    flat = rand_params(unpadded)
    path = write_raw(tmp_path / "old.bin", [20240326, 3, 8, 50, 1, 2, 32, 0], flat.numpy().tobytes())
    cfg, loaded, _ = ck.load_llmc(path)
    assert cfg.padded_vocab_size == 50 and torch.equal(loaded, flat)


def test_save_llmc_wrong_parameter_count(tmp_path):
    with pytest.raises(LlmpyError, match="m.bin"):
        ck.save_llmc(tmp_path / "m.bin", SMALL, torch.zeros(10))
    assert not os.listdir(tmp_path)


@pytest.fixture
def good_bin(tmp_path):
    path = tmp_path / "good.bin"
    ck.save_llmc(path, SMALL, rand_params(SMALL))
    return path


def test_llmc_wrong_magic(tmp_path):
    path = write_raw(tmp_path / "junk.bin", [12345, 3, 32, 300, 2, 2, 64, 384])
    with pytest.raises(LlmpyError, match=r"junk\.bin.*not an llm\.c model file \(magic 12345, expected 20240326\)"):
        ck.load_llmc(path)


def test_llmc_wrong_version(tmp_path, good_bin):
    raw = bytearray(good_bin.read_bytes())
    raw[4:8] = np.int32(4).tobytes()
    bad = tmp_path / "v4.bin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(LlmpyError, match=r"v4\.bin.*version 4"):
        ck.load_llmc(bad)


def test_llmc_corrupt_sizes(tmp_path):
    path = write_raw(tmp_path / "neg.bin", [20240326, 3, 32, -5, 2, 2, 64, 384])
    with pytest.raises(LlmpyError, match=r"neg\.bin.*vocab_size=-5"):
        ck.read_llmc_header(path)
    path = write_raw(tmp_path / "heads.bin", [20240326, 3, 32, 300, 2, 3, 64, 384])
    with pytest.raises(LlmpyError, match=r"heads\.bin.*not divisible"):
        ck.read_llmc_header(path)


def test_llmc_truncated_and_too_long(tmp_path, good_bin):
    raw = good_bin.read_bytes()
    expected = 1024 + 4 * SMALL.num_parameters
    short = tmp_path / "short.bin"
    short.write_bytes(raw[:-6])
    with pytest.raises(LlmpyError, match=rf"short\.bin is truncated.*{expected} bytes.*{expected - 6}"):
        ck.load_llmc(short)
    long = tmp_path / "long.bin"
    long.write_bytes(raw + b"\0" * 8)
    with pytest.raises(LlmpyError, match=rf"long\.bin is too long.*{expected} bytes.*{expected + 8}"):
        ck.load_llmc(long)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(raw[:100])
    with pytest.raises(LlmpyError, match=r"tiny\.bin is too short"):
        ck.load_llmc(tiny)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_llmc_non_finite_weights_are_refused_naming_the_tensor(tmp_path, dtype, value):
    # else the run starts and stops at step 1 with "the loss is nan", never naming the model file
    flat = rand_params(SMALL, seed=12)
    parameter_views(flat, SMALL)["fcw"][1, 5, 7] = value
    path = tmp_path / "bad.bin"
    ck.save_llmc(path, SMALL, flat, dtype=dtype)
    for load in (ck.load_llmc, ck.load_model_file):
        with pytest.raises(LlmpyError, match=r"^.*bad\.bin: tensor fcw \(layer 1\) holds NaN or inf values; "
                                             r"a model's weights must be finite$"):
            load(path)
    parameter_views(flat, SMALL)["fcw"][1, 5, 7] = 0.5
    parameter_views(flat, SMALL)["wte"][3, 0] = -value
    ck.save_llmc(path, SMALL, flat, dtype=dtype)
    with pytest.raises(LlmpyError, match=r"bad\.bin: tensor wte holds NaN or inf"):
        ck.load_llmc(path)


def test_missing_file(tmp_path):
    with pytest.raises(LlmpyError, match=r"nope\.bin: no such file"):
        ck.load_llmc(tmp_path / "nope.bin")
    with pytest.raises(LlmpyError, match=r"nope\.bin"):
        ck.load_model_file(tmp_path / "nope.bin")


def test_check_precision(tmp_path, good_bin):
    ck.check_precision(good_bin, "float32")
    ck.check_precision(good_bin, torch.float32)
    with pytest.raises(LlmpyError, match=r"good\.bin is a fp32 \(version 3\) checkpoint but the run is bf16"):
        ck.check_precision(good_bin, "bf16")
    bf = tmp_path / "x_bf16.bin"
    ck.save_llmc(bf, SMALL, rand_params(SMALL), dtype="bfloat16")
    ck.check_precision(bf, torch.bfloat16)
    with pytest.raises(LlmpyError, match=r"x_bf16\.bin is a bf16 \(version 5\) checkpoint but the run is fp32"):
        ck.check_precision(bf, "float32")
    with pytest.raises(LlmpyError, match=r"y\.bin is a bf16 \(version 5\)"):
        ck.check_precision(5, "fp32", name="y.bin")
    ck.check_precision(3, "fp32")
    with pytest.raises(LlmpyError, match="float16"):
        ck.check_precision(3, "float16")


# ---------------------------------------------------------------------------------------------
# HuggingFace


def hand_made_hf(config, flat):
    """HF GPT-2 tensors built independently of the module's mapping table."""
    p = parameter_views(flat, config)
    out = {"wte.weight": p["wte"][:config.vocab_size], "wpe.weight": p["wpe"],
           "ln_f.weight": p["lnfw"], "ln_f.bias": p["lnfb"]}
    for i in range(config.num_layers):
        pre = f"h.{i}."
        out[pre + "ln_1.weight"], out[pre + "ln_1.bias"] = p["ln1w"][i], p["ln1b"][i]
        out[pre + "attn.c_attn.weight"] = p["qkvw"][i].T      # Conv1D: (in, out)
        out[pre + "attn.c_attn.bias"] = p["qkvb"][i]
        out[pre + "attn.c_proj.weight"] = p["attprojw"][i].T
        out[pre + "attn.c_proj.bias"] = p["attprojb"][i]
        out[pre + "ln_2.weight"], out[pre + "ln_2.bias"] = p["ln2w"][i], p["ln2b"][i]
        out[pre + "mlp.c_fc.weight"] = p["fcw"][i].T
        out[pre + "mlp.c_fc.bias"] = p["fcb"][i]
        out[pre + "mlp.c_proj.weight"] = p["fcprojw"][i].T
        out[pre + "mlp.c_proj.bias"] = p["fcprojb"][i]
    return {k: v.contiguous().clone() for k, v in out.items()}


@CONFIGS
def test_hf_round_trip(tmp_path, config):
    flat = rand_params(config, seed=2)
    out = tmp_path / "hf"
    weights = ck.save_hf(out, config, flat)
    assert weights == out / "model.safetensors"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    cfg, loaded = ck.load_hf(out)
    assert cfg == config
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, zero_pad_rows(config, flat))
    assert not parameter_views(loaded, config)["wte"][config.vocab_size:].any()


def test_hf_sharded_index_loads_and_a_malformed_one_is_one_line(tmp_path):
    flat = rand_params(SMALL, seed=4)
    single = tmp_path / "single"
    ck.save_hf(single, SMALL, flat)
    tensors = load_file(single / "model.safetensors")
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((single / "config.json").read_bytes())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
    config, loaded = ck.load_hf(sharded)
    assert config == SMALL and torch.equal(loaded, ck.load_hf(single)[1])
    for weight_map in (["x"], {"a": 5}, {"a": "model-00001-of-00002.safetensors", "b": None}, {"a": ""}, "x"):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(LlmpyError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
            ck.load_hf(sharded)
        with pytest.raises(LlmpyError, match=r"not a safetensors index"):
            ck.load_model_file(sharded)


def test_a_pipe_or_a_broken_link_as_a_model_file_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "pipe.bin")  # reading it would block for ever
    with pytest.raises(LlmpyError, match=r"pipe\.bin: not a regular file"):
        ck.load_model_file(tmp_path / "pipe.bin")
    with pytest.raises(LlmpyError, match=r"null: not a regular file"):
        ck.load_model_file(os.devnull)
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    with pytest.raises(LlmpyError, match=r"loop1: a link to nothing \(or a loop of links\)"):
        ck.load_model_file(tmp_path / "loop1")
    with pytest.raises(LlmpyError, match=r"absent\.bin: no such file or directory"):
        ck.load_model_file(tmp_path / "absent.bin")
    with pytest.raises(LlmpyError, match=r"^an empty model file name$"):
        ck.load_model_file("")


def test_orphaned_temporaries_of_a_killed_process_are_removed_and_nothing_else(tmp_path):
    import subprocess
    import sys
    import time
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process id that no longer runs
    names = {f".model_00000004.bin.{dead}.0a1b2c3d.tmp": False, f".x_train_000001.bin.{dead}.deadbeef.part": False,
             f".model_00000004.bin.{os.getppid()}.0a1b2c3d.tmp": True,  # a live process's write
             # this process's id on a file older than this process: an earlier process of the same id (a restarted
             # container's trainer is process 1 again) was killed writing it
             f".state_00000004.safetensors.{os.getpid()}.0a1b2c3d.tmp": False,
             f".model.bin.{dead}.0A1B2C3D.tmp": True, "model_00000004.bin": True, f"model.{dead}.0a1b2c3d.tmp": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (time.time() - files.ORPHAN_MIN_AGE_S - 5,) * 2)
    young = tmp_path / f".state_00000008.safetensors.{dead}.00000000.tmp"
    young.write_bytes(b"x")  # just written: maybe another host's write into a shared folder, so kept for now
    assert files.remove_orphaned_temporaries(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([n for n, kept in names.items() if kept] +
                                                                [young.name])
    assert files.remove_orphaned_temporaries(tmp_path / "absent") == 0


def test_a_temporary_this_process_wrote_is_kept_however_old(tmp_path, monkeypatch):
    import time
    monkeypatch.setattr(files, "_IMPORTED_AT", time.time() - 10 * files.ORPHAN_MIN_AGE_S)  # a long run
    mine = tmp_path / f".model_00000004.bin.{os.getpid()}.0a1b2c3d.tmp"
    mine.write_bytes(b"x")
    os.utime(mine, (time.time() - files.ORPHAN_MIN_AGE_S - 5,) * 2)  # written by this process, long ago
    assert files.remove_orphaned_temporaries(tmp_path) == 0 and mine.exists()


def test_hf_export_on_a_full_disk_keeps_the_old_files_and_says_so(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError
    old = ck.save_hf(tmp_path, SMALL, rand_params(SMALL)).read_bytes()
    old_config = (tmp_path / "config.json").read_bytes()

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # half a file, then safetensors' error on ENOSPC
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError) as e:  # another model's export: its config.json must not land without its weights
        ck.save_hf(tmp_path, ODD, rand_params(ODD))
    assert e.value.strerror == "No space left on device" and e.value.filename == str(tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == old
    assert (tmp_path / "config.json").read_bytes() == old_config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_hf_export_interrupted_at_its_config_keeps_the_old_weights(tmp_path, monkeypatch):
    old = ck.save_hf(tmp_path, SMALL, rand_params(SMALL)).read_bytes()

    def interrupted(config):
        raise KeyboardInterrupt
    monkeypatch.setattr(ck, "hf_config_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save_hf(tmp_path, ODD, rand_params(ODD))
    assert (tmp_path / "model.safetensors").read_bytes() == old  # not ODD's weights beside SMALL's config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_hf_export_whose_config_cannot_reach_the_disk_keeps_the_old_weights(tmp_path, monkeypatch):
    # a file system that reports a full disk only at the sync (NFS): the config's came after the new weights
    # were in place, which then stood beside the old config
    import errno
    old = ck.save_hf(tmp_path, SMALL, rand_params(SMALL)).read_bytes()
    sync = os.fsync

    def config_sync_fails(fd):
        if "config.json" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        sync(fd)
    monkeypatch.setattr(os, "fsync", config_sync_fails)
    with pytest.raises(OSError):
        ck.save_hf(tmp_path, ODD, rand_params(ODD))
    assert (tmp_path / "model.safetensors").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_safetensors_files_take_the_umask_mode(tmp_path):
    mask = os.umask(0o022)
    try:
        weights = ck.save_hf(tmp_path, SMALL, rand_params(SMALL))
    finally:
        os.umask(mask)
    assert weights.stat().st_mode & 0o777 == 0o644  # safetensors alone creates 0600


@CONFIGS
def test_hf_layout_matches_hand_made_mapping(tmp_path, config):
    flat = rand_params(config, seed=3)
    ck.save_hf(tmp_path, config, flat)
    stored = load_file(tmp_path / "model.safetensors")
    assert all(k.startswith("transformer.") for k in stored)
    stored = {k.removeprefix("transformer."): v for k, v in stored.items()}
    expected = hand_made_hf(config, flat)
    assert stored.keys() == expected.keys()
    for k in expected:
        assert stored[k].dtype == torch.float32
        assert torch.equal(stored[k], expected[k]), k
    # shapes as HF's GPT-2 has them
    C = config.channels
    assert stored["h.0.attn.c_attn.weight"].shape == (C, 3 * C)
    assert stored["h.0.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert stored["h.0.mlp.c_proj.weight"].shape == (4 * C, C)
    assert stored["wte.weight"].shape == (config.vocab_size, C)


def test_hf_config_json(tmp_path):
    ck.save_hf(tmp_path, ODD, rand_params(ODD))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["model_type"] == "gpt2"
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"]) == (3, 3, 48)
    assert (cfg["n_positions"], cfg["n_ctx"], cfg["vocab_size"]) == (20, 20, 77)
    assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] < 77


def test_hf_file_path_and_load_model_file(tmp_path):
    flat = rand_params(SMALL, seed=4)
    weights = ck.save_hf(tmp_path / "gpt.safetensors", SMALL, flat)
    assert weights == tmp_path / "gpt.safetensors" and (tmp_path / "config.json").is_file()
    cfg, loaded, dtype = ck.load_model_file(weights)
    assert (cfg, dtype) == (SMALL, "float32") and torch.equal(loaded, zero_pad_rows(SMALL, flat))
    weights.rename(tmp_path / "model.safetensors")
    cfg, loaded, dtype = ck.load_model_file(tmp_path)
    assert (cfg, dtype) == (SMALL, "float32") and torch.equal(loaded, zero_pad_rows(SMALL, flat))


def test_hf_unprefixed_with_buffers_tied_head_and_no_config(tmp_path):
    # GPT-2 as the hub stores it: no prefix, causal-mask buffers, and no config.json here, so the
    # heads are inferred with head size 64.
    config = GPT2Config(num_layers=2, channels=128, num_heads=2, vocab_size=90, max_seq_len=16)
    flat = rand_params(config, seed=5)
    tensors = hand_made_hf(config, flat)
    for i in range(config.num_layers):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    save_file({k: v.half() if k == "wpe.weight" else v for k, v in tensors.items()},
              tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="no config.json beside it: 2 heads assumed"):
        cfg, loaded = ck.load_hf(tmp_path / "model.safetensors")
    assert cfg == config
    expected = zero_pad_rows(config, flat)
    parameter_views(expected, config)["wpe"].copy_(parameter_views(expected, config)["wpe"].half())
    assert torch.equal(loaded, expected)


def test_hf_config_json_overrides_head_guess(tmp_path):
    flat = rand_params(SMALL)
    ck.save_hf(tmp_path, SMALL, flat)
    (tmp_path / "config.json").unlink()
    # the weights alone, without the config save_hf embeds in them: the heads are a guess, and said to be
    save_file(load_file(tmp_path / "model.safetensors"), tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=re.escape("model.safetensors: no config.json beside it: 1 head assumed "
                                                   "(GPT-2's head size 64)")):
        cfg, _ = ck.load_hf(tmp_path)
    assert cfg.num_heads == 1  # 64 channels / head size 64
    ck.save_hf(tmp_path, SMALL, flat)
    assert ck.load_hf(tmp_path)[0].num_heads == 2


def test_hf_weights_exported_alone_keep_their_heads(tmp_path):
    """A model.safetensors copied away from its config.json loaded with C / 64 heads, another model's outputs without
    a word; save_hf's weights carry their config, so the file alone is the model it was."""
    config = GPT2Config(num_layers=2, channels=64, num_heads=4, vocab_size=300, max_seq_len=32, padded_vocab_size=384)
    flat = rand_params(config, seed=23)
    ck.save_hf(tmp_path / "hf", config, flat)
    (tmp_path / "alone").mkdir()
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "alone" / "model.safetensors")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guess, no note
        cfg, loaded = ck.load_hf(tmp_path / "alone")
    assert cfg == config and torch.equal(loaded, zero_pad_rows(config, flat))
    # config.json, where there is one, still decides (a user's edit of it wins over the copy)
    ck.save_hf(tmp_path / "alone", config, flat)
    cfg_json = json.loads((tmp_path / "alone" / "config.json").read_text())
    (tmp_path / "alone" / "config.json").write_text(json.dumps({**cfg_json, "n_head": 2}))
    assert ck.load_hf(tmp_path / "alone")[0].num_heads == 2


@pytest.mark.parametrize("embedded, message", [
    ("{not json", "(its embedded config): not valid JSON"),
    ("[1, 2]", "(its embedded config): expected a JSON object"),
    ('{"n_layer": 2, "n_head": 3, "n_embd": 64, "n_positions": 32, "vocab_size": 300}',
     "(its embedded config): bad GPT-2 configuration"),
    ('{"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 32}', "(its embedded config): missing 'vocab_size'"),
])
def test_hf_damaged_embedded_config_is_refused(tmp_path, embedded, message):
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL))
    (tmp_path / "config.json").unlink()
    save_file(load_file(tmp_path / "model.safetensors"), tmp_path / "model.safetensors",
              metadata={"format": "pt", ck.HF_CONFIG_METADATA_KEY: embedded})
    with pytest.raises(LlmpyError, match=re.escape(message)):
        ck.load_hf(tmp_path)


def test_hf_untied_head_is_an_error(tmp_path):
    tensors = hand_made_hf(SMALL, rand_params(SMALL))
    tensors["lm_head.weight"] = tensors["wte.weight"] + 1
    save_file(tensors, tmp_path / "untied.safetensors")
    with pytest.warns(UserWarning, match="1 head assumed"), \
            pytest.raises(LlmpyError, match=r"untied\.safetensors.*lm_head\.weight differs"):
        ck.load_hf(tmp_path / "untied.safetensors")


def test_hf_missing_tensor(tmp_path):
    tensors = hand_made_hf(SMALL, rand_params(SMALL))
    del tensors["h.1.mlp.c_fc.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ck.hf_config_dict(SMALL)))
    with pytest.raises(LlmpyError, match=r"model\.safetensors: missing tensor 'h\.1\.mlp\.c_fc\.bias'"):
        ck.load_hf(tmp_path)
    del tensors["wte.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LlmpyError, match=r"model\.safetensors: missing tensor 'wte\.weight'"):
        ck.load_model_file(tmp_path)


def test_hf_wrong_shape(tmp_path):
    tensors = hand_made_hf(SMALL, rand_params(SMALL))
    # stored untransposed, as if llm.c's layout had been written straight out
    tensors["h.0.attn.c_attn.weight"] = tensors["h.0.attn.c_attn.weight"].T.contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ck.hf_config_dict(SMALL)))
    with pytest.raises(LlmpyError, match=r"model\.safetensors: tensor 'h\.0\.attn\.c_attn\.weight' has shape "
                                         r"\[192, 64\], expected \[64, 192\]"):
        ck.load_hf(tmp_path)


def test_hf_config_mismatch_and_unknown_tensor(tmp_path):
    tensors = hand_made_hf(SMALL, rand_params(SMALL))
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ck.hf_config_dict(ODD)))
    with pytest.raises(LlmpyError, match=r"model\.safetensors: its tensors hold 2 layer\(s\), layers 0\.\.1; "
                                         r".*config\.json says 3"):
        ck.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ck.hf_config_dict(GPT2Config(
        num_layers=2, channels=48, num_heads=3, vocab_size=77, max_seq_len=20))))
    with pytest.raises(LlmpyError, match=r"model\.safetensors: tensor 'wte\.weight' has shape"):
        ck.load_hf(tmp_path)
    tensors["score.weight"] = torch.zeros(2, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LlmpyError, match=r"model\.safetensors: unexpected tensor 'score\.weight'"):
        ck.load_hf(tmp_path)


def test_hf_not_safetensors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"hello world, not safetensors")
    with pytest.raises(LlmpyError, match=r"bad\.safetensors"):
        ck.load_hf(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmpyError, match=r"empty is a directory without model\.safetensors"):
        ck.load_model_file(tmp_path / "empty")


def test_hf_deeply_nested_config_or_index_is_one_line(tmp_path):
    # json's decoder recurses: '[' * 100000 is a RecursionError, not a ValueError
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=13))
    (tmp_path / "config.json").write_text("[" * 100000)
    with pytest.raises(LlmpyError, match=r"config\.json: not valid JSON \(maximum recursion depth"):
        ck.load_model_file(tmp_path)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text("[" * 100000)
    with pytest.raises(LlmpyError, match=r"model\.safetensors\.index\.json: not a safetensors index \(maximum"):
        ck.load_model_file(sharded)


def test_hf_config_or_index_that_cannot_be_read_is_not_called_bad_json(tmp_path, monkeypatch):
    # was "config.json: not valid JSON (Permission denied)": the file's content was never looked at
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=13))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    for method in ("read_bytes", "read_text"):
        def denied(self, *args, _read=getattr(Path, method), **kwargs):
            if self.name in ("config.json", "model.safetensors.index.json"):
                raise PermissionError(13, "Permission denied", str(self))
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(Path, method, denied)
    with pytest.raises(LlmpyError, match=r"config\.json: cannot read: Permission denied$"):
        ck.load_model_file(tmp_path)
    with pytest.raises(LlmpyError, match=r"model\.safetensors\.index\.json: cannot read: Permission denied$"):
        ck.load_model_file(sharded)
    monkeypatch.undo()
    (tmp_path / "config.json").write_bytes(b'{"n_layer": "\xff"}')  # not UTF-8: still the one line of bad JSON
    with pytest.raises(LlmpyError, match=r"config\.json: not valid JSON \('utf-8' codec can't decode"):
        ck.load_model_file(tmp_path)


def test_hf_layer_number_in_other_digits_is_an_unexpected_tensor(tmp_path):
    # "h.².ln_1.weight": str.isdigit() took "²" as a layer number that int() then refused (a ValueError traceback)
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=15))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({k.replace("h.0.", "h.\u00b2."): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(LlmpyError, match=r"unexpected tensor 'h\.\u00b2\."):
        ck.load_model_file(tmp_path)


def test_hf_tied_weights_saved_under_lm_heads_name_load(tmp_path):
    # safetensors.torch.save_model keeps one name of tied tensors, lm_head.weight: "missing tensor 'wte.weight'"
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=16))
    _, want, _ = ck.load_model_file(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("transformer.wte.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config, loaded, _ = ck.load_model_file(tmp_path)
    assert config == SMALL and torch.equal(loaded, want)


def test_hf_config_weights_or_shard_that_is_not_a_file_says_so(tmp_path):
    # was "no config.json beside it and the width ...", "is a directory without model.safetensors" and "no such file"
    flat = rand_params(SMALL, seed=14)
    ck.save_hf(tmp_path / "cfg", SMALL, flat)
    (tmp_path / "cfg" / "config.json").unlink()
    (tmp_path / "cfg" / "config.json").mkdir()
    with pytest.raises(LlmpyError, match=r"cfg/config\.json is a directory, not a JSON config$"):
        ck.load_model_file(tmp_path / "cfg")
    os.rmdir(tmp_path / "cfg" / "config.json")
    os.mkfifo(tmp_path / "cfg" / "config.json")  # reading it would block for ever
    with pytest.raises(LlmpyError, match=r"cfg/config\.json: not a regular file, so not a JSON config$"):
        ck.load_hf(tmp_path / "cfg" / "model.safetensors")
    (tmp_path / "weights" / "model.safetensors").mkdir(parents=True)
    with pytest.raises(LlmpyError, match=r"weights/model\.safetensors is a directory, not a safetensors file$"):
        ck.load_model_file(tmp_path / "weights")
    shards = tmp_path / "shards"
    (shards / "model-00001-of-00001.safetensors").mkdir(parents=True)
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"wte.weight": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(LlmpyError, match=r"model-00001-of-00001\.safetensors is a directory, not a safetensors file$"):
        ck.load_model_file(shards)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool], ids=["int8", "int64", "bool"])
def test_hf_tensor_that_is_not_floating_point_is_refused_naming_it(tmp_path, dtype):
    # was cast to float without a word
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=15))
    tensors = load_file(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(16)
    t = tensors["transformer.h.1.mlp.c_fc.weight"]
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.randint(-100, 100, t.shape, generator=g).to(dtype)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    name = {torch.int8: "I8", torch.int64: "I64", torch.bool: "BOOL"}[dtype]
    with pytest.raises(LlmpyError, match=rf"model\.safetensors: tensor 'transformer\.h\.1\.mlp\.c_fc\.weight' is "
                                         rf"{name}, not floating point"):
        ck.load_model_file(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_hf_non_finite_weights_are_refused_naming_the_tensor(tmp_path, value):
    flat = rand_params(SMALL, seed=17)
    ck.save_hf(tmp_path, SMALL, flat)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["transformer.h.0.attn.c_proj.bias"][9] = value
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"].half()  # checked once widened
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LlmpyError, match=r"model\.safetensors: tensor 'transformer\.h\.0\.attn\.c_proj\.bias' "
                                         r"holds NaN or inf values"):
        ck.load_model_file(tmp_path)
    tensors["transformer.h.0.attn.c_proj.bias"][9] = 0.25
    tensors["transformer.wpe.weight"][3, 3] = value
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LlmpyError, match=r"tensor 'transformer\.wpe\.weight' holds NaN or inf values"):
        ck.load_hf(tmp_path)


@pytest.mark.parametrize("key, value, message", [
    ("n_embd", 64.5, "n_embd must be a positive integer, not 64.5"),
    ("n_embd", "64", 'n_embd must be a positive integer, not "64"'),
    ("n_layer", True, "n_layer must be a positive integer, not true"),
    ("n_head", 0, "n_head must be a positive integer, not 0"),
    ("vocab_size", None, "vocab_size must be a positive integer, not null"),
    ("layer_norm_epsilon", "abc", 'layer_norm_epsilon must be a positive number, not "abc"'),
    ("layer_norm_epsilon", -1e-5, "layer_norm_epsilon must be a positive number, not -1e-05"),
    ("layer_norm_epsilon", float("nan"), "layer_norm_epsilon must be a positive number, not NaN"),
    ("llmc_padded_vocab_size", "x", 'llmc_padded_vocab_size must be a positive integer, not "x"'),
    ("llmc_padded_vocab_size", 10, "llmc_padded_vocab_size 10 is smaller than vocab_size 300"),
    # a traceback from the allocation of a 4-petabyte model
    ("llmc_padded_vocab_size", 10**15, "llmc_padded_vocab_size 1000000000000000 is far above vocab_size 300 (llm.c "
                                       "pads to the next multiple of 128)"),
    # transformers' options that change the attention's arithmetic were loaded without a word
    ("scale_attn_weights", False, "scale_attn_weights false: llm.c's GPT-2 has true, and loading this model so would "
                                  "change its outputs"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx true: llm.c's GPT-2 has false, and "
                                              "loading this model so would change its outputs"),
    ("activation_function", ["gelu_new"],
     'activation_function ["gelu_new"] is not the tanh GELU (gelu_new) llm.c uses'),
], ids=["float", "str", "bool", "zero", "null", "eps-str", "eps-negative", "eps-nan", "padded-str", "padded-small",
        "padded-huge", "unscaled-attention", "attention-scaled-by-layer", "activation-list"])
def test_hf_config_value_of_the_wrong_type_or_range_is_named(tmp_path, key, value, message):
    # was truncated (64.5), parsed ("64"), given a note ("abc") or ignored (the padded vocab)
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=18))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LlmpyError) as e:
        ck.load_model_file(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"


def test_hf_layer_count_that_the_tensors_do_not_hold_is_one_line_at_once(tmp_path):
    # a config.json (or one tensor's name) saying a million layers cost minutes and gigabytes before its error
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=20))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_layer"] = 10**6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LlmpyError, match=re.escape(f"model.safetensors: its tensors hold 2 layer(s), layers 0..1; "
                                                   f"{tmp_path / 'config.json'} says 1000000")):
        ck.load_hf(tmp_path)
    (tmp_path / "config.json").unlink()
    tensors = hand_made_hf(SMALL, rand_params(SMALL))
    tensors["h.100000000.ln_1.weight"] = torch.ones(64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="1 head assumed"), \
            pytest.raises(LlmpyError, match=re.escape("model.safetensors: its tensors hold 3 layer(s), layers "
                                                   "0..100000000; numbered from 0 without gaps")):
        ck.load_hf(tmp_path)


def test_hf_config_padded_vocab_and_epsilon_that_are_right_are_used(tmp_path):
    config = GPT2Config(num_layers=1, channels=64, num_heads=2, vocab_size=300, max_seq_len=16, padded_vocab_size=320)
    ck.save_hf(tmp_path, config, rand_params(config, seed=19))
    assert ck.load_hf(tmp_path)[0] == config
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["layer_norm_epsilon"] = 1.00001e-5  # a JSON round trip's difference, not another model
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ck.load_hf(tmp_path)[0] == config


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_hf_other_layernorm_epsilon_is_refused(tmp_path, eps):
    """llm.c's LayerNorm has eps 1e-5; a model trained with another loaded with a note and computed other outputs
    (0.26 in the logits at 1e-3), as scale_attn_weights would, which is refused."""
    ck.save_hf(tmp_path, SMALL, rand_params(SMALL))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_norm_epsilon": eps}))
    with pytest.raises(LlmpyError, match=re.escape(f"config.json: layer_norm_epsilon {eps}: llm.c's GPT-2 has 1e-5, "
                                                   "and loading this model so would change its outputs")):
        ck.load_hf(tmp_path)


# ---------------------------------------------------------------------------------------------
# debug state


@pytest.mark.parametrize("padded_logits", [False, True])
def test_debug_state_round_trip(tmp_path, padded_logits):
    config, B, T = ODD, 3, 5
    g = torch.Generator().manual_seed(6)
    inputs = torch.randint(0, config.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, config.vocab_size, (B, T), generator=g)
    V = config.padded_vocab_size if padded_logits else config.vocab_size
    logits = torch.randn(B, T, V, generator=g)
    grads = torch.randn(config.num_parameters, generator=g)
    path = tmp_path / "debug.bin"
    ck.save_debug_state(path, config, inputs, targets, logits, torch.tensor(3.25), grads)
    assert list(header_of(path)[:4]) == [20240327, 2, B, T]
    assert path.stat().st_size == 1024 + 4 * (2 * B * T + B * T * config.vocab_size + 1 + config.num_parameters)
    st = ck.load_debug_state(path, config)
    assert (st["B"], st["T"], st["loss"]) == (B, T, 3.25)
    assert st["inputs"].dtype == torch.int32 and torch.equal(st["inputs"].long(), inputs)
    assert torch.equal(st["targets"].long(), targets)
    assert torch.equal(st["logits"], logits[..., :config.vocab_size])
    assert torch.equal(st["grads"], grads)


def test_debug_state_bad_input(tmp_path):
    config, B, T = SMALL, 2, 4
    args = (torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long),
            torch.zeros(B, T, config.vocab_size), 1.0, torch.zeros(config.num_parameters))
    path = tmp_path / "dbg.bin"
    ck.save_debug_state(path, config, *args)
    raw = path.read_bytes()
    (tmp_path / "cut.bin").write_bytes(raw[:-4])
    with pytest.raises(LlmpyError, match=r"cut\.bin is truncated"):
        ck.load_debug_state(tmp_path / "cut.bin", config)
    deeper = GPT2Config(num_layers=3, channels=64, num_heads=2, vocab_size=300, max_seq_len=32)
    with pytest.raises(LlmpyError, match=r"dbg\.bin is truncated"):  # written for a smaller model
        ck.load_debug_state(path, deeper)
    (tmp_path / "v1.bin").write_bytes(raw[:4] + np.int32(1).tobytes() + raw[8:])
    with pytest.raises(LlmpyError, match=r"v1\.bin: unsupported debug state version 1"):
        ck.load_debug_state(tmp_path / "v1.bin", config)
    ck.save_llmc(tmp_path / "good.bin", config, rand_params(config))
    with pytest.raises(LlmpyError, match=r"good\.bin is not an llm\.c debug state.*20240326"):
        ck.load_debug_state(tmp_path / "good.bin", config)
    with pytest.raises(LlmpyError, match=r"x\.bin.*logits"):
        ck.save_debug_state(tmp_path / "x.bin", config, args[0], args[1], torch.zeros(B, T, 5), 1.0, args[4])


# ---------------------------------------------------------------------------------------------
# format detection


def test_load_model_file_llmc(tmp_path):
    flat = rand_params(SMALL)
    ck.save_llmc(tmp_path / "a.bin", SMALL, flat)
    ck.save_llmc(tmp_path / "b.bin", SMALL, flat, dtype="bf16")
    cfg, loaded, dtype = ck.load_model_file(tmp_path / "a.bin")
    assert (cfg, dtype) == (SMALL, "float32") and torch.equal(loaded, flat)
    cfg, loaded, dtype = ck.load_model_file(tmp_path / "b.bin")
    assert (cfg, dtype) == (SMALL, "bfloat16") and loaded.dtype == torch.bfloat16


def test_load_model_file_rejects_other_files(tmp_path):
    shard = write_raw(tmp_path / "fineweb_train_000001.bin", [20240520, 1, 10],
                      np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(LlmpyError, match=r"fineweb_train_000001\.bin is a token shard, not a model file"):
        ck.load_model_file(shard)
    with pytest.raises(LlmpyError, match=r"fineweb_train_000001\.bin is a token shard, not an llm\.c model file"):
        ck.load_llmc(shard)
    dbg = write_raw(tmp_path / "gpt2_124M_debug_state.bin", [20240327, 2, 1, 1])
    with pytest.raises(LlmpyError, match=r"gpt2_124M_debug_state\.bin is an llm\.c debug state.*not a model file"):
        ck.load_model_file(dbg)
    text = tmp_path / "notes.txt"
    text.write_text("just some text, long enough to have a header of sorts\n")
    with pytest.raises(LlmpyError, match=r"notes\.txt is not a model file"):
        ck.load_model_file(text)


# ---------------------------------------------------------------------------------------------
# atomicity


def test_failed_llmc_save_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.bin"
    first = rand_params(SMALL, seed=7)
    ck.save_llmc(path, SMALL, first)

    def half_then_fail(f, tensor, dtype="float32"):
        f.write(b"\1" * 1000)  # something reached the disk before the failure
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_write_tensor", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        ck.save_llmc(path, SMALL, rand_params(SMALL, seed=8))
    assert os.listdir(tmp_path) == ["model.bin"]
    assert torch.equal(ck.load_llmc(path)[1], first)


def test_failed_hf_save_keeps_old_files(tmp_path, monkeypatch):
    first = rand_params(SMALL, seed=9)
    ck.save_hf(tmp_path, SMALL, first)

    def fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt  # even a Ctrl-C mid-write leaves the old file

    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        ck.save_hf(tmp_path, SMALL, rand_params(SMALL, seed=10))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert torch.equal(ck.load_hf(tmp_path)[1], zero_pad_rows(SMALL, first))


def test_atomic_write_into_missing_directory(tmp_path):
    with pytest.raises(LlmpyError, match=r"nodir"):
        ck.save_llmc(tmp_path / "nodir" / "m.bin", SMALL, rand_params(SMALL))


# ---------------------------------------------------------------------------------------------
# transformers (only where it is installed, e.g. the GPU machine)


def test_transformers_loads_saved_model_and_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = ODD
    flat = rand_params(config, seed=11) * 0.1
    ck.save_hf(tmp_path / "ours", config, flat)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    p = parameter_views(flat, config)
    assert torch.equal(model.lm_head.weight, p["wte"][:config.vocab_size])  # tied
    x = torch.randn(2, 5, config.channels)
    blk = model.transformer.h[1]
    F = torch.nn.functional
    with torch.no_grad():
        # HF's Conv1D computes x @ W + b; llm.c's layout computes x @ w.T + b: same numbers
        for mod, w, b, width in ((blk.attn.c_attn, "qkvw", "qkvb", 1), (blk.attn.c_proj, "attprojw", "attprojb", 1),
                                 (blk.mlp.c_fc, "fcw", "fcb", 1), (blk.mlp.c_proj, "fcprojw", "fcprojb", 4)):
            xin = torch.randn(2, 5, config.channels * width)
            torch.testing.assert_close(mod(xin), F.linear(xin, p[w][1], p[b][1]))
        torch.testing.assert_close(blk.ln_1(x), F.layer_norm(x, (config.channels,), p["ln1w"][1], p["ln1b"][1], 1e-5))
    model.save_pretrained(tmp_path / "theirs")
    cfg, loaded = ck.load_hf(tmp_path / "theirs")
    assert cfg == config
    assert torch.equal(loaded, zero_pad_rows(config, flat))


@pytest.mark.parametrize("name", ["x" * 251, "é" * 125 + ".bin", "d" * 255], ids=["ascii", "utf8", "max"])
def test_a_long_file_name_gets_a_temporary_the_file_system_takes(tmp_path, name):
    # the temporary was the name plus ~20 characters: past NAME_MAX (255 bytes) where the file's own name is not, so
    # `llmpy prepare` of a text file with a 240-character name failed with "File name too long"
    files.atomic_write(tmp_path / name, lambda f: f.write(b"ok"))
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_bytes() == b"ok"
    tmp = files.temporary_sibling(tmp_path / name, "part")
    assert len(os.fsencode(tmp.name)) <= 255 and files._TEMPORARY_NAME.match(tmp.name)


# ---------------------------------------------------------------------------------------------
# training states (training_state.py; the resume itself is test_resume.py's)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu], ids=["e4m3", "e8m0"])
def test_a_state_tensor_in_a_dtype_numpy_lacks_fails_its_checksum_in_one_line(tmp_path, dtype):
    # the checksum went through numpy, which has no fp8: an fp8 tensor in a state file was a TypeError's traceback
    from safetensors import safe_open

    from llmpy import training_state as ts
    n = SMALL.num_parameters
    tensors = {"params": rand_params(SMALL), "m": torch.randn(n), "v": torch.rand(n)}
    ts.save_checkpoint(tmp_path, 5, SMALL, tensors["params"], tensors, {"options": {}})
    spath = ts.state_path(tmp_path, 5)
    with safe_open(str(spath), framework="pt") as f:
        metadata = f.metadata()
    save_file({**load_file(str(spath)), "m": torch.randn(n).to(dtype)}, str(spath), metadata=metadata)
    with pytest.raises(LlmpyError, match=r"state_00000005\.safetensors: tensor 'm' fails its checksum"):
        ts.load_checkpoint(tmp_path, 5)
