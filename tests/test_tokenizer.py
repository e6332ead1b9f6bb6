"""Tokenizers: GPT-2 BPE from the verified local files (offline) and the byte tokenizer."""
from __future__ import annotations

import json
import secrets
import unicodedata

import numpy as np
import pytest

from llmpy.errors import LlmpyError
from llmpy.tokenizer import (ByteTokenizer, GPT2Tokenizer, find_gpt2_dir, gpt2_mergeable_ranks,
                             load_tokenizer, split_at_safe_cuts, tiktoken_cached_gpt2_files)


GPT2_FILES = ("gpt2/encoder.json", "gpt2/vocab.bpe")
SHAKESPEARE = "tinyshakespeare/input.txt"


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def gpt2_dir(shared_data):
    return shared_data(*GPT2_FILES) / "gpt2"


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    return GPT2Tokenizer.from_files(gpt2_dir / "encoder.json", gpt2_dir / "vocab.bpe")


@pytest.fixture(params=["gpt2", "bytes"])
def tok(request):
    """Each tokenizer in turn."""
    return request.getfixturevalue("gpt2") if request.param == "gpt2" else ByteTokenizer()


def _random_text(rng, n):
    alphabet = list("abcXYZ 019'.,;\n\t") + ["é", "ß", "€", "日本", "🙂", "\u00a0", "'s", " 've", "  ", "\r\n",
                                              "。", "e\u0301", "\x1c", "\u3000"]
    return "".join(rng.choice(alphabet, n))


# ----------------------------------------------------------------------------------------------
# GPT-2

def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.eot == 50256 and gpt2.vocab_size == 50257
    assert gpt2.decode([15496, 995]) == "Hello world"
    assert gpt2.decode([50256]) == "<|endoftext|>"
    # special-token text is ordinary text when encoding documents, as in llm.c's scripts
    assert 50256 not in gpt2.encode("<|endoftext|>")


def test_gpt2_encode_arrays_are_encode_in_parallel_and_without_lists(gpt2, rng, monkeypatch):
    # encode_arrays (tiktoken's numpy form, pieces on several threads) gives encode's ids, special-token text
    # included as ordinary text; and so does its fallback for a tiktoken without the numpy form
    import llmpy.tokenizer as tk
    texts = [_random_text(rng, int(rng.integers(0, 3000))) for _ in range(9)]
    texts += ["<|endoftext|>", "a <|endoftext|> b<|endoftext|>", ""]
    expect = [gpt2.encode(t) for t in texts]
    monkeypatch.setattr(tk, "ENCODE_THREADS", 3)
    cases = ((gpt2.encode_arrays(texts), expect), (gpt2.encode_arrays(texts[-2:-1]), expect[-2:-1]),
             (tk.Tokenizer.encode_arrays(gpt2, texts), expect))  # the last: the lists' path
    for arrays, want in cases:
        assert all(a.dtype == np.uint16 for a in arrays) and [a.tolist() for a in arrays] == want


def test_encode_arrays_of_no_texts_is_no_arrays(tok):
    # as encode_batch([]); GPT-2's made a pool of 0 threads: a ValueError
    assert tok.encode_arrays([]) == [] and tok.encode_batch([]) == []


def test_gpt2_round_trip_on_shakespeare(gpt2, rng, shared_data):
    text = (shared_data(SHAKESPEARE) / SHAKESPEARE).read_text(encoding="utf-8")
    start = int(rng.integers(0, len(text) - 20000))
    piece = text[start:start + 20000]
    ids = gpt2.encode(piece)
    assert 0 < len(ids) < len(piece) and max(ids) < 50256
    assert gpt2.decode(ids) == piece
    assert text.startswith("First Citizen:") and gpt2.encode("First Citizen:") == [5962, 22307, 25]


def test_gpt2_round_trip_on_random_unicode(gpt2, rng):
    for _ in range(5):
        s = _random_text(rng, int(rng.integers(1, 400)))
        assert gpt2.decode(gpt2.encode(s)) == s


