"""Linear layers (kernels/matmul.py) against reference.matmul_forward / matmul_backward / gelu_forward /
gelu_backward: the cuBLAS paths, the Triton GEMM with its GELU_AUX and DGELU epilogues (pointer and TMA
kernels), with and without the epilogues, the deterministic bias-gradient reduction (with and without the
fused dgelu), accumulate semantics, poisoned outputs, out-of-bounds writes, determinism and stochastic
rounding.

CPU: small and odd shapes through Triton's interpreter (also run on the GPU with device=cuda).
GPU (marker gpu): GPT-2 124M shapes in bf16 against the fp32 reference computed on the GPU.
"""
import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels import matmul as mm
from llmpy.kernels.common import tma_usable

# ||out - ref|| / ||ref||. fp32: reference in float64; bf16: reference in fp32 on the bf16-rounded inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
# (M, C, OC): tiny, odd everything (K not a multiple of the K tile, partial tiles), several tiles
SHAPES = [(6, 16, 48), (35, 24, 40), (64, 64, 256)]
GUARD = 37  # sentinel elements after an output: writes past its end show up there


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 checks need true fp32 GEMMs in torch too, whatever another module set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def rel_err(out, expected):
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def bf16_ulp(exact):
    """The spacing of bf16 values at each element's magnitude: a stochastically rounded result lies within it."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(exact.abs()))


def check(out, expected, dtype, what=""):
    assert torch.isfinite(out).all(), f"{what}: non-finite (unwritten?) elements"
    err = rel_err(out, expected)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]:.0e}"


class Rand:
    """Fresh random tensors (seeded per test for reproducibility), made on the CPU, moved to the device."""

    def __init__(self, device, dtype, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype

    def __call__(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.g) * scale).to(self.device, self.dtype)


def ref_dtype(dtype):
    return torch.float64 if dtype == torch.float32 else torch.float32


def up(t, dtype):
    """The reference's copy of a kernel input: exact values, in the reference precision."""
    return None if t is None else t.to(ref_dtype(dtype))


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def guarded(shape, dtype, device, fill=float("nan")):
    """(view, buffer): a contiguous view of the front of a buffer whose last GUARD elements hold a sentinel."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + GUARD,), fill, dtype=dtype, device=device)
    buf[n:] = 12345.0
    return buf[:n].view(*shape), buf


def assert_guard_intact(buf):
    assert (buf[-GUARD:] == 12345.0).all(), "written past the end of the output"


def linear_inputs(rand, M, C, OC, bias=True, lead=()):
    """inp, weight, bias scaled so that pre-activations are O(1): GELU sees both of its regimes."""
    inp = rand(*lead, M, C) if lead else rand(M, C)
    weight = rand(OC, C, scale=C ** -0.5)
    return inp, weight, (rand(OC, scale=0.5) if bias else None)


# ----------------------------------------------------------------------------------------------------
# forward

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_forward(device, dtype, shape, has_bias):
    M, C, OC = shape
    inp, weight, bias = linear_inputs(Rand(device, dtype), M, C, OC, has_bias)
    out = poisoned((M, OC), dtype, device)
    mm.matmul_forward(out, inp, weight, bias)
    check(out, ref.matmul_forward(up(inp, dtype), up(weight, dtype), up(bias, dtype)), dtype, "out")


def test_matmul_forward_keeps_leading_dims(device):
    """(B, T, C) in, (B, T, OC) out, as the model calls it."""
    dtype = torch.float32
    inp, weight, bias = linear_inputs(Rand(device, dtype, 1), 5, 16, 24, lead=(3,))
    out = poisoned((3, 5, 24), dtype, device)
    mm.matmul_forward(out, inp, weight, bias)
    check(out, ref.matmul_forward(up(inp, dtype), up(weight, dtype), up(bias, dtype)), dtype, "out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_matmul_forward_residual(device, dtype, has_bias, in_place):
    """out = residual + inp @ W.T + b (torch's path; cuBLASLt's epilogue: tests/test_cublaslt.py)."""
    M, C, OC = 13, 24, 40
    rand = Rand(device, dtype, 3)
    inp, weight, bias = linear_inputs(rand, M, C, OC, has_bias, lead=(2,))
    residual = rand(2, M, OC, scale=3.0)
    expected = up(residual, dtype) + ref.matmul_forward(up(inp, dtype), up(weight, dtype), up(bias, dtype))
    if in_place:
        out, buf = residual.clone(), None
        mm.matmul_forward(out, inp, weight, bias, residual=out)
    else:
        out, buf = guarded((2, M, OC), dtype, device)
        mm.matmul_forward(out, inp, weight, bias, residual=residual)
        assert_guard_intact(buf)
    check(out, expected, dtype, "out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gelu_epilogue", [False, True], ids=["gelu_pass", "gelu_epilogue"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_forward_gelu(device, dtype, shape, gelu_epilogue, has_bias):
    """pre_gelu = inp @ W.T + b and out = gelu(pre_gelu), both written, with and without the epilogue."""
    M, C, OC = shape
    inp, weight, bias = linear_inputs(Rand(device, dtype, 2), M, C, OC, has_bias)
    out, out_buf = guarded((M, OC), dtype, device)
    pre, pre_buf = guarded((M, OC), dtype, device)
    mm.matmul_forward(out, inp, weight, bias, pre_gelu=pre, gelu_epilogue=gelu_epilogue)
    expected_pre = ref.matmul_forward(up(inp, dtype), up(weight, dtype), up(bias, dtype))
    check(pre, expected_pre, dtype, "pre_gelu")
    check(out, ref.gelu_forward(expected_pre), dtype, "out")
    # out is the gelu of pre_gelu as stored (what the backward sees), up to out's own rounding
    check(out, ref.gelu_forward(up(pre, dtype)), dtype, "out vs gelu(stored pre_gelu)")
    assert_guard_intact(out_buf)
    assert_guard_intact(pre_buf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_epilogue_agrees_with_gelu_pass(device, dtype):
    """cuBLAS + the gelu kernel and the Triton GEMM with the GELU epilogue agree to rounding."""
    M, C, OC = 35, 24, 40
    inp, weight, bias = linear_inputs(Rand(device, dtype, 3), M, C, OC)
    outs = []
    for epilogue in (False, True):
        out, pre = poisoned((M, OC), dtype, device), poisoned((M, OC), dtype, device)
        mm.matmul_forward(out, inp, weight, bias, pre_gelu=pre, gelu_epilogue=epilogue)
        outs.append((out, pre))
    check(outs[1][0], outs[0][0], dtype, "out, epilogue vs pass")
    check(outs[1][1], outs[0][1], dtype, "pre_gelu, epilogue vs pass")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(35, 24, 40), (70, 48, 72)])
def test_triton_matmul_plain_and_edges(device, dtype, shape):
    """The Triton GEMM without epilogue, b as a transposed view (forward) and as a plain matrix (backward);
    partial tiles in M and N, a masked K tail, no write past the output."""
    M, K, N = shape
    rand = Rand(device, dtype, 4)
    a, w_nk, w_kn, bias = rand(M, K), rand(N, K), rand(K, N), rand(N)
    for b, with_bias in ((w_nk.t(), True), (w_kn, False)):
        c, buf = guarded((M, N), dtype, device)
        mm.triton_matmul(c, a, b, bias if with_bias else None)
        expected = up(a, dtype) @ up(b, dtype) + (up(bias, dtype) if with_bias else 0.0)
        check(c, expected, dtype, f"c (bias={with_bias})")
        assert_guard_intact(buf)


def _tma_config(device, subtile):
    """The persistent TMA kernel's knobs around the pointer kernel's tiles (interpreter-sized on the CPU)."""
    base = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1) if device == "cpu" \
        else dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=3)
    return dict(base, TMA=True, PROGRAMS_PER_SM=1, SUBTILE=subtile, FLATTEN=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40, 24, 48), (33, 16, 72), (130, 40, 96)])
@pytest.mark.parametrize("epilogue", [mm.EPILOGUE_NONE, mm.EPILOGUE_GELU_AUX, mm.EPILOGUE_DGELU],
                         ids=["none", "gelu_aux", "dgelu"])
@pytest.mark.parametrize("subtile", [False, True], ids=["whole", "subtile"])
def test_triton_matmul_tma_equals_pointer_kernel(device, dtype, shape, epilogue, subtile):
    """The persistent TMA kernel (tensor descriptors, edge tiles clipped by TMA rather than masked) gives
    the pointer kernel's bits: same tiles, same K order, same epilogue arithmetic; for both weight layouts,
    partial tiles in M and N and a K tail; pre_gelu (aux) too; nothing written past the outputs. And each
    epilogue's outputs against float64 on their own (a fault the two kernels shared would pass the bitwise
    comparison)."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90")
    M, K, N = shape
    rand = Rand(device, dtype, 9)
    a, w_nk, w_kn, bias = rand(M, K), rand(N, K, scale=K ** -0.5), rand(K, N, scale=K ** -0.5), rand(N, scale=0.5)
    tma = _tma_config(device, subtile)
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    plain = {k: v for k, v in tma.items() if k in tiles}
    aux_in = rand(M, N)
    for b in (w_nk.t(), w_kn):
        assert tma_usable(a, b), "the test shapes are meant for the TMA path"
        outs = []
        for cfg in (plain, tma):
            c, buf = guarded((M, N), dtype, device)
            aux = aux_in.clone() if epilogue == mm.EPILOGUE_DGELU else (
                poisoned((M, N), dtype, device) if epilogue == mm.EPILOGUE_GELU_AUX else None)
            mm.triton_matmul(c, a, b, None if epilogue == mm.EPILOGUE_DGELU else bias, aux=aux, epilogue=epilogue,
                             config=cfg)
            assert_guard_intact(buf)
            outs.append((c, aux))
        assert torch.isfinite(outs[1][0]).all()
        assert torch.equal(outs[0][0], outs[1][0]), "TMA kernel output differs from the pointer kernel's"
        if epilogue == mm.EPILOGUE_GELU_AUX:
            assert torch.equal(outs[0][1], outs[1][1]), "TMA kernel pre_gelu differs"
        c, aux = outs[1]
        product = a.double() @ b.double()
        if epilogue == mm.EPILOGUE_NONE:
            check(c, product + bias.double(), dtype, "c")
        elif epilogue == mm.EPILOGUE_GELU_AUX:
            check(aux, product + bias.double(), dtype, "pre_gelu")
            check(c, ref.gelu_forward(product + bias.double()), dtype, "gelu(pre_gelu)")
        else:
            check(c, ref.gelu_backward(aux_in.double(), product), dtype, "dgelu")


