"""The Python API: create, train, sample, on a tiny model and random shards."""
import re

import numpy as np
import pytest
import torch

import llmpy
from llmpy.errors import LlmpyError
from llmpy.data import write_shard


def test_create_train_sample(tmp_path):
    rng = np.random.default_rng()
    # a learnable stream: a repeated random phrase, so the loss must fall
    phrase = rng.integers(0, 256, 40)
    write_shard(tmp_path / "t_train_000000.bin", np.tile(phrase, 100))
    write_shard(tmp_path / "t_val_000000.bin", np.tile(phrase, 20))
    model = llmpy.create_model("layers=1,channels=32,heads=2,seq=32,vocab=257")
    assert model.config.padded_vocab_size == 384
    result = llmpy.train(log=lambda *_: None, train_data=str(tmp_path / "t_train_*.bin"),
                         val_data=str(tmp_path / "t_val_*.bin"), model="layers=1,channels=32,heads=2,seq=32,vocab=257",
                         batch_size=4, seq_len=32, max_steps=30, learning_rate=1e-2, val_every=10, val_max_steps=2,
                         gen_tokens=0, progress=0)
    assert len(result.train_losses) == 30
    assert result.train_losses[-1] < 0.5 * result.train_losses[0]
    assert result.val_losses[-1][1] < result.val_losses[0][1]
    text = llmpy.sample(result.model, "ab", gen_tokens=5, temperature=0)
    assert isinstance(text, str) and len(text) > 0


def test_sample_with_the_kernel_model_matches_the_reference(device):
    """sample() takes the kernel model train() returns on a GPU (logits_last on its fixed (B, T) batch)
    and continues a prompt as the CPU reference does (fp32, greedy: the same tokens)."""
    import torch
    from llmpy.model import GPT2Model
    ref_model = llmpy.create_model("layers=1,channels=32,heads=2,seq=16,vocab=257", seed=3)
    kernel_model = GPT2Model(ref_model.config, ref_model.params_flat, 2, 8, device=device, dtype=torch.float32,
                             cuda_graph=False)
    # 12 tokens from a 3-token prompt: the context outgrows the model's T = 8 and is cropped to the last 8
    want = llmpy.sample(ref_model, "ab", gen_tokens=12, temperature=0)
    got = llmpy.sample(kernel_model, "ab", gen_tokens=12, temperature=0)
    assert got == want


TINY = "layers=1,channels=16,heads=2,seq=16,vocab=257"


@pytest.mark.parametrize("call, message", [
    (lambda m: llmpy.train(batchsize=4), "train(): no option 'batchsize'; did you mean 'batch_size'?"),
    (lambda m: llmpy.train(colour=1), "train(): no option 'colour'"),
    (lambda m: llmpy.train("data/*.bin"), "train('data/*.bin'): options are given by name, as "
                                          "train(train_data=..., model=...)"),
    (lambda m: llmpy.train(val_data=""), "-j (val_data=''): an empty name"),  # the demo's own split is not taken
    (lambda m: llmpy.create_model(None), "descriptor None: must be a descriptor or a model file's path"),
    (lambda m: llmpy.create_model(TINY, seed=1.5), "seed 1.5: must be an integer"),
    (lambda m: llmpy.create_model(TINY, seed=2**32), "seed 4294967296: must be an integer from 0 to 4294967295"),
    (lambda m: llmpy.load_model(None), "path None: must be a model file's path"),
    (lambda m: llmpy.load_model("d6"), "d6: no such file"),
    (lambda m: llmpy.sample("model.bin", "hi"), "sample(): model 'model.bin': must be a model"),
    (lambda m: llmpy.sample(m, 123), "prompt 123: must be text"),
    (lambda m: llmpy.sample(m, "hi", temperature=float("nan")), "--temperature nan: must be a finite number"),
    (lambda m: llmpy.sample(m, "hi", temperature=-1), "--temperature -1: must be >= 0"),
    (lambda m: llmpy.sample(m, "hi", top_k=-3), "--top-k -3: must be >= 0"),
    (lambda m: llmpy.sample(m, "hi", gen_tokens=-1), "-g -1: must be >= 0"),
    (lambda m: llmpy.sample(m, "hi", gen_tokens=2.5), "-g 2.5: must be an integer"),
    (lambda m: llmpy.sample(m, "hi", seed=2**64), "--seed 18446744073709551616: must be an integer from 0"),
    (lambda m: llmpy.sample(m, tokenizer=None), "tokenizer None: must be 'auto', 'bytes' or 'gpt2'"),
    # an OverflowError traceback from float()
    (lambda m: llmpy.sample(m, "hi", temperature=10**400), "--temperature 10000000000000000000...: too large"),
    (lambda m: llmpy.train(learning_rate=10**400), "-l (learning_rate=10000000000000000000...): too large"),
    # the demo run (no data, no model) looked the device up before checking it: a KeyError traceback
    (lambda m: llmpy.train(device="gpu", max_steps=1), "--device gpu: must be auto, cpu or cuda"),
    (lambda m: llmpy.train(device=3, max_steps=1), "--device 3: must be auto, cpu or cuda"),
])
def test_api_refuses_wrong_values_by_name(call, message):
    """The API's callers pass values the command line's parser never sees: each wrong one is an LlmpyError
    naming the parameter, as the flag's would be, not a TypeError from deep inside."""
    model = llmpy.create_model(TINY)
    with pytest.raises(LlmpyError) as e:
        call(model)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_model_reads_files_only(tmp_path):
    from llmpy.checkpoint import save_llmc
    model = llmpy.create_model(TINY, seed=5)
    save_llmc(tmp_path / "m.bin", model.config, model.params_flat)
    loaded = llmpy.load_model(tmp_path / "m.bin")
    assert loaded.config == model.config and (loaded.params_flat == model.params_flat).all()