def test_gpt2_pattern_agrees_with_tiktokens_own(gpt2, gpt2_dir, rng, shared_data):
    """Our transcription of GPT-2's split regex against the (equivalent, faster) one tiktoken ships."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    ref = tiktoken.Encoding("ref", pat_str=r50k_pat_str,
                            mergeable_ranks=gpt2_mergeable_ranks(gpt2_dir / "encoder.json", gpt2_dir / "vocab.bpe"),
                            special_tokens={"<|endoftext|>": 50256})
    texts = [_random_text(rng, int(rng.integers(1, 2000))) for _ in range(20)]
    texts += ["I'm sure they'll've  done it's   \n\n  ok?!  ", " \t\n", "a  b   c\n\n\nd", "123456 7.5e-3"]
    shakespeare = shared_data() / SHAKESPEARE
    if shakespeare.is_file():
        texts.append(shakespeare.read_text(encoding="utf-8")[:50000])
    for t in texts:
        assert gpt2.encode(t) == ref.encode_ordinary(t), repr(t[:80])


def test_gpt2_encode_documents(gpt2, rng):
    docs = [_random_text(rng, int(rng.integers(0, 100))) for _ in range(int(rng.integers(2, 6)))]
    stream = gpt2.encode_documents(docs)
    assert stream.dtype == np.uint16
    expect = []
    for d in docs:
        expect += [50256] + gpt2.encode(d)
    assert stream.tolist() == expect


def test_split_at_safe_cuts_cuts_only_where_the_pre_tokenizer_does():
    text = "ab cd  ef\tgh é1 2日 本 ' x 'y z\nw.\n\n 'q\r\n日本。\n\x1c\n \n\u3000\n🙂\ne\u0301\n"
    for size in range(0, len(text) + 2):
        _assert_safe_pieces(list(split_at_safe_cuts(text, size)), text, size)
    assert list(split_at_safe_cuts("", 4)) == [""]
    assert list(split_at_safe_cuts("x" * 50 + " . " + "y" * 10, 4)) == ["x" * 50 + " . " + "y" * 10]  # no safe cut
    # after whitespace (to Python, or to the pattern's \s only: \x1c is neither to the other) a line break is no cut
    assert list(split_at_safe_cuts("x" * 9 + " \n\t\n\x1c\n\u3000\n\n", 4)) == ["x" * 9 + " \n\t\n\x1c\n\u3000\n\n"]
    assert list(split_at_safe_cuts("ab\ncd\r\nef。\ngh", 1)) == ["ab", "\ncd", "\r\nef。", "\ngh"]


def test_a_text_of_lines_without_spaces_is_cut(gpt2):
    """A word a line (a word list, a CSV column) or lines of CJK text had no space between two letters: the whole
    document was one piece, held and encoded at once (870 MB for a 210 MB text); now cut at its line breaks."""
    words = ["alpha", "beta", "γάμμα", "42", "x.y", "日本語。", "🙂", "end,"]
    text = "\n".join(words[i % len(words)] for i in range(5000)) + "\r\n" + "中文的句子。\n" * 300
    pieces = list(split_at_safe_cuts(text, 1000))
    _assert_safe_pieces(pieces, text, 1000)
    assert len(pieces) >= len(text) // 1100
    assert [i for p in pieces for i in gpt2.encode(p)] == gpt2.encode(text)


def test_gpt2_tokens_of_pieces_are_the_whole_texts(gpt2, rng, shared_data):
    # cut at split_at_safe_cuts' spaces, the pre-tokenizer's matches and so the tokens are the whole text's
    texts = [_random_text(rng, int(rng.integers(1, 3000))) for _ in range(30)]
    texts += ["I'm sure they'll've  done it's   \n\n  ok?!  a b", "x1 2y 3 4 5\u00a0z \u3000q w", "é e\u0301 f g"]
    texts.append((shared_data(SHAKESPEARE) / SHAKESPEARE).read_text(encoding="utf-8")[:200000])  # a real text
    for t in texts:
        whole = gpt2.encode(t)
        for size in (1, 7, 64, 1000):
            pieces = list(split_at_safe_cuts(t, size))
            assert [i for p in pieces for i in gpt2.encode(p)] == whole, (size, repr(t[:80]))
    assert len(list(split_at_safe_cuts(texts[-1], 1000))) > 10  # the corpus does get cut


def _in_parts(rng, text):
    """`text` as consecutive parts of random lengths, some empty, some one character."""
    cuts = np.sort(rng.integers(0, len(text) + 1, int(rng.integers(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _assert_safe_pieces(pieces, text, size):
    assert "".join(pieces) == text and all(pieces) or pieces == [""] == [text]
    assert all(len(p) >= size for p in pieces[:-1])
    for left, right in zip(pieces, pieces[1:]):
        if right[0] == " ":
            assert left[-1].isalnum() and right[1].isalnum(), (size, left, right)
        else:
            assert right[0] in "\n\r" and unicodedata.category(left[-1])[0] in "LMNPS", (size, left, right)


def test_split_at_safe_cuts_of_a_text_in_parts(gpt2, rng):
    # a text that comes in parts (a file read in blocks): the same kind of cuts, and the same tokens, wherever the
    # parts end; one part is the text whole
    for _ in range(40):
        text = _random_text(rng, int(rng.integers(0, 400)))
        parts = _in_parts(rng, text)
        for size in (0, 1, 5, 60):
            pieces = list(split_at_safe_cuts(iter(parts), size))
            _assert_safe_pieces(pieces, text, size)
            assert [i for p in pieces for i in gpt2.encode(p)] == gpt2.encode(text)
            assert list(split_at_safe_cuts([text], size)) == list(split_at_safe_cuts(text, size))
    assert list(split_at_safe_cuts([], 4)) == [""] == list(split_at_safe_cuts(["", ""], 4))
    # a space that ends a part is not cut at: its right side is in the next part
    assert list(split_at_safe_cuts(["ab ", "cd ef"], 1)) == ["ab cd", " ef"]
    assert list(split_at_safe_cuts(["ab", " cd"], 1)) == ["ab", " cd"]  # the left side is the last part's


def _stream_of(tok, texts) -> list[int]:
    """The token stream of the texts encoded one by one: one EOT, then the text's tokens, for each."""
    return [i for t in texts for i in [tok.eot, *tok.encode(t)]]


