"""The GPU model (llmpy.model.GPT2Model) against the fp32 CPU reference: llm.c's test_gpt2cu.

The reference (reference.GPT2Reference) computes llm.c's debug state for a batch - logits, loss, the 16
gradient tensors - which is written and read back through checkpoint.save_debug_state /
load_debug_state (llm.c's exchange format); then the model, in each configuration of llm.c's flags
(-w master weights, -r recompute, -ge GELU fusion, the attention impl, bf16 or fp32), must match it:

- logits: relative error max|model - ref| / max|ref| (tolerances in TOL, per model size and dtype);
- loss: |model - ref| / max(1, |ref|);
- every gradient tensor: relative norm error ||model - ref|| / ||ref|| (llm.c's per-tensor check;
  bf16 storage rounds every activation to 8 mantissa bits, hence percent-level);
- 10 AdamW steps (clipping and weight decay on): the model's losses follow the reference's.

Also: gradient accumulation (2 micro-steps of B against one of 2B), bitwise reproducibility from the
seed, and on the GPU the CUDA-graph step bitwise equal to the eager one.

Classifier chunks (classifier_chunks=k: the logits a chunk of rows at a time, the lm_head backward in
the forward): k = 2, 3 (ragged: 32 rows) and B*T (one row a chunk) against the reference and against
k = 1. Not bitwise: a GEMM over fewer rows may take another kernel and so another reduction order (torch
2.14's CPU GEMM does for 10-11 rows against 32, cuBLAS does on the GPU, and one row a chunk takes the
single-row path everywhere), and dwte sums its chunks' products in another order; so k = 1's losses and
gradients are asserted to rounding level (fp32: rel 1e-6 and 2e-6), the reference's to the tolerances.

CPU (CI): a tiny model through Triton's interpreter, few configurations (the interpreter runs every
program in Python: a training step costs seconds). The multi-step tests use the Triton flash attention,
several times cheaper than the classic path's per-row softmax under the interpreter; the classic path is
in the configuration matrix. On a GPU machine these same tests run on CUDA (with CUDA graphs).
GPU (marker gpu): GPT-2 124M (d12) at B=4, T=64 and T=1024 against the reference run in fp32 on the GPU,
in every configuration; graphs, determinism, training, memory.
"""
import math
import re

import numpy as np
import pytest
import torch

from llmpy.checkpoint import load_debug_state, save_debug_state
from llmpy.config import PARAMETER_NAMES, GPT2Config, parameter_views, parse_descriptor
from llmpy.errors import LlmpyError
from llmpy.init import init_parameters
from llmpy.kernels import matmul as kmm
from llmpy.model import (FC_BIAS_COLUMNS, GPT2Model, activation_specs, default_classifier_chunks, format_memory,
                         memory_plan)
from llmpy.reference import GPT2Reference, clip_scale

BF16, FP32 = torch.bfloat16, torch.float32
# Tolerances per dtype: logits max|d| / max|ref|, loss |d| / max(1, |ref|), gradients ||d|| / ||ref|| per
# tensor; training: per-step loss |d| / max(1, |ref|), parameters after training ||d|| / ||ref||.
# The tiny model (CPU and GPU) is held tighter than GPT-2 124M (sums over 768-3072 channels and 4096 rows
# in bf16; llm.c's test_gpt2cu allows a few percent per gradient tensor in bf16).
TOL = {
    "tiny": {FP32: dict(logits=1e-5, loss=1e-5, grad=2e-5, train=1e-4, params=1e-4),
             BF16: dict(logits=2e-2, loss=2e-3, grad=3e-2, train=1.5e-2, params=3e-2)},
    "d12": {FP32: dict(logits=1e-4, loss=1e-5, grad=1e-4, train=1e-4, params=1e-3),
            BF16: dict(logits=3e-2, loss=2e-3, grad=6e-2, train=1.5e-2, params=5e-2)},
}

TINY = GPT2Config(max_seq_len=32, vocab_size=300, num_layers=2, num_heads=2, channels=64)
# an odd shape: head size 16, C not a power of two, vocab padded from 250 to 256
ODD = GPT2Config(max_seq_len=16, vocab_size=250, num_layers=1, num_heads=3, channels=48)
# the multi-step tests (training, accumulation, seeds): smaller still, every step costs seconds on the CPU
SMALL = GPT2Config(max_seq_len=32, vocab_size=128, num_layers=2, num_heads=2, channels=32)
B, T = 2, 16
LR, WD, CLIP = 3e-3, 0.1, 1.0
TRAIN_STEPS = 10


@pytest.fixture(autouse=True)
def _setup():
    # fp32 must mean fp32 in torch's GEMMs too. Saved and restored by hand: cuBLAS's flag lives behind the
    # module's __getattr__, which pytest >= 9.2's monkeypatch records as absent and then cannot undo
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def trained_like(config: GPT2Config, seed: int = 0) -> torch.Tensor:
    """llm.c's random init, then scaled and perturbed to look more like trained weights: larger matrices
    (peaked attention, logits of a few units), layernorm scales and shifts away from 1 and 0, non-zero
    biases. The padded rows of wte stay zero."""
    flat = init_parameters(config, seed=42)
    p = parameter_views(flat, config)
    g = torch.Generator().manual_seed(seed)
    for name in ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"):
        p[name].mul_(4.0)
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name].add_(0.1 * torch.randn(p[name].shape, generator=g))
    for name in ("ln1b", "ln2b", "lnfb", "qkvb", "attprojb", "fcb", "fcprojb"):
        p[name].copy_(0.05 * torch.randn(p[name].shape, generator=g))
    return flat


def make_batch(config: GPT2Config, B: int, T: int, seed: int):
    """(inputs, targets): tokens with a learnable rule (target = a fixed function of the input), so
    training lowers the loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (B, T), generator=g)
    return x, (x * 7 + 3) % config.vocab_size


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def reference_debug_state(config, params, x, y, device="cpu"):
    """llm.c's debug state from the fp32 reference: logits (B, T, V), loss, flat gradients (CPU)."""
    ref = GPT2Reference(config, params.to(device))
    loss = ref.forward(x.to(device), y.to(device))
    logits = ref.logits[..., :config.vocab_size].cpu()
    ref.zero_grad()
    ref.backward()
    grads = ref.grads_flat.cpu()
    del ref
    return {"logits": logits, "loss": loss, "grads": grads}


