"""Token shards and the data loader, in llm.c's format and order.

Shard file (llm.c's `.bin` token format): a header of 256 little-endian int32 -- [0] magic 20240520,
[1] version 1, [2] number of tokens -- followed by the tokens as little-endian uint16.

`DataLoader` reproduces llm.c's dataloader.h: the shards of a glob (sorted) are read one after
another; a shard holds `(n_tokens - 1) // (world_size * B * T)` windows of `world_size * B * T + 1`
tokens, rank r reads the `B * T + 1` tokens at `r * B * T` inside each window, inputs are the first
`B * T` of them and targets the last `B * T`. After the last shard a new epoch starts. A shard too
small for one window (a prepared split's short last shard) is set aside, in `skipped`, where llm.c
stops; only when every shard is too small is that an error. With
`shuffle=True` each epoch visits the shards, and the windows inside each shard, in an order drawn
from `(seed, epoch)` -- the same on every rank, so the ranks stay disjoint.

Batches are `(inputs, targets)`: two CPU `torch.int64` tensors of shape (B, T); the caller moves
them to its device.

Validation, as llm.c does it: `EvalLoader(val_pattern, B, T, ...)` (never shuffled) and
`for x, y in loader.batches(m): ...` -- every call starts from the first window, so each
evaluation sees the same `m` batches (`m=None`: one whole pass over the validation shards).
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from .errors import LlmpyError

if TYPE_CHECKING:  # torch loads with the first batch: `llmpy prepare` writes shards without it
    import torch

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = 65535  # uint16
STATE_VERSION = 1
VOCAB_CHECK_TOKENS = 1 << 24  # the loader checks a shard's ids against the vocabulary in pieces of 32 MB


# ----------------------------------------------------------------------------------------------
# shard files

def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write `tokens` (any integer array-like) as an llm.c token shard, atomically.

    The data goes to a temporary file in the same folder, is fsynced and then renamed over `path`,
    so a reader (or a crash) never sees a half-written shard.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise LlmpyError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = lo if lo < 0 else hi
            pos = int(np.argmax(arr == bad))
            raise LlmpyError(f"{path}: token id {bad} at position {pos} does not fit a uint16 shard "
                             f"(ids must be 0..{MAX_TOKEN_ID})")
    if arr.size >= 2**31:
        raise LlmpyError(f"{path}: {arr.size} tokens is more than a shard's int32 count can hold")
    body = arr.astype("<u2", copy=False)
    _atomic_write(path, [_shard_header(arr.size), body.tobytes()])
    return path


def _shard_header(num_tokens: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, num_tokens
    return header.tobytes()


class ShardFile:
    """A token shard written as its tokens arrive, so that it is never held in memory whole (`llmpy prepare`'s
    shards, 10^8 tokens by default): the header with a count of 0, the tokens appended, then close() writes the
    count over the header's and syncs. Not atomic by itself: write it under a temporary name and rename it once
    closed. Token ids must fit uint16 (a tokenizer's arrays do); an OS error is one line naming the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.num_tokens = 0
        try:
            self._file = open(self.path, "xb")
            self._file.write(_shard_header(0))
        except OSError as e:
            self._fail(e)

    def append(self, tokens: np.ndarray) -> None:
        if self.num_tokens + len(tokens) >= 2**31:
            raise LlmpyError(f"{self.path}: more tokens than a shard's int32 count can hold")
        try:
            self._file.write(memoryview(np.ascontiguousarray(tokens, dtype="<u2")).cast("B"))
        except OSError as e:
            self._fail(e)
        self.num_tokens += len(tokens)

    def close(self) -> int:
        """Write the count, sync and close; returns the count."""
        try:
            self._file.seek(0)
            self._file.write(_shard_header(self.num_tokens))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        except OSError as e:
            self._fail(e)
        return self.num_tokens

    def abandon(self) -> None:
        """Close without finishing (the caller removes the file)."""
        if getattr(self, "_file", None) is not None:
            try:
                self._file.close()
            except OSError:
                pass  # its unwritten bytes: the file is going anyway

    def _fail(self, e: OSError):
        self.abandon()
        raise LlmpyError(f"{self.path}: cannot write ({e.strerror or e})") from None


def _atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write the chunks to `path` atomically (files.atomic_write: temp file, fsync, rename), making
    the folder first; an OS error becomes one line naming the file."""
    from .files import atomic_write
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: [f.write(chunk) for chunk in chunks])
    except OSError as e:
        raise LlmpyError(f"{path}: cannot write ({e.strerror or e})") from None


def shard_num_tokens(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count (reads only the header)."""
    path = Path(path)
    try:
        st = path.stat()
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a pipe would block the read for ever
            raise LlmpyError(f"{path}: not a regular file, so not a token shard")
        size = st.st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise LlmpyError(f"{path}: no such token shard") from None
    except IsADirectoryError:
        raise LlmpyError(f"{path}: is a folder, not a token shard") from None
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < HEADER_BYTES:
        raise LlmpyError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header of an "
                         "llm.c token shard")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != SHARD_MAGIC:
        raise LlmpyError(f"{path}: bad magic {magic} (expected {SHARD_MAGIC}): not an llm.c token shard")
    if version != SHARD_VERSION:
        raise LlmpyError(f"{path}: unsupported token shard version {version} (expected {SHARD_VERSION})")
    if count < 0:
        raise LlmpyError(f"{path}: negative token count {count} in the header")
    expected = HEADER_BYTES + 2 * count
    if size < expected:
        raise LlmpyError(f"{path}: truncated: header says {count} tokens ({expected} bytes), "
                         f"file has {size} bytes")
    if size > expected:
        raise LlmpyError(f"{path}: {size - expected} trailing bytes after the {count} tokens the "
                         "header declares")
    return count


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """The tokens of a validated shard as a read-only uint16 array (memory-mapped: a file shortened while the
    array lives kills the process with SIGBUS, so the loader reads its batches with read_tokens instead)."""
    count = shard_num_tokens(path)
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def read_tokens(f, path, start: int, count: int) -> np.ndarray:
    """`count` tokens from position `start` of the open shard `f` (opened with buffering=0), read rather than
    mapped: a shard shortened under the loader is one line naming it, not a SIGBUS."""
    out = np.empty(count, dtype="<u2")
    view, got = memoryview(out).cast("B"), 0
    f.seek(HEADER_BYTES + 2 * start)
    while got < 2 * count:  # f unbuffered (no stale bytes after a change): a read may stop short
        n = f.readinto(view[got:])
        if not n:
            raise LlmpyError(f"{path}: changed on disk while training (tokens {start} to {start + count - 1} are "
                             f"no longer there)")
        got += n
    return out


