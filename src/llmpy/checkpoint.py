"""Model files: llm.c's `.bin` checkpoints, HuggingFace GPT-2 `model.safetensors`, llm.c's debug state.

Parameters travel as one flat tensor in llm.c's layout (`config.parameter_shapes()` order, wte with
its padded rows), so a file round-trips into the same buffer the trainer holds.

Formats (all little-endian):
  * llm.c model file: 256 int32 header [magic 20240326, version, maxT, V, L, NH, C, Vp, 0...], then
    the 16 tensors back to back, fp32 (version 3) or bf16 (version 5).
  * llm.c debug state: 256 int32 header [magic 20240327, version 2, B, T, 0...], then inputs (B*T
    int32), targets (B*T int32), logits (B*T*V fp32, unpadded V), loss (1 fp32), grads (flat fp32).
  * HuggingFace: GPT2LMHeadModel's tensors in a safetensors file plus config.json.

Every write goes through `atomic_write`/`atomic_path` (files.py): a temp file in the target's directory,
fsync, then os.replace, so a crash never leaves a half-written file under the real name. No
pickle is used anywhere.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .config import GPT2Config, parameter_views
from .errors import LlmpyError
from .files import atomic_path, atomic_write, expand_user, refuse_non_file

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

MODEL_MAGIC = 20240326
DEBUG_STATE_MAGIC = 20240327
TOKENIZER_MAGIC = 20240328
TOKEN_SHARD_MAGIC = 20240520
TRAIN_STATE_MAGIC = 20240527

VERSION_FP32 = 3
VERSION_BF16 = 5
DEBUG_STATE_VERSION = 2

_VERSION_DTYPE = {VERSION_FP32: "float32", VERSION_BF16: "bfloat16"}
_DTYPE_VERSION = {v: k for k, v in _VERSION_DTYPE.items()}
_TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}

# Magics of llm.c's other binary files, so a mix-up gets a message saying what the file is.
_OTHER_MAGICS = {
    DEBUG_STATE_MAGIC: "an llm.c debug state (gpt2_124M_debug_state.bin)",
    TOKENIZER_MAGIC: "an llm.c tokenizer file",
    TOKEN_SHARD_MAGIC: "a token shard",
    TRAIN_STATE_MAGIC: "an llm.c training-state file (state_*.bin)",
}

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
HF_CONFIG_NAME = "config.json"
HF_PREFIX = "transformer."
# save_hf's copy of config.json inside the weights' metadata, so the file alone still names its heads
HF_CONFIG_METADATA_KEY = "llmpy_config"
# Activations HF implements as the tanh GELU that llm.c uses.
_TANH_GELUS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}
# safetensors dtypes a GPT-2's weights may have (widened to fp32 on load): integers or bools are not weights
_HF_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2")

# Elements converted and written per step: bounds the temporary copy for multi-GB models.
_WRITE_CHUNK = 1 << 24

if sys.byteorder != "little":  # the formats are little-endian and the code writes raw buffers
    raise ImportError("llmpy.checkpoint supports little-endian hosts only")


def normalize_dtype(dtype) -> str:
    """'float32'/'fp32'/torch.float32 -> 'float32'; 'bfloat16'/'bf16'/torch.bfloat16 -> 'bfloat16'."""
    if isinstance(dtype, torch.dtype):
        for name, td in _TORCH_DTYPE.items():
            if td == dtype:
                return name
    elif isinstance(dtype, str):
        low = dtype.lower()
        if low in ("float32", "fp32", "f32", "float"):
            return "float32"
        if low in ("bfloat16", "bf16"):
            return "bfloat16"
    raise LlmpyError(f"unsupported parameter dtype {dtype!r}: expected float32 (fp32) or bfloat16 (bf16)")


# ---------------------------------------------------------------------------------------------
# safetensors, atomically (files.py has the atomic writes themselves)

def save_safetensors(path, tensors: dict, metadata: dict) -> None:
    """safetensors' save_file, atomically, its errors (a full disk) raised as OSError like every other write's."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    with atomic_path(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as e:
            # its message ends "(os error N)" where the system refused the write
            code = re.search(r"os error (\d+)", str(e))
            reason = os.strerror(int(code.group(1))) if code else str(e)
            raise OSError(int(code.group(1)) if code else None, reason, str(path)) from None


