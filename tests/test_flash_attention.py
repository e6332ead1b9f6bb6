"""Triton flash attention (forward + backward) against reference.attention_forward / attention_backward.

CPU tests run through Triton's interpreter at tiny shapes (and on the GPU machine with device=cuda);
the gpu-marked ones check GPT-2-sized shapes. Errors are measured as ||out - ref|| / ||ref||; bf16 runs
are compared with the reference evaluated in fp32 on the same bf16-rounded inputs.
"""
import math

import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels import flash_attention as fa
from llmpy.kernels.flash_attention import FLASH_CONFIGS, flash_attention_backward, flash_attention_forward

# relative-norm tolerances per storage dtype. bf16 error comes from rounding p, dS and the outputs to bf16
# (~0.3% on the GPU; ~0.6% in the interpreter, whose bf16 conversion is cruder).
TOL = {
    torch.float32: dict(out=1e-5, lse=1e-5, dqkv=1e-5),
    torch.bfloat16: dict(out=1e-2, lse=1e-4, dqkv=1e-2),
}
DTYPES = [torch.float32, torch.bfloat16]
# (B, T, NH, hs): T not a multiple of the 16-wide interpreter tiles, head sizes padded (8 -> 16, 24 -> 32), T = 1
CPU_SHAPES = [(1, 16, 2, 16), (2, 33, 2, 8), (1, 40, 1, 24), (2, 1, 2, 16)]
GPU_SHAPES = [(4, 1024, 12, 64), (16, 1024, 12, 64), (2, 1024, 8, 80), (2, 1024, 8, 96), (2, 1024, 6, 128),
              (1, 2048, 12, 64)]


def rel_err(x, y):
    """||x - y|| / ||y||; the absolute error where y is all zeros (dq, dk at T = 1)."""
    x, y = x.double(), y.double()
    err, norm = (x - y).norm(), y.norm()
    return (err / norm).item() if norm > 0 else err.item()