def test_triton_matmul_tma_falls_back_on_unaligned_rows(device):
    """Rows whose byte stride is not a multiple of 16 cannot be TMA-addressed: the pointer kernel runs."""
    dtype = torch.bfloat16
    M, K, N = 20, 24, 36  # 36 bf16 = 72 bytes a row
    rand = Rand(device, dtype, 10)
    a, w = rand(M, K), rand(N, K)
    c = poisoned((M, N), dtype, device)
    assert not tma_usable(a, w.t(), c)
    mm.triton_matmul(c, a, w.t(), config=_tma_config(device, True))
    check(c, up(a, dtype) @ up(w.t(), dtype), dtype, "c")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp -> inf, by design
def test_gelu_extremes(device):
    """Large |x|: gelu -> x and 0, gelu' -> 1 and 0, no inf/nan from the exp; matches the tanh reference."""
    dtype = torch.float32
    x = torch.tensor([-60.0, -20.0, -8.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 8.0, 20.0, 60.0, 0.5, -0.5, 1.7, -1.7, 4.0],
                     device=device)
    M, K = 1, x.numel()
    # a GEMM that passes x through unchanged: a = x as a row, b = identity
    a = x.view(1, K).contiguous()
    eye = torch.eye(K, device=device, dtype=dtype)
    out, pre = poisoned((M, K), dtype, device), poisoned((M, K), dtype, device)
    mm.triton_matmul(out, a, eye, aux=pre, epilogue=mm.EPILOGUE_GELU_AUX)
    assert torch.equal(pre[0], x)
    check(out[0], ref.gelu_forward(x.double()), dtype, "gelu")
    dgrad = poisoned((M, K), dtype, device)
    mm.triton_matmul(dgrad, torch.ones(1, K, device=device), eye, aux=pre, epilogue=mm.EPILOGUE_DGELU)
    check(dgrad[0], ref.gelu_backward(x.double(), torch.ones_like(x.double())), dtype, "gelu'")


# ----------------------------------------------------------------------------------------------------
# backward