def _write_tensor(f, tensor: torch.Tensor, dtype: str = "float32") -> None:
    """Write a tensor's elements raw (little-endian) as `dtype`, in chunks to bound memory."""
    td = getattr(torch, dtype)
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _WRITE_CHUNK):
        # torch's cast to bf16 rounds to nearest even, as llm.c's export does
        chunk = flat[start:start + _WRITE_CHUNK].to(device="cpu", dtype=td).contiguous()
        if td == torch.bfloat16:
            chunk = chunk.view(torch.int16)  # numpy has no bf16; the bits are what we store
        f.write(memoryview(chunk.numpy()).cast("B"))


def _header(magic: int, version: int, *fields: int) -> bytes:
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = magic, version
    for i, v in enumerate(fields):
        h[2 + i] = v
    return h.tobytes()


# ---------------------------------------------------------------------------------------------
# reading headers


def _check_finite(path, config: GPT2Config, flat: torch.Tensor) -> None:
    """NaN or inf weights would only show as a NaN loss at step 1, far from the file: name it and the tensor."""
    for name, view in parameter_views(flat, config).items():
        if torch.isfinite(view).all():
            continue
        where = ""
        if name not in ("wte", "wpe", "lnfw", "lnfb"):  # per layer: say which
            layer = next(i for i in range(config.num_layers) if not torch.isfinite(view[i]).all())
            where = f" (layer {layer})"
        raise LlmpyError(f"{path}: tensor {name}{where} holds NaN or inf values; a model's weights must be finite")


def _read_header(path) -> np.ndarray:
    path = Path(path)
    refuse_non_file(path, "an llm.c model file")
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise LlmpyError(f"{path}: no such file") from None
    except OSError as e:
        raise LlmpyError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) < HEADER_BYTES:
        raise LlmpyError(f"{path} is too short ({len(raw)} bytes) for an llm.c header of {HEADER_BYTES} bytes")
    return np.frombuffer(raw, dtype="<i4")


def _check_magic(path, header, magic: int, what: str) -> None:
    got = int(header[0])
    if got == magic:
        return
    if got in _OTHER_MAGICS:
        raise LlmpyError(f"{path} is {_OTHER_MAGICS[got]}, not {what} (magic {got}, expected {magic})")
    raise LlmpyError(f"{path} is not {what} (magic {got}, expected {magic})")


def _check_size(path, expected: int, what: str) -> None:
    actual = os.path.getsize(path)
    if actual != expected:
        kind = "truncated" if actual < expected else "too long"
        raise LlmpyError(f"{path} is {kind}: {what} needs {expected} bytes, the file has {actual}")


class LlmcHeader(NamedTuple):
    config: GPT2Config
    version: int

    @property
    def dtype(self) -> str:
        return _VERSION_DTYPE[self.version]

    @property
    def itemsize(self) -> int:
        return 4 if self.version == VERSION_FP32 else 2

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.config.num_parameters * self.itemsize


def read_llmc_header(path) -> LlmcHeader:
    """Read and validate an llm.c model file's header: (config, version). Does not check the length."""
    h = _read_header(path)
    _check_magic(path, h, MODEL_MAGIC, "an llm.c model file")
    version = int(h[1])
    if version not in _VERSION_DTYPE:
        raise LlmpyError(f"{path}: unsupported llm.c model file version {version} "
                         "(expected 3 for fp32 or 5 for bf16)")
    maxT, V, L, NH, C, Vp = (int(x) for x in h[2:8])
    fields = {"max_seq_len": maxT, "vocab_size": V, "num_layers": L, "num_heads": NH, "channels": C}
    bad = [f"{k}={v}" for k, v in fields.items() if v <= 0]
    if bad or Vp < 0:
        bad += [f"padded_vocab_size={Vp}"] if Vp < 0 else []
        raise LlmpyError(f"{path}: corrupt llm.c header, non-positive {', '.join(bad)}")
    # Old version-3 files (from before padding) leave [7] zero: their vocab is not padded.
    try:
        config = GPT2Config(**fields, padded_vocab_size=Vp or V)
    except LlmpyError as e:
        raise LlmpyError(f"{path}: bad llm.c header: {e}") from None
    return LlmcHeader(config, version)


# ---------------------------------------------------------------------------------------------
# llm.c model files


def _check_flat(path, config: GPT2Config, flat) -> None:
    if not isinstance(flat, torch.Tensor):
        raise LlmpyError(f"cannot write {path}: parameters must be a torch tensor, got {type(flat).__name__}")
    if flat.numel() != config.num_parameters:
        raise LlmpyError(f"cannot write {path}: {flat.numel()} parameters given, "
                         f"the model ({config.describe()}) has {config.num_parameters}")