def make_inputs(B, T, NH, hs, dtype, device, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = NH * hs
    qkv = (scale * torch.randn(B, T, 3 * C, generator=g)).to(dtype).to(device)
    dout = torch.randn(B, T, C, generator=g).to(dtype).to(device)
    return qkv, dout


def reference(qkv, dout, NH):
    """fp32 reference (out, lse, dqkv) for (bf16-rounded) inputs, one batch row at a time to bound memory.
    It runs on the CPU: reference.attention_forward builds its causal mask there."""
    outs, lses, grads = [], [], []
    for b in range(qkv.shape[0]):
        x = qkv[b:b + 1].float().cpu()
        out, preatt, att = ref.attention_forward(x, NH)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        lses.append(torch.logsumexp(preatt.masked_fill(~causal, float("-inf")), dim=-1))
        outs.append(out)
        if dout is not None:
            grads.append(ref.attention_backward(dout[b:b + 1].float().cpu(), x, att, NH))
    cat = lambda ts: torch.cat(ts).to(qkv.device) if ts else None
    return cat(outs), cat(lses), cat(grads)


def run_forward(qkv, NH):
    B, T, C3 = qkv.shape
    out = torch.full((B, T, C3 // 3), float("nan"), dtype=qkv.dtype, device=qkv.device)
    lse = torch.full((B, NH, T), float("nan"), dtype=torch.float32, device=qkv.device)
    flash_attention_forward(out, lse, qkv, NH)
    return out, lse


def run_backward(dout, qkv, out, lse, NH, delta=None, q_sums=None):
    dqkv = torch.full_like(qkv, float("nan"))
    flash_attention_backward(dqkv, dout, qkv, out, lse, NH, delta=delta, q_sums=q_sums)
    return dqkv


def poisoned_q_sums(qkv):
    B, T, C3 = qkv.shape
    return torch.full((fa.q_sum_blocks(B, T), C3 // 3), float("nan"), dtype=torch.float32, device=qkv.device)


def block_sums(dq):
    """float64 column sums of dq (B, T, C) over blocks of Q_SUM_ROWS of its B*T rows."""
    rows = dq.reshape(-1, dq.shape[-1]).double()
    pad = -rows.shape[0] % fa.Q_SUM_ROWS
    rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return rows.view(-1, fa.Q_SUM_ROWS, rows.shape[1]).sum(1)


def check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding):
    """q_sums against the block sums of the exact dq (the reference's, within the gradient's tolerance)
    and of the dq written: exactly those sums up to fp32 rounding where they are sums of the stored
    values, within one rounding of dq's storage where the kernel sums its fp32 dq before rounding it."""
    assert torch.isfinite(q_sums).all(), "unwritten (NaN) or non-finite q_sums"
    C = dqkv.shape[-1] // 3
    assert rel_err(q_sums, block_sums(dqkv_ref[..., :C])) < 2 * TOL[dtype]["dqkv"]
    stored, magnitude = block_sums(dqkv[..., :C]), block_sums(dqkv[..., :C].abs())
    rounding = 2.0 ** -8 if summed_before_rounding else 1e-6
    assert ((q_sums.double() - stored).abs() <= rounding * magnitude + 1e-30).all()


def check_forward(out, lse, out_ref, lse_ref, dtype):
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "unwritten (NaN) or non-finite outputs"
    assert rel_err(out, out_ref) < TOL[dtype]["out"], rel_err(out, out_ref)
    assert rel_err(lse, lse_ref) < TOL[dtype]["lse"], rel_err(lse, lse_ref)


def check_backward(dqkv, dqkv_ref, dtype):
    assert torch.isfinite(dqkv).all(), "unwritten (NaN) or non-finite gradient"
    C = dqkv.shape[-1] // 3
    for i, name in enumerate("qkv"):  # each third separately: a wrong dk must not hide behind a right dv
        part, part_ref = dqkv[..., i * C:(i + 1) * C], dqkv_ref[..., i * C:(i + 1) * C]
        assert rel_err(part, part_ref) < TOL[dtype]["dqkv"], (name, rel_err(part, part_ref))


# ----------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU at small shapes

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "B%dT%dNH%dhs%d" % s)
def test_forward_backward_match_reference(device, shape, dtype):
    B, T, NH, hs = shape
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    dqkv = run_backward(dout, qkv, out, lse, NH)
    check_backward(dqkv, dqkv_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 33, 2, 8), (3, 50, 1, 32), (1, 130, 2, 16)], ids=lambda s: "B%dT%dNH%dhs%d" % s)
def test_backward_q_sums(device, shape, dtype):
    """q_sums: dq's column sums in blocks of 64 of the B*T rows (blocks across batch rows, a partial last
    one), for the QKV bias gradient; the gradient itself is the same with or without them."""
    B, T, NH, hs = shape
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=17)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    q_sums = poisoned_q_sums(qkv)
    dqkv = run_backward(dout, qkv, out, lse, NH, q_sums=q_sums)
    check_backward(dqkv, dqkv_ref, dtype)
    check_q_sums(q_sums, dqkv, dqkv_ref, dtype, summed_before_rounding=False)
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 16, 2, 16), (2, 33, 2, 16), (1, 70, 3, 32)], ids=lambda s: "B%dT%dNH%dhs%d" % s)
def test_forward_tma_matches_pointer(device, monkeypatch, shape, dtype):
    """The forward's TMA path (keys and values through a tensor descriptor, rows past T read from the next
    batch row) against the reference, and bitwise against the pointer path in the interpreter."""
    B, T, NH, hs = shape
    qkv, _ = make_inputs(B, T, NH, hs, dtype, device, seed=13)
    out_ref, lse_ref, _ = reference(qkv, None, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, dict(fwd_tma=True))
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    monkeypatch.setitem(FLASH_CONFIGS, hs, dict(fwd_tma=False))
    out_ptr, lse_ptr = run_forward(qkv, NH)
    if device == "cpu":
        assert torch.equal(out, out_ptr) and torch.equal(lse, lse_ptr)


@pytest.mark.parametrize("schedule", fa.BWD_SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 33, 2, 16), (3, 50, 1, 32), (2, 16, 2, 16)], ids=lambda s: "B%dT%dNH%dhs%d" % s)
def test_backward_tma_matches_pointer(device, monkeypatch, shape, dtype, schedule):
    """The backward's TMA path (q, dout tiles in the dk/dv half and k, v tiles in the dq half through
    descriptors; rows past T hold the next batch row's values, which the mask must hide) against the
    reference, and bitwise against the pointer path in the interpreter."""
    B, T, NH, hs = shape
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=18)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    monkeypatch.setitem(FLASH_CONFIGS, hs, dict(bwd_tma=True, bwd_schedule=schedule))
    dqkv = run_backward(dout, qkv, out, lse, NH)
    check_backward(dqkv, dqkv_ref, dtype)
    monkeypatch.setitem(FLASH_CONFIGS, hs, dict(bwd_tma=False, bwd_schedule=schedule))
    if device == "cpu":
        assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH))


def test_large_scores_online_softmax(device):
    """Scores of std ~ 50: exp overflows unless every block rescales by the running max correctly."""
    qkv, dout = make_inputs(1, 40, 1, 24, torch.float32, device, scale=7.0, seed=1)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, 1)
    out, lse = run_forward(qkv, 1)
    check_forward(out, lse, out_ref, lse_ref, torch.float32)
    check_backward(run_backward(dout, qkv, out, lse, 1), dqkv_ref, torch.float32)


