"""The lm_head backward with the logit gradient formed inside its products (kernels.lm_head_backward, the model's
lm_head_prologue option, both modes: loss-pass and dinp-sums).

The Gluon products do not run in Triton's CPU interpreter: on the CPU they run in tests/gluon_emulator.py (their
own code, against float64); these tests also check the Triton kernels around them (each row's exponent shift and
the padding's -inf before; dinp's finish after, with the rows it does again), the scaled scatter that adds the
one-hot's share, and the model's plumbing with float64 stand-ins for the two products, which assert the contract
they are given; on the GPU the products themselves against float64, and the whole model against its default
classifier.
"""
import pytest
import torch

from llmpy import reference
from llmpy.config import GPT2Config, parameter_views
from llmpy.errors import LlmpyError
from llmpy.init import init_parameters
from llmpy.kernels import lm_head_backward as klm
from llmpy.kernels.encoder import encoder_backward_scratch, wte_backward
from llmpy.model import GPT2Model

LOG2E = klm.LOG2E


def rel_err(out, expected):
    out, expected = out.double(), expected.to(out.device).double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V,Vp", [(37, 250, 256), (5, 128, 128), (64, 300, 384)])
@pytest.mark.parametrize("from_loss", [True, False])
def test_row_shifts_and_mask(device, dtype, R, V, Vp, from_loss):
    """From the classifier's losses: each row's log-sum-exp (base 2); without: the target's logit + ROW_OFFSET2."""
    gen = torch.Generator().manual_seed(R + V)
    logits = (torch.randn(R, Vp, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    losses = reference.fused_classifier(logits.double(), targets, V)[0].float()
    before = logits.clone()
    logits, targets = logits.to(device), targets.to(device)
    shift2 = torch.full((R,), float("nan"), device=device)
    klm.row_shifts_and_mask(logits, targets, shift2, V, losses=losses.to(device) if from_loss else None)
    x_t2 = before.double()[torch.arange(R), targets.cpu().long()] * LOG2E
    expected = torch.logsumexp(before[:, :V].double(), dim=1) * LOG2E if from_loss else x_t2 + klm.ROW_OFFSET2
    assert (shift2.cpu().double() - expected).abs().max() <= 2e-6 * expected.abs().max()
    assert torch.equal(logits[:, :V].cpu(), before[:, :V]), "the real columns changed"
    assert bool((logits[:, V:] == float("-inf")).all()), "the padding columns are not -inf"


def _dinp_products_standin(logits, wte, shift2, scale, partial, row_sums, stages=None):
    """lm_head_dinp's Gluon product in float64 from fp32 exponentials (they overflow where the kernel's do),
    after checking what the caller hands it: -inf padding, the vocabulary halves as the kernel splits it."""
    R, Vp = logits.shape
    V = int((logits[0] > float("-inf")).sum())
    assert bool((logits[:, V:] == float("-inf")).all()) and partial.shape == (klm.DINP_SPLIT, R, wte.shape[1])
    g = torch.exp2(logits.float() * LOG2E - shift2[:, None]).double()
    part = Vp // klm.DINP_SPLIT
    for s in range(klm.DINP_SPLIT):
        cols = slice(s * part, (s + 1) * part)
        partial[s] = (g[:, cols] * scale) @ wte[cols].double()
        if row_sums is not None:
            row_sums[s] = g[:, cols].sum(1)


def _expected_dinp(logits, wte, targets, dloss, V):
    """float64: dloss (softmax(logits[:, :V]) @ wte[:V] - wte[targets]), each row's loss and lse2."""
    x = logits[:, :V].double()
    lse = torch.logsumexp(x, dim=1)
    out = dloss * (torch.softmax(x, dim=1) @ wte[:V].double() - wte.double()[targets.long()])
    return out, lse - x[torch.arange(len(x)), targets.long()], lse * LOG2E


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the overflowed row's inf * 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,C,V,Vp", [(37, 100, 250, 256), (16, 300, 120, 128)])
@pytest.mark.parametrize("row_sums", [True, False])
def test_dinp_finish(device, dtype, R, C, V, Vp, row_sums):
    """lm_head_dinp after its product, on the stand-in's float64 parts: dinp-sums gives dlnf, each row's lse2 and
    loss, with two rows done again from their logits: loss ~210 nats (its fp32 sum overflows) and ~120 nats (its
    sum is finite but above SUM_LIMIT); loss-pass: the parts (already scaled) summed, less the target's row."""
    gen = torch.Generator().manual_seed(R * C)
    dloss = 1.0 / 64
    logits = (torch.randn(R, Vp, generator=gen) * 3).to(dtype)
    logits[:, V:] = float("-inf")
    wte = (torch.randn(Vp, C, generator=gen) * 0.5).to(dtype)
    targets = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    again = {3: 105.0, R - 1: 60.0}  # row: the target's logit at -gap, another's at +gap
    for r, gap in again.items():
        logits[r, targets[r]] = -gap
        logits[r, (int(targets[r]) + 1) % V] = gap
    expected, expected_loss, expected_lse2 = _expected_dinp(logits, wte, targets, dloss, V)
    losses = reference.fused_classifier(logits.double(), targets, V)[0].float()
    shift2 = torch.empty(R)
    klm.row_shifts_and_mask(logits.clone(), targets, shift2, V, losses=None if row_sums else losses)
    partial = torch.full((klm.DINP_SPLIT, R, C), float("nan"))
    sums = torch.full((klm.DINP_SPLIT, R), float("nan")) if row_sums else None
    _dinp_products_standin(logits, wte, shift2, 1.0 if row_sums else dloss, partial, sums)
    if row_sums:
        total = sums.sum(0)
        assert not total[3].isfinite() and klm.SUM_LIMIT.value < total[R - 1] < float("inf"), "not the test's rows"
    lse2, loss = (torch.full((R,), float("nan"), device=device) for _ in range(2))
    out = torch.full((R, C), float("nan"), dtype=dtype, device=device)
    klm.dinp_finish(partial.to(device), sums.to(device) if row_sums else None, shift2.to(device), logits.to(device),
                    targets.to(device), wte.to(device), dloss, out, lse2 if row_sums else None,
                    loss if row_sums else None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, expected) < tol, rel_err(out, expected)
    for r in again:
        assert rel_err(out[r], expected[r]) < tol, f"row {r}: {rel_err(out[r], expected[r]):.3g}"
    if row_sums:
        assert (loss.cpu().double() - expected_loss).abs().max() < 2e-5 * expected_loss.abs().max()
        assert (lse2.cpu().double() - expected_lse2).abs().max() < 2e-6 * expected_lse2.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wte_backward_scale(device, dtype):
    """scale = -2^-k: bitwise the scatter of the scaled rows (the lm_head's one-hot share), and the float64
    index_add_ of them within rounding; repeated ids (few distinct ones) cross the chunks."""
    gen = torch.Generator().manual_seed(11)
    B, T, C, Vp = 3, 50, 40, 64
    dout = torch.randn(B, T, C, generator=gen).to(dtype)
    ids = torch.randint(0, 9, (B, T), generator=gen, dtype=torch.int32)
    dwte0 = (torch.randn(Vp, C, generator=gen) * 1e-2).to(dtype)
    scale = -2.0 ** -7
    outs = []
    for rows, s in ((dout, scale), (dout * scale, 1.0)):
        dwte = dwte0.clone().to(device)
        scratch = encoder_backward_scratch(B, T, C, device, piece=16)
        wte_backward(dwte, rows.to(device), ids.to(device), 0, scratch, stochastic=False, piece=16, scale=s)
        outs.append(dwte.cpu())
    assert torch.equal(outs[0], outs[1])
    expected = dwte0.double().index_add(0, ids.view(-1).long(), dout.view(-1, C).double() * scale)
    assert rel_err(outs[0], expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def _config():
    return GPT2Config(max_seq_len=32, vocab_size=300, num_layers=2, num_heads=2, channels=64)


def test_option_refused(device):
    config = _config()
    params = init_parameters(config, seed=1)
    with pytest.raises(LlmpyError, match="lm_head_prologue='on': one of off, loss-pass, dinp-sums"):
        GPT2Model(config, params, 2, 16, device=device, classifier_chunks=2, lm_head_prologue="on")
    with pytest.raises(LlmpyError, match="lm_head_prologue: it needs classifier chunks"):
        GPT2Model(config, params, 2, 16, device=device, classifier_chunks=1, lm_head_prologue="dinp-sums")
    if device == "cpu":
        with pytest.raises(LlmpyError, match="lm_head_prologue: "):
            GPT2Model(config, params, 2, 16, device=device, classifier_chunks=2, lm_head_prologue="loss-pass")


def _dweight_standin(logits, lnf, lse2, dloss, V, dwte):
    g = torch.exp2(logits[:, :V].double() * LOG2E - lse2.double()[:, None]) * dloss
    dwte[:V] = (dwte[:V].double() + g.t() @ lnf.double()).to(dwte.dtype)
    return dwte


def _one_training_pass(model, x, y):
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / x.numel())
    losses = model.acts["losses"].float().cpu().clone()
    model.backward()
    return losses, parameter_views(model.gradients_fp32().cpu(), model.config)


def _with_and_without(config, params, B, T, device, dtype, chunks, mode):
    out = []
    for option in ("off", mode):
        model = GPT2Model(config, params, B, T, device=device, dtype=dtype, classifier_chunks=chunks,
                          cuda_graph=False, lm_head_prologue=option)
        gen = torch.Generator().manual_seed(5)
        x = torch.randint(0, config.vocab_size, (B, T), generator=gen)
        y = torch.randint(0, config.vocab_size, (B, T), generator=gen)
        out.append(_one_training_pass(model, x, y))
    return out


def _params(config, seed):
    """Logits of a few units, and wte's padding rows NOT zero (a loaded checkpoint may have them): the -inf
    mask must keep them out of dlnf."""
    params = init_parameters(config, seed=seed)
    C, V, Vp = config.channels, config.vocab_size, config.padded_vocab_size
    params[:Vp * C] *= 2 / (0.02 * C ** 0.5)
    params[V * C:Vp * C] = torch.randn((Vp - V) * C, generator=torch.Generator().manual_seed(seed))
    return params


@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_model_plumbing(monkeypatch, dtype, tol, mode):
    """On the CPU, the products replaced by float64 stand-ins: the same losses (loss-pass: bitwise) and gradients
    as the model's own classifier (3 chunks of 10, 11, 11 rows), nothing in wte's padding rows' gradient."""
    monkeypatch.setattr(klm, "lm_head_prologue_usable", lambda *a: None)
    monkeypatch.setattr(klm, "_dinp_products", _dinp_products_standin)
    monkeypatch.setattr(klm, "lm_head_dweight", _dweight_standin)
    config = _config()
    (l0, g0), (l1, g1) = _with_and_without(config, _params(config, 3), 2, 16, "cpu", dtype, 3, mode)
    if mode == "loss-pass":
        assert torch.equal(l0, l1), "the losses differ"
    else:
        assert rel_err(l1, l0) < 1e-6, rel_err(l1, l0)
    for name in g0:
        assert rel_err(g1[name], g0[name]) < tol, f"{name}: {rel_err(g1[name], g0[name]):.3g}"
    assert not g1["wte"][config.vocab_size:].any()


def _require_gluon(rows, C, Vp):
    """Skip where the GPU cannot run the Gluon products (not an sm_90 GPU, no Gluon): the reason given."""
    why = klm.lm_head_prologue_usable("cuda", torch.bfloat16, rows, C, Vp)
    if why:
        pytest.skip(why)


# the GPU tests' model: chunks of 512 rows, C and the padded vocabulary on the products' tiles
GPU_CONFIG = GPT2Config(max_seq_len=256, vocab_size=1000, num_layers=2, num_heads=4, channels=256)


def _wrong_tiles(out, expected, tol=1e-2):
    """The products' [TILE_M, TILE_N] output tiles that are wrong, for a failure's message (_report): where the
    first GPU run of a kernel goes wrong (one column tile, the last row block, ...) says what to look at."""
    out, expected = out.cpu().double(), expected.cpu().double()
    wrong = []
    for r in range(0, out.shape[0], klm.TILE_M):
        for c in range(0, out.shape[1], klm.TILE_N):
            err = rel_err(out[r:r + klm.TILE_M, c:c + klm.TILE_N], expected[r:r + klm.TILE_M, c:c + klm.TILE_N])
            if not err < tol:
                wrong.append(f"[{r}:, {c}:] {err:.3g}")
    return wrong


def _report(wrong):
    return f"{len(wrong)} wrong tiles (rows, columns: relative error): " + ", ".join(wrong[:12])


def _emulate_products(monkeypatch, gluon_emulator, tma_loads="at-issue"):
    """The two Gluon products' launches run their code on the CPU (tests/gluon_emulator.py)."""
    for name in ("_lm_head_dinp_kernel", "_lm_head_dweight_kernel"):
        monkeypatch.setattr(klm, name, gluon_emulator.emulate(getattr(klm, name), tma_loads))


def _check_products(mode, device):
    """The Gluon products (and dinp's finish) against float64, row 5's loss ~210 nats (dinp-sums: its sum
    overflows and the finish does the row again), wte's padding rows not zero; the same bits twice."""
    from llmpy.kernels.fused_classifier import fused_classifier
    gen = torch.Generator().manual_seed(2)
    R, C, V, Vp = 256, 512, 1000, 1024
    dloss = 1.0 / 4096
    logits = torch.randn(R, Vp, generator=gen) * 3
    targets = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    logits[5, targets[5]], logits[5, (int(targets[5]) + 1) % V] = -100.0, 110.0
    logits = logits.to(torch.bfloat16).to(device)
    targets = targets.to(device)
    wte = (torch.randn(Vp, C, generator=gen) * 0.05).to(torch.bfloat16).to(device)  # padding rows not zero
    lnf = torch.randn(R, C, generator=gen).to(torch.bfloat16).to(device)
    # small against the increments (~dloss at the targets), so that its rounding does not swamp their error
    dw0 = (torch.randn(Vp, C, generator=gen) * 1e-5).to(torch.bfloat16).to(device)
    g = reference.fused_classifier(logits.cpu().double(), targets.cpu(), V, dloss)[1]
    expected_losses = reference.fused_classifier(logits.cpu().double(), targets.cpu(), V)[0]
    losses, shift2 = (torch.full((R,), float("nan"), device=device) for _ in range(2))
    partial = torch.full((klm.DINP_SPLIT, R, C), float("nan"), device=device)
    if mode == "loss-pass":
        fused_classifier(logits, losses, 0.0, targets, V, write_dlogits=False)
        klm.row_shifts_and_mask(logits, targets, shift2, V, losses=losses)
        lse2, outputs = shift2, {}
    else:
        klm.row_shifts_and_mask(logits, targets, shift2, V)
        lse2 = torch.full((R,), float("nan"), device=device)
        outputs = dict(row_sums=torch.full((klm.DINP_SPLIT, R), float("nan"), device=device), lse2=lse2,
                       losses=losses)
    dinp = torch.full((R, C), float("nan"), dtype=torch.bfloat16, device=device)
    klm.lm_head_dinp(logits, wte, shift2, targets, dloss, dinp, partial, **outputs)
    if mode == "dinp-sums":  # every row but 5 from the product's own sums (the redo would hide a wrong one)
        sums = outputs["row_sums"].sum(0).cpu()
        assert bool((torch.isfinite(sums) & (sums < 2.0 ** 100)).sum() == R - 1) and not sums[5] < 2.0 ** 100
    assert (losses.cpu().double() - expected_losses).abs().max() < 1e-5 * expected_losses.abs().max()
    dw = dw0.clone()
    klm.lm_head_dweight(logits, lnf, lse2, dloss, V, dw)
    wte_backward(dw, lnf.view(1, R, C), targets.view(1, R), 0, encoder_backward_scratch(1, R, C, device),
                 stochastic=False, scale=-dloss)
    assert rel_err(dinp, g @ wte.cpu().double()) < 1e-2, _report(_wrong_tiles(dinp, g @ wte.cpu().double()))
    assert rel_err(dinp[5], g[5] @ wte.cpu().double()) < 1e-2, "the row done again"
    dw_added, dw_expected = dw.double() - dw0.double(), g.t() @ lnf.cpu().double()
    assert rel_err(dw_added, dw_expected) < 1e-2, _report(_wrong_tiles(dw_added, dw_expected))
    assert torch.equal(dw[V:], dw0[V:]), "wte's padding rows' gradient changed"
    again = torch.empty_like(dinp)
    klm.lm_head_dinp(logits, wte, shift2, targets, dloss, again, partial, **outputs)
    assert torch.equal(again, dinp), "not the same bits twice"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
def test_products_against_float64(mode):
    _require_gluon(256, 512, 1024)
    _check_products(mode, "cuda")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the overflowed row's inf * 0
@pytest.mark.parametrize("tma_loads", ["at-issue", "at-wait"])
@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
def test_products_emulated_on_the_cpu(monkeypatch, gluon_emulator, mode, tma_loads):
    """The Gluon products' own code, run on the CPU by tests/gluon_emulator.py: their tiles, masks, ring slots
    and barrier phases, with TMA loads landing at issue and at the wait (each shows other ring mistakes)."""
    _emulate_products(monkeypatch, gluon_emulator, tma_loads)
    _check_products(mode, "cpu")


def test_products_emulated_at_gpt2_shapes(monkeypatch, gluon_emulator):
    """dinp-sums at GPT-2 124M's shapes (C = 768, V = 50257, Vp = 50304: three column tiles, 393 vocabulary
    tiles, a ragged last one) on 512 rows, emulated: every output tile against float64."""
    _emulate_products(monkeypatch, gluon_emulator)
    gen = torch.Generator().manual_seed(3)
    R, C, V, Vp = 512, 768, 50257, 50304
    dloss = 1.0 / (64 * 1024)
    logits = (torch.randn(R, Vp, generator=gen) * 2).to(torch.bfloat16)
    targets = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    wte = (torch.randn(Vp, C, generator=gen) * 0.02).to(torch.bfloat16)
    lnf = torch.randn(R, C, generator=gen).to(torch.bfloat16)
    # an old gradient well below the increments (~1e-8 a vocabulary row here), so bf16's rounding of the sum
    # does not swamp them
    dw0 = (torch.randn(Vp, C, generator=gen) * 1e-11).to(torch.bfloat16)
    expected_losses, g = reference.fused_classifier(logits.double(), targets, V, dloss)
    shift2, lse2, losses = (torch.full((R,), float("nan")) for _ in range(3))
    klm.row_shifts_and_mask(logits, targets, shift2, V)
    dinp = torch.full((R, C), float("nan"), dtype=torch.bfloat16)
    klm.lm_head_dinp(logits, wte, shift2, targets, dloss, dinp, torch.full((klm.DINP_SPLIT, R, C), float("nan")),
                     row_sums=torch.full((klm.DINP_SPLIT, R), float("nan")), lse2=lse2, losses=losses)
    dw = dw0.clone()
    klm.lm_head_dweight(logits, lnf, lse2, dloss, V, dw)
    wte_backward(dw, lnf.view(1, R, C), targets.view(1, R), 0, encoder_backward_scratch(1, R, C, "cpu"),
                 stochastic=False, scale=-dloss)
    assert (losses.double() - expected_losses).abs().max() < 1e-5 * expected_losses.abs().max()
    wrong = _wrong_tiles(dinp, g @ wte.double())
    assert not wrong, _report(wrong)
    wrong = _wrong_tiles(dw.double() - dw0.double(), g.t() @ lnf.double())
    assert not wrong, _report(wrong)
    assert torch.equal(dw[V:], dw0[V:]), "wte's padding rows' gradient changed"


def _check_against_default(config, params, B, T, device, mode):
    """bf16, two classifier chunks: the same losses and gradients as the default classifier, within bf16."""
    (l0, g0), (l1, g1) = _with_and_without(config, params, B, T, device, torch.bfloat16, 2, mode)
    assert rel_err(l1, l0) < 1e-5
    for name in g0:
        assert rel_err(g1[name], g0[name]) < 1e-2, f"{name}: {rel_err(g1[name], g0[name]):.3g}"
    assert not g1["wte"][config.vocab_size:].any()


# the default classifier's masked tail takes exp2 of the padding columns' logits (large: wte's padding rows are
# not zero here) before discarding them; numpy warns of the overflow, the GPU does not
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
def test_model_with_emulated_products(monkeypatch, gluon_emulator, mode):
    """The model's chunked classifier with the Gluon products' own code (emulated on the CPU) against its default
    classifier, bf16, two chunks of 128 rows: the views, descriptors and scratch the model hands the kernels."""
    monkeypatch.setattr(klm, "lm_head_prologue_usable", lambda *a: None)
    _emulate_products(monkeypatch, gluon_emulator)
    config = GPT2Config(max_seq_len=64, vocab_size=300, num_layers=1, num_heads=4, channels=256)
    _check_against_default(config, _params(config, 7), 4, 64, "cpu", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
def test_model_against_default_classifier(mode):
    config = GPU_CONFIG
    _require_gluon(512, config.channels, config.padded_vocab_size)
    _check_against_default(config, _params(config, 4), 4, 256, "cuda", mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["loss-pass", "dinp-sums"])
def test_model_same_seed_same_bits(mode):
    """Three CUDA-graph steps twice from the same seed: bitwise the same losses and parameters."""
    config = GPU_CONFIG
    _require_gluon(512, config.channels, config.padded_vocab_size)
    params = _params(config, 6)
    gen = torch.Generator().manual_seed(8)
    batches = [(torch.randint(0, 1000, (4, 256), generator=gen), torch.randint(0, 1000, (4, 256), generator=gen))
               for _ in range(3)]
    runs = []
    for _ in range(2):
        model = GPT2Model(config, params, 4, 256, device="cuda", classifier_chunks=2, lm_head_prologue=mode)
        losses = [model.train_step([b], 1e-3, i + 1, 0.1)[0] for i, b in enumerate(batches)]
        runs.append((losses, model.parameters_fp32().cpu()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
