"""HellaSwag: llm.c's eval file (dev/data/hellaswag.py's format, read by dataloader.h's EvalLoader) and
the completion-style accuracy that `llmpy train -h 1` logs at each validation.

File layout (little-endian): a header of 256 int32 -- [0] magic 20240522, [1] version 1, [2] number of
examples, [3] the longest example's size in bytes -- then each example as a uint16 stream:
    65535 (start of example), the example's size in bytes (this whole record), its index, the label
    (the correct completion), the number of completions (4), the context length, the context tokens,
    then per completion: its length, its tokens.

Scoring (as llm.c): each example becomes 4 rows, context + completion i; the loss of each completion
token is averaged over the completion; the predicted completion has the lowest average loss. Rows are
packed B at a time (B // 4 examples per forward), so B must be a multiple of 4: the GPU model is
preallocated for exactly (B, T). Rows longer than T + 1 tokens lose context tokens from the left.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .errors import LlmpyError
from .files import expand_user

if TYPE_CHECKING:  # imported where scoring needs it: `llmpy prepare hellaswag` runs without torch (~1.7 s)
    import torch

EVAL_MAGIC = 20240522
EVAL_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
START_EXAMPLE = 65535
NUM_COMPLETIONS = 4  # llm.c's ASSUMED_NUM_COMPLETIONS
MAX_TOKEN_ID = 65534  # 65535 is the delimiter; GPT-2's ids are far below either

HELLASWAG_VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DEFAULT_EVAL_FILE = os.path.join("data", "hellaswag", "hellaswag_val.bin")


@dataclass
class Example:
    index: int
    label: int
    context: list[int]
    completions: list[list[int]]


# ----------------------------------------------------------------------------------------------
# the file

def _encode_example(ex: Example, path) -> np.ndarray:
    body = [ex.index, ex.label, len(ex.completions), len(ex.context), *ex.context]
    for c in ex.completions:
        body += [len(c), *c]
    stream = [START_EXAMPLE, 2 * (len(body) + 2), *body]
    if max(stream[1:]) > 65535 or min(stream) < 0:
        # the size, index or a token does not fit uint16: llm.c's format cannot hold this example
        raise LlmpyError(f"{path}: example {ex.index} does not fit the eval file's uint16 fields "
                         f"(size {stream[1]} bytes, index {ex.index}, token ids <= {MAX_TOKEN_ID})")
    return np.asarray(stream, dtype="<u2")


def write_eval_file(path: str | os.PathLike, examples: Sequence[Example]) -> Path:
    """Write llm.c's eval file atomically."""
    from .data import _atomic_write
    path = Path(path)
    for i, ex in enumerate(examples):
        if ex.index != i:
            raise LlmpyError(f"{path}: example {i} has index {ex.index}; indices must be 0, 1, 2, ...")
        if len(ex.completions) != NUM_COMPLETIONS or not 0 <= ex.label < NUM_COMPLETIONS:
            raise LlmpyError(f"{path}: example {i} needs {NUM_COMPLETIONS} completions and a label in 0..3")
        if not ex.context or not all(ex.completions):  # read_eval_file refuses these: never write them
            raise LlmpyError(f"{path}: example {i} has an empty context or completion")
        if any(t > MAX_TOKEN_ID for t in ex.context) or any(t > MAX_TOKEN_ID for c in ex.completions for t in c):
            raise LlmpyError(f"{path}: example {i} has a token id above {MAX_TOKEN_ID}")
    streams = [_encode_example(ex, path) for ex in examples]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = EVAL_MAGIC, EVAL_VERSION, len(examples)
    header[3] = max((s.nbytes for s in streams), default=0)  # llm.c sizes its read buffer with this
    _atomic_write(path, [header.tobytes(), *(s.tobytes() for s in streams)])
    return path


