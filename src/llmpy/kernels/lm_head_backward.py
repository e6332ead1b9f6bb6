"""The lm_head backward with the classifier's logit gradient formed inside its two products (Hopper, Gluon).

The model's chunked classifier, per chunk of rows, by default: the fused classifier reads the logits and writes
dlogits = (softmax - onehot) * dloss over them in place, then cuBLAS computes dlnf = dlogits @ wte and
dwte += dlogits^T @ lnf. With GPT2Model(lm_head_prologue=True) nothing writes or reads dlogits:

- the classifier's validation kernel writes each row's loss (a read-only pass over the logits);
- `lse2_and_mask` recovers each row's log-sum-exp in base 2, lse2 = (loss + logit[target]) log2 e, and sets the
  padding columns' logits to -inf, so that g is exactly 0 there whatever wte's padding rows hold;
- `lm_head_dinp`: dlnf[r] = sum_v g(r, v) wte[v] - dloss wte[target r], g(r, v) = exp2(logit log2 e - lse2) dloss
  formed from each [128 rows, 64 vocabulary] tile of logits in registers, as the A operand of an asynchronous
  wgmma: the next tile's exponentials run while this tile's product is on the tensor cores (Triton's tl.dot
  waits for each product before the next tile's prologue, which made the same kernel 1.7x slower than a plain
  product: bench/RESULTS.md, run AQ). The vocabulary is split in two halves summed in a fixed order;
- `lm_head_dweight`: dwte[v] += sum_r g(r, v) lnf[r] for v < V, g formed from [64 rows, 128 vocabulary] tiles read
  transposed, dwte's old value the accumulator's start;
- the one-hot's share of dwte, -dloss lnf[r] into row target[r], is encoder.wte_backward's deterministic scatter
  (scale = -dloss), once a step over all rows.

Why the one-hot is not in the tiles: when a select touches the A operand (the target's -dloss, or a padding mask),
ptxas serialises every wgmma of the loop (warning C7515). So dinp takes dloss * wte[target] off in its epilogue
(exact in fp32) and dweight leaves it to the scatter. No atomics: the same bits run after run.

GPU only (sm_90, bf16): Gluon has no CPU interpreter; `lse2_and_mask` is Triton and runs everywhere. Tested on the
GPU against float64 products (tests/test_lm_head_backward.py), compiled for sm_90a on the CPU (test_gluon_compile).
Not yet measured on an H200: `bash bench/gpu_check.sh lm-head-tests lm-head lm-head-ab` (the tests, the kernels
against the classifier and cuBLAS in bench/kernels/try_lm_head_prologue.py, the whole step with and without).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv

try:  # Gluon ships with triton >= 3.5; without it the option is refused (the default path serves)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from .flash_backward_wgmma import _rings
    GLUON = True
except Exception:  # noqa: BLE001 - an import of an experimental module may fail in many ways
    GLUON = False

LOG2E = 1.4426950408889634
# the products' tiles: 128 x 256 outputs, 64-deep steps; 8 warps (two warpgroups of 64 rows), one program an SM
# (171 and 232 registers a thread under triton 3.6, no spills); dinp's vocabulary split in two for its waves
# (64 x 3 programs per 8192-row chunk otherwise); STAGES: TMA ring depths (147 / 197 kB of shared memory at 3 / 4)
TILE_M, TILE_N, TILE_K = 128, 256, 64
DINP_SPLIT = 2
DINP_STAGES = 4
DWEIGHT_STAGES = 3
WARPS = 8


def lm_head_prologue_usable(device, dtype: torch.dtype, chunk_rows: int, C: int, Vp: int) -> str | None:
    """None when the Gluon lm_head backward serves these shapes here, else why not (one line)."""
    if not GLUON:
        return "this triton has no Gluon"
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "it needs an sm_90 GPU (Hopper's wgmma)"
    if dtype != torch.bfloat16:
        return "it needs bf16 activations"
    if chunk_rows % TILE_M or C % TILE_N or Vp % TILE_M or (Vp // TILE_K) % DINP_SPLIT:
        return (f"it needs classifier chunks of a multiple of {TILE_M} rows (here {chunk_rows}), C a multiple of "
                f"{TILE_N} (here {C}) and the padded vocabulary a multiple of {TILE_M} (here {Vp})")
    return None


@triton.jit
def _classifier_lse2_kernel(logits_ptr, losses_ptr, targets_ptr, lse2_ptr, n_rows, V, Vp,
                          ROWS: tl.constexpr, PAD: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    row_base = rows.to(tl.int64) * Vp
    tgt = tl.load(targets_ptr + rows, mask=ok, other=0).to(tl.int64)
    x_t = tl.load(logits_ptr + row_base + tgt, mask=ok, other=0.0).to(tl.float32)
    loss = tl.load(losses_ptr + rows, mask=ok, other=0.0)
    tl.store(lse2_ptr + rows, (loss + x_t) * 1.4426950408889634, mask=ok)
    cols = V + tl.arange(0, PAD)
    m2 = ok[:, None] & (cols < Vp)[None, :]
    neg_inf = tl.full([ROWS, PAD], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row_base[:, None] + cols[None, :], neg_inf, mask=m2)


def lse2_and_mask(logits: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor, lse2: torch.Tensor, V: int):
    """lse2[r] = (losses[r] + logits[r, targets[r]]) * log2 e (each row's log-sum-exp in base 2, from the loss
    the classifier wrote: loss = lse - logit[target]); logits[:, V:] = -inf. logits (R, Vp) contiguous."""
    R, Vp = logits.shape
    assert logits.is_contiguous() and losses.shape == (R,) and targets.shape == (R,) and lse2.shape == (R,)
    assert losses.dtype == lse2.dtype == torch.float32
    rows = 32
    _classifier_lse2_kernel[(cdiv(R, rows),)](logits, losses, targets, lse2, R, V, Vp, ROWS=rows,
                                            PAD=triton.next_power_of_2(max(Vp - V, 1)), num_warps=4)
    return lse2


@triton.jit
def _lm_head_split_sum_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):  # the halves in order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


if GLUON:
    @gluon.constexpr_function
    def _mma_layout(cols, num_warps):
        """The wgmma accumulator layout of [16 * num_warps, cols] tiles: the products' (cols = TILE_N), and the
        one the logits tile is read into for its prologue (cols = TILE_K), whose values convert to the A
        operand without data movement."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])

    @gluon.jit
    def _dinp_loads(x_desc, w_desc, x_ring, w_ring, bars, j, k0, m0, n0, STAGES: gl.constexpr, BK: gl.constexpr):
        slot = j % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [m0, (k0 + j) * BK], bar, x_ring.index(slot))
        tma.async_copy_global_to_shared(w_desc, [(k0 + j) * BK, n0], bar, w_ring.index(slot))

    @gluon.jit
    def _lm_head_dinp_kernel(x_desc, w_desc, w_ptr, lse2_ptr, tgt_ptr, out_ptr, dloss, M, N, K_TILES_SPLIT,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr,
                     NT: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """out[s] (fp32 [M, N] slice s of SPLIT) = the product over vocabulary part s; split 0 also takes off
        dloss * wte[target]. Tile j + 1's prologue runs while tile j's product is in flight; each ring slot is
        refilled once the product that read it is done."""
        pid = gl.program_id(0)
        n_t = pid % NT  # a row block's column tiles run side by side: its logits come from L2 for all but one
        rest = pid // NT
        s = rest % SPLIT
        m0 = (rest // SPLIT) * BM
        n0 = n_t * BN
        mma_acc: gl.constexpr = _mma_layout(BN, num_warps)
        mma_x: gl.constexpr = _mma_layout(BK, num_warps)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_acc, k_width=2)
        x_ring, w_ring, bars = _rings(x_desc, w_desc, STAGES)
        k0 = s * K_TILES_SPLIT
        nk = K_TILES_SPLIT
        for i in gl.static_range(STAGES):
            if i < nk:
                _dinp_loads(x_desc, w_desc, x_ring, w_ring, bars, i, k0, m0, n0, STAGES, BK)
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_x))
        lse2 = gl.load(lse2_ptr + rows)
        acc = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, mma_acc))
        a_prev = gl.zeros([BM, BK], gl.bfloat16, a_l)
        for j in range(nk):
            slot = j % STAGES
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            x = x_ring.index(slot).load(mma_x)
            g = gl.exp2(x.to(gl.float32) * 1.4426950408889634 - gl.expand_dims(lse2, 1)) * dloss
            a = gl.convert_layout(g.to(gl.bfloat16), a_l)
            acc = warpgroup_mma(a, w_ring.index(slot), acc, is_async=True)
            # tile j - 1's product done; its A registers (a_prev) stay live until here so that tile j's prologue
            # does not reuse them while that product reads them
            warpgroup_mma_wait(num_outstanding=1, deps=(a_prev, ))
            a_prev = a
            if j > 0:
                if j - 1 + STAGES < nk:  # tile j - 1's slot takes tile j - 1 + STAGES
                    _dinp_loads(x_desc, w_desc, x_ring, w_ring, bars, j - 1 + STAGES, k0, m0, n0, STAGES, BK)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        out_rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_acc))
        out_cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_acc))
        if s == 0:  # the one-hot's share, once over the splits
            t_rows = gl.load(tgt_ptr + out_rows).to(gl.int64)
            w_t = gl.load(w_ptr + gl.expand_dims(t_rows * N, 1) + gl.expand_dims(out_cols, 0))
            acc = acc - w_t.to(gl.float32) * dloss
        offs = gl.expand_dims((s * M + out_rows) * N, 1) + gl.expand_dims(out_cols, 0)
        gl.store(out_ptr + offs, acc)

    @gluon.jit
    def _dweight_loads(x_desc, a_desc, x_ring, a_ring, bars, j, v0, n0, STAGES: gl.constexpr, BK: gl.constexpr):
        slot = j % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [j * BK, v0], bar, x_ring.index(slot))
        tma.async_copy_global_to_shared(a_desc, [j * BK, n0], bar, a_ring.index(slot))

    @gluon.jit
    def _lm_head_dweight_kernel(x_desc, a_desc, lse2_ptr, dw_ptr, dloss, V, R, N,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NT: gl.constexpr,
                        STAGES: gl.constexpr, num_warps: gl.constexpr):
        """dw[v0:v0+BM, n0:n0+BN] += sum over rows r of g(r, v) a[r, n], g formed from a [BK rows, BM vocabulary]
        tile read transposed; no one-hot (the scatter adds it); rows v >= V not written. _lm_head_dinp_kernel's
        pipeline."""
        pid = gl.program_id(0)
        n_t = pid % NT
        v0 = (pid // NT) * BM
        n0 = n_t * BN
        mma_acc: gl.constexpr = _mma_layout(BN, num_warps)
        mma_x: gl.constexpr = _mma_layout(BK, num_warps)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_acc, k_width=2)
        x_ring, a_ring, bars = _rings(x_desc, a_desc, STAGES)
        nk = R // BK
        for i in gl.static_range(STAGES):
            if i < nk:
                _dweight_loads(x_desc, a_desc, x_ring, a_ring, bars, i, v0, n0, STAGES, BK)
        k_offs = gl.arange(0, BK, layout=gl.SliceLayout(0, mma_x))
        lse2 = gl.load(lse2_ptr + k_offs)
        # dw's old value is the accumulator's start: loading it after the loop spills
        out_rows = v0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_acc))
        out_cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_acc))
        offs = gl.expand_dims(out_rows * N, 1) + gl.expand_dims(out_cols, 0)
        mask = gl.expand_dims(out_rows < V, 1) & gl.expand_dims(out_cols < N, 0)
        acc = warpgroup_mma_init(gl.load(dw_ptr + offs, mask=mask, other=0.0).to(gl.float32))
        a_prev = gl.zeros([BM, BK], gl.bfloat16, a_l)
        for j in range(nk):
            slot = j % STAGES
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            x = x_ring.index(slot).permute((1, 0)).load(mma_x)
            g = gl.exp2(x.to(gl.float32) * 1.4426950408889634 - gl.expand_dims(lse2, 0)) * dloss
            a = gl.convert_layout(g.to(gl.bfloat16), a_l)
            # the next tile's log-sum-exps, on their way under the product
            lse2 = gl.load(lse2_ptr + (j + 1) * BK + k_offs, mask=(j + 1) * BK + k_offs < R, other=0.0)
            acc = warpgroup_mma(a, a_ring.index(slot), acc, is_async=True)
            warpgroup_mma_wait(num_outstanding=1, deps=(a_prev, ))
            a_prev = a
            if j > 0:
                if j - 1 + STAGES < nk:
                    _dweight_loads(x_desc, a_desc, x_ring, a_ring, bars, j - 1 + STAGES, v0, n0, STAGES, BK)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        # the offsets again (program_id(1) is 0: an expression the compiler cannot share with the first, so that
        # the first's registers are not held over the loop)
        out_rows = v0 + gl.program_id(1) + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_acc))
        offs = gl.expand_dims(out_rows * N, 1) + gl.expand_dims(out_cols, 0)
        mask = gl.expand_dims(out_rows < V, 1) & gl.expand_dims(out_cols < N, 0)
        gl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=mask)


