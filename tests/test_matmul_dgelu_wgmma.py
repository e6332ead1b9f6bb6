"""The Gluon DGELU GEMM (kernels/matmul_dgelu_wgmma.py): dinp = (dout @ weight) * gelu'(pre_gelu) against
float64 math, on the GPU only (Gluon has no CPU interpreter; the CPU runs the other DGELU paths, tested
in test_matmul.py). Odd shapes (partial tiles in M, N and K), NaN-poisoned outputs, the rows past the
output left alone, bitwise repeats, and GPT-2 124M's fcproj shape against cuBLASLt's epilogue."""
import pytest
import torch

from llmpy import reference as ref

pytestmark = pytest.mark.gpu

# (M, K, N): one partial tile in every dimension; more tiles than programs; GPT-2 124M's fcproj at B*T = 4096
SHAPES = [(200, 72, 136), (1000, 768, 3072), (4096, 768, 3072)]


def _case(M, K, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(K, N, generator=g, device="cuda") * K ** -0.5).to(torch.bfloat16)
    pre = (torch.randn(M, N, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return dout, weight, pre


def _expected(dout, weight, pre):
    return ref.gelu_backward(pre.double(), dout.double() @ weight.double())


@pytest.fixture(autouse=True)
def _needs_sm90():
    from llmpy.kernels.matmul_dgelu_wgmma import GLUON
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    if not GLUON or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon and an sm_90 GPU")


# (stages, block_k, epilogue through shared memory and TMA, block_n)
CONFIGS = [(2, 64, True, 128), (4, 32, True, 128), (3, 64, False, 128), (4, 64, False, 256), (3, 64, True, 256)]


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("stages,block_k,epilogue_smem,block_n", CONFIGS)
def test_dgelu_wgmma_matches_float64(M, K, N, stages, block_k, epilogue_smem, block_n):
    from llmpy.kernels.matmul_dgelu_wgmma import dgelu_wgmma_usable, matmul_dgelu_wgmma
    dout, weight, pre = _case(M, K, N, seed=M + N + stages)
    # the output inside a larger buffer: the rows after it must keep their NaNs
    buf = torch.full((M + 3, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    dinp = buf[:M]
    assert dgelu_wgmma_usable(dinp, dout, weight, pre)
    kw = dict(stages=stages, block_k=block_k, epilogue_smem=epilogue_smem, block_n=block_n)
    matmul_dgelu_wgmma(dinp, dout, weight, pre, **kw)
    assert torch.isfinite(dinp).all(), "poisoned output not fully written"
    assert torch.isnan(buf[M:]).all(), "wrote past the output"
    exp = _expected(dout, weight, pre)
    err = (dinp.double() - exp).abs().max().item() / exp.abs().max().item()
    assert err < 1e-2, f"max error {err:.3e} of the largest value"
    # rounded once from fp32 sums: most elements are the nearest bf16 of the exact value or a neighbour
    close = ((dinp.double() - exp).abs() <= exp.abs() * 2 ** -7 + 1e-6).double().mean().item()
    assert close > 0.999, f"only {close:.4%} of the elements within one bf16 ulp"
    again = torch.full_like(dinp, float("nan"))
    matmul_dgelu_wgmma(again, dout, weight, pre, **kw)
    assert torch.equal(again, dinp), "not bitwise repeatable"


def test_dgelu_wgmma_against_cublaslt_at_gpt2_shape():
    """GPT-2 124M's fcproj input gradient (B*T = 65536 rows): within rounding of cuBLASLt's DGELU
    epilogue (what the model ran before), both against float64 on a sample of rows."""
    from llmpy.kernels import cublaslt
    from llmpy.kernels.matmul_dgelu_wgmma import matmul_dgelu_wgmma
    M, K, N = 65536, 768, 3072
    dout, weight, pre = _case(M, K, N, seed=5)
    ours = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    matmul_dgelu_wgmma(ours, dout, weight, pre)
    assert torch.isfinite(ours).all()
    if cublaslt.available():
        theirs = torch.empty_like(ours)
        cublaslt.linear_input_grad(theirs, dout, weight, pre_gelu=pre)
        rows = torch.arange(0, M, 97, device="cuda")
        exp = _expected(dout[rows], weight, pre[rows])
        scale = exp.abs().max().item()
        ours_err = (ours[rows].double() - exp).abs().max().item() / scale
        theirs_err = (theirs[rows].double() - exp).abs().max().item() / scale
        assert ours_err <= max(2 * theirs_err, 1e-2), (ours_err, theirs_err)


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_dgelu_wgmma_ws_matches_float64(M, K, N):
    """The warp-specialised variant: same checks."""
    from llmpy.kernels.matmul_dgelu_wgmma import matmul_dgelu_wgmma_ws
    dout, weight, pre = _case(M, K, N, seed=M + N)
    buf = torch.full((M + 3, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    dinp = buf[:M]
    matmul_dgelu_wgmma_ws(dinp, dout, weight, pre)
    assert torch.isfinite(dinp).all(), "poisoned output not fully written"
    assert torch.isnan(buf[M:]).all(), "wrote past the output"
    exp = _expected(dout, weight, pre)
    err = (dinp.double() - exp).abs().max().item() / exp.abs().max().item()
    assert err < 1e-2, f"max error {err:.3e} of the largest value"
    again = torch.full_like(dinp, float("nan"))
    matmul_dgelu_wgmma_ws(again, dout, weight, pre)
    assert torch.equal(again, dinp), "not bitwise repeatable"
