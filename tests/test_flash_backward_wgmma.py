"""The Gluon (explicit async wgmma) flash backward against the CPU reference and the tl.dot kernel.

Gluon kernels do not run in Triton's CPU interpreter: on the CPU the kernel's own code runs in
tests/gluon_emulator.py against the reference, and the dispatch is checked: which calls it serves, and that
everything else falls back to the tl.dot kernel (which test_flash_attention.py tests on the CPU). On the GPU
the compiled kernel against the reference and the tl.dot kernel.
"""
import pytest
import torch

from llmpy.kernels import flash_attention as fa
from llmpy.kernels import flash_backward_wgmma as fw
from llmpy.kernels.flash_attention import FLASH_CONFIGS

from test_flash_attention import (check_backward, check_q_sums, make_inputs, poisoned_q_sums, reference, run_backward,
                                  run_forward)


def test_config_names_the_kernel(monkeypatch):
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "wgmma"})
    assert fa.flash_config(64, torch.bfloat16)["bwd_kernel"] == "wgmma"
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "cutlass"})
    with pytest.raises(AssertionError, match="bwd_kernel"):
        fa.flash_config(64, torch.bfloat16)
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "wgmma", "wgmma_stages": (1, 2)})
    with pytest.raises(AssertionError, match="wgmma_stages"):
        fa.flash_config(64, torch.bfloat16)
    # the dk/dv half's k from registers is the GPU table's default at hs 64 (three programs an SM at 168
    # registers); q and dout (bits 4, 8) are not offered
    assert fa._CONFIGS_16[64]["wgmma_a_regs"] == 1 and fa._CONFIGS_16[64]["wgmma_maxnreg"] == 168
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "wgmma", "wgmma_a_regs": 4})
    with pytest.raises(AssertionError, match="wgmma_a_regs"):
        fa.flash_config(64, torch.bfloat16)


def test_other_calls_fall_back(monkeypatch, device):
    """On the CPU, and for fp32, other head sizes or T off the 64 grid, the tl.dot kernel serves: with the
    wgmma kernel asked for, the gradient is still the reference's."""
    assert not fw.wgmma_backward_usable(torch.zeros(1, 64, 3 * 64, dtype=torch.bfloat16), 64, 64)
    monkeypatch.setitem(FLASH_CONFIGS, 16, {"bwd_kernel": "wgmma"})
    B, T, NH, hs, dtype = 1, 20, 2, 16, torch.float32
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=3)
    assert not fw.wgmma_backward_usable(qkv, T, hs)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_backward(run_backward(dout, qkv, out, lse, NH), dqkv_ref, dtype)


# (B, T, NH): one 64-row block (two query tiles on the diagonal, one key tile), a few blocks, GPT-2 sizes
GPU_SHAPES = [(2, 64, 3), (3, 192, 2), (4, 1024, 12), (1, 2048, 12)]
VARIANTS = {"default": {}, "stages-2-2": dict(wgmma_stages=(2, 2)), "stages-4-3": dict(wgmma_stages=(4, 3)),
            "k-v-in-shared": dict(wgmma_a_regs=0, wgmma_maxnreg=None), "v-in-registers": dict(wgmma_a_regs=2),
            "k-v-in-registers": dict(wgmma_a_regs=3)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B%dT%dNH%d" % s)
def test_gpu_wgmma_backward(monkeypatch, shape, variant):
    B, T, NH = shape
    hs, dtype = 64, torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=11)
    assert fw.wgmma_backward_usable(qkv, T, hs)
    out, lse = run_forward(qkv, NH)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "tl.dot"})
    dqkv_tl = run_backward(dout, qkv, out, lse, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma", **VARIANTS[variant]})
    dqkv = run_backward(dout, qkv, out, lse, NH)  # poisoned with NaN before the kernel writes it
    check_backward(dqkv, dqkv_ref, dtype)
    # the same products in the same order as the tl.dot kernel (bitwise equal on the H200 with triton 3.6,
    # run V; asked here only to within a bf16 rounding, so that a compiler's other FMA choice passes)
    assert torch.allclose(dqkv.float(), dqkv_tl.float(), rtol=2 ** -7, atol=1e-3 * dqkv_tl.float().abs().max().item())
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH)), "not reproducible"
    # ring depths and where the A operands come from change no product: every variant gives the same bits
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma", "wgmma_stages": (3, 3), "wgmma_a_regs": 0,
                                            "wgmma_maxnreg": None})
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH)), "not the bits of k and v from shared memory"


@pytest.mark.parametrize("tma_loads", ["at-issue", "at-wait"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(2, 64, 3), (2, 192, 2)], ids=lambda s: "B%dT%dNH%d" % s)
def test_wgmma_backward_emulated_on_the_cpu(monkeypatch, gluon_emulator, shape, variant, tma_loads):
    """The kernel's own code on the CPU (tests/gluon_emulator.py): its tiles, diagonal masks, ring slots and
    barrier phases, the dq column sums, with TMA loads landing at issue and at the wait."""
    B, T, NH = shape
    hs, dtype = 64, torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cpu", seed=11)
    out, lse = run_forward(qkv, NH)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    monkeypatch.setattr(fa, "wgmma_backward_usable", lambda *args: True)  # on the CPU it says no, rightly
    emulated = gluon_emulator.emulate(fw._flash_bwd_wgmma_kernel, tma_loads)
    monkeypatch.setattr(fw, "_flash_bwd_wgmma_kernel", emulated)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma", **VARIANTS[variant]})
    q_sums = poisoned_q_sums(qkv)
    dqkv = run_backward(dout, qkv, out, lse, NH, q_sums=q_sums)
    assert emulated.launches == 1
    check_backward(dqkv, dqkv_ref, dtype)
    check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding=True)
    if variant == "default":  # without the query sums (Q_SUMS off): the same gradient, bit for bit
        assert torch.equal(run_backward(dout, qkv, out, lse, NH), dqkv)
        assert emulated.launches == 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B%dT%dNH%d" % s)
def test_gpu_wgmma_q_sums(monkeypatch, shape):
    """The kernel's own column sums of dq (fp32, before rounding) a 64-row block at a time: against the
    reference's and the stored dq's block sums, repeatable bit for bit, and dq, dk, dv the same with or
    without them."""
    B, T, NH = shape
    hs, dtype = 64, torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=19)
    out, lse = run_forward(qkv, NH)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma"})
    q_sums = poisoned_q_sums(qkv)
    dqkv = run_backward(dout, qkv, out, lse, NH, q_sums=q_sums)
    check_backward(dqkv, dqkv_ref, dtype)
    check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding=True)
    again = poisoned_q_sums(qkv)
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH, q_sums=again)) and torch.equal(q_sums, again)
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH))


@pytest.mark.gpu
def test_gpu_off_grid_falls_back(monkeypatch):
    B, T, NH, hs, dtype = 2, 1000, 12, 64, torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=12)
    assert not fw.wgmma_backward_usable(qkv, T, hs)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma"})
    _, _, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    q_sums = poisoned_q_sums(qkv)  # summed by a pass over dq after the tl.dot kernel
    dqkv = run_backward(dout, qkv, out, lse, NH, q_sums=q_sums)
    check_backward(dqkv, dqkv_ref, dtype)
    check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding=False)
