"""`llmpy prepare`: text -> llm.c token shards (`{name}_val_000000.bin`, `{name}_train_000000.bin`, ...).

SOURCE is a local text file (one document), a JSON-lines file (`.jsonl`, or gzipped `.jsonl.gz`: one
document a line, the string under "text" or --text-field), a folder of such files (found at any depth, read in the
order of their paths; .txt files are taken as text), or a named dataset fetched like llm.c's dev/data scripts:

  tinyshakespeare  karpathy/char-rnn's input.txt, documents at blank lines, val = first 32768 tokens
  tinystories      roneneldan/TinyStories' TinyStories_all_data.tar.gz, one story per document,
                   val = the stories of data00.json
  fineweb          HuggingFaceFW/fineweb sample-10BT (needs the `datasets` package), val = first shard
  fineweb-edu      HuggingFaceFW/fineweb-edu sample-10BT, likewise
  hellaswag        rowanz/hellaswag's hellaswag_val.jsonl -> llm.c's eval file OUTDIR/hellaswag_val.bin
                   (for `llmpy train -h 1`; not token shards)

Named datasets take precedence over a local path of the same name (write ./NAME for the path).
Every document is preceded by one end-of-text token. Downloads are kept in --cache-dir. The new shards
replace an earlier prepare's in OUTDIR only once all of them are written: a failed one leaves those as they were.
"""
from __future__ import annotations

import argparse
import codecs
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .files import (NO_LOCKS_ERRNOS, ORPHAN_MIN_AGE_S, atomic_path, expand_user, remove_orphaned_temporaries,
                    temporary_sibling, writable_dir)
from .data import ShardFile, commit_journal, shard_name
from .errors import LlmpyError
from .tokenizer import TOKENIZER_NAMES, Document, Tokenizer, load_tokenizer, refuse_files_for_bytes

DEFAULT_SHARD_SIZE = 10**8  # tokens, llm.c's fineweb shard size
MAX_SHARD_SIZE = 2**31 - 1  # the header's int32 count
DEFAULT_VAL_FRACTION = 0.1

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSTORIES_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"
FINEWEB_REPOS = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
NAMED_DATASETS = ("tinyshakespeare", "tinystories", "fineweb", "fineweb-edu", "hellaswag")

_urlopen = urllib.request.urlopen  # module attribute so tests can take the network away


def default_download_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmpy" / "downloads"


# ----------------------------------------------------------------------------------------------
# downloads

def _file_sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read ({e.strerror or e})") from None


def download(url: str, dest: Path, sha256: str | None = None) -> Path:
    """Fetch `url` to `dest` (kept and reused once complete) with a progress bar; atomic (files.atomic_path: a
    killed download's temporary is an orphan the next one removes, and the file gets the umask's mode)."""
    from tqdm import tqdm

    dest = Path(dest)
    if dest.is_file():
        # a file placed by hand (as the offline error below asks) or changed since: the dataset's, or refused
        if sha256 and (found := _file_sha256(dest)) != sha256:
            raise LlmpyError(f"{dest}: sha256 {found}, expected {sha256}: not the file {url} serves (remove it to "
                             "download it again)")
        return dest
    if dest.is_dir():  # the download's rename would fail, and the error below would ask for the file that is "missing"
        raise LlmpyError(f"{dest}: a folder is there, not the file {url} serves; move it away (without network, "
                         "place the file there)")
    writable_dir(dest.parent, "download folder")
    remove_orphaned_temporaries(dest.parent)  # a killed download's partial file
    digest = hashlib.sha256()
    received = 0
    try:
        with atomic_path(dest) as tmp, open(tmp, "wb") as f, _urlopen(url, timeout=60) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=None) as bar:
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            # a dropped connection can end the body early without an error: kept, the part would pass for the file
            if total is not None and received != total:  # raised inside, like the sha256 check: no file is kept
                raise LlmpyError(f"{url}: download cut short ({received} of {total} bytes); run the command again")
            if sha256 and digest.hexdigest() != sha256:  # raised inside: the temporary goes, no file is kept
                raise LlmpyError(f"{url}: downloaded data has sha256 {digest.hexdigest()}, expected {sha256}")
    # URLError, HTTPError, timeouts and disk errors are OSErrors; a dropped chunked transfer's IncompleteRead is not
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise LlmpyError(f"cannot download {url} ({reason}); without network, place the file at {dest}") from None
    return dest


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------
# sources: each yields (is_val_hint, documents) groups; the hint is used only by the default split of
# sources that define one (tinystories), otherwise the first val tokens of the stream are the val split

