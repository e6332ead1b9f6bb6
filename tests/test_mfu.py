"""MFU as llm.c's gpt2_estimate_mfu computes it: (6N + 6LCT) FLOPs a token over the card's peak for the run's
precision, by device name."""
import numpy as np
import pytest

from llmpy.config import parse_descriptor
from llmpy.mfu import estimate_mfu, peak_bf16_flops


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12), ("NVIDIA A10G", 70e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12), ("NVIDIA GeForce RTX 4070 Ti", 80.2e12),
    ("Tesla T4", None), ("NVIDIA A1000", None)])  # A10 must not match A100, nor A100 A1000
def test_the_peak_is_the_longest_whole_word_match(name, peak):
    assert peak_bf16_flops(name) == peak


@pytest.mark.parametrize("dtype, peak", [("bfloat16", 989e12), ("float32", 989e12 / 2)])
def test_mfu_is_llmcs_flops_over_the_peak_of_the_runs_precision(dtype, peak):
    # a float32 run was measured against the bf16 peak: twice too low (llm.c's fp32 build takes the TF32 peak)
    rng = np.random.default_rng()
    config = parse_descriptor("d12")
    T, tok_s = int(rng.integers(64, 1025)), float(rng.uniform(1e5, 1e6))
    flops_per_token = 6 * config.num_parameters + 6 * config.num_layers * config.channels * T
    got = estimate_mfu(config, T, tok_s, "NVIDIA H100 80GB HBM3", dtype)
    assert got == pytest.approx(flops_per_token * tok_s / peak, rel=1e-12)


def test_mfu_of_an_unknown_card_or_no_throughput_is_minus_one():
    config = parse_descriptor("d12")
    assert estimate_mfu(config, 1024, 5e5, "Tesla T4") == -1.0
    assert estimate_mfu(config, 1024, 0.0, "NVIDIA H100 80GB HBM3") == -1.0


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA GeForce RTX 4080 SUPER", 104.5e12), ("NVIDIA GeForce RTX 4070 Ti SUPER", 88.2e12),
    ("NVIDIA GeForce RTX 4070 SUPER", 71.0e12), ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
    ("NVIDIA RTX A5000 Laptop GPU", None), ("NVIDIA GeForce RTX 4090 D", 147.1e12)])
def test_super_and_laptop_cards_do_not_take_the_desktop_cards_peak(name, peak):
    # llm.c's numbers (tensor cores x clock): a 4080 SUPER took the 4080's peak, a 4070 Ti SUPER the 4070 Ti's
    # (MFU 7-10 % too high), a laptop 4090 the desktop card's; a 4090 D (fewer SMs) the 4090's (MFU 11 % too low)
    assert peak_bf16_flops(name) == peak