def reference_training(config, params, batches, steps, device="cpu"):
    """Losses, norms and final parameters of `steps` AdamW steps of the reference, cycling over batches."""
    ref = GPT2Reference(config, params.to(device))
    losses, norms = [], []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        ref.zero_grad()
        losses.append(ref.forward(x.to(device), y.to(device)))
        ref.backward()
        norm = ref.grad_norm()
        norms.append(norm)
        ref.update(LR, step + 1, weight_decay=WD, grad_scale=clip_scale(norm, CLIP))
    return losses, norms, ref.params_flat.cpu()


def check_against(model: GPT2Model, state, x, y, dtype, label="", scale="tiny"):
    """Logits, loss and every gradient of model on (x, y) against a debug state."""
    tol = TOL[scale][dtype]
    cfg = model.config
    model.forward(x, y)  # the validation variant: the logits stay (unchunked)
    if model.classifier_chunks == 1:  # chunked, no forward keeps them all: the losses and gradients tell
        logits = model.logits_view()[..., :cfg.vocab_size].float().cpu()
        assert torch.isfinite(logits).all(), f"{label}: non-finite logits"
        err = max_rel_err(logits, state["logits"])
        assert err < tol["logits"], f"{label}: logits max relative error {err:.3g} >= {tol['logits']}"
    loss = model.loss()
    assert abs(loss - state["loss"]) < tol["loss"] * max(1.0, abs(state["loss"])), \
        f"{label}: loss {loss} vs reference {state['loss']}"

    model.zero_grad()
    model.forward(x, y, dloss=1.0 / (x.numel()))
    assert model.loss() == pytest.approx(loss, rel=1e-6), f"{label}: training and validation forwards differ"
    model.backward()
    grads = parameter_views(model.gradients_fp32(), cfg)
    expected = parameter_views(state["grads"], cfg)
    errors = {name: rel_err(grads[name], expected[name]) for name in PARAMETER_NAMES}
    bad = {n: f"{e:.3g}" for n, e in errors.items() if not e < tol["grad"]}
    assert not bad, f"{label}: gradient relative errors above {tol['grad']}: {bad} (all: " \
                    f"{ {n: f'{e:.2g}' for n, e in errors.items()} })"
    # the padding rows of wte get no gradient
    assert not grads["wte"][cfg.vocab_size:].any(), f"{label}: gradient in the padded rows of wte"


# ----------------------------------------------------------------------------------------------------
# CPU (and small on the GPU): the tiny model

@pytest.fixture(scope="module")
def tiny():
    """Parameters, a batch, and the reference's debug state, written and read back in llm.c's format."""
    params = trained_like(TINY)
    x, y = make_batch(TINY, B, T, seed=1)
    return params, x, y, reference_debug_state(TINY, params, x, y)


def test_debug_state_round_trip(tiny, tmp_path):
    params, x, y, state = tiny
    path = tmp_path / "gpt2_tiny_debug_state.bin"
    save_debug_state(path, TINY, x, y, state["logits"], state["loss"], state["grads"])
    back = load_debug_state(path, TINY)
    assert (back["B"], back["T"]) == (B, T)
    assert torch.equal(back["inputs"], x.int()) and torch.equal(back["targets"], y.int())
    assert torch.equal(back["logits"], state["logits"]) and torch.equal(back["grads"], state["grads"])
    assert back["loss"] == pytest.approx(state["loss"], rel=1e-7)  # stored as fp32


# (kwargs, dtype): the default (bf16, master weights, recompute 1, gelu fusion 0: the GELU passes and the
# fused dgelu + bias gradient), llm.c's -r 2, -r 0 with both GELU epilogues (-ge 2), -ge 1 with the flash
# kernel, fp32
CPU_CONFIGS = {
    "default": {},
    "r2": dict(recompute=2),
    "r0-ge2": dict(recompute=0, gelu_fusion=2),
    "ge1-flash": dict(gelu_fusion=1, attention="flash"),
    "fp32": dict(dtype=FP32),
    # attproj's and fcproj's bias gradients in reduction passes of their own (the default sums them in the
    # LayerNorm backward), at -ge 0 and -ge 2
    "proj-bias-pass": dict(proj_bias_in_layernorm=False, attention="flash"),
    "proj-bias-pass-ge2-fp32": dict(proj_bias_in_layernorm=False, gelu_fusion=2, dtype=FP32),
    # the residual add in the projections' product (here torch's addmm onto the residual; cuBLASLt's
    # epilogue on the GPU), alone and with the option above
    "residual-in-product": dict(residual_in_product=True),
    "residual-in-product-proj-bias-pass-fp32": dict(residual_in_product=True, proj_bias_in_layernorm=False,
                                                    dtype=FP32, attention="flash"),
    # fc's bias gradient from its weight-gradient product (the default at -ge 2: ln2 with a column of ones),
    # with ln2 recomputed in the backward, after the residual add in the product, and the reduction pass
    "r2-ge2": dict(recompute=2, gelu_fusion=2),
    "residual-in-product-ge2": dict(residual_in_product=True, gelu_fusion=2, attention="flash"),
    "ge2-fc-bias-pass": dict(recompute=0, gelu_fusion=2, fc_bias_in_product=False),
}


def test_fc_bias_in_product_where_the_pass_is(tiny, device):
    """On by default at -ge 2 only (ln2 then has FC_BIAS_COLUMNS more columns); asked for elsewhere, an
    error that says why."""
    params = tiny[0]
    ge2 = GPT2Model(TINY, params, B, T, device=device, gelu_fusion=2, attention="flash", cuda_graph=False)
    ge0 = GPT2Model(TINY, params, B, T, device=device, gelu_fusion=0, attention="flash", cuda_graph=False)
    assert ge2.fc_bias_in_product and not ge0.fc_bias_in_product
    C = TINY.channels
    assert ge2.acts["ln2"].shape[-1] == C + FC_BIAS_COLUMNS and ge0.acts["ln2"].shape[-1] == C
    with pytest.raises(LlmpyError, match="fc_bias_in_product needs -ge 2"):
        GPT2Model(TINY, params, B, T, device=device, gelu_fusion=1, fc_bias_in_product=True)


