"""Attention kernels against reference.py: the classic path (permute, causal softmax and its backward,
cuBLAS GEMMs) on the CPU through Triton's interpreter and on the GPU; PyTorch's fused cuDNN and flash
paths and the dispatcher on the GPU only."""
import math

import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels import attention as A

# relative tolerance ||out - ref|| / ||ref||. bf16 is compared with the reference run in fp32 on the
# bf16-rounded inputs. The classic path rounds scores, probabilities and their gradients to bf16
# between its stages, so its backward gets twice the forward's tolerance (measured: ~3e-3 forward,
# ~5e-3 backward at the small shapes).
TOL = {
    torch.float32: {"fwd": 1e-5, "bwd": 1e-5},
    torch.bfloat16: {"fwd": 1e-2, "bwd": 2e-2},
}
DTYPES = (torch.float32, torch.bfloat16)
NAN = float("nan")

# (B, T, NH, hs): tiny, odd T, odd C (hs 20 -> C 40), hs 64
SHAPES = [(2, 5, 2, 8), (1, 9, 3, 16), (1, 16, 2, 64), (1, 7, 2, 20)]


def rel_err(out, expected):
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def poisoned(shape, dtype, device):
    return torch.full(shape, NAN, dtype=dtype, device=device)


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def split_heads(qkv, NH):
    B, T, C3 = qkv.shape
    return qkv.view(B, T, 3, NH, C3 // (3 * NH)).permute(2, 0, 3, 1, 4)


def reference_forward(qkv, NH):
    """reference.attention_forward in fp32 on qkv's device (its causal mask is made with the default
    device, hence the device context); plus the log-sum-exp of the scaled scores."""
    with torch.device(qkv.device):
        out, preatt, att = ref.attention_forward(qkv.float(), NH)
    T = qkv.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()
    lse = torch.logsumexp(preatt.masked_fill(~causal, float("-inf")), dim=-1)
    return out, att, lse


def reference_backward(dout, qkv, att, NH):
    with torch.device(qkv.device):
        return ref.attention_backward(dout.float(), qkv.float(), att, NH)


def reference_dscores(dout, qkv, att, NH):
    """The gradient of the raw scores q.k: what the in-place softmax backward leaves in datt."""
    B, T, C = dout.shape
    hs = C // NH
    v = split_heads(qkv.float(), NH)[2]
    datt = dout.float().view(B, T, NH, hs).transpose(1, 2) @ v.transpose(-1, -2)
    return att * (datt - (att * datt).sum(-1, keepdim=True)) / math.sqrt(hs)


class Classic:
    """The classic path's buffers, poisoned, and a forward + backward through them."""

    def __init__(self, B, T, NH, hs, dtype, device):
        C = NH * hs
        self.NH = NH
        self.out = poisoned((B, T, C), dtype, device)
        self.qkvr = poisoned((3, B, NH, T, hs), dtype, device)
        self.att = poisoned((B, NH, T, T), dtype, device)
        self.scratch = poisoned((B, NH, T, hs), dtype, device)
        self.dqkv = poisoned((B, T, 3 * C), dtype, device)
        self.dqkvr = poisoned((3, B, NH, T, hs), dtype, device)
        self.datt = poisoned((B, NH, T, T), dtype, device)

    def run(self, qkv, dout):
        A.attention_forward(self.out, self.qkvr, self.att, qkv, self.NH, scratch=self.scratch)
        A.attention_backward(self.dqkv, self.dqkvr, self.datt, self.scratch, dout, self.qkvr, self.att, self.NH)
        return self


def check_causal_zeros(x):
    T = x.shape[-1]
    above = ~torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    assert bool((x[..., above] == 0).all()), "entries above the diagonal must be exactly 0"


# ---------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: the classic path at small shapes

# and for the permute kernel, T in several tiles of BLOCK_T = 4096 / next_pow2(hs) rows: hs 600 (tiles of 4 rows,
# T = 7: the second partial) and hs 2050 (tiles of 1 row)
PERMUTE_SHAPES = SHAPES + [(2, 7, 2, 600), (1, 3, 1, 2050)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,NH,hs", PERMUTE_SHAPES)
def test_permute_unpermute_exact(device, B, T, NH, hs, dtype):
    C = NH * hs
    qkv = rand(B, T, 3 * C, dtype=dtype, device=device)
    qkvr = poisoned((3, B, NH, T, hs), dtype, device)
    A.permute(qkvr, qkv, NH)
    assert torch.equal(qkvr, split_heads(qkv, NH))
    dqkv = poisoned((B, T, 3 * C), dtype, device)
    A.permute_backward(dqkv, qkvr, NH)  # the inverse permutation
    assert torch.equal(dqkv, qkv)

    y = rand(B, NH, T, hs, dtype=dtype, device=device)
    out = poisoned((B, T, C), dtype, device)
    A.unpermute(out, y, NH)
    assert torch.equal(out, y.transpose(1, 2).reshape(B, T, C))
    dy = poisoned((B, NH, T, hs), dtype, device)
    A.unpermute_backward(dy, out, NH)
    assert torch.equal(dy, y)


# (B, NH, T, block): one chunk per row, T = 1, and several chunks (the online max/sum across chunks)
SOFTMAX_CASES = [(2, 2, 7, None), (1, 3, 1, None), (1, 1, 37, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,NH,T,block", SOFTMAX_CASES)
def test_softmax_forward(device, B, NH, T, block, dtype):
    scale = 0.3
    scores = rand(B, NH, T, T, dtype=dtype, device=device, scale=4.0)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    # what the GEMM leaves above the diagonal must not leak in: huge values there
    scores = scores.masked_fill(~causal, 3e4)
    expected = torch.softmax((scores.float() * scale).masked_fill(~causal, float("-inf")), dim=-1)
    att = scores.clone()
    A.attention_softmax_forward(att, scale, block=block)
    assert rel_err(att, expected) < TOL[dtype]["fwd"]
    check_causal_zeros(att)
    assert torch.allclose(att.float().sum(-1), torch.ones(B, NH, T, device=device), rtol=TOL[dtype]["fwd"] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,NH,T,block", SOFTMAX_CASES)
def test_softmax_backward_inplace(device, B, NH, T, block, dtype):
    scale = 0.3
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    att = torch.softmax(torch.randn(B, NH, T, T, device=device).masked_fill(~causal, float("-inf")), -1).to(dtype)
    datt = rand(B, NH, T, T, dtype=dtype, device=device)  # full: the GEMM writes above the diagonal too
    a, d = att.double(), datt.double()
    expected = (a * (d - (a * d).sum(-1, keepdim=True)) * scale).masked_fill(~causal, 0.0)
    A.attention_softmax_backward_inplace(datt, att, scale, block=block)
    assert rel_err(datt, expected) < TOL[dtype]["fwd"]
    check_causal_zeros(datt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,NH,hs", SHAPES)
def test_classic_attention_vs_reference(device, B, T, NH, hs, dtype):
    C = NH * hs
    qkv = rand(B, T, 3 * C, dtype=dtype, device=device)
    dout = rand(B, T, C, dtype=dtype, device=device)
    qkv_before = qkv.clone()
    r = Classic(B, T, NH, hs, dtype, device).run(qkv, dout)
    assert torch.equal(qkv, qkv_before), "qkv must stay intact when a scratch buffer is given"

    out_ref, att_ref, _ = reference_forward(qkv, NH)
    assert torch.equal(r.qkvr, split_heads(qkv, NH))
    assert rel_err(r.out, out_ref) < TOL[dtype]["fwd"]
    assert rel_err(r.att, att_ref) < TOL[dtype]["fwd"]
    check_causal_zeros(r.att)

    dqkv_ref = reference_backward(dout, qkv, att_ref, NH)
    assert rel_err(r.dqkv, dqkv_ref) < TOL[dtype]["bwd"]
    # datt ends as the gradient of the raw scores, exactly 0 above the diagonal
    assert rel_err(r.datt, reference_dscores(dout, qkv, att_ref, NH)) < TOL[dtype]["bwd"]
    check_causal_zeros(r.datt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_classic_forward_without_scratch_uses_qkv(device, dtype):
    """Without scratch, att @ v lands in qkv (llm.c's reuse); the outputs are the same bits."""
    B, T, NH, hs = 1, 9, 3, 16
    qkv = rand(B, T, 3 * NH * hs, dtype=dtype, device=device)
    a = Classic(B, T, NH, hs, dtype, device)
    A.attention_forward(a.out, a.qkvr, a.att, qkv.clone(), NH, scratch=a.scratch)
    b = Classic(B, T, NH, hs, dtype, device)
    A.attention_forward(b.out, b.qkvr, b.att, qkv.clone(), NH)
    assert torch.equal(a.out, b.out) and torch.equal(a.att, b.att) and torch.equal(a.qkvr, b.qkvr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_classic_deterministic(device, dtype):
    B, T, NH, hs = 2, 7, 2, 16
    qkv = rand(B, T, 3 * NH * hs, dtype=dtype, device=device)
    dout = rand(B, T, NH * hs, dtype=dtype, device=device)
    r1 = Classic(B, T, NH, hs, dtype, device).run(qkv, dout)
    r2 = Classic(B, T, NH, hs, dtype, device).run(qkv, dout)
    for name in ("out", "qkvr", "att", "dqkv", "datt"):
        assert torch.equal(getattr(r1, name), getattr(r2, name)), name


def test_dispatcher_classic(device):
    B, T, NH, hs, dtype = 1, 7, 2, 20, torch.bfloat16
    C = NH * hs
    if device == "cpu":
        assert A.default_attention_impl(device) == "classic"
    assert A.ATTENTION_IMPLS == ("classic", "flash", "cudnn", "cudnn+flash", "torch-cudnn", "torch-flash")
    shapes = A.attention_buffer_shapes("classic", B, T, C, NH)
    assert shapes["qkvr"] == ((3, B, NH, T, hs), "floatX") and shapes["att"] == ((B, NH, T, T), "floatX")
    for impl in ("cudnn", "torch-cudnn", "torch-flash"):
        assert A.attention_buffer_shapes(impl, B, T, C, NH) == {"lse": ((B, NH, T), "fp32")}
    for impl in ("flash", "cudnn+flash"):  # the Triton backward's delta scratch
        assert A.attention_buffer_shapes(impl, B, T, C, NH) == {"lse": ((B, NH, T), "fp32"),
                                                                "delta": ((B, NH, T), "fp32")}
    with pytest.raises(ValueError):
        A.attention_buffer_shapes("nope", B, T, C, NH)

    qkv = rand(B, T, 3 * C, dtype=dtype, device=device)
    dout = rand(B, T, C, dtype=dtype, device=device)
    direct = Classic(B, T, NH, hs, dtype, device).run(qkv, dout)
    buf = {name: poisoned(shape, dtype, device) for name, (shape, _) in shapes.items()}
    out, dqkv = poisoned((B, T, C), dtype, device), poisoned((B, T, 3 * C), dtype, device)
    A.attention_forward_any("classic", out, qkv, NH, qkvr=buf["qkvr"], att=buf["att"], scratch=buf["scratch"])
    A.attention_backward_any("classic", dqkv, dout, qkv, out, NH, **buf)
    assert torch.equal(out, direct.out) and torch.equal(dqkv, direct.dqkv)
    with pytest.raises(ValueError):
        A.attention_forward_any("nope", out, qkv, NH, lse=torch.empty(B, NH, T, device=device))
    with pytest.raises(AssertionError):
        A.attention_forward_any("classic", out, qkv, NH)  # missing qkvr, att


def test_fused_ops_schema_usable():
    """The private aten ops the fused paths call exist in this torch, and every required argument is
    one we fill (else the slower autograd fallback would run): a check of the schema adaptation."""
    for op in (A._CUDNN_FWD, A._CUDNN_BWD, A._FLASH_FWD, A._FLASH_BWD):
        assert op.usable, (op.name, op.args)
    assert "logsumexp" in A._CUDNN_FWD.returns and "philox_seed" in A._CUDNN_FWD.returns
    assert "rng_state" in A._FLASH_FWD.returns


# ---------------------------------------------------------------------------------------------------
# GPU: GPT-2 124M shapes, the fused paths, the dispatcher, determinism, CUDA graphs

def gpu_inputs(B, T, NH, hs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = NH * hs
    qkv = torch.randn(B, T, 3 * C, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(B, T, C, device="cuda", generator=g).to(torch.bfloat16)
    return qkv, dout


class Fused:
    """Buffers of a fused impl (and of classic, so the dispatcher runs any impl with one set)."""

    def __init__(self, impl, B, T, NH, hs, dtype=torch.bfloat16):
        C = NH * hs
        self.impl, self.NH = impl, NH
        self.out = poisoned((B, T, C), dtype, "cuda")
        self.dqkv = poisoned((B, T, 3 * C), dtype, "cuda")
        self.buf = {name: poisoned(shape, dtype if kind == "floatX" else torch.float32, "cuda")
                    for name, (shape, kind) in A.attention_buffer_shapes(impl, B, T, C, NH).items()}

    def forward(self, qkv):
        keys = ("qkvr", "att", "scratch") if self.impl == "classic" else ("lse",)
        A.attention_forward_any(self.impl, self.out, qkv, self.NH, **{k: self.buf[k] for k in keys})

    def backward(self, dout, qkv):
        A.attention_backward_any(self.impl, self.dqkv, dout, qkv, self.out, self.NH, **self.buf)

    def run(self, qkv, dout):
        self.forward(qkv)
        self.backward(dout, qkv)
        return self


def check_against_reference(r, qkv, dout, NH, check_lse):
    out_ref, att_ref, lse_ref = reference_forward(qkv, NH)
    tol = TOL[torch.bfloat16]
    assert rel_err(r.out, out_ref) < tol["fwd"], "out"
    if check_lse:
        assert rel_err(r.buf["lse"], lse_ref) < 1e-3, "lse"  # fp32 statistics of bf16 inputs
    del lse_ref
    dqkv_ref = reference_backward(dout, qkv, att_ref, NH)
    assert rel_err(r.dqkv, dqkv_ref) < tol["bwd"], "dqkv"


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 16])
def test_classic_gpt2_shapes(B):
    T, NH, hs = 1024, 12, 64
    qkv, dout = gpu_inputs(B, T, NH, hs)
    r = Fused("classic", B, T, NH, hs).run(qkv, dout)
    torch.cuda.synchronize()
    check_causal_zeros(r.buf["att"][0, 0])
    check_against_reference(r, qkv, dout, NH, check_lse=False)


FUSED_SHAPES = [(4, 1024, 12, 64), (2, 1024, 8, 80), (2, 1024, 8, 96), (4, 1024, 6, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,NH,hs", FUSED_SHAPES)
@pytest.mark.parametrize("impl", ["cudnn", "cudnn+flash", "torch-cudnn", "torch-flash"])
def test_fused_vs_reference(impl, B, T, NH, hs):
    qkv, dout = gpu_inputs(B, T, NH, hs)
    qkv_before = qkv.clone()
    r = Fused(impl, B, T, NH, hs).run(qkv, dout)
    torch.cuda.synchronize()
    assert torch.equal(qkv, qkv_before)
    check_against_reference(r, qkv, dout, NH, check_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", A.ATTENTION_IMPLS)
def test_dispatcher_all_impls(impl):
    B, T, NH, hs = 4, 1024, 12, 64
    qkv, dout = gpu_inputs(B, T, NH, hs, seed=1)
    r = Fused(impl, B, T, NH, hs).run(qkv, dout)
    torch.cuda.synchronize()
    check_against_reference(r, qkv, dout, NH, check_lse=impl != "classic")


@pytest.mark.gpu
def test_default_impl_gpu():
    impl = A.default_attention_impl("cuda")
    assert impl in A.ATTENTION_IMPLS
    print(f"default attention impl on this GPU: {impl}")


def _backward_twice(impl, B, T, NH, hs):
    qkv, dout = gpu_inputs(B, T, NH, hs, seed=2)
    r = Fused(impl, B, T, NH, hs)
    r.forward(qkv)
    r.backward(dout, qkv)
    first = r.dqkv.clone()
    r.dqkv.fill_(NAN)
    r.backward(dout, qkv)
    torch.cuda.synchronize()
    return first, r.dqkv.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", A.ATTENTION_IMPLS)
def test_backward_deterministic(impl):
    """Two backward passes on the same inputs give the same bits. Strict for classic, the Triton flash
    backward (ours, atomic-free by design) and cuDNN's through its frontend (built with its deterministic
    algorithm). For PyTorch's ops the result is recorded: pass when deterministic; otherwise XFAIL with
    the observed difference, and whether torch.use_deterministic_algorithms(True) makes it deterministic."""
    B, T, NH, hs = 4, 1024, 12, 64
    a, b = _backward_twice(impl, B, T, NH, hs)
    if torch.equal(a, b):
        return
    diff = float((a.float() - b.float()).abs().max())
    if impl in A.DETERMINISTIC:
        pytest.fail(f"{impl} backward is not bitwise deterministic: max |diff| {diff:.3e}")
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        a2, b2 = _backward_twice(impl, B, T, NH, hs)
        det_mode = "deterministic" if torch.equal(a2, b2) else "still NOT deterministic"
    except Exception as e:  # noqa: BLE001 - e.g. the op refuses deterministic mode
        det_mode = f"raises under deterministic mode ({type(e).__name__}: {e})"
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    pytest.xfail(f"{impl} backward is NOT bitwise deterministic by default (max |diff| {diff:.3e}); "
                 f"with torch.use_deterministic_algorithms(True): {det_mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", A.ATTENTION_IMPLS)
def test_cuda_graph_capture(impl):
    """Forward + backward captured in one CUDA graph and replayed on new inputs (the model captures
    whole steps): the replay matches the eager result (bitwise for classic and flash)."""
    B, T, NH, hs = 2, 256, 4, 64
    qkv, dout = gpu_inputs(B, T, NH, hs, seed=3)
    r = Fused(impl, B, T, NH, hs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (autotuning, cuDNN plans, RNG-state tensors)
        for _ in range(2):
            r.run(qkv, dout)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r.run(qkv, dout)
    new_qkv, new_dout = gpu_inputs(B, T, NH, hs, seed=4)
    qkv.copy_(new_qkv)
    dout.copy_(new_dout)
    graph.replay()
    torch.cuda.synchronize()
    replay_out, replay_dqkv = r.out.clone(), r.dqkv.clone()
    eager = Fused(impl, B, T, NH, hs).run(new_qkv, new_dout)
    torch.cuda.synchronize()
    if impl in A.DETERMINISTIC:
        assert torch.equal(replay_out, eager.out) and torch.equal(replay_dqkv, eager.dqkv)
    else:
        assert rel_err(replay_out, eager.out) < 1e-3 and rel_err(replay_dqkv, eager.dqkv) < 1e-2


# ----------------------------------------------------------------------------------------------------
# cuDNN through its frontend (kernels/cudnn_attention.py)

def test_cudnn_layouts_are_the_views():
    """The dims, strides and pointers the cuDNN graphs are described with are those of the strided views
    the other paths use: q, k, v inside qkv, out and dout as (B, NH, T, hs), dq, dk, dv inside dqkv."""
    from llmpy.kernels import cudnn_attention as CA

    B, T, NH, hs = 3, 5, 2, 8
    C = NH * hs
    qkv = torch.empty(B, T, 3 * C, dtype=torch.bfloat16)
    for name, view in zip("qkv", A._qkv_views(qkv, NH)):
        assert CA._strides(B, T, C, NH, hs, 3) == (list(view.shape), list(view.stride()))
        assert CA._qkv_pointers(qkv, C)[name] == view.data_ptr()
        assert CA._qkv_pointers(qkv, C, "d")["d" + name] == view.data_ptr()
    out = torch.empty(B, T, C, dtype=torch.bfloat16)
    view = A._heads_view(out, NH)
    assert CA._strides(B, T, C, NH, hs, 1) == (list(view.shape), list(view.stride()))


def test_cudnn_frontend_missing_is_one_clear_line(monkeypatch):
    """Without the frontend package: an ImportError naming the package to install (the model turns it
    into its one-line LlmpyError for attention "cudnn" / "cudnn+flash")."""
    import sys

    from llmpy.kernels import cudnn_attention as CA

    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    CA.frontend.cache_clear()
    try:
        with pytest.raises(ImportError, match="pip install nvidia-cudnn-frontend"):
            CA.frontend()
    finally:
        CA.frontend.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,NH,hs", [(3, 100, 2, 64), (2, 257, 3, 128), (1, 64, 1, 32)])
def test_cudnn_odd_shapes(B, T, NH, hs):
    """Odd lengths and head counts, against the fp32 reference; the caller's workspace gives the same bits
    as the module's own, and a workspace smaller than the graph needs is refused."""
    from llmpy.kernels import cudnn_attention as CA

    qkv, dout = gpu_inputs(B, T, NH, hs, seed=5)
    r = Fused("cudnn", B, T, NH, hs).run(qkv, dout)
    torch.cuda.synchronize()
    check_against_reference(r, qkv, dout, NH, check_lse=True)
    nbytes = CA.workspace_bytes(B, T, NH, hs, torch.bfloat16, "cuda")
    workspace = torch.full((max(1, nbytes),), 0xAB, dtype=torch.uint8, device="cuda")
    mine = Fused("cudnn", B, T, NH, hs)
    A.attention_forward_any("cudnn", mine.out, qkv, NH, lse=mine.buf["lse"], workspace=workspace)
    A.attention_backward_any("cudnn", mine.dqkv, dout, qkv, mine.out, NH, lse=mine.buf["lse"], workspace=workspace)
    torch.cuda.synchronize()
    assert torch.equal(mine.out, r.out) and torch.equal(mine.dqkv, r.dqkv)
    assert torch.equal(mine.buf["lse"], r.buf["lse"])
    if nbytes > 0:
        with pytest.raises(ValueError, match="workspace"):
            A.attention_backward_any("cudnn", mine.dqkv, dout, qkv, mine.out, NH, lse=mine.buf["lse"],
                                     workspace=workspace[:nbytes - 1])
