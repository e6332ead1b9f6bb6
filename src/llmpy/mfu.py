"""Model FLOPs utilisation (llm.c's mfu.h and gpt2_estimate_mfu): achieved FLOP/s over the GPU's peak.

The numerator is llm.c's: 6N + 6LCT FLOPs per token (config.flops_per_token), N counting the whole flat
parameter buffer, the attention term for a sequence of T. The denominator is the dense (no sparsity)
bf16 tensor-core peak with fp32 accumulation from the vendors' data sheets, by device name. llm.c derives
its numbers from tensor-core counts and clocks; these are the published peaks, which agree closely, except on the
workstation cards (RTX A4000-A6000, RTX 6000 Ada): their fp32 accumulation runs at full rate, where llm.c's table
gives them the GeForce half rate, so llm.c's MFU there is twice ours.
"""
from __future__ import annotations

import re

from .config import GPT2Config

# Dense bf16 tensor-core peak, FLOP/s, fp32 accumulation. Matched against torch.cuda.get_device_name()
# by case-insensitive whole-word match, longest key first (so "H100 PCIe" wins over "H100").
PEAK_BF16_FLOPS: dict[str, float] = {
    # Blackwell
    "B200": 2250e12,
    "B100": 1750e12,
    # Hopper
    "H200 NVL": 835e12,
    "H200": 989e12,          # SXM
    "GH200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,          # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    "H800 PCIe": 756e12,
    "H800": 989e12,
    "H20": 148e12,
    # Ampere data centre
    "A100": 312e12,          # SXM4 and PCIe, 40 and 80 GB
    "A800": 312e12,
    "A30": 165e12,
    "A40": 149.7e12,
    "A10G": 70e12,
    "A10": 125e12,
    # Ada / Ampere workstation and data centre
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 6000 Ada": 364e12,
    "RTX A6000": 154.8e12,
    "RTX A5000": 111e12,
    "RTX A4000": 76.7e12,
    # GeForce (bf16 with fp32 accumulation runs at half the fp16-accumulate rate)
    "RTX 5090": 209.5e12,
    "RTX 4090 D": 147.1e12,  # China's 4090: 114 SMs of the 4090's 128 at its clock (2520 MHz x 512 FLOP an SM)
    "RTX 4090": 165.2e12,
    "RTX 4080 SUPER": 104.5e12,  # SUPER cards have more tensor cores: not the plain card's peak
    "RTX 4080": 97.5e12,
    "RTX 4070 Ti SUPER": 88.2e12,
    "RTX 4070 Ti": 80.2e12,
    "RTX 4070 SUPER": 71.0e12,
    "RTX 3090 Ti": 80e12,
    "RTX 3090": 71e12,
    "RTX 3080 Ti": 68.2e12,
    "RTX 3080": 59.5e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name (e.g. torch.cuda.get_device_name()), or None if unknown.
    A key matches as whole words ("A10" does not match "A100"), the longest matching key wins; laptop parts are
    unknown (llm.c's table has none either)."""
    name = device_name.lower()
    if re.search(r"(?<![0-9a-z])laptop(?![0-9a-z])", name):
        return None  # a laptop part shares its desktop card's name but not its clocks (nor, often, its chip)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(r"(?<![0-9a-z])" + re.escape(key.lower()) + r"(?![0-9a-z])", name):
            return PEAK_BF16_FLOPS[key]
    return None


def estimate_mfu(config: GPT2Config, T: int, tokens_per_second: float, device_name: str,
                 dtype: str = "bfloat16") -> float:
    """llm.c's gpt2_estimate_mfu: (6N + 6LCT) * tokens/s over the device's peak for the run's precision, as a
    fraction (0.5 = 50%); -1 when the device is not in the table (llm.c prints -1 then too). A float32 run is
    measured against the TF32 peak, half the bf16 one on every card in the table, as llm.c's fp32 build is."""
    peak = peak_bf16_flops(device_name)
    if peak is None or tokens_per_second <= 0:
        return -1.0
    if dtype == "float32":
        peak /= 2
    return config.flops_per_token(T) * tokens_per_second / peak