@pytest.mark.parametrize("name", list(CPU_CONFIGS))
def test_matches_reference(tiny, tmp_path, device, name):
    params, x, y, state = tiny
    path = tmp_path / "debug_state.bin"
    save_debug_state(path, TINY, x, y, state["logits"], state["loss"], state["grads"])
    state = load_debug_state(path, TINY)  # what llm.c's test reads
    kw = dict(attention="classic")
    kw.update(CPU_CONFIGS[name])
    dtype = kw.get("dtype", BF16)
    model = GPT2Model(TINY, params, B, T, device=device, **kw)
    check_against(model, state, state["inputs"], state["targets"], dtype, name)


@pytest.mark.parametrize("q_sums", [False, True], ids=["q-pass", "q-sums"])
@pytest.mark.parametrize("proj_bias_in_layernorm", [True, False])
def test_qkv_bias_gradient_parts(tiny, device, monkeypatch, proj_bias_in_layernorm, q_sums):
    """The QKV bias gradient as kernels.matmul.qkv_bias_backward makes it: the key part exactly zero (the
    loss does not depend on the key bias), the value part equal to the column sums of dv within fp32
    rounding, whether it comes through attproj's weight (proj_bias_in_layernorm) or from dv; the query part
    from a pass over dq or from the attention backward's block sums (QKV_QUERY_SUMS_FROM_ATTENTION)."""
    params, x, y, state = tiny
    monkeypatch.setattr(kmm, "QKV_QUERY_SUMS_FROM_ATTENTION", q_sums)
    model = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash",
                      proj_bias_in_layernorm=proj_bias_in_layernorm)
    assert (model.acts.get("q_bias_sums") is not None) == q_sums
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / x.numel())
    model.backward()
    C = TINY.channels
    got = parameter_views(model.gradients_fp32(), TINY)["qkvb"].view(TINY.num_layers, 3 * C)
    expected = parameter_views(state["grads"], TINY)["qkvb"].view(TINY.num_layers, 3 * C)
    assert torch.equal(got[:, C:2 * C], torch.zeros_like(got[:, C:2 * C]))
    assert expected[:, C:2 * C].abs().max() < 1e-6 * expected.abs().max()  # the reference's: rounding only
    for part in (slice(0, C), slice(2 * C, 3 * C)):
        assert rel_err(got[:, part], expected[:, part]) < 1e-5


def test_odd_shape_matches_reference(device):
    """Head size 16, C = 48, vocab 250: fp32, both attention paths, both GELU epilogues (-ge 2)."""
    params = trained_like(ODD, seed=3)
    x, y = make_batch(ODD, 2, 12, seed=4)
    state = reference_debug_state(ODD, params, x, y)
    for attention in ("classic", "flash"):
        model = GPT2Model(ODD, params, 2, 12, device=device, dtype=FP32, attention=attention, gelu_fusion=2,
                          recompute=2)
        check_against(model, state, x, y, FP32, f"odd {attention}")


def _one_step(model, x, y):
    """Validation losses, training losses, and the gradients of one training forward + backward."""
    model.forward(x, y)
    val = model.acts["losses"].cpu().clone()
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / x.numel())
    train = model.acts["losses"].cpu().clone()
    model.backward()
    return val, train, parameter_views(model.gradients_fp32(), model.config)


def test_classifier_chunks_match(tiny, device):
    """fp32, k = 2, 3 (32 rows: chunks of 10, 11, 11), B*T: the reference's loss and gradients, and k = 1's
    to rounding level (see the module docstring)."""
    params, x, y, state = tiny
    tol = TOL["tiny"][FP32]
    expected = parameter_views(state["grads"], TINY)
    one = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash", classifier_chunks=1)
    v1, t1, g1 = _one_step(one, x, y)
    for k in (2, 3, B * T):
        model = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash", classifier_chunks=k)
        assert model.classifier_chunks == k
        vk, tk, gk = _one_step(model, x, y)
        assert torch.equal(vk, tk), f"chunks {k}: training and validation losses differ"
        loss = float(tk.double().mean())
        assert abs(loss - state["loss"]) < tol["loss"] * max(1.0, abs(state["loss"])), f"chunks {k}: loss {loss}"
        assert max_rel_err(tk, t1) < 1e-6, f"chunks {k}: losses {max_rel_err(tk, t1):.3g} from those of chunks 1"
        for name in PARAMETER_NAMES:
            err = rel_err(gk[name], expected[name])
            assert err < tol["grad"], f"chunks {k}: {name} relative error {err:.3g} against the reference"
            err = rel_err(gk[name], g1[name])
            assert err < 2e-6, f"chunks {k}: {name} relative error {err:.3g} against chunks 1"
        assert not gk["wte"][TINY.vocab_size:].any(), f"chunks {k}: gradient in the padded rows of wte"
    # the logits buffer holds the largest chunk (one row at k = B*T), not B*T rows
    assert model.acts["output"].numel() == TINY.padded_vocab_size
    with pytest.raises(LlmpyError, match="classifier_chunks"):
        model.logits_view()


