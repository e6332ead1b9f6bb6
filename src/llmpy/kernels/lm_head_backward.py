"""The lm_head backward with the classifier's logit gradient formed inside its two products (Hopper, Gluon).

The model's chunked classifier, per chunk of rows, by default: the fused classifier reads the logits and writes
dlogits = (softmax - onehot) * dloss over them in place, then cuBLAS computes dlnf = dlogits @ wte and
dwte += dlogits^T @ lnf. With GPT2Model(lm_head_prologue="loss-pass" or "dinp-sums") nothing writes or reads
dlogits. Per chunk:

- loss-pass only: the classifier's validation kernel writes each row's loss (a read-only pass over the logits);
- `row_shifts_and_mask`: each row's exponent shift in base 2 (loss-pass: the log-sum-exp, lse2 = (loss +
  logit[target]) log2 e; dinp-sums: logit[target] log2 e + ROW_OFFSET2), and -inf in the padding columns' logits,
  so that g is exactly 0 there whatever wte's padding rows hold;
- `lm_head_dinp`: dlnf[r] = dloss (sum_v p(r, v) wte[v] - wte[target r]), from g(r, v) = exp2(logit log2 e -
  shift2) formed from each [128 rows, 64 vocabulary] tile of logits in registers, as the A operand of an
  asynchronous wgmma: the next tile's exponentials run while this tile's product is on the tensor cores (Triton's
  tl.dot waits for each product before the next tile's prologue, which made the same kernel 1.7x slower than a
  plain product: bench/RESULTS.md, run AQ). The vocabulary is split in two halves; a Triton finish kernel sums
  them in a fixed order and takes off dloss wte[target]. loss-pass: g = p dloss already. dinp-sums: the product
  also sums each row's g, and the finish scales by dloss / sum and writes each row's lse2 and loss, so no other
  pass reads the logits before the products;
- `lm_head_dweight`: dwte[v] += sum_r g(r, v) lnf[r] for v < V, g = exp2(logit log2 e - lse2) dloss formed from
  [64 rows, 128 vocabulary] tiles read transposed, dwte's old value the accumulator's start;
- the one-hot's share of dwte, -dloss lnf[r] into row target[r], is encoder.wte_backward's deterministic scatter
  (scale = -dloss), once a step over all rows.

Why the one-hot is not in the tiles: when a select touches the A operand (the target's -dloss, or a padding mask),
ptxas serialises every wgmma of the loop (warning C7515). So the finish kernel takes dloss * wte[target] off
(exact in fp32) and dweight leaves it to the scatter. No atomics: the same bits run after run.

GPU only (sm_90, bf16); the Triton kernels (row shifts, finish) run everywhere. Gluon has no CPU interpreter: on
the CPU the products' own code runs in tests/gluon_emulator.py against float64, in the model's plumbing float64
stand-ins take their place, and they compile for sm_90a (test_gluon_compile); on the GPU they are tested against
float64 (tests/test_lm_head_backward.py). Not yet
measured on an H200: `bash bench/gpu_check.sh lm-head-tests lm-head lm-head-ab` (the tests, the kernels against
the classifier and cuBLAS in bench/kernels/try_lm_head_prologue.py, the whole step each way).
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
# (dinp 171, 239 with ROW_SUMS, dweight 243 registers a thread under triton 3.6 and its ptxas, no spills);
# dinp's vocabulary split in two for its waves (64 x 3 programs per 8192-row chunk otherwise); STAGES: TMA ring
# depths (147 / 197 kB of shared memory at 3 / 4)
TILE_M, TILE_N, TILE_K = 128, 256, 64
DINP_SPLIT = 2
DINP_STAGES = 4
DWEIGHT_STAGES = 3
WARPS = 8
# the model's lm_head_prologue values: off (the classifier writes dlogits, cuBLAS products); loss-pass (the
# classifier's read-only pass gives each row's log-sum-exp first); dinp-sums (dinp sums each row's exponentials
# itself: one pass over the logits less)
PROLOGUE_MODES = ("off", "loss-pass", "dinp-sums")
# dinp-sums' shift, above the target's logit (base 2): the sum of a row's exponentials is 2^(loss log2 e - 64),
# at least 2^-64 (fp32 keeps every term that matters). Rows whose sum reaches SUM_LIMIT (a loss above
# 164 ln 2 = 114 nats: a diverging run), where a term could round to inf in bf16 or the product overflow, the
# finish kernel does again from their logits
ROW_OFFSET2 = 64.0
SUM_LIMIT = tl.constexpr(2.0 ** 100)


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
def _lm_head_row_shift_kernel(logits_ptr, losses_ptr, targets_ptr, shift2_ptr, n_rows, V, Vp,
                              FROM_LOSS: tl.constexpr, OFFSET2: tl.constexpr, ROWS: tl.constexpr, PAD: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    row_base = rows.to(tl.int64) * Vp
    tgt = tl.load(targets_ptr + rows, mask=ok, other=0).to(tl.int64)
    x_t2 = tl.load(logits_ptr + row_base + tgt, mask=ok, other=0.0).to(tl.float32) * LOG2E
    if FROM_LOSS:  # the row's log-sum-exp: loss = lse - logit[target]
        shift2 = tl.load(losses_ptr + rows, mask=ok, other=0.0) * LOG2E + x_t2
    else:
        shift2 = x_t2 + OFFSET2
    tl.store(shift2_ptr + rows, shift2, mask=ok)
    cols = V + tl.arange(0, PAD)
    m2 = ok[:, None] & (cols < Vp)[None, :]
    neg_inf = tl.full([ROWS, PAD], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row_base[:, None] + cols[None, :], neg_inf, mask=m2)


def row_shifts_and_mask(logits: torch.Tensor, targets: torch.Tensor, shift2: torch.Tensor, V: int,
                        losses: torch.Tensor | None = None):
    """Each row's exponent shift in base 2, g = exp2(logit log2 e - shift2[r]), and logits[:, V:] = -inf.
    With the classifier's losses (loss-pass): shift2 = (loss + logit[target]) log2 e, the row's log-sum-exp, so
    that g is the softmax. Without (dinp-sums): shift2 = logit[target] log2 e + ROW_OFFSET2, and dinp sums the
    exponentials. logits (R, Vp) contiguous; shift2, losses (R,) fp32."""
    R, Vp = logits.shape
    assert logits.is_contiguous() and targets.shape == (R,) and shift2.shape == (R,) and shift2.dtype == torch.float32
    assert losses is None or (losses.shape == (R,) and losses.dtype == torch.float32)
    rows = 32
    _lm_head_row_shift_kernel[(cdiv(R, rows),)](
        logits, shift2 if losses is None else losses, targets, shift2, R, V, Vp, FROM_LOSS=losses is not None,
        OFFSET2=ROW_OFFSET2, ROWS=rows, PAD=triton.next_power_of_2(max(Vp - V, 1)), num_warps=4)
    return shift2


@triton.jit
def _lm_head_dinp_finish_kernel(part_ptr, sums_ptr, shift2_ptr, logits_ptr, tgt_ptr, w_ptr, out_ptr, lse2_ptr,
                                losses_ptr, dloss, R, C, Vp, SPLIT: tl.constexpr, ROW_SUMS: tl.constexpr,
                                ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                                W_ROWS: tl.constexpr):
    """out = (the SPLIT parts, in order) [* dloss / the row's sum of exponentials] - dloss * wte[target]; with
    ROW_SUMS also each row's lse2 and loss (column block 0 writes them), and the rows whose sum reached
    SUM_LIMIT or whose parts are not finite done again from their logits (_dinp_row_again)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok_r, ok_c = rows < R, cols < C
    ok = ok_r[:, None] & ok_c[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):  # the parts in order: the same bits every run
        acc += tl.load(part_ptr + s * R * C + offs, mask=ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=ok_r, other=0).to(tl.int64)
    w_t = tl.load(w_ptr + tgt[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    keep = ok
    if ROW_SUMS:
        total = tl.load(sums_ptr + rows, mask=ok_r, other=1.0)
        for s in tl.static_range(1, SPLIT):
            total += tl.load(sums_ptr + s * R + rows, mask=ok_r, other=1.0)
        # a row is done again when its sum is this large (or NaN), or its parts here are not finite (NaN: the
        # comparisons are False)
        parts_finite = tl.sum((~(tl.abs(acc) < float("inf"))).to(tl.int32), axis=1) == 0
        again = ok_r & ~((total < SUM_LIMIT) & parts_finite)
        acc = acc * (dloss / total)[:, None]
        keep = ok & ~again[:, None]
        shift2 = tl.load(shift2_ptr + rows, mask=ok_r, other=0.0)
        x_t2 = tl.load(logits_ptr + rows.to(tl.int64) * Vp + tgt, mask=ok_r, other=0.0).to(tl.float32) * LOG2E
        log2_total = tl.log2(total)
        first = ok_r & ~again & (tl.program_id(1) == 0)
        tl.store(lse2_ptr + rows, shift2 + log2_total, mask=first)
        # the shift's offset from the target's logit (exactly as rounded) plus log2 of the sum: no cancellation
        tl.store(losses_ptr + rows, ((shift2 - x_t2) + log2_total) * LN2, mask=first)
    tl.store(out_ptr + offs, (acc - w_t * dloss).to(out_ptr.dtype.element_ty), mask=keep)
    if ROW_SUMS:
        if tl.sum(again.to(tl.int32), axis=0) > 0:
            for i in range(ROWS):
                if tl.sum(tl.where(tl.arange(0, ROWS) == i, again.to(tl.int32), 0), axis=0) > 0:
                    _dinp_row_again(tl.program_id(0) * ROWS + i, cols, ok_c, logits_ptr, tgt_ptr, w_ptr, out_ptr,
                                    lse2_ptr, losses_ptr, dloss, C, Vp, BLOCK_V, W_ROWS)


@triton.jit
def _dinp_row_again(r, cols, ok_c, logits_ptr, tgt_ptr, w_ptr, out_ptr, lse2_ptr, losses_ptr, dloss, C, Vp,
                    BLOCK_V: tl.constexpr, W_ROWS: tl.constexpr):
    """A row whose loss is so large (above 114 nats) that dinp's shifted exponentials may have overflowed:
    its lse2 from the logits (max, then sum), then out[r, cols] = dloss (softmax @ wte[:, cols] - wte[target]).
    Rare (a diverging run): a loop over the vocabulary, a row at a time."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    base = r.to(tl.int64) * Vp
    v_offs = tl.arange(0, BLOCK_V)
    high = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for v0 in range(0, Vp, BLOCK_V):
        v = v0 + v_offs
        high = tl.maximum(high, tl.load(logits_ptr + base + v, mask=v < Vp, other=float("-inf")).to(tl.float32))
    high2 = tl.max(high, axis=0) * LOG2E
    z = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, Vp, BLOCK_V):
        v = v0 + v_offs
        x = tl.load(logits_ptr + base + v, mask=v < Vp, other=float("-inf")).to(tl.float32)
        z += tl.exp2(x * LOG2E - high2)
    lse2 = high2 + tl.log2(tl.sum(z, axis=0))
    # W_ROWS rows of wte at a time, summed over them each step: few registers for a path that is rarely taken
    grad = tl.zeros([cols.shape[0]], tl.float32)
    for v0 in range(0, Vp, W_ROWS):
        v = v0 + tl.arange(0, W_ROWS)
        x = tl.load(logits_ptr + base + v, mask=v < Vp, other=float("-inf")).to(tl.float32)
        w = tl.load(w_ptr + v.to(tl.int64)[:, None] * C + cols[None, :], mask=(v < Vp)[:, None] & ok_c[None, :],
                    other=0.0).to(tl.float32)
        grad += tl.sum(tl.exp2(x * LOG2E - lse2)[:, None] * w, axis=0)
    tgt = tl.load(tgt_ptr + r).to(tl.int64)
    w_t = tl.load(w_ptr + tgt * C + cols, mask=ok_c, other=0.0).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * C + cols, ((grad - w_t) * dloss).to(out_ptr.dtype.element_ty), mask=ok_c)
    if tl.program_id(1) == 0:
        x_t = tl.load(logits_ptr + base + tgt).to(tl.float32)
        tl.store(lse2_ptr + r, lse2)
        tl.store(losses_ptr + r, (lse2 - x_t * LOG2E) * LN2)


if GLUON:
    @gluon.constexpr_function
    def _mma_layout(cols, num_warps):
        """The wgmma accumulator layout of [16 * num_warps, cols] tiles: the products' (cols = TILE_N), and the
        one the logits tile is read into for its prologue (cols = TILE_K), whose values convert to the A
        operand without data movement."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])

    @gluon.jit
    def _ring_loads(a_desc, b_desc, a_ring, b_ring, bars, j, a0, a1, b0, b1, STAGES: gl.constexpr):
        """Tile j of both streams (boxes at [a0, a1] and [b0, b1]) into ring slot j % STAGES, one barrier."""
        slot = j % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [a0, a1], bar, a_ring.index(slot))
        tma.async_copy_global_to_shared(b_desc, [b0, b1], bar, b_ring.index(slot))

    @gluon.jit
    def _lm_head_dinp_kernel(x_desc, w_desc, shift2_ptr, sums_ptr, out_ptr, scale, M, N, K_TILES_SPLIT,
                             BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr,
                             NT: gl.constexpr, STAGES: gl.constexpr, ROW_SUMS: gl.constexpr,
                             num_warps: gl.constexpr):
        """out[s] (fp32 [M, N] slice s of SPLIT) = the product over vocabulary part s of g = exp2(x log2 e -
        shift2) scale and wte; with ROW_SUMS, g unscaled, and each row's sum of those g over part s into sums[s]
        (column tile 0 writes it). Tile j + 1's prologue runs while tile j's product is in flight; each ring slot
        is refilled once the product that read it is done."""
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
                # logits [m0, k] and wte [k, n0]
                _ring_loads(x_desc, w_desc, x_ring, w_ring, bars, i, m0, (k0 + i) * BK, (k0 + i) * BK, n0, STAGES)
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_x))
        shift2 = gl.load(shift2_ptr + rows)
        if ROW_SUMS:  # elementwise over the loop (an add a value), one reduction after it
            sums = gl.zeros([BM, BK], gl.float32, mma_x)
        acc = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, mma_acc))
        a_prev = gl.zeros([BM, BK], gl.bfloat16, a_l)
        for j in range(nk):
            slot = j % STAGES
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            x = x_ring.index(slot).load(mma_x)
            g = gl.exp2(x.to(gl.float32) * 1.4426950408889634 - gl.expand_dims(shift2, 1))
            if ROW_SUMS:  # unscaled: the finish kernel scales by dloss / sum
                sums = sums + g
            else:
                g = g * scale
            a = gl.convert_layout(g.to(gl.bfloat16), a_l)
            acc = warpgroup_mma(a, w_ring.index(slot), acc, is_async=True)
            # tile j - 1's product done; its A registers (a_prev) stay live until here so that tile j's prologue
            # does not reuse them while that product reads them
            warpgroup_mma_wait(num_outstanding=1, deps=(a_prev, ))
            a_prev = a
            if j > 0:
                if j - 1 + STAGES < nk:  # tile j - 1's slot takes tile j - 1 + STAGES
                    k = (k0 + j - 1 + STAGES) * BK
                    _ring_loads(x_desc, w_desc, x_ring, w_ring, bars, j - 1 + STAGES, m0, k, k, n0, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if ROW_SUMS:
            if n_t == 0:
                gl.store(sums_ptr + s * M + rows, gl.sum(sums, axis=1))
        out_rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_acc))
        out_cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_acc))
        offs = gl.expand_dims((s * M + out_rows) * N, 1) + gl.expand_dims(out_cols, 0)
        gl.store(out_ptr + offs, acc)

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
                # logits [k, v0] (read transposed) and lnf [k, n0]
                _ring_loads(x_desc, a_desc, x_ring, a_ring, bars, i, i * BK, v0, i * BK, n0, STAGES)
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
                    k = (j - 1 + STAGES) * BK
                    _ring_loads(x_desc, a_desc, x_ring, a_ring, bars, j - 1 + STAGES, k, v0, k, n0, STAGES)
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


