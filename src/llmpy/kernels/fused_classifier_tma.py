"""The fused classifier with each row staged in shared memory by TMA (Triton's Gluon dialect, sm_90).

Same results as fused_classifier's variants (loss = logsumexp(logits[:V]) - logits[target]; in training
the row overwritten in place by (softmax - onehot) * dloss, 0 in [V, Vp)), with the row read from HBM
once. Why: the model's two-pass kernel reads a 100 KB row twice (the second time half from L2: ncu, 51 %
hits, 3.33 TB/s, bench/RESULTS.md run Y), and the one-pass kernels that hold the row in registers fill
an SM's register file with one row, so nothing of the next row is in flight while this one is reduced
(run T: slower than the two-pass kernel). Here the row goes into shared memory through the TMA unit, which
needs no registers: an SM's shared memory holds two row buffers (2 x 104 KB), either one program's two
(the next row on its way into the other buffer while this one is reduced) or one each of two programs
(the default: while one reduces and writes its row, the other's row arrives). The row is read three
times from shared memory (max, sum of exp, gradient: two exps an element, as the two-pass kernel) and
written once to HBM from registers.

The logits (rows, Vp) are seen as (rows, Vp / 128, 128), so one TMA box is [1, BOX_ROWS, 128] (8 KB at
BOX_ROWS = 32) and a row is NBOX boxes; the boxes' part past Vp / 128 lies outside that view, which TMA
fills with zeros without reading anything, and the kernel masks every column >= V. Unswizzled shared
memory: a box row is 256 bytes, wider than TMA's largest swizzle span, and each thread reads 16
contiguous bytes, which needs no swizzle to be free of bank conflicts.

GPU only (sm_90 with Gluon; Gluon has no CPU interpreter, so the CPU tests run this kernel's code in
tests/gluon_emulator.py). fused_classifier's "tma" variant
runs it where tma_classifier_usable says so (bf16 logits, Vp a multiple of 128, a row within two
buffers' worth of shared memory) and the two-pass kernel elsewhere, which is also what the CPU tests run.
The reduction order is fixed by the layout (no atomics): bitwise repeatable, and validation (no gradient
written) gives bitwise the training losses.
"""
from __future__ import annotations

import functools

import torch
import triton

from .common import register_cap

try:  # Gluon ships with triton >= 3.5; anything missing here just means the two-pass kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from .gluon_compat import cta_barrier, tma_load
    GLUON = True
except Exception:  # noqa: BLE001 - an import of an experimental module may fail in many ways
    GLUON = False

BOX_COLS = 128      # logits a box row: 256 bytes of bf16
BOX_ROWS = 32       # box rows a TMA box: 8 KB
ROW_BUFFERS = 2     # rows an SM's shared memory holds at once (two programs of one, or one of two)
SMEM_BUDGET = 220 * 1024  # of the H100/H200's 227 KB a block may have (the rest: barriers, reductions)