def test_classifier_chunks_bf16_classic(tiny, device):
    """bf16, classic attention (its qkv and datt scratch share the chunk-sized logits buffer), k = 3."""
    params, x, y, state = tiny
    model = GPT2Model(TINY, params, B, T, device=device, attention="classic", classifier_chunks=3)
    C, NH = TINY.channels, TINY.num_heads
    assert model.acts["output"].numel() == max(-(-B * T // 3) * TINY.padded_vocab_size, B * T * 3 * C, B * NH * T * T)
    assert "datt" not in model.acts
    check_against(model, state, x, y, BF16, "bf16 classic chunks 3")


def test_logits_last_and_parameters(tiny, device):
    """Sampling's logits (a shorter context in a (B, T) batch), and the parameters in and out."""
    params, x, _, _ = tiny
    model = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash")
    ctx = x[0, :7]
    ref = GPT2Reference(TINY, params)
    ref.forward(ctx[None])
    got = model.logits_last(ctx.tolist())
    assert got.shape == (1, TINY.vocab_size)
    assert max_rel_err(got[0], ref.logits[0, -1, :TINY.vocab_size]) < TOL["tiny"][FP32]["logits"]
    # chunked (one row a chunk: the two rows come out a chunk at a time)
    chunked = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash", classifier_chunks=B * T)
    both = chunked.logits_last(x[:, :7])
    assert both.shape == (2, TINY.vocab_size)
    assert max_rel_err(both[0], got[0]) < 1e-6
    ref.forward(x[1:, :7])
    assert max_rel_err(both[1], ref.logits[0, -1, :TINY.vocab_size]) < TOL["tiny"][FP32]["logits"]
    assert torch.equal(model.parameters_fp32(), params)
    other = params * 0.5
    model.load_parameters(other)
    assert torch.equal(model.parameters_fp32(), other)
    bf = GPT2Model(TINY, params, B, T, device=device, attention="flash")  # bf16 + master weights
    assert torch.equal(bf.parameters_fp32(), params)  # from the fp32 master copy
    assert torch.equal(bf.params_memory.cpu(), params.to(BF16))


def test_bad_inputs(tiny, device):
    params, x, y, _ = tiny
    model = GPT2Model(TINY, params, B, T, device=device, dtype=FP32, attention="flash")
    with pytest.raises(LlmpyError, match="outside"):
        model.forward(torch.full((B, T), TINY.vocab_size), y)
    with pytest.raises(LlmpyError, match="B=2, T=16"):
        model.forward(x[:, :8], y[:, :8])
    with pytest.raises(LlmpyError, match="B=2, T=16"):
        model.train_step([(x[:1], y[:1])], LR, 1)
    outside = f"outside the model's vocabulary [0, {TINY.vocab_size})"
    with pytest.raises(LlmpyError, match=re.escape(f"micro-batch 0: targets hold token id {TINY.vocab_size} at "
                                                   f"[0, 0], {outside}")):
        model.train_step([(x, torch.full((B, T), TINY.vocab_size))], LR, 1)
    with pytest.raises(LlmpyError, match=re.escape(f"micro-batch 0: inputs hold token id -1 at [0, 0], {outside}")):
        model.train_step([(x.numpy() * 0 - 1, y)], LR, 1)
    for dtype in (np.int32, np.int16):  # negatives read as unsigned by the check: huge, so rejected
        with pytest.raises(LlmpyError, match=re.escape(f"inputs hold token id -1 at [0, 0], {outside}")):
            model.train_step([((x.numpy() * 0 - 1).astype(dtype), y)], LR, 1)
    with pytest.raises(LlmpyError, match="backward"):  # the reference's misuse is one line too
        model.backward()
    with pytest.raises(LlmpyError, match="dloss"):
        model.forward(x, dloss=1.0)
    with pytest.raises(LlmpyError, match="-r 3"):
        GPT2Model(TINY, params, B, T, device=device, recompute=3)
    with pytest.raises(LlmpyError, match="-t 64"):
        GPT2Model(TINY, params, B, 64, device=device)
    for k in (0, B * T + 1):
        with pytest.raises(LlmpyError, match="classifier_chunks"):
            GPT2Model(TINY, params, B, T, device=device, classifier_chunks=k)


@pytest.fixture(scope="module")
def small():
    """SMALL's parameters, three batches, and the reference's TRAIN_STEPS steps over them."""
    params = trained_like(SMALL, seed=5)
    batches = [make_batch(SMALL, B, T, seed=10 + i) for i in range(3)]
    return params, batches, reference_training(SMALL, params, batches, TRAIN_STEPS)


@pytest.mark.parametrize("kw", [pytest.param(dict(dtype=FP32), id="fp32"), pytest.param({}, id="bf16"),
                                pytest.param(dict(master_weights=False), id="bf16-w0"),
                                pytest.param(dict(dtype=FP32, classifier_chunks=3), id="fp32-chunks3"),
                                pytest.param(dict(proj_bias_in_layernorm=False), id="bf16-proj-bias-pass"),
                                pytest.param(dict(residual_in_product=True), id="bf16-residual-in-product")])
def test_training_follows_reference(small, device, kw):
    """TRAIN_STEPS steps of AdamW (weight decay, clipping active: the first norms are above CLIP)."""
    params, batches, (ref_losses, ref_norms, ref_params) = small
    assert ref_norms[0] > CLIP, "the test should exercise clipping"
    dtype = kw.get("dtype", BF16)
    tol = TOL["tiny"][dtype]
    model = GPT2Model(SMALL, params, B, T, device=device, attention="flash", **kw)
    for step in range(TRAIN_STEPS):
        loss, norm = model.train_step([batches[step % len(batches)]], LR, step + 1, WD, CLIP)
        assert abs(loss - ref_losses[step]) < tol["train"] * max(1.0, ref_losses[step]), \
            f"step {step + 1}: loss {loss} vs reference {ref_losses[step]}"
        assert abs(norm - ref_norms[step]) < 10 * tol["train"] * max(1.0, ref_norms[step]), \
            f"step {step + 1}: norm {norm} vs reference {ref_norms[step]}"
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the reference should be learning"
    err = rel_err(model.parameters_fp32(), ref_params)
    assert err < tol["params"], f"parameters after training, relative error {err:.3g}"


def test_gradient_accumulation(small, device):
    """Two micro-steps of B=1 give the step of one micro-batch of B=2 (fp32: to rounding), and so does an update()
    after it."""
    params = small[0]
    x, y = make_batch(SMALL, 2, T, seed=20)
    one = GPT2Model(SMALL, params, 2, T, device=device, dtype=FP32, attention="flash")
    two = GPT2Model(SMALL, params, 1, T, device=device, dtype=FP32, attention="flash")
    loss1, norm1 = one.train_step([(x, y)], LR, 1, WD, CLIP)
    loss2, norm2 = two.train_step([(x[:1], y[:1]), (x[1:], y[1:])], LR, 1, WD, CLIP)
    assert loss2 == pytest.approx(loss1, abs=1e-5)
    assert norm2 == pytest.approx(norm1, rel=1e-5)
    assert rel_err(two.gradients_fp32(), one.gradients_fp32()) < 1e-5
    # AdamW's first step is about lr * sign(g): where a gradient is ~0 its sign follows rounding noise, so
    # the parameters agree to the gradients' accuracy only in norm (1.8e-5 seen on an H200)
    assert rel_err(two.parameters_fp32(), one.parameters_fp32()) < 1e-4
    # update() right after: its gradient (and clip) is the step's sum, the one grad_norm() reports - not the last
    # micro-step's left in the buffer under the sum's norm - so both take the same second step
    assert two.grad_norm() == pytest.approx(norm2, rel=1e-6)
    for model in (one, two):
        model.update(LR, 2, weight_decay=WD, grad_clip=CLIP)
    assert rel_err(two.parameters_fp32(), one.parameters_fp32()) < 1e-4
    # a backward makes the buffer the gradient again (here without zero_grad: added to the last micro-step's)
    two.forward(x[:1], y[:1], dloss=1.0 / T)
    two.backward()
    assert two.grad_norm() == pytest.approx(float(two.gradients_fp32().double().norm()), rel=1e-5)
    # chunked: dwte accumulates over the chunks of a micro-step, the micro-steps add in the fp32 accumulator
    chk = GPT2Model(SMALL, params, 1, T, device=device, dtype=FP32, attention="flash", classifier_chunks=3)
    loss3, norm3 = chk.train_step([(x[:1], y[:1]), (x[1:], y[1:])], LR, 1, WD, CLIP)
    assert loss3 == pytest.approx(loss1, abs=1e-5) and norm3 == pytest.approx(norm1, rel=1e-5)
    assert rel_err(chk.gradients_fp32(), one.gradients_fp32()) < 1e-5


def test_same_seed_same_bits(small, device):
    """bf16 without master weights: every update is stochastically rounded into the parameters, so the
    seed decides the bits; the same seed gives the same bits, another seed others."""
    params = small[0]
    batches = [make_batch(SMALL, B, T, seed=30 + i) for i in range(2)]
    runs = []
    for seed, steps in ((7, 2), (7, 2), (8, 1)):
        model = GPT2Model(SMALL, params, B, T, device=device, attention="flash", master_weights=False, seed=seed)
        losses, snapshots = [], []
        for s in range(steps):
            losses.append(model.train_step([batches[s]], LR, s + 1, WD, CLIP))
            snapshots.append(model.params_memory.cpu().view(torch.int16).clone())
        runs.append((losses, snapshots))
    (la, pa), (lb, pb), (lc, pc) = runs
    assert la == lb, "same seed, different losses"
    assert all(torch.equal(a, b) for a, b in zip(pa, pb)), "same seed, different parameter bits"
    # the first loss does not depend on the rounding seed (the first norm does: bf16 gradients are rounded
    # stochastically)
    assert lc[0][0] == la[0][0]
    assert not torch.equal(pc[0], pa[0]), "another seed, the same rounding: the seed is not used"


def test_attention_choices_checked():
    """The CUDA-only paths are refused off the GPU with one clear line, as are unknown names; the cuDNN
    paths have no fp32 kernels (checked before the device on the GPU; here the device check comes first)."""
    from llmpy.model import _resolve_attention

    cpu = torch.device("cpu")
    for att in ("cudnn", "cudnn+flash", "torch-cudnn", "torch-flash"):
        with pytest.raises(LlmpyError, match=f"attention '{re.escape(att)}' needs a CUDA device"):
            _resolve_attention(att, cpu, BF16)
    with pytest.raises(LlmpyError, match="choose one of auto, classic, flash, cudnn, cudnn\\+flash"):
        _resolve_attention("cudnn-flash", cpu, BF16)
    assert _resolve_attention("flash", cpu, FP32) == "flash" and _resolve_attention("auto", cpu, BF16) == "classic"


def test_memory_plan():
    """The buffer plan at GPT-2 124M, B=64, T=1024 (no allocation): -r 0 within 28 GiB, -r 1 and -r 2 less;
    and the plan of a built model is what its arenas hold."""
    cfg = parse_descriptor("d12")
    totals = {r: memory_plan(cfg, 64, 1024, BF16, True, r, "cudnn")["total"] for r in (0, 1, 2)}
    assert totals[0] <= 28 * 2**30, format_memory(memory_plan(cfg, 64, 1024, BF16, True, 0, "cudnn"))
    assert totals[2] < totals[1] < totals[0]
    # the classic path keeps (B, NH, T, T) per layer: far more
    assert memory_plan(cfg, 64, 1024, BF16, True, 1, "classic")["total"] > totals[1] + 16 * 2**30


def test_memory_plan_classifier_chunks():
    """d12, B=64, T=1024: the default cuts the logits into 8 chunks of 8192 rows (0.77 GiB, bf16), the plan
    drops by 7/8 of the 6.14 GiB logits, and the chunk shares its bytes with the backward's scratch (-5
    B*T*C): 28.80 GB -> 22.53 GB at -r 0 (dlnf reuses scratch_bt4c)."""
    cfg = parse_descriptor("d12")
    Vp = cfg.padded_vocab_size
    assert default_classifier_chunks(cfg, 64, 1024, BF16) == 8
    assert default_classifier_chunks(cfg, 64, 1024, FP32) == 16
    assert default_classifier_chunks(cfg, 4, 64, BF16) == 1  # small batches: unchunked
    assert default_classifier_chunks(cfg, 24, 1024, BF16) == 3  # 2.47 GB of logits
    for att in ("flash", "cudnn"):
        full = memory_plan(cfg, 64, 1024, BF16, True, 0, att, classifier_chunks=1)
        auto = memory_plan(cfg, 64, 1024, BF16, True, 0, att)  # None: the default, 8
        assert full["buffers"]["output"] == 64 * 1024 * Vp * 2
        assert auto["buffers"]["output"] == 8192 * Vp * 2
        btc = 64 * 1024 * cfg.channels * 2
        assert full["total"] - auto["total"] == 7 * 8192 * Vp * 2 + 5 * btc
        # one new buffer, the region; the chunk and the three scratch buffers are views of it
        assert set(auto["buffers"]) == set(full["buffers"]) | {"shared_scratch"} and not full["shared"]
        assert auto["shared"] == dict.fromkeys(("scratch_bt4c", "dresidual", "scratch_btc", "output"),
                                               "shared_scratch")
        assert auto["buffers"]["shared_scratch"] == btc + 8192 * Vp * 2
        # under the 24 GB goal with room for what the GPU adds (CUDA context, libraries: ~0.9 GB on an H200)
        assert auto["total"] <= 22.6e9, format_memory(auto)
    # classic: the buffer also holds datt (B, NH, T, T), larger than a chunk at T=1024; no datt of its own
    classic = memory_plan(cfg, 64, 1024, BF16, True, 1, "classic")
    assert classic["buffers"]["output"] == 64 * cfg.num_heads * 1024 * 1024 * 2 and "datt" not in classic["buffers"]


@pytest.mark.parametrize("B_,T_,k", [(64, 1024, 8), (2, 16, 2), (2, 16, 32), (3, 5, 3)])
def test_shared_scratch_layout(B_, T_, k):
    """Chunked, the logits chunk and the backward's scratch are views of one region: the three scratch
    buffers apart from each other, the chunk inside the region and clear of dlnf (scratch_bt4c's first
    B*T*C elements, live from the classifier section to the backward's first layernorm), every view
    aligned; unchunked or classic, nothing is shared."""
    cfg = parse_descriptor("d12") if B_ == 64 else TINY
    C = cfg.channels
    specs = {s.name: s for s in activation_specs(cfg, B_, T_, BF16, 0, "flash", classifier_chunks=k)}
    region = specs["shared_scratch"].numel

    def span(name):
        s = specs[name]
        off = s.within[1]
        assert s.within[0] == "shared_scratch" and off % 128 == 0 and off + s.numel <= region, name
        return off, off + s.numel

    bt4c, dres, btc, out = (span(n) for n in ("scratch_bt4c", "dresidual", "scratch_btc", "output"))
    assert bt4c[1] <= dres[0] and dres[1] <= btc[0]
    assert out[0] >= bt4c[0] + B_ * T_ * C  # clear of dlnf
    assert specs["output"].numel == -(-B_ * T_ // k) * cfg.padded_vocab_size
    assert region == max(btc[1], out[1])
    for kw in (dict(attention="flash", classifier_chunks=1), dict(attention="classic", classifier_chunks=k)):
        plain = activation_specs(cfg, B_, T_, BF16, 0, **kw)
        assert all(s.within is None for s in plain) and "shared_scratch" not in {s.name for s in plain}


def test_memory_plan_matches_allocation(tiny):
    params = tiny[0]
    model = GPT2Model(TINY, params, B, T, device="cpu", attention="classic", recompute=2)
    plan = model.memory_report()
    arena = sum(b.numel() * b.element_size() for b in model.acts.buffers)
    groups = plan["groups"]
    counted = groups["activations"] + groups["scratch"]
    # the plan also counts the integer buffers allocated apart (inputs, targets, the encoder's sort)
    assert 0 <= counted - arena <= 16 * 1024
    assert groups["master"] == 4 * TINY.num_parameters + (-4 * TINY.num_parameters) % 256
    assert "ln1" in plan["buffers"] and model.acts["ln1"].shape[0] == 1  # -r 2: one shared ln1
    chunked = GPT2Model(TINY, params, B, T, device="cpu", attention="flash", classifier_chunks=4)
    plan = chunked.memory_report()
    arena = sum(b.numel() * b.element_size() for b in chunked.acts.buffers)
    assert 0 <= plan["groups"]["activations"] + plan["groups"]["scratch"] - arena <= 16 * 1024
    assert plan["buffers"]["output"] == B * T // 4 * TINY.padded_vocab_size * 2


# ----------------------------------------------------------------------------------------------------
# GPU: GPT-2 124M

D12_B = 4
GPU_CONFIGS = {
    "default": dict(gelu_fusion=-1),
    "w0": dict(master_weights=False, gelu_fusion=-1),
    "r0": dict(recompute=0, gelu_fusion=-1),
    "r2": dict(recompute=2, gelu_fusion=-1),
    "ge0": dict(gelu_fusion=0),
    "ge1": dict(gelu_fusion=1),
    "ge2": dict(gelu_fusion=2),
    # the GELU epilogues in our Triton GEMM, where the default picks cuBLASLt's
    "ge1-triton": dict(gelu_fusion=1, use_cublaslt=False),
    "ge2-triton": dict(gelu_fusion=2, use_cublaslt=False),
    "proj-bias-pass": dict(proj_bias_in_layernorm=False, gelu_fusion=-1),
    "fc-bias-pass": dict(fc_bias_in_product=False, gelu_fusion=2),
    "r2-ge2": dict(recompute=2, gelu_fusion=2),
    "residual-in-product": dict(residual_in_product=True, gelu_fusion=-1),
    "residual-in-product-fp32": dict(residual_in_product=True, dtype=FP32, gelu_fusion=-1),
    "classic": dict(attention="classic", gelu_fusion=-1),
    "flash": dict(attention="flash", gelu_fusion=-1),
    "cudnn": dict(attention="cudnn", gelu_fusion=-1),
    "cudnn+flash": dict(attention="cudnn+flash", gelu_fusion=-1),
    "torch-cudnn": dict(attention="torch-cudnn", gelu_fusion=-1),
    "torch-flash": dict(attention="torch-flash", gelu_fusion=-1),
    "fp32": dict(dtype=FP32, gelu_fusion=-1),
    "fp32-classic": dict(dtype=FP32, attention="classic", gelu_fusion=-1),
    # the classifier in chunks (B=4: 256 / 4096 rows): 8 even ones, 3 ragged ones, classic sharing the buffer
    "chunks8": dict(classifier_chunks=8, gelu_fusion=-1),
    "chunks3": dict(classifier_chunks=3, attention="flash", gelu_fusion=-1),
    "chunks8-classic": dict(classifier_chunks=8, attention="classic", gelu_fusion=-1),
    "fp32-chunks8": dict(dtype=FP32, classifier_chunks=8, gelu_fusion=-1),
}


@pytest.fixture(scope="module")
def d12():
    cfg = parse_descriptor("d12")
    return cfg, init_parameters(cfg, seed=42)


@pytest.fixture(scope="module")
def d12_states(d12):
    """Reference debug states at B=4, T=64 and T=1024, run in fp32 on the GPU (kept on the CPU)."""
    cfg, params = d12
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # (module fixtures run before the autouse _setup)
    try:
        states = {}
        for t in (64, 1024):
            x, y = make_batch(cfg, D12_B, t, seed=t)
            states[t] = (x, y, reference_debug_state(cfg, params, x, y, device="cuda"))
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return states


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 1024])
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_d12_matches_reference(d12, d12_states, name, t):
    cfg, params = d12
    x, y, state = d12_states[t]
    kw = GPU_CONFIGS[name]
    model = GPT2Model(cfg, params, D12_B, t, device="cuda", **kw)
    check_against(model, state, x, y, kw.get("dtype", BF16), f"d12 T={t} {name} ({model.describe()})", "d12")


def _d12_steps(cfg, params, batches, steps, **kw):
    model = GPT2Model(cfg, params, D12_B, 64, device="cuda", **kw)
    out = [model.train_step([batches[s % len(batches)]], LR, s + 1, WD, CLIP) for s in range(steps)]
    return out, model


def _five_steps(cfg, params, batches, accum, skip=None, **kw):
    """5 train_steps of a fresh d12 model at B=4, T=64 over the 3 batches, accum micro-steps each:
    (losses and norms, bf16 parameters, fp32 master weights)."""
    model = GPT2Model(cfg, params, D12_B, 64, device="cuda", **kw)
    steps = [model.train_step([batches[(s + k) % 3] for k in range(accum)], LR, s + 1, WD, CLIP, skip=skip)
             for s in range(5)]
    return steps, model.params_memory.clone(), model.master_memory.clone()


def _assert_same_bits(a, b, what):
    (sa, pa, ma), (sb, pb, mb) = a, b
    assert sa == sb, f"losses/norms differ {what}: {sa} vs {sb}"
    assert torch.equal(pa.view(torch.int16), pb.view(torch.int16)) and torch.equal(ma, mb), f"parameters differ {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("skip,accum,chunks,ge,proj", [(False, 1, 1, -1, False), (True, 1, 1, -1, False),
                                                       (False, 2, 1, -1, False), (False, 2, 8, -1, False),
                                                       (False, 1, 1, 2, False), (False, 2, 1, -1, "pass"),
                                                       (False, 2, 8, -1, "residual")])
