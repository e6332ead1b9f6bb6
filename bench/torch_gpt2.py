"""The project's PyTorch baseline: GPT-2 written with torch.nn and trained with autograd, the usual AMP way.

Same math as llm.c's GPT-2 (and `llmpy.reference`): learned position embeddings, pre-LN blocks, tanh GELU,
layernorm eps 1e-5, biases on every linear layer but the lm_head, the lm_head tied to wte over the padded
vocabulary Vp, and the loss over the first V logit columns only. Attention goes through
F.scaled_dot_product_attention(is_causal=True). Module names follow llm.c's tensor names (qkv, attproj,
fc, fcproj) so a reader can map each weight to its slot in the flat buffer.

Training recipe (`TorchTrainer`): fp32 parameters (the master copy), bf16 autocast for the forward and
backward, global-norm clipping, fused AdamW with weight decay on the 2-D tensors only (llm.c's mask).
`from_flat` loads llm.c's flat fp32 buffer, so this model starts from exactly the weights
`llmpy.init.init_parameters` gives the project's own model.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmpy.config import PARAMETER_NAMES, GPT2Config, parameter_views

LAYERNORM_EPS = 1e-5


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        C = config.channels
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(C, 3 * C)
        self.attproj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        NH = self.num_heads
        # qkvw's rows are [q | k | v], each split into heads: (B, T, 3, NH, hs) -> three (B, NH, T, hs).
        # The permuted views are strided, which SDPA's flash kernel accepts (last dim contiguous).
        q, k, v = self.qkv(x).view(B, T, 3, NH, C // NH).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attproj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        C = config.channels
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fcproj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.channels, eps=LAYERNORM_EPS)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.channels, eps=LAYERNORM_EPS)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        C = config.channels
        self.wte = nn.Embedding(config.padded_vocab_size, C)
        self.wpe = nn.Embedding(config.max_seq_len, C)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.lnf = nn.LayerNorm(C, eps=LAYERNORM_EPS)
        # no lm_head module: the classifier reuses wte.weight directly (weight tying without a shared
        # Parameter in two modules, so parameters() and the optimizer see wte once)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, return_logits: bool = False):
        """idx (B, T) token ids. With targets: the mean loss (and the logits if return_logits);
        without: the (B, T, Vp) logits."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.config.max_seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)  # (B, T, Vp)
        if targets is None:
            return logits
        V = self.config.vocab_size
        # the loss sees only the V real columns; the padded ones get no gradient. The fp32 cast is what
        # autocast would do for the log-softmax anyway; made explicit so the loss is fp32 everywhere, and
        # done before the reshape so the strided slice is copied once (into the fp32 tensor), not twice.
        loss = F.cross_entropy(logits[..., :V].float().reshape(-1, V), targets.reshape(-1))
        # logits are not returned by default: holding them would keep B*T*Vp bf16 values alive
        return (loss, logits) if return_logits else loss


# ----------------------------------------------------------------------------------------------------
# llm.c's flat buffer <-> the nn.Module's parameters

def _module_slots(model: TorchGPT2) -> dict[str, list[torch.Tensor]]:
    """For each of llm.c's 16 tensor names, the model's parameter(s) holding it: one tensor for the
    non-layered ones, one per layer for the others (in layer order)."""
    b = model.blocks
    return {
        "wte": [model.wte.weight], "wpe": [model.wpe.weight],
        "ln1w": [blk.ln1.weight for blk in b], "ln1b": [blk.ln1.bias for blk in b],
        "qkvw": [blk.attn.qkv.weight for blk in b], "qkvb": [blk.attn.qkv.bias for blk in b],
        "attprojw": [blk.attn.attproj.weight for blk in b], "attprojb": [blk.attn.attproj.bias for blk in b],
        "ln2w": [blk.ln2.weight for blk in b], "ln2b": [blk.ln2.bias for blk in b],
        "fcw": [blk.mlp.fc.weight for blk in b], "fcb": [blk.mlp.fc.bias for blk in b],
        "fcprojw": [blk.mlp.fcproj.weight for blk in b], "fcprojb": [blk.mlp.fcproj.bias for blk in b],
        "lnfw": [model.lnf.weight], "lnfb": [model.lnf.bias],
    }


def from_flat(config: GPT2Config, flat_fp32: torch.Tensor, device: str | torch.device = "cpu") -> TorchGPT2:
    """A TorchGPT2 (fp32 parameters on `device`) holding llm.c's flat buffer (config.parameter_shapes
    order; weights (out, in), the layout nn.Linear uses too)."""
    if flat_fp32.numel() != config.num_parameters:
        raise ValueError(f"flat buffer has {flat_fp32.numel()} elements, the model needs {config.num_parameters}")
    # build on the meta device: nn's default init of 124 M parameters would be thrown away anyway
    with torch.device("meta"):
        model = TorchGPT2(config)
    model = model.to_empty(device=device)
    views = parameter_views(flat_fp32.detach().float().reshape(-1), config)
    with torch.no_grad():
        for name, slots in _module_slots(model).items():
            src = views[name]
            if len(slots) == 1 and name in ("wte", "wpe", "lnfw", "lnfb"):
                slots[0].copy_(src)
            else:
                for l, p in enumerate(slots):
                    p.copy_(src[l])
    return model


def to_flat(model: TorchGPT2, grads: bool = False) -> torch.Tensor:
    """The parameters (or their gradients, zeros where None) as llm.c's flat fp32 buffer on the CPU."""
    parts = []
    for name in PARAMETER_NAMES:
        for p in _module_slots(model)[name]:
            t = p.grad if grads else p
            t = torch.zeros_like(p) if t is None else t
            parts.append(t.detach().float().reshape(-1).cpu())
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------------
# the training step

def make_optimizer(model: nn.Module, lr: float, weight_decay: float, fused: bool | None = None,
                   betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D tensors (wte, wpe and the four matmul weights) only, as
    llm.c's gpt2_update; fused on CUDA (one multi-tensor kernel for the whole update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    if fused is None:
        fused = all(p.is_cuda for p in params)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


class TorchTrainer:
    """One training step of a TorchGPT2: forward + backward under bf16 autocast (CUDA), global-norm
    clipping, AdamW on the fp32 parameters. `model` may be the torch.compile'd wrapper of `module`."""

    def __init__(self, module: TorchGPT2, model: nn.Module | None = None, lr: float = 3e-4,
                 weight_decay: float = 0.0, grad_clip: float = 1.0, autocast: bool | None = None,
                 fused: bool | None = None):
        self.module = module
        self.model = model if model is not None else module
        self.device = next(module.parameters()).device
        self.grad_clip = grad_clip
        self.autocast = (self.device.type == "cuda") if autocast is None else autocast
        self.optimizer = make_optimizer(module, lr, weight_decay, fused=fused)

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, lr: float | None = None):
        """Returns (loss, norm) as 0-d device tensors (no host sync here); norm is before clipping."""
        non_blocking = self.device.type == "cuda"
        x = inputs.to(self.device, dtype=torch.long, non_blocking=non_blocking)
        y = targets.to(self.device, dtype=torch.long, non_blocking=non_blocking)
        with self._autocast():
            loss = self.model(x, y)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        else:  # norm only, for the log
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm.detach()


def num_parameters(model: nn.Module) -> int:
    """Distinct parameter elements (wte counted once, with its padded rows, as llm.c counts them)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["TorchGPT2", "from_flat", "to_flat", "make_optimizer", "TorchTrainer", "num_parameters",
           "LAYERNORM_EPS"]
