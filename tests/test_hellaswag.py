"""HellaSwag: llm.c's eval file read back exactly, its corruptions refused in one line, the batched
scoring checked against a row-by-row oracle, `llmpy train -h 1` logging accuracy, and `llmpy prepare
hellaswag` offline."""
import io
import json
import os
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
import torch

from llmpy import hellaswag as hs
from llmpy import prepare as prep
from llmpy.config import parse_descriptor
from llmpy.data import write_shard
from llmpy.errors import LlmpyError
from llmpy.hellaswag import Example, read_eval_file, score, write_eval_file
from llmpy.init import init_parameters
from llmpy.reference import GPT2Reference

from cli_helpers import SRC, assert_one_line_error, llmpy

TINY = "layers=1,channels=16,heads=2,seq=32,vocab=257"


def random_examples(n, rng, vocab=257, max_ctx=12, max_comp=6):
    return [Example(i, int(rng.integers(0, 4)), rng.integers(0, vocab, int(rng.integers(1, max_ctx))).tolist(),
                    [rng.integers(0, vocab, int(rng.integers(1, max_comp))).tolist() for _ in range(4)])
            for i in range(n)]


@pytest.fixture
def eval_file(tmp_path):
    exs = random_examples(5, np.random.default_rng(0))
    return write_eval_file(tmp_path / "hs.bin", exs), exs


# ----------------------------------------------------------------------------------------------
# the file

def test_round_trip_and_layout(eval_file):
    path, exs = eval_file
    assert read_eval_file(path) == exs
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [20240522, 1, 5]
    s = np.frombuffer(raw[1024:], dtype="<u2")
    ex = exs[0]
    expect = [65535, 0, 0, ex.label, 4, len(ex.context), *ex.context]
    for c in ex.completions:
        expect += [len(c), *c]
    expect[1] = 2 * len(expect)  # the record's size in bytes, itself included
    assert s[:len(expect)].tolist() == expect
    assert s[len(expect)] == 65535  # the next example starts right after
    assert header[3] == max(2 * (6 + len(e.context) + sum(1 + len(c) for c in e.completions)) for e in exs)


def _patched(path, offset, values, dtype):
    raw = bytearray(path.read_bytes())
    b = np.asarray(values, dtype=dtype).tobytes()
    raw[offset:offset + len(b)] = b
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("corrupt, needle", [
    (lambda p: _patched(p, 0, [20240520], "<i4"), "magic"),
    (lambda p: _patched(p, 4, [2], "<i4"), "version"),
    (lambda p: _patched(p, 8, [6], "<i4"), "truncated"),
    (lambda p: _patched(p, 1024, [65534], "<u2"), "delimiter"),
    (lambda p: p.write_bytes(p.read_bytes()[:-6]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "header"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0\0"), "after the last"),
    (lambda p: _patched(p, 1024 + 6, [7], "<u2"), "label"),
    (lambda p: _patched(p, 1024 + 8, [3], "<u2"), "completions"),
    (lambda p: _patched(p, 1024 + 4, [1], "<u2"), "index"),
    (lambda p: _patched(p, 1024 + 2, [400], "<u2"), "example 0"),
    (lambda p: _patched(p, 12, [2], "<i4"), "longest"),
])
def test_corrupt_files_are_one_line_errors(eval_file, corrupt, needle):
    path, _ = eval_file
    corrupt(path)
    with pytest.raises(LlmpyError) as e:
        read_eval_file(path)
    msg = str(e.value)
    assert "hs.bin" in msg and needle in msg and "\n" not in msg


def test_a_wrong_big_file_is_refused_from_its_header(tmp_path):
    # a token shard (or any big file) given as --hellaswag-file: refused after its header, not read whole first
    import tracemalloc
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng().integers(0, 2**16, 16 << 20, dtype=np.uint16).tobytes())
    tracemalloc.start()
    try:
        with pytest.raises(LlmpyError, match=r"big\.bin: bad magic"):
            read_eval_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), peak


