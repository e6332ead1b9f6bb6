"""llm.c's random initialisation (`gpt2_build_from_random`): the flat fp32 parameter buffer.

Everything starts at zero; the layernorm weights (ln1w, ln2w, lnfw) are one; then ONE generator,
seeded `seed`, draws the weights in llm.c's order, which is the order in which PyTorch's GPT-2
initialises its modules (so the same seed gives the same numbers as torch's generator):

    for l in 0..L-1:
        for each of the 16 tensors i:
            l == 0, wte:  normal(0, 0.02) over the first V*C elements (the padded rows stay zero)
            l == 0, wpe:  normal(0, 0.02) over all maxT*C elements
            qkvw, attprojw, fcw, fcprojw: normal(0, std) over layer l's slice only,
                std = 0.02, or 0.02 / sqrt(2L) for the residual projections attprojw and fcprojw

Each slice is one normal_ call, so torch's 16-block rule applies per call.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import GPT2Config, PARAMETER_NAMES, check_fits_in_host_memory, parameter_views
from .errors import LlmpyError
from .rand import MT19937

INIT_STD = 0.02
# the tensors drawn once (at layer 0) and those drawn per layer
_ONCE = ("wte", "wpe")
_PER_LAYER = ("qkvw", "attprojw", "fcw", "fcprojw")
_RESIDUAL = ("attprojw", "fcprojw")
_LAYERNORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")


def residual_std(num_layers: int) -> np.float32:
    """0.02 / sqrt(2L) computed in float32 as llm.c does (0.02f * (1.0f / sqrtf(2.0f * L))); for some L
    (6, 24, ...) it is one ulp away from float32(0.02 / math.sqrt(2 * L)), the PyTorch script's value."""
    f = np.float32
    return f(INIT_STD) * (f(1) / np.sqrt(f(2) * f(num_layers)))


def init_draws(config: GPT2Config):
    """The draws of gpt2_build_from_random in order: (tensor name, offset within the tensor, count, std)."""
    L = config.num_layers
    sizes = config.parameter_sizes()
    draws = []
    for l in range(L):
        for name in PARAMETER_NAMES:
            if l == 0 and name in _ONCE:
                n = config.vocab_size * config.channels if name == "wte" else sizes[name]
                draws.append((name, 0, n, np.float32(INIT_STD)))
            elif name in _PER_LAYER:
                n = sizes[name] // L
                std = residual_std(L) if name in _RESIDUAL else np.float32(INIT_STD)
                draws.append((name, l * n, n, std))
    return draws


def init_parameters(config: GPT2Config, seed: int = 42) -> torch.Tensor:
    """The flat fp32 parameter buffer (llm.c's order, config.num_parameters elements), filled as llm.c's
    gpt2_build_from_random with a generator seeded `seed` (llm.c uses 42)."""
    n = config.num_parameters
    what = f"its {n:,} fp32 parameters"
    check_fits_in_host_memory(config, 4 * n, what)
    try:
        flat = np.zeros(n, dtype=np.float32)
    except (MemoryError, ValueError):  # where /proc/meminfo does not say; ValueError: past numpy's largest array
        raise LlmpyError(f"model {config.describe()}: {what} need {4 * n / 1e9:,.1f} GB, more than this machine "
                         "can allocate") from None
    views = parameter_views(flat, config)
    for name in _LAYERNORM_WEIGHTS:
        views[name][...] = 1.0
    rng = MT19937(seed)
    for name, offset, n, std in init_draws(config):
        tensor = views[name].reshape(-1)
        rng.normal_(n, 0.0, std, out=tensor[offset:offset + n])
    return torch.from_numpy(flat)