def test_gpu_cuda_graph_bitwise(d12, skip, accum, chunks, ge, proj):
    """The graphed step (whole step; or two graphs around a skip decision; with gradient accumulation)
    gives the eager step's bits. The flash kernel: cuDNN's backward need not be reproducible."""
    cfg, params = d12
    batches = [make_batch(cfg, D12_B, 64, seed=100 + i) for i in range(3)]
    decide = (lambda loss, norm: False) if skip else None
    eager, graphed = (_five_steps(cfg, params, batches, accum, skip=decide, attention="flash", gelu_fusion=ge,
                                  cuda_graph=graph, classifier_chunks=chunks, proj_bias_in_layernorm=proj != "pass",
                                  residual_in_product=proj == "residual")
                      for graph in (False, True))
    _assert_same_bits(eager, graphed, "with the graph")


@pytest.mark.gpu
@pytest.mark.parametrize("mode,graph,accum,kw", [
    ("on", True, 1, {}), ("priority", True, 1, {}), ("on", False, 1, {}), ("priority", True, 2, {}),
    ("on", True, 2, dict(classifier_chunks=1, recompute=2)), ("priority", True, 1, dict(gelu_fusion=0)),
    ("on", True, 1, dict(attention="classic")), ("on", True, 1, dict(proj_bias_in_layernorm=False))])