def check_tokens(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, offset: int = 0) -> None:
    """Raise if any token id is >= vocab_size, naming the shard, the id and its position (tokens[0] is the
    shard's token `offset`)."""
    if tokens.size == 0:
        return
    hi = int(tokens.max())
    if hi >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise LlmpyError(f"{path}: token id {int(tokens[pos])} at position {offset + pos} is outside the "
                         f"vocabulary of {vocab_size} (wrong tokenizer for this model?)")


def resolve_shards(pattern_or_paths) -> list[Path]:
    """Files named by a glob, a path, or a list of either; sorted within each glob."""
    items = [pattern_or_paths] if isinstance(pattern_or_paths, (str, os.PathLike)) else list(pattern_or_paths)
    if not items:
        raise LlmpyError("no token shards given (empty file list)")
    files: list[Path] = []
    for item in items:
        s = os.fspath(item)
        if glob.has_magic(s) and not os.path.lexists(s):  # run[1]/x_train_000000.bin: a file's own name
            head, tail = os.path.split(s)
            matched = []
            # run[1]/*.bin: a folder's own name first (prepare -o "run[1]" prints it), else [1] would pick run1's
            if head and glob.has_magic(head) and os.path.isdir(head):
                matched = sorted(glob.glob(os.path.join(glob.escape(head), tail)))
            if not matched:
                matched = sorted(glob.glob(s))
            if not matched:
                raise LlmpyError(f"{s}: no files match this pattern{_stopped_commit_note(head)}")
            files.extend(Path(m) for m in matched)
        else:
            if not Path(s).exists():
                raise LlmpyError(f"{s}: no such token shard")
            files.append(Path(s))
    refuse_a_stopped_commit(files)
    return files


# ----------------------------------------------------------------------------------------------
# loader