@dataclass
class Source:
    name: str
    groups: Callable[[], Iterator[tuple[bool, Iterable[Document]]]]
    default_val_tokens: int | None = None   # llm.c's fixed val size, where it has one
    hinted_split: bool = False              # the groups' hints define the default split


READ_BYTES = 1 << 24  # a text file is read, decoded and tokenized this many bytes at a time


BOM = "\ufeff"  # UTF-8's byte-order mark, as decoded


def _text_blocks(path: Path, block_bytes: int | None = None) -> Iterator[str]:
    """The UTF-8 text of `path` in consecutive parts of about block_bytes (default READ_BYTES) bytes each,
    decoded as they are read, so that a large file is never held whole; a byte that is not UTF-8 stops it with
    the file's byte offset, as a whole-file decode would name it. A byte-order mark that opens the file is not
    text (editors on Windows write one) and is dropped, as in a .jsonl file."""
    block_bytes = READ_BYTES if block_bytes is None else block_bytes
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before this block
    first = True  # no character decoded yet
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(block_bytes)
                waiting = len(decoder.getstate()[0])  # a character's first bytes, held from the last block
                try:
                    text = decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    at = offset - waiting + e.start
                    raise LlmpyError(f"{path}: not UTF-8 text (byte {at}: {e.reason})") from None
                if not block:
                    return
                offset += len(block)
                if text and first:
                    text, first = text.removeprefix(BOM), False
                if text:
                    yield text
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read ({e.strerror or e})") from None


def _read_text(path: Path) -> str:
    return "".join(_text_blocks(path))


def _local_file(path: Path) -> Source:
    # else a shard of one end-of-text token, which no run can train on (a byte-order mark alone is no text either)
    if path.stat().st_size <= len(BOM.encode()) and not _read_text(path):
        raise LlmpyError(f"{path}: empty file, no text to tokenize")
    return Source(path.stem, lambda: iter([(False, [_text_blocks(path)])]))


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DEFAULT_TEXT_FIELD = "text"


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """The documents of a JSON-lines file, a line at a time: each non-blank line a JSON object whose `field` is
    the document's text (fineweb's and most web dumps' form); a line that is not is an error naming it."""
    import gzip
    import zlib

    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    # decoded here: json.loads would guess UTF-16 or -32 from the bytes and misname a non-UTF-8 line
                    decoded = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise LlmpyError(f"{path}: line {number}: not UTF-8 text (byte {e.start} of the line: "
                                     f"{e.reason})") from None
                try:
                    record = json.loads(decoded.removeprefix(BOM))  # a UTF-8 BOM: json.loads(bytes) skipped it
                except (ValueError, RecursionError) as e:  # RecursionError: nested too deep for the parser
                    raise LlmpyError(f"{path}: line {number}: not JSON ({e})") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise LlmpyError(f"{path}: line {number}: not an object with a string {field!r} field "
                                     "(--text-field names the field)")
                try:
                    text.encode("utf-8")  # JSON's "\ud800" escape gives a lone surrogate, which no tokenizer encodes
                except UnicodeEncodeError as e:
                    raise LlmpyError(f"{path}: line {number}: field {field!r} holds a lone surrogate "
                                     f"({text[e.start]!r} at character {e.start}), not Unicode text") from None
                yield text
    except (OSError, EOFError, zlib.error) as e:  # gzip's BadGzipFile is an OSError; EOFError: a cut-off .gz;
        reason = (e.strerror or e) if isinstance(e, OSError) else e  # zlib.error: damaged compressed data
        raise LlmpyError(f"{path}: cannot read ({reason})") from None


