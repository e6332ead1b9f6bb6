"""Tokenizers: GPT-2's byte-level BPE (through tiktoken) and a 257-symbol byte tokenizer.

`load_tokenizer("gpt2")` reads encoder.json + vocab.bpe from a folder (argument, else the
`LLMPY_GPT2_DIR` environment variable), else tiktoken's cached copies of those two files; only with
download=True (`llmpy prepare`, which the user runs to fetch and tokenize data) may tiktoken fetch them
from the network. `load_tokenizer("bytes")` needs nothing: ids 0..255 are the UTF-8 bytes and 256 is the
end-of-text token.

`encode_documents(docs)` puts one end-of-text token before each document, as llm.c's data scripts
do, and returns the token stream as uint16, ready for `llmpy.data.write_shard`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

import numpy as np

from .errors import LlmpyError
from .files import expand_user

GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenization regex, as published with the model (tiktoken runs it with fancy-regex)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_DIR_ENV = "LLMPY_GPT2_DIR"
# file names of OpenAI's release and their HuggingFace copies (byte-identical)
_GPT2_FILE_NAMES = (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt"))
TOKENIZER_NAMES = ("gpt2", "bytes")
# where tiktoken fetches GPT-2's two files from (encoder.json, vocab.bpe); it caches each under the sha1 of its address
_TIKTOKEN_GPT2_URLS = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                       "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe")


PIECE_CHARS = 1 << 20   # a document longer than this is encoded in pieces of about this size
BATCH_CHARS = 1 << 24   # characters encoded at a time (a batch of documents or pieces, in parallel)


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # the CPUs this process may run on (a container's share)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# threads encoding a batch's pieces (tiktoken encodes without Python's lock); its default is 8 whatever the machine
ENCODE_THREADS = _usable_cpus()


# a document: a text, or a text that comes as consecutive parts (a file read in blocks), never held whole
Document = Union[str, Iterable[str]]


# where a piece may end: before a space (between two letters or digits) or a line break (after text); _is_safe_cut
_CUT_CANDIDATE = re.compile(r"[ \n\r]")


def _is_safe_cut(part: str, cut: int, before: str) -> bool:
    left = part[cut - 1] if cut else before
    if not left:
        return False
    if part[cut] == " ":
        return cut + 1 < len(part) and left.isalnum() and part[cut + 1].isalnum()
    # a letter, mark, digit, punctuation or symbol: no whitespace to any definition (White_Space is Cc, Z*)
    return unicodedata.category(left)[0] in "LMNPS"


def split_at_safe_cuts(text: Document, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at least piece_chars characters (the last may be shorter; at least one piece, "" for
    ""), each cut just before a space that has a letter or digit on both sides, or just before a line break (\\n,
    \\r) that follows a letter, mark, digit, punctuation or symbol. GPT-2's pre-tokenizer (GPT2_PATTERN) ends a
    match there in the whole text: the character on the left is in a run of letters, of digits, of other
    non-space characters or a contraction, none of which takes whitespace in; and a match that begins at the cut
    depends only on the text after it (the pattern looks ahead, never back), so the space's " ?\\p{L}+" (or
    digit or symbol form) or the line break's whitespace run is the same in the piece. So the pieces' tokens,
    joined, are the whole text's. The characters that decide must not be whitespace to any definition of it,
    which letters, digits, punctuation and symbols never are. A text with no such place from some point on stays
    whole from there (a line of CJK text without a break, say).

    `text` may come in parts (a str is one part): the pieces then hold about a piece and a part at a time. A
    space that ends a part is not cut at (its right side is unknown yet), which only makes a piece longer."""
    parts = (text,) if isinstance(text, str) else text
    held: list[str] = []  # the piece so far: the parts' text since the last cut
    held_chars = 0
    before = ""  # the character before the current part
    for part in parts:
        if not part:
            continue
        start = 0
        while True:
            # the piece reaches piece_chars at `at`, and is never empty
            at = start + max(piece_chars - held_chars, 0 if held_chars else 1)
            found = _CUT_CANDIDATE.search(part, at)
            while found is not None and not _is_safe_cut(part, found.start(), before):
                found = _CUT_CANDIDATE.search(part, found.start() + 1)
            if found is None:
                held.append(part[start:])
                held_chars += len(part) - start
                break
            cut = found.start()
            yield "".join(held) + part[start:cut]
            held, held_chars, start = [], 0, cut
        before = part[-1]
    yield "".join(held)


