"""GPT-2 on the GPU: llm.c's train_gpt2.cu model (gpt2_forward, gpt2_backward_and_reduce, gpt2_update)
wired from the Triton kernels of `llmpy.kernels` and cuBLAS matrix products (through torch, and through
kernels/cublaslt.py where cuBLASLt's epilogues or a tuned algorithm do better).

Everything lives in preallocated device memory, as in llm.c:

- one flat parameter buffer in the storage dtype ("floatX": bf16 by default, or fp32), llm.c's order
  (config.parameter_views gives the 16 tensors), and one flat gradient buffer of the same dtype;
- AdamW's m and v, fp32, allocated UP FRONT with everything else (so the memory check at construction
  is the whole bill, and a CUDA graph never sees an allocation), and fp32 master weights when the
  storage is bf16 and master_weights is on;
- every activation for the micro-batch (B, T) in two arenas (one floatX, one fp32), carved into named
  views as llm.c's ActivationTensors (see `activation_specs`), plus a few small integer buffers.

Recompute (llm.c's -r): 0 keeps every per-layer activation; 1 does not keep GELU's output per layer
(fch_gelu is one (B, T, 4C) buffer, recomputed from fch in the backward); 2 also keeps one ln1 and one
ln2 buffer instead of one per layer, recomputed in the backward from the residual and the saved
mean/rstd.

GELU fusion (llm.c's -ge): 0 runs GELU outside the matrix products: cuBLASLt fc GEMM + the GELU kernel
forward; backward, cuBLAS fcproj dinp then ONE pass that applies GELU's derivative in place and sums the
result's columns for fc's bias gradient (kernels.matmul.bias_gelu_backward). 1 moves the forward GELU
into the fc product's epilogue (GELU_AUX_BIAS: writes pre-activation and activation); 2 also the
backward's (DGELU epilogue, then fc's bias gradient in a separate reduction), as llm.c's -ge 2. The
epilogues are cuBLASLt's on CUDA (kernels/cublaslt.py, as llm.c), our Triton GEMM's elsewhere or with
use_cublaslt=False; with cuBLASLt, the few products of kernels.matmul.TUNED_ALGOS also run its
algorithm tuned for them.

Two options that move work between passes: proj_bias_in_layernorm (on by default: -0.4 to -0.9 ms a step
on the H200, bench/RESULTS.md run N) has the LayerNorm backward that writes the residual gradient (the
projections' output gradient) also sum its columns into attproj's / fcproj's bias gradient, instead of
a reduction pass of its own; residual_in_product (off: no gain beyond noise in the same A/B) adds the
residual stream in the attproj / fcproj product itself (cuBLASLt's beta = 1 onto the residual; torch's
addmm elsewhere) and then runs a plain LayerNorm, instead of writing the product to a scratch and
running the fused residual + LayerNorm pass. A third, fc_bias_in_product (on by default at -ge 2, where
fc's bias gradient otherwise takes a reduction pass of its own over the (B, T, 4C) gradient): the
LayerNorm forward writes ln2 into rows FC_BIAS_COLUMNS wider, the extra columns a 1 and then 0s, so that
fc's weight-gradient product over [ln2 | 1 | 0] (fp32 output, 776 columns at C = 768) also gives the
column sums of that gradient, the bias gradient (kernels.matmul.weight_grad_bias_column).

The QKV bias gradient (kernels.matmul.qkv_bias_backward) uses what attention's math gives: its key part
is exactly zero (softmax ignores the shift q . b_k of a whole row of scores: llm.c and PyTorch add up
rounding noise there), its value part equals attproj's bias gradient through attproj's weight (each row
of the attention matrix sums to one), handed over in fp32 by the LayerNorm backward that sums it under
proj_bias_in_layernorm (else reduced over dv), and only its query part is a sum, over dq: 100 MB read a
layer at B=64, T=1024 instead of 300 (bench/RESULTS.md run S). With kernels.matmul.QKV_QUERY_SUMS_FROM_ATTENTION
(on by default; run AI) the Triton attention backward ("flash", "cudnn+flash") sums dq's columns a 64-row
block at a time as it writes dq, and no pass reads dq again (other attention paths keep the pass).

overlap_weight_grads ("off" by default): the backward issues every call through llmpy.streams.Lanes with
the tensors it reads and writes; "on" puts the weight-gradient products and bias reductions on a second
CUDA stream (the chain of input gradients stays on the first, "priority" gives it a high-priority
stream), each lane waiting for the other only where their memory conflicts. Same kernels, same bits;
on the H200 no faster (bench/RESULTS.md run O: at the power cap two kernels side by side take as long as
one after the other).

Classifier chunks (classifier_chunks, default `default_classifier_chunks`): the (B*T, Vp) logits are
the largest activation (6.6 GB at GPT-2 124M, B=64, T=1024, bf16), and they are only needed a row at a
time. With k > 1 chunks a training forward runs, per chunk of rows r (fixed order): logits_r = lnf[r] @
wte^T into a chunk-sized buffer; the fused classifier writes losses[r] and the logit gradient in place;
then at once dlnf[r] = dlogits_r @ wte and dwte += dlogits_r^T @ lnf[r] - the classifier's backward,
moved into the forward, so backward() starts from the stored dlnf. Validation is chunked the same way
(losses only); a forward without targets stops at lnf, and logits_last computes the rows it returns.
The chunk's buffer is not memory of its own: it overlays the backward's scratch, dead in the classifier
section (see _shared_scratch_specs).

Attention: "classic" (llm.c's permute + cuBLAS + softmax path: keeps qkvr and the (B, NH, T, T)
probabilities per layer), "flash" (the Triton flash kernels), "cudnn" (cuDNN's through its frontend,
deterministic backward, with a workspace among the buffers), "cudnn+flash" (cuDNN's forward, the Triton
backward), "torch-cudnn" / "torch-flash" (PyTorch's fused ops); the fused paths keep qkv and the fp32
log-sum-exp per layer. "auto" asks kernels.attention.default_attention_impl.

Determinism: every kernel of the step reduces in a fixed order (no atomics), the stochastic-rounding
seeds live in a device tensor advanced by a fixed recurrence every micro-step, so two runs from the same
seed give the same bits (torch-cudnn and torch-flash excepted: PyTorch's backward ops are not bitwise
repeatable; see tests/test_attention.py).

A training step (`train_step`) on CUDA is one CUDA graph: after one eager warm-up step (which compiles
every Triton kernel and fills the fused-attention ops' state), forward + backward of every micro-step,
the global norm, the clip scale and AdamW (with several ranks, NCCL's collectives too) are captured
once; each later step copies its batches into static device buffers, writes the step's hyper-parameters
(learning rate, bias corrections) into device memory, and replays.
"""
from __future__ import annotations

import functools
import math
import numbers
import random
from dataclasses import dataclass

import numpy as np
import torch

from .config import GPT2Config, parameter_views
from .distributed import DataParallel, release_before_shutdown, shard_bounds
from .errors import LlmpyError, shown
from .kernels import adamw as kadamw
from .kernels import attention as kattn
from .kernels import encoder as kenc
from .kernels import global_norm as knorm
from .kernels import layernorm as kln
from .kernels import matmul as kmm
from .kernels.common import interpreting
from .kernels.fused_classifier import fused_classifier
from .kernels.gelu import gelu_forward
from .rand import check_seed
from .reference import checked_adamw_args, checked_dloss, checked_number
from .streams import OVERLAP_MODES, Lanes
from .token_ids import check_id_tensor, check_vocabulary, host_ids

RECOMPUTE_LEVELS = (0, 1, 2)
GELU_FUSION_LEVELS = (0, 1, 2)
# ln2's extra columns with fc_bias_in_product: a 1 (the fc bias gradient's column of the weight-gradient
# product), then 0s to keep rows 16-byte aligned for cuBLAS (776 at C = 768: measured in run W)
FC_BIAS_COLUMNS = 8
ATTENTION_CHOICES = ("auto",) + kattn.ATTENTION_IMPLS

# Headroom asked for on top of the counted buffers: the CUDA context's share is already gone from
# mem_get_info's free bytes, but cuBLAS workspaces, Triton's and the fused-attention ops' temporaries,
# and a captured graph's private pool are not in our count.
MEMORY_MARGIN = 1 << 30

# Row chunks of the layernorm backward's first level under Triton's interpreter: it runs every program in
# Python, so a few long chunks instead of one per row (the GPU keeps kernels.layernorm's constant).
INTERPRET_LN_CHUNKS = 4


