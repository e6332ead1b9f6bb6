"""GELU kernels against reference.gelu_forward / gelu_backward: odd sizes, large |x|, both dtypes,
NaN-poisoned outputs, bitwise determinism; GPT-2 124M shapes on the GPU."""
import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.gelu import gelu_backward_inplace, gelu_forward

# ||out - ref|| / ||ref||; bf16 is compared against the fp32 reference of the bf16-rounded inputs
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out, expected):
    out, expected = out.double(), expected.to(out.device).double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def rand(shape, gen, scale=3.0):
    return torch.randn(shape, generator=gen) * scale


def run_forward(x, device, dtype, **kw):
    xd = x.to(device=device, dtype=dtype)
    out = torch.full_like(xd, float("nan"))
    gelu_forward(out, xd, **kw)
    return out, ref.gelu_forward(xd.float())


def run_backward(x, d, device, dtype, **kw):
    xd, dd = x.to(device=device, dtype=dtype), d.to(device=device, dtype=dtype)
    expected = ref.gelu_backward(xd.float(), dd.float())
    gelu_backward_inplace(dd, xd, **kw)
    return dd, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((1,), None), ((37,), None), ((3, 5, 96), None), ((2, 7, 40), 64),
                                         ((1001,), 128), ((4099,), None)])
def test_gelu_forward(device, dtype, shape, block):
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    kw = {} if block is None else {"block": block}
    out, expected = run_forward(rand(shape, gen), device, dtype, **kw)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    assert rel_err(out.float(), expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((1,), None), ((37,), None), ((3, 5, 96), None), ((2, 7, 40), 64),
                                         ((1001,), 128), ((4099,), None)])
def test_gelu_backward_inplace(device, dtype, shape, block):
    gen = torch.Generator().manual_seed(1 + hash(shape) % 1000)
    kw = {} if block is None else {"block": block}
    x, d = rand(shape, gen), rand(shape, gen, 1.0)
    out, expected = run_backward(x, d, device, dtype, **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_large_inputs_do_not_overflow(device, dtype):
    """|x| up to 1e4: tanh saturates to +-1 without inf/inf or inf - inf; gelu -> x or 0, gelu' -> 1 or 0."""
    big = torch.tensor([30.0, -30.0, 50.0, -50.0, 88.0, -88.0, 100.0, -100.0, 1e3, -1e3, 1e4, -1e4, 5.0, -5.0])
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([big, big * (1 + torch.rand(big.shape, generator=gen))])
    out, expected = run_forward(x, device, dtype)
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), expected) < TOL[dtype]
    pos, neg = x > 20, x < -20
    assert torch.equal(out.float()[pos.to(out.device)], x.to(dtype).float()[pos].to(out.device))
    assert (out.float()[neg.to(out.device)].abs() < 1e-30).all()
    d = torch.randn(x.shape, generator=gen)
    dout, expected = run_backward(x, d, device, dtype)
    assert torch.isfinite(dout).all()
    assert rel_err(dout.float(), expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_deterministic(device, dtype):
    gen = torch.Generator().manual_seed(3)
    x, d = rand((5, 333), gen), rand((5, 333), gen, 1.0)
    a, _ = run_forward(x, device, dtype)
    b, _ = run_forward(x, device, dtype)
    assert torch.equal(a, b)
    da, _ = run_backward(x, d, device, dtype)
    db, _ = run_backward(x, d, device, dtype)
    assert torch.equal(da, db)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 16, 64])
def test_gelu_gpt2_shapes_gpu(B):
    T, C = 1024, 768
    gen = torch.Generator(device="cuda").manual_seed(B)
    x = torch.randn(B, T, 4 * C, device="cuda", generator=gen) * 3
    d = torch.randn(B, T, 4 * C, device="cuda", generator=gen)
    out, expected = run_forward(x, "cuda", torch.bfloat16)
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), expected) < TOL[torch.bfloat16]
    out2, _ = run_forward(x, "cuda", torch.bfloat16)
    assert torch.equal(out, out2)
    dout, expected = run_backward(x, d, "cuda", torch.bfloat16)
    assert torch.isfinite(dout).all()
    assert rel_err(dout.float(), expected) < TOL[torch.bfloat16]