def test_iter_encoded_of_documents_in_parts(tok, rng, monkeypatch):
    # a document given as parts (the lazy form prepare reads a file in) encodes to the tokens of the whole text
    import llmpy.tokenizer as tk
    monkeypatch.setattr(tk, "PIECE_CHARS", 40)
    texts = [_random_text(rng, int(rng.integers(0, 500))) for _ in range(int(rng.integers(2, 6)))] + [""]
    expect = _stream_of(tok, texts)
    docs = [iter(_in_parts(rng, t)) for t in texts] + [iter([])]
    parts = list(tok.iter_encoded(docs, batch_chars=int(rng.integers(1, 200))))
    assert np.concatenate(parts).tolist() == expect + [tok.eot]  # an empty document in no parts: its EOT


def test_iter_encoded_pieces_and_batches_make_the_same_stream(tok, rng, monkeypatch):
    # documents long enough to be cut in pieces, batches small enough to be many: one EOT a document, same tokens
    import llmpy.tokenizer as tk
    monkeypatch.setattr(tk, "PIECE_CHARS", 50)
    docs = [_random_text(rng, int(rng.integers(0, 600))) for _ in range(int(rng.integers(3, 8)))] + [""]
    # random text may hold no space between letters or digits past 50 characters, where a cut may go: one that does
    docs.insert(int(rng.integers(0, len(docs))), " ".join(rng.choice(["ab", "9", "日本", "Xé"], 80)))
    expect = _stream_of(tok, docs)
    for batch_chars in (1, 37, 10**6):
        parts = list(tok.iter_encoded(docs, batch_chars=batch_chars))
        assert all(p.dtype == np.uint16 for p in parts)
        assert np.concatenate(parts).tolist() == expect
        assert batch_chars > 100 or tok.name == "bytes" or len(parts) > len(docs)  # the long ones went in pieces
    assert tok.encode_documents(docs).tolist() == expect