def save_llmc(path, config: GPT2Config, flat_params: torch.Tensor, dtype="float32") -> None:
    """Write an llm.c model file: version 3 for dtype float32, version 5 for bfloat16 (rounded RNE)."""
    dtype = normalize_dtype(dtype)
    _check_flat(path, config, flat_params)
    c = config
    header = _header(MODEL_MAGIC, _DTYPE_VERSION[dtype], c.max_seq_len, c.vocab_size, c.num_layers,
                     c.num_heads, c.channels, c.padded_vocab_size)

    def write(f):
        f.write(header)
        _write_tensor(f, flat_params, dtype)

    atomic_write(path, write)


def load_llmc(path) -> tuple[GPT2Config, torch.Tensor, int]:
    """Read an llm.c model file: (config, flat CPU tensor in the file's dtype, version)."""
    hdr = read_llmc_header(path)
    _check_size(path, hdr.file_bytes,
                f"a version-{hdr.version} model with {hdr.config.num_parameters} parameters")
    n = hdr.config.num_parameters
    if hdr.version == VERSION_FP32:
        flat = torch.from_numpy(np.fromfile(path, dtype="<f4", count=n, offset=HEADER_BYTES))
    else:
        flat = torch.from_numpy(np.fromfile(path, dtype="<i2", count=n, offset=HEADER_BYTES))
        flat = flat.view(torch.bfloat16)
    _check_finite(path, hdr.config, flat)
    return hdr.config, flat, hdr.version


def check_precision(path_or_version, run_dtype, name: str | None = None) -> None:
    """Raise LlmpyError if a model file's precision differs from the run's, as llm.c refuses to.

    `path_or_version` is a model file (its header is read) or a version number (3 or 5); `name`
    labels the checkpoint in the message when only a version is given.
    """
    run = normalize_dtype(run_dtype)
    if isinstance(path_or_version, (int, np.integer)):
        version, label = int(path_or_version), name or "the checkpoint"
        if version not in _VERSION_DTYPE:
            raise LlmpyError(f"{label}: unknown llm.c model version {version} (expected 3 or 5)")
    else:
        version, label = read_llmc_header(path_or_version).version, name or str(path_or_version)
    have = _VERSION_DTYPE[version]
    if have == run:
        return
    other = _DTYPE_VERSION[run]
    raise LlmpyError(f"{label} is a {_SHORT[have]} (version {version}) checkpoint but the run is "
                     f"{_SHORT[run]}: run in {_SHORT[have]} or load a {_SHORT[run]} (version {other}) file"
                     + (" (llm.c names those *_bf16.bin)" if run == "bfloat16" else ""))


# ---------------------------------------------------------------------------------------------
# HuggingFace safetensors