def _at_least_one(pieces: Iterable[str]) -> Iterator[str]:
    """The pieces, or "" where there are none (an empty document still gets its end-of-text token)."""
    empty = True
    for p in pieces:
        empty = False
        yield p
    if empty:
        yield ""


class Tokenizer:
    """Common interface: name, vocab_size, eot, encode, decode, token_bytes (a sample streamed as it comes),
    encode_documents, iter_encoded; encode_arrays and pieces are what a tokenizer may do faster or in parts."""

    name: str
    vocab_size: int
    eot: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for: decode(ids) is their concatenation read as UTF-8 (errors replaced)."""
        raise NotImplementedError

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the {self.name} vocabulary of {self.vocab_size}")
        return ids

    def encode_documents(self, docs: Iterable[Document]) -> np.ndarray:
        """One EOT, then the document's tokens, for each document; as a uint16 array."""
        parts = list(self.iter_encoded(docs))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """encode_batch's ids as uint16 arrays."""
        return [np.asarray(ids, dtype=np.uint16) for ids in self.encode_batch(texts)]

    def pieces(self, doc: Document) -> Iterable[str]:
        """The document in pieces whose tokens, joined, are the document's (at least one piece); a tokenizer
        that knows where it may cut (GPT2Tokenizer, ByteTokenizer) cuts a long one, so that it is encoded, and a
        document in parts held, a piece at a time. Here: the document whole."""
        return (doc if isinstance(doc, str) else "".join(doc),)

    def iter_encoded(self, docs: Iterable[Document], batch_chars: int | None = None) -> Iterator[np.ndarray]:
        """encode_documents' stream in uint16 arrays of about batch_chars (default BATCH_CHARS) characters'
        tokens each, a document going in its pieces (self.pieces), so that a 1 GB text file takes a batch's worth
        of memory, not its tokens' (tiktoken's lists of Python ints take ~36 bytes a token). The pieces of a batch
        are encoded in parallel (encode_arrays), and in the background while the caller takes the batch before:
        reading, cutting and writing overlap the encoding."""
        from concurrent.futures import ThreadPoolExecutor

        batch_chars = BATCH_CHARS if batch_chars is None else batch_chars
        eot = np.array([self.eot], dtype=np.uint16)

        def encoded(batch: list[str], starts: list[bool]) -> np.ndarray:
            parts = []
            for starts_doc, ids in zip(starts, self.encode_arrays(batch)):
                if starts_doc:  # the piece begins its document: the document's EOT before it
                    parts.append(eot)
                parts.append(ids)
            return np.concatenate(parts)

        def batches() -> Iterator[tuple[list[str], list[bool]]]:
            batch, starts, size = [], [], 0
            for doc in docs:
                for k, piece in enumerate(self.pieces(doc)):
                    batch.append(piece)
                    starts.append(k == 0)
                    size += len(piece)
                    if size >= batch_chars:
                        yield batch, starts
                        batch, starts, size = [], [], 0
            if batch:
                yield batch, starts

        with ThreadPoolExecutor(1) as background:  # one batch encoding ahead, in order
            ahead = None
            for batch, starts in batches():
                if ahead is not None:
                    yield ahead.result()
                ahead = background.submit(encoded, batch, starts)
            if ahead is not None:
                yield ahead.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot={self.eot})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and end-of-text as 256: works offline with no files."""

    name = "bytes"
    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def pieces(self, doc: Document) -> Iterable[str]:
        # a text's bytes are its pieces' bytes, joined, wherever it is cut: a document in parts goes part by part
        if isinstance(doc, str):
            return super().pieces(doc)
        return _at_least_one(p for p in doc if p)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        # fast path: bytes map straight onto uint16 ids without Python lists
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._check_ids(ids)
        out, run = [], bytearray()
        for i in ids:
            if i == self.eot:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(ENDOFTEXT)
                run = bytearray()
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token: int) -> bytes:
        (token,) = self._check_ids([token])
        return ENDOFTEXT.encode() if token == self.eot else bytes([token])


def _gpt2_byte_symbols() -> dict[str, int]:
    """GPT-2's files spell each byte as one printable character: printable Latin-1 bytes as
    themselves, the other 68 bytes as chr(256), chr(257), ... in byte order."""
    kept = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def gpt2_mergeable_ranks(encoder_json: str | os.PathLike, vocab_bpe: str | os.PathLike) -> dict[bytes, int]:
    """tiktoken's `mergeable_ranks` (token bytes -> id) from GPT-2's two files, checked against
    each other: tiktoken merges by rank, so merge i of vocab.bpe must be token 256 + i."""
    symbols = _gpt2_byte_symbols()

    def to_bytes(s: str, where: Path) -> bytes:
        try:
            return bytes(symbols[c] for c in s)
        except KeyError as e:
            raise LlmpyError(f"{where}: {s!r} contains {e.args[0]!r}, not a GPT-2 byte symbol") from None

    enc_path, bpe_path = Path(encoder_json), Path(vocab_bpe)
    try:
        encoder = json.loads(enc_path.read_text(encoding="utf-8"))
        merges_text = bpe_path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise LlmpyError(f"{e.filename}: GPT-2 tokenizer file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise LlmpyError(f"{enc_path} / {bpe_path}: cannot read the GPT-2 tokenizer files ({e})") from None
    if not isinstance(encoder, dict) or not all(type(v) is int for v in encoder.values()):
        raise LlmpyError(f"{enc_path}: expected a JSON object of token -> integer id")
    ranks = {to_bytes(k, enc_path): v for k, v in encoder.items() if k != ENDOFTEXT}
    if encoder.get(ENDOFTEXT) != GPT2_EOT or len(ranks) != GPT2_EOT or sorted(ranks.values()) != list(range(GPT2_EOT)):
        raise LlmpyError(f"{enc_path}: not GPT-2's encoder (expected ids 0..{GPT2_EOT - 1} and "
                         f"{ENDOFTEXT} = {GPT2_EOT}, found {len(encoder)} entries)")
    lines = [ln for ln in merges_text.split("\n")[1:] if ln.strip()]  # line 0 is "#version: 0.2"
    if len(lines) != GPT2_EOT - 256:
        raise LlmpyError(f"{bpe_path}: {len(lines)} merges, GPT-2 has {GPT2_EOT - 256}")
    for i, line in enumerate(lines):
        a, _, b = line.partition(" ")
        if ranks.get(to_bytes(a, bpe_path) + to_bytes(b, bpe_path)) != 256 + i:
            raise LlmpyError(f"{bpe_path}: merge {i} ({line!r}) is not token {256 + i} of {enc_path}; "
                             "the two files do not belong together")
    return ranks


class GPT2Tokenizer(Tokenizer):
    """GPT-2's BPE, 50257 tokens, end-of-text 50256 (wraps a tiktoken.Encoding)."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot = GPT2_EOT

    def __init__(self, encoding):
        self.encoding = encoding
        if encoding.n_vocab != GPT2_VOCAB_SIZE or encoding.eot_token != GPT2_EOT:
            raise LlmpyError(f"tiktoken encoding {encoding.name!r} is not GPT-2's "
                             f"({encoding.n_vocab} tokens, end-of-text {encoding.eot_token})")

    def pieces(self, doc: Document) -> Iterable[str]:
        # safe for GPT2_PATTERN (split_at_safe_cuts says why); the module's PIECE_CHARS read at each call
        return split_at_safe_cuts(doc, PIECE_CHARS)

    @classmethod
    def from_files(cls, encoder_json: str | os.PathLike, vocab_bpe: str | os.PathLike) -> "GPT2Tokenizer":
        import tiktoken

        ranks = gpt2_mergeable_ranks(encoder_json, vocab_bpe)
        enc = tiktoken.Encoding("gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                special_tokens={ENDOFTEXT: GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB_SIZE)
        return cls(enc)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "GPT2Tokenizer":
        return cls.from_files(*find_gpt2_files(directory))

    @classmethod
    def from_tiktoken(cls) -> "GPT2Tokenizer":
        """tiktoken's own "gpt2" encoding: from its cache, else downloaded by tiktoken."""
        import tiktoken

        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # network and cache failures come as many exception types
            raise LlmpyError(f"cannot load GPT-2 BPE through tiktoken ({type(e).__name__}: {e}); offline, "
                             f"set {GPT2_DIR_ENV} to a folder holding encoder.json and vocab.bpe") from None
        return cls(enc)

    def encode(self, text: str) -> list[int]:
        # text "<|endoftext|>" is ordinary text here, as in llm.c's data scripts
        _refuse_surrogates(text)
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        for text in texts:
            _refuse_surrogates(text)
        return self.encoding.encode_ordinary_batch(texts, num_threads=ENCODE_THREADS)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        # tiktoken's numpy form skips the list of Python ints, which is built holding Python's lock (so threads
        # wait on each other there) and takes ~36 bytes a token; with nothing disallowed (no check for special-token
        # text) and nothing allowed, it encodes as encode_ordinary does
        to_numpy = getattr(self.encoding, "encode_to_numpy", None)  # tiktoken 0.7 has it; older ones, the lists
        if to_numpy is None:
            return super().encode_arrays(texts)
        from concurrent.futures import ThreadPoolExecutor

        def one(text: str) -> np.ndarray:
            return to_numpy(text, allowed_special=set(), disallowed_special=()).astype(np.uint16)
        if len(texts) <= 1:  # no pool for one text, nor for none (a pool of 0 threads is a ValueError)
            return [one(t) for t in texts]
        with ThreadPoolExecutor(min(ENCODE_THREADS, len(texts))) as pool:
            return list(pool.map(one, texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(self._check_ids(ids), errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(self._check_ids([token])[0])


def _refuse_surrogates(text: str) -> None:
    """A UnicodeEncodeError for a lone surrogate (JSON's "\\ud800" escape makes one), as encode_arrays and the
    bytes tokenizer raise: tiktoken's encode_ordinary would put U+FFFD's token in its place without a word."""
    if not text.isascii():  # ASCII, the common case, holds none; the check is then free
        text.encode("utf-8")


def find_gpt2_files(directory: str | os.PathLike) -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) in `directory`, or HuggingFace's (vocab.json, merges.txt)."""
    d = expand_user(directory)
    if not d.is_dir():
        if d.exists():
            raise LlmpyError(f"{d}: not a folder (give the folder that holds GPT-2's encoder.json and vocab.bpe)")
        raise LlmpyError(f"{d}: GPT-2 tokenizer folder not found")
    for enc, bpe in _GPT2_FILE_NAMES:
        if (d / enc).is_file() and (d / bpe).is_file():
            return d / enc, d / bpe
    raise LlmpyError(f"{d}: holds neither encoder.json + vocab.bpe nor vocab.json + merges.txt")


def find_gpt2_dir(directory: str | os.PathLike | None = None) -> Path | None:
    """The folder to read GPT-2's files from: `directory`, else $LLMPY_GPT2_DIR, else None."""
    if directory is not None:
        if not str(directory).strip():  # Path("") is the current folder: not what was meant
            raise LlmpyError(f"--tokenizer-dir '': an empty folder name (leave it out for ${GPT2_DIR_ENV} or "
                             "tiktoken's cache)")
        find_gpt2_files(directory)
        return expand_user(directory)
    env = os.environ.get(GPT2_DIR_ENV)
    if env:
        try:
            find_gpt2_files(env)
        except LlmpyError as e:
            raise LlmpyError(f"{GPT2_DIR_ENV}={env}: {e}") from None
        return expand_user(env)
    return None


def tiktoken_cached_gpt2_files() -> tuple[Path, Path] | None:
    """(encoder.json, vocab.bpe) as tiktoken caches them, or None: its cache folder is $TIKTOKEN_CACHE_DIR, else
    $DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache ("" turns caching off), each file named by the sha1 of its
    address. Read as plain files, so that nothing is fetched when they are absent."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache = os.environ["TIKTOKEN_CACHE_DIR"]
    else:
        cache = os.environ.get("DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    if not cache:
        return None
    enc, bpe = (Path(cache) / hashlib.sha1(url.encode()).hexdigest() for url in _TIKTOKEN_GPT2_URLS)
    return (enc, bpe) if enc.is_file() and bpe.is_file() else None


def _cached_files_error(e: LlmpyError, enc: Path, bpe: Path) -> LlmpyError:
    """gpt2_mergeable_ranks' error about tiktoken's cached files, reworded: their names (sha1s of the addresses) say
    neither what they are nor that deleting them is the fix. Not deleted here: the user's cache, the user's call."""
    detail = str(e)
    both = f"{enc} / {bpe}: cannot read the GPT-2 tokenizer files ("
    if detail.startswith(both) and detail.endswith(")"):
        detail = detail[len(both):-1]
    else:  # an error about one of them: named by what it is, the paths are in the line's head
        for path, label in ((enc, "encoder.json"), (bpe, "vocab.bpe")):
            if detail.startswith(f"{path}: "):
                detail = f"{label}: {detail[len(str(path)) + 2:]}"
                break
    return LlmpyError(f"{enc} / {bpe}: tiktoken's cached copies of GPT-2's encoder.json and vocab.bpe cannot be used "
                      f"({detail}); delete both (`llmpy prepare` with the gpt2 tokenizer then fetches them again)")


def refuse_files_for_bytes(name: str, directory, label: str) -> None:
    """The bytes tokenizer reads no files: a folder given for it (`label`: the flag or argument) would be ignored
    without a word, so it is one line instead. Callers check before any slow work."""
    if directory is not None and name.strip().lower() in ("bytes", "byte"):
        raise LlmpyError(f"{label} {str(directory)!r}: the bytes tokenizer has no files; leave it out")


def load_tokenizer(name: str = "gpt2", directory: str | os.PathLike | None = None,
                   download: bool = False) -> Tokenizer:
    """"gpt2" or "bytes". GPT-2's files come from `directory`, else $LLMPY_GPT2_DIR, else tiktoken's cache; only
    with download=True may tiktoken fetch them from the network (else a missing file is an LlmpyError)."""
    key = name.strip().lower()
    if key in ("bytes", "byte"):
        return ByteTokenizer()
    if key == "gpt2":
        d = find_gpt2_dir(directory)
        if d is not None:
            return GPT2Tokenizer.from_dir(d)
        cached = tiktoken_cached_gpt2_files()
        if cached is not None:
            try:
                return GPT2Tokenizer.from_files(*cached)
            except LlmpyError as e:  # files named by a sha1 mean nothing to a user: say whose they are, and the way out
                raise _cached_files_error(e, *cached) from None
        if download:
            return GPT2Tokenizer.from_tiktoken()
        raise LlmpyError(f"GPT-2's tokenizer files are not on this machine: set {GPT2_DIR_ENV} (`llmpy sample` and "
                         "`llmpy prepare` also take --tokenizer-dir, the API's sample() tokenizer_dir) to a folder "
                         "holding encoder.json and vocab.bpe, or fetch them once into tiktoken's cache with network "
                         "access (`llmpy prepare` with the gpt2 tokenizer does)")
    raise LlmpyError(f"unknown tokenizer {name!r}: expected one of {', '.join(TOKENIZER_NAMES)}")


__all__ = ["Tokenizer", "ByteTokenizer", "GPT2Tokenizer", "load_tokenizer", "find_gpt2_dir", "find_gpt2_files",
           "gpt2_mergeable_ranks", "tiktoken_cached_gpt2_files", "GPT2_EOT", "GPT2_VOCAB_SIZE", "TOKENIZER_NAMES"]