def read_eval_file(path: str | os.PathLike, vocab_size: int | None = None) -> list[Example]:
    """Read and check every field of an llm.c eval file; with vocab_size, every token must be below it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise LlmpyError(f"{path}: is a folder, not a HellaSwag eval file")
        if not stat.S_ISREG(mode):  # a pipe would block the read for ever
            raise LlmpyError(f"{path}: not a regular file, so not a HellaSwag eval file")
        with open(path, "rb") as f:
            # the header checked before the body is read: a wrong multi-GB file costs no memory
            raw = f.read(HEADER_BYTES)
            if len(raw) < HEADER_BYTES:
                raise LlmpyError(f"{path}: {len(raw)} bytes, shorter than the eval file's {HEADER_BYTES}-byte header")
            header = np.frombuffer(raw, dtype="<i4", count=HEADER_INTS)
            if header[0] != EVAL_MAGIC:
                raise LlmpyError(f"{path}: bad magic {int(header[0])} (an llm.c eval file has {EVAL_MAGIC})")
            if header[1] != EVAL_VERSION:
                raise LlmpyError(f"{path}: eval file version {int(header[1])}, expected {EVAL_VERSION}")
            body = f.read()
    except FileNotFoundError:
        raise LlmpyError(f"{path}: no such HellaSwag eval file (make it with `llmpy prepare hellaswag`)") from None
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read ({e.strerror or e})") from None
    count, longest = int(header[2]), int(header[3])
    if count <= 0:
        raise LlmpyError(f"{path}: the header says {count} examples")
    if len(body) % 2:
        raise LlmpyError(f"{path}: truncated (odd number of bytes after the header)")
    s = np.frombuffer(body, dtype="<u2").astype(np.int64)
    examples: list[Example] = []
    pos, seen_longest = 0, 0
    for i in range(count):
        def bad(msg):
            return LlmpyError(f"{path}: example {i}: {msg}")
        if pos >= len(s):
            raise bad(f"truncated: the header says {count} examples, the file ends after {i}")
        if s[pos] != START_EXAMPLE:
            raise bad(f"expected the start-of-example delimiter {START_EXAMPLE} at byte "
                      f"{HEADER_BYTES + 2 * pos}, found {int(s[pos])}")
        if pos + 6 > len(s):
            raise bad("truncated inside the example's fields")
        size, index, label, ncomp, nctx = (int(v) for v in s[pos + 1:pos + 6])
        if size % 2 or size < 14:
            raise bad(f"size {size} bytes is not a valid record size")
        end = pos + size // 2
        if end > len(s):
            raise bad(f"truncated: the record needs {size} bytes, {2 * (len(s) - pos)} are left")
        if index != i:
            raise bad(f"index field is {index}")
        if ncomp != NUM_COMPLETIONS:
            raise bad(f"{ncomp} completions; llm.c's HellaSwag has {NUM_COMPLETIONS}")
        if not 0 <= label < ncomp:
            raise bad(f"label {label} is not in 0..{ncomp - 1}")
        if nctx == 0:
            raise bad("empty context")
        q = pos + 6
        context = s[q:q + nctx]
        q += nctx
        completions = []
        for c in range(ncomp):
            if q >= end:
                raise bad(f"completion {c} runs past the record's {size} bytes")
            n = int(s[q])
            if n == 0:
                raise bad(f"completion {c} is empty")
            completions.append(s[q + 1:q + 1 + n])
            q += 1 + n
        if q != end:
            raise bad(f"the fields take {2 * (q - pos)} bytes but the record's size field says {size}")
        toks = np.concatenate([context, *completions])
        if (toks == START_EXAMPLE).any():
            raise bad(f"token id {START_EXAMPLE} (the delimiter) inside the example")
        if vocab_size is not None and int(toks.max()) >= vocab_size:
            raise bad(f"token id {int(toks.max())} is outside the model's vocabulary of {vocab_size}")
        examples.append(Example(index, label, context.tolist(), [c.tolist() for c in completions]))
        seen_longest = max(seen_longest, size)
        pos = end
    if pos != len(s):
        raise LlmpyError(f"{path}: {2 * (len(s) - pos)} bytes after the last of the header's {count} examples")
    if longest != seen_longest:
        raise LlmpyError(f"{path}: the header's longest example is {longest} bytes, the longest record is "
                         f"{seen_longest}")
    return examples


# ----------------------------------------------------------------------------------------------
# scoring

@dataclass
class EvalResult:
    correct: int
    total: int
    predictions: list[int]

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def _row(context: list[int], completion: list[int], T: int) -> tuple[list[int], int]:
    """The row's tokens (at most T + 1: inputs are row[:-1], targets row[1:]) and the first target
    position that predicts a completion token."""
    row = context + completion
    if len(row) > T + 1:
        row = row[-(T + 1):]  # context goes first; the completion's own tokens are kept if they fit
    return row, max(0, len(row) - len(completion) - 1)


def score(examples: Sequence[Example], position_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          B: int, T: int) -> EvalResult:
    """Accuracy of the completion with the lowest mean loss. position_losses(inputs, targets) takes a
    (B, T) batch of token ids and returns the (B, T) per-position losses."""
    import torch

    if B % NUM_COMPLETIONS or B <= 0:
        raise LlmpyError(f"-b {B}: HellaSwag packs the {NUM_COMPLETIONS} completions of an example into one "
                         f"batch, so B must be a multiple of {NUM_COMPLETIONS}")
    per_batch = B // NUM_COMPLETIONS
    correct, predictions = 0, []
    for b0 in range(0, len(examples), per_batch):
        chunk = examples[b0:b0 + per_batch]
        x = torch.zeros(B, T, dtype=torch.int64)  # padding: token 0, masked out below
        y = torch.zeros(B, T, dtype=torch.int64)
        spans = []
        for e, ex in enumerate(chunk):
            for c, comp in enumerate(ex.completions):
                r = e * NUM_COMPLETIONS + c
                row, lo = _row(ex.context, comp, T)
                n = len(row) - 1
                x[r, :n] = torch.tensor(row[:-1])
                y[r, :n] = torch.tensor(row[1:])
                spans.append((r, lo, n))
        losses = position_losses(x, y).detach().float().cpu()
        means = [float(losses[r, lo:n].double().mean()) for r, lo, n in spans]
        for e, ex in enumerate(chunk):
            m = means[e * NUM_COMPLETIONS:(e + 1) * NUM_COMPLETIONS]
            pred = min(range(NUM_COMPLETIONS), key=lambda k: m[k])  # the first on ties, as llm.c's argmin
            predictions.append(pred)
            correct += pred == ex.label
    return EvalResult(correct, len(examples), predictions)


# ----------------------------------------------------------------------------------------------
# preparing the file from the HellaSwag jsonl

def _record_fields(d) -> tuple[str, int, list[str]]:
    """A jsonl record's ctx, label and endings, their JSON types checked strictly: int() and len() would take a
    label of 1.7 or true as 1, and an object's keys as the endings."""
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an object")
    for key in ("ctx", "label", "endings"):
        if key not in d:
            raise ValueError(f"no {key!r} field")
    ctx, label, endings = d["ctx"], d["label"], d["endings"]
    if not isinstance(ctx, str):
        raise ValueError("ctx must be a text")
    if not ctx:  # no context tokens: read_eval_file (`train -h 1`) would refuse the example
        raise ValueError("empty context")
    if isinstance(label, str) and label.isascii() and label.isdigit():  # HuggingFace's copies write "2"
        label = int(label)
    if type(label) is not int:  # bool is an int subclass; floats (Infinity, NaN, 1.7) and other texts are not labels
        raise ValueError(f"label {json.dumps(label)[:40]}, not an integer 0..{NUM_COMPLETIONS - 1}")
    if not 0 <= label < NUM_COMPLETIONS:
        raise ValueError(f"label {label}, not one of 0..{NUM_COMPLETIONS - 1}")
    if not (isinstance(endings, list) and len(endings) == NUM_COMPLETIONS and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"endings must be a list of {NUM_COMPLETIONS} texts")
    for text in (ctx, *endings):  # JSON's "\ud800" escape gives a lone surrogate, which no tokenizer encodes
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"a lone surrogate {text[e.start]!r}, not Unicode text") from None
    return ctx, label, endings


