"""kernels/cublaslt.py: the ctypes binding of cuBLASLt's products with llm.c's GELU epilogues, and where
kernels/matmul.py uses it (use_cublaslt: the GELU epilogues and the tuned products).

CPU: the row-major -> column-major bookkeeping of the three linear-layer products, with cuBLASLt's
`_gemm` replaced by an emulator of its column-major semantics (read straight from the tensors' storage
with the leading dimensions given, float64) - so a wrong transpose, leading dimension or bias length
fails here, without a GPU; and the errors.
GPU (marker gpu): every epilogue against the float64 reference (reference.py), on odd and GPT-2 shapes,
in bf16 and fp32, poisoned outputs, strided row views, bitwise repeats, capture in a CUDA graph, and
matmul_forward / matmul_backward with cuBLASLt's epilogues against our Triton GEMM's.
"""
import pytest
import torch

from llmpy import reference as ref
from llmpy.errors import LlmpyError
from llmpy.kernels import cublaslt as lt
from llmpy.kernels import matmul as mm

HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------
# CPU: the layout bookkeeping against an emulator of cuBLASLt's column-major product

def _colmajor(t, rows, cols, ld):
    """The column-major (rows, cols) matrix with leading dimension ld that starts at t's first element."""
    return t.as_strided((rows, cols), (1, ld), t.storage_offset())


def _gelu_grad64(x):
    return ref.gelu_backward(x.double(), torch.ones_like(x, dtype=torch.float64))


def fake_gemm(d, a, b, m, n, k, transa, transb, lda, ldb, ldd, *, epilogue=lt.EPILOGUE_DEFAULT, bias=None,
              aux=None, aux_ld=0, accumulate=False, c=None, ldc=0, algo_index=0):
    """What cuBLASLt computes for these arguments (column-major, float64), written into d / bias / aux."""
    A = _colmajor(a, *((k, m) if transa else (m, k)), lda).double()
    B = _colmajor(b, *((n, k) if transb else (k, n)), ldb).double()
    opA, opB = (A.t() if transa else A), (B.t() if transb else B)
    D = _colmajor(d, m, n, ldd)
    x = opA @ opB + (D.double() if accumulate else 0.0)
    if c is not None:
        x = x + _colmajor(c, m, n, ldc).double()
    if epilogue in (lt.EPILOGUE_BIAS, lt.EPILOGUE_GELU_AUX_BIAS):
        x = x + bias.double()[:, None]  # a bias per row of D
    if epilogue in (lt.EPILOGUE_GELU_AUX, lt.EPILOGUE_GELU_AUX_BIAS):
        _colmajor(aux, m, n, aux_ld).copy_(x)
        x = ref.gelu_forward(x)
    if epilogue == lt.EPILOGUE_DGELU:
        x = x * _gelu_grad64(_colmajor(aux, m, n, aux_ld))
    if epilogue == lt.EPILOGUE_BGRADB:
        bias.copy_(opB.sum(0))  # over k: one sum per column of D
    D.copy_(x)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(lt, "_gemm", fake_gemm)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float32)  # the binding takes fp32 or bf16


def _poison(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float32)


def close(a, b):
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,C,OC", [(5, 8, 24), (33, 16, 8)])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_layout(emulated, M, C, OC, gelu, bias):
    g = torch.Generator().manual_seed(M * 7 + OC)
    inp, w = _rand(g, M, C), _rand(g, OC, C)
    b = _rand(g, OC) if bias else None
    wide = _poison(M, OC + 8)  # out as a strided view of a wider buffer: ld != OC
    out = wide[:, :OC]
    pre = _poison(M, OC) if gelu else None
    lt.linear_forward(out, inp, w, b, pre_gelu=pre)
    expected_pre = inp @ w.t() + (b if bias else 0.0)
    if gelu:
        assert close(pre, expected_pre) and close(out, ref.gelu_forward(expected_pre))
    else:
        assert close(out, expected_pre)
    assert torch.isnan(wide[:, OC:]).all(), "wrote outside the view"


