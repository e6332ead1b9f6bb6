"""Softmax + cross-entropy + logit gradient, fused as llm.c's fused_classifier_kernel5.

Per row (b, t) of the (B*T, Vp) logits: loss = logsumexp(logits[:V]) - logits[target], and in training
the logits are overwritten IN PLACE by the gradient (softmax - onehot(target)) * dloss, with zeros in the
padding columns [V, Vp). No row is split across programs that could race on it: a row's logits are read
(all of them, and the target's logit) before the same program - or, in "split", the next kernel - writes.

At GPT-2 sizes a row is 50304 bf16 = 100 KB, and the kernel is bound by memory traffic AND by the exp
unit (MUFU: 16 exp2 a clock an SM, an eighth of the FP32 rate), so the variants differ in how often they
touch HBM and how many exp and other instructions they spend per element:

- "twopass" (default): one program per row (or a persistent grid of progs_per_sm programs per SM walking
  the rows, which keeps the L2 working set at ~100 KB a program so that the second read of a row hits
  L2). Pass 1 is an online softmax over [BLOCK / TILE, TILE] tiles: one max and one rescale per TILE
  elements (TILE values sit in one thread, so the tile max costs no shuffles), then one exp per element.
  The full blocks run without masks; only the tail block is masked. Pass 2 writes exp(x - lse) * dloss;
  only the block that holds the target subtracts dloss (a branch uniform over the program). ~7 SASS
  instructions an element a pass (the first version, "legacy": ~15 in pass 1, ~12 in pass 2).
- "onepass": the whole row held in registers by one program (16 or 32 warps), so HBM is read once and
  written once, with one exp an element. The row is cut into at most 4 power-of-two chunks that add up to
  Vp (50304 = 32768 + 16384 + 1024 + 128), so no register holds padding; each chunk is an [R, S] tile
  with one 16-byte vector a thread per tile row, whose pointers the compiler turns into immediate
  offsets from one base (a 1-D chunk costs a live 64-bit address a load). exact=False: one block of
  next_pow2(Vp), 30 % of it padding (spills). All loads are issued before the first reduction (a
  barrier), so the whole row is in flight at once. keep chooses what stays in registers between the max
  and the gradient: "p" the fp32 probabilities (one exp an element, 98 registers a thread at 16 warps),
  "pl" the probabilities rounded to the storage dtype, "x" the logits (two exps), "pw" / "xw" the same
  as pl / x packed two bf16 to an int32 word (the compiler gives every bf16 value a register of its own).
  Holding 100 KB, a program fills an SM's register file: progs_per_sm=1 makes the grid persistent, and
  prefetch=True then asks L2 for the program's next row while it reduces this one.
- "split": two kernels with full parallelism, (row, chunk) programs: partial (max, sum) per chunk into a
  scratch buffer, then each program combines its row's partials in a fixed order (deterministic, no
  atomics) and writes the gradient of its chunk. Reads the logits twice from HBM.
- "legacy": the first version (per-lane online softmax, 1-exp trick, masks everywhere), for comparison.
- "tma": the row staged in shared memory by the TMA unit, read from HBM once, the next row on its way
  while this one is reduced (fused_classifier_tma.py: Gluon, sm_90 and bf16 only; elsewhere the two-pass
  kernel with FALLBACK_CONFIG runs).

Everything is fp32 in registers; exp is exp2 of log2(e)-scaled logits, and the log-sum-exp form keeps the
loss finite where the target's probability underflows. Loads are masked at Vp (a multiple of 16: they
stay vectorised) and the columns [V, Vp) are set to -inf in registers. Launchers only launch (no host
sync; "split" allocates its scratch unless one is passed), so they can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fused_classifier_tma import fused_classifier_tma, tma_classifier_usable

# Per mode, the variant and its knobs; knobs left out come from KNOB_DEFAULTS[variant].
# bench_fused_classifier sweeps the alternatives on the GPU: copy the winner here.
# "tma" with one row buffer a program (two programs an SM): 0.454 ms a chunk of 8192 rows against 0.502 for
# the two-pass kernel, and 0.9 ms off the whole step (bench/RESULTS.md, run AA); where its Gluon kernel
# does not serve (the CPU, fp32, other GPUs), FALLBACK_CONFIG's two-pass kernel runs.
TRAIN_CONFIG = {"variant": "tma", "num_warps": 16, "buffers": 1}
# Validation runs the training configuration without the gradient pass: the same blocks, tiles and warps
# give the same reduction order, so a batch's validation losses are bitwise its training losses (with
# 4096 / 4 warps, faster alone, they differed in the last bit for some rows on the H200).
VAL_CONFIG = dict(TRAIN_CONFIG)
# What the "tma" variant falls back to where its kernel does not serve (the model's configuration before
# it); knobs a caller passes for the two-pass kernel (block_size, tile...) still apply there.
FALLBACK_CONFIG = {"variant": "twopass", "block_size": 8192, "num_warps": 16, "stages": 1, "tile": 8, "progs_per_sm": 0}
KNOB_DEFAULTS = {
    "legacy": {"block_size": 2048, "num_warps": 8, "stages": 1},
    "twopass": {"block_size": 4096, "num_warps": 16, "stages": 1, "tile": 8, "progs_per_sm": 0},
    "onepass": {"num_warps": 16, "keep": "p", "exact": True, "progs_per_sm": 0, "prefetch": True},
    "split": {"block_size": 4096, "num_warps": 8},
    "tma": {"num_warps": 16, "buffers": 2},
}
KEEP_MODES = {"p": 0, "x": 1, "pl": 2, "pw": 0, "xw": 1}  # pw / xw: the packed-words kernel
_MAX_CHUNKS = 4  # onepass: chunks a row is cut into (the kernel has that many slots)


# ----------------------------------------------------------------------------------------------------
# kernels: "legacy"

@triton.jit
def _fc_legacy_kernel(logits_ptr, losses_ptr, targets_ptr, dloss, V, Vp,
                      BLOCK: tl.constexpr, WRITE_DLOGITS: tl.constexpr, STAGES: tl.constexpr):
    """Per-lane online max/sum (one exp an element: e = exp(-|x - m|), s = s*e + 1 or s + e), target
    picked up in pass 1, every load masked; pass 2 re-reads the row and writes the gradient."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * Vp  # B*T*Vp exceeds 2^31 at GPT-2 sizes: 64-bit row offset
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row).to(tl.int32)
    m = tl.full([BLOCK], -3.0e38, dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    xt = 0.0
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        c = start + cols
        x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = tl.where(c < V, x, float("-inf"))
        if (target >= start) & (target < start + BLOCK):
            xt += tl.sum(tl.where(c == target, x, 0.0), axis=0)
        x2 = x * LOG2E
        e = tl.exp2(tl.minimum(x2, m) - tl.maximum(x2, m))
        s = tl.where(x2 > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x2)
    mx = tl.max(m, axis=0)
    lse2 = mx + tl.log2(tl.sum(s * tl.exp2(m - mx), axis=0))
    tl.store(losses_ptr + row, lse2 * LN2 - xt)
    if WRITE_DLOGITS:
        for start in tl.range(0, Vp, BLOCK, num_stages=STAGES):
            c = start + cols
            x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = (tl.exp2(x * LOG2E - lse2) - tl.where(c == target, 1.0, 0.0)) * dloss
            g = tl.where(c < V, g, 0.0)
            tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < Vp)


