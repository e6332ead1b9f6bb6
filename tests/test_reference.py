"""The CPU reference against an independent oracle: a torch.nn GPT-2 written here, differentiated by
autograd in float64. Layer by layer, then the whole model (logits, loss, every gradient), then 10
AdamW steps."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from llmpy import reference as ref
from llmpy.config import GPT2Config, parameter_views
from llmpy.errors import LlmpyError

F64 = torch.float64


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# layer by layer: the hand-written backward against autograd of the same forward, in float64

def autograd_vjp(fn, inputs, dout):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return [x.grad for x in leaves]


@pytest.mark.parametrize("shape", [(2, 3, 8), (3, 5, 13)])
def test_layernorm_backward_matches_autograd(shape):
    x, w, b, dout = randn(*shape), randn(shape[-1]), randn(shape[-1]), randn(*shape)
    out, mean, rstd = ref.layernorm_forward(x, w, b)
    expected = F.layer_norm(x, (shape[-1],), w, b, eps=ref.LAYERNORM_EPS)
    assert rel_err(out, expected) < 1e-12
    dx, dw, db = ref.layernorm_backward(dout, x, w, mean, rstd)
    gx, gw, gb = autograd_vjp(lambda x, w, b: F.layer_norm(x, (shape[-1],), w, b, eps=ref.LAYERNORM_EPS),
                              [x, w, b], dout)
    assert rel_err(dx, gx) < 1e-10 and rel_err(dw, gw) < 1e-12 and rel_err(db, gb) < 1e-12


def test_gelu_matches_torch_tanh_gelu():
    x = randn(1000) * 4
    x[:3] = torch.tensor([-30.0, 0.0, 30.0], dtype=F64)  # large |x|: the tanh form must not overflow
    dout = randn(1000)
    assert rel_err(ref.gelu_forward(x), F.gelu(x, approximate="tanh")) < 1e-14
    (gx,) = autograd_vjp(lambda x: F.gelu(x, approximate="tanh"), [x], dout)
    assert rel_err(ref.gelu_backward(x, dout), gx) < 1e-12


@pytest.mark.parametrize("B,T,C,OC,bias", [(2, 3, 8, 5, True), (1, 7, 13, 11, False)])
def test_matmul_backward_matches_autograd(B, T, C, OC, bias):
    x, w, b, dout = randn(B, T, C), randn(OC, C), randn(OC), randn(B, T, OC)
    out = ref.matmul_forward(x, w, b if bias else None)
    assert rel_err(out, F.linear(x, w, b if bias else None)) < 1e-14
    dx, dw, db = ref.matmul_backward(dout, x, w, has_bias=bias)
    if bias:
        gx, gw, gb = autograd_vjp(lambda x, w, b: F.linear(x, w, b), [x, w, b], dout)
        assert rel_err(db, gb) < 1e-13
    else:
        gx, gw = autograd_vjp(lambda x, w: F.linear(x, w), [x, w], dout)
        assert db is None
    assert rel_err(dx, gx) < 1e-13 and rel_err(dw, gw) < 1e-13


def sdpa_attention(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = qkv.split(C, dim=-1)
    q, k, v = (t.reshape(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
    # written out (not F.scaled_dot_product_attention) so the oracle has no fused kernel of its own
    s = q @ k.transpose(-1, -2) / math.sqrt(C // NH)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)


@pytest.mark.parametrize("B,T,NH,hs", [(2, 5, 2, 4), (1, 9, 3, 5)])
def test_attention_backward_matches_autograd(B, T, NH, hs):
    C = NH * hs
    qkv, dout = randn(B, T, 3 * C), randn(B, T, C)
    out, preatt, att = ref.attention_forward(qkv, NH)
    assert rel_err(out, sdpa_attention(qkv, NH)) < 1e-13
    assert torch.all(att.triu(1) == 0) and torch.allclose(att.sum(-1), torch.ones(B, NH, T, dtype=F64))
    (gqkv,) = autograd_vjp(lambda t: sdpa_attention(t, NH), [qkv], dout)
    assert rel_err(ref.attention_backward(dout, qkv, att, NH), gqkv) < 1e-12


@pytest.mark.parametrize("V,Vp", [(7, 8), (50, 128), (13, 13)])
def test_classifier_matches_autograd_and_leaves_padding_alone(V, Vp):
    B, T = 2, 3
    logits = randn(B, T, Vp) * 3
    targets = torch.randint(0, V, (B, T))
    dloss = 1.0 / (B * T)
    losses, dlogits = ref.fused_classifier(logits, targets, V, dloss)
    probs = ref.softmax_forward(logits, V)
    assert rel_err(losses, ref.crossentropy_forward(probs, targets)) < 1e-13
    expected = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1), reduction="none").view(B, T)
    assert rel_err(losses, expected) < 1e-13
    (g,) = autograd_vjp(lambda t: F.cross_entropy(t[..., :V].reshape(-1, V), targets.reshape(-1), reduction="mean"),
                        [logits], torch.tensor(1.0, dtype=F64))
    assert rel_err(dlogits, g) < 1e-12
    assert torch.all(dlogits[..., V:] == 0)
    assert ref.fused_classifier(logits, targets, V)[1] is None
    # llm.c's unfused pair: softmax, then the cross-entropy's backward through it (per-position dlosses)
    dlosses = torch.rand(B, T, dtype=F64) + 0.5
    unfused = ref.crossentropy_softmax_backward(dlosses, probs, targets, V)
    (g,) = autograd_vjp(lambda t: F.cross_entropy(t[..., :V].reshape(-1, V), targets.reshape(-1),
                                                  reduction="none").view(B, T), [logits], dlosses)
    assert rel_err(unfused, g) < 1e-12 and torch.all(unfused[..., V:] == 0)


def test_encoder_backward_matches_autograd():
    Vp, maxT, C, B, T = 11, 9, 6, 3, 7
    wte, wpe = randn(Vp, C), randn(maxT, C)
    inp = torch.randint(0, 5, (B, T))  # few ids: repeated tokens must accumulate
    dout = randn(B, T, C)
    gwte, gwpe = autograd_vjp(lambda a, b: ref.encoder_forward(inp, a, b), [wte, wpe], dout)
    dwte, dwpe = ref.encoder_backward(dout, inp, Vp, maxT)
    assert rel_err(dwte, gwte) < 1e-14 and rel_err(dwpe, gwpe) < 1e-14


def test_adamw_update_matches_torch_adamw():
    n = 3000
    p0, g = randn(n), randn(n)
    for wd in (0.0, 0.1):
        p_ref, m, v = p0.clone(), torch.zeros(n, dtype=F64), torch.zeros(n, dtype=F64)
        p_t = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([p_t], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
        for step in range(1, 4):
            gs = g * step  # a different gradient each step
            ref.adamw_update(p_ref, gs, m, v, step, 1e-2, 0.9, 0.95, 1e-8, wd, grad_scale=0.5, chunk=1000)
            p_t.grad = gs * 0.5
            opt.step()
        assert rel_err(p_ref, p_t.detach()) < 1e-13


def test_global_norm_and_clip_scale():
    g = randn(1001)
    assert math.isclose(ref.global_norm(g), float(g.norm()), rel_tol=1e-12)
    assert ref.clip_scale(2.0, 1.0) == 0.5 and ref.clip_scale(0.5, 1.0) == 1.0 and ref.clip_scale(5.0, 0.0) == 1.0


def test_global_norm_of_a_float32_buffer_is_exact_to_float64():
    # fp32 dot products over chunks of a million values were off by ~7e-5 of the sum of squares (a step line's
    # norm 12.6001 for 12.6005), and the reference is the kernels' oracle and what -c clips by
    g = torch.randn(3 * (1 << 20) + 7) * 0.01 + 0.02  # a mean: every partial sum grows, as a gradient's can
    exact = math.sqrt(float((g.double() ** 2).sum()))
    assert math.isclose(ref.global_norm(g), exact, rel_tol=1e-13)


# ---------------------------------------------------------------------------------------------------
# the whole model: an independent torch.nn GPT-2 in float64

class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=1e-5), nn.LayerNorm(C, eps=1e-5)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        x = x + self.c_proj(sdpa_attention(self.c_attn(self.ln_1(x)), self.NH))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
    """nanoGPT-style GPT-2, tied embeddings, logits over the padded vocabulary."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        C = cfg.channels
        self.V = cfg.vocab_size
        self.wte = nn.Embedding(cfg.padded_vocab_size, C)
        self.wpe = nn.Embedding(cfg.max_seq_len, C)
        self.h = nn.ModuleList(Block(C, cfg.num_heads) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        loss = F.cross_entropy(logits[..., : self.V].reshape(-1, self.V), targets.reshape(-1))
        return logits, loss

    def load_flat(self, flat, cfg):
        v = parameter_views(flat, cfg)
        with torch.no_grad():
            self.wte.weight.copy_(v["wte"])
            self.wpe.weight.copy_(v["wpe"])
            for l, b in enumerate(self.h):
                for mod, w, bias in ((b.ln_1, "ln1w", "ln1b"), (b.c_attn, "qkvw", "qkvb"),
                                     (b.c_proj, "attprojw", "attprojb"), (b.ln_2, "ln2w", "ln2b"),
                                     (b.c_fc, "fcw", "fcb"), (b.mlp_proj, "fcprojw", "fcprojb")):
                    mod.weight.copy_(v[w][l])
                    mod.bias.copy_(v[bias][l])
            self.ln_f.weight.copy_(v["lnfw"])
            self.ln_f.bias.copy_(v["lnfb"])

    def grads_flat(self, cfg):
        """The autograd gradients laid out like llm.c's flat gradient buffer."""
        out = {"wte": self.wte.weight.grad, "wpe": self.wpe.weight.grad,
               "lnfw": self.ln_f.weight.grad, "lnfb": self.ln_f.bias.grad}
        for w, bias, attr in (("ln1w", "ln1b", "ln_1"), ("qkvw", "qkvb", "c_attn"), ("attprojw", "attprojb", "c_proj"),
                              ("ln2w", "ln2b", "ln_2"), ("fcw", "fcb", "c_fc"), ("fcprojw", "fcprojb", "mlp_proj")):
            out[w] = torch.stack([getattr(b, attr).weight.grad for b in self.h])
            out[bias] = torch.stack([getattr(b, attr).bias.grad for b in self.h])
        return out


def random_params(cfg):
    """Random parameters on the scale of a trained model, padded wte rows zero as llm.c keeps them."""
    flat = torch.randn(cfg.num_parameters) * 0.1
    v = parameter_views(flat, cfg)
    v["wte"][cfg.vocab_size:] = 0
    for name in ("ln1w", "ln2w", "lnfw"):
        v[name].add_(1.0)
    return flat


CONFIGS = [
    GPT2Config(max_seq_len=16, vocab_size=61, num_layers=2, num_heads=2, channels=16),
    GPT2Config(max_seq_len=11, vocab_size=37, num_layers=3, num_heads=3, channels=15, padded_vocab_size=40),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["even", "odd"])
def test_gpt2_forward_backward_matches_autograd_float64(cfg):
    B, T = 3, cfg.max_seq_len - 2
    flat = random_params(cfg)
    inputs = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))

    oracle = TorchGPT2(cfg).to(F64)
    oracle.load_flat(flat.double(), cfg)
    logits64, loss64 = oracle(inputs, targets)
    loss64.backward()
    expected = oracle.grads_flat(cfg)

    model = ref.GPT2Reference(cfg, flat)  # float32
    loss = model.forward(inputs, targets)
    assert rel_err(model.logits, logits64) < 1e-5
    assert abs(loss - loss64.item()) < 1e-5 * abs(loss64.item())
    model.zero_grad()
    model.backward()
    for name, g in expected.items():
        assert rel_err(model.grads[name], g) < 1e-4, name
    assert torch.all(model.grads["wte"][cfg.vocab_size:] == 0)