def test_single_position_attends_to_itself(device):
    """T = 1: out is v exactly and lse is the one scaled score."""
    qkv, dout = make_inputs(2, 1, 2, 16, torch.float32, device, seed=2)
    out, lse = run_forward(qkv, 2)
    C = 32
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    assert torch.allclose(out, v, rtol=1e-6, atol=1e-6)
    score = (q * k).view(2, 1, 2, 16).sum(-1).transpose(1, 2) / 4.0  # (B, NH, T), scale 1/sqrt(16)
    assert torch.allclose(lse, score, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", fa.BWD_SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_deterministic(device, monkeypatch, dtype, schedule):
    monkeypatch.setitem(FLASH_CONFIGS, 8, dict(bwd_schedule=schedule))
    qkv, dout = make_inputs(2, 33, 2, 8, dtype, device, seed=3)
    out1, lse1 = run_forward(qkv, 2)
    out2, lse2 = run_forward(qkv, 2)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    d1 = run_backward(dout, qkv, out1, lse1, 2)
    d2 = run_backward(dout, qkv, out1, lse1, 2)
    assert torch.equal(d1, d2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_backward_schedules_agree(device, monkeypatch, dtype):
    """The fused and split schedules run the same sums: bitwise equal in the interpreter, to rounding
    when compiled (each kernel's dots may sum in their own order); each matches the reference."""
    B, T, NH, hs = 2, 50, 2, 16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=10)
    _, _, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    grads = {}
    for schedule in fa.BWD_SCHEDULES:
        monkeypatch.setitem(FLASH_CONFIGS, hs, dict(bwd_schedule=schedule))
        grads[schedule] = run_backward(dout, qkv, out, lse, NH)
        check_backward(grads[schedule], dqkv_ref, dtype)
    if device == "cpu":
        assert torch.equal(grads["fused"], grads["split"])
    else:
        assert rel_err(grads["fused"], grads["split"]) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_writes_stay_in_bounds_and_inputs_untouched(device):
    """Outputs are views at the front of larger sentinel buffers: nothing past T may be written, the
    last partial block included; the inputs come back unchanged."""
    B, T, NH, hs, dtype = 1, 40, 1, 24, torch.bfloat16
    C = NH * hs
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=4)
    sentinel = 1234.0

    def guarded(shape, dt):
        n = math.prod(shape)
        buf = torch.full((n + 4 * 3 * C,), sentinel, dtype=dt, device=device)
        view = buf[:n].view(shape)
        view.fill_(float("nan"))
        return buf, view

    out_buf, out = guarded((B, T, C), dtype)
    lse_buf, lse = guarded((B, NH, T), torch.float32)
    qkv0, dout0 = qkv.clone(), dout.clone()
    flash_attention_forward(out, lse, qkv, NH)
    out0, lse0 = out.clone(), lse.clone()
    dqkv_buf, dqkv = guarded((B, T, 3 * C), dtype)
    delta_buf, delta = guarded((B, NH, T), torch.float32)
    flash_attention_backward(dqkv, dout, qkv, out, lse, NH, delta=delta)
    for buf, view in ((out_buf, out), (lse_buf, lse), (dqkv_buf, dqkv), (delta_buf, delta)):
        assert torch.isfinite(view).all()
        assert (buf[view.numel():] == sentinel).all(), "wrote past the end of an output"
    assert torch.equal(qkv, qkv0) and torch.equal(dout, dout0)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_delta_buffer(device):
    """A caller-provided delta gives the same gradient as the internal one and holds rowsum(dout * out)."""
    B, T, NH, hs = 2, 33, 2, 8
    qkv, dout = make_inputs(B, T, NH, hs, torch.float32, device, seed=5)
    out, lse = run_forward(qkv, NH)
    delta = torch.full((B, NH, T), float("nan"), device=device)
    d1 = run_backward(dout, qkv, out, lse, NH, delta=delta)
    d2 = run_backward(dout, qkv, out, lse, NH)
    assert torch.equal(d1, d2)
    expect = (dout * out).view(B, T, NH, hs).sum(-1).transpose(1, 2)
    assert torch.allclose(delta, expect, rtol=1e-5, atol=1e-6)


# rectangular tiles, (forward, dk/dv half, dq half) each as (query tile, key tile), and the T that leaves
# the last tiles partial: "query tiles larger" as on the GPU, so a diagonal spans several masked blocks;
# "key tiles larger" the other way round, so a diagonal block also holds rows or keys on the far side of it
RECTANGULAR_TILES = {
    "query-tiles-larger": (((32, 16), (16, 32), (32, 16)), 40),
    "key-tiles-larger": (((16, 32), (32, 16), (16, 32)), 50),
}