def test_api_takes_numpys_numbers(tmp_path):
    # values from a numpy sweep are numbers too; the state's JSON gets them as Python's
    write_shard(tmp_path / "t_train_000000.bin", np.random.default_rng().integers(0, 257, 400))
    result = llmpy.train(log=lambda *_: None, train_data=str(tmp_path / "t_train_*.bin"), model=TINY,
                         batch_size=np.int64(2), seq_len=np.int32(8), max_steps=np.int64(2),
                         learning_rate=np.float32(1e-3), seed=np.uint32(7), gen_tokens=0, progress=0,
                         output_dir=tmp_path / "out")
    assert len(result.train_losses) == 2 and (tmp_path / "out" / "state_00000002.safetensors").exists()
    model = llmpy.create_model(TINY, seed=np.int64(3))
    assert llmpy.sample(model, "a", gen_tokens=np.int64(3), temperature=np.float32(0), seed=np.uint32(7)) == \
        llmpy.sample(model, "a", gen_tokens=3, temperature=0.0, seed=7)


def test_sample_reads_gpt2_files_from_tokenizer_dir(shared_data, monkeypatch, tmp_path):
    """sample(tokenizer_dir=...) as `llmpy sample --tokenizer-dir`: no environment variable, no tiktoken cache."""
    gpt2_dir = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe") / "gpt2"
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: tiktoken's copies are not there
    model = llmpy.create_model("layers=1,channels=16,heads=2,seq=16", seed=5)
    with pytest.raises(LlmpyError, match=r"not on this machine: set LLMPY_GPT2_DIR \(`llmpy sample` and `llmpy "
                                         r"prepare` also take --tokenizer-dir, the API's sample\(\) tokenizer_dir\)"):
        llmpy.sample(model, "Hello", gen_tokens=3)
    text = llmpy.sample(model, "Hello", gen_tokens=6, temperature=0, tokenizer_dir=gpt2_dir)
    assert isinstance(text, str) and text
    assert text == llmpy.sample(model, "Hello", gen_tokens=6, temperature=0, tokenizer_dir=str(gpt2_dir))
    with pytest.raises(LlmpyError, match="tokenizer_dir 3: must be a folder's path"):
        llmpy.sample(model, "Hello", tokenizer_dir=3)
    # bytes serve a larger vocab (a byte-level run of GPT-2's: the ids 0-256 of it); the other way round is one
    # error before any token is drawn
    assert isinstance(llmpy.sample(model, "Hello", tokenizer="bytes", gen_tokens=3), str)
    byte_model = llmpy.create_model("layers=1,channels=16,heads=2,seq=16,vocab=257", seed=5)
    with pytest.raises(LlmpyError, match="vocab of 257 does not match the gpt2 tokenizer's 50257"):
        llmpy.sample(byte_model, "Hello", tokenizer="gpt2", tokenizer_dir=gpt2_dir)
    # said first even without GPT-2's files, which it could not use anyway (they were asked for instead)
    with pytest.raises(LlmpyError, match="vocab of 257 does not match the gpt2 tokenizer's 50257"):
        llmpy.sample(byte_model, "Hello", tokenizer="gpt2")
    # a vocabulary neither tokenizer has: said so, not that GPT-2's files are missing
    odd_model = llmpy.create_model("layers=1,channels=16,heads=2,seq=16,vocab=1000", seed=5)
    with pytest.raises(LlmpyError, match=r"^sample\(\): the model's vocab of 1000 fits neither of llmpy's tokenizers "
                                         r"\(bytes: 257 tokens, gpt2: 50257\)"):
        llmpy.sample(odd_model, "Hello")


