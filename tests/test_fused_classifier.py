"""Fused classifier against reference.fused_classifier: losses, in-place dlogits with zero padding,
the validation variant leaving the logits untouched, NaN-poisoned losses, determinism, and several
column blocks per row (the online softmax merging across blocks); GPT-2 124M shapes on the GPU."""
import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.fused_classifier import fused_classifier

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(2, 3, 61, 128), (3, 5, 50, 64), (1, 7, 37, 40)]  # (B, T, V, Vp)


def rel_err(out, expected):
    out, expected = out.double(), expected.to(out.device).double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def make_case(B, T, V, Vp, dtype, seed, scale=5.0, padding=0.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, Vp, generator=gen) * scale
    logits[..., V:] = padding  # what the model leaves there is not the kernel's business
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets.view(-1)[0] = 0  # the first and the last real column
    targets.view(-1)[-1] = V - 1
    return logits.to(dtype), targets


def reference(logits, targets, V, dloss):
    """fp32 reference of the (possibly bf16-rounded) logits, on their device (reference.fused_classifier
    builds its dloss tensor on the default device, hence the device context)."""
    with torch.device(logits.device):
        return ref.fused_classifier(logits.float(), targets.to(logits.device), V, dloss)


def run(logits, targets, V, dloss, device, write_dlogits=True, **kw):
    lg = logits.clone().to(device)
    losses = torch.full(targets.shape, float("nan"), dtype=torch.float32, device=device)
    fused_classifier(lg, losses, dloss, targets.to(device), V, write_dlogits=write_dlogits, **kw)
    return losses, lg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
@pytest.mark.parametrize("block,stages", [(None, 1), (16, 1), (32, 3)])
@pytest.mark.parametrize("tgt_dtype", [torch.int64, torch.int32])
def test_fused_classifier_train(device, dtype, B, T, V, Vp, block, stages, tgt_dtype):
    logits, targets = make_case(B, T, V, Vp, dtype, seed=B * 100 + V)
    dloss = 1.0 / (B * T * 3)
    kw = {"stages": stages} if block is None else {"block_size": block, "stages": stages}
    losses, dlogits = run(logits, targets.to(tgt_dtype), V, dloss, device, **kw)
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    assert torch.isfinite(losses).all(), "NaN-poisoned losses not written"
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert torch.isfinite(dlogits).all()
    assert rel_err(dlogits.float(), exp_dlogits) < TOL[dtype]
    assert (dlogits[..., V:] == 0).all(), "padding columns must be zero"
    # per row: the gradient sums to ~0 and is -(1 - p_target) * dloss at the target
    assert float(dlogits.float().sum(-1).abs().max()) < 50 * TOL[dtype] * dloss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
@pytest.mark.parametrize("block", [None, 16])
def test_fused_classifier_validation_leaves_logits(device, dtype, B, T, V, Vp, block):
    logits, targets = make_case(B, T, V, Vp, dtype, seed=7 + V)
    kw = {} if block is None else {"block_size": block}
    losses, after = run(logits, targets, V, 0.5, device, write_dlogits=False, **kw)
    exp_losses, _ = reference(logits, targets, V, None)
    assert torch.isfinite(losses).all()
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert torch.equal(after, logits.to(device)), "validation must not touch the logits"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_padding_garbage_and_extremes(device, dtype):
    """NaN in the padding is ignored; logits of scale 40 (probabilities that underflow, a target far
    below the max) give finite losses through the log-sum-exp form."""
    B, T, V, Vp = 2, 5, 45, 64
    logits, targets = make_case(B, T, V, Vp, dtype, seed=3, scale=40.0, padding=float("nan"))
    losses, dlogits = run(logits, targets, V, 0.25, device, block_size=16)
    exp_losses, exp_dlogits = reference(logits, targets, V, 0.25)
    assert torch.isfinite(losses).all() and torch.isfinite(dlogits).all()
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert rel_err(dlogits.float(), exp_dlogits) < TOL[dtype]
    assert (dlogits[..., V:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_deterministic(device, dtype):
    logits, targets = make_case(3, 5, 50, 64, dtype, seed=11)
    a = run(logits, targets, 50, 0.1, device, block_size=16)
    b = run(logits, targets, 50, 0.1, device, block_size=16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [4])
def test_fused_classifier_gpt2_shapes_gpu(dtype, B):
    T, V, Vp = 1024, 50257, 50304
    logits, targets = make_case(B, T, V, Vp, dtype, seed=B)
    logits, targets = logits.cuda(), targets.cuda()
    dloss = 1.0 / (B * T)
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    val_losses, after = run(logits, targets, V, dloss, "cuda", write_dlogits=False)
    assert torch.equal(after, logits)
    assert rel_err(val_losses, exp_losses) < TOL[dtype]
    losses, dlogits = run(logits, targets, V, dloss, "cuda")
    assert torch.isfinite(losses).all()
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert rel_err(dlogits.float(), exp_dlogits) < TOL[dtype]
    assert (dlogits[..., V:] == 0).all()
    again = run(logits, targets, V, dloss, "cuda")
    assert torch.equal(losses, again[0]) and torch.equal(dlogits, again[1])


@pytest.mark.gpu
def test_fused_classifier_in_cuda_graph():
    """Captured once, replayed on new logits and targets copied into the same buffers: the eager result."""
    B, T, V, Vp = 4, 1024, 50257, 50304
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=1)
    buf, tgt = logits.cuda(), targets.cuda()
    losses = torch.empty(B, T, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile before capture
        fused_classifier(buf, losses, 0.5, tgt, V)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_classifier(buf, losses, 0.5, tgt, V)
    for seed in (2, 3):
        new_logits, new_targets = make_case(B, T, V, Vp, torch.bfloat16, seed=seed)
        buf.copy_(new_logits)
        tgt.copy_(new_targets)
        graph.replay()
        eager_losses, eager_dlogits = run(new_logits, new_targets, V, 0.5, "cuda")
        torch.cuda.synchronize()
        assert torch.equal(losses, eager_losses) and torch.equal(buf, eager_dlogits)
