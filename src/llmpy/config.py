"""Model configuration: llm.c's model descriptors and the layout of the 16 parameter tensors.

A descriptor is what llm.c's `-e` flag takes: `d12`, `gpt2:d12`, `gpt3:c768`, `gpt2-medium`, an
explicit `layers=2,channels=64,heads=2[,seq=256,vocab=300]`, or a checkpoint path (resolved by the
caller through `llmpy.checkpoint`, not here).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .errors import LlmpyError, shown

GPT2_VOCAB = 50257
GPT2_MAX_SEQ = 1024
GPT3_MAX_SEQ = 2048
VOCAB_PAD_MULTIPLE = 128

# llm.c's depth table for `-e dN` (GPT-2 family): depth -> (channels, heads)
GPT2_DEPTHS = {
    6: (384, 6),
    12: (768, 12),
    24: (1024, 16),
    36: (1280, 20),
    48: (1600, 25),
    60: (1920, 30),
    72: (2880, 30),
    84: (3456, 36),
}

# llm.c's GPT-3 table for `-e gpt3:cN`: channels -> (depth, head size). llm.c lists the 13B model as
# c5140, which is not a multiple of its head size 128; the GPT-3 paper's width is 5120, used here
# (c5140 is accepted as llm.c's spelling of the same model).
GPT3_CHANNELS = {
    384: (6, 64),
    768: (12, 64),
    1024: (24, 64),
    1536: (24, 96),
    2048: (24, 128),
    2560: (32, 80),
    4096: (32, 128),
    5120: (40, 128),
    12288: (96, 128),
}

GPT2_NAMES = {"gpt2": 12, "gpt2-medium": 24, "gpt2-large": 36, "gpt2-xl": 48}

# The attention paths (kernels/attention.py's dispatcher runs them; here so that the trainer checks its flag
# without importing the kernels): flash: the Triton kernels; cudnn: cuDNN's through its frontend
# (deterministic backward); cudnn+flash: cuDNN's forward with the Triton backward; torch-*: PyTorch's
# private SDPA ops; classic: llm.c's unfused path.
ATTENTION_IMPLS = ("classic", "flash", "cudnn", "cudnn+flash", "torch-cudnn", "torch-flash")

# The 16 parameter tensors, in llm.c's order (the order of its checkpoint files and flat buffer).
PARAMETER_NAMES = (
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb",
)


class ConfigError(LlmpyError):
    """A model descriptor or configuration that cannot describe a GPT-2 model."""


def pad_vocab(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


_INT_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels", "padded_vocab_size")


@dataclass(frozen=True)
class GPT2Config:
    max_seq_len: int = GPT2_MAX_SEQ
    vocab_size: int = GPT2_VOCAB
    num_layers: int = 12
    num_heads: int = 12
    channels: int = 768
    padded_vocab_size: int = field(default=0)

    def __post_init__(self):
        for name in _INT_FIELDS:
            value = getattr(self, name)
            # numpy's integers are sizes too (a sweep's values); bool, 2.5, 32.0 and "2" are not
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name} must be an integer, got {shown(value, 40)} ({type(value).__name__})")
            if value >= 2**63:  # no array dimension is that large, and the sizes below stay printable
                raise ConfigError(f"{name} must be less than 2**63, got a {int(value).bit_length()}-bit integer")
            object.__setattr__(self, name, int(value))  # a numpy integer as Python's: JSON and repr stay plain
        if self.padded_vocab_size == 0:
            object.__setattr__(self, "padded_vocab_size", pad_vocab(self.vocab_size))
        for name in ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.channels % self.num_heads:
            raise ConfigError(f"channels {self.channels} is not divisible by heads {self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"padded vocab {self.padded_vocab_size} < vocab {self.vocab_size}")

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the 16 tensors in llm.c's order; weights are (out, in): y = x @ w.T + b."""
        Vp, C, L, maxT = self.padded_vocab_size, self.channels, self.num_layers, self.max_seq_len
        return {
            "wte": (Vp, C), "wpe": (maxT, C),
            "ln1w": (L, C), "ln1b": (L, C),
            "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
            "attprojw": (L, C, C), "attprojb": (L, C),
            "ln2w": (L, C), "ln2b": (L, C),
            "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
            "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
            "lnfw": (C,), "lnfb": (C,),
        }

    def parameter_sizes(self) -> dict[str, int]:
        return {k: math.prod(s) for k, s in self.parameter_shapes().items()}

    @property
    def num_parameters(self) -> int:
        """Elements of the flat parameter buffer (wte counted with its padded rows, as llm.c does)."""
        return sum(self.parameter_sizes().values())

    def weight_decay_mask(self) -> dict[str, bool]:
        """Which tensors get weight decay: the 2-D ones (per layer), as llm.c's gpt2_update."""
        return {k: k in ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw") for k in PARAMETER_NAMES}

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """llm.c's MFU numerator: 6N + 6LCT with N the whole flat buffer (803.5 M for d12, T = 1024)."""
        T = seq_len or self.max_seq_len
        return 6 * self.num_parameters + 6 * self.num_layers * self.channels * T

    def describe(self) -> str:
        return (f"layers={self.num_layers},channels={self.channels},heads={self.num_heads},"
                f"seq={self.max_seq_len},vocab={self.vocab_size}")


def _gpt2_depth(depth: int) -> GPT2Config:
    if depth not in GPT2_DEPTHS:
        raise ConfigError(f"unknown GPT-2 depth d{depth}; llm.c's table has d{', d'.join(map(str, GPT2_DEPTHS))}")
    channels, heads = GPT2_DEPTHS[depth]
    return GPT2Config(max_seq_len=GPT2_MAX_SEQ, vocab_size=GPT2_VOCAB, num_layers=depth,
                      num_heads=heads, channels=channels)


def _gpt3_channels(channels: int) -> GPT2Config:
    if channels == 5140:
        channels = 5120
    if channels not in GPT3_CHANNELS:
        raise ConfigError(f"unknown GPT-3 width c{channels}; llm.c's table has c{', c'.join(map(str, GPT3_CHANNELS))}")
    depth, head_size = GPT3_CHANNELS[channels]
    return GPT2Config(max_seq_len=GPT3_MAX_SEQ, vocab_size=GPT2_VOCAB, num_layers=depth,
                      num_heads=channels // head_size, channels=channels)


_EXPLICIT_KEYS = {"layers": "num_layers", "channels": "channels", "heads": "num_heads",
                  "seq": "max_seq_len", "vocab": "vocab_size"}


def _shown(text: str, most: int = 60) -> str:
    """text quoted for a message, its middle cut to "..." past `most` characters (a pasted or generated descriptor
    can be thousands long)."""
    return repr(text if len(text) <= most else text[:most // 2] + "..." + text[-(most // 2):])


def _decimal(text: str, signed: bool = False) -> int:
    """ASCII decimal digits only (int() also takes "1_2", "+2" and other scripts' digits: d1_2 was d12); a
    ValueError otherwise."""
    t = text.strip()
    digits = t[1:] if signed and t.startswith("-") else t
    if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > 18:
        raise ValueError(text)
    return int(t)


def _explicit(desc: str) -> GPT2Config:
    values, shown = {}, _shown(desc)
    for part in desc.split(","):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in _EXPLICIT_KEYS:
            raise ConfigError(f"bad model descriptor part {_shown(part, 40)} in {shown}: expected "
                              "layers=N,channels=N,heads=N[,seq=N,vocab=N]")
        if _EXPLICIT_KEYS[key] in values:
            raise ConfigError(f"model descriptor {shown}: {key} is given twice")
        try:
            values[_EXPLICIT_KEYS[key]] = _decimal(val, signed=True)  # signed: "-16" is refused as not positive
        except ValueError:
            digits = val.strip().lstrip("-")
            what = "is far too large" if digits.isascii() and digits.isdigit() else "must be an integer"
            raise ConfigError(f"model descriptor {shown}: {key} {what}, got {_shown(val, 40)}") from None
    missing = [k for k in ("layers", "channels", "heads") if _EXPLICIT_KEYS[k] not in values]
    if missing:
        raise ConfigError(f"model descriptor {shown} lacks {', '.join(missing)}")
    # refused in the descriptor's own words (layers, not num_layers), the descriptor named
    for key, name in _EXPLICIT_KEYS.items():
        if name in values and values[name] <= 0:
            raise ConfigError(f"model descriptor {shown}: {key} must be positive, got {values[name]}")
    try:
        return GPT2Config(**values)
    except ConfigError as e:
        raise ConfigError(f"model descriptor {shown}: {e}") from None


def looks_like_a_model_path(desc: str) -> bool:
    """-e meant as a model file's path rather than a descriptor: a folder in it, or a model file's suffix."""
    d = desc.strip()
    return "/" in d or d.endswith((".bin", ".safetensors"))


def parse_descriptor(desc: str) -> GPT2Config:
    """Turn llm.c's `-e` model descriptor (other than a checkpoint path) into a configuration."""
    if not isinstance(desc, str):
        # a Path names a file, which the caller resolves (load_model, checkpoint.load_model_file), not this
        raise ConfigError(f"model descriptor {shown(desc)}: must be a str such as 'd12' or "
                          f"'layers=2,channels=64,heads=2', not {type(desc).__name__}")
    d = desc.strip()
    low = d.lower()
    if low in GPT2_NAMES:
        return _gpt2_depth(GPT2_NAMES[low])
    if "=" in d and not looks_like_a_model_path(d):  # a missing runs/lr=3e-4/model.bin is a file, not layers=...
        return _explicit(d)
    family = "gpt2"
    if ":" in low:
        family, _, low = low.partition(":")
    try:
        if family == "gpt2" and low.startswith("d"):
            return _gpt2_depth(_decimal(low[1:]))
        if family == "gpt3" and low.startswith("c"):
            return _gpt3_channels(_decimal(low[1:]))
    except ValueError:
        pass
    if looks_like_a_model_path(d):
        raise ConfigError(f"{desc if len(desc) <= 200 else _shown(desc, 200)}: no such model file")
    raise ConfigError(f"unknown model descriptor {_shown(desc)}: expected dN, gpt2:dN, gpt3:cN, gpt2, gpt2-medium, "
                      "gpt2-large, gpt2-xl, layers=..,channels=..,heads=.. or a checkpoint file")


_CGROUP_ROOT = "/sys/fs/cgroup"  # module constants: the tests point them at a fake hierarchy
_PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_ints(path: str, keys=None) -> dict | int | None:
    """A file's one integer ("max": None), or with keys the integers of those `key value` lines; None if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
        if keys is None:
            return None if text.strip() == "max" else int(text)
        return {k: int(v) for k, v in (line.split() for line in text.splitlines()) if k in keys}
    except (OSError, ValueError):
        return None


def _cgroup_memory_left() -> int | None:
    """What the memory limit of this process's cgroup (and of each cgroup above it, v2 or v1) still leaves, page cache
    counted as free: in a container MemAvailable is the host's, and a model past the container's limit is killed."""
    try:
        with open(_PROC_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    left = None
    for line in lines:
        fields = line.split(":", 2)  # hierarchy-id:controllers:path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            base, names = _CGROUP_ROOT, ("memory.max", "memory.current", ("file",))
        elif "memory" in controllers.split(","):  # v1
            base, names = _CGROUP_ROOT + "/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                     ("total_cache", "cache"))
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # this cgroup up to the hierarchy's root (a container sees its own)
            folder = "/".join([base, *parts[:depth]])
            limit, used = _read_ints(f"{folder}/{names[0]}"), _read_ints(f"{folder}/{names[1]}")
            if limit is None or used is None:
                continue
            stat = _read_ints(f"{folder}/memory.stat", names[2]) or {}
            cache = max((stat.get(k, 0) for k in names[2]), default=0)
            free = max(0, limit - used + cache)
            left = free if left is None else min(left, free)
    return left


def host_memory_available() -> int | None:
    """Bytes the kernel says a process can still take (MemAvailable, or less where a cgroup's limit leaves less), None
    where it does not say."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    left = _cgroup_memory_left()
    return left if avail is None else avail if left is None else min(avail, left)


def check_fits_in_host_memory(config: GPT2Config, nbytes: int, what: str) -> None:
    """One ConfigError naming the model when `what` (nbytes) is more than the host can give: a descriptor with a
    few zeros too many would otherwise die in numpy or torch, or take the machine's memory and be killed."""
    free = host_memory_available()
    if free is not None and nbytes > free:
        raise ConfigError(f"model {config.describe()}: {what} need {nbytes / 1e9:,.1f} GB of host memory, more "
                          f"than the {free / 1e9:,.1f} GB available")


def parameter_views(flat, config: GPT2Config) -> dict:
    """Views of the 16 tensors inside one flat buffer (torch tensor or numpy array), llm.c's order."""
    # checked first: a short buffer would fail in reshape, a torch or numpy error naming neither buffer nor model
    if len(flat.shape) != 1 or flat.shape[0] != config.num_parameters:
        raise ConfigError(f"flat buffer of shape {list(flat.shape)}: the model ({config.describe()}) needs "
                          f"{config.num_parameters} elements")
    views, offset = {}, 0
    for name, shape in config.parameter_shapes().items():
        n = math.prod(shape)
        views[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    return views