def test_a_pipe_or_a_folder_is_no_eval_file(tmp_path):
    # reading a FIFO would wait for a writer for ever (`train -h 1 --hellaswag-file` hung)
    os.mkfifo(tmp_path / "hs.bin")
    with pytest.raises(LlmpyError, match=r"hs\.bin: not a regular file, so not a HellaSwag eval file"):
        read_eval_file(tmp_path / "hs.bin")
    with pytest.raises(LlmpyError, match=rf"^{tmp_path}: is a folder, not a HellaSwag eval file"):
        read_eval_file(tmp_path)


def test_write_refuses_what_read_refuses(tmp_path):
    # an empty context or completion would be written, then refused by read_eval_file at `train -h 1`
    for ctx, comps in (([], [[1], [2], [3], [4]]), ([5], [[1], [], [3], [4]])):
        with pytest.raises(LlmpyError, match=r"x\.bin: example 0 has an empty context or completion"):
            write_eval_file(tmp_path / "x.bin", [Example(0, 1, ctx, comps)])
    assert not (tmp_path / "x.bin").exists()


def test_missing_file_and_vocab(tmp_path, eval_file):
    with pytest.raises(LlmpyError, match="nothere.bin.*llmpy prepare hellaswag"):
        read_eval_file(tmp_path / "nothere.bin")
    path, exs = eval_file
    top = max(exs[0].context + sum(exs[0].completions, []))  # the first example already has ids >= 10
    with pytest.raises(LlmpyError, match=rf"hs.bin: example 0: token id {top} .*vocabulary of 10"):
        read_eval_file(path, vocab_size=10)


# ----------------------------------------------------------------------------------------------
# scoring

def oracle(model: GPT2Reference, examples, T, V):
    """Row by row, no padding: log-softmax of the logits, mean -log p over the completion's tokens."""
    preds = []
    for ex in examples:
        means = []
        for comp in ex.completions:
            row = (ex.context + comp)[-(T + 1):]  # the documented crop: context from the left
            ncomp = min(len(comp), len(row) - 1)
            model.forward(torch.tensor([row[:-1]]))
            logp = torch.log_softmax(model.logits[0, :, :V].double(), -1)
            tgt = torch.tensor(row[1:])
            nll = -logp[torch.arange(len(tgt)), tgt]
            means.append(float(nll[-ncomp:].mean()))
        preds.append(int(np.argmin(means)))
    return preds


@pytest.mark.parametrize("B", [4, 8])
def test_batched_score_matches_row_by_row_oracle(B):
    cfg = parse_descriptor(TINY)
    model = GPT2Reference(cfg, init_parameters(cfg, seed=3))
    rng = np.random.default_rng(1)
    exs = random_examples(7, rng)  # 7 examples: a partial last batch of padding rows
    exs.append(Example(7, 2, rng.integers(0, 257, 30).tolist(), [rng.integers(0, 257, 5).tolist() for _ in range(4)]))
    T = 16  # the last example is longer than T + 1: cropped
    want = oracle(model, exs, T, cfg.vocab_size)

    def position_losses(x, y):
        assert x.shape == (B, T) and y.shape == (B, T)
        model.forward(x, y)
        return model.losses
    res = score(exs, position_losses, B, T)
    assert res.predictions == want
    assert res.total == 8 and res.correct == sum(p == e.label for p, e in zip(want, exs))
    assert res.accuracy == res.correct / 8


def test_the_likely_completion_wins():
    """A fake model to which token 7 is certain: the completion made of 7s is picked, whatever its slot,
    and context tokens (also 7s here) do not count."""
    exs = [Example(i, i % 4, [7] * 5, [[7, 7, 7] if k == i % 4 else [7, 3, 7] for k in range(4)]) for i in range(6)]

    def position_losses(x, y):
        return torch.where(y == 7, 0.0, 5.0)
    res = score(exs, position_losses, 8, 10)
    assert res.predictions == [e.label for e in exs] and res.accuracy == 1.0


