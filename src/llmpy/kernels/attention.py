"""Causal self-attention: llm.c's classic path, PyTorch's fused cuDNN / flash paths, and a dispatcher.

Classic path (llm.c attention.cuh), the readable baseline. It materialises the (B, NH, T, T) score
matrix and leaves both matrix products to cuBLAS (through torch.bmm with out=), so the only Triton
kernels are the memory-bound glue around them:

- a permute kernel: qkv (B, T, 3C) -> q, k, v, each (B, NH, T, hs), side by side in qkvr, so every
  (b, nh) head is one contiguous (T, hs) matrix and each product is a single strided-batched GEMM;
  the same kernel in the other direction unpermutes (B, NH, T, hs) -> (B, T, C), and both directions
  are also the backward of each other (a permutation's gradient is the inverse permutation);
- a causal softmax kernel, one program per row (b, nh, t): an online max+sum pass over the live
  entries 0..t (Milakov & Gimelshein), then a pass that writes the probabilities and exact zeros
  above the diagonal, so the following att @ v GEMM can run over the full T x T matrix;
- the softmax backward, in place over datt, one program per row, fp32 row reduction.

Both softmax kernels visit rows in reverse order, as llm.c does: within a head the long rows (large t)
start first, which evens out the tail of the launch, and the rows of the first heads are written last,
so they are still in L2 when the next GEMM (which starts at head 0) reads them.

The 1/sqrt(hs) scale is applied inside the softmax kernels, not in the GEMMs.

Fused paths: "flash" is the Triton flash attention (kernels/flash_attention.py); "cudnn" is cuDNN's
fused attention through its frontend on our layouts, and "cudnn+flash" its forward with the Triton
backward (kernels/cudnn_attention.py). "torch-cudnn" and "torch-flash" are PyTorch's private aten ops
for cuDNN's fused attention and for flash attention 2, called directly (no autograd): q, k, v are
strided views into qkv, no copies in. Their outputs are allocated by the op (there is no out=
variant), in the (B, T, NH, hs) layout of q, so landing them in our preallocated (B, T, C) buffers is
one contiguous copy. The log-sum-exp (natural log, of the scaled
scores, fp32 (B, NH, T)) is saved for the backward, which recomputes the probabilities from it.

Dispatcher: `ATTENTION_IMPLS`, `default_attention_impl(device)`, `attention_forward_any` and
`attention_backward_any` (one set of buffers for every impl; `attention_buffer_shapes` lists what
each impl needs).

Determinism: classic, flash, cudnn and cudnn+flash are bitwise repeatable (cuBLAS GEMMs with fixed
shapes, our atomic-free kernels, cuDNN's deterministic backward). PyTorch's ops need not be: see
tests/test_attention.py for what they do.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..config import ATTENTION_IMPLS
from .common import cdiv, interpreting

# ----------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _permute_kernel(tok_ptr, head_ptr, T, NH, HS, tok_row_stride, head_group_stride,
                    TO_HEADS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HS: tl.constexpr):
    """Copy a (BLOCK_T, hs) tile of one head between the two layouts of attention tensors:

    token-major: tok[b, t, g*C + nh*hs + d], rows of tok_row_stride elements (3C for qkv, C for out)
    head-major:  head[g, b, nh, t, d], contiguous; group g (q, k or v) starts at g * head_group_stride

    grid (B * cdiv(T, BLOCK_T), G * NH). The head-major side of a tile is one contiguous block and the
    token-major side BLOCK_T contiguous runs of hs elements, so both the loads and the stores coalesce.
    """
    pid_bt = tl.program_id(0)
    pid_gh = tl.program_id(1)  # g * NH + nh
    n_tblocks = tl.cdiv(T, BLOCK_T)
    b = pid_bt // n_tblocks
    t = (pid_bt % n_tblocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = pid_gh // NH
    nh = pid_gh % NH
    d = tl.arange(0, BLOCK_HS)
    mask = (t[:, None] < T) & (d[None, :] < HS)
    # int64 offsets: 3 * B * T * C passes 2^31 at large batch sizes
    tok_offs = ((b * T + t).to(tl.int64) * tok_row_stride)[:, None] + (pid_gh * HS + d)[None, :]
    head_offs = (g.to(tl.int64) * head_group_stride + ((b * NH + nh).to(tl.int64) * T + t) * HS)[:, None] \
        + d[None, :]
    if TO_HEADS:
        tl.store(head_ptr + head_offs, tl.load(tok_ptr + tok_offs, mask=mask), mask=mask)
    else:
        tl.store(tok_ptr + tok_offs, tl.load(head_ptr + head_offs, mask=mask), mask=mask)


@triton.jit
def _softmax_forward_kernel(att_ptr, T, scale_log2e, BLOCK: tl.constexpr):
    """In place over att (B*NH*T rows of T): row (b, nh, t) <- softmax(scale * row[0..t]), 0 after t.

    Entries above the diagonal are never read (the GEMM left whatever there), only overwritten by 0.
    Each lane keeps its own running (max, sum) across the column chunks, combined at the end: the
    online softmax of llm.c's softmax_forward_kernel5, in base 2 (scale folded with log2(e)).
    """
    row = tl.num_programs(0) - 1 - tl.program_id(0)  # reverse order, see the module docstring
    t = row % T
    base = att_ptr + row.to(tl.int64) * T
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for c in range(0, tl.cdiv(t + 1, BLOCK)):
        j = c * BLOCK + cols
        x = tl.load(base + j, mask=j <= t, other=float("-inf")).to(tl.float32) * scale_log2e
        m_new = tl.maximum(m, x)
        # a lane that has only seen masked entries stays at -inf; subtract 0 there, not -inf (NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2(m - m_ref) + tl.exp2(x - m_ref)
        m = m_new
    row_max = tl.max(m, 0)  # finite: column 0 is live in every row
    inv_sum = 1.0 / tl.sum(s * tl.exp2(m - row_max), 0)
    for c in range(0, tl.cdiv(T, BLOCK)):
        j = c * BLOCK + cols
        x = tl.load(base + j, mask=j <= t, other=float("-inf")).to(tl.float32) * scale_log2e
        p = tl.exp2(x - row_max) * inv_sum  # exp2(-inf) = 0 above the diagonal
        tl.store(base + j, p.to(att_ptr.dtype.element_ty), mask=j < T)


@triton.jit
def _softmax_backward_kernel(datt_ptr, att_ptr, T, scale, BLOCK: tl.constexpr):
    """In place over datt: row (b, nh, t) <- scale * att * (datt - sum_j att_j datt_j) on 0..t, 0 after.

    The first pass reduces the row in fp32; the second re-reads it (from L1/L2: a row is at most a
    few KB) and writes. Only the live entries 0..t of att and datt are read.
    """
    row = tl.num_programs(0) - 1 - tl.program_id(0)  # reverse order, see the module docstring
    t = row % T
    off = row.to(tl.int64) * T
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, tl.cdiv(t + 1, BLOCK)):
        j = c * BLOCK + cols
        live = j <= t
        a = tl.load(att_ptr + off + j, mask=live, other=0.0).to(tl.float32)
        d = tl.load(datt_ptr + off + j, mask=live, other=0.0).to(tl.float32)
        acc += a * d
    dot = tl.sum(acc, 0)
    for c in range(0, tl.cdiv(T, BLOCK)):
        j = c * BLOCK + cols
        live = j <= t
        a = tl.load(att_ptr + off + j, mask=live, other=0.0).to(tl.float32)
        d = tl.load(datt_ptr + off + j, mask=live, other=0.0).to(tl.float32)
        g = tl.where(live, a * (d - dot) * scale, 0.0)
        tl.store(datt_ptr + off + j, g.to(datt_ptr.dtype.element_ty), mask=j < T)


# ----------------------------------------------------------------------------------------------------
# classic path: launchers

_FLOAT_X = (torch.float32, torch.bfloat16)


def _dims(qkv_or_out: torch.Tensor, num_heads: int, width: int):
    B, T, W = qkv_or_out.shape
    assert W % width == 0 and (W // width) % num_heads == 0, (qkv_or_out.shape, num_heads)
    C = W // width
    return B, T, C, C // num_heads


def _check(*tensors):
    dev, dt = tensors[0].device, tensors[0].dtype
    assert dt in _FLOAT_X, dt
    for x in tensors:
        assert x.device == dev and x.dtype == dt and x.is_contiguous(), (x.shape, x.dtype, x.device)


def _launch_permute(tok: torch.Tensor, heads: torch.Tensor, groups: int, num_heads: int, to_heads: bool):
    """tok (B, T, groups*C) <-> heads (groups, B, NH, T, hs); direction given by to_heads."""
    B, T, C, hs = _dims(tok, num_heads, groups)
    assert heads.numel() >= groups * B * T * C and heads.is_contiguous() and tok.is_contiguous()
    assert heads.dtype == tok.dtype and heads.device == tok.device
    block_hs = triton.next_power_of_2(hs)
    # ~4K elements per program; fewer, smaller programs under the interpreter (each runs in Python)
    block_t = min(triton.next_power_of_2(T), max(1, 4096 // block_hs))
    grid = (B * cdiv(T, block_t), groups * num_heads)
    _permute_kernel[grid](tok, heads, T, num_heads, hs, tok.shape[2], B * T * C,
                          TO_HEADS=to_heads, BLOCK_T=block_t, BLOCK_HS=block_hs, num_warps=4)


def permute(qkvr: torch.Tensor, qkv: torch.Tensor, num_heads: int):
    """qkv (B, T, 3C) -> qkvr (3, B, NH, T, hs): q, k, v each head-major (llm.c permute_kernel)."""
    _launch_permute(qkv, qkvr, 3, num_heads, to_heads=True)


def permute_backward(dqkv: torch.Tensor, dqkvr: torch.Tensor, num_heads: int):
    """dqkvr (3, B, NH, T, hs) -> dqkv (B, T, 3C), overwritten (llm.c permute_kernel_backward)."""
    _launch_permute(dqkv, dqkvr, 3, num_heads, to_heads=False)


def unpermute(out: torch.Tensor, vaccum: torch.Tensor, num_heads: int):
    """vaccum (B, NH, T, hs) -> out (B, T, C): the heads side by side again (llm.c unpermute_kernel)."""
    _launch_permute(out, vaccum, 1, num_heads, to_heads=False)


def unpermute_backward(dvaccum: torch.Tensor, dout: torch.Tensor, num_heads: int):
    """dout (B, T, C) -> dvaccum (B, NH, T, hs), overwritten (llm.c unpermute_kernel_backward)."""
    _launch_permute(dout, dvaccum, 1, num_heads, to_heads=True)


def _softmax_block(T: int, block: int | None = None) -> tuple[int, int]:
    """Column chunk and warps of the softmax kernels: the whole row in one chunk up to T = 4096
    (8 elements a thread at T = 1024 with 4 warps); longer rows loop over chunks."""
    block = block or min(triton.next_power_of_2(T), 4096)
    assert block & (block - 1) == 0, block
    return block, (1 if interpreting() else max(1, min(8, block // 256)))


def attention_softmax_forward(att: torch.Tensor, scale: float, block: int | None = None):
    """In place over att (B, NH, T, T) holding raw scores q.k: the causal softmax of scale * scores,
    exactly 0 above the diagonal (llm.c softmax_forward_kernel5). block (a power of two) overrides
    the column chunk, so tests can exercise the multi-chunk path at small T."""
    assert att.is_contiguous() and att.dtype in _FLOAT_X and att.shape[-1] == att.shape[-2]
    T = att.shape[-1]
    block, warps = _softmax_block(T, block)
    _softmax_forward_kernel[(att.numel() // T,)](att, T, scale * math.log2(math.e), BLOCK=block, num_warps=warps)


def attention_softmax_backward_inplace(datt: torch.Tensor, att: torch.Tensor, scale: float,
                                       block: int | None = None):
    """datt (B, NH, T, T) <- scale * att * (datt - rowsum(att * datt)), 0 above the diagonal
    (llm.c softmax_autoregressive_backward_inplace_kernel): the gradient of the raw scores."""
    _check(datt, att)
    assert datt.shape == att.shape and att.shape[-1] == att.shape[-2]
    T = att.shape[-1]
    block, warps = _softmax_block(T, block)
    _softmax_backward_kernel[(att.numel() // T,)](datt, att, T, scale, BLOCK=block, num_warps=warps)


def attention_forward(out: torch.Tensor, qkvr: torch.Tensor, att: torch.Tensor, qkv: torch.Tensor,
                      num_heads: int, scratch: torch.Tensor | None = None):
    """Classic causal attention forward (llm.c attention_forward).

    qkv     (B, T, 3C)          input: q, k, v side by side, heads within each
    out     (B, T, C)           output
    qkvr    (3, B, NH, T, hs)   output, kept for the backward: q, k, v head-major
    att     (B, NH, T, T)       output, kept for the backward: the causal softmax, 0 above the diagonal
    scratch (B, NH, T, hs)      scratch for att @ v; when None, qkv is used (it is dead once permuted,
                                and the backward reads qkvr), as llm.c does: qkv is then CLOBBERED.
    All floatX (fp32 or bf16), contiguous, one device.
    """
    B, T, C, hs = _dims(qkv, num_heads, 3)
    _check(out, qkvr, att, qkv)
    assert out.shape == (B, T, C) and qkvr.shape == (3, B, num_heads, T, hs) and att.shape == (B, num_heads, T, T)
    vaccum = qkv if scratch is None else scratch
    if scratch is not None:
        _check(qkv, scratch)
        assert scratch.numel() >= B * T * C
    vaccum = vaccum.view(-1)[: B * T * C].view(B * num_heads, T, hs)
    BH = B * num_heads
    permute(qkvr, qkv, num_heads)
    q, k, v = (x.view(BH, T, hs) for x in qkvr.unbind(0))
    att3 = att.view(BH, T, T)
    torch.bmm(q, k.transpose(1, 2), out=att3)  # raw scores; the scale is applied in the softmax
    attention_softmax_forward(att, 1.0 / math.sqrt(hs))
    torch.bmm(att3, v, out=vaccum)
    unpermute(out, vaccum, num_heads)


def attention_backward(dqkv: torch.Tensor, dqkvr: torch.Tensor, datt: torch.Tensor, scratch: torch.Tensor,
                       dout: torch.Tensor, qkvr: torch.Tensor, att: torch.Tensor, num_heads: int):
    """Classic causal attention backward (llm.c attention_backward).

    dout    (B, T, C)           input: gradient of out
    qkvr    (3, B, NH, T, hs)   input: saved by attention_forward
    att     (B, NH, T, T)       input: saved by attention_forward
    dqkv    (B, T, 3C)          output, OVERWRITTEN (not accumulated: nothing upstream shares it)
    dqkvr   (3, B, NH, T, hs)   scratch: dq, dk, dv head-major
    datt    (B, NH, T, T)       scratch: the gradient of att, then (in place) of the raw scores
    scratch (B, NH, T, hs)      scratch: dout head-major
    All floatX, contiguous, one device.
    """
    B, T, C, hs = _dims(dqkv, num_heads, 3)
    _check(dqkv, dqkvr, datt, scratch, dout, qkvr, att)
    assert dout.shape == (B, T, C) and qkvr.shape == dqkvr.shape == (3, B, num_heads, T, hs)
    assert att.shape == datt.shape == (B, num_heads, T, T) and scratch.numel() >= B * T * C
    BH = B * num_heads
    dvaccum = scratch.view(-1)[: B * T * C].view(BH, T, hs)
    q, k, v = (x.view(BH, T, hs) for x in qkvr.unbind(0))
    dq, dk, dv = (x.view(BH, T, hs) for x in dqkvr.unbind(0))
    att3, datt3 = att.view(BH, T, T), datt.view(BH, T, T)
    unpermute_backward(dvaccum, dout, num_heads)
    torch.bmm(dvaccum, v.transpose(1, 2), out=datt3)  # datt = dy @ v^T
    torch.bmm(att3.transpose(1, 2), dvaccum, out=dv)  # dv = att^T @ dy
    attention_softmax_backward_inplace(datt, att, 1.0 / math.sqrt(hs))  # datt -> dscores
    torch.bmm(datt3, k, out=dq)  # dq = dscores @ k
    torch.bmm(datt3.transpose(1, 2), q, out=dk)  # dk = dscores^T @ q
    permute_backward(dqkv, dqkvr, num_heads)


# ----------------------------------------------------------------------------------------------------
# fused paths: PyTorch's cuDNN and flash attention ops, without autograd


def _heads_view(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, C) -> (B, NH, T, hs) view."""
    B, T, C = x.shape
    return x.view(B, T, num_heads, C // num_heads).transpose(1, 2)


def _qkv_views(qkv: torch.Tensor, num_heads: int):
    """(B, T, 3C) -> three (B, NH, T, hs) strided views, no copy."""
    B, T, C3 = qkv.shape
    return qkv.view(B, T, 3, num_heads, C3 // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


class _AtenOp:
    """A private aten op called by argument name. Its schema is read at import, so renamed or added
    optional arguments between torch versions adapt; `usable` is False when the op is missing or has
    a required argument we do not know how to fill (then the autograd fallback runs instead)."""

    def __init__(self, name: str, known: set[str]):
        self.name = name
        try:
            self.op = getattr(torch.ops.aten, name).default
            schema = self.op._schema
        except (AttributeError, RuntimeError):
            self.op, self.args, self.returns, self.usable = None, (), (), False
            return
        self.args = tuple(a.name for a in schema.arguments)
        self.returns = tuple(r.name for r in schema.returns)
        required = {a.name for a in schema.arguments if not a.has_default_value()}
        self.usable = required <= known

    def __call__(self, **given):
        return self.op(**{k: v for k, v in given.items() if k in self.args})

    def result(self, res, name: str, fallback_index: int):
        """An output of the op by its schema name, else by position."""
        return res[self.returns.index(name)] if name in self.returns else res[fallback_index]


_FWD_ARGS = {"query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
             "return_debug_mask", "scale"}
_BWD_ARGS = {"grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
             "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"}

_CUDNN_FWD = _AtenOp("_scaled_dot_product_cudnn_attention", _FWD_ARGS)
_CUDNN_BWD = _AtenOp("_scaled_dot_product_cudnn_attention_backward", _BWD_ARGS)
_FLASH_FWD = _AtenOp("_scaled_dot_product_flash_attention", _FWD_ARGS)
_FLASH_BWD = _AtenOp("_scaled_dot_product_flash_attention_backward", _BWD_ARGS)

# the forward's RNG state outputs, per (op, device): the backward needs tensors of the right kind
# there, unused at dropout 0. Filled by the first forward (run one before capturing a CUDA graph).
_RNG_STATE: dict = {}


def _check_fused(out, lse, qkv, num_heads):
    B, T, C, hs = _dims(qkv, num_heads, 3)
    assert qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32), (qkv.device, qkv.dtype)
    assert out.shape == (B, T, C) and out.is_contiguous() and out.dtype == qkv.dtype and qkv.is_contiguous()
    assert lse.shape == (B, num_heads, T) and lse.dtype == torch.float32 and lse.is_contiguous()
    return B, T, C, hs


def _store_dqkv(dqkv: torch.Tensor, grads, num_heads: int):
    """dq, dk, dv (B, NH, T, hs, any strides) -> dqkv (B, T, 3C): three strided copies; the ops
    allocate their gradients in q's (B, T, NH, hs) order, so each copy reads contiguous memory."""
    for dst, src in zip(_qkv_views(dqkv, num_heads), grads):
        dst.copy_(src)


def _sdpa_fallback_forward(backend_name: str, out, lse, qkv, num_heads):
    """Autograd-free fallback through F.scaled_dot_product_attention pinned to one backend, for when
    the private op is missing or its schema changed. It does NOT write lse (SDPA does not return it)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv_views(qkv, num_heads)
    with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, backend_name)):
        _heads_view(out, num_heads).copy_(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _sdpa_fallback_backward(backend_name: str, dqkv, dout, qkv, num_heads):
    """Fallback backward: recomputes the forward under autograd (an extra forward) and backpropagates
    dout; the gradient of the whole qkv comes out (B, T, 3C) directly."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = qkv.detach().requires_grad_(True)
    with torch.enable_grad(), sdpa_kernel(getattr(SDPBackend, backend_name)):
        o = F.scaled_dot_product_attention(*_qkv_views(x, num_heads), is_causal=True)
        (g,) = torch.autograd.grad(o, x, _heads_view(dout, num_heads))
    dqkv.copy_(g)


def _fused_forward(fwd: _AtenOp, key: str, backend: str, out, lse, qkv, num_heads):
    B, T, C, hs = _check_fused(out, lse, qkv, num_heads)
    if not fwd.usable:
        return _sdpa_fallback_forward(backend, out, lse, qkv, num_heads)
    q, k, v = _qkv_views(qkv, num_heads)
    res = fwd(query=q, key=k, value=v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0,
              is_causal=True, return_debug_mask=False, scale=1.0 / math.sqrt(hs))
    _heads_view(out, num_heads).copy_(fwd.result(res, "output", 0))
    l = fwd.result(res, "logsumexp", 1)
    lse.copy_(l.squeeze(-1) if l.dim() == 4 else l[..., :T])  # cuDNN: (B, NH, T, 1); flash: (B, NH, T)
    rng_key = (key, qkv.device)
    if rng_key not in _RNG_STATE:
        seed_name, off_name = ("philox_seed", "philox_offset") if key == "torch-cudnn" else ("rng_state", "unused")
        _RNG_STATE[rng_key] = (fwd.result(res, seed_name, 6), fwd.result(res, off_name, 7))


def _fused_backward(bwd: _AtenOp, key: str, backend: str, dqkv, dout, qkv, out, lse, num_heads):
    B, T, C, hs = _check_fused(out, lse, qkv, num_heads)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype and dqkv.is_contiguous()
    assert dout.shape == out.shape and dout.dtype == out.dtype and dout.is_contiguous()
    rng = _RNG_STATE.get((key, qkv.device))
    if not bwd.usable or rng is None:
        # no forward through the op has run on this device yet (or the op is unusable)
        return _sdpa_fallback_backward(backend, dqkv, dout, qkv, num_heads)
    q, k, v = _qkv_views(qkv, num_heads)
    # out and dout as (B, NH, T, hs) views of (B, T, C): the same strides as the op's own output
    logsumexp = lse.unsqueeze(-1) if key == "torch-cudnn" else lse
    res = bwd(grad_out=_heads_view(dout, num_heads), query=q, key=k, value=v, out=_heads_view(out, num_heads),
              logsumexp=logsumexp, philox_seed=rng[0], philox_offset=rng[1], attn_bias=None, cum_seq_q=None,
              cum_seq_k=None, max_q=T, max_k=T, dropout_p=0.0, is_causal=True, scale=1.0 / math.sqrt(hs))
    _store_dqkv(dqkv, res[:3], num_heads)


def torch_cudnn_attention_forward(out: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor, num_heads: int):
    """PyTorch's cuDNN fused causal attention forward: qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T) fp32.

    Runs aten._scaled_dot_product_cudnn_attention on strided views of qkv; the op allocates its output
    (in q's layout) and lse, which are copied into out and lse (one contiguous copy each). CUDA only.
    """
    _fused_forward(_CUDNN_FWD, "torch-cudnn", "CUDNN_ATTENTION", out, lse, qkv, num_heads)


def torch_cudnn_attention_backward(dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, num_heads: int):
    """PyTorch's cuDNN fused causal attention backward: dqkv (B, T, 3C) OVERWRITTEN from dout (B, T, C),
    given the forward's qkv, out and lse. Needs one torch_cudnn_attention_forward on this device first
    (for the op's RNG-state tensors); otherwise it recomputes through autograd. Not deterministic: PyTorch
    builds cuDNN's backward without its deterministic algorithm (see kernels/cudnn_attention.py)."""
    _fused_backward(_CUDNN_BWD, "torch-cudnn", "CUDNN_ATTENTION", dqkv, dout, qkv, out, lse, num_heads)


def torch_flash_attention_forward(out: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor, num_heads: int):
    """PyTorch's flash attention 2 forward (aten._scaled_dot_product_flash_attention), same contract
    as torch_cudnn_attention_forward. bf16/fp16 only (flash attention has no fp32 kernels)."""
    _fused_forward(_FLASH_FWD, "torch-flash", "FLASH_ATTENTION", out, lse, qkv, num_heads)


def torch_flash_attention_backward(dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, num_heads: int):
    """PyTorch's flash attention 2 backward, same contract as torch_cudnn_attention_backward."""
    _fused_backward(_FLASH_BWD, "torch-flash", "FLASH_ATTENTION", dqkv, dout, qkv, out, lse, num_heads)


# ----------------------------------------------------------------------------------------------------
# dispatcher


# The paths by their kernels: the Triton backward (its delta scratch; head sizes up to 128), and the cuDNN
# frontend's forward (cudnn_attention.py; a workspace)
TRITON_BACKWARD = ("flash", "cudnn+flash")
CUDNN_FRONTEND = ("cudnn", "cudnn+flash")
# the paths whose backward gives the same bits every run (PyTorch's ops need not: tests/test_attention.py)
DETERMINISTIC = ("classic", "flash", "cudnn", "cudnn+flash")


def attention_buffer_shapes(impl: str, B: int, T: int, C: int, NH: int) -> dict:
    """name -> (shape, dtype kind) of what attention_forward_any / attention_backward_any need besides
    qkv, out, dqkv, dout. "floatX" is the model's storage dtype, "fp32" is float32.

    Saved from forward to backward (one per layer): classic qkvr + att, fused lse.
    Backward-only scratch (one shared by all layers): classic dqkvr, datt, scratch (the last also
    serves as the forward's att @ v scratch, so forward keeps qkv intact when it is passed); Triton
    flash delta (the row sums dout.out, fp32).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; one of {ATTENTION_IMPLS}")
    hs = C // NH
    if impl == "classic":
        return {"qkvr": ((3, B, NH, T, hs), "floatX"), "att": ((B, NH, T, T), "floatX"),
                "dqkvr": ((3, B, NH, T, hs), "floatX"), "datt": ((B, NH, T, T), "floatX"),
                "scratch": ((B, NH, T, hs), "floatX")}
    if impl in TRITON_BACKWARD:
        return {"lse": ((B, NH, T), "fp32"), "delta": ((B, NH, T), "fp32")}
    return {"lse": ((B, NH, T), "fp32")}


def _triton_flash():
    from . import flash_attention  # written alongside; imported only when asked for

    return flash_attention


def _cudnn():
    from . import cudnn_attention  # needs the cuDNN frontend package: imported only when asked for

    return cudnn_attention


def attention_forward_any(impl: str, out: torch.Tensor, qkv: torch.Tensor, num_heads: int, *,
                          lse: torch.Tensor | None = None, qkvr: torch.Tensor | None = None,
                          att: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                          workspace: torch.Tensor | None = None):
    """Causal attention forward through impl: out (B, T, C) from qkv (B, T, 3C).

    classic: qkvr, att (saved), scratch optional (without it qkv is clobbered, see attention_forward);
    the others: lse (saved); cudnn, cudnn+flash: workspace optional (see kernels/cudnn_attention.py).
    """
    if impl == "classic":
        assert qkvr is not None and att is not None, "classic attention needs qkvr and att"
        attention_forward(out, qkvr, att, qkv, num_heads, scratch=scratch)
        return
    assert lse is not None, f"{impl} attention needs lse"
    if impl == "flash":
        _triton_flash().flash_attention_forward(out, lse, qkv, num_heads)
    elif impl in CUDNN_FRONTEND:
        _cudnn().cudnn_attention_forward(out, lse, qkv, num_heads, workspace=workspace)
    elif impl == "torch-cudnn":
        torch_cudnn_attention_forward(out, lse, qkv, num_heads)
    elif impl == "torch-flash":
        torch_flash_attention_forward(out, lse, qkv, num_heads)
    else:
        raise ValueError(f"unknown attention impl {impl!r}; one of {ATTENTION_IMPLS}")


def attention_backward_any(impl: str, dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor,
                           out: torch.Tensor, num_heads: int, *, lse: torch.Tensor | None = None,
                           qkvr: torch.Tensor | None = None, att: torch.Tensor | None = None,
                           dqkvr: torch.Tensor | None = None, datt: torch.Tensor | None = None,
                           scratch: torch.Tensor | None = None, delta: torch.Tensor | None = None,
                           workspace: torch.Tensor | None = None, q_sums: torch.Tensor | None = None):
    """Causal attention backward through impl: dqkv (B, T, 3C) OVERWRITTEN from dout (B, T, C).

    classic: qkvr, att (from the forward), dqkvr, datt, scratch (scratch); qkv and out are not read.
    the others: qkv, out, lse from the forward; flash and cudnn+flash also take delta (B, NH, T) fp32
    scratch (else they allocate one: not inside a CUDA graph capture) and q_sums (optional: dq's column
    sums in blocks of rows, see flash_attention.flash_attention_backward); cudnn a workspace (optional).
    """
    if impl == "classic":
        assert None not in (qkvr, att, dqkvr, datt, scratch), "classic attention needs qkvr, att, dqkvr, datt, scratch"
        attention_backward(dqkv, dqkvr, datt, scratch, dout, qkvr, att, num_heads)
        return
    assert lse is not None, f"{impl} attention needs lse"
    assert q_sums is None or impl in TRITON_BACKWARD, f"{impl} attention does not sum dq's columns"
    if impl in TRITON_BACKWARD:
        _triton_flash().flash_attention_backward(dqkv, dout, qkv, out, lse, num_heads, delta=delta, q_sums=q_sums)
    elif impl == "cudnn":
        _cudnn().cudnn_attention_backward(dqkv, dout, qkv, out, lse, num_heads, workspace=workspace)
    elif impl == "torch-cudnn":
        torch_cudnn_attention_backward(dqkv, dout, qkv, out, lse, num_heads)
    elif impl == "torch-flash":
        torch_flash_attention_backward(dqkv, dout, qkv, out, lse, num_heads)
    else:
        raise ValueError(f"unknown attention impl {impl!r}; one of {ATTENTION_IMPLS}")


@functools.lru_cache(maxsize=None)
def _probe(impl: str, device: torch.device) -> bool:
    """Does impl run forward and backward on device, and agree with the math? A tiny bf16 problem
    against attention written out in fp32 by torch. Any exception means no."""
    try:
        B, T, NH, hs = 2, 128, 2, 64
        C = NH * hs
        g = torch.Generator(device=device).manual_seed(1234)
        qkv = torch.randn(B, T, 3 * C, device=device, generator=g).to(torch.bfloat16)
        dout = torch.randn(B, T, C, device=device, generator=g).to(torch.bfloat16)
        out = torch.empty(B, T, C, device=device, dtype=torch.bfloat16)
        dqkv = torch.empty_like(qkv)
        lse = torch.empty(B, NH, T, device=device, dtype=torch.float32)
        attention_forward_any(impl, out, qkv, NH, lse=lse)
        attention_backward_any(impl, dqkv, dout, qkv, out, NH, lse=lse)
        x = qkv.float().requires_grad_(True)
        q, k, v = _qkv_views(x, NH)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=device).tril(), float("-inf"))
        o = torch.softmax(s, -1) @ v
        (dx,) = torch.autograd.grad(o, x, _heads_view(dout, NH).float())
        o = o.transpose(1, 2).reshape(B, T, C)

        def close(a, b):
            b = b.detach()
            return bool(torch.isfinite(a).all()) and float((a.float() - b).norm() / b.norm()) < 3e-2

        ok = close(out, o) and close(dqkv, dx) and close(lse, torch.logsumexp(s, -1))
        torch.cuda.synchronize(device)
        return ok
    except Exception:  # noqa: BLE001 - a probe: whatever went wrong, this impl is not usable here
        return False


# Preference on a CUDA device, the first that runs and agrees with the math. cuDNN's forward with the Triton
# flash backward comes first: both deterministic, and cuDNN's forward is the faster (0.31 against 0.37 ms a
# layer at GPT-2 124M's B=64, T=1024; bench/RESULTS.md run P); it needs the cuDNN frontend package. Then the
# Triton kernels alone (no extra package). Both take head sizes up to 128 (the Triton backward's limit);
# above that cuDNN's own backward (deterministic, with a large workspace), and PyTorch's cuDNN op last
# (not deterministic).
DEFAULT_PREFERENCE = ("cudnn+flash", "flash", "cudnn", "torch-cudnn")


def default_attention_impl(device, head_size: int = 64) -> str:
    """The first of DEFAULT_PREFERENCE that runs and agrees with the math on this CUDA device (the Triton
    backward only for head sizes up to 128), else classic; classic on the CPU (the interpreter). Probes
    once per device; call it before capturing CUDA graphs (the probe allocates and synchronises)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return "classic"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for impl in DEFAULT_PREFERENCE:
        if impl in TRITON_BACKWARD and head_size > 128:
            continue
        if _probe(impl, device):
            return impl
    return "classic"