@pytest.mark.parametrize("schedule", fa.BWD_SCHEDULES)
@pytest.mark.parametrize("tiles", list(RECTANGULAR_TILES))
def test_rectangular_tiles(device, monkeypatch, tiles, schedule):
    ((bm, bn), (m1, n1), (m2, n2)), T = RECTANGULAR_TILES[tiles]
    B, NH, hs, dtype = 1, 2, 16, torch.float32
    monkeypatch.setitem(FLASH_CONFIGS, hs, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2,
                                                BLOCK_N2=n2, bwd_schedule=schedule, fwd_warps=4, fwd_stages=2,
                                                bwd_warps=4, bwd_stages=2))
    qkv, dout = make_inputs(B, T, NH, hs, dtype, device, seed=6)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    check_backward(run_backward(dout, qkv, out, lse, NH), dqkv_ref, dtype)


def test_config_validation(monkeypatch):
    fa.flash_config(64, torch.bfloat16)
    for bad in (dict(BLOCK_N=24), dict(BLOCK_M=8), dict(BLOCK_N2=48)):  # tl.arange / tl.dot cannot take these
        monkeypatch.setitem(FLASH_CONFIGS, 64, bad)
        with pytest.raises(AssertionError, match="power of two"):
            fa.flash_config(64, torch.bfloat16)
    monkeypatch.setitem(FLASH_CONFIGS, 64, dict(BLOCK_N1=32, BLOCK_M2=64, BLOCK_M1=16, BLOCK_N2=16,
                                                bwd_schedule="fused"))
    with pytest.raises(AssertionError):
        fa.flash_config(64, torch.bfloat16)
    monkeypatch.setitem(FLASH_CONFIGS, 64, dict(bwd_schedule="atomic"))
    with pytest.raises(AssertionError, match="bwd_schedule"):
        fa.flash_config(64, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# GPU, GPT-2 shapes

@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B%dT%dNH%dhs%d" % s)
def test_gpu_gpt2_shapes_bf16(shape):
    B, T, NH, hs = shape
    dtype = torch.bfloat16
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=7)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    dqkv = run_backward(dout, qkv, out, lse, NH)
    check_backward(dqkv, dqkv_ref, dtype)
    out2, lse2 = run_forward(qkv, NH)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert torch.equal(dqkv, run_backward(dout, qkv, out, lse, NH))


# configurations checked at a GPT-2 shape with T = 1000 (not a multiple of any tile) and B = 3 (TMA reads
# rows past T from the next batch row), against the reference: FLASH_CONFIGS fields on top of the defaults
GPU_CONFIGS = {
    "fused": dict(bwd_schedule="fused"),
    "split": dict(bwd_schedule="split"),
    "fused-bwd-tma": dict(bwd_schedule="fused", bwd_tma=True),
    "split-bwd-tma": dict(bwd_schedule="split", bwd_tma=True),
    # cuDNN's forward tiling (64 queries x 128 keys) and its mirror in the backward
    "fused-key-tiles-larger": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_M1=128, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=128,
                                   bwd_warps=8, bwd_schedule="fused"),
    "split-key-tiles-larger": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_M1=128, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=128,
                                   bwd_warps=8, bwd_schedule="split"),
    "fwd-pointer-64x64-w4": dict(fwd_tma=False, BLOCK_M=64, BLOCK_N=64, fwd_warps=4),
    "fwd-tma-128x64-w8": dict(fwd_tma=True, BLOCK_M=128, BLOCK_N=64, fwd_warps=8),
    "fwd-tma-128x128-w8": dict(fwd_tma=True, BLOCK_M=128, BLOCK_N=128, fwd_warps=8),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_configs_match_reference(monkeypatch, name):
    B, T, NH, hs, dtype = 3, 1000, 12, 64, torch.bfloat16
    monkeypatch.setitem(FLASH_CONFIGS, hs, GPU_CONFIGS[name])
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=9)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    check_backward(run_backward(dout, qkv, out, lse, NH), dqkv_ref, dtype)


@pytest.mark.gpu
def test_gpu_fp32():
    B, T, NH, hs, dtype = 2, 1024, 12, 64, torch.float32
    qkv, dout = make_inputs(B, T, NH, hs, dtype, "cuda", seed=8)
    out_ref, lse_ref, dqkv_ref = reference(qkv, dout, NH)
    out, lse = run_forward(qkv, NH)
    check_forward(out, lse, out_ref, lse_ref, dtype)
    check_backward(run_backward(dout, qkv, out, lse, NH), dqkv_ref, dtype)