@pytest.mark.parametrize("text", ["a\ud800b", "\udc80", "x \udfff"])
def test_a_lone_surrogate_is_refused_by_every_encode(tok, text):
    # not Unicode text: every way in refuses it alike (GPT-2's encode and encode_batch gave tiktoken's U+FFFD
    # token in its place, where encode_arrays and encode_documents raised), and the callers (prepare, HellaSwag)
    # name it from the UnicodeEncodeError
    for encode in (tok.encode, lambda t: tok.encode_batch([t, "ok"]), lambda t: tok.encode_arrays([t, "ok"]),
                   lambda t: tok.encode_documents(["ok", t])):
        with pytest.raises(UnicodeEncodeError):
            encode(text)


def test_gpt2_round_trip_on_odd_unicode(gpt2, gpt2_dir):
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = gpt2_mergeable_ranks(gpt2_dir / "encoder.json", gpt2_dir / "vocab.bpe")
    ref = tiktoken.Encoding("ref", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    for text in ["x\u2028y\u2029z\u0085", "\U0001F469\u200d\U0001F469\u200d\U0001F467\U0001F3FD", "e\u0301 \u0301",
                 " " * 100_000 + "a", "\t" * 5000 + "\n" * 5000, "\ufeff\u200b\u3000\u00a0 \U0010FFFF\x00",
                 "'s 'S \u2019s \u2167 \u0663 \u00b2"]:
        ids = gpt2.encode(text)
        assert ids == ref.encode_ordinary(text) == gpt2.encode_arrays([text])[0].tolist()
        assert gpt2.decode(ids) == text == ByteTokenizer().decode(ByteTokenizer().encode(text))


def test_gpt2_decode_refuses_ids_outside_vocab(gpt2):
    with pytest.raises(ValueError, match="50257"):
        gpt2.decode([15496, 50257])


def test_huggingface_file_names_and_env_var(monkeypatch, tmp_path, gpt2, gpt2_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "vocab.json").write_bytes((gpt2_dir / "encoder.json").read_bytes())
    (hf / "merges.txt").write_bytes((gpt2_dir / "vocab.bpe").read_bytes())
    assert find_gpt2_dir(hf) == hf
    monkeypatch.setenv("LLMPY_GPT2_DIR", str(hf))
    tok = load_tokenizer("gpt2")
    assert isinstance(tok, GPT2Tokenizer) and tok.encode(" the Hello world") == gpt2.encode(" the Hello world")
    monkeypatch.setenv("LLMPY_GPT2_DIR", str(tmp_path / "missing"))
    with pytest.raises(LlmpyError, match=r"LLMPY_GPT2_DIR=.*missing: GPT-2 tokenizer folder not found"):
        load_tokenizer("gpt2")
    with pytest.raises(LlmpyError, match=r"holds neither encoder\.json"):
        load_tokenizer("gpt2", tmp_path)


def test_mismatched_merges_are_refused(tmp_path, rng, gpt2_dir):
    lines = (gpt2_dir / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    i = int(rng.integers(1, len(lines) - 3))
    lines[i], lines[i + 1] = lines[i + 1], lines[i]  # swap two merges: ranks no longer match ids
    bad = tmp_path / "vocab.bpe"
    bad.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(LlmpyError, match=r"vocab\.bpe: merge .* do not belong together"):
        gpt2_mergeable_ranks(gpt2_dir / "encoder.json", bad)
    with pytest.raises(LlmpyError, match=r"nope\.json: GPT-2 tokenizer file not found"):
        gpt2_mergeable_ranks(tmp_path / "nope.json", bad)


def test_an_encoder_json_nested_too_deep_is_one_line(tmp_path, gpt2_dir):
    (tmp_path / "encoder.json").write_text("[" * 100_000)  # json.loads raises RecursionError, not a ValueError
    with pytest.raises(LlmpyError, match=r"encoder\.json / .*vocab\.bpe: cannot read the GPT-2 tokenizer files "
                                         r"\(maximum recursion depth"):
        gpt2_mergeable_ranks(tmp_path / "encoder.json", gpt2_dir / "vocab.bpe")


@pytest.mark.parametrize("bad_id", ["0", 0.0, False], ids=["str", "float", "bool"])
def test_an_encoder_json_with_ids_that_are_not_integers_is_one_line(tmp_path, gpt2_dir, bad_id):
    # a string id made sorting fail with a TypeError traceback; a float id passed the checks and failed in tiktoken
    encoder = json.loads((gpt2_dir / "encoder.json").read_text(encoding="utf-8"))
    encoder[next(token for token, i in encoder.items() if i == 0)] = bad_id  # equal to 0, but not an integer
    (tmp_path / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    with pytest.raises(LlmpyError, match=r"encoder\.json: expected a JSON object of token -> integer id"):
        gpt2_mergeable_ranks(tmp_path / "encoder.json", gpt2_dir / "vocab.bpe")


def test_a_tokenizer_dir_that_is_empty_or_a_file(monkeypatch, tmp_path, gpt2_dir):
    monkeypatch.chdir(gpt2_dir)  # Path("") is the current folder, here one that holds GPT-2's files
    with pytest.raises(LlmpyError, match=r"^--tokenizer-dir '': an empty folder name"):
        load_tokenizer("gpt2", "")
    with pytest.raises(LlmpyError, match=r"^--tokenizer-dir '': an empty folder name"):
        find_gpt2_dir("")
    # an existing file: "folder not found" misled
    with pytest.raises(LlmpyError, match=rf"^{gpt2_dir / 'vocab.bpe'}: not a folder \(give the folder that holds"):
        load_tokenizer("gpt2", gpt2_dir / "vocab.bpe")
    monkeypatch.setenv("LLMPY_GPT2_DIR", str(gpt2_dir / "vocab.bpe"))
    with pytest.raises(LlmpyError, match=r"^LLMPY_GPT2_DIR=.*vocab\.bpe: .*vocab\.bpe: not a folder"):
        load_tokenizer("gpt2")


def test_from_tiktoken_failure_is_a_clear_error(monkeypatch, tmp_path):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache
    with pytest.raises(LlmpyError, match=r"cannot load GPT-2 BPE through tiktoken.*no network.*LLMPY_GPT2_DIR"):
        load_tokenizer("gpt2", download=True)


def test_nothing_is_fetched_unless_asked(monkeypatch, tmp_path, gpt2, gpt2_dir):
    # without download=True GPT-2's files come from a folder or tiktoken's cache, never the network
    import hashlib

    import tiktoken

    def fetch(name):
        raise AssertionError("tiktoken asked to fetch")
    monkeypatch.setattr(tiktoken, "get_encoding", fetch)
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    with pytest.raises(LlmpyError, match=r"not on this machine: set LLMPY_GPT2_DIR"):
        load_tokenizer("gpt2")
    assert tiktoken_cached_gpt2_files() is None
    # tiktoken's cached copies (named by the sha1 of their address) serve as a local folder would
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name in ("encoder.json", "vocab.bpe"):
        (cache / hashlib.sha1((base + name).encode()).hexdigest()).write_bytes((gpt2_dir / name).read_bytes())
    text = " the Hello world, 日本 🙂"
    assert load_tokenizer("gpt2").encode(text) == gpt2.encode(text)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's "no cache"
    assert tiktoken_cached_gpt2_files() is None


def _tiktoken_cache(folder, encoder: bytes, vocab: bytes):
    """GPT-2's two files as tiktoken caches them, each named by the sha1 of its address; their paths."""
    import hashlib
    folder.mkdir(parents=True, exist_ok=True)
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    paths = [folder / hashlib.sha1((base + name).encode()).hexdigest() for name in ("encoder.json", "vocab.bpe")]
    for path, data in zip(paths, (encoder, vocab)):
        path.write_bytes(data)
    return paths


def _cache_error(enc, bpe, detail):
    return (f"{enc} / {bpe}: tiktoken's cached copies of GPT-2's encoder.json and vocab.bpe cannot be used ({detail}); "
            "delete both (`llmpy prepare` with the gpt2 tokenizer then fetches them again)")


def test_a_damaged_tiktoken_cache_is_named_as_such(monkeypatch, tmp_path, rng):
    # the line named two sha1-named files and a JSON error: neither what they are nor that deleting them is the fix
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    garbage = ["x" + secrets.token_hex(int(rng.integers(1, 50))) for _ in range(2)]  # "x": no JSON value starts so
    enc, bpe = _tiktoken_cache(tmp_path / "tk", *(g.encode() for g in garbage))
    for download in (False, True):
        with pytest.raises(LlmpyError) as e:
            load_tokenizer("gpt2", download=download)
        assert str(e.value) == _cache_error(enc, bpe, "Expecting value: line 1 column 1 (char 0)")
    assert [enc.read_text(), bpe.read_text()] == garbage  # not deleted: the user's cache, the user's call


def test_a_tiktoken_cache_with_a_cut_vocab_names_the_file_by_what_it_is(monkeypatch, tmp_path, rng, gpt2_dir):
    monkeypatch.delenv("LLMPY_GPT2_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    lines = (gpt2_dir / "vocab.bpe").read_bytes().split(b"\n")
    keep = int(rng.integers(2, len(lines) - 2))  # the version line and keep - 1 merges
    enc, bpe = _tiktoken_cache(tmp_path / "tk", (gpt2_dir / "encoder.json").read_bytes(), b"\n".join(lines[:keep]))
    with pytest.raises(LlmpyError) as e:
        load_tokenizer("gpt2")
    assert str(e.value) == _cache_error(enc, bpe, f"vocab.bpe: {keep - 1} merges, GPT-2 has 50000")


def test_cli_prepare_with_a_damaged_tiktoken_cache_is_one_line(tmp_path, rng):
    from cli_helpers import llmpy
    garbage = ["x" + secrets.token_hex(int(rng.integers(1, 50))) for _ in range(2)]
    enc, bpe = _tiktoken_cache(tmp_path / "tk", *(g.encode() for g in garbage))
    (tmp_path / "small.txt").write_text(_random_text(rng, 200), encoding="utf-8")
    # LLMPY_GPT2_DIR empty: unset (llmpy reads "" as no folder), so the cache is where the files come from
    res = llmpy("prepare", tmp_path / "small.txt", "-o", tmp_path / "x", cwd=tmp_path,
                env={"LLMPY_GPT2_DIR": "", "TIKTOKEN_CACHE_DIR": str(tmp_path / "tk")})
    assert res.returncode == 1 and res.stderr == \
        "llmpy prepare: error: " + _cache_error(enc, bpe, "Expecting value: line 1 column 1 (char 0)") + "\n"
    assert not (tmp_path / "x").exists() and [enc.read_text(), bpe.read_text()] == garbage


# ----------------------------------------------------------------------------------------------
# bytes

def test_byte_tokenizer(rng):
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eot == 256
    s = _random_text(rng, 300)
    ids = tok.encode(s)
    assert ids == list(s.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == s
    assert tok.decode([104, 105, 256, 0xC3]) == "hi<|endoftext|>\ufffd"  # a broken byte is replaced
    with pytest.raises(ValueError):
        tok.decode([257])


def test_byte_encode_documents(rng):
    tok = ByteTokenizer()
    docs = [_random_text(rng, int(rng.integers(0, 50))) for _ in range(int(rng.integers(1, 8)))]
    stream = tok.encode_documents(docs)
    assert stream.dtype == np.uint16
    expect = []
    for d in docs:
        expect += [256] + list(d.encode("utf-8"))
    assert stream.tolist() == expect
    assert tok.encode_documents([]).tolist() == []


def test_unknown_tokenizer_name():
    with pytest.raises(LlmpyError, match=r"unknown tokenizer 'sentencepiece': expected one of gpt2, bytes"):
        load_tokenizer("sentencepiece")


# ----------------------------------------------------------------------------------------------
# decoding a sample as it streams (llmpy.sampler.sample_text's on_text)

def test_streamed_pieces_join_to_the_decoded_ids(tok, rng):
    # random ids (the end-of-text among them) cut characters anywhere: the streamed pieces, from each token's
    # bytes, join to decode(ids) exactly, and hold at most one character's start
    import torch
    from types import SimpleNamespace
    from llmpy.sampler import sample_text
    ids = [int(i) for i in rng.integers(0, tok.vocab_size, 300)] + [tok.eot]
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace") == tok.decode(ids)

    class Scripted:  # greedy sampling follows the ids
        config = SimpleNamespace(vocab_size=tok.vocab_size, max_seq_len=1024)

        def logits_last(self, contexts):
            row = torch.randn(tok.vocab_size)
            row[ids[len(contexts[0]) - 1]] = 100.0
            return row[None]
    pieces = []
    text = sample_text(Scripted(), tok, "", gen_tokens=len(ids), temperature=0, on_text=pieces.append)
    assert text == tok.decode(ids) and "".join(pieces) == text and all(pieces)
    with pytest.raises(ValueError, match="outside"):
        tok.token_bytes(tok.vocab_size)


@pytest.mark.parametrize("script", [[0x80, 0x80, 0xE2, 0x82, 0xAC], [0x80, 0xF0, 0x9F, 0x98, 0x80]])
def test_streamed_sample_is_the_sample_after_stray_bytes(script):
    # a young byte-level model's stray bytes, then a 3- or 4-byte character: `llmpy sample` printed "����" for
    # the sample "��€" (its streamer let out a held piece after 4 tokens, mid-character)
    import torch
    from types import SimpleNamespace
    from llmpy.sampler import sample_text

    class Scripted:  # greedy sampling follows the script
        config = SimpleNamespace(vocab_size=257, max_seq_len=64)

        def logits_last(self, contexts):
            row = torch.randn(257)
            row[script[len(contexts[0]) - 1]] = 100.0
            return row[None]
    pieces = []
    text = sample_text(Scripted(), ByteTokenizer(), "", gen_tokens=len(script), temperature=0, on_text=pieces.append)
    assert text == bytes(script).decode("utf-8", errors="replace")
    assert "".join(pieces) == text


def test_sampling_math_and_determinism():
    # frequencies follow softmax(logits / temperature) over the top k (the padded columns never drawn), and a
    # seed gives the same tokens again
    import torch
    from llmpy.sampler import generate, sample_next
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 9.0])  # column 5: padding past vocab_size 5
    for temperature, top_k in ((1.0, 0), (0.5, 0), (2.0, 3), (1.0, 1)):
        gen = torch.Generator().manual_seed(0)
        draws = torch.tensor([sample_next(logits, 5, gen, temperature, top_k) for _ in range(20000)])
        scaled = logits[:5].double() / temperature
        if top_k:
            scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
        assert torch.bincount(draws, minlength=5).double().div(20000).tolist() == pytest.approx(
            torch.softmax(scaled, 0).tolist(), abs=0.015)

    def next_logits(ctx):
        return torch.sin(torch.arange(300.0) * (len(ctx) + sum(ctx)))
    runs = [generate(next_logits, [1], 40, 257, 8, seed=seed, top_k=20) for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