def lm_head_dinp(logits: torch.Tensor, wte: torch.Tensor, shift2: torch.Tensor, targets: torch.Tensor, dloss: float,
                 out: torch.Tensor, partial: torch.Tensor, row_sums: torch.Tensor | None = None,
                 lse2: torch.Tensor | None = None, losses: torch.Tensor | None = None, stages: int = DINP_STAGES):
    """out (R, C) = dloss (softmax(logits) @ wte - wte[targets]): the classifier's logit gradient times wte,
    never stored. logits (R, Vp) bf16 with -inf in the padding columns and shift2 each row's exponent shift, both
    from row_shifts_and_mask; partial (DINP_SPLIT, R, C) fp32 scratch.
    loss-pass (row_sums None): shift2 is each row's lse2, g = exp2(logit log2 e - shift2) dloss in the product.
    dinp-sums: the product also sums each row's exponentials into row_sums (DINP_SPLIT, R) fp32, and this writes
    each row's lse2 (what lm_head_dweight takes) and loss (R,) fp32. Returns out."""
    R, Vp = logits.shape
    C = wte.shape[1]
    assert partial.shape == (DINP_SPLIT, R, C) and partial.dtype == torch.float32
    assert out.shape == (R, C) and out.is_contiguous() and wte.shape[0] == Vp and shift2.shape == (R,)
    sums = row_sums is not None
    assert sums == (lse2 is not None) == (losses is not None), "dinp-sums takes row_sums, lse2 and losses"
    assert not sums or (row_sums.shape == (DINP_SPLIT, R) and lse2.shape == losses.shape == (R,))
    _dinp_products(logits, wte, shift2, 1.0 if sums else dloss, partial, row_sums, stages)
    return dinp_finish(partial, row_sums, shift2, logits, targets, wte, dloss, out, lse2, losses)