def examples_from_jsonl(path: Path, tokenizer) -> list[Example]:
    """llm.c's render_example: context = encode(ctx), completion i = encode(" " + endings[i])."""
    examples = []
    try:
        # lines end at "\n" only: splitlines() would also cut at U+2028, U+2029 or U+0085 inside a JSON string
        # (a "\n" byte is never inside a UTF-8 sequence: each line is decoded alone, so a bad byte names its line)
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read the HellaSwag jsonl ({e})") from None
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LlmpyError(f"{path}: line {lineno} is not a HellaSwag example (not UTF-8 text: byte "
                             f"0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            ctx, label, endings = _record_fields(json.loads(line))
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep for the parser
            raise LlmpyError(f"{path}: line {lineno} is not a HellaSwag example ({e})") from None
        examples.append(Example(len(examples), label, tokenizer.encode(ctx),
                                [tokenizer.encode(" " + s) for s in endings]))
    if not examples:
        raise LlmpyError(f"{path}: no examples")
    return examples


def prepare_hellaswag(outdir, cache: Path, tokenizer: str = "gpt2", tokenizer_dir=None, log=print) -> Path:
    """Download hellaswag_val.jsonl (kept in the cache), tokenize it, write OUTDIR/hellaswag_val.bin."""
    from .files import writable_dir
    from .prepare import _missing_folders, _remove_empty, download
    from .tokenizer import load_tokenizer
    out = expand_user(outdir) if outdir is not None else Path("data") / "hellaswag"
    created = _missing_folders(out)
    try:
        # first, as prepare's shards: an -o that is a file is named as such (the write said "OUT/hellaswag_val.bin:
        # cannot write (File exists)"), and before the download and tokenizing
        writable_dir(out, "output folder")
        jsonl = download(HELLASWAG_VAL_URL, Path(cache) / "hellaswag" / "hellaswag_val.jsonl")
        tok = load_tokenizer(tokenizer, tokenizer_dir, download=True)  # `llmpy prepare hellaswag` fetches anyway
        examples = examples_from_jsonl(jsonl, tok)
        dest = write_eval_file(out / "hellaswag_val.bin", examples)
    except BaseException:  # no empty output folder of ours left behind
        _remove_empty(created)
        raise
    log(f"hellaswag val: {len(examples):,} examples ({tok.name} tokens) in {dest}")
    return dest


__all__ = ["Example", "EvalResult", "read_eval_file", "write_eval_file", "score", "prepare_hellaswag",
           "examples_from_jsonl", "DEFAULT_EVAL_FILE", "HELLASWAG_VAL_URL"]