@pytest.mark.parametrize("options, needle", [
    ({"train_data": ""}, "-i (train_data=''): an empty name; leave it out for its default"),
    ({"val_data": " "}, "-j (val_data=' '): an empty name"),
    ({"output_dir": ""}, "-o (output_dir=''): an empty name"),
    ({"model": ""}, "-e (model=''): an empty name"),
    ({"output_dir": "a\0b"}, "-o (output_dir='a\\x00b'): a file name cannot hold a NUL character"),
    ({"log": None}, "train(): log=None must be a function of one str"),
])
def test_train_refuses_empty_names_nul_characters_and_a_log_that_is_no_function(tmp_path, monkeypatch, options,
                                                                                 needle):
    monkeypatch.chdir(tmp_path)  # an empty -o was the current folder: nothing may land there
    log = options.pop("log", print)
    with pytest.raises(LlmpyError) as e:
        llmpy.train(log=log, max_steps=1, device="cpu", **options)
    assert needle in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_descriptor_wins_over_a_folder_of_its_name_and_a_model_of_its_name_is_ambiguous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d6").mkdir()  # e.g. a run's -o named after its model
    assert llmpy.create_model("d6", seed=3).config.num_layers == 6
    tiny = "layers=1,channels=16,heads=2,seq=16,vocab=257"
    from llmpy.checkpoint import save_llmc
    model = llmpy.create_model(tiny, seed=4)
    save_llmc(tmp_path / "gpt2", model.config, model.params_flat)  # an llm.c model file named like a descriptor
    with pytest.raises(LlmpyError, match=r"-e gpt2: both a model descriptor and the model at \./gpt2; write "
                                         r"\./gpt2 for that model"):
        llmpy.create_model("gpt2")
    assert torch.equal(llmpy.create_model("./gpt2").params_flat, model.params_flat)


def test_sample_refuses_a_tokenizer_dir_for_the_bytes_tokenizer(tmp_path):
    model = llmpy.create_model("layers=1,channels=16,heads=2,seq=16,vocab=257", seed=5)
    with pytest.raises(LlmpyError, match="tokenizer_dir .*: the bytes tokenizer has no files; leave it out"):
        llmpy.sample(model, "a", tokenizer="bytes", tokenizer_dir=tmp_path)
    # "auto" picks bytes for this model: the folder, even a missing one, was ignored without a word
    with pytest.raises(LlmpyError, match=r"^tokenizer_dir '.*missing': the model's 257-token vocab samples with the "
                                         r"bytes tokenizer, which has no files; leave it out$"):
        llmpy.sample(model, "a", tokenizer_dir=tmp_path / "missing")


@pytest.mark.parametrize("progress", [0, 1])
def test_every_line_of_a_run_goes_to_the_log_function(tmp_path, capsys, progress):
    # with the progress bar on too, the step lines and the closing line reach the caller's log, not stdout
    rng = np.random.default_rng()
    write_shard(tmp_path / "t_train_000000.bin", rng.integers(0, 257, 3000))
    lines = []
    llmpy.train(log=lines.append, train_data=str(tmp_path / "t_train_*.bin"), device="cpu", progress=progress,
                model="layers=1,channels=16,heads=2,seq=16,vocab=257", batch_size=2, seq_len=16, max_steps=3,
                val_every=0, gen_tokens=0)
    assert sum(line.startswith("step ") for line in lines) == 3 and lines[-1].startswith("done: 3 steps")
    assert capsys.readouterr().out == ""