def test_batch_not_a_multiple_of_four():
    with pytest.raises(LlmpyError, match="-b 6.*multiple of 4"):
        score(random_examples(2, np.random.default_rng(0)), lambda x, y: torch.zeros_like(x, dtype=torch.float), 6, 8)


# ----------------------------------------------------------------------------------------------
# the command line



def test_train_with_hellaswag_logs_accuracy(tmp_path, eval_file):
    path, exs = eval_file
    rng = np.random.default_rng(2)
    train, val = tmp_path / "t_train_000000.bin", tmp_path / "t_val_000000.bin"
    write_shard(train, rng.integers(0, 257, 3000))
    write_shard(val, rng.integers(0, 257, 1000))
    out = tmp_path / "out"
    common = ["-i", train, "-j", val, "-e", TINY, "-t", 16, "-x", 4, "-v", 2, "-m", 1, "-g", 0, "--progress", 0]
    res = llmpy("train", *common, "-b", 4, "-h", 1, "--hellaswag-file", path, "-o", out)
    assert res.returncode == 0, res.stderr
    # steps 2 and the end; as llm.c, not step 0 (a random model: a whole pass over the file for nothing)
    assert res.stdout.count("HellaSwag: ") == 2
    evals = [l for l in (out / "main.log").read_text().splitlines() if " eval:" in l]
    assert [l.split()[0] for l in evals] == ["s:2", "s:4"]
    recs = [json.loads(l) for l in (out / "main.jsonl").read_text().splitlines()]
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in ev] == [2, 4]
    assert [r["step"] for r in recs if r["kind"] == "val"] == [0, 2, 4]  # the validation loss is at step 0 too
    for r, l in zip(ev, evals):
        assert r["total"] == len(exs) and r["accuracy"] == r["correct"] / len(exs)
        assert l == f"s:{r['step']} eval:{r['accuracy']:.4f}"
    # -h 1 needs B a multiple of 4, and an eval file that exists
    assert_one_line_error(llmpy("train", *common, "-b", 2, "-h", 1, "--hellaswag-file", path), "-b 2", "multiple of 4")
    assert_one_line_error(llmpy("train", *common, "-b", 4, "-h", 1, "--hellaswag-file", tmp_path / "none.bin"),
                   "none.bin", "llmpy prepare hellaswag")


# ----------------------------------------------------------------------------------------------
# prepare