class DataLoader:
    """llm.c's distributed data loader over token shards; see the module docstring for the order.

    `next_batch()` (or iterating, which never ends) returns `(inputs, targets)` as CPU int64 tensors
    of shape (B, T). `state_dict()` is the position (epoch, shard, window), the same on every rank;
    `load_state_dict()` restores it so that the following batches are bitwise the ones the original
    loader would have produced.
    """

    def __init__(self, pattern_or_paths, B: int, T: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 1337, vocab_size: int | None = None):
        if B <= 0 or T <= 0:
            raise LlmpyError(f"batch size B={B} and sequence length T={T} must be positive")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise LlmpyError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
        if vocab_size is not None and vocab_size <= 0:
            raise LlmpyError(f"vocab size {vocab_size} must be positive")
        self.B, self.T = int(B), int(T)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.vocab_size = vocab_size
        self.window = self.world_size * self.B * self.T  # tokens one step consumes over all ranks
        self.files: list[Path] = []
        self.shard_tokens: list[int] = []
        self.shard_windows: list[int] = []
        self.skipped: list[tuple[Path, int]] = []  # (shard, tokens): too small for one window
        for f in resolve_shards(pattern_or_paths):
            n = shard_num_tokens(f)
            if n < self.window + 1:
                self.skipped.append((f, n))
                continue
            self.files.append(f)
            self.shard_tokens.append(n)
            self.shard_windows.append((n - 1) // self.window)
        if not self.files:
            f, n = max(self.skipped, key=lambda item: item[1])
            more = f" (the largest of {len(self.skipped)} shards)" if len(self.skipped) > 1 else ""
            raise LlmpyError(f"{f}: {n} tokens{more} is too small for one batch: B*T*world_size+1 = "
                             f"{self.B}*{self.T}*{self.world_size}+1 = {self.window + 1} tokens")
        self._checked: set[int] = set()  # shards whose ids were checked against vocab_size
        self._open_index: int | None = None
        self._open_file = None
        self.reset()

    # -- sizes
    @property
    def num_tokens(self) -> int:
        """Tokens in all the shards."""
        return sum(self.shard_tokens)

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens this rank turns into inputs in one epoch (the rest of each shard is unused)."""
        return len(self) * self.B * self.T

    def __len__(self) -> int:
        """Batches per epoch (the same for every rank)."""
        return sum(self.shard_windows)

    # -- order
    def _shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.files)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0]).permutation(n)

    def _window_order(self, epoch: int, shard: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch, 1, shard]).permutation(self.shard_windows[shard])

    def _set_position(self, epoch: int, shard_pos: int, window_pos: int) -> None:
        self.epoch, self.shard_pos, self.window_pos = epoch, shard_pos, window_pos
        self._order = self._shard_order(epoch)
        self._windows = self._window_order(epoch, int(self._order[shard_pos]))

    def reset(self) -> None:
        """Back to the first batch of epoch 0."""
        self._set_position(0, 0, 0)

    def _shard_file(self, shard: int):
        """The open file of `shard`, its header checked again and its ids against vocab_size once."""
        if self._open_index != shard:
            self.close()
            path, expected = self.files[shard], self.shard_tokens[shard]
            n = shard_num_tokens(path)
            if n != expected:
                raise LlmpyError(f"{path}: changed on disk while training ({n} tokens, was {expected})")
            try:
                f = open(path, "rb", buffering=0)
            except OSError as e:
                raise LlmpyError(f"{path}: cannot read ({e.strerror or e})") from None
            self._open_index, self._open_file = shard, f
            if self.vocab_size is not None and shard not in self._checked:
                try:
                    for start in range(0, n, VOCAB_CHECK_TOKENS):  # in pieces: a shard may be GBs
                        count = min(VOCAB_CHECK_TOKENS, n - start)
                        check_tokens(path, read_tokens(f, path, start, count), self.vocab_size, offset=start)
                except LlmpyError:
                    self.close()  # left open, the next batch would take the shard as checked
                    raise
                self._checked.add(shard)
        return self._open_file

    def close(self) -> None:
        """Close the open shard (the next batch opens it again)."""
        if self._open_file is not None:
            self._open_file.close()
        self._open_index, self._open_file = None, None

    def __del__(self):
        if getattr(self, "_open_file", None) is not None:  # none where __init__ failed
            self.close()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard = int(self._order[self.shard_pos])
        w = self.window_pos if self._windows is None else int(self._windows[self.window_pos])
        start = w * self.window + self.rank * self.B * self.T
        buf = read_tokens(self._shard_file(shard), self.files[shard], start, self.B * self.T + 1).astype(np.int64)
        # advance: next window, else next shard, else next epoch
        if self.window_pos + 1 < self.shard_windows[shard]:
            self.window_pos += 1
        elif self.shard_pos + 1 < len(self.files):
            self._set_position(self.epoch, self.shard_pos + 1, 0)
        else:
            self._set_position(self.epoch + 1, 0, 0)
        import torch
        t = torch.from_numpy(buf)
        return t[:-1].view(self.B, self.T), t[1:].view(self.B, self.T)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def __next__(self):
        return self.next_batch()

    # -- checkpointing
    def fingerprint(self) -> str:
        """The shards read, by name and size (16 hex digits): a resume or another rank must read the same."""
        h = hashlib.sha1()
        for f, n in zip(self.files, self.shard_tokens):
            h.update(f"{f.name}:{n};".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        """The position as a small JSON-serialisable dict; identical on every rank."""
        return {
            "version": STATE_VERSION, "epoch": self.epoch, "shard_pos": self.shard_pos,
            "window_pos": self.window_pos, "shuffle": self.shuffle, "seed": self.seed,
            "B": self.B, "T": self.T, "world_size": self.world_size,
            "num_shards": len(self.files), "shards": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`; the loader must read the same shards with the same B, T,
        world size, shuffle and seed (the permutations are recomputed from seed and epoch)."""
        try:
            if state.get("version") != STATE_VERSION:
                raise LlmpyError(f"data loader state version {state.get('version')} is not {STATE_VERSION}")
            mine = self.state_dict()
            for key in ("B", "T", "world_size", "shuffle", "seed"):
                if state[key] != mine[key]:
                    raise LlmpyError(f"data loader state was saved with {key}={state[key]!r}, this run "
                                     f"has {key}={mine[key]!r}; the position cannot be restored")
            if (state["num_shards"], state["shards"]) != (mine["num_shards"], mine["shards"]):  # a hash tells nothing
                raise LlmpyError(f"the position was saved over other shards than these {len(self.files)} "
                                 f"({self.files[0].name} ...; {state['num_shards']} then, told apart by name and "
                                 "token count): resume with the data that run trained on")
            epoch, shard_pos, window_pos = int(state["epoch"]), int(state["shard_pos"]), int(state["window_pos"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise LlmpyError(f"data loader state is malformed ({type(e).__name__}: {e})") from None
        if epoch < 0 or not 0 <= shard_pos < len(self.files):
            raise LlmpyError(f"data loader state has epoch {epoch}, shard {shard_pos}: out of range")
        self._set_position(epoch, shard_pos, 0)
        shard = int(self._order[shard_pos])
        if not 0 <= window_pos < self.shard_windows[shard]:
            raise LlmpyError(f"data loader state has window {window_pos} of shard {self.files[shard]}, "
                             f"which has {self.shard_windows[shard]}")
        self.window_pos = window_pos

    def __repr__(self) -> str:
        return (f"DataLoader({len(self.files)} shards, {self.num_tokens} tokens, B={self.B}, T={self.T}, "
                f"rank {self.rank}/{self.world_size}, shuffle={self.shuffle}, {len(self)} batches/epoch)")


class EvalLoader(DataLoader):
    """A never-shuffled loader for validation: `batches(m)` yields the first m batches each call."""

    def __init__(self, pattern_or_paths, B: int, T: int, rank: int = 0, world_size: int = 1,
                 vocab_size: int | None = None):
        super().__init__(pattern_or_paths, B, T, rank=rank, world_size=world_size, shuffle=False,
                         vocab_size=vocab_size)

    def batches(self, m: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first `m` batches (all of one pass when m is None); more than one pass is an error,
        because it would count some tokens twice."""
        n = len(self) if m is None else int(m)
        if n < 0 or n > len(self):
            names = self.files[0].name + (f" .. {self.files[-1].name}" if len(self.files) > 1 else "")
            raise LlmpyError(f"{m} validation batches requested, but {names} hold only {len(self)} batches "
                             f"of B*T*world_size = {self.window} tokens")
        self.reset()
        for _ in range(n):
            yield self.next_batch()


# ----------------------------------------------------------------------------------------------
# the embedded default corpus: the running Python's standard library

DEFAULT_CORPUS_BYTES = 4 * 2**20
# tests (large, repetitive), third-party packages, and generated tables are not useful text
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
              "encodings", "pydoc_data"}


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """The documents of the offline default run: the stdlib's `*.py` files, one document each,
    sorted by relative path, whole files until `max_bytes` (UTF-8 bytes) would be exceeded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise LlmpyError(f"{root}: the Python standard library folder is missing; no default corpus")
    rel_files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        rel_files.extend((rel / name).as_posix() for name in filenames
                         if name.endswith(".py") and not name.startswith("test_"))
    docs, total = [], 0
    for rel in sorted(rel_files):
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            break
        docs.append(text)
        total += size
    if not docs:
        raise LlmpyError(f"{root}: no Python source files found for the default corpus")
    return docs


@dataclass(frozen=True)
class DatasetFiles:
    """Where a prepared dataset lies: glob patterns for the train and val shards."""
    train: str
    val: str
    vocab_size: int
    tokenizer: str


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmpy" / "default"


def default_dataset(tokenizer=None, cache_dir: str | os.PathLike | None = None,
                    val_fraction: float = 0.05, max_bytes: int = DEFAULT_CORPUS_BYTES) -> DatasetFiles:
    """Tokenize `default_corpus()` into `stdlib_train_000000.bin` / `stdlib_val_000000.bin` under
    `cache_dir/<tokenizer name>/` once, and reuse them while the corpus and tokenizer are unchanged.

    The last `val_fraction` of the documents (at least one) is the validation split. `tokenizer`
    defaults to the byte-level one (no files, no network).
    """
    import json

    from .tokenizer import ByteTokenizer

    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    if not 0 < val_fraction < 1:
        raise LlmpyError(f"val_fraction {val_fraction} must be between 0 and 1")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / tok.name
    docs = default_corpus(max_bytes)
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    key = {"corpus_sha256": h.hexdigest(), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
           "val_fraction": val_fraction, "documents": len(docs)}
    train, val = folder / "stdlib_train_000000.bin", folder / "stdlib_val_000000.bin"
    manifest = folder / "manifest.json"
    files = DatasetFiles(str(train), str(val), tok.vocab_size, tok.name)
    try:
        if json.loads(manifest.read_text()) == key:
            shard_num_tokens(train), shard_num_tokens(val)
            return files
    except (OSError, ValueError, RecursionError, LlmpyError):  # RecursionError: JSON nested too deep
        pass  # missing, stale or damaged: rebuild
    n_val = max(1, int(round(len(docs) * val_fraction)))
    write_shard(train, tok.encode_documents(docs[:-n_val]))
    write_shard(val, tok.encode_documents(docs[-n_val:]))
    _atomic_write(manifest, [json.dumps(key, indent=1).encode()])  # last: marks the shards complete
    return files


def shard_name(name: str, split: str, index: int) -> str:
    """llm.c's shard file name, e.g. `fineweb_train_000001.bin`."""
    return f"{name}_{split}_{index:06d}.bin"


_SHARD_NAME = re.compile(r"(.+)_(?:train|val)_\d{6}\.bin")


def commit_journal(folder: Path, name: str) -> Path:
    """The file `llmpy prepare` keeps in its folder while it moves NAME's new shards into place and removes the
    earlier ones: left there (the process killed mid-way), the folder's NAME shards may mix two prepares."""
    return Path(folder) / f".{name}.prepare-commit"


def _stopped_commit_note(folder: str) -> str:
    """For a glob that matched nothing: the commit journals in its folder (a killed prepare may have set its only
    shard aside), as a clause to add to the error line."""
    if glob.has_magic(folder):
        return ""
    try:
        journals = sorted(e.name for e in os.scandir(folder or ".") if e.name.endswith(".prepare-commit"))
    except OSError:
        return ""
    return (f" (a prepare was stopped here while it moved its shards into place: {', '.join(journals)} is left; run "
            "it again)") if journals else ""


def refuse_a_stopped_commit(files: list[Path]) -> None:
    """LlmpyError naming the first shard whose folder holds its prepare's commit journal (one check a prefix)."""
    checked = set()
    for f in files:
        for path in (f, Path(os.path.realpath(f))):  # the shard as named, and the one a link leads to
            m = _SHARD_NAME.fullmatch(path.name)
            if m is None or (path.parent, m.group(1)) in checked:
                continue
            checked.add((path.parent, m.group(1)))
            journal = commit_journal(path.parent, m.group(1))
            if os.path.lexists(journal):
                raise LlmpyError(f"{f}: a prepare of '{m.group(1)}' was stopped while it moved its shards into "
                                 f"place ({journal} is left), so they may mix two prepares; run that llmpy prepare "
                                 "again")


__all__ = [
    "SHARD_MAGIC", "SHARD_VERSION", "HEADER_INTS", "write_shard", "ShardFile", "read_shard", "read_tokens",
    "shard_num_tokens",
    "check_tokens", "resolve_shards", "commit_journal", "DataLoader", "EvalLoader", "default_corpus", "default_dataset",
    "default_cache_dir", "DatasetFiles", "shard_name",
]