def test_gpu_overlap_bitwise(d12, mode, graph, accum, kw):
    """The weight gradients on a second stream (overlap_weight_grads) give the one-stream step's bits:
    losses, norms, parameters and master weights after 5 steps (at T=64 every kernel is short, so the
    two streams really run side by side: a missing wait would show as a race)."""
    cfg, params = d12
    batches = [make_batch(cfg, D12_B, 64, seed=400 + i) for i in range(3)]
    one, two = (_five_steps(cfg, params, batches, accum, cuda_graph=graph, overlap_weight_grads=overlap,
                            **{"attention": "flash", **kw})
                for overlap in ("off", mode))
    _assert_same_bits(one, two, f"with overlap {mode}")


@pytest.mark.gpu
def test_gpu_skip_leaves_parameters(d12):
    cfg, params = d12
    x, y = make_batch(cfg, D12_B, 64, seed=5)
    model = GPT2Model(cfg, params, D12_B, 64, device="cuda")
    for step in range(3):  # eager warm-up, capture, replay
        before = model.params_memory.clone()
        model.train_step([(x, y)], LR, step + 1, WD, CLIP, skip=lambda loss, norm: step == 2)
        assert torch.equal(model.params_memory, before) == (step == 2) and model.last_step_skipped == (step == 2)