def test_a_one_step_run_ends_with_a_done_line(tmp_path):
    # the closing line needed two steps for its median, so a one-step run ended without it
    rng = np.random.default_rng()
    write_shard(tmp_path / "t_train_000000.bin", rng.integers(0, 257, 3000))
    lines = []
    result = llmpy.train(log=lines.append, train_data=str(tmp_path / "t_train_*.bin"), device="cpu", progress=0,
                         model="layers=1,channels=16,heads=2,seq=16,vocab=257", batch_size=2, seq_len=16,
                         max_steps=1, val_every=0, gen_tokens=0)
    assert re.fullmatch(r"done: 1 step, \d+\.\d ms, warm-up included, final train loss \d+\.\d{4}", lines[-1])
    assert lines[-1].endswith(f"{result.train_losses[-1]:.4f}")


def test_a_run_notes_the_shards_too_small_for_one_batch(tmp_path):
    # `llmpy prepare` ends a split with whatever rest its last shard gets: training stopped at it
    rng = np.random.default_rng()
    write_shard(tmp_path / "t_train_000000.bin", rng.integers(0, 257, 3000))
    write_shard(tmp_path / "t_train_000001.bin", rng.integers(0, 257, int(rng.integers(1, 2 * 16 + 1))))
    write_shard(tmp_path / "t_val_000000.bin", rng.integers(0, 257, 500))
    write_shard(tmp_path / "t_val_000001.bin", rng.integers(0, 257, 7))
    lines = []
    llmpy.train(log=lines.append, train_data=str(tmp_path / "t_train_*.bin"), val_data=str(tmp_path / "t_val_*.bin"),
                device="cpu", progress=0, model="layers=1,channels=16,heads=2,seq=16,vocab=257", batch_size=2,
                seq_len=16, max_steps=3, val_every=3, val_max_steps=1, gen_tokens=0)
    notes = [line for line in lines if line.startswith("note: set aside")]
    small = (tmp_path / "t_train_000001.bin").stat().st_size // 2 - 512
    assert notes == [f"note: set aside, too small for one batch of B*T*processes+1 = 33 tokens: t_train_000001.bin "
                     f"({small} tokens)",
                     "note: set aside, too small for one batch of B*T*processes+1 = 33 tokens: t_val_000001.bin "
                     "(7 tokens)"]
    assert sum(line.startswith("step ") for line in lines) == 3


def test_val_max_steps_minus_one_validates_on_the_whole_split():
    # llm.c's -m -1: every batch of the validation split (it was refused)
    import tempfile
    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory() as d:
        write_shard(f"{d}/t_train_000000.bin", rng.integers(0, 257, 2000))
        batches = int(rng.integers(3, 9))
        write_shard(f"{d}/t_val_000000.bin", rng.integers(0, 257, batches * 2 * 16 + 1))
        common = dict(log=lambda *_: None, train_data=f"{d}/t_train_*.bin", val_data=f"{d}/t_val_*.bin", device="cpu",
                      model="layers=1,channels=16,heads=2,seq=16,vocab=257", batch_size=2, seq_len=16, max_steps=2,
                      val_every=2, gen_tokens=0, progress=0)
        whole = llmpy.train(val_max_steps=-1, **common).val_losses
        assert whole == llmpy.train(val_max_steps=batches, **common).val_losses
        assert whole != llmpy.train(val_max_steps=batches - 1, **common).val_losses


