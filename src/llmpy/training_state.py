"""Training-state checkpoints: what `-y 1` needs to continue a run bit for bit.

A checkpoint of step N under the output directory is a pair:
  * `model_%08d.bin`: llm.c's model file in the run's precision (version 3 fp32, version 5 bf16, as
    llm.c writes them, so `-e` loads it into a run of the same precision);
  * `state_%08d.safetensors`: the tensors (the device's parameter storage, fp32 master weights when
    there are some, AdamW's m and v) and, in the safetensors metadata (str -> str), one JSON entry
    "llmpy" with the step, the options that define the run, the data loader's and outlier detectors'
    states, the GPU's stochastic-rounding seeds and CRC-32 checksums of the model file and tensors, and
    "metadata_checksum", the CRC-32 of that JSON itself (canonical: sorted keys, no spaces) without it.

The model file is written first and the state last, each atomically (files.atomic_path), so a
pair is complete exactly when the state exists and its metadata names the model file's step; a crash
between the two leaves an orphan model file that resume ignores.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import load_llmc, save_llmc, save_safetensors
from .config import GPT2Config
from .errors import LlmpyError
from .files import refuse_non_file

STATE_FORMAT = "llmpy-train-state"
# 2: the metadata carries its own checksum. Version 1 files, from before it, still resume (a run in progress
# survives an upgrade), unchecked: only a damaged version digit (2 -> 1) could pass for one
STATE_FORMAT_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)
META_KEY = "llmpy"
META_CRC_KEY = "metadata_checksum"

_MODEL_RE = re.compile(r"^model_(\d{8})\.bin$")
_STATE_RE = re.compile(r"^state_(\d{8})\.safetensors$")
_CRC_CHUNK = 1 << 24

# config fields a resumed run must share with its checkpoint, with how the user names them
CONFIG_FIELDS = ("num_layers", "channels", "num_heads", "max_seq_len", "vocab_size", "padded_vocab_size")


# the metadata's entries read as tables (JSON objects) and as integers
_META_TABLES = ("options", "checksums", "rng", "data", "outliers")
_META_INTS = ("step", "total_steps")
# the saved options (trainer._run_options) by kind: a resume compares them with its flags and reuses some, so a
# "4" where 4 belongs would read as "saved with -b 4 but this run has -b 4"
_OPTION_KINDS = {
    **dict.fromkeys(("batch_size", "seq_len", "total_batch_size", "warmup_steps", "max_steps", "seed",
                     "master_weights", "shuffle", "overfit_single_batch", "grad_accumulation", "world_size",
                     "zero_stage"), "int"),
    **dict.fromkeys(("learning_rate", "final_lr_frac", "weight_decay", "grad_clip", "skip_loss_z", "skip_grad_z"),
                    "number"),
    **dict.fromkeys(("lr_schedule", "dtype", "device"), "text"),
    **dict.fromkeys(("model", "train_data"), "path"),  # null: the default model or the embedded corpus
    "tokenizer": "path",  # "bytes" (the embedded corpus) or null
    "config": "table",
}
_KINDS = {"int": ((int,), "an integer"), "number": ((int, float), "a finite number"), "text": ((str,), "text"),
          "path": ((str, type(None)), "text or null"), "table": ((dict,), "a table")}


def model_path(out_dir, step: int) -> Path:
    return Path(out_dir) / f"model_{step:08d}.bin"


def state_path(out_dir, step: int) -> Path:
    return Path(out_dir) / f"state_{step:08d}.safetensors"


def done_path(out_dir, step: int) -> Path:
    """llm.c's empty DONE_%08d, written once the pair of `step` is whole (its scripts wait for it)."""
    return Path(out_dir) / f"DONE_{step:08d}"


def config_dict(config: GPT2Config) -> dict:
    return {k: int(getattr(config, k)) for k in CONFIG_FIELDS}