def ln_scratch_shapes(num_rows: int, C: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The LayerNorm backward's scratch shapes, plain and with a projection's bias summed along (the
    model's one flat ln_scratch is viewed as either); INTERPRET_LN_CHUNKS chunks under the interpreter."""
    chunks = (INTERPRET_LN_CHUNKS,) if interpreting() else ()
    return (kln.layernorm_backward_scratch_shape(num_rows, C, *chunks),
            kln.layernorm_backward_scratch_shape(num_rows, C, *chunks, proj_bias=True))


# The default classifier chunk: at most this many bytes of logits at once (see default_classifier_chunks).
CLASSIFIER_CHUNK_BYTES = 1 << 30

# Every buffer starts on a 256-byte boundary of its arena (vectorised loads, cuBLAS alignment).
_ALIGN_BYTES = 256

# Stochastic-rounding seeds: one slot per call site that rounds a parameter gradient or a parameter
# (so two sites never share a random stream), advanced every micro-step by a full-period LCG mod 2^31
# (Hull-Dobell: c odd, a - 1 divisible by 4), run on the device so a replayed graph advances it too.
# Distinct slots stay distinct forever: the recurrence is a bijection.
_LCG_A, _LCG_C, _LCG_M = 1103515245, 12345, 1 << 31


def default_gelu_fusion(device, use_cublaslt: bool) -> int:
    """What `-ge -1` means here. 2 with cuBLASLt's epilogues on sm_90 and later, as llm.c: on an H200 at
    B=64, T=1024 the whole step took 2.8 ms less at -ge 2 and 2.4 ms less at -ge 1 than at -ge 0
    (bench/RESULTS.md, run L). 0 elsewhere: our Triton GEMM's epilogues measured no faster than cuBLAS +
    the GELU passes (third kernel run), and nothing else has them."""
    if use_cublaslt and torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return 2
    return 0


def default_classifier_chunks(config: GPT2Config, B: int, T: int, dtype: torch.dtype) -> int:
    """What classifier_chunks=None means: k = ceil(B*T*Vp*itemsize / CLASSIFIER_CHUNK_BYTES) (so one chunk
    of logits is at most 1 GiB), rounded up to the next divisor of B*T (every chunk the same GEMM shape).
    1 (the unchunked path) when the logits fit in one chunk. GPT-2 124M, B=64, T=1024: 8 chunks of 8192
    rows, 0.77 GiB each, in bf16 (16 in fp32)."""
    rows = B * T
    itemsize = torch.empty((), dtype=dtype).element_size()
    want = max(1, -(-rows * config.padded_vocab_size * itemsize // CLASSIFIER_CHUNK_BYTES))
    return next(k for k in range(min(want, rows), rows + 1) if rows % k == 0)


def _resolve_chunks(config: GPT2Config, B: int, T: int, dtype: torch.dtype, chunks: int | None) -> int:
    if chunks is None:
        return default_classifier_chunks(config, B, T, dtype)
    if not isinstance(chunks, int) or not 1 <= chunks <= B * T:
        raise LlmpyError(f"classifier_chunks={chunks!r}: must be None (automatic) or 1 ... B*T = {B * T}")
    return chunks


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) rows of each classifier chunk, in order: chunk i is [i*rows//k, (i+1)*rows//k), so k
    chunks exactly, sizes differing by at most one when k does not divide rows (the largest is
    ceil(rows / k), what the logits buffer holds)."""
    return [(i * rows // chunks, (i + 1) * rows // chunks) for i in range(chunks)]


_FUSED_16BIT = ("cudnn", "cudnn+flash", "torch-cudnn", "torch-flash")  # the CUDA-only paths


def _resolve_attention(attention: str, device: torch.device, dtype: torch.dtype, head_size: int = 64) -> str:
    if attention not in ATTENTION_CHOICES:
        raise LlmpyError(f"attention {attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if attention == "auto":
        impl = kattn.default_attention_impl(device, head_size)
        # cuDNN's and PyTorch's fused kernels are 16-bit; the fp32 model takes the Triton flash kernel instead
        if dtype == torch.float32 and impl in _FUSED_16BIT:
            impl = "flash"
        return impl
    if attention in _FUSED_16BIT and (device.type != "cuda" or interpreting()):
        raise LlmpyError(f"attention {attention!r} needs a CUDA device; use classic or flash here")
    if attention in ("cudnn", "cudnn+flash", "torch-flash") and dtype == torch.float32:
        raise LlmpyError(f"attention {attention!r} has no fp32 kernels; use flash or classic with fp32")
    if attention == "cudnn+flash" and head_size > 128:
        raise LlmpyError(f"attention 'cudnn+flash': the flash backward takes head sizes up to 128, not {head_size}")
    if attention in kattn.CUDNN_FRONTEND:
        try:
            kattn._cudnn().frontend()
        except ImportError as e:
            raise LlmpyError(f"attention {attention!r}: {e}") from None
    return attention


# ----------------------------------------------------------------------------------------------------
# the buffer plan

@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple
    dtype: torch.dtype
    group: str  # parameters, gradients, optimizer, master, activations, scratch
    # a view into an earlier buffer of the same dtype (its name, and an element offset in it) instead of
    # memory of its own: buffers whose lives never overlap share bytes
    within: tuple[str, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN_BYTES - 1) // _ALIGN_BYTES * _ALIGN_BYTES


def activation_specs(config: GPT2Config, B: int, T: int, dtype: torch.dtype, recompute: int,
                     attention: str, device="cpu", classifier_chunks: int = 1,
                     fc_bias_in_product: bool = False) -> list[BufferSpec]:
    """The activation and scratch buffers of the model (llm.c's ActivationTensors), for a resolved
    attention impl and a resolved number of classifier chunks. Per-layer tensors have a leading L; those
    recompute shares across layers have 1. fc_bias_in_product: ln2's rows carry FC_BIAS_COLUMNS more
    columns (a 1, then 0s) and the fc weight gradient's fp32 product gets a scratch of its own."""
    L, C, NH, Vp = config.num_layers, config.channels, config.num_heads, config.padded_vocab_size
    hs = C // NH
    f32 = torch.float32
    Lg = 1 if recompute >= 1 else L  # fch_gelu
    Ll = 1 if recompute >= 2 else L  # ln1, ln2
    classic = attention == "classic"
    # the logits (one chunk of rows of them); in the classic path also the forward's qkv scratch and the
    # backward's datt scratch: both are dead whenever the logits are live (llm.c's "scratchX =
    # acts.output"). Unchunked, datt gets a buffer of its own when it is the larger (as before); chunked,
    # the buffer grows to hold datt (the chunk is small, and max(chunk, datt) < chunk + datt).
    chunk_rows = -(-B * T // classifier_chunks)
    out_numel = chunk_rows * Vp
    # Chunked (and not classic), a logits chunk lives only inside the training forward's classifier
    # section, where the backward's scratch is dead: scratch_bt4c past its first B*T*C (which holds dlnf),
    # dresidual and scratch_btc. So those and the chunk share one region (-0.5 GB at d12, B=64):
    # [scratch_bt4c | dresidual | scratch_btc], the chunk from element B*T*C on (see _shared_scratch_specs).
    shared = classifier_chunks > 1 and not classic
    if classic:
        out_numel = max(out_numel, B * T * 3 * C)
        if classifier_chunks > 1:
            out_numel = max(out_numel, B * NH * T * T)
    specs = [
        BufferSpec("encoded", (B, T, C), dtype, "activations"),
        BufferSpec("ln1", (Ll, B, T, C), dtype, "activations"),
        BufferSpec("ln1_mean", (L, B, T), f32, "activations"),
        BufferSpec("ln1_rstd", (L, B, T), f32, "activations"),
    ]
    if classic:
        specs += [BufferSpec("qkvr", (L, 3, B, NH, T, hs), dtype, "activations"),
                  BufferSpec("att", (L, B, NH, T, T), dtype, "activations")]
    else:
        specs += [BufferSpec("qkv", (L, B, T, 3 * C), dtype, "activations"),
                  BufferSpec("lse", (L, B, NH, T), f32, "activations")]
    specs += [
        BufferSpec("atty", (L, B, T, C), dtype, "activations"),
        BufferSpec("residual2", (L, B, T, C), dtype, "activations"),
        BufferSpec("ln2", (Ll, B, T, C + (FC_BIAS_COLUMNS if fc_bias_in_product else 0)), dtype, "activations"),
        BufferSpec("ln2_mean", (L, B, T), f32, "activations"),
        BufferSpec("ln2_rstd", (L, B, T), f32, "activations"),
        BufferSpec("fch", (L, B, T, 4 * C), dtype, "activations"),
        BufferSpec("fch_gelu", (Lg, B, T, 4 * C), dtype, "activations"),
        BufferSpec("residual3", (L, B, T, C), dtype, "activations"),
        BufferSpec("lnf", (B, T, C), dtype, "activations"),
        BufferSpec("lnf_mean", (B, T), f32, "activations"),
        BufferSpec("lnf_rstd", (B, T), f32, "activations"),
        BufferSpec("losses", (B, T), f32, "activations"),
    ]
    specs += _shared_scratch_specs(B, T, C, out_numel, dtype) if shared else [
        BufferSpec("output", (out_numel,), dtype, "activations"),
        # forward: the attention / MLP projection output; backward: dl_btc, the (B, T, C) gradient
        BufferSpec("scratch_btc", (B, T, C), dtype, "scratch"),
        # backward: dl_bt4c (the MLP's 4C gradient), also dlnf and dqkv; with classifier chunks, dlnf from the
        # training forward's classifier until the backward's first layernorm (the forward never uses it)
        BufferSpec("scratch_bt4c", (B, T, 4 * C), dtype, "scratch"),
        # backward: the gradient of the residual stream, accumulated by every layernorm backward
        BufferSpec("dresidual", (B, T, C), dtype, "scratch"),
    ]
    specs += [
        # flat: viewed as the plain backward's (chunks, 2, C) or, where the attproj / fcproj bias gradients
        # ride along (proj_bias_in_layernorm), the (chunks', 3, C) of that variant
        BufferSpec("ln_scratch", (max(math.prod(s) for s in ln_scratch_shapes(B * T, C)),), f32, "scratch"),
        # backward: attproj's bias gradient of this micro-step in fp32, from the LayerNorm backward that sums
        # it (proj_bias_in_layernorm) to the QKV bias gradient's value part (kernels.matmul.qkv_bias_backward)
        BufferSpec("proj_bias_sum", (C,), f32, "scratch"),
    ]
    if fc_bias_in_product:
        # the fc weight-gradient product's fp32 output: the weight gradient, then the bias gradient column
        specs.append(BufferSpec("fc_grad_wide", (4 * C * (C + FC_BIAS_COLUMNS),), f32, "scratch"))
    if classic and B * NH * T * T > out_numel:
        specs.append(BufferSpec("datt", (B, NH, T, T), dtype, "scratch"))
    if attention in kattn.TRITON_BACKWARD:
        specs.append(BufferSpec("delta", (B, NH, T), f32, "scratch"))
    if attention in kattn.TRITON_BACKWARD and kmm.QKV_QUERY_SUMS_FROM_ATTENTION:
        # the column sums of dq in blocks of rows, from the attention backward to the QKV bias gradient
        specs.append(BufferSpec("q_bias_sums", (kattn._triton_flash().q_sum_blocks(B, T), C), f32, "scratch"))
    if attention in kattn.CUDNN_FRONTEND:
        # cuDNN's workspace (the deterministic backward's is large); sized by building the graphs, which
        # needs the GPU: a plan made off it counts none
        nbytes = (kattn._cudnn().workspace_bytes(B, T, NH, hs, dtype, device, backward=attention == "cudnn")
                  if torch.device(device).type == "cuda" else 0)
        specs.append(BufferSpec("cudnn_workspace", (max(1, nbytes),), torch.uint8, "scratch"))
    bias_numel = max([kmm.bias_scratch_numel(B * T, n, device) for n in (3 * C, C, 4 * C)]
                     + [kmm.bias_scratch_numel(B * T, 4 * C, device, gelu=True)])
    specs.append(BufferSpec("bias_scratch", (max(1, bias_numel),), f32, "scratch"))
    # the encoder backward's fp32 piece sums (its int scratch is allocated apart, counted below)
    specs.append(BufferSpec("encoder_partial", (2 * kenc.cdiv(B * T, kenc.ENC_PIECE), C), f32, "scratch"))
    specs.append(BufferSpec("norm_partials", (knorm.num_norm_partials(config.num_parameters),), f32, "scratch"))
    return specs


def _shared_scratch_specs(B: int, T: int, C: int, out_numel: int, dtype: torch.dtype) -> list[BufferSpec]:
    """The logits chunk and the backward's (B, T, *) scratch as views of one region "shared_scratch":
    scratch_bt4c at 0, dresidual after it, scratch_btc after that (each at an aligned offset); the chunk
    ("output") from the aligned end of dlnf (scratch_bt4c's first B*T*C elements) on, over the rest of
    scratch_bt4c, dresidual and scratch_btc, and on past them if it is the larger. Safe because the chunk
    is written and read only between the last layer's forward and the end of the classifier section, and
    none of the three is live there: the forward's projection scratch (scratch_btc) is spent, the backward
    zeroes dresidual and writes its dl_btc / dl_bt4c before reading them, and dlnf stays clear of it."""
    align = _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    up = lambda n: -(-n // align) * align  # noqa: E731
    btc, bt4c = B * T * C, B * T * 4 * C
    o_dres = up(bt4c)
    o_btc = o_dres + up(btc)
    o_out = up(btc)
    region = max(o_btc + btc, o_out + out_numel)
    return [
        BufferSpec("shared_scratch", (region,), dtype, "scratch"),
        BufferSpec("scratch_bt4c", (B, T, 4 * C), dtype, "scratch", within=("shared_scratch", 0)),
        BufferSpec("dresidual", (B, T, C), dtype, "scratch", within=("shared_scratch", o_dres)),
        BufferSpec("scratch_btc", (B, T, C), dtype, "scratch", within=("shared_scratch", o_btc)),
        BufferSpec("output", (out_numel,), dtype, "activations", within=("shared_scratch", o_out)),
    ]


def memory_plan(config: GPT2Config, B: int, T: int, dtype: torch.dtype = torch.bfloat16,
                master_weights: bool = True, recompute: int = 1, attention: str = "cudnn",
                device="cpu", classifier_chunks: int | None = None, optimizer_numel: int | None = None,
                fc_bias_in_product: bool = False) -> dict:
    """Bytes the model allocates, by group and by buffer, without allocating anything (attention must be
    a resolved impl, not "auto"; classifier_chunks as the model's: None is default_classifier_chunks,
    1 the unchunked logits; optimizer_numel: the elements of AdamW's m, v and the master weights this
    process keeps, all of them (None) or a ZeRO-1 shard). The returned dict: {"groups": {group: bytes},
    "buffers": {name: bytes}, "total": bytes}."""
    N = config.num_parameters
    S = N if optimizer_numel is None else optimizer_numel
    f32 = torch.float32
    specs = [BufferSpec("params", (N,), dtype, "parameters"), BufferSpec("grads", (N,), dtype, "gradients"),
             BufferSpec("adam_m", (S,), f32, "optimizer"), BufferSpec("adam_v", (S,), f32, "optimizer")]
    if master_weights and dtype != torch.float32:
        specs.append(BufferSpec("master", (S,), f32, "master"))
    chunks = _resolve_chunks(config, B, T, dtype, classifier_chunks)
    specs += activation_specs(config, B, T, dtype, recompute, attention, device, chunks, fc_bias_in_product)
    # integer buffers: inputs, targets (int32), the encoder's sort (int32 ids, int64 permutation)
    specs += [BufferSpec("inputs", (B, T), torch.int32, "scratch"),
              BufferSpec("targets", (B, T), torch.int32, "scratch"),
              BufferSpec("encoder_sorted", (B * T,), torch.int32, "scratch"),
              BufferSpec("encoder_perm", (B * T,), torch.int64, "scratch")]
    groups: dict[str, int] = {}
    buffers: dict[str, int] = {}
    for s in specs:
        b = _aligned(s.nbytes)
        buffers[s.name] = b  # a view's own size, though it costs nothing more
        if s.within is None:
            groups[s.group] = groups.get(s.group, 0) + b
    return {"groups": groups, "buffers": buffers, "total": sum(groups.values()),
            "shared": {s.name: s.within[0] for s in specs if s.within is not None}}


def format_memory(plan: dict) -> str:
    gib = 1 << 30
    parts = [f"{g} {b / gib:.2f}" for g, b in plan["groups"].items()]
    views = plan.get("shared", {})  # views into another buffer: not memory of their own
    big = sorted(((n, b) for n, b in plan["buffers"].items() if n not in views), key=lambda kv: -kv[1])[:6]
    return (f"{plan['total'] / gib:.2f} GiB ({plan['total'] / 1e9:.2f} GB): " + ", ".join(parts) + " GiB"
            + " | largest: " + ", ".join(f"{n} {b / gib:.2f}" for n, b in big))


def _check_flat_buffer(flat, who: str, what: str = "the flat parameter buffer"):
    if not isinstance(flat, torch.Tensor) or not flat.is_floating_point():
        got = (f"a {flat.dtype} tensor" if isinstance(flat, torch.Tensor)
               else "None" if flat is None else f"a {type(flat).__name__}")
        raise LlmpyError(f"{who} is {got}; it must be {what}, a floating-point torch tensor")


class _Arena:
    """One flat allocation per dtype, carved into aligned, named, contiguous views."""

    def __init__(self, specs: list[BufferSpec], device):
        self.views: dict[str, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, list[BufferSpec]] = {}
        for s in specs:
            by_dtype.setdefault(s.dtype, []).append(s)
        for dt, group in by_dtype.items():
            itemsize = torch.empty((), dtype=dt).element_size()
            align = _ALIGN_BYTES // itemsize
            offsets, total = {}, 0
            numels = {s.name: s.numel for s in group}
            for s in group:
                if s.within is None:
                    offsets[s.name] = total
                    total += (s.numel + align - 1) // align * align
            flat = torch.empty(total, dtype=dt, device=device)
            self.buffers.append(flat)
            for s in group:
                if s.within is None:
                    off = offsets[s.name]
                else:  # a view into an earlier buffer of this dtype, inside its bounds
                    host, rel = s.within
                    assert rel % align == 0 and rel + s.numel <= numels[host], (s.name, host)
                    off = offsets[host] + rel
                self.views[s.name] = flat[off:off + s.numel].view(s.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def get(self, name: str) -> torch.Tensor | None:
        return self.views.get(name)


def _decay_ranges(config: GPT2Config) -> list[tuple[int, int]]:
    """[start, end) spans of the flat buffer that get weight decay (the 2-D tensors), adjacent ones merged."""
    mask = config.weight_decay_mask()
    ranges: list[list[int]] = []
    offset = 0
    for name, n in config.parameter_sizes().items():
        if mask[name]:
            if ranges and ranges[-1][1] == offset:
                ranges[-1][1] = offset + n
            else:
                ranges.append([offset, offset + n])
        offset += n
    return [tuple(r) for r in ranges]


# ----------------------------------------------------------------------------------------------------
# the model

class GPT2Model:
    """GPT-2 for training on one device (CUDA; or the CPU through Triton's interpreter, for tests).

    Typical use (what the trainer does):

        model = GPT2Model(config, params, B, T)
        loss, norm = model.train_step([(x, y), ...], lr, step, weight_decay, grad_clip)
        val = model.validate(x, y)

    or step by step: zero_grad(); forward(x, y, dloss=1/(B*T*accum)); backward() per micro-step;
    then update(lr, step, ...). The pieces never synchronise with the host except loss(),
    grad_norm(), validate() and the copies back to the CPU.
    """

    def __init__(self, config: GPT2Config, params: torch.Tensor, B: int, T: int, *, device="cuda",
                 dtype: torch.dtype = torch.bfloat16, master_weights: bool = True, recompute: int = 1,
                 gelu_fusion: int = -1, attention: str = "auto", seed: int = 42, cuda_graph: bool = True,
                 stochastic_rounding: bool = True, classifier_chunks: int | None = None,
                 data_parallel: "DataParallel | None" = None, overlap_reduction: bool = True,
                 use_cublaslt: bool | None = None, proj_bias_in_layernorm: bool = True,
                 residual_in_product: bool = False, overlap_weight_grads: str = "off",
                 fc_bias_in_product: bool | None = None):
        if not isinstance(config, GPT2Config):
            raise LlmpyError(f"GPT2Model: config {shown(config)}: must be a GPT2Config (llmpy.parse_descriptor "
                             "makes one from a descriptor)")
        _check_flat_buffer(params, "GPT2Model: params")
        self.config = config
        self.device = self._check_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in (torch.bfloat16, torch.float32):
            raise LlmpyError(f"dtype {dtype}: the model trains in torch.bfloat16 or torch.float32")
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0 for n in (B, T)):
            raise LlmpyError(f"B={B!r}, T={T!r}: the micro-batch must be positive integers")
        B, T = int(B), int(T)
        check_seed(seed, "GPT2Model: seed")  # None would draw the rounding seeds from the OS: not repeatable
        if T > config.max_seq_len:
            raise LlmpyError(f"-t {T}: longer than the model's context of {config.max_seq_len} tokens")
        if recompute not in RECOMPUTE_LEVELS:
            raise LlmpyError(f"-r {recompute}: must be one of 0, 1, 2")
        # -ge 1 / 2's epilogues and the tuned products through cuBLASLt (None: where it binds)
        self.use_cublaslt = kmm.resolve_cublaslt(use_cublaslt, self.device)
        if gelu_fusion == -1:
            gelu_fusion = default_gelu_fusion(self.device, self.use_cublaslt)
        if gelu_fusion not in GELU_FUSION_LEVELS:
            raise LlmpyError(f"-ge {gelu_fusion}: must be -1 (per GPU) or one of 0, 1, 2")
        if params.numel() != config.num_parameters:
            raise LlmpyError(f"parameter buffer has {params.numel()} elements, the model needs "
                             f"{config.num_parameters}")
        self.B, self.T = B, T
        self.dtype = dtype
        self.recompute = recompute
        self.gelu_fusion = gelu_fusion
        self.master_weights = bool(master_weights) and dtype == torch.bfloat16
        self.attention = _resolve_attention(attention, self.device, dtype, config.channels // config.num_heads)
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda" and not interpreting()
        # False only to show what round-to-nearest does to bf16 weights updated without master weights
        self.stochastic_rounding = bool(stochastic_rounding)
        # attproj's and fcproj's bias gradients summed by the LayerNorm backward that writes their output
        # gradient (the residual stream's), instead of a reduction pass of their own over it
        self.proj_bias_in_layernorm = bool(proj_bias_in_layernorm)
        # the residual add in the projections' product (cuBLASLt: beta = 1 onto the residual stream), then a
        # plain LayerNorm, instead of the product into a scratch and the fused residual + LayerNorm pass
        self.residual_in_product = bool(residual_in_product)
        # fc's bias gradient from its weight-gradient product (ln2 with a column of ones; a few more output
        # columns) instead of a reduction pass over the (B, T, 4C) gradient. Only where that pass exists:
        # at -ge 2 (-ge 0 and 1 sum it inside the dGELU pass). None: there, on.
        if fc_bias_in_product is None:
            fc_bias_in_product = gelu_fusion == 2
        if fc_bias_in_product and gelu_fusion != 2:
            raise LlmpyError(f"fc_bias_in_product needs -ge 2 (at -ge {gelu_fusion} the dGELU pass sums fc's bias)")
        self.fc_bias_in_product = bool(fc_bias_in_product)
        # the backward's weight and bias gradients on a second stream (llmpy.streams): "off", "on", or
        # "priority" (the input-gradient chain also on a high-priority stream)
        if overlap_weight_grads not in OVERLAP_MODES:
            raise LlmpyError(f"overlap_weight_grads={overlap_weight_grads!r}: one of {', '.join(OVERLAP_MODES)}")
        self.overlap_weight_grads = overlap_weight_grads
        self._lanes = Lanes(self.device, overlap_weight_grads)
        if self._lanes.side_stream() is not None and self.use_cublaslt:
            kmm.cublaslt.reserve_workspace(self._lanes.side_stream())
        self.seed = seed
        # None: default_classifier_chunks (<= 1 GiB of logits a chunk); 1: the whole (B*T, Vp) logits
        self.classifier_chunks = _resolve_chunks(config, B, T, dtype, classifier_chunks)
        self._chunk_bounds = chunk_bounds(B * T, self.classifier_chunks)

        # data parallelism (llmpy.distributed): this rank's shard [lo, hi) of the flat buffers, whole
        # chunks of the global norm; with ZeRO-1 the optimizer state and master weights are the shard's
        N = config.num_parameters
        self.dp = data_parallel
        self.world_size = data_parallel.world_size if data_parallel else 1
        self.rank = data_parallel.rank if data_parallel else 0
        self.zero_stage = data_parallel.zero_stage if data_parallel else 0
        self._shards = shard_bounds(N, self.world_size, knorm.NORM_CHUNK)
        self._lo, self._hi = self._shards[self.rank]
        self._opt_lo = self._lo if self.zero_stage == 1 else 0
        opt_n = (self._hi - self._lo) if self.zero_stage == 1 else N

        self._plan = memory_plan(config, B, T, dtype, self.master_weights, recompute, self.attention,
                                 self.device, self.classifier_chunks, optimizer_numel=opt_n,
                                 fc_bias_in_product=self.fc_bias_in_product)
        self._check_memory()

        f32 = torch.float32
        dev = self.device
        # parameters, gradients, optimizer state, master weights: flat buffers in llm.c's order
        self.params_memory = torch.empty(N, dtype=dtype, device=dev)
        self.grads_memory = torch.zeros(N, dtype=dtype, device=dev)
        self.m_memory = torch.zeros(opt_n, dtype=f32, device=dev)
        self.v_memory = torch.zeros(opt_n, dtype=f32, device=dev)
        self.master_memory = torch.empty(opt_n, dtype=f32, device=dev) if self.master_weights else None
        # lazily: the fp32 accumulator of micro-steps, the reduction's buffers (see _prepare)
        self._acc32 = None
        self._reduce_bufs: dict = {}
        self._update_grads = self.grads_memory  # what the next AdamW reads (set by _reduce_norm_clip)
        # several ranks: reduce buckets of finished layers during the last micro-step's backward (the
        # collectives are issued between the layers' kernels), or all at once after it
        self.overlap_reduction = bool(overlap_reduction) and self.world_size > 1
        self._buckets: list = []  # _bucket_plan(), made by _prepare (it needs the gradient views)
        self._pending: list = []  # (work, my part [x, y), its receive buffer) of the buckets in flight
        self.params = parameter_views(self.params_memory, config)
        self.grads = parameter_views(self.grads_memory, config)
        self.load_parameters(params)

        # activations and scratch
        self.acts = _Arena(activation_specs(config, B, T, dtype, recompute, self.attention, dev,
                                            self.classifier_chunks, self.fc_bias_in_product), dev)
        self.inputs = torch.zeros(B, T, dtype=torch.int32, device=dev)
        self.targets = torch.zeros(B, T, dtype=torch.int32, device=dev)
        self._enc_scratch = kenc.EncoderBackwardScratch(
            sorted_ids=torch.empty(B * T, dtype=torch.int32, device=dev),
            perm=torch.empty(B * T, dtype=torch.int64, device=dev),
            partial=self.acts["encoder_partial"])

        # small device state: the optimizer's hyper-parameters, the squared norm, the loss sum, seeds
        self._hyper = kadamw.hyper_tensor(dev)
        # on CUDA the host side of the hyper-parameters' copy is pinned and reused (torch.tensor + a pageable
        # copy cost ~0.1 ms a step while the GPU waits); the event guards the buffer against a rewrite
        # before the last copy out of it ran
        self._hyper_host = self._hyper_copied = None
        if dev.type == "cuda":
            self._hyper_host = torch.zeros(kadamw.GRAD_SCALE, dtype=f32, pin_memory=True)
            self._hyper_copied = torch.cuda.Event()
        self._decay = kadamw.decay_ranges_tensor(_decay_ranges(config), dev)
        self._norm_sq = torch.zeros(1, dtype=f32, device=dev)
        L = config.num_layers
        # slots: 0 encoder, 1 lnf, 2 adamw, then per layer ln1, ln2, qkvb, attprojb, fcb, fcprojb
        self._n_seeds = 3 + 6 * L
        rng = random.Random(seed)
        init = [rng.randrange(_LCG_M) for _ in range(self._n_seeds)]
        while len(set(init)) < len(init):  # distinct slots (vanishingly unlikely to loop)
            init = [rng.randrange(_LCG_M) for _ in range(self._n_seeds)]
        self._seeds = torch.tensor(init, dtype=torch.int64, device=dev)
        self._seeds_base = self._seeds.clone()  # the seeds at the start of a train_step

        self._cur_inputs = None      # the (B, T) ids of the last forward (the backward's encoder needs them)
        # the last forward was a training one: the logit gradient is in place (unchunked), or dlnf is in
        # scratch_bt4c and dwte has the classifier's share (chunked)
        self._have_dlogits = False
        self._have_losses = False    # a forward with targets has written the losses (the arena starts uninitialised)
        self._norm_fresh = False     # _norm_sq holds the norm of the current gradients
        self._graphs: dict = {}      # key -> (main graph, update graph or None)
        self._graph_grads: dict = {}  # key -> the gradient its AdamW reads (_update_grads as the capture set it)
        if self.world_size > 1:  # the graphs will hold NCCL work: free them before the group goes
            release_before_shutdown(self.release_graphs)
        self._warmed: set = set()
        self._staging: dict = {}     # accum -> (device inputs, device targets, pinned host buffer)
        self._micro_losses: dict = {}  # accum -> (accum,) fp32: each micro-step's loss sum
        self._readout = None           # pinned fp32: the step's loss sums and squared norm, read back (_fetch)
        self.last_step_skipped = False

    def _check_kernels_run(self, who: str):
        # a CPU model runs its kernels in Triton's interpreter only (without it, Triton's raw "0 active drivers");
        # checked at the first kernel, not at construction: a model built for its memory plan runs none
        if self.device.type == "cpu" and not interpreting():
            raise LlmpyError(f"GPT2Model.{who}: a model on the CPU runs its kernels in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before importing llmpy (slow; meant for tests), or use device=cuda")

    @staticmethod
    def _check_device(device) -> torch.device:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            dev = None
        if dev is None or dev.type not in ("cuda", "cpu"):
            raise LlmpyError(f"GPT2Model: device {str(device)!r}: must be cuda (a GPU) or cpu (Triton's interpreter)")
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0:
                raise LlmpyError(f"GPT2Model: device {str(device)!r}: no CUDA GPU is visible to torch")
            if dev.index is not None and dev.index >= n:
                raise LlmpyError(f"GPT2Model: device {str(device)!r}: torch sees {n} CUDA device(s)")
        return dev

    # ------------------------------------------------------------------------------------------------
    # memory

    def _check_memory(self):
        if self.device.type != "cuda" or interpreting():
            return
        free, total = torch.cuda.mem_get_info(self.device)
        need = self._plan["total"] + MEMORY_MARGIN
        if need > free:
            gib = 1 << 30
            hint = "lower -b (the micro-batch)"
            if self.recompute < 2:
                hint += f", raise -r (now {self.recompute}; 2 keeps the least)"
            if self.attention == "classic":
                hint += ", or use a fused attention (classic keeps (B, NH, T, T) per layer)"
            hint += "; use -d to keep the total batch"
            raise LlmpyError(
                f"not enough device memory for B={self.B} T={self.T}: the model needs {need / gib:.2f} GiB "
                f"({format_memory(self._plan)}, plus {MEMORY_MARGIN / gib:.0f} GiB headroom), "
                f"{free / gib:.2f} GiB of {total / gib:.2f} GiB is free: {hint}")

    def memory_report(self) -> dict:
        """The bytes allocated at construction: {"groups": {group: bytes}, "buffers": {name: bytes},
        "total": bytes, "shared": {view: the buffer it lies in}} (format_memory(model.memory_report()) for
        one line). A view's bytes are listed under "buffers" but counted only once, in its host's."""
        return self._plan

    def describe(self) -> str:
        return (f"GPT2Model {self.config.describe()} | B={self.B} T={self.T} | {str(self.dtype).split('.')[-1]} | "
                f"master weights {int(self.master_weights)} | recompute {self.recompute} | "
                f"gelu fusion {self.gelu_fusion} | cuBLASLt {int(self.use_cublaslt)} | attention {self.attention} | "
                f"classifier chunks {self.classifier_chunks} | overlap {self.overlap_weight_grads} | "
                f"cuda graph {int(self.cuda_graph)} | {self._describe_parallel()}memory {format_memory(self._plan)}")

    def _describe_parallel(self) -> str:
        if self.world_size == 1:
            return ""
        kept = "AdamW state and master weights" if self.master_weights else "AdamW state"
        what = (f"ZeRO-1: {kept} of {self._hi - self._lo:,} of "
                f"{self.config.num_parameters:,} parameters" if self.zero_stage == 1 else "all-reduce (-z 0)")
        return f"rank {self.rank} of {self.world_size}, {what} | "

    # ------------------------------------------------------------------------------------------------
    # parameters in and out

    def load_parameters(self, flat: torch.Tensor):
        """Set the weights from a flat fp32 (or bf16) buffer in llm.c's order. With master weights the
        fp32 copy takes the values and the bf16 working copy their round-to-nearest."""
        _check_flat_buffer(flat, "load_parameters: flat")
        if flat.numel() != self.config.num_parameters:
            raise LlmpyError(f"parameter buffer has {flat.numel()} elements, the model needs "
                             f"{self.config.num_parameters}")
        flat = flat.detach().reshape(-1)
        if self.master_memory is not None:
            self.master_memory.copy_(flat[self._opt_lo:self._opt_lo + self.master_memory.numel()].to(torch.float32))
        # the working copy: the round-to-nearest of the (master) values
        self.params_memory.copy_(flat.to(torch.float32))

    def _whole(self, shard: torch.Tensor, host: bool = True) -> torch.Tensor:
        """A flat fp32 CPU copy of an optimizer-side buffer: itself, or with ZeRO-1 every rank's shard
        gathered (a collective: every rank calls it). host=False: the whole buffer on the device, not copied
        when it is already whole (a rank that writes no checkpoint joins the gather, but needs no CPU copy)."""
        if self.zero_stage != 1:
            return shard.detach().to("cpu", torch.float32).clone() if host else shard.detach()
        whole = torch.empty(self.config.num_parameters, dtype=shard.dtype, device=shard.device)
        self.dp.all_gather_uneven(whole, shard, self._shards, keep=False)
        return whole.to("cpu", torch.float32) if host else whole

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole flat buffer (all of it without ZeRO-1)."""
        whole = whole.reshape(-1)
        return whole[self._lo:self._hi] if self.zero_stage == 1 else whole

    def parameters_fp32(self) -> torch.Tensor:
        """The flat fp32 parameters on the CPU (from the master weights when there are some). With ZeRO-1
        a collective: every rank calls it."""
        if self.master_memory is not None:
            return self._whole(self.master_memory)
        return self.params_memory.detach().to("cpu", torch.float32).clone()

    def master_fp32(self, host: bool = True) -> torch.Tensor | None:
        """The whole fp32 master weights on the CPU (host=False: on the device), or None without them
        (ZeRO-1: a collective)."""
        return None if self.master_memory is None else self._whole(self.master_memory, host)

    def optimizer_state(self, host: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """AdamW's (m, v), whole flat fp32 CPU copies (for checkpoints that resume; ZeRO-1: gathered from
        every rank's shard, a collective), so a checkpoint resumes on any number of GPUs. host=False: only
        this rank's part in the collectives, and None (a rank that writes no checkpoint)."""
        if not host:
            self._whole(self.m_memory, host=False)  # joined, then dropped: one whole buffer at a time
            self._whole(self.v_memory, host=False)
            return None
        return self._whole(self.m_memory), self._whole(self.v_memory)

    def load_optimizer_state(self, m: torch.Tensor, v: torch.Tensor):
        """Whole (m, v) as optimizer_state() returns them; ZeRO-1 keeps this rank's shard."""
        N = self.config.num_parameters
        _check_flat_buffer(m, "load_optimizer_state: m", "AdamW's whole flat m")
        _check_flat_buffer(v, "load_optimizer_state: v", "AdamW's whole flat v")
        if m.numel() != N or v.numel() != N:  # both checked before either is written (copy_ would broadcast one)
            raise LlmpyError(f"load_optimizer_state: m has {m.numel():,} elements, v {v.numel():,}; the model has "
                             f"{N:,} parameters")
        self.m_memory.copy_(self._mine(m))
        self.v_memory.copy_(self._mine(v))

    def load_master(self, master: torch.Tensor):
        """Whole fp32 master weights (a checkpoint's); ZeRO-1 keeps this rank's shard."""
        if self.master_memory is None:
            raise LlmpyError("load_master: this model keeps no master weights (only bf16 storage with "
                             "master_weights=True has them)")
        _check_flat_buffer(master, "load_master: master", "the whole flat master weights")
        if master.numel() != self.config.num_parameters:
            raise LlmpyError(f"load_master: the master weights have {master.numel():,} elements, the model "
                             f"{self.config.num_parameters:,} parameters")
        self.master_memory.copy_(self._mine(master))

    def gradients_fp32(self) -> torch.Tensor:
        """The gradient as fp32 on the CPU (tests, debugging): after train_step the one AdamW used (the
        micro-steps' sum, reduced over ranks; ZeRO-1: gathered, a collective), else the gradient buffer."""
        g = self._update_grads
        # ZeRO-1's reduced shard: gathered on every rank (not told by its size: a model of one norm chunk has one
        # rank's shard the whole buffer, and that rank skipped the collective the others waited in)
        if self.zero_stage == 1 and g is not self.grads_memory:
            return self._whole(g)
        return g.detach().to("cpu", torch.float32).clone()

    # ------------------------------------------------------------------------------------------------
    # inputs

    def _checked_ids(self, ids, what: str) -> torch.Tensor:
        """ids as a (B, T) tensor of integers, refused otherwise; its values inside the vocabulary wherever they
        are on the host (the CPU model's own int32 tensors too). A tensor on a GPU is taken as it is: reading it
        back would cost a sync (train_step checks its CPU batches before it copies them there)."""
        if isinstance(ids, torch.Tensor) and ids.device.type != "cpu":
            check_id_tensor(ids, what)  # a meta tensor too, and a sparse one on the GPU
            host = None
        else:
            host = host_ids(ids, what)
        shape = tuple(ids.shape if host is None else host.shape)
        if shape != (self.B, self.T):
            raise LlmpyError(f"{what} of shape {list(shape)}: the model was built for B={self.B}, T={self.T}")
        if host is None:
            return ids
        self._check_ids(host, what)
        # numpy's reversed views and big-endian arrays, which torch does not take: as int32 (the range is checked)
        return ids if isinstance(ids, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(host, dtype=np.int32))

    def _device_ids(self, ids: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """A (B, T) int32 device tensor for checked ids: ids itself when it already is one, else copied into buf."""
        if ids.device == self.device and ids.dtype == torch.int32 and ids.is_contiguous():
            return ids
        buf.copy_(ids)
        return buf

    def _check_ids(self, ids: np.ndarray, what: str):
        """Token ids (numpy: see _stage) inside the vocabulary."""
        check_vocabulary(ids, self.config.vocab_size, what)

    # ------------------------------------------------------------------------------------------------
    # forward

    def _layer_buffers(self, l: int) -> dict:
        a = self.acts
        r2 = self.recompute >= 2
        d = {
            "residual": a["encoded"] if l == 0 else a["residual3"][l - 1],
            "ln1": a["ln1"][0 if r2 else l], "ln1_mean": a["ln1_mean"][l], "ln1_rstd": a["ln1_rstd"][l],
            "atty": a["atty"][l], "residual2": a["residual2"][l],
            # ln2: the LayerNorm's output; ln2_wide: with fc_bias_in_product, its rows with the bias column
            "ln2_wide": a["ln2"][0 if r2 else l], "ln2": a["ln2"][0 if r2 else l][..., :self.config.channels],
            "ln2_mean": a["ln2_mean"][l], "ln2_rstd": a["ln2_rstd"][l],
            "fch": a["fch"][l], "fch_gelu": a["fch_gelu"][0 if self.recompute >= 1 else l],
            "residual3": a["residual3"][l],
        }
        if self.attention == "classic":
            d["qkvr"], d["att"] = a["qkvr"][l], a["att"][l]
        else:
            d["qkv"], d["lse"] = a["qkv"][l], a["lse"][l]
        return d

    def _output(self, numel: int) -> torch.Tensor:
        return self.acts["output"].view(-1)[:numel]

    def logits_view(self) -> torch.Tensor:
        """(B, T, Vp) view of the logits buffer (the logit gradient after a training forward). Only with
        classifier_chunks=1: chunked, the buffer holds one chunk, and no forward keeps all the logits."""
        if self.classifier_chunks > 1:
            raise LlmpyError(f"logits_view: classifier_chunks={self.classifier_chunks} keeps no (B, T, Vp) "
                             f"logits (build the model with classifier_chunks=1, or use logits_last)")
        return self._output(self.B * self.T * self.config.padded_vocab_size).view(
            self.B, self.T, self.config.padded_vocab_size)

    def _qkv_scratch(self) -> torch.Tensor:
        # classic: qkv is dead once permuted into qkvr, so it lives in the (not yet written) logits
        B, T, C = self.B, self.T, self.config.channels
        return self._output(B * T * 3 * C).view(B, T, 3 * C)

    def forward(self, inputs, targets=None, dloss: float | None = None):
        """llm.c's gpt2_forward. inputs/targets: (B, T) token ids (CPU tensors are copied into the static
        device buffers; (B, T) int32 tensors on the device are used as they are). With targets: the
        losses; with dloss as well (training): the logit gradient dloss * (softmax - onehot) is written
        over the logits, ready for backward(). Returns nothing; loss() reads the mean loss.

        classifier_chunks > 1: the logits exist one chunk at a time; a training forward also runs the
        classifier's backward (dlnf, and dwte ACCUMULATED: zero_grad() comes before it, not between it and
        backward()), and a forward without targets stops at lnf (logits_last computes its rows)."""
        dloss = checked_dloss(dloss, "GPT2Model.forward")
        self._check_kernels_run("forward")
        lt = self.use_cublaslt
        cfg, p, a = self.config, self.params, self.acts
        NH, L = cfg.num_heads, cfg.num_layers
        if dloss is not None and targets is None:
            raise LlmpyError("forward: dloss (training) needs targets")
        # both checked before anything is written: refused targets leave the last forward's state as it was
        inputs = self._checked_ids(inputs, "inputs")
        targets = None if targets is None else self._checked_ids(targets, "targets")
        inp = self._device_ids(inputs, self.inputs)
        self._cur_inputs = inp
        self._have_dlogits = False
        kenc.encoder_forward(a["encoded"], inp, p["wte"], p["wpe"])
        b0 = self._layer_buffers(0)
        kln.layernorm_forward(b0["ln1"], b0["ln1_mean"], b0["ln1_rstd"], a["encoded"], p["ln1w"][0], p["ln1b"][0])
        proj = a["scratch_btc"]
        for l in range(L):
            b = self._layer_buffers(l)
            # attention block
            qkv = b["qkv"] if self.attention != "classic" else self._qkv_scratch()
            kmm.matmul_forward(qkv, b["ln1"], p["qkvw"][l], p["qkvb"][l], use_cublaslt=lt)
            if self.attention == "classic":
                # no att @ v scratch given: it goes into qkv, which is dead by then
                kattn.attention_forward_any("classic", b["atty"], qkv, NH, qkvr=b["qkvr"], att=b["att"])
            else:
                kattn.attention_forward_any(self.attention, b["atty"], qkv, NH, lse=b["lse"],
                                            workspace=a.get("cudnn_workspace"))
            if self.residual_in_product:
                kmm.matmul_forward(b["residual2"], b["atty"], p["attprojw"][l], p["attprojb"][l], use_cublaslt=lt,
                                   residual=b["residual"])
                kln.layernorm_forward(b["ln2"], b["ln2_mean"], b["ln2_rstd"], b["residual2"], p["ln2w"][l],
                                      p["ln2b"][l], bias_column=self.fc_bias_in_product)
            else:
                kmm.matmul_forward(proj, b["atty"], p["attprojw"][l], p["attprojb"][l], use_cublaslt=lt)
                kln.fused_residual_forward(b["residual2"], b["ln2"], b["ln2_mean"], b["ln2_rstd"], b["residual"],
                                           proj, p["ln2w"][l], p["ln2b"][l], bias_column=self.fc_bias_in_product)
            # MLP block
            kmm.matmul_forward(b["fch_gelu"], b["ln2"], p["fcw"][l], p["fcb"][l], pre_gelu=b["fch"],
                               gelu_epilogue=self.gelu_fusion >= 1, use_cublaslt=lt)
            # the residual add across the block boundary, fused with the next layernorm (or in the product)
            if l + 1 < L:
                nb = self._layer_buffers(l + 1)
                ln_out = (nb["ln1"], nb["ln1_mean"], nb["ln1_rstd"])
                ln_w, ln_b = p["ln1w"][l + 1], p["ln1b"][l + 1]
            else:
                ln_out, ln_w, ln_b = (a["lnf"], a["lnf_mean"], a["lnf_rstd"]), p["lnfw"], p["lnfb"]
            if self.residual_in_product:
                kmm.matmul_forward(b["residual3"], b["fch_gelu"], p["fcprojw"][l], p["fcprojb"][l], use_cublaslt=lt,
                                   residual=b["residual2"])
                kln.layernorm_forward(*ln_out, b["residual3"], ln_w, ln_b)
            else:
                kmm.matmul_forward(proj, b["fch_gelu"], p["fcprojw"][l], p["fcprojb"][l], use_cublaslt=lt)
                kln.fused_residual_forward(b["residual3"], *ln_out, b["residual2"], proj, ln_w, ln_b)
        if self.classifier_chunks > 1:
            if targets is not None:
                if dloss is not None:  # a training forward adds dwte's share to the buffer
                    self._norm_fresh = False
                    self._update_grads = self.grads_memory
                self._chunked_classifier(self._device_ids(targets, self.targets), dloss)
                self._have_dlogits = dloss is not None
                self._have_losses = True
            return
        logits = self.logits_view()
        kmm.matmul_forward(logits, a["lnf"], p["wte"], use_cublaslt=lt)
        if targets is not None:
            tgt = self._device_ids(targets, self.targets)
            fused_classifier(logits, a["losses"], 0.0 if dloss is None else dloss, tgt, cfg.vocab_size,
                             write_dlogits=dloss is not None)
            self._have_dlogits = dloss is not None
            self._have_losses = True

    def _dlnf(self) -> torch.Tensor:
        # the first B*T*C of scratch_bt4c: free from the end of one backward's layers to the start of the
        # next backward's lnf layernorm (the forward writes no scratch_bt4c)
        B, T, C = self.B, self.T, self.config.channels
        return self.acts["scratch_bt4c"].view(-1)[:B * T * C].view(B, T, C)

    def _chunked_classifier(self, tgt: torch.Tensor, dloss: float | None):
        """The classifier chunk by chunk of rows, in a fixed order (see the module docstring). Views only:
        nothing is allocated (CUDA graphs)."""
        lt = self.use_cublaslt
        cfg, p, g, a = self.config, self.params, self.grads, self.acts
        Vp, C = cfg.padded_vocab_size, cfg.channels
        lnf, losses, tgt = a["lnf"].view(-1, C), a["losses"].view(-1), tgt.view(-1)
        dlnf = self._dlnf().view(-1, C) if dloss is not None else None
        for r0, r1 in self._chunk_bounds:
            logits = self._output((r1 - r0) * Vp).view(r1 - r0, Vp)
            kmm.matmul_forward(logits, lnf[r0:r1], p["wte"], use_cublaslt=lt)
            fused_classifier(logits, losses[r0:r1], 0.0 if dloss is None else dloss, tgt[r0:r1], cfg.vocab_size,
                             write_dlogits=dloss is not None)
            if dloss is not None:
                # the lm_head backward of these rows while their logit gradient is here: dlnf rows
                # overwritten, dwte accumulated chunk after chunk (one more rounding a chunk in bf16)
                kmm.matmul_backward(dlnf[r0:r1], g["wte"], None, logits, lnf[r0:r1], p["wte"], use_cublaslt=lt)

    def loss(self) -> float:
        """Mean loss of the last forward with targets (one host sync)."""
        self._check_losses()
        return float(self.acts["losses"].double().mean())

    def position_losses(self) -> torch.Tensor:
        """(B, T) fp32 per-position losses of the last forward with targets, on the CPU (HellaSwag)."""
        self._check_losses()
        return self.acts["losses"].to("cpu", torch.float32, copy=True)  # a copy (the CPU's .cpu() is a view)

    def _check_losses(self):
        if not self._have_losses:
            raise LlmpyError("no forward with targets has run yet: no loss to read")

    def seed_state(self) -> list[int]:
        """The stochastic-rounding seeds (one per rounding call site), for a checkpoint."""
        return [int(x) for x in self._seeds.tolist()]

    def load_seed_state(self, seeds: list[int]):
        """Restore seed_state()'s values, so a resumed run rounds exactly as the uninterrupted one."""
        if len(seeds) != self._seeds.numel():
            raise LlmpyError(f"checkpoint has {len(seeds)} rounding seeds, the model {self._seeds.numel()}")
        self._seeds.copy_(torch.tensor(seeds, dtype=self._seeds.dtype))

    def validate(self, inputs, targets) -> float:
        """Mean loss over a (B, T) batch, no gradient (the fused classifier's validation variant)."""
        if targets is None:  # a forward without targets writes no losses: loss() would read an earlier batch's
            raise LlmpyError("validate: targets is None; it needs the (B, T) targets of the inputs")
        self.forward(inputs, targets)
        return self.loss()

    def logits_last(self, tokens) -> torch.Tensor:
        """Logits after the last token of each row, cropped to the real vocabulary: (b, V) fp32 on the CPU.

        tokens: a list of ids, a 1-D tensor, or (b, t) with b <= B; the context is cropped to the last T
        tokens. The rows go into a (B, T) batch padded with token 0 (causal attention: the padding after
        a row's last token does not change that token's logits), as llm.c samples."""
        lt = self.use_cublaslt
        ids = host_ids(tokens, "logits_last: tokens")
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not 1 <= ids.shape[0] <= self.B or ids.shape[1] == 0:
            raise LlmpyError(f"logits_last: tokens of shape {list(ids.shape)}; want (b, t), 1 <= b <= {self.B}, t >= 1")
        self._check_ids(ids, "logits_last: tokens")  # before any narrowing (2**32 + 5 in int32 is 5)
        x = torch.as_tensor(ids.astype(np.int64))[:, -self.T:]
        t = x.shape[1]
        batch = torch.zeros(self.B, self.T, dtype=torch.int32)
        batch[:x.shape[0], :t] = x
        self.forward(batch)
        if self.classifier_chunks == 1:
            # a copy: the next forward rewrites the buffer (.float().cpu() of fp32 on the CPU is a view)
            return self.logits_view()[:x.shape[0], t - 1, :self.config.vocab_size].to("cpu", torch.float32, copy=True)
        # chunked: only the b rows asked for, at most one chunk of them at a time (not inside a graph:
        # the gathered rows are a small fresh tensor)
        Vp = self.config.padded_vocab_size
        rows = self.acts["lnf"][:x.shape[0], t - 1].contiguous()
        step = self._chunk_bounds[0][1] - self._chunk_bounds[0][0]  # the smallest chunk's row count
        out = []
        for r0 in range(0, rows.shape[0], step):
            piece = rows[r0:r0 + step]
            logits = self._output(piece.shape[0] * Vp).view(piece.shape[0], Vp)
            kmm.matmul_forward(logits, piece, self.params["wte"], use_cublaslt=lt)
            # a copy: the next piece reuses the buffer (.float().cpu() of fp32 on the CPU is a view)
            out.append(logits[:, :self.config.vocab_size].to("cpu", torch.float32, copy=True))
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------------
    # backward

    def zero_grad(self):
        """Zero the parameter gradients (before micro-step 0: the backward accumulates)."""
        self.grads_memory.zero_()
        self._update_grads = self.grads_memory
        self._norm_fresh = False

    def _seed(self, slot: int) -> torch.Tensor:
        return self._seeds[slot:slot + 1]

    def _layer_seed(self, l: int, k: int) -> torch.Tensor:
        return self._seed(3 + 6 * l + k)

    def _advance_seeds(self):
        # a fresh stochastic-rounding stream every micro-step, on the device (a replayed graph advances it)
        self._seeds.mul_(_LCG_A).add_(_LCG_C).remainder_(_LCG_M)

    def _seeds_after(self, k: int):
        """_seeds = the step's base seeds advanced k times (one LCG jump: x -> A_k x + C_k mod M): global
        micro-step j of a step rounds with k = j + 1 on whichever rank runs it."""
        a, c = 1, 0
        for _ in range(k):
            a, c = a * _LCG_A % _LCG_M, (c * _LCG_A + _LCG_C) % _LCG_M
        self._seeds.copy_(self._seeds_base).mul_(a).add_(c).remainder_(_LCG_M)

    def backward(self, advance_seeds: bool = True, on_layer_done=None):
        """llm.c's gpt2_backward: from the logit gradient the last forward(..., dloss) left in place (with
        classifier chunks: from the dlnf it left), every parameter gradient ACCUMULATED into the gradient
        buffer (zero_grad() before micro-step 0). advance_seeds=False: the caller set the rounding seeds
        (train_step does, by global micro-step). on_layer_done(l), if given, is called (host side, in
        launch order) once layer l's gradients are all launched, and with l = -1 after the encoder's:
        the data-parallel reduction starts on the finished layers while the rest of the backward runs."""
        lt = self.use_cublaslt
        if not self._have_dlogits:
            raise LlmpyError("backward() needs a forward(inputs, targets, dloss=...) just before it")
        self._have_dlogits = False
        self._norm_fresh = False
        self._update_grads = self.grads_memory  # the gradient is the buffer again, not a past train_step's sum
        cfg, p, g, a = self.config, self.params, self.grads, self.acts
        B, T, C, NH, L = self.B, self.T, cfg.channels, cfg.num_heads, cfg.num_layers
        gf = self.gelu_fusion
        if advance_seeds:
            self._advance_seeds()
        bias_scratch = a["bias_scratch"]
        # the QKV bias gradient's query part summed by the attention backward (Triton's) as it writes dq, where
        # the plan made room for it (kernels.matmul.QKV_QUERY_SUMS_FROM_ATTENTION)
        q_sums = a.get("q_bias_sums") if kmm.QKV_BIAS_FROM_IDENTITIES else None
        plain_shape, proj_shape = ln_scratch_shapes(B * T, C)
        ln_scratch = a["ln_scratch"][:math.prod(plain_shape)].view(plain_shape)
        ln_scratch3 = a["ln_scratch"][:math.prod(proj_shape)].view(proj_shape)  # with the projection's slot
        fuse = self.proj_bias_in_layernorm
        dresidual = a["dresidual"]
        # the chain of input gradients on the main lane; weight and bias gradients on the side lane, each
        # call declaring what it reads and writes (llmpy.streams orders the lanes by it)
        lanes = self._lanes
        main, side = functools.partial(lanes.run, "main"), functools.partial(lanes.run, "side")

        def ln_backward(dout, inp, w, dw, db, mean, rstd, ln_seed, proj_layer, proj_name, proj_slot, proj_sum=None):
            """layernorm_backward into dresidual; with fuse, also the bias gradient of proj_name in layer
            proj_layer (None: no projection before this LayerNorm), rounded with that bias's own seed slot,
            and its fp32 increment into proj_sum when given."""
            reads, writes = [dout, inp, w, mean, rstd, ln_seed], [dresidual, dw, db, a["ln_scratch"]]
            if fuse and proj_layer is not None:
                proj_seed = self._layer_seed(proj_layer, proj_slot)
                main(lambda: kln.layernorm_backward(dresidual, dw, db, ln_scratch3, dout, inp, w, mean, rstd,
                                                    seed=ln_seed, dproj_bias=g[proj_name][proj_layer],
                                                    proj_seed=proj_seed, dproj_sum=proj_sum),
                     reads + [proj_seed], writes + [g[proj_name][proj_layer], proj_sum], "layernorm_backward")
            else:
                main(lambda: kln.layernorm_backward(dresidual, dw, db, ln_scratch, dout, inp, w, mean, rstd,
                                                    seed=ln_seed),
                     reads, writes, "layernorm_backward")

        def linear_backward(dinp, dweight, dbias, dout, inp, weight, slot_seed, pre_gelu=None, dgelu_epilogue=False,
                            inp_wide=None):
            """matmul_backward as two calls: dinp on the main lane, dweight (and dbias) on the side lane;
            given inp_wide (inp with its bias column), dbias from the weight-gradient product."""
            if dinp is not None:
                main(lambda: kmm.matmul_backward(dinp, None, None, dout, inp, weight, pre_gelu=pre_gelu,
                                                 dgelu_epilogue=dgelu_epilogue, use_cublaslt=lt),
                     [dout, weight, pre_gelu], [dinp], "matmul_backward dinp")
            if inp_wide is not None:
                wide = a["fc_grad_wide"]
                side(lambda: kmm.weight_grad_bias_column(dweight, dbias, dout, inp_wide, wide, seed=slot_seed,
                                                             use_cublaslt=lt),
                     [dout, inp_wide, slot_seed], [dweight, dbias, wide], "weight_grad_bias_column")
                return
            side(lambda: kmm.matmul_backward(None, dweight, dbias, dout, inp, weight, scratch=bias_scratch,
                                             seed=slot_seed, use_cublaslt=lt),
                 [dout, inp, slot_seed], [dweight, dbias, bias_scratch if dbias is not None else None],
                 "matmul_backward dweight")

        def layer_done(l):
            if on_layer_done is not None:
                # the data-parallel reduction reads this layer's gradients, some of them the side lane's
                lanes.wait_side()
                main(lambda: on_layer_done(l), [], [], "on_layer_done")

        lanes.begin()
        dl_btc = a["scratch_btc"]      # the forward's projection scratch is free now
        dl_bt4c = a["scratch_bt4c"]
        bt4c_flat = dl_bt4c.view(-1)
        main(dresidual.zero_, [], [dresidual], "zero dresidual")

        # classifier matmul: dlnf = dlogits @ wte, dwte += dlogits^T @ lnf (chunked: the forward did it)
        dlnf = self._dlnf()
        if self.classifier_chunks == 1:
            linear_backward(dlnf, g["wte"], None, self.logits_view(), a["lnf"], p["wte"], None)
        ln_backward(dlnf, a["residual3"][L - 1], p["lnfw"], g["lnfw"], g["lnfb"], a["lnf_mean"], a["lnf_rstd"],
                    self._seed(1), L - 1, "fcprojb", 5)
        dqkv = bt4c_flat[:B * T * 3 * C].view(B, T, 3 * C)
        proj_sum = a["proj_bias_sum"] if fuse else None

        for l in reversed(range(L)):
            b = self._layer_buffers(l)
            seed = lambda k: self._layer_seed(l, k)  # noqa: E731
            if self.recompute >= 1:
                main(lambda: gelu_forward(b["fch_gelu"], b["fch"]), [b["fch"]], [b["fch_gelu"]], "gelu_forward")
            # fcproj, then the GELU: dl_bt4c becomes the gradient of fch (fcproj's bias gradient: here, or
            # already summed by the LayerNorm backward that wrote dresidual)
            fcproj_dbias = None if fuse else g["fcprojb"][l]
            if gf == 2:
                # llm.c's DGELU epilogue (cuBLASLt's or our Triton GEMM's); fc's bias gradient in its own
                # reduction below, or from the weight-gradient product (fc_bias_in_product)
                linear_backward(dl_bt4c, g["fcprojw"][l], fcproj_dbias, dresidual, b["fch_gelu"], p["fcprojw"][l],
                                seed(5), pre_gelu=b["fch"], dgelu_epilogue=True)
                fc_dbias = g["fcb"][l]
            else:
                # dgelu fused with fc's bias gradient: one pass over the (B, T, 4C) gradient
                linear_backward(dl_bt4c, g["fcprojw"][l], fcproj_dbias, dresidual, b["fch_gelu"], p["fcprojw"][l],
                                seed(5))
                main(lambda: kmm.bias_gelu_backward(g["fcb"][l], bias_scratch, dl_bt4c, b["fch"], seed=seed(4)),
                     [b["fch"], seed(4)], [dl_bt4c, g["fcb"][l], bias_scratch], "bias_gelu_backward")
                fc_dbias = None
            if self.recompute >= 2:
                main(lambda: kln.layernorm_forward(b["ln2"], b["ln2_mean"], b["ln2_rstd"], b["residual2"],
                                                   p["ln2w"][l], p["ln2b"][l], bias_column=self.fc_bias_in_product),
                     [b["residual2"], p["ln2w"][l], p["ln2b"][l]], [b["ln2"], b["ln2_mean"], b["ln2_rstd"]],
                     "layernorm_forward")
            linear_backward(dl_btc, g["fcw"][l], fc_dbias, dl_bt4c, b["ln2"], p["fcw"][l], seed(4),
                            inp_wide=b["ln2_wide"] if self.fc_bias_in_product else None)
            # ln2: dresidual becomes the gradient of residual2 (the MLP branch added to the skip path)
            ln_backward(dl_btc, b["residual2"], p["ln2w"][l], g["ln2w"][l], g["ln2b"][l], b["ln2_mean"], b["ln2_rstd"],
                        seed(1), l, "attprojb", 3, proj_sum)
            linear_backward(dl_btc, g["attprojw"][l], None if fuse else g["attprojb"][l], dresidual, b["atty"],
                            p["attprojw"][l], seed(3))
            if self.attention == "classic":
                # dead by now: fch (4C >= 3C) holds dq, dk, dv head-major; atty holds dout head-major;
                # the logits buffer (spent) holds datt when it is large enough
                hs = C // NH
                dqkvr = b["fch"].view(-1)[:3 * B * T * C].view(3, B, NH, T, hs)
                datt = a["datt"] if "datt" in a else self._output(B * NH * T * T).view(B, NH, T, T)
                main(lambda: kattn.attention_backward_any("classic", dqkv, dl_btc, None, None, NH, qkvr=b["qkvr"],
                                                          att=b["att"], dqkvr=dqkvr, datt=datt, scratch=b["atty"]),
                     [dl_btc, b["qkvr"], b["att"]], [dqkv, dqkvr, datt, b["atty"]], "attention_backward")
            else:
                delta, workspace = a.get("delta"), a.get("cudnn_workspace")
                main(lambda: kattn.attention_backward_any(self.attention, dqkv, dl_btc, b["qkv"], b["atty"], NH,
                                                          lse=b["lse"], delta=delta, workspace=workspace,
                                                          q_sums=q_sums),
                     [dl_btc, b["qkv"], b["atty"], b["lse"]], [dqkv, delta, workspace, q_sums], "attention_backward")
            if self.recompute >= 2:
                main(lambda: kln.layernorm_forward(b["ln1"], b["ln1_mean"], b["ln1_rstd"], b["residual"],
                                                   p["ln1w"][l], p["ln1b"][l]),
                     [b["residual"], p["ln1w"][l], p["ln1b"][l]], [b["ln1"], b["ln1_mean"], b["ln1_rstd"]],
                     "layernorm_forward")
            linear_backward(dl_btc, g["qkvw"][l], None, dqkv, b["ln1"], p["qkvw"][l], seed(2))
            # the QKV bias gradient: the query part summed over dq, the key part exactly zero and the value
            # part through attproj's weight from its bias gradient (fused: no pass over dk and dv); see
            # kernels.matmul.qkv_bias_backward
            side(lambda: kmm.qkv_bias_backward(g["qkvb"][l], dqkv, bias_scratch, seed(2), proj_sum,
                                               p["attprojw"][l] if fuse else None, q_sums=q_sums),
                 [dqkv, seed(2), proj_sum, p["attprojw"][l], q_sums], [g["qkvb"][l], bias_scratch], "qkv bias")
            # ln1: dresidual becomes the gradient of this layer's input residual
            ln_backward(dl_btc, b["residual"], p["ln1w"][l], g["ln1w"][l], g["ln1b"][l], b["ln1_mean"], b["ln1_rstd"],
                        seed(0), l - 1 if l > 0 else None, "fcprojb", 5)
            layer_done(l)
        main(lambda: kenc.encoder_backward(g["wte"], g["wpe"], dresidual, self._cur_inputs, self._seed(0),
                                           scratch=self._enc_scratch),
             [dresidual, self._cur_inputs, self._seed(0)],
             [g["wte"], g["wpe"], *(t for t in vars(self._enc_scratch).values() if isinstance(t, torch.Tensor))],
             "encoder_backward")
        layer_done(-1)
        lanes.end()

    # ------------------------------------------------------------------------------------------------
    # update

    def _compute_norm(self, grads: torch.Tensor | None = None, shard: bool = False):
        """The squared global norm of grads (default: the current gradient, _update_grads) into _norm_sq.
        shard (ZeRO-1, grads = this rank's reduced shard): the shard's chunk partials, gathered from every
        rank in chunk order, then summed - the bits one GPU gets over the whole buffer. Every rank must take the
        same branch (the gather is a collective), so it is not told by the shard's size: a model of one norm chunk
        has one rank's shard the whole buffer and the others' empty."""
        grads = self._update_grads if grads is None else grads
        partials = self.acts["norm_partials"]
        count = knorm.num_norm_partials(self.config.num_parameters)
        if not shard:
            knorm.global_norm_squared(self._norm_sq, grads, partials)
        else:
            c0 = self._lo // knorm.NORM_CHUNK
            mine = knorm.num_norm_partials(grads.numel())
            knorm.norm_partials(partials[c0:c0 + mine], grads)
            self.dp.all_gather_uneven(partials[:count], partials[c0:c0 + mine].clone(),
                                      shard_bounds(count, self.world_size, 1))
            knorm.norm_aggregate(self._norm_sq, partials, count)
        self._norm_fresh = True

    def _clip(self, grad_clip: float):
        knorm.clip_scale(self._hyper[kadamw.GRAD_SCALE:kadamw.GRAD_SCALE + 1], self._norm_sq, grad_clip)

    @staticmethod
    def _checked_numbers(who: str, lr, step, hp, grad_clip) -> tuple:
        """(lr, step, hp, grad_clip), checked before any work: a refused call must leave the gradients and the
        rounding seeds as they were (lr=None was refused only by _set_hyper, after the forward and backward)."""
        lr, step, *hp = checked_adamw_args(f"GPT2Model.{who}", lr, step, *hp)
        grad_clip = checked_number(grad_clip, f"GPT2Model.{who}", "grad_clip",
                                   "a finite number >= 0 (0 turns clipping off)", lambda x: x >= 0)
        return lr, step, tuple(hp), grad_clip

    def _set_hyper(self, lr, step, beta1, beta2, eps, weight_decay):
        # the numbers: checked by update() and train_step() before any work
        if self._hyper_host is None:
            kadamw.set_hyper(self._hyper, lr, step, beta1, beta2, eps, weight_decay)
            return
        self._hyper_copied.synchronize()  # returns at once unless update() calls come faster than the GPU
        kadamw.set_hyper(self._hyper, lr, step, beta1, beta2, eps, weight_decay, host=self._hyper_host)
        self._hyper_copied.record()

    def _adamw(self):
        """AdamW from _update_grads: over the whole buffer, or (ZeRO-1) over this rank's shard - decay
        ranges and rounding streams by global index, so the shard's elements change exactly as in the
        unsharded update - followed by the all-gather of every rank's updated parameters."""
        if self.zero_stage != 1:
            kadamw.adamw_update(self.params_memory, self._update_grads, self.m_memory, self.v_memory, self._hyper,
                                self._seed(2), self._decay, master=self.master_memory,
                                stochastic=self.stochastic_rounding)
            return
        lo, hi = self._lo, self._hi
        kadamw.adamw_update(self.params_memory[lo:hi], self._update_grads, self.m_memory, self.v_memory,
                            self._hyper, self._seed(2), self._decay, master=self.master_memory, offset=lo,
                            stochastic=self.stochastic_rounding)
        self.dp.all_gather_uneven(self.params_memory, self.params_memory[lo:hi], self._shards)

    def grad_norm(self) -> float:
        """Global L2 norm of the current gradient - the buffer after backward(), right after train_step that step's
        (its micro-steps' sum), as gradients_fp32() - computed on the device if not yet; one host sync."""
        self._check_kernels_run("grad_norm")
        if not self._norm_fresh:
            self._compute_norm()
        return math.sqrt(float(self._norm_sq))

    def update(self, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
               weight_decay: float = 0.0, grad_clip: float = 1.0):
        """llm.c's gpt2_update: the global norm (device), the clip scale (device: max_norm / norm when the norm
        is above grad_clip > 0, else 1), AdamW over the flat buffer, weight decay on the 2-D tensors only,
        master weights and stochastic rounding. step counts from 1. No host sync. Its gradient is grad_norm()'s:
        right after a train_step of several micro-steps, their sum, not the last one's left in the buffer.

        To skip an update on an outlier (-sl/-sg): read loss() and grad_norm(), decide, and call update()
        or not. train_step(..., skip=fn) does that inside the graphed step."""
        if self.world_size > 1:
            raise LlmpyError("update(): with several ranks the gradients must be reduced first; use train_step")
        lr, step, hp, grad_clip = self._checked_numbers("update", lr, step, (beta1, beta2, eps, weight_decay),
                                                        grad_clip)
        self._check_kernels_run("update")
        if not self._norm_fresh:
            self._compute_norm()
        self._clip(grad_clip)
        self._set_hyper(lr, step, *hp)
        self._adamw()

    # ------------------------------------------------------------------------------------------------
    # the whole step

    def _stage(self, batches):
        """Copy the micro-batches into static device buffers (accum, B, T): inputs and targets in one H2D copy.

        The checks and the copy into the pinned buffer are numpy's, on this thread: torch's CPU ops would
        wake its intra-op thread pool, and on the H200 machine that cost 13-35 ms in one step of six
        (bench/RESULTS.md, run O) while the device sat idle between two steps."""
        accum = len(batches)
        if accum not in self._staging:
            # inputs and targets side by side, on the host and on the device: one copy a step
            dev = torch.zeros(2, accum, self.B, self.T, dtype=torch.int32, device=self.device)
            pin = self.device.type == "cuda"
            host = torch.zeros(2, accum, self.B, self.T, dtype=torch.int32, pin_memory=pin)
            self._staging[accum] = (dev[0], dev[1], host, dev)
        dev_in, dev_tg, host, dev = self._staging[accum]
        host_np = host.numpy()
        for k, (x, y) in enumerate(batches):
            x, y = host_ids(x, "inputs"), host_ids(y, "targets")
            if x.shape != (self.B, self.T) or y.shape != (self.B, self.T):
                raise LlmpyError(f"micro-batch {k}: inputs {list(x.shape)}, targets {list(y.shape)}; the model was "
                                 f"built for B={self.B}, T={self.T}")
            self._check_ids(x, f"micro-batch {k}: inputs")
            self._check_ids(y, f"micro-batch {k}: targets")
            host_np[0, k] = x
            host_np[1, k] = y
        # the host buffer is reused next step; the step ends with a sync (loss, norm), so no copy is in flight
        dev.copy_(host, non_blocking=True)
        return dev_in, dev_tg

    # layers a reduction bucket holds: about this many bytes of gradients (one per layer at GPT-2 124M)
    BUCKET_BYTES = 16 << 20

    def _bucket_plan(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """[(layer, ranges)]: after the backward of `layer` (-1: after the encoder's) the flat-buffer
        ranges [a, b) are final. A bucket is a few consecutive layers: one range per per-layer tensor
        (llm.c's layout keeps a tensor's layers together, not a layer's tensors); the last bucket holds
        wte, wpe and lnf. The ranges of all buckets cover the buffer once."""
        cfg, g = self.config, self.grads
        L = cfg.num_layers
        base = self.grads_memory.storage_offset()
        spans = {name: (t.storage_offset() - base, t.numel()) for name, t in g.items()}
        per_layer = [name for name, t in g.items() if t.dim() >= 2 and t.shape[0] == L and name not in ("wte", "wpe")]
        layer_bytes = sum(spans[n][1] for n in per_layer) // L * self.grads_memory.element_size()
        group = max(1, -(-self.BUCKET_BYTES // max(1, layer_bytes)))
        plan = []
        for top in range(L - 1, -1, -group):
            lo = max(0, top - group + 1)
            ranges = []
            for n in per_layer:
                off, numel = spans[n]
                per = numel // L
                ranges.append((off + lo * per, off + (top + 1) * per))
            plan.append((lo, ranges))
        rest = sorted(spans[n] for n in g if n not in per_layer)
        merged: list[list[int]] = []
        for off, numel in rest:  # wte + wpe and lnfw + lnfb sit side by side
            if merged and merged[-1][1] == off:
                merged[-1][1] = off + numel
            else:
                merged.append([off, off + numel])
        plan.append((-1, [tuple(r) for r in merged]))
        assert sum(b - a for _, rs in plan for a, b in rs) == cfg.num_parameters
        return plan

    def _send_bucket(self, layer: int, accum: int):
        """on_layer_done of the last micro-step: start the all-to-all of every bucket that `layer`
        finishes (with accumulation, after adding this micro-step's share of those ranges)."""
        N, lo, hi = self.world_size, self._lo, self._hi
        local = self._acc32 if accum > 1 else self.grads_memory
        recv_all = self._reduce_bufs[local.dtype]
        for trigger, ranges in self._buckets:
            if trigger != layer:
                continue
            for a, b in ranges:
                if accum > 1:
                    self._acc32[a:b].add_(self.grads_memory[a:b])
                x, y = max(a, lo), min(b, hi)
                mine = max(0, y - x)
                # this range's receive slot: N pieces of my part, after the slots of the ranges before it
                start = N * self._recv_used
                self._recv_used += mine
                recv = recv_all[start:start + N * mine]
                splits = [max(0, min(b, h) - max(a, l)) for l, h in self._shards]
                work = self.dp.all_to_all(recv, local[a:b], [mine] * N, splits, async_op=True)
                self._pending.append((work, x, mine, recv))

    def _prepare(self, accum: int):
        """Buffers a step with `accum` micro-steps needs, allocated before any graph capture: the fp32
        accumulator (accum > 1), the per-micro-step loss sums, the reduction's receive buffers (N > 1)."""
        if accum not in self._micro_losses:
            self._micro_losses[accum] = torch.zeros(accum, dtype=torch.float32, device=self.device)
        if accum > 1 and self._acc32 is None:
            self._acc32 = torch.zeros(self.config.num_parameters, dtype=torch.float32, device=self.device)
        if self.world_size > 1:
            if not self._buckets:
                self._buckets = self._bucket_plan()
            send_dtype = torch.float32 if accum > 1 else self.dtype
            mine = self._hi - self._lo
            if send_dtype not in self._reduce_bufs:
                self._reduce_bufs[send_dtype] = torch.empty(self.world_size * mine, dtype=send_dtype,
                                                            device=self.device)
            if "reduced" not in self._reduce_bufs:
                self._reduce_bufs["reduced"] = torch.empty(mine, dtype=torch.float32, device=self.device)
                if self.zero_stage == 0:
                    self._reduce_bufs["whole"] = torch.empty(self.config.num_parameters, dtype=torch.float32,
                                                             device=self.device)

    def _local_fwdbwd(self, dev_in, dev_tg, accum: int):
        """This rank's micro-steps: forward, backward, each micro-step's loss sum (device only).

        One micro-step: its gradient lands in the (zeroed) gradient buffer. Several: each one's gradient
        is added to an fp32 accumulator in micro-step order - the additions the cross-rank reduction
        makes in rank order, so that one GPU with N*A micro-steps and N GPUs with A give the same bits
        (A = 1). Rank r's micro-step m is the step's global micro-step j = m*N + r (the DataLoader's
        order): it rounds stochastically with the seeds advanced j + 1 times from the step's base."""
        N, r = self.world_size, self.rank
        self._seeds_base.copy_(self._seeds)
        losses = self._micro_losses[accum]
        dloss = 1.0 / (self.B * self.T * accum * N)
        for k in range(accum):
            self.zero_grad()
            self._seeds_after(k * N + r + 1)
            self.forward(dev_in[k], dev_tg[k], dloss=dloss)
            losses[k:k + 1].copy_(self.acts["losses"].sum().view(1))
            overlap = self.overlap_reduction and k == accum - 1
            if overlap:
                self._recv_used = 0
            hook = (lambda l: self._send_bucket(l, accum)) if overlap else None
            self.backward(advance_seeds=False, on_layer_done=hook)
            if accum > 1 and not overlap:  # (overlapping, _send_bucket adds the last micro-step's share)
                if k == 0:
                    self._acc32.copy_(self.grads_memory)
                else:
                    self._acc32.add_(self.grads_memory)
        self._seeds_after(accum * N)  # every global micro-step of the step drew from the stream

    def _reduce_norm_clip(self, accum: int, grad_clip: float):
        """The step's gradient (reduced over ranks in rank order), its global norm and the clip scale.
        Sets _update_grads: the gradient buffer, the fp32 accumulator, the whole reduced fp32 gradient
        (-z 0) or this rank's reduced shard (-z 1)."""
        local = self._acc32 if accum > 1 else self.grads_memory
        if self.world_size == 1:
            self._update_grads = local
        else:
            N, lo = self.world_size, self._lo
            reduced = self._reduce_bufs["reduced"]
            if not self._pending:  # all at once: rank r's piece of my shard is recv[r]
                mine, recv = self._hi - lo, self._reduce_bufs[local.dtype]
                self._pending = [(self.dp.all_to_all(recv, local, [mine] * N, [h - l for l, h in self._shards],
                                                     async_op=True), lo, mine, recv)]
            for work, x, mine, recv in self._pending:  # each element added in rank order, as one GPU adds
                work.wait()
                part = reduced[x - lo:x - lo + mine]
                part.copy_(recv[:mine])
                for k in range(1, N):
                    part.add_(recv[k * mine:(k + 1) * mine])
            self._pending = []
            if self.zero_stage == 0:
                self._update_grads = self.dp.all_gather_uneven(self._reduce_bufs["whole"], reduced, self._shards)
            else:
                self._update_grads = reduced
        self._compute_norm(self._update_grads, shard=self.zero_stage == 1)
        self._clip(grad_clip)

    def _read(self, accum: int) -> tuple[float, float]:
        """(mean loss, norm) of the step: the micro-steps' loss sums added in global micro-step order
        (m-major over ranks) in fp32, as one GPU adds its own, then one division (host, one sync)."""
        sums = self._micro_losses[accum]
        if self.world_size > 1:
            sums = self.dp.all_gather_scalars(sums).t()  # (accum, N): global micro-step j = m*N + r
        values = self._fetch(sums.reshape(-1), self._norm_sq)
        total = np.float32(0.0)
        for x in values[:-1]:
            total = np.float32(total + x)
        loss = float(total) / (self.B * self.T * accum * self.world_size)
        return loss, math.sqrt(float(values[-1]))

    def _fetch(self, *tensors) -> np.ndarray:
        """1-D fp32 device tensors, concatenated, on the host: on CUDA one wait for the stream, after their
        copies into a pinned buffer (not a blocking copy and a wake-up each)."""
        n = sum(t.numel() for t in tensors)
        if self.device.type != "cuda":
            return np.concatenate([t.detach().numpy() for t in tensors])
        if self._readout is None or self._readout.numel() < n:
            self._readout = torch.empty(n, dtype=torch.float32, pin_memory=True)
        offset = 0
        for t in tensors:
            self._readout[offset:offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        torch.cuda.current_stream(self.device).synchronize()
        return self._readout[:n].numpy().copy()

    def _eager_step(self, dev_in, dev_tg, accum, lr, step, hp, grad_clip, skip):
        self._local_fwdbwd(dev_in, dev_tg, accum)
        return self._finish_eagerly(accum, lr, step, hp, grad_clip, skip)

    def _finish_eagerly(self, accum, lr, step, hp, grad_clip, skip):
        """After the micro-steps: reduction, norm, clip, the skip decision and AdamW, launched one by one."""
        self._reduce_norm_clip(accum, grad_clip)
        loss, norm = self._read(accum)
        self.last_step_skipped = bool(skip(loss, norm)) if skip is not None else False
        if not self.last_step_skipped:
            self._set_hyper(lr, step, *hp)
            self._adamw()
        return loss, norm

    def release_graphs(self):
        """Free the captured step graphs (the next step captures again); with several ranks they hold
        the NCCL communicator, so distributed.shutdown calls this first."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
        for graphs in self._graphs.values():
            for graph in graphs:
                if graph is not None:
                    graph.reset()
        self._graphs.clear()
        self._graph_grads.clear()

    def train_step(self, batches, lr: float, step: int, weight_decay: float = 0.0, grad_clip: float = 1.0, *,
                   beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, skip=None) -> tuple[float, float]:
        """One optimizer step over the micro-batches `batches` [(inputs, targets), ...] (CPU (B, T) int
        tensors; gradient accumulation = len(batches)). Returns (mean loss, gradient norm before clipping).

        skip: None, or a function (loss, norm) -> bool called before the update; True skips it (the
        trainer's outlier detection, -sl/-sg), recorded in last_step_skipped. Without skip the whole step
        is one CUDA graph; with it, two (forward/backward/norm, then AdamW) with the decision between.
        """
        # before a generator of batches is drawn from
        lr, step, hp, grad_clip = self._checked_numbers("train_step", lr, step, (beta1, beta2, eps, weight_decay),
                                                        grad_clip)
        if not isinstance(batches, (list, tuple)):
            batches = list(batches)  # a generator of pairs, say (iterated once: the checks below, then _stage)
        if not batches:
            raise LlmpyError("train_step needs at least one micro-batch")
        self._check_kernels_run("train_step")
        pairs = []
        for k, b in enumerate(batches):
            try:  # a tuple, a list, or one stacked (2, B, T) tensor or array
                x, y = b
                if getattr(x, "ndim", 2) < 2:  # b was one (2, T) batch's rows, not a pair
                    raise ValueError
            except (TypeError, ValueError):
                size = (f" of shape {list(b.shape)}" if hasattr(b, "shape") else
                        f" of {len(b)}" if hasattr(b, "__len__") else "")
                raise LlmpyError(f"train_step: micro-batch {k} is a {type(b).__name__}{size}, not an (inputs, "
                                 "targets) pair (batches: a list of pairs)") from None
            pairs.append((x, y))
        batches = pairs
        accum = len(batches)
        self._prepare(accum)
        if not self.cuda_graph:
            dev_in, dev_tg = self._stage(batches)
            return self._eager_step(dev_in, dev_tg, accum, lr, step, hp, grad_clip, skip)

        # the whole step in a graph (or two, around the skip decision); with several ranks NCCL's
        # collectives are captured too - the all-to-alls launched by the backward's layer hooks, the
        # gathers of -z 0/-z 1 - so the overlapped reduction costs no launch gaps
        key = (accum, float(grad_clip), skip is not None)
        if key not in self._graphs:
            if key not in self._warmed:
                # warm-up: a real step, eager, on a side stream (as torch.cuda.graphs asks): compiles every
                # Triton kernel, lets cuBLAS/cuDNN set up their workspaces and the fused ops their state,
                # creates the NCCL communicator and the gather buffers
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    dev_in, dev_tg = self._stage(batches)
                    result = self._eager_step(dev_in, dev_tg, accum, lr, step, hp, grad_clip, skip)
                torch.cuda.current_stream(self.device).wait_stream(side)
                self._warmed.add(key)
                return result
            # the batches checked (and staged) before the capture: one refused after it had left the host flags
            # (the norm fresh, no logit gradient) as if the step had run
            dev_in, dev_tg = self._stage(batches)
            # several ranks: no eager collective may still be in flight when the capture starts, and the
            # capture checks only this thread (the process group's watchdog thread polls its own events)
            mode = "global"
            if self.world_size > 1:
                torch.cuda.synchronize(self.device)
                mode = "thread_local"
            main = torch.cuda.CUDAGraph()
            with torch.cuda.graph(main, capture_error_mode=mode):
                self._local_fwdbwd(dev_in, dev_tg, accum)
                self._reduce_norm_clip(accum, grad_clip)
                if skip is None:
                    self._adamw()
            upd = None
            if skip is not None:
                upd = torch.cuda.CUDAGraph()
                with torch.cuda.graph(upd, pool=main.pool(), capture_error_mode=mode):
                    self._adamw()
            self._graphs[key] = (main, upd)
            self._graph_grads[key] = self._update_grads
        else:
            self._stage(batches)
        main, upd = self._graphs[key]
        # another key's capture may have come since: the host's view follows the graph that runs (accumulated
        # micro-steps leave their sum in the fp32 accumulator, a single one in the gradient buffer)
        self._update_grads = self._graph_grads[key]
        if upd is None:
            self._set_hyper(lr, step, *hp)
            main.replay()
            loss, norm = self._read(accum)
            self.last_step_skipped = False
        else:
            main.replay()
            loss, norm = self._read(accum)
            self.last_step_skipped = bool(skip(loss, norm))
            if not self.last_step_skipped:
                self._set_hyper(lr, step, *hp)
                upd.replay()
        # the graph ran forward/backward: the host-side flags follow
        self._norm_fresh = True
        self._have_dlogits = False
        return loss, norm