def _local_jsonl(path: Path, suffix: str, field: str) -> Source:
    if path.stat().st_size == 0:
        raise LlmpyError(f"{path}: empty file, no documents to tokenize")
    return Source(path.name[:-len(suffix)], lambda: iter([(False, _jsonl_documents(path, field))]))


def _jsonl_suffix(path: Path) -> str | None:
    return next((x for x in JSONL_SUFFIXES if path.name.lower().endswith(x)), None)


def _is_text_file(path: Path) -> bool:
    return path.suffix.lower() == ".txt"


def _files_under(folder: Path) -> Iterator[Path]:
    """Every file below folder (symbolic links to folders not followed); a subfolder that cannot be listed is an
    error naming it, where Path.rglob would skip it and its documents without a word."""
    def cannot_list(e: OSError):
        raise LlmpyError(f"{e.filename}: cannot list this folder ({e.strerror or e})")
    for top, _dirs, names in os.walk(folder, onerror=cannot_list):
        for name in names:
            yield Path(top) / name


def _local_folder(folder: Path, field: str) -> Source:
    files = sorted((p for p in _files_under(folder) if p.is_file() and (_is_text_file(p) or _jsonl_suffix(p))),
                   key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise LlmpyError(f"{folder}: folder holds no .txt, .jsonl or .jsonl.gz files")
    if all(p.stat().st_size == 0 for p in files):
        raise LlmpyError(f"{folder}: every .txt or .jsonl file in the folder is empty, no text to tokenize")

    def documents():
        # a .txt file is a document, read block by block as the tokenizer reaches it; a .jsonl file a document a line
        for p in files:
            if _is_text_file(p):
                yield _text_blocks(p)
            else:
                yield from _jsonl_documents(p, field)
    return Source(folder.resolve().name, lambda: iter([(False, documents())]))


def _tinyshakespeare(cache: Path) -> Source:
    def groups():
        text = _read_text(download(TINYSHAKESPEARE_URL, cache / "tinyshakespeare" / "input.txt",
                                   sha256=TINYSHAKESPEARE_SHA256))
        # llm.c: one document per blank-line-separated section, keeping the separator
        sections = text.split("\n\n")
        yield False, [s + "\n\n" if i < len(sections) - 1 else s for i, s in enumerate(sections)]
    return Source("tinyshakespeare", groups, default_val_tokens=32768)


_TINYSTORIES_MEMBER = re.compile(r"data\d+\.json")


def _tinystories_files(cache: Path) -> list[Path]:
    import tarfile

    folder = cache / "TinyStories_all_data"
    done = folder / ".complete"
    if not done.is_file():
        archive = download(TINYSTORIES_URL, cache / "TinyStories_all_data.tar.gz")
        writable_dir(folder, "download folder")
        remove_orphaned_temporaries(folder)  # a killed unpacking's partial file
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for m in tar:
                    name = os.path.basename(m.name)
                    if m.isfile() and _TINYSTORIES_MEMBER.fullmatch(name):
                        # only the base name is used, so no member can write outside `folder`
                        with tar.extractfile(m) as src:
                            _write_atomic_stream(folder / name, src)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise LlmpyError(f"{archive}: cannot unpack ({e}); delete it to download it again") from None
        done.write_text("ok\n")
    files = sorted(folder.glob("data*.json"))
    if not files:
        raise LlmpyError(f"{folder}: no data*.json files in the unpacked TinyStories archive")
    return files


def _write_atomic_stream(dest: Path, src) -> None:
    with atomic_path(dest) as tmp, open(tmp, "wb") as f:
        shutil.copyfileobj(src, f, 1 << 20)


def _tinystories(cache: Path) -> Source:
    def groups():
        for i, path in enumerate(_tinystories_files(cache)):
            try:
                stories = json.loads(path.read_text(encoding="utf-8"))
                docs = [s["story"].strip() for s in stories]
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise LlmpyError(f"{path}: not a TinyStories JSON file ({e}); delete {path.parent} to unpack the "
                                 "archive again") from None
            for j in range(0, len(docs), 4096):
                yield i == 0, docs[j:j + 4096]  # llm.c: data00.json is the val split
    return Source("tinystories", groups, hinted_split=True)


def _fineweb(name: str, shard_size: int) -> Source:
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        raise LlmpyError(f"{name} needs the `datasets` package, which is not installed (pip install datasets)")

    def groups():
        import datasets

        try:
            ds = datasets.load_dataset(FINEWEB_REPOS[name], name="sample-10BT", split="train", streaming=True)
            batch: list[str] = []
            for row in ds:
                batch.append(row["text"])
                if len(batch) == 1024:
                    yield False, batch
                    batch = []
            if batch:
                yield False, batch
        except (OSError, ConnectionError, ValueError) as e:
            raise LlmpyError(f"cannot read {FINEWEB_REPOS[name]} through `datasets` ({type(e).__name__}: {e})") \
                from None
    return Source(name, groups, default_val_tokens=shard_size)


def resolve_source(source: str, cache: Path, shard_size: int, text_field: str | None = None) -> Source:
    key = source.strip().lower()
    path = expand_user(source)
    jsonl = _jsonl_suffix(path)
    if text_field is not None and (key in NAMED_DATASETS or not (jsonl or path.is_dir())):
        raise LlmpyError(f"--text-field {text_field!r}: only a .jsonl source (or a folder of them) has fields")
    if text_field == "":
        raise LlmpyError("--text-field '': name the field that holds the text")
    field = DEFAULT_TEXT_FIELD if text_field is None else text_field
    if key == "tinyshakespeare":
        return _tinyshakespeare(cache)
    if key == "tinystories":
        return _tinystories(cache)
    if key in FINEWEB_REPOS:
        return _fineweb(key, shard_size)
    if path.is_file():
        return _local_jsonl(path, jsonl, field) if jsonl else _local_file(path)
    if path.is_dir():
        return _local_folder(path, field)
    if path.exists():  # a device, pipe or socket: no text of a known size to split
        raise LlmpyError(f"{source}: not a regular file or folder (give a text or .jsonl file, or a folder of "
                         "them)")
    raise LlmpyError(f"{source}: no such file or folder, and not a named dataset "
                     f"({', '.join(NAMED_DATASETS)})")


# ----------------------------------------------------------------------------------------------
# writing

KEEP_FRESH_S = ORPHAN_MIN_AGE_S / 10  # how often a prepare touches its temporaries that no write changes


class Staging:
    """Shards written under temporary names in the output folder and renamed into place together once the
    whole prepare succeeded, so that a failed or interrupted one leaves an earlier dataset as it was."""

    def __init__(self, folder: Path | None = None, log: Callable[[str], None] | None = None):
        self.pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self.others: list[Path] = []  # the run's other temporaries (the spilled token stream)
        self.folder, self.log = folder, log  # where keep_fresh looks for a killed prepare's temporaries
        self._touched = time.monotonic()

    def keep_fresh(self) -> None:
        """Touch the run's temporaries every KEEP_FRESH_S. A finished shard waits unchanged until the commit, and
        the spill while it is read back, for hours on a large corpus; a prepare on another host of a shared folder
        (or in another container) cannot see this process, so it tells a live writer's files only by their age.
        By the same rule, the temporaries of a prepare killed just before this one began were too new to remove at
        its start (a spill as large as the dataset's tokens): they go here once they have aged."""
        now = time.monotonic()
        if now - self._touched < KEEP_FRESH_S:
            return
        self._touched = now
        for path in [tmp for tmp, _ in self.pending] + self.others:
            try:
                os.utime(path)
            except OSError:  # not created yet (a shard's file opens at its first tokens), or gone: nothing to keep
                pass
        if self.folder is not None:  # after the touch: this run's own files are fresh, whatever their age before
            remove_orphaned_temporaries(self.folder, self.log)

    def temporary(self, final: Path) -> Path:
        # hidden and not ending in .bin: neither a shard glob nor _remove_stale picks it up; named by this process,
        # so that two prepares into one folder do not collide
        tmp = temporary_sibling(final, "part")
        self.pending.append((tmp, final))
        return tmp

    def commit(self, journal: Path | None = None) -> None:
        """Every new shard into place, or none: a shard being replaced is first set aside under a temporary name and
        put back if a later move fails, so that a train never reads a mix of two prepares. `journal` (data's
        commit_journal) is written first, and left for the caller to remove once the dataset is whole: a process
        killed in between leaves it, and train refuses the shards it names."""
        for _, final in self.pending:
            if os.path.lexists(final) and not (os.path.islink(final) or os.path.isfile(final)):
                raise LlmpyError(f"{final}: not a file, where a new shard goes; move it away")
        moved, set_aside, final = [], [], None  # finals holding new shards; (temporary, final) of the old ones
        # an earlier prepare's journal (it was killed mid-way): the folder is a mix already, and stays refused until
        # a commit completes, even when this one is rolled back
        earlier_journal = journal is not None and os.path.lexists(journal)
        if journal is not None:
            try:
                journal.write_text(f"llmpy prepare (process {os.getpid()}) moving {len(self.pending)} shard(s)\n")
            except OSError as e:
                raise LlmpyError(f"{journal}: cannot write ({e.strerror or e}); the shards already there are as "
                                 "they were") from None
        put_back = True
        try:
            for tmp, final in self.pending:
                if os.path.lexists(final):
                    backup = temporary_sibling(final, "old")
                    # each move noted before it is made: a Ctrl-C between the two would leave it out of the undoing
                    set_aside.append((backup, final))
                    os.replace(final, backup)
                    # a rename keeps the old shard's time: fresh, a prepare on another host (which knows a temporary
                    # only by its age) leaves it for the put-back below
                    os.utime(backup)
                moved.append(final)
                os.replace(tmp, final)
        except BaseException as e:  # Ctrl-C too
            for path in moved:
                _unlink(path)
            for backup, old in reversed(set_aside):
                if not os.path.lexists(backup):
                    continue  # its move was not made
                try:
                    os.replace(backup, old)
                except OSError:
                    put_back = False
            if journal is not None and put_back and not earlier_journal:  # as they were: nothing for train to refuse
                _unlink(journal)
            if isinstance(e, OSError):
                kept_from = f" ({journal.name} keeps train from them)" if journal is not None else ""
                state = ("the shards already there are as they were" if put_back else
                         f"some earlier shards could not be put back{kept_from}: run the prepare again")
                raise LlmpyError(f"{final}: cannot move the new shard into place ({e.strerror or e}); {state}") \
                    from None
            raise
        self.pending = []
        for backup, _ in set_aside:
            _unlink(backup)

    def discard(self) -> None:
        for tmp, _ in self.pending:
            _unlink(tmp)
        self.pending = []


class ShardWriter:
    """Cuts one split's token stream into shards of exactly `shard_size` tokens (the last shorter), each written
    as its tokens come (data.ShardFile) under its temporary name until staging.commit()."""

    def __init__(self, outdir: Path, name: str, split: str, shard_size: int, staging: Staging):
        self.outdir, self.name, self.split, self.shard_size = outdir, name, split, shard_size
        self.staging = staging
        self.shard: ShardFile | None = None  # the shard being written
        self.written: list[tuple[Path, int]] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.shard is None:
                path = self.outdir / shard_name(self.name, self.split, len(self.written))
                self.shard = ShardFile(self.staging.temporary(path))
                self.written.append((path, 0))
            take = min(len(tokens), self.shard_size - self.shard.num_tokens)
            self.shard.append(tokens[:take])
            tokens = tokens[take:]
            if self.shard.num_tokens == self.shard_size:
                self._finish()

    def _finish(self) -> None:
        self.written[-1] = (self.written[-1][0], self.shard.close())
        self.shard = None

    def close(self) -> list[tuple[Path, int]]:
        if self.shard is not None:
            self._finish()
        return self.written

    def abandon(self) -> None:
        if self.shard is not None:
            self.shard.abandon()
            self.shard = None


SPILL_READ_TOKENS = 1 << 24  # the spilled stream is read back this many tokens at a time


def _spill(chunks: Iterable[tuple[bool, np.ndarray]], path: Path) -> int:
    """Write the token stream to `path` (a new file) and return its length: a split by --val-fraction needs the
    total before the first shard, and the stream on disk costs no memory (in memory, 2 bytes a token)."""
    def failed(e: OSError) -> LlmpyError:  # the file's errors only: the source's own pass through as they are
        return LlmpyError(f"{path}: cannot write the token stream to count it ({e.strerror or e})")
    total = 0
    try:
        f = open(path, "xb", buffering=0)  # unbuffered: a full disk says so at a write, never at close
    except OSError as e:
        raise failed(e) from None
    with f:
        for _, tokens in chunks:
            data = memoryview(np.ascontiguousarray(tokens, dtype="<u2")).cast("B")
            try:
                while data:
                    data = data[f.write(data):]
            except OSError as e:
                raise failed(e) from None
            total += len(tokens)
    return total


def _unspill(path: Path) -> Iterator[tuple[bool, np.ndarray]]:
    try:
        with open(path, "rb") as f:
            while block := f.read(2 * SPILL_READ_TOKENS):
                yield False, np.frombuffer(block, dtype="<u2")
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read back the token stream ({e.strerror or e})") from None


def _token_chunks(src: Source, tok: Tokenizer) -> Iterator[tuple[bool, np.ndarray]]:
    # a batch's tokens at a time: a long text file streams through (and the progress bar moves) in pieces
    try:
        for hint, docs in src.groups():
            for tokens in tok.iter_encoded(docs):
                yield hint, tokens
    except UnicodeEncodeError as e:  # JSON's "\ud800" escape gives a lone surrogate (jsonl lines are checked first)
        raise LlmpyError(f"{src.name}: a document holds a lone surrogate ({e.object[e.start]!r}), not Unicode "
                         "text") from None


def prepare(source: str, outdir: str | os.PathLike | None = None, *, tokenizer: str = "gpt2",
            tokenizer_dir: str | None = None, val_fraction: float | None = None,
            val_tokens: int | None = None, shard_size: int | None = None,
            name: str | None = None, cache_dir: str | os.PathLike | None = None,
            text_field: str | None = None, log=print) -> dict[str, list[tuple[Path, int]]]:
    """Tokenize SOURCE into shards; returns {"val": [(path, tokens)...], "train": [...]}. text_field: the field of
    a .jsonl source's records that holds the text (default "text"); shard_size: tokens a shard (None:
    DEFAULT_SHARD_SIZE; None is how hellaswag tells that --shard-size was not given)."""
    from tqdm import tqdm

    shard_size_given = shard_size is not None
    shard_size = DEFAULT_SHARD_SIZE if shard_size is None else shard_size
    if not 0 < shard_size <= MAX_SHARD_SIZE:
        raise LlmpyError(f"--shard-size {shard_size} must be between 1 and {MAX_SHARD_SIZE}")
    if val_fraction is not None and val_tokens is not None:
        raise LlmpyError("give --val-fraction or --val-tokens, not both")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise LlmpyError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if val_tokens is not None and val_tokens < 0:
        raise LlmpyError(f"--val-tokens {val_tokens} must not be negative")
    # Path("") is the current folder: not what was meant (checked before hellaswag's branch, which takes them too)
    if not source.strip():
        raise LlmpyError(f"SOURCE '{source}': an empty name (give a text or .jsonl file, a folder of them, or a named "
                         f"dataset: {', '.join(NAMED_DATASETS)})")
    if outdir is not None and not str(outdir).strip():
        raise LlmpyError("-o '': an empty output folder name (leave -o out for data/NAME)")
    if cache_dir is not None and not str(cache_dir).strip():
        raise LlmpyError(f"--cache-dir '': an empty folder name (leave it out for {default_download_dir()})")
    refuse_files_for_bytes(tokenizer, tokenizer_dir, "--tokenizer-dir")
    cache = expand_user(cache_dir) if cache_dir is not None else default_download_dir()
    if source.strip().lower() == "hellaswag":  # an eval file, not train/val shards
        from .hellaswag import prepare_hellaswag
        if (val_fraction is not None or val_tokens is not None or name is not None or text_field is not None
                or shard_size_given):
            raise LlmpyError("hellaswag: --shard-size, --val-fraction, --val-tokens, --name and --text-field do not "
                             "apply to the eval file")
        dest = prepare_hellaswag(outdir, cache, tokenizer, tokenizer_dir, log=log)
        return {"val": [(dest, 0)], "train": []}
    src = resolve_source(source, cache, shard_size, text_field)
    if name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise LlmpyError(f"--name {name!r}: use letters, digits, '.', '_' and '-' only")
    name = name or re.sub(r"[^A-Za-z0-9._-]+", "_", src.name) or "data"
    out = expand_user(outdir) if outdir is not None else Path("data") / name
    use_hints = src.hinted_split and val_fraction is None and val_tokens is None
    # val tokens from the start of the stream; None: a fraction of the total, counted below
    n_val = val_tokens if val_tokens is not None or val_fraction is not None else src.default_val_tokens

    created = _missing_folders(out)
    journal = commit_journal(out, name)
    def log_beside_bar(line: str) -> None:  # a note in the middle of the run: the progress bar cleared, then redrawn
        with tqdm.external_write_mode():
            log(line)
    staging = Staging(out, log_beside_bar)
    spill = commit_lock = None
    writers: dict[str, ShardWriter] = {}
    try:
        writable_dir(out, "output folder")
        remove_orphaned_temporaries(out, log)
        tok = load_tokenizer(tokenizer, tokenizer_dir, download=True)  # the user asked for data: tiktoken may fetch
        writers = {s: ShardWriter(out, name, s, shard_size, staging) for s in ("val", "train")}
        seen = 0
        with tqdm(unit="tok", unit_scale=True, desc=f"tokenizing {src.name}", disable=None) as bar:
            def counted(chunks):
                for hint, tokens in chunks:
                    bar.update(len(tokens))
                    yield hint, tokens
            chunks: Iterable[tuple[bool, np.ndarray]] = counted(_token_chunks(src, tok))
            if not use_hints and n_val is None:  # a fraction of a total not known yet
                spill = temporary_sibling(out / f"{name}_tokens", "part")  # a killed run's is an orphan to remove
                staging.others.append(spill)
                total = _spill(chunks, spill)
                chunks = counted(_unspill(spill))
                n_val = int(round(total * (DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction)))
                bar.set_description(f"splitting {src.name}")  # the second pass: from the spill into shards
                bar.reset(total=total)
            for hint, tokens in chunks:
                staging.keep_fresh()
                if use_hints:
                    writers["val" if hint else "train"].add(tokens)
                else:
                    k = max(0, min(len(tokens), n_val - seen))
                    writers["val"].add(tokens[:k])
                    writers["train"].add(tokens[k:])
                seen += len(tokens)
        result = {s: w.close() for s, w in writers.items()}
        if not seen:
            raise LlmpyError(f"{source}: no documents to tokenize")
        if not result["train"]:
            raise LlmpyError(f"{source}: all {seen} tokens went to the val split; nothing left to train on "
                             "(lower --val-tokens / --val-fraction)")
        commit_lock = _lock_folder_for_commit(out, log)
        staging.commit(journal)
    except BaseException:  # KeyboardInterrupt too: no temporaries, no empty folder of ours left behind
        _unlock(commit_lock)
        for w in writers.values():
            w.abandon()
        staging.discard()
        if spill is not None:
            _unlink(spill)
        _remove_empty(created)
        raise
    if spill is not None:
        _unlink(spill)
    try:
        _remove_stale(out, name, result)
        _unlink(journal)  # the dataset is whole: the new shards in place, the earlier run's extra ones gone
    finally:
        _unlock(commit_lock)
    for split in ("val", "train"):
        files = result[split]
        total = sum(n for _, n in files)
        log(f"{split}: {total:,} tokens in {len(files)} shard(s)" + (f", {files[0][0]} .." if files else ""))
    log(f"tokenizer {tok.name} (vocab {tok.vocab_size}); train on {out / (name + '_train_*.bin')}"
        + (f", validate on {out / (name + '_val_*.bin')}" if result["val"] else ""))
    return result


def _lock_folder_for_commit(out: Path, log) -> int | None:
    """An exclusive lock on the output folder from the first shard moved into place until the earlier extra ones are
    removed: two prepares into one folder then commit one after the other, each whole, where their moves and
    removals interleaved (one's stale removal could delete the other's new shards, and both shared one commit
    journal). The lock goes with the process, however it ends. None where there are no locks (Windows, some
    network file systems), which a note names."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError as e:
        raise LlmpyError(f"{out}: cannot open the output folder to lock it ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another llmpy prepare to finish moving its shards into {out}")
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        os.close(fd)
        if e.errno in NO_LOCKS_ERRNOS:
            log(f"note: {out}: the file system takes no locks ({e.strerror}); a second prepare into this folder "
                "at the same time could mix its shards with these")
            return None
        raise LlmpyError(f"{out}: cannot lock the output folder ({e.strerror or e})") from None
    except BaseException:  # Ctrl-C while waiting
        os.close(fd)
        raise
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the lock


def _missing_folders(folder: Path) -> list[Path]:
    """The folders that creating `folder` would make, deepest first."""
    missing = []
    path = Path(os.path.abspath(folder))
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed prepare created, deepest first, as far as they are still empty."""
    for folder in folders:
        try:
            os.rmdir(folder)  # refuses a folder that holds anything
        except OSError:
            return


def _remove_stale(out: Path, name: str, result) -> None:
    """Shards of an earlier, bigger run would be picked up by the glob: delete them."""
    keep = {p.name for files in result.values() for p, _ in files}
    pattern = re.compile(re.escape(name) + r"_(train|val)_\d{6}\.bin")
    for p in out.iterdir():
        if pattern.fullmatch(p.name) and p.name not in keep:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # left, it would be read with the new ones: the commit journal stays, and says so
                raise LlmpyError(f"{p}: cannot remove this shard of an earlier prepare ({e.strerror or e}); train "
                                 "refuses the folder's shards until it is gone and the prepare has run again") \
                    from None


# ----------------------------------------------------------------------------------------------
# command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("source", metavar="SOURCE",
                        help="a text file, a .jsonl or .jsonl.gz file (one document a line), a folder of .txt "
                             f"and .jsonl files, or one of: {', '.join(NAMED_DATASETS)}")
    parser.add_argument("-o", "--output-dir", default=None, metavar="OUTDIR",
                        help="folder for the shards (default: data/NAME)")
    parser.add_argument("--name", default=None, help="shard name prefix (default: dataset, file or folder name)")
    parser.add_argument("--tokenizer", choices=TOKENIZER_NAMES, default="gpt2",
                        help="gpt2 (BPE, 50257 tokens) or bytes (257 tokens, offline); default gpt2")
    parser.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                        help="folder with GPT-2's encoder.json and vocab.bpe (default: $LLMPY_GPT2_DIR, "
                             "else tiktoken's cache, else tiktoken downloads them)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None,
                     help=f"fraction of the tokens (from the start) for validation (default {DEFAULT_VAL_FRACTION}, "
                          "or the dataset's llm.c split); the token stream is counted in a temporary file beside "
                          "the shards, as large as they are")
    val.add_argument("--val-tokens", type=int, default=None, metavar="N",
                     help="the first N tokens are the validation split")
    parser.add_argument("--shard-size", type=int, default=None, metavar="N",  # None: not given (hellaswag refuses it)
                        help=f"tokens per shard (default {DEFAULT_SHARD_SIZE:,})")
    parser.add_argument("--text-field", default=None, metavar="NAME",
                        help=f"a .jsonl source's field that holds each document's text (default "
                             f"{DEFAULT_TEXT_FIELD!r})")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help=f"where downloads are kept (default {default_download_dir()})")


def run(args: argparse.Namespace) -> int:
    prepare(args.source, args.output_dir, tokenizer=args.tokenizer, tokenizer_dir=args.tokenizer_dir,
            val_fraction=args.val_fraction, val_tokens=args.val_tokens, shard_size=args.shard_size,
            name=args.name, cache_dir=args.cache_dir, text_field=args.text_field,
            log=lambda msg: print(msg, file=sys.stdout))
    return 0


__all__ = ["add_arguments", "run", "prepare", "download", "resolve_source", "ShardWriter", "Staging",
           "NAMED_DATASETS", "DEFAULT_SHARD_SIZE"]