@pytest.mark.gpu
@pytest.mark.parametrize("attention,ge", [("flash", -1), ("classic", -1), ("cudnn", -1), ("cudnn+flash", -1),
                                          ("flash", 2)])
def test_gpu_same_seed_same_bits(d12, attention, ge):
    """Two runs from the same seed, the same bits (ge 2: with cuBLASLt's GELU epilogues)."""
    cfg, params = d12
    batches = [make_batch(cfg, D12_B, 64, seed=200 + i) for i in range(2)]
    a, ma = _d12_steps(cfg, params, batches, 4, attention=attention, gelu_fusion=ge)
    pa = ma.params_memory.clone()
    del ma
    b, mb = _d12_steps(cfg, params, batches, 4, attention=attention, gelu_fusion=ge)
    same = a == b and torch.equal(pa.view(torch.int16), mb.params_memory.view(torch.int16))
    assert same, f"{attention}: two runs from the same seed differ: {a} vs {b}"


@pytest.fixture(scope="module")
def d12_training(d12):
    """Two batches and TRAIN_STEPS steps of the fp32 reference over them, on the GPU."""
    cfg, params = d12
    batches = [make_batch(cfg, D12_B, 64, seed=300 + i) for i in range(2)]
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        result = reference_training(cfg, params, batches, TRAIN_STEPS, device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    torch.cuda.empty_cache()
    return batches, result


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "w0", "r2", "ge0", "ge2", "classic", "fp32", "chunks8", "chunks3",
                                  "proj-bias-pass", "residual-in-product"])