def backward_case(device, dtype, M, C, OC, seed):
    rand = Rand(device, dtype, seed)
    inp, weight, _ = linear_inputs(rand, M, C, OC, bias=False)
    dout = rand(M, OC)
    dweight0, dbias0 = rand(OC, C), rand(OC)  # pre-filled: the backward accumulates into them
    return inp, weight, dout, dweight0, dbias0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_backward(device, dtype, shape, has_bias):
    """dinp overwritten, dweight and dbias accumulated."""
    M, C, OC = shape
    inp, weight, dout, dweight0, dbias0 = backward_case(device, dtype, M, C, OC, 5)
    dinp = poisoned((M, C), dtype, device)
    dweight = dweight0.clone()
    dbias = dbias0.clone() if has_bias else None
    mm.matmul_backward(dinp, dweight, dbias, dout, inp, weight)
    e_dinp, e_dweight, e_dbias = ref.matmul_backward(up(dout, dtype), up(inp, dtype), up(weight, dtype), has_bias)
    check(dinp, e_dinp, dtype, "dinp")
    check(dweight, up(dweight0, dtype) + e_dweight, dtype, "dweight")
    if has_bias:
        check(dbias, up(dbias0, dtype) + e_dbias, dtype, "dbias")


def test_matmul_backward_leading_dims_and_repeat(device):
    """(B, T, .) tensors; two backward calls accumulate twice into dweight/dbias, dinp is overwritten."""
    dtype = torch.float32
    B, T, C, OC = 3, 5, 16, 24
    rand = Rand(device, dtype, 6)
    inp, weight, _ = linear_inputs(rand, T, C, OC, bias=False, lead=(B,))
    dout = rand(B, T, OC)
    dweight0, dbias0 = rand(OC, C), rand(OC)
    dinp, dweight, dbias = rand(B, T, C), dweight0.clone(), dbias0.clone()
    for _ in range(2):
        mm.matmul_backward(dinp, dweight, dbias, dout, inp, weight)
    e_dinp, e_dweight, e_dbias = ref.matmul_backward(up(dout, dtype), up(inp, dtype), up(weight, dtype))
    check(dinp, e_dinp, dtype, "dinp")
    check(dweight, up(dweight0, dtype) + 2 * e_dweight, dtype, "dweight")
    check(dbias, up(dbias0, dtype) + 2 * e_dbias, dtype, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dgelu_epilogue", [False, True], ids=["dgelu_pass", "dgelu_epilogue"])
def test_matmul_backward_gelu(device, dtype, shape, dgelu_epilogue):
    """fcproj: the input was gelu(pre_gelu), dinp becomes the gradient w.r.t. pre_gelu, by the gelu pass
    after cuBLAS or in the Triton GEMM's epilogue."""
    M, C, OC = shape
    inp, weight, dout, dweight0, dbias0 = backward_case(device, dtype, M, C, OC, 7)
    pre = Rand(device, dtype, 8)(M, C, scale=2.0)
    dinp, dinp_buf = guarded((M, C), dtype, device)
    dweight, dbias = dweight0.clone(), dbias0.clone()
    mm.matmul_backward(dinp, dweight, dbias, dout, inp, weight, pre_gelu=pre, dgelu_epilogue=dgelu_epilogue)
    e_dinp, e_dweight, e_dbias = ref.matmul_backward(up(dout, dtype), up(inp, dtype), up(weight, dtype))
    check(dinp, ref.gelu_backward(up(pre, dtype), e_dinp), dtype, "dinp")
    check(dweight, up(dweight0, dtype) + e_dweight, dtype, "dweight")
    check(dbias, up(dbias0, dtype) + e_dbias, dtype, "dbias")
    assert_guard_intact(dinp_buf)


# ----------------------------------------------------------------------------------------------------
# bias gradient reduction

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, OC", [(1, 48), (35, 40), (200, 72)])
@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_matmul_backward_bias(device, dtype, M, OC, num_chunks):
    """One chunk (direct), several chunks (scratch + fixed-order finish), the default plan; partial row
    tiles and column blocks; no write past dbias; bitwise the same on a second run."""
    rand = Rand(device, dtype, 9)
    dout, dbias0 = rand(M, OC), rand(OC)
    results = []
    for _ in range(2):
        dbias, buf = guarded((OC,), dtype, device)
        dbias.copy_(dbias0)
        mm.matmul_backward_bias(dbias, dout, num_chunks=num_chunks)
        assert_guard_intact(buf)
        results.append(dbias)
    check(results[0], up(dbias0, dtype) + up(dout, dtype).sum(0), dtype, "dbias")
    assert torch.equal(results[0], results[1]), "bias reduction is not deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_backward_bias_more_chunks_than_a_finish_step(device, dtype):
    """More chunks than the finish kernel adds a step (FINISH_BLOCK_CHUNKS): its loop over blocks of chunks
    runs three times, the last block partial, as does the last chunk's row tile; against float64 (bf16:
    rounded stochastically, with a seed); no write past dbias; bitwise the same on a second run."""
    want = 2 * mm.FINISH_BLOCK_CHUNKS + 1
    M, OC = want * mm.BIAS_BLOCK_M - 9, 40
    assert mm._chunking(M, want, mm.BIAS_BLOCK_M)[0] == want
    rand = Rand(device, dtype, 28)
    dout, dbias0 = rand(M, OC), rand(OC)
    seed = torch.tensor([555], device=device) if dtype == torch.bfloat16 else None
    results = []
    for _ in range(2):
        dbias, buf = guarded((OC,), dtype, device)
        dbias.copy_(dbias0)
        mm.matmul_backward_bias(dbias, dout, seed=seed, num_chunks=want)
        assert_guard_intact(buf)
        results.append(dbias)
    check(results[0], dbias0.double() + dout.double().sum(0), dtype, "dbias")
    assert torch.equal(results[0], results[1]), "bias reduction is not deterministic"


@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_bias_gradients_of_no_rows(device, num_chunks):
    """An empty gradient (no rows: B*T = 0) adds nothing: dbias and dweight keep their values, for the plain
    reduction, the fused dGELU one and matmul_backward (no division by zero in the chunk plan)."""
    dtype = torch.float32
    OC, C = 40, 24
    rand = Rand(device, dtype, 26)
    dbias0, dweight0, weight = rand(OC), rand(OC, C), rand(OC, C)
    dbias = dbias0.clone()
    mm.matmul_backward_bias(dbias, torch.empty(0, OC, device=device), num_chunks=num_chunks)
    assert torch.equal(dbias, dbias0)
    dbias = dbias0.clone()
    mm.bias_gelu_backward(dbias, None, torch.empty(2, 0, OC, device=device), torch.empty(2, 0, OC, device=device),
                          num_chunks=num_chunks)
    assert torch.equal(dbias, dbias0)
    dbias, dweight = dbias0.clone(), dweight0.clone()
    dinp = torch.empty(0, C, device=device)
    mm.matmul_backward(dinp, dweight, dbias, torch.empty(0, OC, device=device), torch.empty(0, C, device=device),
                       weight)
    assert torch.equal(dbias, dbias0) and torch.equal(dweight, dweight0)


def test_bias_scratch_too_small_uses_fewer_chunks(device):
    dtype = torch.float32
    M, OC = 200, 40
    rand = Rand(device, dtype, 10)
    dout, dbias0 = rand(M, OC), rand(OC)
    plan_chunks, _ = mm._chunking(M, 6, mm.BIAS_BLOCK_M)
    assert plan_chunks > 2
    scratch = torch.full((2 * OC,), float("nan"), device=device)  # room for two chunks only
    dbias = dbias0.clone()
    mm.matmul_backward_bias(dbias, dout, scratch=scratch, num_chunks=6)
    check(dbias, up(dbias0, dtype) + up(dout, dtype).sum(0), dtype, "dbias")
    assert torch.isfinite(scratch).all(), "two chunks should fill the scratch exactly"


@pytest.mark.parametrize("gelu", [False, True], ids=["plain", "gelu"])
def test_bias_scratch_numel_is_enough(device, gelu):
    """The plan covers every row once, and the scratch it asks for holds its chunks (plain reduction and
    bias_gelu_backward's, which have tiles of their own)."""
    M, OC = 200, 72
    n = mm.bias_scratch_numel(M, OC, device, gelu=gelu)
    chunks, rows = mm.bias_backward_chunks(M, OC, device, gelu=gelu)
    assert chunks * rows >= M > (chunks - 1) * rows
    assert n == (chunks * OC if chunks > 1 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N", [(35, 40), (64, 256)])
@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_bias_gelu_backward(device, dtype, M, N, num_chunks):
    """d *= gelu'(pre) in place and dbias += column sums of the result, in one pass."""
    rand = Rand(device, dtype, 11)
    d0, pre, dbias0 = rand(M, N), rand(M, N, scale=2.0), rand(N)
    results = []
    for _ in range(2):
        d, d_buf = guarded((M, N), dtype, device)
        d.copy_(d0)
        dbias = dbias0.clone()
        mm.bias_gelu_backward(dbias, None, d, pre, num_chunks=num_chunks)
        assert_guard_intact(d_buf)
        results.append((d, dbias))
    e_d = ref.gelu_backward(up(pre, dtype), up(d0, dtype))
    check(results[0][0], e_d, dtype, "d_in_out")
    check(results[0][1], up(dbias0, dtype) + e_d.sum(0), dtype, "dbias")
    # dbias is the column sum of d as stored, the tensor the dweight GEMM then reads
    check(results[0][1], up(dbias0, dtype) + up(results[0][0], dtype).sum(0), dtype, "dbias vs stored d")
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_bias_gelu_backward_stochastic_rounding(device, num_chunks):
    """The model's default bf16 path (-ge 0, a seed): the fused dgelu with bf16 dbias rounded stochastically,
    by the first level itself (one chunk) or by the finish (several). d_in_out is rounded to nearest,
    whatever the seed, against float64; dbias lands on one of the two bf16 neighbours of dbias0 + the column
    sums of d as stored (float64), the seed changes the pick, the same seed repeats it; and the rounding is
    unbiased where round-to-nearest is not."""
    dtype = torch.bfloat16
    M, N = 35, 72  # a partial row tile and a partial column block
    rand = Rand(device, dtype, 27)
    d0, pre, dbias0 = rand(M, N), rand(M, N, scale=2.0), rand(N, scale=20.0)
    e_d = ref.gelu_backward(pre.double(), d0.double())
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    outs = []
    for s in range(4):
        seed.fill_(2000 + 31 * s)
        d, d_buf = guarded((M, N), dtype, device)
        d.copy_(d0)
        dbias, b_buf = guarded((N,), dtype, device)
        dbias.copy_(dbias0)
        mm.bias_gelu_backward(dbias, None, d, pre, seed=seed, num_chunks=num_chunks)
        assert_guard_intact(d_buf)
        assert_guard_intact(b_buf)
        check(d, e_d, dtype, "d_in_out")
        check(dbias, dbias0.double() + e_d.sum(0), dtype, "dbias")
        exact = dbias0.double() + d.double().sum(0)
        ulp = bf16_ulp(exact)
        # (+ 1e-5: the fp32 sum's own error, where exact is small)
        assert ((dbias.double() - exact).abs() <= ulp * 1.001 + 1e-5).all(), "not one of the two bf16 neighbours"
        outs.append((d, dbias))
    assert all(torch.equal(outs[0][0], o[0]) for o in outs[1:]), "d_in_out depends on the seed"
    assert not all(torch.equal(outs[0][1], o[1]) for o in outs[1:]), "the seed changes nothing"
    seed.fill_(2000)
    d, again = d0.clone(), dbias0.clone()
    mm.bias_gelu_backward(again, None, d, pre, seed=seed, num_chunks=num_chunks)
    assert torch.equal(again, outs[0][1]), "same seed, different rounding"

    # unbiased: where pre = 8, gelu' is exactly 1 in fp32 and d (2^-13) passes unchanged; where pre = -8 it is
    # exactly 0, and the random d there adds nothing. Every column sums to 24 * 2^-13 = 3/1024 exactly (in
    # any order), 3/8 of a bf16 ulp above dbias = 1: round-to-nearest gives 1 everywhere, stochastic rounding
    # 1 + 1/128 for ~3/8 of the columns
    M, N = 32, 1024
    live = (torch.arange(M) % 4 != 3)[:, None].to(device)
    d0 = torch.where(live, torch.full((M, N), 2.0 ** -13, device=device), rand(M, N).float()).to(dtype)
    pre = torch.where(live, 8.0, -8.0).expand(M, N).to(dtype).contiguous()
    for s in range(2):
        seed.fill_(77 + s)
        d, d_buf = guarded((M, N), dtype, device)
        d.copy_(d0)
        dbias = torch.ones(N, dtype=dtype, device=device)
        mm.bias_gelu_backward(dbias, None, d, pre, seed=seed, num_chunks=num_chunks)
        assert_guard_intact(d_buf)
        assert torch.equal(d, torch.where(live, d0, 0.0).to(dtype)), "gelu'(8) = 1, gelu'(-8) = 0"
        values = set(dbias.double().unique().tolist())
        assert values <= {1.0, 1.0 + 2.0 ** -7}, values
        up_fraction = float((dbias.double() > 1.0).double().mean())
        assert abs(up_fraction - 3 / 8) < 0.06, f"rounded up {up_fraction:.3f} of the time, expected 0.375"


def test_fc_backward_with_fused_bias_gelu(device):
    """The model's fc/fcproj pattern: fcproj backward without pre_gelu, bias_gelu_backward for fc's dbias,
    fc backward with dbias=None, equals the unfused chain."""
    dtype = torch.bfloat16
    M, C = 35, 16
    rand = Rand(device, dtype, 12)
    ln, w_fc, b_fc = linear_inputs(rand, M, C, 4 * C)
    w_proj = rand(C, 4 * C, scale=(4 * C) ** -0.5)
    pre = rand(M, 4 * C, scale=2.0)
    dres = rand(M, C)
    dw_fc, db_fc, dw_proj, db_proj = rand(4 * C, C), rand(4 * C), rand(C, 4 * C), rand(C)

    d_act = poisoned((M, 4 * C), dtype, device)
    dw_proj_k, db_proj_k, dw_fc_k, db_fc_k = dw_proj.clone(), db_proj.clone(), dw_fc.clone(), db_fc.clone()
    act = rand(M, 4 * C)  # stands for gelu(pre): the fcproj input (only its dweight reads it)
    mm.matmul_backward(d_act, dw_proj_k, db_proj_k, dres, act, w_proj)
    mm.bias_gelu_backward(db_fc_k, None, d_act, pre)
    dln = poisoned((M, C), dtype, device)
    mm.matmul_backward(dln, dw_fc_k, None, d_act, ln, w_fc)

    f = torch.float32
    e_dact = ref.gelu_backward(pre.to(f), dres.to(f) @ w_proj.to(f))
    e_dln, e_dwfc, e_dbfc = ref.matmul_backward(e_dact, ln.to(f), w_fc.to(f))
    check(d_act, e_dact, dtype, "d pre_gelu")
    check(db_fc_k, db_fc.to(f) + e_dbfc, dtype, "fc dbias")
    check(dw_fc_k, dw_fc.to(f) + e_dwfc, dtype, "fc dweight")
    check(dln, e_dln, dtype, "dln")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("OC, C", [(48, 48), (70, 50), (130, 64), (300, 40)])
def test_bias_through_weight(device, dtype, OC, C):
    """dbias += grad_sum @ weight, the sum over OC in a fixed order; partial blocks both ways (OC = 300: two
    steps of THROUGH_BLOCK_K rows, the second partial); nothing written past dbias; bf16 within a bf16 ulp
    (stochastic) of the exact sum; bitwise repeatable."""
    rand = Rand(device, dtype, 21)
    weight, dbias0 = rand(OC, C, scale=C ** -0.5), rand(C)
    grad_sum = rand(OC).float() * 30.0  # fp32: a column sum over many rows
    seed = torch.tensor([4321], device=device) if dtype == torch.bfloat16 else None
    results = []
    for _ in range(2):
        dbias, buf = guarded((C,), dtype, device)
        dbias.copy_(dbias0)
        mm.bias_through_weight(dbias, grad_sum, weight, seed)
        assert_guard_intact(buf)
        results.append(dbias)
    exact = dbias0.double() + grad_sum.double() @ weight.double()
    if dtype == torch.float32:
        check(results[0], exact, dtype, "dbias")
    else:
        ulp = bf16_ulp(exact)
        assert ((results[0].double() - exact).abs() <= ulp * 1.01).all()
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, C, OC, pad", [(37, 24, 40, 8), (64, 48, 70, 1), (130, 40, 33, 16), (5, 520, 20, 3)])
def test_weight_grad_bias_column(device, dtype, M, C, OC, pad):
    """One product gives the weight gradient and, from the input's column of ones, the bias gradient:
    both accumulated into random values, against float64; the input's padding is what the LayerNorm
    forward's bias_column writes; bitwise repeatable; nothing written past either output. C = 520: the
    finish kernel's loop over column blocks of WIDE_FINISH_BLOCK_C takes three steps, the last partial."""
    rand = Rand(device, dtype, 23)
    dout = rand(2, M, OC)
    wide = torch.cat([rand(2, M, C), torch.ones(2, M, 1, dtype=dtype, device=device),
                      torch.zeros(2, M, pad - 1, dtype=dtype, device=device)], dim=-1)
    dweight0, dbias0 = rand(OC, C), rand(OC)
    seed = torch.tensor([777], device=device) if dtype == torch.bfloat16 else None
    results = []
    for _ in range(2):
        dweight, wbuf = guarded((OC, C), dtype, device)
        dbias, bbuf = guarded((OC,), dtype, device)
        dweight.copy_(dweight0)
        dbias.copy_(dbias0)
        scratch = poisoned((OC * (C + pad) + 5,), torch.float32, device)
        mm.weight_grad_bias_column(dweight, dbias, dout, wide, scratch, seed)
        assert_guard_intact(wbuf)
        assert_guard_intact(bbuf)
        results.append((dweight, dbias))
    d2, x2 = dout.reshape(-1, OC).double(), wide[..., :C].reshape(-1, C).double()
    check(results[0][0], dweight0.double() + d2.t() @ x2, dtype, "dweight")
    check(results[0][1], dbias0.double() + d2.sum(0), dtype, "dbias")
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_weight_grad_bias_column_tuned_product_through_cublaslt(device, monkeypatch):
    """With use_cublaslt and a "dweight_wide" entry in TUNED_ALGOS the wide product goes to cuBLASLt
    (overwriting its fp32 scratch, with the entry's algorithm); without either, torch's product serves."""
    calls = []

    def fake_weight_grad(dweight, dout, inp, accumulate=True, algo_index=0):
        calls.append((dweight.dtype, tuple(dweight.shape), accumulate, algo_index))
        dweight.copy_(dout.double().t() @ inp.double())

    monkeypatch.setattr(mm.cublaslt, "linear_weight_grad", fake_weight_grad)
    monkeypatch.setattr(mm, "_capability", lambda device: (9, 0))
    rand = Rand(device, torch.bfloat16, 5)
    M, C, OC, pad = 32, 16, 24, 8
    dout = rand(M, OC)
    wide_inp = torch.cat([rand(M, C), torch.ones(M, 1, dtype=torch.bfloat16, device=device),
                          torch.zeros(M, pad - 1, dtype=torch.bfloat16, device=device)], dim=-1)
    config = mm.cublaslt.AlgoConfig(66, tile=472, stages=35, splitk=3, reduction=2)
    monkeypatch.setitem(mm.TUNED_ALGOS, ("dweight_wide", M, OC, C + pad, (9, 0)), config)
    results = []
    for use in (True, False):
        dweight = torch.zeros(OC, C, dtype=torch.bfloat16, device=device)
        dbias = torch.zeros(OC, dtype=torch.bfloat16, device=device)
        scratch = poisoned((OC * (C + pad),), torch.float32, device)
        mm.weight_grad_bias_column(dweight, dbias, dout, wide_inp, scratch, use_cublaslt=use)
        results.append((dweight, dbias))
    assert calls == [(torch.float32, (OC, C + pad), False, config)], "cuBLASLt once, with the entry's algorithm"
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _attention_with_projection(device, dtype, B=2, T=7, NH=2, hs=8, seed=31):
    """A causal attention block with its output projection, in float64 for the identities: qkv, the
    projection's weight, the output gradient G of the projection; returns (qkv, W, G, dqkv, datt_out)
    with dqkv from reference.attention_backward of datt_out = G @ W."""
    C = NH * hs
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3 * C, generator=g, dtype=torch.float64)
    W = torch.randn(C, C, generator=g, dtype=torch.float64) * C ** -0.5
    G = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    _, _, att = ref.attention_forward(qkv, NH)
    datt_out = G @ W
    return qkv, W, G, ref.attention_backward(datt_out, qkv, att, NH), datt_out


def test_qkv_bias_identities_hold():
    """The math qkv_bias_backward rests on (float64): the key part of the QKV bias gradient sums to zero,
    and the value part equals the projection's bias gradient through its weight."""
    qkv, W, G, dqkv, datt_out = _attention_with_projection("cpu", torch.float64)
    C = W.shape[0]
    sums = dqkv.reshape(-1, 3 * C).sum(0)
    scale = dqkv.abs().max()
    assert sums[C:2 * C].abs().max() < 1e-12 * scale * dqkv.shape[0] * dqkv.shape[1]
    torch.testing.assert_close(sums[2 * C:], G.reshape(-1, C).sum(0) @ W, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sums[2 * C:], datt_out.reshape(-1, C).sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("through_projection", [True, False])
def test_qkv_bias_backward(device, dtype, through_projection):
    """Query part: dbias0 + the column sums of dq; key part: dbias0 unchanged, bit for bit (its gradient is
    exactly zero); value part: the column sums of dv, from the projection's bias gradient through its
    weight or from dv itself. Nothing written past dbias; repeatable bit for bit."""
    qkv, W, G, dqkv64, _ = _attention_with_projection(device, dtype)
    C = W.shape[0]
    rand = Rand(device, dtype, 22)
    dqkv = dqkv64.to(device, dtype)
    weight = W.to(device, dtype)
    dbias0 = rand(3 * C)
    # the projection's bias gradient as the LayerNorm backward hands it over: fp32 column sums of G
    proj_sum = G.reshape(-1, C).sum(0).to(device, torch.float32)
    extra = dict(proj_bias_grad=proj_sum, proj_weight=weight) if through_projection else {}
    seed = torch.tensor([99], device=device) if dtype == torch.bfloat16 else None
    results = []
    for _ in range(2):
        dbias, buf = guarded((3 * C,), dtype, device)
        dbias.copy_(dbias0)
        mm.qkv_bias_backward(dbias, dqkv, seed=seed, **extra)
        assert_guard_intact(buf)
        results.append(dbias)
    got = results[0]
    assert torch.equal(got[C:2 * C], dbias0[C:2 * C]), "the key bias's gradient must add exactly zero"
    sums = up(dqkv, dtype).double().reshape(-1, 3 * C).sum(0)
    check(got[:C], up(dbias0[:C], dtype) + sums[:C], dtype, "query part")
    if through_projection:  # the same value from the projection's side, in its own precision
        value = up(dbias0[2 * C:], dtype) + proj_sum.double() @ up(weight, dtype).double()
    else:
        value = up(dbias0[2 * C:], dtype) + sums[2 * C:]
    check(got[2 * C:], value, dtype, "value part")
    # and that is the exact value part (float64) within the storage's tolerance
    exact = dqkv64.reshape(-1, 3 * C).sum(0)[2 * C:].to(device)
    check(got[2 * C:], dbias0[2 * C:].double() + exact, dtype, "exact value part")
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, rows", [(130, 40, 64), (64, 72, 64), (35, 24, 16), (7, 8, 64)])
def test_column_sums_by_blocks(device, dtype, M, N, rows):
    """part[i] = the column sums of rows [rows * i, rows * (i + 1)) of a strided (M, N) view (a partial last
    block); fp32 sums of the stored values; nothing written past part."""
    d = Rand(device, dtype, 24)(M, N + 5)[:, 2:N + 2]  # a row stride wider than N
    blocks = -(-M // rows)
    part, buf = guarded((blocks, N), torch.float32, device)
    mm.column_sums_by_blocks(part, d, rows)
    assert_guard_intact(buf)
    exact = torch.cat([d.double(), d.new_zeros(-M % rows, N).double()]).view(blocks, rows, N).sum(1)
    assert torch.isfinite(part).all()
    torch.testing.assert_close(part.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_bias_backward_from_q_sums(device, dtype):
    """With the attention backward's block sums of dq (q_sums), the query part is dbias0 + their sum, and
    the key and value parts are as without them; repeatable bit for bit."""
    _, W, G, dqkv64, _ = _attention_with_projection(device, dtype)
    C = W.shape[0]
    dqkv = dqkv64.to(device, dtype)
    dbias0 = Rand(device, dtype, 25)(3 * C)
    proj_sum = G.reshape(-1, C).sum(0).to(device, torch.float32)
    extra = dict(proj_bias_grad=proj_sum, proj_weight=W.to(device, dtype))
    rows = dqkv.reshape(-1, 3 * C)
    q_sums = mm.column_sums_by_blocks(torch.empty(-(-rows.shape[0] // 8), C, device=device), rows[:, :C], 8)
    seed = torch.tensor([99], device=device) if dtype == torch.bfloat16 else None
    got = mm.qkv_bias_backward(dbias0.clone(), dqkv, seed=seed, q_sums=q_sums, **extra)
    assert torch.equal(got, mm.qkv_bias_backward(dbias0.clone(), dqkv, seed=seed, q_sums=q_sums, **extra))
    check(got[:C], up(dbias0[:C], dtype) + up(rows[:, :C], dtype).double().sum(0), dtype, "query part")
    without = mm.qkv_bias_backward(dbias0.clone(), dqkv, seed=seed, **extra)
    assert torch.equal(got[C:], without[C:])


def test_qkv_bias_backward_rejects_strided_q_sums(device):
    """q_sums and dbias are read and written as contiguous rows: strided ones are an error, not another sum."""
    C, blocks = 8, 5
    q_sums = torch.randn(C, blocks, device=device).t()  # (blocks, C), column-major
    dqkv = torch.randn(4, 3 * C, device=device)
    with pytest.raises(AssertionError):
        mm.qkv_bias_backward(torch.zeros(3 * C, device=device), dqkv, q_sums=q_sums)
    with pytest.raises(AssertionError):  # a strided dbias
        mm.qkv_bias_backward(torch.zeros(6 * C, device=device)[::2], dqkv, q_sums=q_sums.contiguous())


def test_qkv_bias_backward_full_pass(device, monkeypatch):
    """QKV_BIAS_FROM_IDENTITIES = False: llm.c's one reduction over all of dqkv (matmul_backward_bias)."""
    _, W, _, dqkv64, _ = _attention_with_projection(device, torch.float32)
    C = W.shape[0]
    dqkv = dqkv64.to(device, torch.float32)
    dbias0 = Rand(device, torch.float32, 23)(3 * C)
    monkeypatch.setattr(mm, "QKV_BIAS_FROM_IDENTITIES", False)
    got = mm.qkv_bias_backward(dbias0.clone(), dqkv)
    assert torch.equal(got, mm.matmul_backward_bias(dbias0.clone(), dqkv))


def test_dbias_stochastic_rounding(device):
    """With a seed tensor, bf16 dbias is rounded stochastically: each element lands on one of the two bf16
    neighbours of the fp32 result, the seed changes the pick, the same seed repeats it; and the rounding is
    unbiased where round-to-nearest is not (both the direct and the scratch + finish path)."""
    dtype = torch.bfloat16
    M, OC = 35, 40
    rand = Rand(device, dtype, 13)
    dout, dbias0 = rand(M, OC), rand(OC, scale=20.0)
    exact = up(dbias0, dtype).double() + up(dout, dtype).double().sum(0)
    ulp = bf16_ulp(exact)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    outs = []
    for s in range(6):
        seed.fill_(1000 + 17 * s)
        dbias = dbias0.clone()
        mm.matmul_backward_bias(dbias, dout, seed=seed, num_chunks=1 + s % 2)
        err = dbias.double() - exact
        assert (err.abs() <= ulp * 1.001).all(), "not one of the two bf16 neighbours"
        outs.append(dbias)
    assert not all(torch.equal(outs[0], o) for o in outs[1:]), "the seed changes nothing"
    seed.fill_(1000)
    again = dbias0.clone()
    mm.matmul_backward_bias(again, dout, seed=seed, num_chunks=1)
    assert torch.equal(again, outs[0]), "same seed, different rounding"

    # unbiased: every element is 1 + 3/1024 exactly (3/8 of a bf16 ulp above 1); round-to-nearest gives 1
    # everywhere (error -3/8 ulp), stochastic rounding gives 1 + 1/128 for ~3/8 of the elements
    OC, M = 1024, 17
    rows = torch.full((M, OC), 2.0 ** -13)  # 16 rows summing to 2/1024 (one chunk of 16 rows) ...
    rows[16] = 2.0 ** -10  # ... and 1/1024 in a second chunk
    dout = rows.to(device, dtype)
    for num_chunks in (1, 2):
        seed.fill_(77 + num_chunks)
        dbias = torch.ones(OC, dtype=dtype, device=device)
        mm.matmul_backward_bias(dbias, dout, seed=seed, num_chunks=num_chunks)
        values = set(dbias.double().unique().tolist())
        assert values <= {1.0, 1.0 + 2.0 ** -7}, values
        up_fraction = float((dbias.double() > 1.0).double().mean())
        assert abs(up_fraction - 3 / 8) < 0.06, f"rounded up {up_fraction:.3f} of the time, expected 0.375"


# ----------------------------------------------------------------------------------------------------
# determinism, argument checks

@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic(device, dtype):
    """Same inputs, bitwise the same outputs: GELU epilogue forward, backward with the dGELU pass and epilogue."""
    M, C, OC = 35, 24, 40
    inp, weight, dout, dweight0, dbias0 = backward_case(device, dtype, M, C, OC, 14)
    _, _, bias = linear_inputs(Rand(device, dtype, 15), M, C, OC)
    pre_in = Rand(device, dtype, 16)(M, C)

    def run():
        out, pre = poisoned((M, OC), dtype, device), poisoned((M, OC), dtype, device)
        mm.matmul_forward(out, inp, weight, bias, pre_gelu=pre, gelu_epilogue=True)
        grads = [out, pre]
        for epilogue in (False, True):
            dinp, dweight, dbias = poisoned((M, C), dtype, device), dweight0.clone(), dbias0.clone()
            mm.matmul_backward(dinp, dweight, dbias, dout, inp, weight, pre_gelu=pre_in, dgelu_epilogue=epilogue)
            grads += [dinp, dweight, dbias]
        return grads

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_rejects_bad_arguments(device):
    dtype = torch.float32
    inp, weight, bias = linear_inputs(Rand(device, dtype, 17), 8, 16, 24)
    with pytest.raises(AssertionError):  # non-contiguous input
        mm.matmul_forward(torch.empty(24, 8, device=device).t(), inp, weight, bias)
    with pytest.raises(AssertionError):  # wrong output width
        mm.matmul_forward(torch.empty(8, 23, device=device), inp, weight, bias)
    with pytest.raises(AssertionError):  # mixed dtypes
        mm.matmul_forward(torch.empty(8, 24, device=device, dtype=torch.bfloat16), inp, weight, bias)


# ----------------------------------------------------------------------------------------------------
# GPU: GPT-2 124M shapes, bf16, against the fp32 reference computed on the GPU

F32 = torch.float32
BF16 = torch.bfloat16
GPT2_LINEAR = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # qkv, attproj, fc, fcproj


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 16384])
@pytest.mark.parametrize("C, OC", GPT2_LINEAR)
def test_gpu_linear_124m(M, C, OC):
    rand = Rand("cuda", BF16, 20)
    inp, weight, bias = linear_inputs(rand, M, C, OC)
    out = poisoned((M, OC), BF16, "cuda")
    mm.matmul_forward(out, inp, weight, bias)
    check(out, ref.matmul_forward(inp.to(F32), weight.to(F32), bias.to(F32)), BF16, "out")

    dout, dweight0, dbias0 = rand(M, OC), rand(OC, C), rand(OC)
    dinp, dweight, dbias = poisoned((M, C), BF16, "cuda"), dweight0.clone(), dbias0.clone()
    scratch = torch.empty(mm.bias_scratch_numel(M, OC, "cuda"), device="cuda")
    mm.matmul_backward(dinp, dweight, dbias, dout, inp, weight, scratch=scratch)
    e_dinp, e_dweight, e_dbias = ref.matmul_backward(dout.to(F32), inp.to(F32), weight.to(F32))
    check(dinp, e_dinp, BF16, "dinp")
    check(dweight, dweight0.to(F32) + e_dweight, BF16, "dweight")
    check(dbias, dbias0.to(F32) + e_dbias, BF16, "dbias")
    again = dbias0.clone()
    mm.matmul_backward_bias(again, dout, scratch=scratch)
    assert torch.equal(again, dbias), "bias reduction is not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 16384])
def test_gpu_fc_gelu_124m(M):
    """fc forward with GELU (pass and epilogue), fcproj backward with dgelu (pass and epilogue) and the
    fused bias_gelu_backward, at 768 -> 3072 -> 768."""
    C, OC = 768, 3072
    rand = Rand("cuda", BF16, 21)
    inp, weight, bias = linear_inputs(rand, M, C, OC)
    e_pre = ref.matmul_forward(inp.to(F32), weight.to(F32), bias.to(F32))
    for epilogue in (False, True):
        out, pre = poisoned((M, OC), BF16, "cuda"), poisoned((M, OC), BF16, "cuda")
        mm.matmul_forward(out, inp, weight, bias, pre_gelu=pre, gelu_epilogue=epilogue)
        check(pre, e_pre, BF16, f"pre_gelu epilogue={epilogue}")
        check(out, ref.gelu_forward(e_pre), BF16, f"out epilogue={epilogue}")
        if epilogue:
            out2, pre2 = poisoned((M, OC), BF16, "cuda"), poisoned((M, OC), BF16, "cuda")
            mm.matmul_forward(out2, inp, weight, bias, pre_gelu=pre2, gelu_epilogue=epilogue)
            assert torch.equal(out, out2) and torch.equal(pre, pre2)

    # fcproj (3072 -> 768): its input is gelu(pre)
    w_proj = rand(C, OC, scale=OC ** -0.5)
    act = rand(M, OC)
    dout = rand(M, C)
    e_dact = ref.gelu_backward(pre.to(F32), dout.to(F32) @ w_proj.to(F32))
    for epilogue in (False, True):
        dinp, dweight, dbias = poisoned((M, OC), BF16, "cuda"), torch.zeros_like(w_proj), torch.zeros(C, device="cuda",
                                                                                                      dtype=BF16)
        mm.matmul_backward(dinp, dweight, dbias, dout, act, w_proj, pre_gelu=pre, dgelu_epilogue=epilogue)
        check(dinp, e_dact, BF16, f"dinp epilogue={epilogue}")
    d = poisoned((M, OC), BF16, "cuda")
    mm.matmul_backward(d, torch.zeros_like(w_proj), None, dout, act, w_proj)
    db_fc0 = rand(OC)
    db_fc = db_fc0.clone()
    mm.bias_gelu_backward(db_fc, None, d, pre)
    check(d, e_dact, BF16, "bias_gelu_backward d")
    check(db_fc, db_fc0.to(F32) + e_dact.sum(0), BF16, "bias_gelu_backward dbias")


@pytest.mark.gpu
def test_gpu_lm_head():
    """wte as the classifier: (4096, 768) -> (4096, 50304), no bias."""
    M, C, OC = 4096, 768, 50304
    rand = Rand("cuda", BF16, 22)
    inp, weight, _ = linear_inputs(rand, M, C, OC, bias=False)
    out = poisoned((M, OC), BF16, "cuda")
    mm.matmul_forward(out, inp, weight)
    check(out, ref.matmul_forward(inp.to(F32), weight.to(F32)), BF16, "logits")
    del out
    dout, dweight0 = rand(M, OC, scale=1e-2), rand(OC, C, scale=1e-2)
    dinp, dweight = poisoned((M, C), BF16, "cuda"), dweight0.clone()
    mm.matmul_backward(dinp, dweight, None, dout, inp, weight)
    e_dinp, e_dweight, _ = ref.matmul_backward(dout.to(F32), inp.to(F32), weight.to(F32), has_bias=False)
    check(dinp, e_dinp, BF16, "dinp")
    check(dweight, dweight0.to(F32) + e_dweight, BF16, "dweight")


@pytest.mark.gpu
def test_gpu_dweight_accumulates_in_one_gemm():
    """dweight.addmm_(dout.T, inp): cuBLAS with beta = 1 on dweight itself; no copy, no separate add."""
    from torch.profiler import ProfilerActivity, profile
    M, C, OC = 16384, 768, 3072
    rand = Rand("cuda", BF16, 23)
    dout, inp, dweight = rand(M, OC), rand(M, C), rand(OC, C)
    dweight.addmm_(dout.t(), inp)  # warm-up (cuBLAS handles, heuristics)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dweight.addmm_(dout.t(), inp)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names, "profiler saw no CUDA kernels"
    assert not any("memcpy" in n.lower() or "elementwise" in n.lower() or "copy" in n.lower() for n in names), names
    assert len(names) <= 2, names  # the GEMM (plus a split-K reduction at most)