def _descriptor(t: torch.Tensor, box):
    return GluonTensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))


def lm_head_dinp(logits: torch.Tensor, wte: torch.Tensor, lse2: torch.Tensor, targets: torch.Tensor, dloss: float,
                 out: torch.Tensor, partial: torch.Tensor, stages: int = DINP_STAGES):
    """out (R, C) = g @ wte - dloss * wte[targets], g = exp2(logits log2 e - lse2) dloss: the classifier's logit
    gradient times wte, g never stored. logits (R, Vp) bf16 with -inf in the padding columns (lse2_and_mask);
    partial: (DINP_SPLIT, R, C) fp32 scratch. Returns out."""
    R, Vp = logits.shape
    C = wte.shape[1]
    k_tiles = Vp // TILE_K
    assert R % TILE_M == 0 and C % TILE_N == 0 and Vp % TILE_K == 0 and k_tiles % DINP_SPLIT == 0
    assert partial.shape == (DINP_SPLIT, R, C) and partial.dtype == torch.float32
    assert out.shape == (R, C) and out.is_contiguous() and wte.shape[0] == Vp
    NT = C // TILE_N
    _lm_head_dinp_kernel[(R // TILE_M * DINP_SPLIT * NT,)](
        _descriptor(logits, [TILE_M, TILE_K]), _descriptor(wte, [TILE_K, TILE_N]), wte, lse2, targets, partial,
        dloss, R, C, k_tiles // DINP_SPLIT, BM=TILE_M, BN=TILE_N, BK=TILE_K, SPLIT=DINP_SPLIT, NT=NT,
        STAGES=stages, num_warps=WARPS)
    block = 4096
    _lm_head_split_sum_kernel[(cdiv(R * C, block),)](partial, out, R * C, SPLIT=DINP_SPLIT, BLOCK=block)
    return out


def lm_head_dweight(logits: torch.Tensor, lnf: torch.Tensor, lse2: torch.Tensor, dloss: float, V: int,
                    dwte: torch.Tensor, stages: int = DWEIGHT_STAGES):
    """dwte[:V] += g[:, :V]^T @ lnf (ACCUMULATED), g as in lm_head_dinp, without the one-hot's -dloss (the
    caller scatters -dloss * lnf by the targets: encoder.wte_backward(..., scale=-dloss)). Returns dwte."""
    R, Vp = logits.shape
    C = lnf.shape[1]
    assert R % TILE_K == 0 and C % TILE_N == 0 and Vp % TILE_M == 0
    assert dwte.shape == (Vp, C) and dwte.is_contiguous() and lnf.shape == (R, C)
    NT = C // TILE_N
    _lm_head_dweight_kernel[(Vp // TILE_M * NT,)](
        _descriptor(logits, [TILE_K, TILE_M]), _descriptor(lnf, [TILE_K, TILE_N]), lse2, dwte, dloss, V, R, C,
        BM=TILE_M, BN=TILE_N, BK=TILE_K, NT=NT, STAGES=stages, num_warps=WARPS)
    return dwte