def test_gpu_training_follows_reference(d12, d12_training, name):
    """TRAIN_STEPS steps (CUDA graphs from step 2) against the fp32 reference on the GPU."""
    cfg, params = d12
    batches, (ref_losses, ref_norms, ref_params) = d12_training
    kw = GPU_CONFIGS[name]
    steps, model = _d12_steps(cfg, params, batches, TRAIN_STEPS, **kw)
    tol = TOL["d12"][kw.get("dtype", BF16)]
    for s, ((loss, norm), rl) in enumerate(zip(steps, ref_losses)):
        assert abs(loss - rl) < tol["train"] * max(1.0, rl), f"{name} step {s + 1}: loss {loss} vs reference {rl}"
    assert steps[-1][0] < steps[0][0] - 1.0
    err = rel_err(model.parameters_fp32(), ref_params)
    assert err < tol["params"], f"{name}: parameters after training, relative error {err:.3g}"


@pytest.mark.gpu
def test_gpu_gradient_accumulation(d12):
    cfg, params = d12
    x, y = make_batch(cfg, 2 * D12_B, 64, seed=7)
    one = GPT2Model(cfg, params, 2 * D12_B, 64, device="cuda")
    l1, n1 = one.train_step([(x, y)], LR, 1, WD, CLIP)
    g1 = one.gradients_fp32()
    del one
    two = GPT2Model(cfg, params, D12_B, 64, device="cuda")
    l2, n2 = two.train_step([(x[:D12_B], y[:D12_B]), (x[D12_B:], y[D12_B:])], LR, 1, WD, CLIP)
    tol = TOL["d12"][BF16]
    assert abs(l1 - l2) < tol["loss"] * l1 and n2 == pytest.approx(n1, rel=2e-2)
    assert rel_err(two.gradients_fp32(), g1) < tol["grad"]


@pytest.mark.gpu
def test_gpu_memory_d12_b64(d12):
    """GPT-2 124M, B=64, T=1024, -r 0: what is allocated is the plan, and a training step (eager, then
    captured) peaks within 28 GiB of torch allocations; with the default classifier chunks (8 here; the
    plan is 23.02 GB) within the 24 GB goal."""
    cfg, params = d12
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = GPT2Model(cfg, params, 64, 1024, device="cuda", recompute=0, gelu_fusion=-1)
    grown = torch.cuda.memory_allocated() - base
    plan = model.memory_report()["total"]
    assert abs(grown - plan) < 64 * 2**20, f"allocated {grown} bytes, the plan says {plan}"
    x, y = make_batch(cfg, 64, 1024, seed=0)
    for step in range(3):
        loss, _ = model.train_step([(x, y)], 0.0, step + 1, 0.0, CLIP)
        assert math.isfinite(loss)
    peak = torch.cuda.max_memory_allocated() - base
    free, total = torch.cuda.mem_get_info()
    assert model.classifier_chunks == 8
    assert peak <= 28 * 2**30, f"peak {peak / 2**30:.2f} GiB ({format_memory(model.memory_report())}); " \
                               f"device in use {(total - free) / 2**30:.2f} GiB"
    assert peak <= 24e9, f"peak {peak / 1e9:.2f} GB over the 24 GB goal ({format_memory(model.memory_report())})"


@pytest.mark.gpu
def test_gpu_out_of_memory_message():
    cfg = parse_descriptor("d12")
    with pytest.raises(LlmpyError, match="lower -b"):
        GPT2Model(cfg, torch.zeros(cfg.num_parameters), 1024, 1024, device="cuda")


def test_grad_norm_follows_a_chunked_training_forward(device):
    """Chunked, a training forward adds the classifier's share to dwte: grad_norm() then kept the norm read
    before it, of gradients no longer in the buffer."""
    params = trained_like(SMALL, seed=3)
    (x, y), (x2, y2) = (make_batch(SMALL, B, T, seed=40 + i) for i in range(2))
    model = GPT2Model(SMALL, params, B, T, device=device, dtype=FP32, attention="flash", classifier_chunks=2)
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / (B * T))
    model.backward()
    before = model.grad_norm()
    model.forward(x2, y2, dloss=1.0 / (B * T))
    want = float(model.gradients_fp32().double().norm())
    assert want != pytest.approx(before, rel=1e-3)
    assert model.grad_norm() == pytest.approx(want, rel=1e-5)


def test_gradients_fp32_gathers_on_every_zero_1_rank():
    """ZeRO-1, after a step: gradients_fp32 gathers the ranks' reduced shards, a collective every rank must join.
    A model of one norm chunk has one rank's shard the whole buffer; that rank chose by the size and skipped it."""
    from llmpy.distributed import DataParallel, shard_bounds
    from llmpy.kernels.global_norm import NORM_CHUNK
    config = parse_descriptor("layers=1,channels=8,heads=1,seq=8,vocab=100")
    N = config.num_parameters
    assert [hi - lo for lo, hi in shard_bounds(N, 2, NORM_CHUNK)] == [0, N]
    shards = [torch.zeros(0), torch.randn(N)]  # each rank's reduced shard of the step's gradient

    class Ranks(DataParallel):
        gathers = 0

        def all_gather_uneven(self, out, mine, bounds, keep=True):
            # both ranks' shards in place, as the collective leaves them
            Ranks.gathers += 1
            for (lo, hi), shard in zip(bounds, shards):
                out[lo:hi] = shard
            return out

    for rank in (0, 1):
        model = GPT2Model(config, init_parameters(config, 1), 1, 8, device="cpu", dtype=FP32, attention="flash",
                          cuda_graph=False, data_parallel=Ranks(rank=rank, world_size=2, zero_stage=1))
        model._prepare(1)
        model._update_grads = model._reduce_bufs["reduced"].copy_(shards[rank])  # as _reduce_norm_clip leaves it
        before = Ranks.gathers
        assert torch.equal(model.gradients_fp32(), shards[1])
        assert Ranks.gathers == before + 1, f"rank {rank} did not join the gather"