@pytest.mark.parametrize("M,C,OC", [(5, 8, 24), (33, 16, 8)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_linear_forward_residual_layout(emulated, M, C, OC, bias, in_place):
    """out = residual + inp @ w.T (+ bias); the residual a strided view of its own wider buffer, or out."""
    g = torch.Generator().manual_seed(M * 5 + OC + bias)
    inp, w = _rand(g, M, C), _rand(g, OC, C)
    b = _rand(g, OC) if bias else None
    res_wide = _rand(g, M, OC + 3)
    residual = res_wide[:, :OC]
    expected = residual + inp @ w.t() + (b if bias else 0.0)
    wide = _poison(M, OC + 8)
    out = wide[:, :OC]
    if in_place:
        out.copy_(residual)
        residual = out
    lt.linear_forward(out, inp, w, b, residual=residual)
    assert close(out, expected)
    assert torch.isnan(wide[:, OC:]).all(), "wrote outside the view"
    with pytest.raises(ValueError, match="not before a GELU"):
        lt.linear_forward(out, inp, w, b, pre_gelu=_poison(M, OC), residual=residual)
    with pytest.raises(ValueError, match="residual has shape"):
        lt.linear_forward(out, inp, w, b, residual=res_wide)


@pytest.mark.parametrize("M,C,OC", [(5, 8, 24), (33, 16, 8)])
@pytest.mark.parametrize("dgelu", [False, True])
def test_linear_input_grad_layout(emulated, M, C, OC, dgelu):
    g = torch.Generator().manual_seed(M + C)
    dout, w, pre = _rand(g, M, OC), _rand(g, OC, C), _rand(g, M, C)
    dinp = _poison(M, C)
    lt.linear_input_grad(dinp, dout, w, pre_gelu=pre if dgelu else None)
    expected = dout @ w
    if dgelu:
        expected = ref.gelu_backward(pre, expected)
    assert close(dinp, expected)


@pytest.mark.parametrize("M,C,OC", [(5, 8, 24), (33, 16, 8)])
def test_linear_weight_grad_layout(emulated, M, C, OC):
    g = torch.Generator().manual_seed(M * OC)
    dout, inp, dw0 = _rand(g, M, OC), _rand(g, M, C), _rand(g, OC, C)
    dw = dw0.clone()
    lt.linear_weight_grad(dw, dout, inp)
    assert close(dw, dw0 + dout.t() @ inp)  # accumulated
    sums = _poison(OC)
    lt.linear_weight_grad(dw, dout, inp, dbias_sums=sums)
    assert close(dw, dw0 + 2 * dout.t() @ inp) and close(sums, dout.sum(0))
    lt.linear_weight_grad(dw, dout, inp, accumulate=False)
    assert close(dw, dout.t() @ inp)


def test_linear_weight_grad_into_fp32(emulated):
    """bf16 operands summed into an fp32 dweight (weight_grad_bias_column's wide product), overwritten;
    fp32 is the one output dtype that may differ, and not with the bias sums in the product."""
    g = torch.Generator().manual_seed(3)
    M, C, OC = 37, 24, 16
    dout, inp = _rand(g, M, OC).bfloat16(), _rand(g, M, C).bfloat16()
    dw = _poison(OC, C)
    lt.linear_weight_grad(dw, dout, inp, accumulate=False)
    assert dw.dtype == torch.float32 and close(dw, dout.double().t() @ inp.double())
    with pytest.raises(ValueError, match="BGRADB"):
        lt.linear_weight_grad(dw, dout, inp, dbias_sums=torch.zeros(OC, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        lt.linear_weight_grad(torch.zeros(OC, C, dtype=torch.float16), dout, inp)
    with pytest.raises(ValueError, match="row-major"):
        lt.linear_weight_grad(torch.zeros(C, OC).t(), dout, inp)


def test_refused_configuration_falls_back_to_the_first_choice():
    """matmul's cuBLASLt calls: a TUNED_ALGOS AlgoConfig this cuBLASLt refuses runs rank 0 instead (the
    table outlives library versions); a refused rank stays an error."""
    calls = []

    def product(*args, algo_index):
        calls.append(algo_index)
        if algo_index != 0:
            raise lt.CublasLtError("refused")
        return "ran"

    config = lt.AlgoConfig(66, tile=29, stages=35)
    assert mm._lt(product, 1, algo=config) == "ran" and calls == [config, 0]
    assert mm._lt(product, 1, algo=None) == "ran" and calls[-1] == 0
    with pytest.raises(lt.CublasLtError):
        mm._lt(product, 1, algo=5)


def test_epilogue_arguments_checked():
    with pytest.raises(ValueError, match="bias/aux given"):
        lt._gemm(torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(8, 8), 8, 8, 8, False, False, 8, 8, 8,
                 epilogue=lt.EPILOGUE_GELU_AUX_BIAS, bias=torch.zeros(8))
    with pytest.raises(ValueError, match="row-major"):
        lt.linear_forward(torch.zeros(8, 4).t(), torch.zeros(4, 8), torch.zeros(8, 8))
    with pytest.raises(ValueError, match=r"out has shape \(4, 6\), expected \(4, 8\)"):
        lt.linear_forward(torch.zeros(4, 6), torch.zeros(4, 8), torch.zeros(8, 8))
    with pytest.raises(ValueError, match="one dtype"):
        lt.linear_input_grad(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8, 8))
    with pytest.raises(ValueError, match="dbias_sums has shape"):
        lt.linear_weight_grad(torch.zeros(8, 8), torch.zeros(4, 8), torch.zeros(4, 8), dbias_sums=torch.zeros(4))


def test_resolve_for_the_cpu():
    """A CPU model never uses cuBLASLt, and asking for it there is a user error (GPU or not)."""
    assert mm.resolve_cublaslt(None, "cpu") is False and mm.resolve_cublaslt(False, "cpu") is False
    assert lt.available() == HAS_CUDA
    with pytest.raises(LlmpyError, match="cuBLASLt: needs a CUDA device"):
        mm.resolve_cublaslt(True, "cpu")


def test_alignment():
    assert lt._alignment(0x1000) == 256 and lt._alignment(0x1010) == 16 and lt._alignment(0x1002) == 2


# ----------------------------------------------------------------------------------------------------
# GPU: the real library

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
GPU_SHAPES = [(40, 24, 56), (1000, 64, 200), (4096, 768, 3072), (4096, 3072, 768)]


def rel_err(out, expected):
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def _dev(g, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,C,OC", GPU_SHAPES)
def test_gpu_forward_epilogues(dtype, M, C, OC):
    g = torch.Generator().manual_seed(M + C + OC)
    inp, w, b = _dev(g, dtype, M, C), _dev(g, dtype, OC, C, scale=C ** -0.5), _dev(g, dtype, OC)
    expected = inp.double() @ w.double().t() + b.double()
    out = torch.full((M, OC), float("nan"), device="cuda", dtype=dtype)
    lt.linear_forward(out, inp, w, b)
    assert rel_err(out, expected) < TOL[dtype]
    pre = torch.full_like(out, float("nan"))
    act = torch.full_like(out, float("nan"))
    lt.linear_forward(act, inp, w, b, pre_gelu=pre)
    assert rel_err(pre, expected) < TOL[dtype]
    assert rel_err(act, ref.gelu_forward(expected)) < TOL[dtype]
    again = torch.empty_like(act)
    lt.linear_forward(again, inp, w, b, pre_gelu=torch.empty_like(pre))
    assert torch.equal(again, act), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,C,OC", [(40, 24, 56), (4096, 768, 768), (4096, 3072, 768)])
def test_gpu_forward_residual(dtype, M, C, OC):
    """out = residual + inp @ w.T + bias in one product (beta = 1), into another buffer (the model's use:
    one rounding of the fp32 sum) and in place (in bf16 cuBLASLt rounds the product before adding it:
    on the H200 bitwise round(round(product) + residual), so only its accuracy is checked here); the
    residual of a few units as in the model's residual stream, the product's share of order one."""
    g = torch.Generator().manual_seed(M + 2 * C + OC)
    inp, w, b = _dev(g, dtype, M, C), _dev(g, dtype, OC, C, scale=C ** -0.5), _dev(g, dtype, OC)
    residual = _dev(g, dtype, M, OC, scale=3.0)
    expected = residual.double() + inp.double() @ w.double().t() + b.double()
    out = torch.full((M, OC), float("nan"), device="cuda", dtype=dtype)
    lt.linear_forward(out, inp, w, b, residual=residual)
    assert rel_err(out, expected) < TOL[dtype]
    assert rel_err(out.double() - residual.double(), expected - residual.double()) < 10 * TOL[dtype]
    again = torch.full_like(out, float("nan"))
    lt.linear_forward(again, inp, w, b, residual=residual)
    assert torch.equal(again, out), "two runs differ"
    in_place = residual.clone()
    lt.linear_forward(in_place, inp, w, b, residual=in_place)
    assert rel_err(in_place, expected) < TOL[dtype]
    if dtype == torch.float32:
        assert torch.equal(in_place, out), "fp32: in place and into another buffer differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,C,OC", GPU_SHAPES)
def test_gpu_backward_epilogues(dtype, M, C, OC):
    g = torch.Generator().manual_seed(3 * M + C)
    dout, w, inp, pre = _dev(g, dtype, M, OC), _dev(g, dtype, OC, C, scale=OC ** -0.5), _dev(g, dtype, M, C), \
        _dev(g, dtype, M, C)
    for dgelu in (False, True):
        dinp = torch.full((M, C), float("nan"), device="cuda", dtype=dtype)
        lt.linear_input_grad(dinp, dout, w, pre_gelu=pre if dgelu else None)
        expected = dout.double() @ w.double()
        if dgelu:
            expected = ref.gelu_backward(pre.double(), expected)
        assert rel_err(dinp, expected) < TOL[dtype]
        again = torch.empty_like(dinp)
        lt.linear_input_grad(again, dout, w, pre_gelu=pre if dgelu else None)
        assert torch.equal(again, dinp), "two runs differ"
    dw0 = _dev(g, dtype, OC, C)
    dw = dw0.clone()
    lt.linear_weight_grad(dw, dout, inp)
    assert rel_err(dw, dw0.double() + dout.double().t() @ inp.double()) < TOL[dtype]
    dw2 = dw0.clone()
    lt.linear_weight_grad(dw2, dout, inp)
    assert torch.equal(dw2, dw), "two runs differ"


@pytest.mark.gpu
def test_gpu_strided_views_and_graph():
    """Row views with a leading dimension wider than the row (the model's qkv slices), and a CUDA graph
    replaying the products with the same results."""
    g = torch.Generator().manual_seed(11)
    bf = torch.bfloat16
    wide = _dev(g, bf, 512, 3 * 256)
    inp = wide[:, 256:512]  # ld 768, 256 columns
    w, b = _dev(g, bf, 384, 256, scale=1 / 16), _dev(g, bf, 384)
    out = torch.full((512, 384), float("nan"), device="cuda", dtype=bf)
    lt.linear_forward(out, inp, w, b)
    assert rel_err(out, inp.double() @ w.double().t() + b.double()) < 1e-2
    eager = out.clone()
    out.fill_(float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        lt.linear_forward(out, inp, w, b)  # plan made outside the capture
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            lt.linear_forward(out, inp, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [0, 66])
def test_gpu_second_stream_and_sm_target(sms):
    """Weight gradients on two streams at once, each with its own workspace (reserve_workspace), planned
    for all SMs or for 66 of them (sm_count_target): each equals the same product on one stream."""
    g = torch.Generator().manual_seed(13)
    bf = torch.bfloat16
    M, C, OC = 8192, 768, 2304
    douts, inps = [_dev(g, bf, M, OC) for _ in range(2)], [_dev(g, bf, M, C) for _ in range(2)]
    expected = []
    for dout, inp in zip(douts, inps):
        dw = torch.zeros(OC, C, device="cuda", dtype=bf)
        lt.linear_weight_grad(dw, dout, inp)
        expected.append(dw)
    side = torch.cuda.Stream()
    lt.reserve_workspace(side)
    got = [torch.zeros(OC, C, device="cuda", dtype=bf) for _ in range(2)]
    with lt.sm_count_target(sms):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lt.linear_weight_grad(got[1], douts[1], inps[1])
        lt.linear_weight_grad(got[0], douts[0], inps[0])
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for dw, ref_dw, dout, inp in zip(got, expected, douts, inps):
        assert rel_err(dw, dout.double().t() @ inp.double()) < TOL[bf]
        if sms == 0:
            assert torch.equal(dw, ref_dw)  # the same plan: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matmul_epilogues_agree(dtype):
    """matmul_forward with the GELU epilogue and matmul_backward with the DGELU epilogue: cuBLASLt's and our
    Triton GEMM's against the reference (the GELUs differ in their last bits, not beyond bf16 rounding)."""
    g = torch.Generator().manual_seed(5)
    M, C, OC = 2048, 256, 768
    inp, w, b = _dev(g, dtype, M, C), _dev(g, dtype, OC, C, scale=C ** -0.5), _dev(g, dtype, OC)
    pre_ref = inp.double() @ w.double().t() + b.double()
    w2, dout = _dev(g, dtype, C, OC, scale=OC ** -0.5), _dev(g, dtype, M, C)
    for impl in (False, True):
        out, pre = (torch.full((M, OC), float("nan"), device="cuda", dtype=dtype) for _ in range(2))
        mm.matmul_forward(out, inp, w, b, pre_gelu=pre, gelu_epilogue=True, use_cublaslt=impl)
        assert rel_err(pre, pre_ref) < TOL[dtype] and rel_err(out, ref.gelu_forward(pre_ref)) < TOL[dtype], impl
        # fcproj's backward: dinp (M, OC) = dout @ w2 (C, OC), times gelu'(pre)
        dinp = torch.full((M, OC), float("nan"), device="cuda", dtype=dtype)
        dw = torch.zeros(C, OC, device="cuda", dtype=dtype)
        mm.matmul_backward(dinp, dw, None, dout, out, w2, pre_gelu=pre, dgelu_epilogue=True, use_cublaslt=impl)
        expected = ref.gelu_backward(pre.double(), dout.double() @ w2.double())
        assert rel_err(dinp, expected) < TOL[dtype], impl
        assert rel_err(dw, dout.double().t() @ out.double()) < TOL[dtype], impl


@pytest.mark.gpu
def test_gpu_resolve():
    assert mm.resolve_cublaslt(None, "cuda") is True and lt.available()


@pytest.mark.gpu
@pytest.mark.parametrize("key", sorted(mm.TUNED_ALGOS, key=str))
def test_gpu_tuned_products(key):
    """Each product of TUNED_ALGOS, at its own shape, through the kmm call the model makes: the reference's
    result within bf16 tolerance, and the same bits twice."""
    product, rows, inner, outer, cap = key
    if torch.cuda.get_device_capability() != cap:
        pytest.skip(f"tuned for capability {cap}")
    g = torch.Generator().manual_seed(rows + inner + outer)
    bf = torch.bfloat16

    def run():
        if product in ("fwd", "fwd_bias", "gelu_aux_bias", "gelu_aux"):
            inp, w = _dev(g0(), bf, rows, inner), _dev(g0(), bf, outer, inner, scale=inner ** -0.5)
            b = _dev(g0(), bf, outer) if product in ("fwd_bias", "gelu_aux_bias") else None
            out = torch.full((rows, outer), float("nan"), device="cuda", dtype=bf)
            pre = torch.full_like(out, float("nan")) if product.startswith("gelu") else None
            mm.matmul_forward(out, inp, w, b, pre_gelu=pre, gelu_epilogue=pre is not None, use_cublaslt=True)
            expected = inp.double() @ w.double().t() + (b.double() if b is not None else 0.0)
            return out, ref.gelu_forward(expected) if pre is not None else expected
        dout, w, inp = _dev(g0(), bf, rows, inner), _dev(g0(), bf, inner, outer, scale=inner ** -0.5), \
            _dev(g0(), bf, rows, outer)
        if product == "dinp":
            dinp = torch.full((rows, outer), float("nan"), device="cuda", dtype=bf)
            mm.matmul_backward(dinp, torch.zeros(inner, outer, device="cuda", dtype=bf), None, dout, inp, w,
                               use_cublaslt=True)
            return dinp, dout.double() @ w.double()
        dw = torch.zeros(inner, outer, device="cuda", dtype=bf)
        mm.matmul_backward(None, dw, None, dout, inp, w, use_cublaslt=True)
        return dw, dout.double().t() @ inp.double()

    def g0():
        return g.manual_seed(rows * 3 + outer)

    first, expected = run()
    assert rel_err(first, expected) < TOL[bf]
    second, _ = run()
    assert torch.equal(first, second), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,C,OC", [(1000, 64, 200), (8192, 768, 2304)])
def test_gpu_bias_grad_in_product(dtype, M, C, OC, monkeypatch):
    """matmul_backward with use_cublaslt and BIAS_GRAD_IN_PRODUCT: dbias ACCUMULATED from the weight-gradient
    product's BGRADB sums (or our reduction where cuBLASLt has no algorithm), as without cuBLASLt, and the
    same bits twice."""
    monkeypatch.setattr(mm, "BIAS_GRAD_IN_PRODUCT", True)
    g = torch.Generator().manual_seed(M + OC)
    dout, inp, w = _dev(g, dtype, M, OC), _dev(g, dtype, M, C), _dev(g, dtype, OC, C, scale=0.05)
    seed = torch.tensor([77], device="cuda", dtype=torch.int64)
    results = []
    for use, again in ((False, 0), (True, 0), (True, 1)):
        dw = _dev(torch.Generator().manual_seed(1), dtype, OC, C)
        db = _dev(torch.Generator().manual_seed(2), dtype, OC)
        db0 = db.clone()
        scratch = torch.full((mm.bias_scratch_numel(M, OC, "cuda") + OC,), float("nan"), device="cuda",
                             dtype=torch.float32)
        mm.matmul_backward(None, dw, db, dout, inp, w, scratch=scratch, seed=seed, use_cublaslt=use)
        assert rel_err(db.double() - db0.double(), dout.double().sum(0)) < TOL[dtype], (use, again)
        results.append((dw, db))
    assert torch.equal(results[1][0], results[2][0]) and torch.equal(results[1][1], results[2][1])
    assert rel_err(results[1][0], results[0][0]) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("M,C,OC", [(1000, 64, 200), (8192, 768, 2304)])
def test_gpu_algo_config(M, C, OC, monkeypatch):
    """An algorithm named in full (AlgoConfig): the heuristic's first choice read back (config_of) runs
    the same kernel, so the same bits; another configuration cuBLASLt accepts is right within bf16
    rounding and repeatable; one it refuses raises CublasLtError; and a TUNED_ALGOS entry holding an
    AlgoConfig reaches cuBLASLt through matmul_forward."""
    g = torch.Generator().manual_seed(M + OC)
    bf = torch.bfloat16
    inp, w, b = _dev(g, bf, M, C), _dev(g, bf, OC, C, scale=C ** -0.5), _dev(g, bf, OC)
    expected = inp.double() @ w.double().t() + b.double()

    def run(algo):
        out = torch.full((M, OC), float("nan"), device="cuda", dtype=bf)
        lt.linear_forward(out, inp, w, b, algo_index=algo)
        return out

    first = run(0)
    plans = [p for k, p in lt._plans.items() if k[1:4] == (OC, M, C) and k[14] == 0 and k[11] == lt.EPILOGUE_BIAS]
    config = lt.config_of(plans[-1].algo)
    assert isinstance(config, lt.AlgoConfig)
    assert torch.equal(run(config), first), "the first choice, named in full, is another kernel"
    other = lt.AlgoConfig(config.algo_id, config.tile, config.stages, config.swizzle, config.custom,
                          2 if config.cluster != 2 else 3)  # another cluster shape
    try:
        out = run(other)
    except lt.CublasLtError:
        pass  # not every algorithm runs every cluster shape
    else:
        assert rel_err(out, expected) < TOL[bf]
        assert torch.equal(run(other), out), "two runs differ"
    refused = lt.AlgoConfig(algo_id=config.algo_id, tile=1, stages=1, cluster=16)  # 8x8 tiles, 1x16 clusters
    with pytest.raises(lt.CublasLtError, match="AlgoCheck|AlgoInit|attribute"):
        run(refused)
    key = ("fwd_bias", M, C, OC, torch.cuda.get_device_capability())
    for entry in (config, refused):  # the table's configuration; one refused runs the heuristic's first
        monkeypatch.setitem(mm.TUNED_ALGOS, key, entry)
        out = torch.full((M, OC), float("nan"), device="cuda", dtype=bf)
        mm.matmul_forward(out, inp, w, b, use_cublaslt=True)
        assert torch.equal(out, first), entry


@pytest.mark.gpu
def test_gpu_split_k_algo_config():
    """Split-K AlgoConfigs (fp32 partial sums in the workspace; two splits of the heuristic's first tile) on a
    weight gradient of qkv's shape: each right within bf16 rounding, bitwise repeatable, and read back by
    config_of with its split. (The model's TUNED_ALGOS entry runs in tests/test_gpt2.py's GPU cases.)"""
    M, C, OC = 8192, 768, 2304
    g = torch.Generator().manual_seed(11)
    bf = torch.bfloat16
    dout, inp, dw0 = _dev(g, bf, M, OC), _dev(g, bf, M, C), _dev(g, bf, OC, C)
    expected = dw0.double() + dout.double().t() @ inp.double()

    def run(algo):
        dw = dw0.clone()
        lt.linear_weight_grad(dw, dout, inp, algo_index=algo)
        return dw

    first = run(0)
    plans = [p for k, p in lt._plans.items() if k[1:4] == (C, OC, M) and k[14] == 0]
    base = lt.config_of(plans[-1].algo)
    ran = 0
    for splitk in (2, 4):
        config = lt.AlgoConfig(base.algo_id, base.tile, base.stages, base.swizzle, base.custom, base.cluster,
                               base.inner_shape, splitk=splitk, reduction=2)
        try:
            out = run(config)
        except lt.CublasLtError:
            continue  # not every algorithm splits every tile
        ran += 1
        assert rel_err(out, expected) < TOL[bf], config
        assert torch.equal(run(config), out), f"two runs differ: {config}"
        plan = [p for k, p in lt._plans.items() if k[1:4] == (C, OC, M) and k[14] == config][-1]
        assert lt.config_of(plan.algo) == config
    assert ran, f"no split of {base} ran"
    assert rel_err(first, expected) < TOL[bf]


@pytest.mark.gpu
def test_gpu_weight_grad_into_fp32():
    """bf16 operands summed into fp32 (weight_grad_bias_column's product, fc's shape with its bias columns
    at 8192 rows), overwritten: the heuristic's first and a split-K configuration against float64, within fp32
    sums' rounding, bitwise repeatable; and weight_grad_bias_column through cuBLASLt agrees with torch's."""
    M, C, OC = 8192, 776, 3072
    g = torch.Generator().manual_seed(13)
    bf = torch.bfloat16
    dout, inp = _dev(g, bf, M, OC), _dev(g, bf, M, C)
    expected = dout.double().t() @ inp.double()

    def run(algo):
        dw = torch.full((OC, C), float("nan"), device="cuda")
        lt.linear_weight_grad(dw, dout, inp, accumulate=False, algo_index=algo)
        return dw

    first = run(0)
    assert rel_err(first, expected) < 1e-5, rel_err(first, expected)
    assert torch.equal(run(0), first)
    plans = [p for k, p in lt._plans.items() if k[1:4] == (C, OC, M) and k[14] == 0 and k[10] == torch.float32]
    base = lt.config_of(plans[-1].algo)
    config = lt.AlgoConfig(base.algo_id, base.tile, base.stages, base.swizzle, base.custom, base.cluster,
                           base.inner_shape, splitk=2, reduction=2)
    try:
        split = run(config)
    except lt.CublasLtError:
        split = None  # not every algorithm splits every tile
    if split is not None:
        assert rel_err(split, expected) < 1e-5, rel_err(split, expected)
        assert torch.equal(run(config), split)
    # through the model's call: the tuned entry against torch's product, both into random dweight / dbias
    x = torch.cat([inp[:, :768], torch.ones(M, 1, dtype=bf, device="cuda"), torch.zeros(M, 7, dtype=bf,
                                                                                      device="cuda")], dim=1)
    dw0, db0 = _dev(g, bf, OC, 768), _dev(g, bf, OC)
    outs = []
    for use in (False, True):
        dw, db = dw0.clone(), db0.clone()
        scratch = torch.full((OC * C,), float("nan"), device="cuda")
        key = ("dweight_wide", M, OC, C, mm._capability(dout.device))
        saved = mm.TUNED_ALGOS.get(key)
        mm.TUNED_ALGOS[key] = config if split is not None else 0
        try:
            mm.weight_grad_bias_column(dw, db, dout, x, scratch, seed=None, use_cublaslt=use)
        finally:
            if saved is None:
                del mm.TUNED_ALGOS[key]
            else:
                mm.TUNED_ALGOS[key] = saved
        outs.append((dw.float(), db.float()))
    for (a, b), name in zip(zip(*outs), ("dweight", "dbias")):
        # fp32 sums in another order, then rounded to bf16: an ulp apart at most, or a hair where sums cancel
        assert torch.allclose(a, b, rtol=2 ** -6, atol=1e-5 * b.abs().max().item()), name


def test_workspace_size_set_before_the_first_product(monkeypatch):
    """set_workspace_bytes: taken before any device has its workspace; refused after (the workspace is allocated
    and the plans chosen to fit it), unless unchanged; a size under 1 byte refused."""
    monkeypatch.setattr(lt, "WORKSPACE_BYTES", lt.WORKSPACE_BYTES)
    monkeypatch.setattr(lt, "_devices", {})
    lt.set_workspace_bytes(64 << 20)
    assert lt.WORKSPACE_BYTES == 64 << 20
    with pytest.raises(LlmpyError, match="at least 1"):
        lt.set_workspace_bytes(0)
    monkeypatch.setitem(lt._devices, 0, object())  # a device with its workspace
    lt.set_workspace_bytes(64 << 20)  # the same size: nothing to change
    with pytest.raises(LlmpyError, match="before the first product"):
        lt.set_workspace_bytes(96 << 20)
    assert lt.WORKSPACE_BYTES == 64 << 20
