"""The Gluon (explicit async wgmma) flash backward against the CPU reference and the tl.dot kernel.

Gluon kernels do not run in Triton's CPU interpreter, so the kernel itself is tested on the GPU only; the
CPU tests check the dispatch: which calls it serves, and that everything else falls back to the tl.dot
kernel (which test_flash_attention.py tests on the CPU).
"""
import pytest
import torch

from llmpy.kernels import flash_attention as fa
from llmpy.kernels import flash_backward_wgmma as fw
from llmpy.kernels.flash_attention import FLASH_CONFIGS

from test_flash_attention import (check_backward, check_q_sums, make_inputs, poisoned_q_sums, reference, rel_err,
                                  run_backward, run_forward)


def test_config_names_the_kernel(monkeypatch):
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "wgmma"})
    assert fa.flash_config(64, torch.bfloat16)["bwd_kernel"] == "wgmma"
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "cutlass"})
    with pytest.raises(AssertionError, match="bwd_kernel"):
        fa.flash_config(64, torch.bfloat16)
    monkeypatch.setitem(FLASH_CONFIGS, 64, {"bwd_kernel": "wgmma", "wgmma_stages": (1, 2)})
    with pytest.raises(AssertionError, match="wgmma_stages"):
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
VARIANTS = {"default": {}, "stages-2-2": dict(wgmma_stages=(2, 2)), "stages-4-3": dict(wgmma_stages=(4, 3))}


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
@pytest.mark.parametrize("heads_a_pass", [None, 1, 5], ids=["all-heads", "one-head", "five-heads"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B%dT%dNH%d" % s)
def test_gpu_wgmma_backward_dq_from_ds(monkeypatch, shape, heads_a_pass):
    """dq summed from the dS^T the dk/dv half stores (ds=) instead of recomputed: against the CPU reference,
    within a bf16 rounding of the fused kernel's (dk, dv bitwise equal: the same half), reproducible bit
    for bit, q_sums with it; a NaN-poisoned scratch of any size (heads in passes) leaves no NaN."""
    B, T, NH = shape
    hs, dtype = 64, torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=29)
    out, lse = run_forward(qkv, NH)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, {"bwd_kernel": "wgmma"})
    fused = run_backward(dout, qkv, out, lse, NH)
    rows, cols = fw.ds_pack_shape(T)
    heads = B * NH if heads_a_pass is None else min(heads_a_pass, B * NH)
    ds = torch.full((heads * rows * cols + 7,), float("nan"), dtype=dtype, device="cuda")  # 7: room to spare
    q_sums = poisoned_q_sums(qkv)
    dqkv = run_backward(dout, qkv, out, lse, NH, q_sums=q_sums, ds=ds)
    check_backward(dqkv, dqkv_ref, dtype)
    check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding=True)
    C = NH * hs
    assert torch.equal(dqkv[..., C:], fused[..., C:]), "dk, dv differ from the fused kernel's"
    assert torch.allclose(dqkv[..., :C].float(), fused[..., :C].float(), rtol=2 ** -7,
                          atol=1e-3 * fused[..., :C].float().abs().max().item())
    ds.fill_(float("nan"))
    again = poisoned_q_sums(qkv)
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH, q_sums=again, ds=ds)), "not reproducible"
    assert torch.equal(q_sums, again)


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


# ----------------------------------------------------------------------------------------------------
# dq from the stored score gradients (flash_backward_wgmma(ds=...)): the dq pass alone runs in Triton, so
# on the CPU too; the dk/dv half that stores dS^T is Gluon, tested on the GPU