# llm.c tensor -> (HF name per layer, whether HF stores it transposed). HF's GPT-2 uses Conv1D,
# whose weight is (in, out): the transpose of llm.c's (out, in).
_HF_LAYER = {
    "ln1w": ("ln_1.weight", False), "ln1b": ("ln_1.bias", False),
    "qkvw": ("attn.c_attn.weight", True), "qkvb": ("attn.c_attn.bias", False),
    "attprojw": ("attn.c_proj.weight", True), "attprojb": ("attn.c_proj.bias", False),
    "ln2w": ("ln_2.weight", False), "ln2b": ("ln_2.bias", False),
    "fcw": ("mlp.c_fc.weight", True), "fcb": ("mlp.c_fc.bias", False),
    "fcprojw": ("mlp.c_proj.weight", True), "fcprojb": ("mlp.c_proj.bias", False),
}
_HF_GLOBAL = {"wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}
# Causal-mask buffers older transformers saved; they carry no parameters.
_HF_BUFFERS = ("attn.bias", "attn.masked_bias")


def hf_tensors(config: GPT2Config, flat_params: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (unprefixed names, fp32, contiguous copies) from an llm.c flat buffer."""
    p = parameter_views(flat_params.detach(), config)
    out = {"wte.weight": p["wte"][:config.vocab_size]}  # HF keeps the real vocab only
    for ours, name in _HF_GLOBAL.items():
        out[name] = p[ours]
    for i in range(config.num_layers):
        for ours, (name, transposed) in _HF_LAYER.items():
            t = p[ours][i]
            out[f"h.{i}.{name}"] = t.t() if transposed else t
    return {k: v.to(device="cpu", dtype=torch.float32).contiguous().clone() for k, v in out.items()}


def hf_config_dict(config: GPT2Config) -> dict:
    """config.json for transformers' GPT2LMHeadModel describing `config`."""
    eos = min(50256, config.vocab_size - 1)  # GPT-2's <|endoftext|>, clipped for tiny vocabularies
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",  # the tanh GELU llm.c uses
        "n_embd": config.channels,
        "n_head": config.num_heads,
        "n_layer": config.num_layers,
        "n_positions": config.max_seq_len,
        "n_ctx": config.max_seq_len,
        "n_inner": None,
        "vocab_size": config.vocab_size,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        # llm.c trains without dropout; keep it off so HF fine-tuning starts from the same model
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "use_cache": True,
        "torch_dtype": "float32",
        # not an HF key (HF ignores it): lets load_hf restore a non-default padding
        "llmc_padded_vocab_size": config.padded_vocab_size,
    }


def _hf_target(dir_or_file) -> tuple[Path, Path]:
    p = Path(dir_or_file)
    if p.suffix == ".safetensors":
        return p, p.parent / HF_CONFIG_NAME
    return p / HF_WEIGHTS_NAME, p / HF_CONFIG_NAME


def save_hf(dir_or_file, config: GPT2Config, flat_params: torch.Tensor) -> Path:
    """Write HF GPT-2 weights (fp32) and config.json; returns the safetensors path.

    `dir_or_file` is a directory (created if missing; gets model.safetensors + config.json) or a
    `*.safetensors` path (config.json goes beside it). Names carry the `transformer.` prefix and
    lm_head is left out (tied to wte), as GPT2LMHeadModel.save_pretrained writes them.
    """
    weights, cfg_path = _hf_target(dir_or_file)
    _check_flat(weights, config, flat_params)
    for target in (weights, cfg_path):  # checked before either is replaced: never one new file beside an old one
        refuse_non_file(target, "a file the export may replace")
    weights.parent.mkdir(parents=True, exist_ok=True)
    tensors = {HF_PREFIX + k: v for k, v in hf_tensors(config, flat_params).items()}
    config_dict = hf_config_dict(config)
    text = json.dumps(config_dict, indent=2) + "\n"
    # both files are written under temp names first, then renamed one after the other, so an interrupted
    # save leaves the old pair (or, in the moment between the renames, new weights with the old config)
    with atomic_path(cfg_path) as cfg_tmp:
        with open(cfg_tmp, "wb") as f:  # on the disk before the weights replace theirs: a full disk fails it here
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        # transformers requires format=pt (and ignores the other key)
        save_safetensors(weights, tensors, metadata={"format": "pt", HF_CONFIG_METADATA_KEY: json.dumps(config_dict)})
    return weights


def _hf_files(path: Path) -> tuple[list[Path], Path]:
    """The safetensors file(s) to read and where config.json would be."""
    if path.is_dir():
        single, index = path / HF_WEIGHTS_NAME, path / HF_INDEX_NAME
        refuse_non_file(single, "a safetensors file")
        if single.is_file():
            return [single], path / HF_CONFIG_NAME
        refuse_non_file(index, "a safetensors index")
        if index.is_file():  # sharded: model-0000x-of-0000n.safetensors listed in the index
            try:
                text = index.read_bytes()  # decoded by json.loads, whose errors are ValueErrors below
            except OSError as e:  # unreadable (permissions, I/O): not "not a safetensors index"
                raise LlmpyError(f"{index}: cannot read: {e.strerror or e}") from None
            try:
                weight_map = json.loads(text)["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # deep nesting: RecursionError
                raise LlmpyError(f"{index}: not a safetensors index ({getattr(e, 'strerror', None) or e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
                raise LlmpyError(f"{index}: not a safetensors index (its weight_map must map tensor names to file "
                                 "names)")
            return [path / s for s in sorted(set(weight_map.values()))], path / HF_CONFIG_NAME
        raise LlmpyError(f"{path} is a directory without {HF_WEIGHTS_NAME}")
    refuse_non_file(path, "a safetensors file")
    if not path.is_file():
        raise LlmpyError(f"{path}: no such file")
    return [path], path.parent / HF_CONFIG_NAME


def _read_hf_config(path: Path) -> dict | None:
    if not os.path.lexists(path):
        return None
    refuse_non_file(path, "a JSON config")  # there but unreadable: not the same as absent
    try:
        text = path.read_bytes()  # decoded by json.loads, whose errors are ValueErrors below
    except OSError as e:  # unreadable (permissions, I/O): not "not valid JSON"
        raise LlmpyError(f"{path}: cannot read: {e.strerror or e}") from None
    return _json_object(text, path)


def _json_object(text, where) -> dict:
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:  # deep nesting ([[[...) is a RecursionError
        raise LlmpyError(f"{where}: not valid JSON ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(cfg, dict):
        raise LlmpyError(f"{where}: expected a JSON object")
    return cfg


def load_hf(path) -> tuple[GPT2Config, torch.Tensor]:
    """Read HF GPT-2 weights into (config, flat fp32 tensor in llm.c's layout, wte padded with zeros).

    `path` is a `*.safetensors` file or a directory holding model.safetensors (or a sharded
    model.safetensors.index.json). Names may carry the `transformer.` prefix. The causal-mask
    buffers `attn.bias`/`attn.masked_bias` are ignored. `lm_head.weight` is ignored when it equals
    wte (tied, as GPT-2 is), and is wte where that is absent (the tied pair saved once, under the head's
    name); an untied head is an error, since llm.c's model has no separate head and dropping it would
    silently change the model.

    The config comes from config.json beside the weights (n_layer, n_head, n_embd, n_positions,
    vocab_size), else from the copy save_hf puts in the weights' metadata. Without either it is inferred from
    the shapes, and since the number of heads is not visible in any shape, a head size of 64 is assumed (GPT-2's,
    for all its sizes), with a note.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    files, cfg_path = _hf_files(path)
    label = files[0] if len(files) == 1 else path

    # name (unprefixed) -> (file, name in file, shape)
    index: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    dtypes: dict[str, str] = {}
    embedded = None  # the config save_hf keeps in the (first) file's metadata
    for file in files:
        refuse_non_file(file, "a safetensors file")
        if not file.is_file():
            raise LlmpyError(f"{file}: no such file (listed in {path / HF_INDEX_NAME})")
        try:
            with safe_open(str(file), framework="pt") as sf:
                if file == files[0]:
                    embedded = (sf.metadata() or {}).get(HF_CONFIG_METADATA_KEY)
                for key in sf.keys():
                    tensor = sf.get_slice(key)
                    index[key.removeprefix(HF_PREFIX)] = (file, key, tuple(tensor.get_shape()))
                    dtypes[key.removeprefix(HF_PREFIX)] = tensor.get_dtype()
        except (SafetensorError, OSError, ValueError) as e:
            raise LlmpyError(f"{file}: not a readable safetensors file ({e})") from None

    if "wte.weight" not in index and "lm_head.weight" in index:
        # tied tensors saved once under one of their names (safetensors' save_model keeps lm_head's): one tensor
        index["wte.weight"], dtypes["wte.weight"] = index["lm_head.weight"], dtypes["lm_head.weight"]
    if {"params", "m", "v"} <= index.keys():  # llmpy train's state_%08d.safetensors, beside its model_%08d.bin
        beside = re.fullmatch(r"state_(\d{8})\.safetensors", label.name) if len(files) == 1 else None
        model = f" ({label.with_name(f'model_{beside.group(1)}.bin')})" if beside else ""
        raise LlmpyError(f"{label}: a training state (the optimizer's moments, the data position), not a model; give "
                         f"the model file written with it{model}")
    unexpected = [k for k in index if not (_is_hf_param(k) or _is_hf_ignored(k))]
    if unexpected:
        raise LlmpyError(f"{label}: unexpected tensor {unexpected[0]!r}"
                         f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}: "
                         "not a GPT-2 model (GPT2Model/GPT2LMHeadModel)")
    for need in ("wte.weight", "wpe.weight"):
        if need not in index:
            raise LlmpyError(f"{label}: missing tensor {need!r}")
    # an integer or bool tensor would be cast to float without a word: not a model's weights
    for name, (file, key, _) in index.items():
        if (_is_hf_param(name) or name == "lm_head.weight") and dtypes[name] not in _HF_FLOAT_DTYPES:
            raise LlmpyError(f"{file}: tensor {key!r} is {dtypes[name]}, not floating point: not a GPT-2's weights "
                             f"(expected {', '.join(_HF_FLOAT_DTYPES)})")

    config = _hf_config(label, cfg_path, index, embedded)
    # the layers' tensors against the layer count, before anything is built per layer: a config.json (or a tensor
    # name) saying a million layers would otherwise cost minutes and gigabytes before "missing tensor h.12..."
    layers = {int(k.split(".")[1]) for k in index if _is_hf_param(k) and k.startswith("h.")}
    if len(layers) != config.num_layers or (layers and (min(layers), max(layers)) != (0, config.num_layers - 1)):
        found = f"layers {min(layers)}..{max(layers)}" if layers else "no layers"
        said = (f"{cfg_path} says {config.num_layers}" if cfg_path.is_file() else
                f"its embedded config says {config.num_layers}" if embedded is not None else
                "numbered from 0 without gaps")
        raise LlmpyError(f"{label}: its tensors hold {len(layers)} layer(s), {found}; {said}")
    shapes = _expected_hf_shapes(config)
    for name, shape in shapes.items():
        if name not in index:
            raise LlmpyError(f"{label}: missing tensor {name!r}")
        if index[name][2] != shape:
            raise LlmpyError(f"{label}: tensor {name!r} has shape {list(index[name][2])}, expected {list(shape)}")
    extra_layers = sorted({k for k in index if _is_hf_param(k) and k not in shapes})
    if extra_layers:
        raise LlmpyError(f"{label}: tensor {extra_layers[0]!r} is beyond the {config.num_layers} layers "
                         f"in {cfg_path}")

    try:
        flat = torch.zeros(config.num_parameters, dtype=torch.float32)  # padded wte rows stay zero
    except (RuntimeError, MemoryError):
        raise LlmpyError(f"{label}: {config.num_parameters:,} parameters ({4 * config.num_parameters / 1e9:.1f} GB in "
                         "fp32) do not fit in this machine's memory") from None
    p = parameter_views(flat, config)
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in files}

        def get(name):
            file, key, _ = index[name]
            t = opened[file].get_tensor(key).to(torch.float32)  # fp32 first: torch has no isfinite for some fp8
            if not torch.isfinite(t).all():  # else the first step's loss is NaN, far from the file
                raise LlmpyError(f"{file}: tensor {key!r} holds NaN or inf values; a model's weights must be finite")
            return t

        p["wte"][:config.vocab_size] = get("wte.weight")
        for ours, name in _HF_GLOBAL.items():
            p[ours].copy_(get(name))
        for i in range(config.num_layers):
            for ours, (name, transposed) in _HF_LAYER.items():
                t = get(f"h.{i}.{name}")
                p[ours][i].copy_(t.t() if transposed else t)
        if "lm_head.weight" in index:
            head = get("lm_head.weight")
            wte = p["wte"][:config.vocab_size]
            if head.shape != wte.shape or not torch.equal(head.to(torch.float32), wte):
                raise LlmpyError(f"{label}: lm_head.weight differs from wte.weight; llm.c ties them, "
                                 "so an untied output head cannot be loaded")
    return config, flat


def _is_hf_ignored(name: str) -> bool:
    if name == "lm_head.weight":
        return True
    head, _, rest = name.partition(".")
    idx, _, leaf = rest.partition(".")
    return head == "h" and idx.isascii() and idx.isdigit() and leaf in _HF_BUFFERS


def _is_hf_param(name: str) -> bool:
    if name == "wte.weight" or name in _HF_GLOBAL.values():
        return True
    head, dot, rest = name.partition(".")
    if head != "h" or not dot:
        return False
    idx, dot, leaf = rest.partition(".")
    return idx.isascii() and idx.isdigit() and leaf in {n for n, _ in _HF_LAYER.values()}  # "²" is a digit to isdigit


def _expected_hf_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    shapes = config.parameter_shapes()
    out = {"wte.weight": (config.vocab_size, config.channels)}
    for ours, name in _HF_GLOBAL.items():
        out[name] = shapes[ours]
    for i in range(config.num_layers):
        for ours, (name, transposed) in _HF_LAYER.items():
            s = shapes[ours][1:]
            out[f"h.{i}.{name}"] = tuple(reversed(s)) if transposed else s
    return out


def _config_int(cfg_path: Path, cfg: dict, key: str) -> int:
    """A positive JSON integer of config.json: 32.5 or "32" is a broken file, not something to truncate or parse."""
    if key not in cfg:
        raise LlmpyError(f"{cfg_path}: missing {key!r}, not a GPT-2 config")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LlmpyError(f"{cfg_path}: {key} must be a positive integer, not {json.dumps(value)[:40]}")
    return value


def _hf_config(label, cfg_path: Path, index, embedded: str | None = None) -> GPT2Config:
    V, C = index["wte.weight"][2] if len(index["wte.weight"][2]) == 2 else (0, 0)
    maxT = index["wpe.weight"][2][0] if index["wpe.weight"][2] else 0
    cfg = _read_hf_config(cfg_path)
    if cfg is None and embedded is not None:  # config.json left behind: save_hf's copy in the weights
        cfg_path = f"{label} (its embedded config)"
        cfg = _json_object(embedded, cfg_path)
    if cfg is not None:
        values = {ours: _config_int(cfg_path, cfg, key) for ours, key in (
            ("num_layers", "n_layer"), ("num_heads", "n_head"), ("channels", "n_embd"), ("max_seq_len", "n_positions"),
            ("vocab_size", "vocab_size"))}
        act = cfg.get("activation_function", "gelu_new")
        if not isinstance(act, str) or act not in _TANH_GELUS:
            raise LlmpyError(f"{cfg_path}: activation_function {json.dumps(act)[:40]} is not the tanh GELU (gelu_new) "
                             "llm.c uses")
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise LlmpyError(f"{cfg_path}: layer_norm_epsilon must be a positive number, not {json.dumps(eps)[:40]}")
        if abs(eps - 1e-5) > 1e-9:
            raise LlmpyError(f"{cfg_path}: layer_norm_epsilon {eps}: llm.c's GPT-2 has 1e-5, and loading this model so "
                             "would change its outputs")
        # transformers' options that change the attention's arithmetic, which llm.c's model does not have
        for key, llmc in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if cfg.get(key, llmc) is not llmc:
                raise LlmpyError(f"{cfg_path}: {key} {json.dumps(cfg[key])[:40]}: llm.c's GPT-2 has "
                                 f"{json.dumps(llmc)}, and loading this model so would change its outputs")
        values["padded_vocab_size"] = 0  # absent: llm.c's padding
        if "llmc_padded_vocab_size" in cfg:
            padded = _config_int(cfg_path, cfg, "llmc_padded_vocab_size")
            if padded < values["vocab_size"]:
                raise LlmpyError(f"{cfg_path}: llmc_padded_vocab_size {padded} is smaller than vocab_size "
                                 f"{values['vocab_size']}")
            if padded > 2 * values["vocab_size"] + 128:  # padding rows are zeros that the file does not hold
                raise LlmpyError(f"{cfg_path}: llmc_padded_vocab_size {padded} is far above vocab_size "
                                 f"{values['vocab_size']} (llm.c pads to the next multiple of 128)")
            values["padded_vocab_size"] = padded
        where = cfg_path
    else:
        layers = {int(k.split(".")[1]) for k in index if _is_hf_param(k) and k.startswith("h.")}
        if not C or C % 64:
            raise LlmpyError(f"{label}: no {HF_CONFIG_NAME} beside it and the width {C} is not a multiple "
                             "of GPT-2's head size 64, so the number of heads is unknown")
        values = {"num_layers": max(layers) + 1 if layers else 0, "num_heads": C // 64, "channels": C,
                  "max_seq_len": maxT, "vocab_size": V}
        # no shape holds the heads: a file of another head size would load, and compute, wrong without a word
        heads = f"{C // 64} head{'s' if C // 64 > 1 else ''}"
        warnings.warn(f"{label}: no {HF_CONFIG_NAME} beside it: {heads} assumed (GPT-2's head size 64)", stacklevel=3)
        where = label
    try:
        return GPT2Config(**values)
    except LlmpyError as e:
        raise LlmpyError(f"{where}: bad GPT-2 configuration: {e}") from None


# ---------------------------------------------------------------------------------------------
# llm.c debug state


def save_debug_state(path, config: GPT2Config, inputs, targets, logits, loss, grads) -> None:
    """Write llm.c's debug state (what test_gpt2 checks against).

    inputs/targets (B, T) integer tokens; logits (B, T, V) or (B, T, Vp) -- only the real vocab's V
    columns are stored; loss a float or 0-d tensor; grads the flat fp32 gradient (padded layout).
    """
    inputs, targets = torch.as_tensor(inputs), torch.as_tensor(targets)
    if inputs.dim() != 2 or targets.shape != inputs.shape:
        raise LlmpyError(f"cannot write {path}: inputs and targets must both be (B, T), got "
                         f"{list(inputs.shape)} and {list(targets.shape)}")
    B, T = inputs.shape
    V = config.vocab_size
    logits = torch.as_tensor(logits)
    if logits.shape not in ((B, T, V), (B, T, config.padded_vocab_size)):
        raise LlmpyError(f"cannot write {path}: logits have shape {list(logits.shape)}, expected "
                         f"{[B, T, V]} or {[B, T, config.padded_vocab_size]}")
    grads = torch.as_tensor(grads)
    if grads.numel() != config.num_parameters:
        raise LlmpyError(f"cannot write {path}: {grads.numel()} gradients given, the model has "
                         f"{config.num_parameters}")
    header = _header(DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION, B, T)
    loss_t = torch.tensor([float(loss)], dtype=torch.float32)

    def write(f):
        f.write(header)
        _write_tensor(f, inputs, "int32")
        _write_tensor(f, targets, "int32")
        _write_tensor(f, logits[..., :V], "float32")
        _write_tensor(f, loss_t, "float32")
        _write_tensor(f, grads, "float32")

    atomic_write(path, write)


def load_debug_state(path, config: GPT2Config) -> dict:
    """Read llm.c's debug state for `config`.

    Returns {'B', 'T', 'inputs' (B,T) int32, 'targets' (B,T) int32, 'logits' (B,T,V) fp32,
    'loss' float, 'grads' flat fp32 (num_parameters, padded layout)}, all CPU tensors.
    """
    h = _read_header(path)
    _check_magic(path, h, DEBUG_STATE_MAGIC, "an llm.c debug state")
    if int(h[1]) != DEBUG_STATE_VERSION:
        raise LlmpyError(f"{path}: unsupported debug state version {int(h[1])} (expected {DEBUG_STATE_VERSION})")
    B, T = int(h[2]), int(h[3])
    if B <= 0 or T <= 0:
        raise LlmpyError(f"{path}: corrupt debug state header, B={B} T={T}")
    if T > config.max_seq_len:
        raise LlmpyError(f"{path}: sequence length T={T} exceeds the model's {config.max_seq_len}")
    V, N = config.vocab_size, config.num_parameters
    counts = [("inputs", "<i4", B * T), ("targets", "<i4", B * T), ("logits", "<f4", B * T * V),
              ("loss", "<f4", 1), ("grads", "<f4", N)]
    _check_size(path, HEADER_BYTES + 4 * sum(c for _, _, c in counts),
                f"a debug state with B={B}, T={T}, V={V} and {N} parameters")
    out: dict = {"B": B, "T": T}
    offset = HEADER_BYTES
    for name, dt, count in counts:
        out[name] = torch.from_numpy(np.fromfile(path, dtype=dt, count=count, offset=offset))
        offset += 4 * count
    out["inputs"] = out["inputs"].reshape(B, T)
    out["targets"] = out["targets"].reshape(B, T)
    out["logits"] = out["logits"].reshape(B, T, V)
    out["loss"] = float(out["loss"][0])
    for name in ("inputs", "targets"):
        t = out[name]
        if t.min() < 0 or t.max() >= V:
            raise LlmpyError(f"{path}: {name} hold token ids outside [0, {V}): was it written for another model?")
    return out


# ---------------------------------------------------------------------------------------------
# format detection


def load_model_file(path) -> tuple[GPT2Config, torch.Tensor, str]:
    """Load any supported model file: (config, flat CPU parameters, 'float32' or 'bfloat16').

    An llm.c .bin (by magic) keeps its dtype; a .safetensors file, or a directory holding
    model.safetensors, loads as float32. Other llm.c files and anything else are refused.
    """
    if not str(path).strip():  # Path("") is the current folder: not what was meant
        raise LlmpyError("an empty model file name")
    p = expand_user(path)  # a quoted "~/model.bin" (the shell expands an unquoted one)
    if p.is_dir():
        config, flat = load_hf(p)
        return config, flat, "float32"
    if not p.exists():
        raise LlmpyError(f"{p}: " + ("a link to nothing (or a loop of links)" if os.path.lexists(p) else
                                     "no such file or directory"))
    if not p.is_file():  # a pipe or a device would block or read forever
        raise LlmpyError(f"{p}: not a regular file (a model file, or a folder holding {HF_WEIGHTS_NAME})")
    with open(p, "rb") as f:
        head = f.read(16)
    if len(head) >= 4:
        magic = int(np.frombuffer(head[:4], dtype="<i4")[0])
        if magic == MODEL_MAGIC:
            config, flat, version = load_llmc(p)
            return config, flat, _VERSION_DTYPE[version]
        if magic in _OTHER_MAGICS:
            raise LlmpyError(f"{p} is {_OTHER_MAGICS[magic]}, not a model file (magic {magic})")
    # safetensors: 8-byte header length, then the JSON header
    if p.suffix == ".safetensors" or head[8:9] == b"{":
        config, flat = load_hf(p)
        return config, flat, "float32"
    raise LlmpyError(f"{p} is not a model file: neither an llm.c model (magic {MODEL_MAGIC}) "
                     "nor a safetensors file")


__all__ = [
    "MODEL_MAGIC", "DEBUG_STATE_MAGIC", "TOKEN_SHARD_MAGIC", "VERSION_FP32", "VERSION_BF16",
    "LlmcHeader", "atomic_path", "atomic_write", "save_safetensors",
    "normalize_dtype", "read_llmc_header",
    "save_llmc", "load_llmc", "check_precision", "hf_tensors", "hf_config_dict", "save_hf",
    "load_hf", "save_debug_state", "load_debug_state", "load_model_file",
]