# ----------------------------------------------------------------------------------------------------
# kernels: "twopass"

@triton.jit
def _tile_update(x, m, s):
    """Online softmax over a [R, TILE] tile of fp32 logits (-inf where masked) into the per-tile-row
    running max m and sum s (sum of exp(x - m)): one rescale per TILE elements, one exp an element.
    m starts at -1e30, not -inf, so a tile row of padding only gives exp2(-inf) = 0, never inf - inf."""
    LOG2E: tl.constexpr = 1.4426950408889634
    m_new = tl.maximum(m, tl.max(x, axis=1))
    mL = m_new * LOG2E
    s = s * tl.exp2(m * LOG2E - mL) + tl.sum(tl.exp2(x * LOG2E - mL[:, None]), axis=1)
    return m_new, s


@triton.jit
def _fc_twopass_kernel(logits_ptr, losses_ptr, targets_ptr, dloss, V, Vp, n_rows,
                       BLOCK: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr,
                       WRITE_DLOGITS: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    R: tl.constexpr = BLOCK // TILE
    tile = tl.arange(0, R)[:, None] * TILE + tl.arange(0, TILE)[None, :]  # TILE contiguous values a thread
    cols = tl.arange(0, BLOCK)
    v_full = (V // BLOCK) * BLOCK  # [0, v_full): whole blocks of real columns, no masks needed
    # grid = rows: one row a program; smaller grid: persistent programs, row += grid
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)  # (the interpreter iterates Python ints)
        base = logits_ptr + row64 * Vp  # B*T*Vp exceeds 2^31 at GPT-2 sizes: 64-bit row offset
        target = tl.load(targets_ptr + row64).to(tl.int32)
        xt = tl.load(base + target).to(tl.float32)  # before any write to the row (see pass 2)

        # pass 1: keep the row in L2 for pass 2 (evict_last)
        m = tl.full([R], -1.0e30, dtype=tl.float32)
        s = tl.zeros([R], dtype=tl.float32)
        for start in tl.range(0, v_full, BLOCK, num_stages=STAGES):
            x = tl.load(base + start + tile, eviction_policy="evict_last").to(tl.float32)
            m, s = _tile_update(x, m, s)
        for start in tl.range(v_full, Vp, BLOCK, num_stages=1):
            c = start + tile
            x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_last").to(tl.float32)
            m, s = _tile_update(tl.where(c < V, x, float("-inf")), m, s)
        mx = tl.max(m, axis=0)
        # log2-sum-exp2; the cross-warp reductions here put a barrier between every thread's read of the
        # row (xt included) and pass 2's writes
        lse2 = mx * LOG2E + tl.log2(tl.sum(s * tl.exp2((m - mx) * LOG2E), axis=0))
        tl.store(losses_ptr + row64, lse2 * LN2 - xt)

        if WRITE_DLOGITS:
            # pass 2: p * dloss = exp2(x*log2e - lse2) * dloss, minus dloss at the target
            for start in tl.range(0, v_full, BLOCK, num_stages=STAGES):
                c = start + cols
                x = tl.load(base + c, eviction_policy="evict_first").to(tl.float32)
                g = tl.exp2(x * LOG2E - lse2) * dloss
                if (target >= start) & (target < start + BLOCK):  # uniform over the program
                    g -= tl.where(c == target, dloss, 0.0)
                tl.store(base + c, g.to(logits_ptr.dtype.element_ty))
            for start in tl.range(v_full, Vp, BLOCK, num_stages=1):
                c = start + cols
                x = tl.load(base + c, mask=c < Vp, other=0.0, eviction_policy="evict_first").to(tl.float32)
                g = (tl.exp2(x * LOG2E - lse2) - tl.where(c == target, 1.0, 0.0)) * dloss
                tl.store(base + c, tl.where(c < V, g, 0.0).to(logits_ptr.dtype.element_ty), mask=c < Vp)


# ----------------------------------------------------------------------------------------------------
# kernels: "onepass" (the row in registers; chunk k is an [R_k, S_k] tile at column O_k, R_k = 0: none)

@triton.jit
def _op_load(base, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, V, Vp):
    """Chunk [O, O + R*S) of the row as an [R, S] tile in its storage dtype; the pointers are built as
    (base + O + r*S) + s so that the compiler folds the r*S into immediate load offsets instead of keeping
    one 64-bit address a load alive. EDGE (the chunk reaches past V): vector loads masked at Vp, and
    -inf in [V, Vp) so that those columns drop out of max and sum (their p is 0)."""
    rows = base + O + tl.arange(0, R)[:, None] * S
    if EDGE:
        c = O + tl.arange(0, R)[:, None] * S + tl.arange(0, S)[None, :]
        x = tl.load(rows + tl.arange(0, S)[None, :], mask=c < Vp, other=float("-inf"))
        # where() in fp32: triton 3.8's interpreter cannot make a bf16 scalar (the same bits either way)
        x = tl.where(c < V, x.to(tl.float32), float("-inf")).to(base.dtype.element_ty)
    else:
        x = tl.load(rows + tl.arange(0, S)[None, :])
    return x


@triton.jit
def _tile_max(x):
    """Max of an [R, S] tile: over R first (in-thread), then one cross-thread reduction."""
    return tl.max(tl.max(x, axis=0), axis=0).to(tl.float32)


@triton.jit
def _widen(x):
    """bf16 -> fp32 written as bit operations, so that the compiler does not merge it with the
    conversion done for the sum and keep a fp32 copy of the row alive (keep="x")."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _op_store(base, g, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, Vp, target, dloss):
    """Write the [R, S] chunk at O of the gradient g (fp32, already 0 in [V, Vp)); subtract dloss at the
    target only in the chunk that holds it (the branch is the same for the whole program)."""
    rows = base + O + tl.arange(0, R)[:, None] * S
    c = O + tl.arange(0, R)[:, None] * S + tl.arange(0, S)[None, :]
    if (target >= O) & (target < O + R * S):
        g -= tl.where(c == target, dloss, 0.0)
    if EDGE:
        tl.store(rows + tl.arange(0, S)[None, :], g.to(base.dtype.element_ty), mask=c < Vp)
    else:
        tl.store(rows + tl.arange(0, S)[None, :], g.to(base.dtype.element_ty))


@triton.jit
def _op_exp_sum(x, mL, total, KEEP: tl.constexpr):
    """exp2(x*log2e - mL) of a chunk, added to total; returns what keep mode KEEP holds in registers."""
    LOG2E: tl.constexpr = 1.4426950408889634
    p = tl.exp2(x.to(tl.float32) * LOG2E - mL)
    total += tl.sum(tl.sum(p, axis=0), axis=0)
    if KEEP == 0:
        kept = p
    elif KEEP == 2:
        kept = p.to(x.dtype)
    else:
        kept = x
    return kept, total


@triton.jit
def _op_grad(kept, scale, lse2, dloss, KEEP: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    if KEEP == 1:
        g = tl.exp2(_widen(kept) * LOG2E - lse2) * dloss
    else:
        g = kept.to(tl.float32) * scale
    return g


@triton.jit
def _prefetch_row_l2(row_ptr, Vp, LINES: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for a row (one prefetch a 128-byte line; GPU only: inline PTX, no register is written)."""
    offs = tl.minimum(tl.arange(0, LINES) * LINE, Vp - 1)  # the lines past the row repeat the last one
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [row_ptr + offs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fc_onepass_kernel(logits_ptr, losses_ptr, targets_ptr, dloss, V, Vp, n_rows,
                       R0: tl.constexpr, S0: tl.constexpr, R1: tl.constexpr, S1: tl.constexpr,
                       R2: tl.constexpr, S2: tl.constexpr, R3: tl.constexpr, S3: tl.constexpr,
                       E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                       KEEP: tl.constexpr, WRITE_DLOGITS: tl.constexpr, PREFETCH: tl.constexpr,
                       LINES: tl.constexpr, LINE: tl.constexpr):
    """Chunk k: an [R_k, S_k] tile at O_k = sum of the previous R*S (R_k = 0: no chunk). grid = rows: one
    row a program; smaller grid: persistent programs, and with PREFETCH each asks L2 for its next row
    while it works on this one (the SM holds one such program: without it, the SM's memory pipe idles
    while the row is reduced)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    O1: tl.constexpr = R0 * S0
    O2: tl.constexpr = O1 + R1 * S1
    O3: tl.constexpr = O2 + R2 * S2
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)  # (the interpreter iterates Python ints)
        base = logits_ptr + row64 * Vp
        target = tl.load(targets_ptr + row64).to(tl.int32)
        xt = tl.load(base + target).to(tl.float32)  # before any write (the reductions below are barriers)

        # all loads first, so that the whole row is in flight at once (a reduction is a barrier)
        x0 = _op_load(base, 0, R0, S0, E0, V, Vp)
        if R1 > 0:
            x1 = _op_load(base, O1, R1, S1, E1, V, Vp)
        if R2 > 0:
            x2 = _op_load(base, O2, R2, S2, E2, V, Vp)
        if R3 > 0:
            x3 = _op_load(base, O3, R3, S3, E3, V, Vp)
        if PREFETCH:
            nxt = row + tl.num_programs(0)
            if nxt < n_rows:
                _prefetch_row_l2(logits_ptr + tl.cast(nxt, tl.int64) * Vp, Vp, LINES, LINE)
        mx = _tile_max(x0)
        if R1 > 0:
            mx = tl.maximum(mx, _tile_max(x1))
        if R2 > 0:
            mx = tl.maximum(mx, _tile_max(x2))
        if R3 > 0:
            mx = tl.maximum(mx, _tile_max(x3))

        # sum of exp, from registers
        mL = mx * LOG2E
        k0, total = _op_exp_sum(x0, mL, 0.0, KEEP)
        if R1 > 0:
            k1, total = _op_exp_sum(x1, mL, total, KEEP)
        if R2 > 0:
            k2, total = _op_exp_sum(x2, mL, total, KEEP)
        if R3 > 0:
            k3, total = _op_exp_sum(x3, mL, total, KEEP)
        lse2 = mL + tl.log2(total)
        tl.store(losses_ptr + row64, lse2 * LN2 - xt)

        # gradient from registers, written once
        if WRITE_DLOGITS:
            scale = dloss / total
            _op_store(base, _op_grad(k0, scale, lse2, dloss, KEEP), 0, R0, S0, E0, Vp, target, dloss)
            if R1 > 0:
                _op_store(base, _op_grad(k1, scale, lse2, dloss, KEEP), O1, R1, S1, E1, Vp, target, dloss)
            if R2 > 0:
                _op_store(base, _op_grad(k2, scale, lse2, dloss, KEEP), O2, R2, S2, E2, Vp, target, dloss)
            if R3 > 0:
                _op_store(base, _op_grad(k3, scale, lse2, dloss, KEEP), O3, R3, S3, E3, Vp, target, dloss)


# ----------------------------------------------------------------------------------------------------
# kernels: "onepass" on packed words (bf16 only). The compiler gives every bf16 value a 32-bit register of
# its own; loading the row as int32 words (two bf16 logits each) and keeping words halves the registers.
# The words are unpacked into fp32 once per phase, and the compiler must not merge the phases' unpacking
# (or move it ahead of the barrier of the previous phase's reduction) and keep fp32 copies alive: each
# phase XORs the words with a zero computed from the previous reduction's result (x != x: 0 unless NaN).

@triton.jit
def _w_load(wbase, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, Wp):
    rows = wbase + O + tl.arange(0, R)[:, None] * S
    if EDGE:
        c = O + tl.arange(0, R)[:, None] * S + tl.arange(0, S)[None, :]
        w = tl.load(rows + tl.arange(0, S)[None, :], mask=c < Wp, other=0)
    else:
        w = tl.load(rows + tl.arange(0, S)[None, :])
    return w


@triton.jit
def _w_unpack(w, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, V):
    """The two bf16 logits of each word (little endian: the low half is the even column) as fp32,
    -inf in the columns >= V."""
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    if EDGE:
        c2 = 2 * (O + tl.arange(0, R)[:, None] * S + tl.arange(0, S)[None, :])
        lo = tl.where(c2 < V, lo, float("-inf"))
        hi = tl.where(c2 + 1 < V, hi, float("-inf"))
    return lo, hi


@triton.jit
def _w_pack(lo, hi):
    """Two fp32 tensors rounded to nearest-even bf16 and packed into int32 words (integer arithmetic:
    the same result on the GPU and in the interpreter; finite values only)."""
    b_lo = lo.to(tl.int32, bitcast=True)
    b_hi = hi.to(tl.int32, bitcast=True)
    r_lo = b_lo + 0x7FFF + ((b_lo >> 16) & 1)
    r_hi = b_hi + 0x7FFF + ((b_hi >> 16) & 1)
    return (r_hi & -65536) | ((r_lo >> 16) & 0xFFFF)


@triton.jit
def _w_max(w, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, V):
    lo, hi = _w_unpack(w, O, R, S, EDGE, V)
    return tl.max(tl.max(tl.maximum(lo, hi), axis=0), axis=0)


@triton.jit
def _w_exp_sum(w, wz, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr, V, mL, total,
               KEEP: tl.constexpr):
    """Sum of exp2 over a chunk of words (unpacked from wz = w ^ zero); keeps the probabilities packed
    (KEEP 0) or the words themselves (KEEP 1)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    lo, hi = _w_unpack(wz, O, R, S, EDGE, V)
    p_lo = tl.exp2(lo * LOG2E - mL)
    p_hi = tl.exp2(hi * LOG2E - mL)
    total += tl.sum(tl.sum(p_lo + p_hi, axis=0), axis=0)
    if KEEP == 0:
        kept = _w_pack(p_lo, p_hi)
    else:
        kept = w
    return kept, total


@triton.jit
def _w_grad_store(wbase, kept, zero, O: tl.constexpr, R: tl.constexpr, S: tl.constexpr, EDGE: tl.constexpr,
                  V, Wp, scale, lse2, dloss, target, KEEP: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    if KEEP == 0:  # packed p, 0 in the padding already
        p_lo = (kept << 16).to(tl.float32, bitcast=True)
        p_hi = (kept & -65536).to(tl.float32, bitcast=True)
        g_lo = p_lo * scale
        g_hi = p_hi * scale
    else:  # the logits' words again: second exp
        lo, hi = _w_unpack(kept ^ zero, O, R, S, EDGE, V)
        g_lo = tl.exp2(lo * LOG2E - lse2) * dloss
        g_hi = tl.exp2(hi * LOG2E - lse2) * dloss
    c = O + tl.arange(0, R)[:, None] * S + tl.arange(0, S)[None, :]
    if (target >= 2 * O) & (target < 2 * (O + R * S)):  # uniform over the program
        g_lo -= tl.where(2 * c == target, dloss, 0.0)
        g_hi -= tl.where(2 * c + 1 == target, dloss, 0.0)
    rows = wbase + O + tl.arange(0, R)[:, None] * S
    if EDGE:
        tl.store(rows + tl.arange(0, S)[None, :], _w_pack(g_lo, g_hi), mask=c < Wp)
    else:
        tl.store(rows + tl.arange(0, S)[None, :], _w_pack(g_lo, g_hi))


@triton.jit
def _fc_onepass_words_kernel(logits_ptr, words_ptr, losses_ptr, targets_ptr, dloss, V, Wp,
                             R0: tl.constexpr, S0: tl.constexpr, R1: tl.constexpr, S1: tl.constexpr,
                             R2: tl.constexpr, S2: tl.constexpr, R3: tl.constexpr, S3: tl.constexpr,
                             E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                             KEEP: tl.constexpr, WRITE_DLOGITS: tl.constexpr):
    """As _fc_onepass_kernel on the row's Wp = Vp / 2 words; KEEP 0 ("pw"): p packed as bf16 pairs (one
    exp an element), 1 ("xw"): the words of logits (two exps)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    O1: tl.constexpr = R0 * S0
    O2: tl.constexpr = O1 + R1 * S1
    O3: tl.constexpr = O2 + R2 * S2
    row = tl.program_id(0).to(tl.int64)
    wbase = words_ptr + row * Wp
    target = tl.load(targets_ptr + row).to(tl.int32)
    xt = tl.load(logits_ptr + row * (2 * Wp) + target).to(tl.float32)

    w0 = _w_load(wbase, 0, R0, S0, E0, Wp)
    if R1 > 0:
        w1 = _w_load(wbase, O1, R1, S1, E1, Wp)
    if R2 > 0:
        w2 = _w_load(wbase, O2, R2, S2, E2, Wp)
    if R3 > 0:
        w3 = _w_load(wbase, O3, R3, S3, E3, Wp)
    mx = _w_max(w0, 0, R0, S0, E0, V)
    if R1 > 0:
        mx = tl.maximum(mx, _w_max(w1, O1, R1, S1, E1, V))
    if R2 > 0:
        mx = tl.maximum(mx, _w_max(w2, O2, R2, S2, E2, V))
    if R3 > 0:
        mx = tl.maximum(mx, _w_max(w3, O3, R3, S3, E3, V))

    mL = mx * LOG2E
    zero0 = (mx != mx).to(tl.int32)
    k0, total = _w_exp_sum(w0, w0 ^ zero0, 0, R0, S0, E0, V, mL, 0.0, KEEP)
    if R1 > 0:
        k1, total = _w_exp_sum(w1, w1 ^ zero0, O1, R1, S1, E1, V, mL, total, KEEP)
    if R2 > 0:
        k2, total = _w_exp_sum(w2, w2 ^ zero0, O2, R2, S2, E2, V, mL, total, KEEP)
    if R3 > 0:
        k3, total = _w_exp_sum(w3, w3 ^ zero0, O3, R3, S3, E3, V, mL, total, KEEP)
    lse2 = mL + tl.log2(total)
    tl.store(losses_ptr + row, lse2 * LN2 - xt)

    if WRITE_DLOGITS:
        scale = dloss / total
        zero1 = (total != total).to(tl.int32)
        _w_grad_store(wbase, k0, zero1, 0, R0, S0, E0, V, Wp, scale, lse2, dloss, target, KEEP)
        if R1 > 0:
            _w_grad_store(wbase, k1, zero1, O1, R1, S1, E1, V, Wp, scale, lse2, dloss, target, KEEP)
        if R2 > 0:
            _w_grad_store(wbase, k2, zero1, O2, R2, S2, E2, V, Wp, scale, lse2, dloss, target, KEEP)
        if R3 > 0:
            _w_grad_store(wbase, k3, zero1, O3, R3, S3, E3, V, Wp, scale, lse2, dloss, target, KEEP)


# ----------------------------------------------------------------------------------------------------
# kernels: "split" (program (row, j) owns columns [j*BLOCK, (j+1)*BLOCK) of the row)

@triton.jit
def _fc_split_partial_kernel(logits_ptr, targets_ptr, part_ptr, xt_ptr, V, Vp, NC, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of one chunk into part[row, j]; chunk 0 also saves the target's logit,
    which the second kernel may overwrite before it needs it."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    base = logits_ptr + row * Vp
    c = j * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(base + c, mask=c < Vp, other=0.0).to(tl.float32)
    x = tl.where(c < V, x, float("-inf"))
    m = tl.maximum(tl.max(x, axis=0), -1.0e30)  # a chunk of padding only: s = 0, no inf - inf
    s = tl.sum(tl.exp2((x - m) * LOG2E), axis=0)
    tl.store(part_ptr + (row * NC + j) * 2, m)
    tl.store(part_ptr + (row * NC + j) * 2 + 1, s)
    if j == 0:
        target = tl.load(targets_ptr + row)
        tl.store(xt_ptr + row, tl.load(base + target).to(tl.float32))


@triton.jit
def _fc_split_apply_kernel(logits_ptr, losses_ptr, targets_ptr, part_ptr, xt_ptr, dloss, V, Vp, NC,
                           BLOCK: tl.constexpr, NCP: tl.constexpr, WRITE_DLOGITS: tl.constexpr):
    """Combine the row's NC partials in a fixed order (every program of the row gets the same lse),
    write the loss (chunk 0) and the gradient of this program's chunk."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    k = tl.arange(0, NCP)
    pm = tl.load(part_ptr + (row * NC + k) * 2, mask=k < NC, other=-1.0e30)
    ps = tl.load(part_ptr + (row * NC + k) * 2 + 1, mask=k < NC, other=0.0)
    mx = tl.max(pm, axis=0)
    lse2 = mx * LOG2E + tl.log2(tl.sum(ps * tl.exp2((pm - mx) * LOG2E), axis=0))
    if j == 0:
        tl.store(losses_ptr + row, lse2 * LN2 - tl.load(xt_ptr + row))
    if WRITE_DLOGITS:
        base = logits_ptr + row * Vp
        target = tl.load(targets_ptr + row).to(tl.int32)
        c = j * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < Vp, other=0.0).to(tl.float32)
        g = (tl.exp2(x * LOG2E - lse2) - tl.where(c == target, 1.0, 0.0)) * dloss
        tl.store(base + c, tl.where(c < V, g, 0.0).to(logits_ptr.dtype.element_ty), mask=c < Vp)


# ----------------------------------------------------------------------------------------------------
# launcher helpers

@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(t: torch.Tensor) -> int:
    """SMs of t's GPU (cached: no host sync after the first call); 4 under the interpreter, so that the
    CPU tests run persistent programs over several rows."""
    if t.device.type != "cuda":
        return 4
    return _cuda_sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


def row_chunks(Vp: int, exact: bool = True, granule: int = 16) -> list[int]:
    """Power-of-two chunk sizes (at most 4, padded with 0) covering [0, Vp) for the onepass kernel.

    exact: the binary digits of Vp rounded up to the granule (50304 -> 32768 16384 1024 128), the last
    rounded up to a power of two when there are more than 4; else one block of next_pow2(Vp)."""
    if not exact:
        parts = [triton.next_power_of_2(Vp)]
    else:
        rem, parts = triton.cdiv(Vp, granule) * granule, []
        while rem and len(parts) < _MAX_CHUNKS - 1:
            parts.append(1 << (rem.bit_length() - 1))
            rem -= parts[-1]
        if rem:
            parts.append(triton.next_power_of_2(rem))
    return parts + [0] * (_MAX_CHUNKS - len(parts))


def onepass_tiles(Vp: int, V: int, elem_size: int, num_warps: int, exact: bool = True) -> dict:
    """The onepass kernel's constexprs: chunk k of row_chunks as an [R_k, S_k] tile, S_k at most one
    16-byte vector a thread (the R_k rows then sit in each thread), E_k: the chunk reaches past V."""
    per_pass = 32 * num_warps * max(1, 16 // elem_size)
    shape, off = {}, 0
    for i, n in enumerate(row_chunks(Vp, exact)):
        S = min(n, per_pass) if n else 1
        shape.update({f"R{i}": n // S, f"S{i}": S, f"E{i}": bool(n) and off + n > V})
        off += n
    return shape


def split_scratch_numel(rows: int, Vp: int, block_size: int) -> int:
    """fp32 elements of the "split" variant's scratch: (max, sum) per (row, chunk) and the target logits."""
    return rows * (2 * triton.cdiv(Vp, block_size) + 1)


def _knobs(write_dlogits: bool, given: dict, mode: dict | None = None) -> dict:
    """The launch's knobs: those given, then the mode's (TRAIN_CONFIG / VAL_CONFIG) where the variant is
    the mode's, then the variant's KNOB_DEFAULTS."""
    mode = mode or (TRAIN_CONFIG if write_dlogits else VAL_CONFIG)
    variant = given.get("variant") or mode["variant"]
    assert variant in KNOB_DEFAULTS, f"unknown variant {variant!r}"
    knobs = dict(KNOB_DEFAULTS[variant])
    if variant == mode["variant"]:
        knobs.update({k: v for k, v in mode.items() if k in knobs})
    knobs.update({k: v for k, v in given.items() if v is not None and k in knobs})
    knobs["variant"] = variant
    return knobs


# ----------------------------------------------------------------------------------------------------
# launcher

def fused_classifier(logits: torch.Tensor, losses: torch.Tensor, dloss: float, targets: torch.Tensor, V: int,
                     write_dlogits: bool = True, block_size: int | None = None, num_warps: int | None = None,
                     stages: int | None = None, *, variant: str | None = None, tile: int | None = None,
                     progs_per_sm: int | None = None, keep: str | None = None, exact: bool | None = None,
                     prefetch: bool | None = None, buffers: int | None = None, scratch: torch.Tensor | None = None):
    """losses (B, T) fp32 = logsumexp(logits[..., :V]) - logits[target]; when write_dlogits, the logits
    (B, T, Vp) are overwritten by (softmax - onehot(target)) * dloss, with 0 in [V, Vp).

    dloss: the gradient of each loss, 1 / (B * T * grad_accum_steps). targets: int32/int64 in [0, V)
    (not checked: that would need a host sync). Any leading shape works: logits (..., Vp), losses and
    targets (...). Returns (losses, logits).

    Tuning knobs (None: TRAIN_CONFIG / VAL_CONFIG, then KNOB_DEFAULTS[variant]): variant ("twopass",
    "onepass", "split", "legacy", "tma"); block_size (columns an iteration / a split program); num_warps;
    stages (software pipelining of the row loops); tile (twopass: values a thread reduces before rescaling);
    progs_per_sm (twopass, onepass with keep p / pl / x: 0 = one program a row, k = a persistent grid of
    k programs an SM); keep, exact, prefetch (onepass, see the module docstring; prefetch only acts on a
    persistent grid, on the GPU); buffers (tma: rows a program holds in shared memory, 2 or 1); scratch
    (split: fp32, split_scratch_numel elements; pass one to keep the launcher allocation-free).
    """
    Vp = logits.shape[-1]
    rows = logits.numel() // Vp if Vp else 0
    assert 0 < V <= Vp, f"V={V} Vp={Vp}"
    assert logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()
    assert losses.dtype == torch.float32 and losses.is_contiguous() and losses.numel() == rows
    assert targets.dtype in (torch.int32, torch.int64) and targets.is_contiguous() and targets.numel() == rows
    assert logits.device == losses.device == targets.device
    given = dict(variant=variant, block_size=block_size, num_warps=num_warps, stages=stages, tile=tile,
                 progs_per_sm=progs_per_sm, keep=keep, exact=exact, prefetch=prefetch, buffers=buffers)
    k = _knobs(write_dlogits, given)
    if "block_size" in k:
        assert k["block_size"] & (k["block_size"] - 1) == 0, "block_size must be a power of two"
    if not rows:
        return losses, logits
    write, dloss = bool(write_dlogits), float(dloss)
    if k["variant"] == "tma":
        if tma_classifier_usable(logits):
            fused_classifier_tma(logits, losses, targets, dloss, V, write, _sm_count(logits),
                                 num_warps=k["num_warps"], buffers=k["buffers"])
            return losses, logits
        # tma's own knobs (num_warps included) do not carry over to the two-pass kernel
        k = _knobs(write, dict(given, variant=None, num_warps=None, buffers=None), mode=FALLBACK_CONFIG)

    if k["variant"] == "twopass":
        # at most the largest power of two <= V, so that the unmasked full-block loop runs at least once:
        # on the H200 (triton 3.6) a ZERO-trip full-block loop (block > V: the tiny vocabularies of tests)
        # left m and s undefined - NaN losses, and a hang in the validation kernel
        block = min(k["block_size"], 1 << (V.bit_length() - 1))
        tile_ = min(k["tile"], block)
        grid = rows if not k["progs_per_sm"] else min(rows, k["progs_per_sm"] * _sm_count(logits))
        _fc_twopass_kernel[(grid,)](logits, losses, targets, dloss, V, Vp, rows, BLOCK=block,
                                    TILE=tile_, STAGES=k["stages"], WRITE_DLOGITS=write,
                                    num_warps=k["num_warps"])
    elif k["variant"] == "onepass":
        keep = k["keep"]
        assert keep in KEEP_MODES, f"unknown keep mode {keep!r}"
        if keep in ("pw", "xw") and logits.dtype == torch.bfloat16 and Vp % 2 == 0:
            # word c holds columns 2c and 2c + 1: the chunks reaching word V // 2 hold padding
            shape = onepass_tiles(Vp // 2, V // 2, 4, k["num_warps"], exact=k["exact"])
            _fc_onepass_words_kernel[(rows,)](logits, logits.view(torch.int32), losses, targets, dloss, V, Vp // 2,
                                              **shape, KEEP=KEEP_MODES[keep], WRITE_DLOGITS=write,
                                              num_warps=k["num_warps"], num_stages=1)
        else:  # fp32 logits: nothing to pack, pw and xw are pl and x
            keep = {"pw": "pl", "xw": "x"}.get(keep, keep)
            shape = onepass_tiles(Vp, V, logits.element_size(), k["num_warps"], exact=k["exact"])
            # persistent: one program an SM (the registers hold one row); the prefetch is inline PTX, so
            # the interpreter runs the persistent loop without it
            grid = min(rows, k["progs_per_sm"] * _sm_count(logits)) if k["progs_per_sm"] else rows
            line = 128 // logits.element_size()
            _fc_onepass_kernel[(grid,)](logits, losses, targets, dloss, V, Vp, rows, **shape,
                                        KEEP=KEEP_MODES[keep], WRITE_DLOGITS=write,
                                        PREFETCH=bool(k["prefetch"]) and logits.is_cuda and grid < rows,
                                        LINES=triton.next_power_of_2(triton.cdiv(Vp, line)), LINE=line,
                                        num_warps=k["num_warps"], num_stages=1)
    elif k["variant"] == "split":
        block = k["block_size"]
        nc = triton.cdiv(Vp, block)
        need = split_scratch_numel(rows, Vp, block)
        if scratch is None:
            scratch = torch.empty(need, dtype=torch.float32, device=logits.device)
        assert scratch.dtype == torch.float32 and scratch.is_contiguous() and scratch.numel() >= need
        assert scratch.device == logits.device
        part, xt = scratch[:rows * nc * 2], scratch[rows * nc * 2:need]
        _fc_split_partial_kernel[(rows, nc)](logits, targets, part, xt, V, Vp, nc, BLOCK=block,
                                             num_warps=k["num_warps"])
        _fc_split_apply_kernel[(rows, nc if write else 1)](logits, losses, targets, part, xt, dloss, V, Vp, nc,
                                                           BLOCK=block, NCP=triton.next_power_of_2(nc),
                                                           WRITE_DLOGITS=write, num_warps=k["num_warps"])
    else:
        _fc_legacy_kernel[(rows,)](logits, losses, targets, dloss, V, Vp, BLOCK=k["block_size"],
                                   WRITE_DLOGITS=write, STAGES=k["stages"], num_warps=k["num_warps"])
    return losses, logits