def score_gradients(qkv, dout, NH):
    """float64 dS (B, NH, T, T), the gradient of the scaled scores (zero above the diagonal), and dq."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // NH
    q, k, v = (t.double().view(B, T, NH, hs).transpose(1, 2) for t in qkv.cpu().split(C3 // 3, dim=-1))
    do = dout.cpu().double().view(B, T, NH, hs).transpose(1, 2)
    scale = hs ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")), dim=-1)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return ds, (ds @ k * scale).transpose(1, 2).reshape(B, T, C3 // 3)


def pack_ds(ds):
    """dS (B, NH, T, T) in ds_pack_shape's layout, one head after another: key block n's dS^T (keys x its
    queries n*64 .. T) in row block min(n, NB-1-n), from column 0 if n is the longer of the pair, else from
    (n + 1) * 64. The columns no block uses (half the middle block's row when NB is odd) are NaN: a read of
    them shows in dq."""
    B, NH, T, _ = ds.shape
    rows, cols = fw.ds_pack_shape(T)
    n_blocks, blk = T // fw.BLOCK_KEYS, fw.BLOCK_KEYS
    packed = torch.full((B * NH, rows, cols), float("nan"), dtype=torch.float64)
    for n in range(n_blocks):
        partner = n_blocks - 1 - n
        row, col = min(n, partner) * blk, 0 if n < partner else (n + 1) * blk
        dsT = ds[:, :, n * blk:, n * blk:(n + 1) * blk].transpose(-1, -2).reshape(B * NH, blk, T - n * blk)
        assert packed[:, row:row + blk, col:col + T - n * blk].isnan().all(), "blocks overlap"
        packed[:, row:row + blk, col:col + T - n * blk] = dsT
    middle_hole = (n_blocks % 2) * (n_blocks + 1) // 2 * blk * blk  # the middle block's row, NB odd
    assert packed.isnan().sum() == B * NH * middle_hole, "a hole besides the odd middle block's"
    return packed.view(B * NH * rows, cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, heads_a_pass", [((1, 64, 2), 2), ((2, 192, 1), 1), ((1, 256, 3), 2)],
                         ids=["one-block", "odd-blocks-by-head", "even-blocks-two-passes"])
def test_dq_from_ds(device, shape, heads_a_pass, dtype):
    """dq summed from packed dS^T (the stored dS rounded to the storage dtype, as the kernel stores it)
    against float64 products of the same rounded dS, and against the exact dq; q_sums with it; the rest of
    dqkv untouched; heads in passes as a smaller scratch makes them."""
    B, T, NH = shape
    hs = 64
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=23)
    ds, dq_exact = score_gradients(qkv, dout, NH)
    packed = pack_ds(ds).to(dtype)
    rows, _ = fw.ds_pack_shape(T)
    k = qkv[..., NH * hs:2 * NH * hs].cpu().double().view(B, T, NH, hs).transpose(1, 2)
    ds_rounded = ds.to(dtype).double()
    dq_rounded = (ds_rounded @ k * hs ** -0.5).transpose(1, 2).reshape(B, T, NH * hs)
    dqkv = torch.full_like(qkv, float("nan"))
    sentinel = torch.randn(B, T, 2 * NH * hs, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    dqkv[..., NH * hs:] = sentinel
    q_sums = torch.full((fa.q_sum_blocks(B, T), NH * hs), float("nan"), dtype=torch.float32, device=device)
    for bh0 in range(0, B * NH, heads_a_pass):
        heads = min(heads_a_pass, B * NH - bh0)
        ds2 = packed[bh0 * rows:(bh0 + heads) * rows].to(device)
        fw.dq_from_ds(dqkv, qkv, ds2, bh0, heads, NH, hs ** -0.5, q_sums)
    dq = dqkv[..., :NH * hs].cpu().double()
    assert torch.isfinite(dq).all(), "a query block left unwritten"
    assert torch.equal(dqkv[..., NH * hs:], sentinel), "dk, dv columns written"
    storage = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6  # an ulp: the interpreter truncates to bf16
    assert ((dq - dq_rounded).abs() <= storage * dq_rounded.abs() + 1e-5 * dq_rounded.abs().max()).all()
    assert rel_err(dq, dq_exact) < TOL_DQ[dtype]
    sums_exact = dq_rounded.reshape(-1, fa.Q_SUM_ROWS, NH * hs).sum(1)
    assert rel_err(q_sums.cpu(), sums_exact) < 1e-5


TOL_DQ = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
