"""The CPU reference: GPT-2's math, every layer's forward and backward written out (llm.c's A1, A2).

No autograd: each backward is the derivative worked out by hand, as llm.c's train_gpt2.c does. Torch is
used only as the array library (its matrix products run on MKL/oneDNN). Everything is float32 in the
trainer; the functions are dtype-generic so the tests can also run them in float64.

This module is the oracle of the GPU kernels: `kernels/layernorm.py::layernorm_forward` is tested
against `reference.layernorm_forward`, and so on, one name for one thing.

Shapes: B batch, T time, C channels, NH heads, hs = C / NH head size, V vocab, Vp padded vocab.
Weights are (out, in) as in llm.c: y = x @ w.T + b.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .config import PARAMETER_NAMES, GPT2Config, check_fits_in_host_memory, parameter_views
from .errors import LlmpyError, shown
from .token_ids import check_vocabulary, host_ids

LAYERNORM_EPS = 1e-5
GELU_SCALING_FACTOR = math.sqrt(2.0 / math.pi)


# ----------------------------------------------------------------------------------------------------
# encoder: token embedding + position embedding

def encoder_forward(inp: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor) -> torch.Tensor:
    """inp (B, T) token ids -> (B, T, C) = wte[inp] + wpe[:T]."""
    T = inp.shape[1]
    return wte[inp] + wpe[:T]


def encoder_backward(dout: torch.Tensor, inp: torch.Tensor, Vp: int, maxT: int, dwte=None, dwpe=None):
    """Gradients of wte (Vp, C) and wpe (maxT, C) from dout (B, T, C). Given dwte / dwpe, they are
    accumulated into (gradient accumulation) and returned; else fresh ones are returned."""
    B, T, C = dout.shape
    if dwte is None:
        dwte = torch.zeros(Vp, C, dtype=dout.dtype, device=dout.device)
    if dwpe is None:
        dwpe = torch.zeros(maxT, C, dtype=dout.dtype, device=dout.device)
    dwte.index_add_(0, inp.reshape(-1), dout.reshape(B * T, C))
    dwpe[:T] += dout.sum(0)
    return dwte, dwpe


# ----------------------------------------------------------------------------------------------------
# layernorm

def layernorm_forward(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = LAYERNORM_EPS):
    """Normalise over the last axis. Returns (out, mean, rstd); mean and rstd are kept for the backward."""
    mean = inp.mean(-1)
    xc = inp - mean[..., None]
    var = (xc * xc).mean(-1)  # biased variance, as GPT-2
    rstd = 1.0 / torch.sqrt(var + eps)
    out = xc * rstd[..., None] * weight + bias
    return out, mean, rstd


def layernorm_backward(dout, inp, weight, mean, rstd, dweight=None, dbias=None):
    """Returns (dinp, dweight, dbias); dweight and dbias are summed over every row (and added into the
    given buffers when passed)."""
    C = inp.shape[-1]
    norm = (inp - mean[..., None]) * rstd[..., None]
    dnorm = dout * weight
    dnorm_mean = dnorm.mean(-1, keepdim=True)
    dnorm_norm_mean = (dnorm * norm).mean(-1, keepdim=True)
    dinp = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[..., None]
    dw = (dout * norm).reshape(-1, C).sum(0)
    db = dout.reshape(-1, C).sum(0)
    dweight = dw if dweight is None else dweight.add_(dw)
    dbias = db if dbias is None else dbias.add_(db)
    return dinp, dweight, dbias


def residual_forward(inp1: torch.Tensor, inp2: torch.Tensor) -> torch.Tensor:
    return inp1 + inp2


def fused_residual_forward(residual, inp, weight, bias, eps: float = LAYERNORM_EPS):
    """residual + inp, then its layernorm: returns (new_residual, normed, mean, rstd)."""
    new_residual = residual + inp
    normed, mean, rstd = layernorm_forward(new_residual, weight, bias, eps)
    return new_residual, normed, mean, rstd


# ----------------------------------------------------------------------------------------------------
# matmul with bias

def matmul_forward(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """inp (..., C) @ weight (OC, C).T + bias (OC) -> (..., OC)."""
    out = inp.reshape(-1, inp.shape[-1]) @ weight.t()
    if bias is not None:
        out += bias
    return out.reshape(*inp.shape[:-1], weight.shape[0])


def matmul_backward(dout, inp, weight, has_bias: bool = True, dweight=None, dbias=None):
    """Returns (dinp, dweight, dbias or None). Given dweight / dbias, the gradients are accumulated
    into them (one GEMM with beta = 1, as llm.c's matmul_backward) instead of returned fresh."""
    OC, C = weight.shape
    d2 = dout.reshape(-1, OC)
    i2 = inp.reshape(-1, C)
    dinp = (d2 @ weight).reshape(inp.shape)
    if dweight is None:
        dweight = d2.t() @ i2
    else:
        dweight.addmm_(d2.t(), i2)
    if has_bias:
        dbias = d2.sum(0) if dbias is None else dbias.add_(d2.sum(0))
    return dinp, dweight, (dbias if has_bias else None)


# ----------------------------------------------------------------------------------------------------
# causal self-attention

def _split_heads(qkv: torch.Tensor, num_heads: int):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // num_heads
    # (B, T, 3, NH, hs) -> three (B, NH, T, hs)
    q, k, v = qkv.view(B, T, 3, num_heads, hs).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def attention_forward(qkv: torch.Tensor, num_heads: int):
    """qkv (B, T, 3C) -> (out (B, T, C), preatt (B, NH, T, T), att (B, NH, T, T)).

    preatt holds the scaled scores q.k / sqrt(hs) on and below the diagonal; att the causal softmax,
    exactly 0 above the diagonal. Both are kept for the backward, as llm.c's CPU path does.
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = _split_heads(qkv, num_heads)
    scale = 1.0 / math.sqrt(C // num_heads)
    preatt = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()
    preatt = preatt.masked_fill(~causal, float("-inf"))
    att = torch.softmax(preatt, dim=-1)
    out = (att @ v).transpose(1, 2).reshape(B, T, C)
    return out, preatt.masked_fill(~causal, 0.0), att


def attention_backward(dout: torch.Tensor, qkv: torch.Tensor, att: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Gradient of qkv (B, T, 3C) from dout (B, T, C), given the saved softmax att."""
    B, T, C = dout.shape
    hs = C // num_heads
    q, k, v = _split_heads(qkv, num_heads)
    dy = dout.view(B, T, num_heads, hs).transpose(1, 2)  # (B, NH, T, hs)
    datt = dy @ v.transpose(-1, -2)
    dv = att.transpose(-1, -2) @ dy
    # softmax backward: dpreatt = att * (datt - sum_j att_j datt_j); zero above the diagonal since att is
    dpreatt = att * (datt - (att * datt).sum(-1, keepdim=True))
    dpreatt = dpreatt * (1.0 / math.sqrt(hs))
    dq = dpreatt @ k
    dk = dpreatt.transpose(-1, -2) @ q
    dqkv = torch.stack((dq, dk, dv), dim=2)  # (B, NH, 3, T, hs)
    return dqkv.permute(0, 3, 2, 1, 4).reshape(B, T, 3 * C)


# ----------------------------------------------------------------------------------------------------
# GELU, tanh form

def gelu_forward(x: torch.Tensor) -> torch.Tensor:
    cube = 0.044715 * x * x * x
    return 0.5 * x * (1.0 + torch.tanh(GELU_SCALING_FACTOR * (x + cube)))


def gelu_backward(x: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """dinp = gelu'(x) * dout. sech^2 is written as 1 - tanh^2 so large |x| cannot overflow cosh."""
    tanh_out = torch.tanh(GELU_SCALING_FACTOR * (x + 0.044715 * x * x * x))
    sech2 = 1.0 - tanh_out * tanh_out
    local_grad = 0.5 * (1.0 + tanh_out) + x * 0.5 * sech2 * GELU_SCALING_FACTOR * (1.0 + 3.0 * 0.044715 * x * x)
    return local_grad * dout


# ----------------------------------------------------------------------------------------------------
# softmax + cross-entropy over the real vocabulary V of rows of stride Vp

def softmax_forward(logits: torch.Tensor, V: int) -> torch.Tensor:
    """Probabilities over columns [0, V) of (B, T, Vp) logits; the padding columns [V, Vp) are 0."""
    probs = torch.zeros_like(logits)
    probs[..., :V] = torch.softmax(logits[..., :V], dim=-1)
    return probs


def crossentropy_forward(probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """losses (B, T) = -log probs[target]."""
    return -torch.log(probs.gather(-1, targets[..., None].long()).squeeze(-1))


def crossentropy_softmax_backward(dlosses: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor, V: int):
    """dlogits (B, T, Vp) = (probs - onehot(target)) * dloss over [0, V); 0 in the padding."""
    dlogits = probs * dlosses[..., None]
    dlogits.scatter_add_(-1, targets[..., None].long(), -dlosses[..., None])
    dlogits[..., V:] = 0
    return dlogits


def fused_classifier(logits: torch.Tensor, targets: torch.Tensor, V: int, dloss: float | None = None):
    """What the fused classifier kernel computes: losses (B, T) and, when dloss is given, the logit
    gradient (probs - onehot) * dloss with zero padding. Returns (losses, dlogits or None).

    The log-sum-exp form keeps the loss finite where the probability of the target underflows.
    """
    lv = logits[..., :V]
    lse = torch.logsumexp(lv, dim=-1)
    losses = lse - lv.gather(-1, targets[..., None].long()).squeeze(-1)
    if dloss is None:
        return losses, None
    # (softmax - onehot) * dloss, written in place into one buffer; the padding columns stay 0
    dlogits = torch.zeros_like(logits)
    dlogits[..., :V] = torch.softmax(lv, dim=-1)
    dlogits.mul_(dloss)
    dlogits.scatter_add_(-1, targets[..., None].long(),
                         torch.full((*targets.shape, 1), -dloss, dtype=logits.dtype, device=logits.device))
    return losses, dlogits


# ----------------------------------------------------------------------------------------------------
# optimizer: AdamW and the global gradient norm

def adamw_update(param, grad, m, v, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.95,
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: float = 1.0,
                 chunk: int = 1 << 20):
    """One AdamW step in place on param, m, v (all the same shape; step counts from 1).

    grad is multiplied by grad_scale (how clipping is applied: the gradient buffer is left as it is).
    The bias corrections are computed once here, as llm.c's launcher does. The flat buffers are
    processed in chunks so the temporaries stay in the CPU cache.
    """
    beta1_correction = 1.0 - beta1 ** step
    beta2_correction = 1.0 - beta2 ** step
    p, g, mm, vv = (t.view(-1) for t in (param, grad, m, v))
    for s in range(0, p.numel(), chunk):
        sl = slice(s, s + chunk)
        gs = g[sl] * grad_scale
        mm[sl].lerp_(gs, 1.0 - beta1)
        vv[sl].lerp_(gs.mul_(gs), 1.0 - beta2)
        # p <- p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps): decay uses the old p, as llm.c
        denom = vv[sl].sqrt().div_(math.sqrt(beta2_correction)).add_(eps)
        if weight_decay != 0.0:
            p[sl].mul_(1.0 - lr * weight_decay)
        p[sl].addcdiv_(mm[sl], denom, value=-lr / beta1_correction)


def global_norm(grads: torch.Tensor, chunk: int = 1 << 20) -> float:
    """sqrt(sum of squares) of a flat gradient buffer, in float64 a chunk at a time (chunks that stay in the cache):
    the oracle of the kernels' fp32 sums, and what clipping compares with -c. A float32 dot product over a
    million values was off by ~7e-5 of the sum, enough to show in the step line's norm; the squares of float32
    values are exact in float64."""
    g = grads.reshape(-1)
    total = 0.0
    for s in range(0, g.numel(), chunk):
        c = g[s:s + chunk].double()
        total += float(torch.dot(c, c))
    return math.sqrt(total)


def clip_scale(norm: float, max_norm: float) -> float:
    """llm.c's clipping factor: scale the gradient to norm max_norm when it is larger; 1 otherwise."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / norm
    return 1.0


# ----------------------------------------------------------------------------------------------------
# the number arguments of both models' methods, checked before any work: a refused call changes nothing

def checked_number(value, who: str, name: str, what: str, ok=None) -> float:
    """value as a float when it is a finite real number (numpy's too; not a bool) for which ok holds, else one
    LlmpyError "who: name value: must be what". A NaN or infinite rate turned every weight NaN, a str was a raw
    TypeError after the update had begun."""
    x = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            x = float(value)
        except OverflowError:  # an int past float's range
            pass
    if not math.isfinite(x) or (ok is not None and not ok(x)):
        raise LlmpyError(f"{who}: {name} {shown(value)}: must be {what}")
    return x


def checked_adamw_args(who: str, lr, step, beta1, beta2, eps, weight_decay) -> tuple:
    """AdamW's arguments, checked: (lr, step, beta1, beta2, eps, weight_decay) as floats and step as an int."""
    # step 0 divided by a zero bias correction, a negative one made it negative, 1.5 or True slipped through
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 1 <= step < 2**63:
        raise LlmpyError(f"{who}: step {shown(step)}: must be an integer from 1 to 2**63 - 1 (AdamW counts steps "
                         "from 1)")
    at_least_0 = "a finite number >= 0"
    return (checked_number(lr, who, "lr", at_least_0, lambda x: x >= 0), int(step),
            # beta = 1: a zero bias correction, as step 0
            checked_number(beta1, who, "beta1", "a number in [0, 1)", lambda x: 0 <= x < 1),
            checked_number(beta2, who, "beta2", "a number in [0, 1)", lambda x: 0 <= x < 1),
            # eps = 0: 0 / 0 where a gradient is always 0 (wte's padding rows)
            checked_number(eps, who, "eps", "a finite number > 0", lambda x: x > 0),
            checked_number(weight_decay, who, "weight_decay", at_least_0, lambda x: x >= 0))


def checked_dloss(dloss, who: str) -> float | None:
    return None if dloss is None else checked_number(dloss, who, "dloss", "None or a finite number")


# ----------------------------------------------------------------------------------------------------
# the whole model

class GPT2Reference:
    """GPT-2 on the CPU in float32: flat parameter and gradient buffers, forward, backward, AdamW.

    forward(inputs, targets) keeps the activations the backward needs; backward(dloss) accumulates
    into the gradient buffer (zero_grad() before micro-step 0), with dloss = 1 / (B * T * accum).
    """

    def __init__(self, config: GPT2Config, params: torch.Tensor, dtype: torch.dtype = torch.float32):
        if not isinstance(config, GPT2Config):
            raise LlmpyError(f"GPT2Reference: config {shown(config)}: must be a GPT2Config (llmpy.parse_descriptor "
                             "makes one from a descriptor)")
        if not isinstance(params, torch.Tensor) or params.dim() != 1 or not params.is_floating_point():
            got = (f"a {params.dim()}-D {params.dtype} tensor" if isinstance(params, torch.Tensor)
                   else "None" if params is None else f"a {type(params).__name__}")
            raise LlmpyError(f"GPT2Reference: params is {got}; it must be the flat parameter buffer, a 1-D "
                             "floating-point torch tensor")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise LlmpyError(f"GPT2Reference: dtype {shown(dtype, 40)}: must be a floating-point torch dtype")
        if params.numel() != config.num_parameters:
            raise LlmpyError(f"GPT2Reference: parameter buffer has {params.numel()} elements, the model needs "
                             f"{config.num_parameters} ({config.describe()})")
        if params.device.type == "cpu":  # the copy below and the gradients: two more buffers of the model's size
            check_fits_in_host_memory(config, 2 * params.numel() * dtype.itemsize,
                                      f"its {str(dtype).removeprefix('torch.')} parameter and gradient buffers")
        self.config = config
        self.dtype = dtype
        self.params_flat = params.detach().to(dtype).contiguous().clone()
        self.params = parameter_views(self.params_flat, config)
        self.grads_flat = torch.zeros_like(self.params_flat)
        self.grads = parameter_views(self.grads_flat, config)
        self.m_flat = None
        self.v_flat = None
        self.acts = None
        self.logits = None  # (B, T, Vp) of the last forward
        self.losses = None  # (B, T) of the last forward, None when it had no targets

    # ---- forward

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None):
        """Returns the mean loss (a float) when targets are given, else None; logits stay in self.logits."""
        cfg, p = self.config, self.params
        # every check before any work: a refused forward leaves the last one's activations for its backward
        inputs = self._token_ids(inputs, "inputs")
        B, T = inputs.shape
        if T > cfg.max_seq_len:
            raise LlmpyError(f"inputs of shape [{B}, {T}]: sequence length {T} exceeds the model's context "
                             f"{cfg.max_seq_len}")
        if targets is not None:
            targets = self._token_ids(targets, "targets")
            if targets.shape != inputs.shape:
                raise LlmpyError(f"targets of shape {list(targets.shape)} do not match inputs of shape {[B, T]}")
        NH = cfg.num_heads
        layers = []
        residual = encoder_forward(inputs, p["wte"], p["wpe"])
        for l in range(cfg.num_layers):
            a = {"residual": residual}
            a["ln1"], a["ln1_mean"], a["ln1_rstd"] = layernorm_forward(residual, p["ln1w"][l], p["ln1b"][l])
            a["qkv"] = matmul_forward(a["ln1"], p["qkvw"][l], p["qkvb"][l])
            a["atty"], _, a["att"] = attention_forward(a["qkv"], NH)
            attproj = matmul_forward(a["atty"], p["attprojw"][l], p["attprojb"][l])
            a["residual2"] = residual_forward(residual, attproj)
            a["ln2"], a["ln2_mean"], a["ln2_rstd"] = layernorm_forward(a["residual2"], p["ln2w"][l], p["ln2b"][l])
            a["fch"] = matmul_forward(a["ln2"], p["fcw"][l], p["fcb"][l])
            a["fch_gelu"] = gelu_forward(a["fch"])
            fcproj = matmul_forward(a["fch_gelu"], p["fcprojw"][l], p["fcprojb"][l])
            residual = residual_forward(a["residual2"], fcproj)
            layers.append(a)
        lnf, lnf_mean, lnf_rstd = layernorm_forward(residual, p["lnfw"], p["lnfb"])
        self.logits = matmul_forward(lnf, p["wte"])  # (B, T, Vp), the padded rows of wte are zero
        self.acts = {"layers": layers, "residual_final": residual, "lnf": lnf, "lnf_mean": lnf_mean,
                     "lnf_rstd": lnf_rstd, "inputs": inputs, "targets": None}
        self.losses = None  # not the last forward-with-targets' losses, for other inputs
        if targets is None:
            return None
        self.acts["targets"] = targets
        self.losses, _ = fused_classifier(self.logits, targets, cfg.vocab_size)
        return float(self.losses.double().mean())

    def _token_ids(self, ids, what: str) -> torch.Tensor:
        """ids as a (B, T) int64 tensor on the model's device; one LlmpyError for anything else: floats (truncated
        to other tokens), ids outside [0, V) (a negative one indexed wte from its end, one in [V, Vp) read a zero
        padding row: losses silently wrong), a shape that is not (B, T) with B, T >= 1."""
        host = host_ids(ids, what)
        if host.ndim != 2 or 0 in host.shape:
            raise LlmpyError(f"{what} of shape {list(host.shape)}: must be (B, T) token ids, B and T at least 1")
        check_vocabulary(host, self.config.vocab_size, what)
        return torch.from_numpy(host.astype(np.int64)).to(self.params_flat.device)

    # ---- backward

    def zero_grad(self):
        self.grads_flat.zero_()

    def backward(self, dloss: float | None = None):
        """Accumulate the gradients of sum(losses) * dloss (default dloss = 1/(B*T): the mean loss)."""
        dloss = checked_dloss(dloss, "GPT2Reference.backward")
        if self.acts is None or self.acts["targets"] is None:
            raise LlmpyError("backward needs a forward with targets first")
        cfg, p, g, acts = self.config, self.params, self.grads, self.acts
        B, T = acts["inputs"].shape
        NH = cfg.num_heads
        if dloss is None:
            dloss = 1.0 / (B * T)
        _, dlogits = fused_classifier(self.logits, acts["targets"], cfg.vocab_size, dloss)
        dlnf, _, _ = matmul_backward(dlogits, acts["lnf"], p["wte"], has_bias=False, dweight=g["wte"])
        dresidual, _, _ = layernorm_backward(dlnf, acts["residual_final"], p["lnfw"], acts["lnf_mean"],
                                             acts["lnf_rstd"], g["lnfw"], g["lnfb"])
        for l in reversed(range(cfg.num_layers)):
            a = acts["layers"][l]
            # MLP block: residual = residual2 + fcproj(gelu(fc(ln2(residual2))))
            dfch_gelu, _, _ = matmul_backward(dresidual, a["fch_gelu"], p["fcprojw"][l], True, g["fcprojw"][l],
                                              g["fcprojb"][l])
            dfch = gelu_backward(a["fch"], dfch_gelu)
            dln2, _, _ = matmul_backward(dfch, a["ln2"], p["fcw"][l], True, g["fcw"][l], g["fcb"][l])
            dx, _, _ = layernorm_backward(dln2, a["residual2"], p["ln2w"][l], a["ln2_mean"], a["ln2_rstd"],
                                          g["ln2w"][l], g["ln2b"][l])
            dresidual2 = dresidual + dx
            # attention block: residual2 = residual + attproj(attention(qkv(ln1(residual))))
            datty, _, _ = matmul_backward(dresidual2, a["atty"], p["attprojw"][l], True, g["attprojw"][l],
                                          g["attprojb"][l])
            dqkv = attention_backward(datty, a["qkv"], a["att"], NH)
            dln1, _, _ = matmul_backward(dqkv, a["ln1"], p["qkvw"][l], True, g["qkvw"][l], g["qkvb"][l])
            dx, _, _ = layernorm_backward(dln1, a["residual"], p["ln1w"][l], a["ln1_mean"], a["ln1_rstd"],
                                          g["ln1w"][l], g["ln1b"][l])
            dresidual = dresidual2 + dx
        encoder_backward(dresidual, acts["inputs"], cfg.padded_vocab_size, cfg.max_seq_len, g["wte"], g["wpe"])
        self.acts = None  # the activations are spent; a second backward would be a bug

    # ---- update

    def grad_norm(self) -> float:
        return global_norm(self.grads_flat)

    def update(self, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
               weight_decay: float = 0.0, grad_scale: float = 1.0):
        """AdamW over the 16 tensors, weight decay on the 2-D ones only (llm.c's gpt2_update)."""
        who = "GPT2Reference.update"
        lr, step, beta1, beta2, eps, weight_decay = checked_adamw_args(who, lr, step, beta1, beta2, eps, weight_decay)
        grad_scale = checked_number(grad_scale, who, "grad_scale", "a finite number >= 0", lambda x: x >= 0)
        if self.m_flat is None:
            self.m_flat = torch.zeros_like(self.params_flat)
            self.v_flat = torch.zeros_like(self.params_flat)
        m = parameter_views(self.m_flat, self.config)
        v = parameter_views(self.v_flat, self.config)
        decay = self.config.weight_decay_mask()
        for name in PARAMETER_NAMES:
            adamw_update(self.params[name], self.grads[name], m[name], v[name], step, lr, beta1, beta2, eps,
                         weight_decay if decay[name] else 0.0, grad_scale)