@pytest.mark.parametrize("desc, message", [
    # the sizes were refused under GPT2Config's field names, with neither the descriptor nor its key named
    ("layers=0,channels=16,heads=2", "model descriptor 'layers=0,channels=16,heads=2': layers must be positive, got 0"),
    ("layers=1,channels=-16,heads=2", "model descriptor 'layers=1,channels=-16,heads=2': channels must be positive, "
                                      "got -16"),
    ("layers=1,channels=16,heads=0", "model descriptor 'layers=1,channels=16,heads=0': heads must be positive, got 0"),
    ("layers=1,channels=16,heads=2,seq=0", "model descriptor 'layers=1,channels=16,heads=2,seq=0': seq must be "
                                           "positive, got 0"),
    ("layers=1,channels=16,heads=2,vocab=-5", "model descriptor 'layers=1,channels=16,heads=2,vocab=-5': vocab must "
                                              "be positive, got -5"),
    ("layers=1,channels=16,heads=3", "model descriptor 'layers=1,channels=16,heads=3': channels 16 is not divisible "
                                     "by heads 3"),
])
def test_descriptor_sizes_are_refused_naming_the_descriptor(desc, message):
    for call in (lambda: llmpy.parse_descriptor(desc), lambda: llmpy.create_model(desc)):
        with pytest.raises(LlmpyError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.parametrize("desc", ["d1_2", "d+12", "d١٢", "gpt3:c7_68", "layers=1_2,channels=16,heads=2",
                                  "layers=+1,channels=16,heads=2", "layers=2,channels=1_6,heads=2", "d" + "9" * 5000,
                                  "layers=" + "1" * 3000 + ",channels=16,heads=2", "x" * 3000 + "=2"])
def test_descriptor_sizes_are_plain_decimal_digits(desc):
    # int() took "1_2" as 12, "+1" and other scripts' digits (d1_2 trained d12); a 5,000-digit size is not echoed
    with pytest.raises(LlmpyError) as e:
        llmpy.parse_descriptor(desc)
    msg = str(e.value)
    assert len(msg) < 400 and ("must be an integer" in msg or "descriptor" in msg), msg


def test_descriptor_sizes_may_have_leading_zeros():
    assert llmpy.parse_descriptor("layers=01,channels=16,heads=2,seq=" + "0" * 20 + "16").max_seq_len == 16


@pytest.mark.parametrize("desc", ["runs/lr=3e-4/model_00001000.bin", "sweep/wd=0.1/model", "run_lr=3e-4.bin"])
def test_a_missing_model_file_with_an_equals_sign_is_no_such_file(desc):
    # a sweep's folder names hold "=": the path was read as a layers=... descriptor ("bad model descriptor part")
    for call in (lambda: llmpy.parse_descriptor(desc), lambda: llmpy.create_model(desc)):
        with pytest.raises(LlmpyError) as e:
            call()
        assert str(e.value) == f"{desc}: no such model file"


def test_sample_refuses_a_seed_of_none_by_name():
    # check_sampling_options skips a None seed (the trainer's own), so it reached int(None): a TypeError traceback
    model = llmpy.create_model(TINY)
    with pytest.raises(LlmpyError, match=r"^--seed None: must be an integer from 0 to 4294967295$"):
        llmpy.sample(model, "hi", seed=None)


@pytest.mark.parametrize("prompt, message", [
    ("abc\ud800", r"^--prompt: a lone surrogate '\\ud800' at character 3, not Unicode text$"),
    ("\ud800\udc80x", r"^--prompt: a lone surrogate '\\ud800\\udc80' at character 0, not Unicode text$"),
    ("a\udcff", r"^--prompt: not UTF-8 text \(the bytes b'\\xff' at character 1\)$"),  # a terminal's byte 0xff
])
def test_sample_refuses_a_prompt_that_is_not_unicode_in_one_line(prompt, message):
    # a str made in Python can hold any lone surrogate; naming it as a byte raised a UnicodeEncodeError traceback
    with pytest.raises(LlmpyError, match=message):
        llmpy.sample(llmpy.create_model(TINY), prompt)


def test_create_model_reads_a_quoted_home_folder(tmp_path, monkeypatch):
    # train(model="~/m.bin") and load_model("~/m.bin") read the home folder; create_model said "no such model file"
    from llmpy.checkpoint import save_llmc
    monkeypatch.setenv("HOME", str(tmp_path))
    model = llmpy.create_model(TINY, seed=5)
    save_llmc(tmp_path / "m.bin", model.config, model.params_flat)
    assert torch.equal(llmpy.load_model("~/m.bin").params_flat, model.params_flat)
    assert torch.equal(llmpy.create_model("~/m.bin").params_flat, model.params_flat)


def test_the_lazily_loaded_api_is_in_dir():
    # a notebook's completion lists dir(llmpy): create_model, train, ... are loaded on first use, not module globals
    assert set(llmpy.__all__) <= set(dir(llmpy))


def test_sample_names_auto_among_the_tokenizers_it_takes():
    # load_tokenizer's own line listed gpt2 and bytes only, though sample's default is auto
    import llmpy
    model = llmpy.create_model(TINY, seed=3)
    with pytest.raises(LlmpyError, match=r"^unknown tokenizer 'bpe': expected one of auto, gpt2, bytes$"):
        llmpy.sample(model, "hi", tokenizer="bpe", gen_tokens=2)
    assert isinstance(llmpy.sample(model, "hi", tokenizer=" Auto ", gen_tokens=2), str)  # as "auto"


@pytest.mark.parametrize("caller_tf32", [False, True])
def test_train_gives_the_callers_tf32_setting_back(tmp_path, caller_tf32, monkeypatch, device):
    # -f sets torch's TF32 flag for the run (llm.c's -f: its own cuBLAS calls only); it stayed set in the caller's
    # process after train() returned, changing a notebook's own fp32 matrix products. The kernel model runs where
    # the kernels run: the GPU, or the interpreter that conftest sets up on a CPU machine
    import torch
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", caller_tf32)
    write_shard(tmp_path / "t_train_000000.bin", np.random.default_rng().integers(0, 257, 500))
    seen = []
    llmpy.train(log=lambda line: seen.append(torch.backends.cuda.matmul.allow_tf32), device=device, engine="kernels",
                tf32=int(not caller_tf32), train_data=str(tmp_path / "t_train_000000.bin"), model=TINY, batch_size=2,
                seq_len=16, max_steps=1, val_every=0, gen_tokens=0, progress=0)
    assert seen[-1] is (not caller_tf32)  # the run's
    assert torch.backends.cuda.matmul.allow_tf32 is caller_tf32


def test_sample_refuses_another_librarys_model_in_one_line():
    # a transformers GPT2LMHeadModel (what `llmpy export` makes, loaded back by transformers) has a config and a
    # forward too: it passed the check and sampling died in an AttributeError traceback (no config.max_seq_len)
    class OtherLibrarysModel:
        class config:
            vocab_size = 257
            n_positions = 16

        def forward(self, input_ids):
            return None

        def __repr__(self):  # as a torch module's: a line for each layer
            return "GPT2LMHeadModel(\n  (transformer): GPT2Model(\n    (wte): Embedding(257, 16)\n  )\n)"
    with pytest.raises(LlmpyError) as e:
        llmpy.sample(OtherLibrarysModel(), "hi", gen_tokens=2)
    assert str(e.value) == ("sample(): model GPT2LMHeadModel( (transformer): GPT2Model( (wte): Embedding(: must be "
                            "a model of llmpy's (create_model, load_model, or train(...).model); load_model reads a "
                            "model file or a transformers folder")


def test_a_wrong_value_shows_on_its_error_line():
    # the value shown in the error line stays on that line: a torch module's repr put a line break in it for each layer
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    tiny = llmpy.create_model(TINY)
    for call in (lambda: llmpy.create_model(module), lambda: llmpy.load_model(module),
                 lambda: llmpy.sample(tiny, "hi", tokenizer=module), lambda: llmpy.sample(module, "hi")):
        with pytest.raises(LlmpyError) as e:
            call()
        assert "\n" not in str(e.value) and "Sequential( (0): Linear" in str(e.value), str(e.value)


def test_sample_names_its_own_argument_for_an_empty_tokenizer_dir():
    # the tokenizer's check said "--tokenizer-dir ''", a flag the API does not have
    model = llmpy.create_model("layers=1,channels=16,heads=2,seq=16", seed=5)
    with pytest.raises(LlmpyError, match=r"^tokenizer_dir '': an empty folder name; leave it out \(None\)"):
        llmpy.sample(model, "Hello", gen_tokens=2, tokenizer_dir="")