class _FakeResponse(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.headers = {"Content-Length": str(len(data))}


def test_prepare_hellaswag_offline_is_one_clean_error(tmp_path, monkeypatch, capsys):
    from llmpy import cli

    def offline(url, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(prep, "_urlopen", offline)
    assert cli.main(["prepare", "hellaswag", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")]) != 0
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and hs.HELLASWAG_VAL_URL in err[0] and "hellaswag_val.jsonl" in err[0]
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]


def test_prepare_hellaswag_with_fake_download(tmp_path, monkeypatch):
    rows = [{"ctx": "A man is", "label": 2, "endings": ["a", "bb", "walking.", "ccc"]},
            {"ctx": "She", "label": 0, "endings": ["runs", "x", "y", "z"]}]
    data = "\n".join(json.dumps(r) for r in rows).encode()
    urls = []
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: urls.append(url) or _FakeResponse(data))
    prep.prepare("hellaswag", tmp_path / "o", tokenizer="bytes", cache_dir=tmp_path / "c", log=lambda m: None)
    assert urls == [hs.HELLASWAG_VAL_URL]
    got = read_eval_file(tmp_path / "o" / "hellaswag_val.bin")
    enc = lambda s: list(s.encode())  # noqa: E731  the byte tokenizer's ids
    assert got == [Example(i, r["label"], enc(r["ctx"]), [enc(" " + e) for e in r["endings"]])
                   for i, r in enumerate(rows)]


@pytest.mark.parametrize("record, needle", [
    ({"ctx": "A man", "label": 7, "endings": ["a", "b", "c", "d"]}, "label 7, not one of 0..3"),
    ({"ctx": "A man", "label": 1, "endings": ["a", "b"]}, "endings must be a list of 4 texts"),
    ({"ctx": "A man", "endings": ["a", "b", "c", "d"]}, "no 'label' field"),
    # int() took these (Infinity as an OverflowError traceback), and len() an object's keys as the endings
    ({"ctx": "A man", "label": float("inf"), "endings": ["a", "b", "c", "d"]}, "label Infinity, not an integer"),
    ({"ctx": "A man", "label": 1.7, "endings": ["a", "b", "c", "d"]}, "label 1.7, not an integer"),
    ({"ctx": "A man", "label": True, "endings": ["a", "b", "c", "d"]}, "label true, not an integer"),
    ({"ctx": "A man", "label": "two", "endings": ["a", "b", "c", "d"]}, 'label "two", not an integer'),
    ({"ctx": "A man", "label": "7", "endings": ["a", "b", "c", "d"]}, "label 7, not one of 0..3"),
    ({"ctx": "A man", "label": 1, "endings": {"a": 1, "b": 2, "c": 3, "d": 4}}, "endings must be a list of 4"),
    ({"ctx": "A man", "label": 1, "endings": ["a", "b", "c", 4]}, "endings must be a list of 4 texts"),
    ({"ctx": 5, "label": 1, "endings": ["a", "b", "c", "d"]}, "ctx must be a text"),
    # no context tokens: read_eval_file refuses the example, so prepare must not write it
    ({"ctx": "", "label": 1, "endings": ["a", "b", "c", "d"]}, "(empty context)"),
    ({"ctx": "A man", "label": 1, "endings": ["a", "b\ud800", "c", "d"]}, "a lone surrogate '\\ud800'"),
    ([1, 2], "a JSON list, not an object"),
    pytest.param("[" * 100_000, "maximum recursion depth", id="nested-too-deep"),  # a RecursionError traceback
])
def test_a_bad_jsonl_record_names_the_jsonl_and_its_line(tmp_path, record, needle):
    from llmpy.tokenizer import ByteTokenizer
    good = {"ctx": "A woman", "label": 2, "endings": ["w", "x", "y", "z"]}
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text(json.dumps(good) + "\n\n" + (record if isinstance(record, str) else json.dumps(record)) + "\n")
    with pytest.raises(LlmpyError) as e:
        hs.examples_from_jsonl(jsonl, ByteTokenizer())
    assert str(e.value).startswith(f"{jsonl}: line 3 is not a HellaSwag example") and needle in str(e.value)



def test_a_line_that_is_not_utf8_is_named_by_its_line(tmp_path):
    # the whole file was decoded at once: the error named a byte offset ("position 1234") and no line
    from llmpy.tokenizer import ByteTokenizer
    rng = np.random.default_rng()
    good = [json.dumps({"ctx": f"c{i}", "label": int(rng.integers(0, 4)), "endings": list("abcd")}) for i in range(3)]
    bad_line = int(rng.integers(2, 4))
    lines = [g.encode() for g in good]
    lines.insert(bad_line - 1, b'{"ctx": "caf\xe9", "label": 1, "endings": ["a", "b", "c", "d"]}')  # latin-1
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(LlmpyError) as e:
        hs.examples_from_jsonl(jsonl, ByteTokenizer())
    assert str(e.value) == (f"{jsonl}: line {bad_line} is not a HellaSwag example (not UTF-8 text: byte 0xe9 at "
                            "column 13)")

def test_line_and_paragraph_separators_inside_a_record_stay_in_its_text(tmp_path):
    # JSON strings may hold U+2028, U+2029 and U+0085 unescaped; str.splitlines() cut a record at them
    from llmpy.tokenizer import ByteTokenizer
    ctx = "A man\u2028sits\u2029down\u0085."
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text(json.dumps({"ctx": ctx, "label": 1, "endings": list("abcd")}, ensure_ascii=False) + "\r\n",
                     encoding="utf-8")
    (example,) = hs.examples_from_jsonl(jsonl, ByteTokenizer())
    assert example.context == list(ctx.encode("utf-8")) and example.label == 1


def test_a_label_written_as_the_text_of_its_number_is_read(tmp_path):
    # HuggingFace's copies of HellaSwag write the label as "0".."3"
    from llmpy.tokenizer import ByteTokenizer
    rng = np.random.default_rng()
    labels = rng.integers(0, 4, 5).tolist()
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text("".join(json.dumps({"ctx": f"c{i}", "label": str(l), "endings": list("abcd")}) + "\n"
                             for i, l in enumerate(labels)))
    assert [ex.label for ex in hs.examples_from_jsonl(jsonl, ByteTokenizer())] == labels


def test_cli_prepare_hellaswag_bad_record_is_one_line_and_keeps_the_earlier_file(tmp_path, capsys):
    from llmpy import cli
    earlier = write_eval_file(tmp_path / "o" / "hellaswag_val.bin", random_examples(3, np.random.default_rng(1)))
    before = earlier.read_bytes()
    (tmp_path / "c" / "hellaswag").mkdir(parents=True)
    (tmp_path / "c" / "hellaswag" / "hellaswag_val.jsonl").write_text(
        '{"ctx": "A man", "label": Infinity, "endings": ["a", "b", "c", "d"]}\n')  # was an OverflowError traceback
    assert cli.main(["prepare", "hellaswag", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"),
                     "--tokenizer", "bytes"]) != 0
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and "hellaswag_val.jsonl: line 1 is not a HellaSwag example (label Infinity" in err[0], err
    assert earlier.read_bytes() == before


def _random_jsonl_rows(rng, n):
    """n HellaSwag records of random words (fresh each run), as hellaswag_val.jsonl holds them."""
    words = ["man", "dog", "runs", "the", "ball", "jumps", "a", "over", "fence", "she", "café", "日本"]
    text = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    return [{"ctx": text(int(rng.integers(1, 8))), "label": int(rng.integers(0, 4)),
             "endings": [text(int(rng.integers(1, 5))) for _ in range(4)]} for _ in range(n)]


def _place_jsonl(cache, rows):
    """The jsonl where `llmpy prepare hellaswag` keeps its download: placed by hand, as offline."""
    (cache / "hellaswag").mkdir(parents=True)
    path = cache / "hellaswag" / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _no_network(url, timeout):
    raise AssertionError(f"{url} fetched")


def test_prepare_hellaswag_does_not_load_torch(tmp_path):
    # the README: `llmpy prepare` runs without loading torch; hellaswag.py imported it at its top (~1.7 s)
    rows = _random_jsonl_rows(np.random.default_rng(), 5)
    _place_jsonl(tmp_path / "c", rows)
    script = (
        "import sys\n"
        "from llmpy import cli\n"
        "rc = cli.main(['prepare', 'hellaswag', '--cache-dir', sys.argv[1], '-o', sys.argv[2], '--tokenizer', "
        "'bytes'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules\n"
        "print('torch-free')\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c"), str(tmp_path / "o")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "torch-free", r.stderr[-2000:]
    enc = lambda s: list(s.encode())  # noqa: E731  the byte tokenizer's ids
    assert read_eval_file(tmp_path / "o" / "hellaswag_val.bin") == [
        Example(i, r["label"], enc(r["ctx"]), [enc(" " + e) for e in r["endings"]]) for i, r in enumerate(rows)]


def test_prepare_hellaswag_refuses_shard_size(tmp_path, monkeypatch, capsys):
    # --shard-size was ignored without a word; the other shard-only flags were refused
    from llmpy import cli
    monkeypatch.setattr(prep, "_urlopen", _no_network)
    _place_jsonl(tmp_path / "c", _random_jsonl_rows(np.random.default_rng(), 3))
    size = int(np.random.default_rng().integers(1, 10**8))
    message = ("hellaswag: --shard-size, --val-fraction, --val-tokens, --name and --text-field do not apply to the "
               "eval file")
    with pytest.raises(LlmpyError) as e:
        prep.prepare("hellaswag", tmp_path / "o", tokenizer="bytes", cache_dir=tmp_path / "c", shard_size=size)
    assert str(e.value) == message
    assert cli.main(["prepare", "hellaswag", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"),
                     "--tokenizer", "bytes", "--shard-size", str(size)]) == 1
    assert capsys.readouterr().err == f"llmpy prepare: error: {message}\n"
    assert not (tmp_path / "o").exists()
    # left out, it is no flag given: the file is written
    assert cli.main(["prepare", "hellaswag", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"),
                     "--tokenizer", "bytes"]) == 0
    assert len(read_eval_file(tmp_path / "o" / "hellaswag_val.bin")) == 3


def test_prepare_hellaswag_into_a_file_says_it_is_no_folder(tmp_path, monkeypatch, capsys):
    # was "afile/hellaswag_val.bin: cannot write (File exists)", after the download and the tokenizing
    from llmpy import cli
    monkeypatch.setattr(prep, "_urlopen", _no_network)
    _place_jsonl(tmp_path / "c", _random_jsonl_rows(np.random.default_rng(), 3))
    afile = tmp_path / "afile"
    content = os.urandom(int(np.random.default_rng().integers(1, 100)))
    afile.write_bytes(content)
    assert cli.main(["prepare", "hellaswag", "-o", str(afile), "--cache-dir", str(tmp_path / "c"),
                     "--tokenizer", "bytes"]) == 1
    # prepare's own wording for an -o that is a file
    assert capsys.readouterr().err == f"llmpy prepare: error: {afile}: a file is there; the output folder must be " \
                                      "a folder\n"
    assert afile.read_bytes() == content


def test_prepare_hellaswag_with_a_folder_where_the_jsonl_goes_says_so(tmp_path, monkeypatch, capsys):
    # was "cannot download ...; without network, place the file at PATH", where a folder already sat at PATH
    from llmpy import cli
    monkeypatch.setattr(prep, "_urlopen", _no_network)
    folder = tmp_path / "c" / "hellaswag" / "hellaswag_val.jsonl"
    folder.mkdir(parents=True)
    inside = folder / f"{os.urandom(4).hex()}.txt"
    inside.write_bytes(os.urandom(16))
    out = tmp_path / "new" / "o"
    assert cli.main(["prepare", "hellaswag", "-o", str(out), "--cache-dir", str(tmp_path / "c"),
                     "--tokenizer", "bytes"]) == 1
    assert capsys.readouterr().err == (f"llmpy prepare: error: {folder}: a folder is there, not the file "
                                       f"{hs.HELLASWAG_VAL_URL} serves; move it away (without network, place the "
                                       "file there)\n")
    assert inside.is_file()  # the folder as it was
    assert not (tmp_path / "new").exists()  # no empty output folder left behind


# ----------------------------------------------------------------------------------------------
# llmpy.files (the writers' helpers prepare hellaswag goes through; no test file of its own in this set)

def test_a_temporary_named_with_an_impossible_process_id_is_no_traceback(tmp_path):
    # os.kill(pid, 0) raised OverflowError past a C int: `train -o` crashed on such a stray file in its folder
    import time
    from llmpy import files
    pid = 10 ** 12 + int(np.random.default_rng().integers(0, 10 ** 9))
    stray = tmp_path / f".model_00000010.bin.{pid}.{os.urandom(4).hex()}.tmp"
    stray.write_bytes(os.urandom(16))
    os.utime(stray, (time.time() - files.ORPHAN_MIN_AGE_S - 5,) * 2)
    kept = tmp_path / "model_00000010.bin"
    kept.write_bytes(os.urandom(16))
    assert files.remove_orphaned_temporaries(tmp_path) == 1  # no process can have that id: a dead writer's
    assert not stray.exists() and kept.exists()