def dinp_finish(partial, row_sums, shift2, logits, targets, wte, dloss: float, out, lse2=None, losses=None):
    """lm_head_dinp after its product (Triton, any shape): out = the parts summed in order [* dloss / the row's
    sum] - dloss wte[targets]; with row_sums also lse2 and losses, and the rows of a huge loss done again."""
    (split, R, C), Vp = partial.shape, logits.shape[1]
    sums = row_sums is not None
    rows, block_c = 8, 256  # 8 x 256 with 8 warps: 72-80 registers (16 x 256 with 4: 165-216, low occupancy)
    _lm_head_dinp_finish_kernel[(cdiv(R, rows), cdiv(C, block_c))](
        partial, row_sums if sums else shift2, shift2, logits, targets, wte, out, lse2 if sums else shift2,
        losses if sums else shift2, dloss, R, C, Vp, SPLIT=split, ROW_SUMS=sums, ROWS=rows, BLOCK_C=block_c,
        BLOCK_V=1024, W_ROWS=16, num_warps=8)
    return out


def _dinp_products(logits, wte, shift2, scale: float, partial, row_sums, stages: int):
    """lm_head_dinp's Gluon product (GPU only: the CPU tests put a float64 stand-in here)."""
    R, Vp = logits.shape
    C = wte.shape[1]
    assert R % TILE_M == 0 and C % TILE_N == 0 and Vp % TILE_K == 0 and (Vp // TILE_K) % DINP_SPLIT == 0
    NT = C // TILE_N
    _lm_head_dinp_kernel[(R // TILE_M * DINP_SPLIT * NT,)](
        _descriptor(logits, [TILE_M, TILE_K]), _descriptor(wte, [TILE_K, TILE_N]), shift2,
        partial if row_sums is None else row_sums, partial, scale, R, C, Vp // TILE_K // DINP_SPLIT, BM=TILE_M,
        BN=TILE_N, BK=TILE_K, SPLIT=DINP_SPLIT, NT=NT, STAGES=stages, ROW_SUMS=row_sums is not None,
        num_warps=WARPS)


def lm_head_dweight(logits: torch.Tensor, lnf: torch.Tensor, lse2: torch.Tensor, dloss: float, V: int,
                    dwte: torch.Tensor, stages: int = DWEIGHT_STAGES):
    """dwte[:V] += g[:, :V]^T @ lnf (ACCUMULATED), g = exp2(logits log2 e - lse2) dloss (each row's lse2:
    row_shifts_and_mask's from the loss, or lm_head_dinp's in dinp-sums), without the one-hot's -dloss (the
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