def boxes_per_row(Vp: int) -> int:
    return triton.cdiv(Vp // BOX_COLS, BOX_ROWS)


def tma_classifier_usable(logits: torch.Tensor) -> bool:
    """Whether _fc_tma_kernel serves these logits (else the two-pass kernel does): Gluon there, an sm_90
    GPU, bf16, contiguous, Vp a multiple of 128 (the 3-D view), 16-byte aligned, and two rows' buffers
    within the shared memory a block may have (Vp <= 53248 at 32-row boxes: GPT-2's 50304 fits)."""
    if not (GLUON and logits.is_cuda and logits.dtype == torch.bfloat16 and logits.is_contiguous()):
        return False
    Vp = logits.shape[-1]
    if Vp % BOX_COLS or logits.data_ptr() % 16:
        return False
    if ROW_BUFFERS * boxes_per_row(Vp) * BOX_ROWS * BOX_COLS * logits.element_size() > SMEM_BUDGET:
        return False
    return torch.cuda.get_device_capability(logits.device)[0] == 9


if GLUON:
    @gluon.jit
    def _fc_tma_row_load(x_desc, bufs, bars, slot, row, NBOX: gl.constexpr, BOX_R: gl.constexpr):
        """All NBOX boxes of logits row `row` into buffer `slot`, counted on that buffer's barrier."""
        bar = bars.index(slot)
        mbarrier.expect(bar, NBOX * x_desc.block_type.nbytes)
        for k in gl.static_range(NBOX):
            tma_load(x_desc, [row, k * BOX_R, 0], bar, bufs.index(slot * NBOX + k))

    @gluon.jit
    def _max_pairs(a, b):
        """Elementwise max of two bf16 tensors, two lanes an instruction (Triton would widen both to fp32
        first). Exact, and like max.f32 it returns the other operand where one is NaN."""
        return gl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=a.dtype,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _fc_tma_kernel(x_desc, logits_ptr, losses_ptr, targets_ptr, dloss, V, Vp, n_rows,
                       NBOX: gl.constexpr, NFULL: gl.constexpr, BOX_R: gl.constexpr, BOX_C: gl.constexpr,
                       NUM_WARPS: gl.constexpr, BUFFERS: gl.constexpr, WRITE_DLOGITS: gl.constexpr):
        """Persistent: program p takes rows p, p + grid, ...; with BUFFERS = 2 the next row loads into the
        other buffer while this one is reduced, with BUFFERS = 1 the SM's other program's row does.
        NFULL = V // box (a constant of the launch): the boxes wholly below V, read without masks, so that
        only the boxes from NFULL on are compiled with them (with a run-time test against V instead, ptxas
        built both paths of every box and computed all their masks up front: 4096 SASS instructions against
        2559, and 0.2 % slower, bench/RESULTS.md run AM)."""
        LOG2E: gl.constexpr = 1.4426950408889634
        LN2: gl.constexpr = 0.6931471805599453
        BOX: gl.constexpr = BOX_R * BOX_C
        # a box [1, BOX_R, BOX_C]: 8 contiguous logits (16 bytes) a thread, 16 threads along a box row
        lay: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [1, NUM_WARPS, 1], [2, 1, 0])
        r = gl.arange(0, BOX_R, layout=gl.SliceLayout(0, gl.SliceLayout(2, lay)))
        c = gl.arange(0, BOX_C, layout=gl.SliceLayout(0, gl.SliceLayout(1, lay)))
        in_box = gl.expand_dims(gl.expand_dims(r, 0), 2) * BOX_C + gl.expand_dims(gl.expand_dims(c, 0), 1)

        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        n_mine = (n_rows - pid + grid - 1) // grid
        bufs = gl.allocate_shared_memory(x_desc.dtype, [BUFFERS * NBOX] + x_desc.block_type.shape, x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(BUFFERS):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
        for b in gl.static_range(BUFFERS):
            if b < n_mine:
                _fc_tma_row_load(x_desc, bufs, bars, b, pid + b * grid, NBOX, BOX_R)

        for it in range(n_mine):
            slot = it % BUFFERS
            row = (pid + it * grid).to(gl.int64)
            base = logits_ptr + row * Vp  # B*T*Vp exceeds 2^31 at GPT-2 sizes: 64-bit row offset
            target = gl.load(targets_ptr + row).to(gl.int32)
            xt = gl.load(base + target).to(gl.float32)  # read before any write to the row (pass 3)
            mbarrier.wait(bars.index(slot), (it // BUFFERS) & 1)

            # pass 1: the row's max; columns >= V (and the zeros TMA filled in past Vp) masked only in the
            # boxes that reach V
            # in the storage dtype (exact; two bf16 a max instruction), widened once at the end
            m = gl.full([1, BOX_R, BOX_C], -1.0e30, x_desc.dtype, lay)
            for k in gl.static_range(NBOX):
                x = bufs.index(slot * NBOX + k).load(lay)
                if k < NFULL:
                    m = _max_pairs(m, x)
                else:
                    m = _max_pairs(m, gl.where(k * BOX + in_box < V, x, -1.0e30).to(x.dtype))
            mx = gl.max(gl.max(gl.max(m.to(gl.float32), axis=2), axis=1), axis=0)
            # the barriers after passes 1 and 2 keep the compiler from merging the passes' shared-memory
            # reads and holding the row in registers (128 registers a thread, one program an SM)
            cta_barrier()
            # pass 2: sum of exp2(x * log2e - max * log2e); the cross-warp reductions are barriers between
            # every thread's read of xt and pass 3's writes
            mL = mx * LOG2E
            total = gl.zeros([1, BOX_R, BOX_C], gl.float32, lay)
            for k in gl.static_range(NBOX):
                x = bufs.index(slot * NBOX + k).load(lay).to(gl.float32)
                if k < NFULL:
                    total += gl.exp2(x * LOG2E - mL)
                else:
                    total += gl.where(k * BOX + in_box < V, gl.exp2(x * LOG2E - mL), 0.0)
            lse2 = mL + gl.log2(gl.sum(gl.sum(gl.sum(total, axis=2), axis=1), axis=0))
            gl.store(losses_ptr + row, lse2 * LN2 - xt)
            cta_barrier()

            if WRITE_DLOGITS:
                # pass 3: p * dloss, minus dloss at the target (only in its box), 0 in [V, Vp), written
                # once to HBM
                for k in gl.static_range(NBOX):
                    x = bufs.index(slot * NBOX + k).load(lay).to(gl.float32)
                    cols = k * BOX + in_box
                    g = gl.exp2(x * LOG2E - lse2) * dloss
                    if (target >= k * BOX) & (target < (k + 1) * BOX):
                        g = gl.where(cols == target, g - dloss, g)
                    if k < NFULL:
                        gl.store(base + cols, g.to(logits_ptr.dtype.element_ty))
                    else:
                        g = gl.where(cols < V, g, 0.0)
                        gl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < Vp)

            # every warp is done with this buffer: it takes the row BUFFERS turns on
            cta_barrier()
            if it + BUFFERS < n_mine:
                fence_async_shared()
                _fc_tma_row_load(x_desc, bufs, bars, slot, pid + (it + BUFFERS) * grid, NBOX, BOX_R)

        for b in gl.static_range(BUFFERS):
            mbarrier.invalidate(bars.index(b))


@functools.lru_cache(maxsize=None)
def _box_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


def fused_classifier_tma(logits: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor, dloss: float, V: int,
                         write_dlogits: bool, sm_count: int, num_warps: int = 16, buffers: int = 2) -> None:
    """fused_classifier's "tma" variant; the caller has checked shapes, dtypes and tma_classifier_usable.
    sm_count: the GPU's SMs (the grid is persistent). num_warps: 16 (a warp covers two box rows, 16 the 32
    of a box; with fewer, ptxas holds several box rows' loads at once and needs 255 registers a thread).
    buffers: rows a program holds, 2 (one program
    an SM, the next row loading into the other buffer) or 1 (two programs an SM at 64 registers, each
    loading its next row after it has written this one)."""
    assert num_warps == 16, f"tma classifier: num_warps {num_warps}, only 16 is served"
    assert buffers in (1, 2), f"tma classifier: buffers {buffers} not in (1, 2)"
    Vp = logits.shape[-1]
    rows = logits.numel() // Vp
    view = logits.view(rows, Vp // BOX_COLS, BOX_COLS)
    x_desc = GluonTensorDescriptor.from_tensor(view, [1, BOX_ROWS, BOX_COLS], _box_layout())
    grid = min(rows, ROW_BUFFERS // buffers * sm_count)  # the SM's shared memory holds 2 rows
    _fc_tma_kernel[(grid,)](
        x_desc, logits, losses, targets, float(dloss), V, Vp, rows, NBOX=boxes_per_row(Vp),
        NFULL=V // (BOX_ROWS * BOX_COLS), BOX_R=BOX_ROWS, BOX_C=BOX_COLS, NUM_WARPS=num_warps, BUFFERS=buffers,
        WRITE_DLOGITS=bool(write_dlogits), num_warps=num_warps,
        **register_cap(64 if buffers == 1 else None))  # two programs of 512 threads an SM