def test_gradient_accumulation_equals_the_big_batch():
    cfg = CONFIGS[0]
    flat = random_params(cfg)
    inputs = torch.randint(0, cfg.vocab_size, (4, 8))
    targets = torch.randint(0, cfg.vocab_size, (4, 8))
    whole = ref.GPT2Reference(cfg, flat, dtype=F64)
    whole.forward(inputs, targets)
    whole.backward()
    parts = ref.GPT2Reference(cfg, flat, dtype=F64)
    for i in range(2):  # two micro-steps of B=2, dloss = 1 / (B * T * accum)
        parts.forward(inputs[2 * i:2 * i + 2], targets[2 * i:2 * i + 2])
        parts.backward(1.0 / (2 * 8 * 2))
    assert rel_err(parts.grads_flat, whole.grads_flat) < 1e-12


def test_ten_adamw_steps_follow_torch():
    cfg = CONFIGS[1]
    flat = random_params(cfg)
    lr, wd, max_norm = 3e-3, 0.1, 1.0
    oracle = TorchGPT2(cfg).to(F64)
    oracle.load_flat(flat.double(), cfg)
    decayed = [p for n, p in oracle.named_parameters() if p.dim() == 2]
    others = [p for n, p in oracle.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": wd}, {"params": others, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    model = ref.GPT2Reference(cfg, flat)
    losses_ref, losses_torch = [], []
    # one batch for all steps, so that the loss must fall (fresh random batches need not)
    inputs = torch.randint(0, cfg.vocab_size, (2, 9))
    targets = torch.randint(0, cfg.vocab_size, (2, 9))
    for step in range(1, 11):
        losses_ref.append(model.forward(inputs, targets))
        model.zero_grad()
        model.backward()
        norm = model.grad_norm()
        model.update(lr, step, weight_decay=wd, grad_scale=ref.clip_scale(norm, max_norm))

        opt.zero_grad()
        _, loss = oracle(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(oracle.parameters(), max_norm)  # a norm with the padded rows: they are 0
        opt.step()
        losses_torch.append(loss.item())
    assert losses_ref[-1] < losses_ref[0]
    for a, b in zip(losses_ref, losses_torch):
        assert abs(a - b) < 1e-4 * abs(b), (losses_ref, losses_torch)


def test_gpt2_in_float64_matches_autograd_to_rounding():
    """The float32 test above allows 1e-4: a small slip in one layer's backward would pass it. In float64 the
    hand-written backward must agree with autograd's to rounding, every tensor, T up to the full context."""
    cfg = GPT2Config(max_seq_len=7, vocab_size=29, num_layers=2, num_heads=3, channels=12, padded_vocab_size=32)
    flat = random_params(cfg).double()
    inputs = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    oracle = TorchGPT2(cfg).to(F64)
    oracle.load_flat(flat, cfg)
    logits64, loss64 = oracle(inputs, targets)
    loss64.backward()
    model = ref.GPT2Reference(cfg, flat, dtype=F64)
    loss = model.forward(inputs, targets)
    assert rel_err(model.logits, logits64) < 1e-13 and abs(loss - loss64.item()) < 1e-13 * loss64.item()
    model.backward()
    for name, g in oracle.grads_flat(cfg).items():
        assert rel_err(model.grads[name], g) < 1e-12, name


# ---------------------------------------------------------------------------------------------------
# the model's inputs: one LlmpyError naming what is wrong, before any work (as GPT2Model's)

IDS_CFG = GPT2Config(max_seq_len=8, vocab_size=50, num_layers=1, num_heads=2, channels=8)  # Vp = 128


def _ids(*shape, high=IDS_CFG.vocab_size):
    return torch.randint(1, high, shape)


@pytest.mark.parametrize("make, message", [
    # a negative id indexed wte from its end, an id in [V, Vp) read a zero padding row: a loss, silently wrong
    (lambda x, y: (x.index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(-1)), y),
     "inputs hold token id -1 at [1, 2], outside the model's vocabulary [0, 50)"),
    (lambda x, y: (x.index_put_((torch.tensor(0), torch.tensor(4)), torch.tensor(60)), y),
     "inputs hold token id 60 at [0, 4], outside the model's vocabulary [0, 50)"),
    (lambda x, y: (x.index_put_((torch.tensor(1), torch.tensor(0)), torch.tensor(200)), y),  # an IndexError
     "inputs hold token id 200 at [1, 0], outside the model's vocabulary [0, 50)"),
    # targets out of range: a RuntimeError from gather
    (lambda x, y: (x, y.index_put_((torch.tensor(0), torch.tensor(3)), torch.tensor(50))),
     "targets hold token id 50 at [0, 3], outside the model's vocabulary [0, 50)"),
    (lambda x, y: (x, y.index_put_((torch.tensor(1), torch.tensor(5)), torch.tensor(-3))),
     "targets hold token id -3 at [1, 5], outside the model's vocabulary [0, 50)"),
    # floats were truncated to other tokens
    (lambda x, y: (x + 0.5, y), "inputs of dtype torch.float32: token ids must be integers"),
    (lambda x, y: (x, y.double()), "targets of dtype torch.float64: token ids must be integers"),
    # a targets tensor that broadcast against the losses gave a loss of the wrong pairs; another a RuntimeError
    (lambda x, y: (x, y[:1]), "targets of shape [1, 6] do not match inputs of shape [2, 6]"),
    (lambda x, y: (x, y[:, :4]), "targets of shape [2, 4] do not match inputs of shape [2, 6]"),
    (lambda x, y: (x[0], y[0]), "inputs of shape [6]: must be (B, T) token ids"),  # a ValueError from unpacking
    (lambda x, y: (x[:, :0], y[:, :0]), "inputs of shape [2, 0]: must be (B, T) token ids"),  # a NaN loss
    (lambda x, y: (torch.cat([x, x], 1), torch.cat([y, y], 1)),
     "inputs of shape [2, 12]: sequence length 12 exceeds the model's context 8"),  # was a ValueError
    (lambda x, y: ([[1, 2], [3]], y), "inputs: not an array of token ids"),  # an AttributeError
    (lambda x, y: (x, "abc"), "targets of dtype <U3: token ids must be integers"),
])
def test_reference_forward_refuses_bad_inputs_in_one_line(make, message):
    model = ref.GPT2Reference(IDS_CFG, random_params(IDS_CFG))
    x, y = _ids(2, 6), _ids(2, 6)
    loss = model.forward(x, y)
    logits = model.logits.clone()
    bad_x, bad_y = make(x.clone(), y.clone())
    with pytest.raises(LlmpyError) as e:
        model.forward(bad_x, bad_y)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    # refused before any work: the last forward's activations are still there for its backward
    assert torch.equal(model.logits, logits)
    model.backward()
    assert math.isfinite(loss) and model.grads_flat.abs().sum() > 0


def test_reference_forward_takes_lists_and_numpys_ids():
    model = ref.GPT2Reference(IDS_CFG, random_params(IDS_CFG))
    x, y = _ids(2, 5), _ids(2, 5)
    want = model.forward(x, y)
    assert model.forward(x.tolist(), y.tolist()) == want
    assert model.forward(x.numpy().astype(np.uint16), y.numpy().astype(np.int32)) == want
    assert model.forward(x.int(), y.to(torch.int16)) == want


def test_reference_backward_and_update_refuse_misuse():
    model = ref.GPT2Reference(IDS_CFG, random_params(IDS_CFG))
    with pytest.raises(LlmpyError, match=r"^backward needs a forward with targets first$"):  # was a RuntimeError
        model.backward()
    model.forward(_ids(2, 5), _ids(2, 5))
    model.backward()
    before = model.params_flat.clone()
    for step in (0, -2):  # 0: a ZeroDivisionError; -2: a negative bias correction, a silently wrong update
        with pytest.raises(LlmpyError, match=rf"^GPT2Reference\.update: step {step}: must be an integer from 1 to "
                                             r"2\*\*63 - 1 \(AdamW counts steps from 1\)$"):
            model.update(1e-3, step)
    assert torch.equal(model.params_flat, before) and model.m_flat is None
    # a forward without targets has no losses: they were the earlier inputs' (read as this one's, silently wrong)
    model.forward(_ids(2, 5), _ids(2, 5))
    assert model.losses.shape == (2, 5)
    model.forward(_ids(1, 3))
    assert model.losses is None and model.logits.shape == (1, 3, IDS_CFG.padded_vocab_size)