def _tensor_crc(t: torch.Tensor) -> int:
    # bytes as stored, of any dtype: numpy has none for bf16 or fp8 (an fp8 tensor in a state was a TypeError)
    t = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    crc = 0
    for s in range(0, t.numel(), _CRC_CHUNK):
        crc = zlib.crc32(memoryview(t[s:s + _CRC_CHUNK].numpy()).cast("B"), crc)
    return crc


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _meta_crc(meta: dict) -> int:
    """CRC-32 of the metadata but its checksum, serialised one way only, so a reader gets the writer's value."""
    body = {k: v for k, v in meta.items() if k != META_CRC_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class TrainingState:
    step: int
    meta: dict
    tensors: dict          # name -> CPU tensor
    config: GPT2Config
    params_fp32: torch.Tensor  # from the model file
    model_file: Path
    state_file: Path


def save_checkpoint(out_dir, step: int, config: GPT2Config, model_params: torch.Tensor, tensors: dict,
                    meta: dict, model_dtype: str = "float32") -> tuple[Path, Path]:
    """Write the model file (model_params, written in model_dtype) then the state file of `step`. On failure (a full
    disk, say) neither file of this step is left behind, no temp file either, and every earlier checkpoint is
    untouched."""
    mpath, spath = model_path(out_dir, step), state_path(out_dir, step)
    wrote_model = False
    try:
        save_llmc(mpath, config, model_params, dtype=model_dtype)
        wrote_model = True
        crcs = {name: _tensor_crc(t) for name, t in tensors.items()}
        crcs["model_file"] = _file_crc(mpath)
        full = {**meta, "format": STATE_FORMAT, "format_version": STATE_FORMAT_VERSION, "step": int(step),
                "model_file": mpath.name, "checksums": crcs}
        # of the metadata as a reader parses it (keys as text, tuples as lists), not of the objects given here
        full[META_CRC_KEY] = _meta_crc(json.loads(json.dumps(full)))
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        save_safetensors(spath, cpu, {META_KEY: json.dumps(full)})
    except OSError as e:
        # the step's new model file alone would be an orphan (or mismatch an older state of the same
        # step): remove both so the folder holds whole pairs only. A failed model write replaced nothing.
        for p in ((spath, mpath) if wrote_model else ()):
            try:
                p.unlink()
            except OSError:
                pass
        raise LlmpyError(f"cannot write the checkpoint of step {step} to {out_dir}: {e.strerror or e}; "
                         "earlier checkpoints are kept") from None
    return mpath, spath


def _check_kind(spath: Path, key: str, value, kind: str) -> None:
    types, what = _KINDS[kind]
    if isinstance(value, bool) or not isinstance(value, types) or (kind == "number" and not math.isfinite(value)):
        raise LlmpyError(f"{spath}: malformed training-state metadata ('{key}' should be {what}, not "
                         f"{json.dumps(value)[:40]})")


def _read_meta(spath: Path) -> dict:
    from safetensors import SafetensorError, safe_open
    # a directory would read as "No such device (os error 19)", and a pipe would block
    refuse_non_file(spath, "a training-state file")
    try:
        with safe_open(str(spath), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
    except (SafetensorError, OSError, ValueError) as e:
        raise LlmpyError(f"{spath}: corrupt or truncated training state ({e})") from None
    if raw is None:
        raise LlmpyError(f"{spath}: not an llmpy training state (no '{META_KEY}' metadata)")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # deep nesting ([[[...) is a RecursionError
        raise LlmpyError(f"{spath}: corrupt training-state metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise LlmpyError(f"{spath}: not an llmpy training state")
    version = meta.get("format_version")
    if type(version) is not int or version not in READABLE_STATE_VERSIONS:  # not true or 1.0, which equal 1
        raise LlmpyError(f"{spath}: training-state format version {meta.get('format_version')}; this llmpy "
                         f"reads versions {', '.join(map(str, READABLE_STATE_VERSIONS))} (resume it with the llmpy "
                         "that wrote it, or train on from its model file with -e and another -o)")
    # an edited or damaged file can hold valid JSON of the wrong shape: refuse it here, in one line
    for key, kind in [(k, "table") for k in _META_TABLES] + [(k, "int") for k in _META_INTS]:
        if key in meta:
            _check_kind(spath, key, meta[key], kind)
    options = meta.get("options", {})
    for key, kind in _OPTION_KINDS.items():
        if key in options:
            _check_kind(spath, f"options.{key}", options[key], kind)
    for key in CONFIG_FIELDS:
        if key in options.get("config", {}):
            _check_kind(spath, f"options.config.{key}", options["config"][key], "int")
    seeds = meta.get("rng", {}).get("sr_seeds")  # the stochastic-rounding seeds (int64 on the device), or null
    if seeds is not None and not (isinstance(seeds, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63 for x in seeds)):
        raise LlmpyError(f"{spath}: malformed training-state metadata ('rng.sr_seeds' should be a list of 64-bit "
                         f"integers, not {json.dumps(seeds)[:40]})")
    # a flipped digit keeps the JSON valid and well shaped (window_pos 4 -> 5) and would resume another run silently
    try:
        # version 1 had no checksum; one that holds a checksum is a version 2 whose digit was damaged
        intact = (version == 1 and META_CRC_KEY not in meta) or meta.get(META_CRC_KEY) == _meta_crc(meta)
    except RecursionError:  # nesting the parser just took can pass the serialiser's limit: not llmpy's metadata
        intact = False
    if not intact:
        raise LlmpyError(f"{spath}: its metadata fails its checksum (damaged)")
    return meta


def _steps(out_dir: Path, pattern) -> set[int]:
    return {int(m.group(1)) for p in out_dir.iterdir() if (m := pattern.match(p.name))}


def checkpoint_files(out_dir, after: int | None = None) -> list[str]:
    """The names of every model_*.bin and state_*.safetensors in out_dir, complete pairs or not; with `after`,
    only those of later steps."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    names = []
    for p in out_dir.iterdir():
        m = _MODEL_RE.match(p.name) or _STATE_RE.match(p.name)
        if m and (after is None or int(m.group(1)) > after):
            names.append(p.name)
    return sorted(names)


def checkpoint_steps(out_dir) -> list[int]:
    """Steps that have both a model file and a state file (not yet checked against each other)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(_steps(out_dir, _MODEL_RE) & _steps(out_dir, _STATE_RE))


def _with_the_way_back(e: LlmpyError, out_dir, step: int) -> LlmpyError:
    """`e` (a damaged checkpoint of `step`) and the earlier pair a resume takes once this one is moved away, if any:
    -y 1 never skips a damaged checkpoint by itself (it would train on from further back without a word)."""
    earlier = [s for s in checkpoint_steps(out_dir) if s < step]
    if not earlier:
        return e
    return LlmpyError(f"{e}; move {model_path(out_dir, step).name} and {state_path(out_dir, step).name} away to "
                      f"resume from the checkpoint of step {earlier[-1]}")


def run_tokenizer(model_file) -> str | None:
    """The tokenizer the run that wrote `model_file` (a checkpoint's model_NNNNNNNN.bin) saved in its state file
    beside it ("bytes" for the embedded corpus), or None: no such state, one unreadable or damaged, or the data's
    own tokenizer. Sampling reads it as a hint only, so a missing or bad state is no error here."""
    match = _MODEL_RE.match(Path(model_file).name)
    spath = state_path(Path(model_file).parent, int(match.group(1))) if match else None
    if spath is None or not spath.is_file():
        return None
    try:
        tokenizer = _read_meta(spath).get("options", {}).get("tokenizer")
    except LlmpyError:
        return None
    return tokenizer if isinstance(tokenizer, str) else None


def latest_complete_step(out_dir) -> int | None:
    """The latest step whose pair is complete: both files exist and the state names this model file.
    A state that cannot be read is an error naming it, not something to skip silently."""
    for step in reversed(checkpoint_steps(out_dir)):
        try:
            meta = _read_meta(state_path(out_dir, step))
        except LlmpyError as e:
            raise _with_the_way_back(e, out_dir, step) from None
        if meta.get("step") == step and meta.get("model_file") == model_path(out_dir, step).name:
            return step
    return None


def load_checkpoint(out_dir, step: int) -> TrainingState:
    """Read and verify the pair of `step`: sizes, checksums and shapes; LlmpyError names the bad file (and the
    earlier checkpoint to resume from instead)."""
    try:
        return _load_checkpoint(out_dir, step)
    except LlmpyError as e:
        raise _with_the_way_back(e, out_dir, step) from None


def _load_checkpoint(out_dir, step: int) -> TrainingState:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    mpath, spath = model_path(out_dir, step), state_path(out_dir, step)
    meta = _read_meta(spath)
    try:
        tensors = load_file(str(spath))
    except (SafetensorError, OSError, ValueError) as e:
        raise LlmpyError(f"{spath}: corrupt or truncated training state ({e})") from None
    crcs = meta.get("checksums", {})
    for name, t in tensors.items():
        if crcs.get(name) != _tensor_crc(t):
            raise LlmpyError(f"{spath}: tensor '{name}' fails its checksum: the file is corrupt")
    config, flat, _version = load_llmc(mpath)  # raises naming the file if truncated or not a model
    if crcs.get("model_file") != _file_crc(mpath):
        raise LlmpyError(f"{mpath}: fails the checksum recorded in {spath.name}: the model file is corrupt")
    saved = meta.get("options", {}).get("config", {})
    if saved and saved != config_dict(config):
        raise LlmpyError(f"{mpath}: its model ({config.describe()}) is not the one {spath.name} was saved with")
    for name in ("m", "v", "params", "master"):
        if name in tensors and tensors[name].numel() != config.num_parameters:
            raise LlmpyError(f"{spath}: tensor '{name}' has {tensors[name].numel()} elements, the model "
                             f"has {config.num_parameters}")
        # the checksums cover a tensor's bytes, not the header's dtype: F32 damaged to I32 would load as integers
        if name in tensors and tensors[name].dtype not in (torch.float32, torch.bfloat16):
            raise LlmpyError(f"{spath}: tensor '{name}' is {str(tensors[name].dtype).removeprefix('torch.')}, "
                             "not float32 or bfloat16: the file is damaged")
    for name, what in (("params", "parameters"), ("m", "AdamW"), ("v", "AdamW")):
        if name not in tensors:
            raise LlmpyError(f"{spath}: no {what} '{name}' tensor")
    return TrainingState(step=step, meta=meta, tensors=tensors, config=config, params_fp32=flat.float(),
                         model_file=mpath, state_file=spath)


def prune_checkpoints(out_dir, keep_last: int, keep_every: int, newest: int) -> list[int]:
    """-nk/-nm after the checkpoint of step `newest`: keep the last `keep_last` complete checkpoints up to it (0: all)
    and the steps that are multiples of `keep_every` for ever; delete the files of the other steps before those kept
    (DONE too). Only complete pairs count: a lone file (a run killed while writing) must not take a kept checkpoint's
    place, and files of steps after `newest` (an earlier run's, which -y 1 went back before) are left for the run to
    replace. Returns the steps removed."""
    if keep_last <= 0:
        return []
    out_dir = Path(out_dir)
    complete = [s for s in checkpoint_steps(out_dir) if s <= newest]
    if len(complete) <= keep_last:
        return []
    first_kept = complete[-keep_last]
    removed = []
    for s in sorted(_steps(out_dir, _MODEL_RE) | _steps(out_dir, _STATE_RE)):
        if s >= first_kept or (keep_every > 0 and s % keep_every == 0):
            continue
        # DONE, then the state: a model file without its state is already "incomplete" if we stop half-way
        for p in (done_path(out_dir, s), state_path(out_dir, s), model_path(out_dir, s)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        removed.append(s)
    return removed
