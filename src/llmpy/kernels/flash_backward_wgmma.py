"""The flash attention backward on Hopper with explicit asynchronous wgmma (Triton's Gluon dialect).

Same work as flash_attention._flash_bwd_kernel's fused schedule (program i: key block i's dk, dv over the
query tiles at or after it, then query block i's dq over the key tiles up to it; no atomics, bitwise
reproducible), the same tiles (64 keys x 32 queries in the dk/dv half, 64 x 64 in the dq half) and the same
order of the sums, written where tl.dot cannot be: Triton waits for every product whose result is not a loop
accumulator right after issuing it, so the score product S^T and dP^T run one after the other and the tensor
cores sit idle during the softmax (ncu: 47 % busy, against 98 % in a cuBLAS product; bench/RESULTS.md, run U).
Here each tile issues both score products at once and waits for S^T alone: the exponentials run while dP^T is
still on the tensor cores, and the dv, dk (dq) products of a tile run on, unwaited, under the next tile's
loads and score products. Queries and dout (keys and values in the dq half) stream through rings of TMA
buffers, each refilled as soon as the products that read it are known to be done; dk, dv and dq leave through
TMA stores from the buffers k, v and q came in. The dk/dv half's score product takes k from registers (loaded
once a program) rather than shared memory: a 64 x 32 tile's products read 32 kB of operands from shared memory
and take 8 kB of TMA writes against 256 clocks of tensor-core work, so by that arithmetic shared memory is the
tighter pipe; k in registers saves 8 kB a tile. 168 registers a thread (capped: ptxas takes 176 uncapped, and
three programs an SM allow 168; no spills with triton 3.6), rings of 3 and 3, 65.6 kB of shared memory, so
three programs an SM. At B=64, T=1024 on the H200 at its power cap: 0.944-0.973 ms a layer against 0.956-0.987
with k from shared memory (-1.4 %, run AL), which was itself 0.955-0.991 against 0.980-1.008 for the tl.dot
kernel (-1.7 to -2.5 %, run W); dqkv bitwise equal in all three.

Tried and left out (bench/RESULTS.md, runs V, W and AL): the score products' loop-invariant operands (k, v; q,
dout) all in registers instead of shared memory (190 registers, two programs an SM: 15 % slower); v instead of
k, capped at 168 (-1.0 %); k and v, capped at 168 (spills, and ptxas serialises the wgmma); q and dout in the
dq half (no more registers, but dq wrong after the first key tile under triton 3.6); 64-query tiles in the
dk/dv half (232 registers, two programs an SM: 1 % slower); each tile's lse and delta loaded during the tile
before (no gain); issuing each tile's S^T one tile early, under the previous tile's exponentials: carried into
the next iteration in flight, ptxas serialises every wgmma (C7514/C7515, 29 % slower); carried already waited
for, it compiles asynchronous at 168 registers and runs no faster (0.979 against 0.976 ms). Two warpgroups a
program sharing every streamed tile (128-row blocks, half the L2 traffic): one program an SM, 16-39 % slower;
capped at 128 registers for four programs an SM: 6 % slower. ncu: the tensor pipe is busy 49 % of the time, as
with the tl.dot kernel (48.8 %), and the warps' stalls spread over L1TEX results, wgmma waits, barriers and
dispatch with none dominant: twelve warps an SM at 154-168 registers is the balance these tiles allow. dq
summed across key blocks instead of recomputed (each 64-key program adding its share of every query tile into
an fp32 sum through the TMA unit's reduce-add, in an order fixed by per-tile counters; commit 181187c, run X):
bitwise repeatable but 1.46 against 0.98 ms, the shares' 1.7 GB of L2 writes a layer alone costing ~0.5 ms.

Not written: FlashAttention-3's backward (a producer warp, two consumer warpgroups, 128 x 128 tiles, dq by atomic
adds). Its paper (Shah et al. 2024, H100 SXM5, head size 64, sequence 1k) puts it 4 % above cuDNN's backward (363
against 348 TFLOPs/s), and that kernel is not deterministic; this one is 6-8 % faster than cuDNN's (0.94-0.97 ms at
the power cap, run AL, against 1.03 for cuDNN's through PyTorch, run J), so that design promises no gain here.

GPU only (sm_90). flash_attention.py's tl.dot kernel is the portable path; this one is tested on the GPU
against the CPU reference and against that kernel, and on the CPU, where Gluon has no interpreter, through
tests/gluon_emulator.py (its own code, sequentially, against the reference). It serves
bf16 storage, head size 64 and T a multiple of 64 (every GPT-2 size); flash_attention_backward falls back to
the tl.dot kernel elsewhere.
"""
from __future__ import annotations

import torch

from .common import register_cap, tma_usable

try:  # Gluon ships with triton >= 3.5; anything missing here just means the tl.dot kernel serves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from .gluon_compat import tma_load, tma_store
    GLUON = True
except Exception:  # noqa: BLE001 - an import of an experimental module may fail in many ways
    GLUON = False

BLOCK_KEYS = 64      # keys a program owns in the dk/dv half, queries it owns in the dq half
BLOCK_QUERIES = 32   # query tile the dk/dv half streams
HEAD_SIZE = 64


def wgmma_backward_usable(qkv: torch.Tensor, T: int, hs: int, *others: torch.Tensor) -> bool:
    """Whether _flash_bwd_wgmma_kernel serves this call (else the tl.dot kernel does): Gluon there, an sm_90
    GPU (wgmma is Hopper's), bf16, head size 64, T on the 64 grid, and qkv and the other (B, T, width)
    tensors TMA-addressable as 2-D views (common.tma_usable, as the tl.dot kernel's descriptors)."""
    if not (GLUON and qkv.is_cuda and qkv.dtype == torch.bfloat16 and hs == HEAD_SIZE and T % BLOCK_KEYS == 0):
        return False
    return (torch.cuda.get_device_capability(qkv.device)[0] == 9
            and tma_usable(*(t.view(-1, t.shape[-1]) for t in (qkv, *others))))


if GLUON:
    @gluon.jit
    def _dkdv_tile_loads(q_desc, do_desc, q_ring, do_ring, bars, tile, m_first, row0, col_q,
                         STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
        """Query tile `tile` (rows m_first + tile * BLOCK_M on) of q and dout into ring slot tile % STAGES."""
        slot = tile % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        row = row0 + m_first + tile * BLOCK_M
        tma_load(q_desc, [row, col_q], bar, q_ring.index(slot))
        tma_load(do_desc, [row, col_q], bar, do_ring.index(slot))

    @gluon.jit
    def _dq_tile_loads(kv_desc, k_ring, v_ring, bars, tile, row0, col_k, col_v,
                       STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """Key tile `tile` of k and v into ring slot tile % STAGES."""
        slot = tile % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, 2 * kv_desc.block_type.nbytes)
        tma_load(kv_desc, [row0 + tile * BLOCK_N, col_k], bar, k_ring.index(slot))
        tma_load(kv_desc, [row0 + tile * BLOCK_N, col_v], bar, v_ring.index(slot))

    @gluon.jit
    def _rings(desc_a, desc_b, STAGES: gl.constexpr):
        """Two rings of STAGES tiles (a stream each: q and dout, or k and v) as the descriptors' boxes, and
        their barriers."""
        ring_a = gl.allocate_shared_memory(desc_a.dtype, [STAGES] + desc_a.block_type.shape, desc_a.layout)
        ring_b = gl.allocate_shared_memory(desc_b.dtype, [STAGES] + desc_b.block_type.shape, desc_b.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        return ring_a, ring_b, bars

    @gluon.jit
    def _dkdv_loop(k_smem, v_smem, q_ring, do_ring, bars, q_desc, do_desc, lse_base, delta_base, n0, row0, col_q,
                   n_tiles, scale_log2, dtype: gl.constexpr, mma_s: gl.constexpr, mma_d: gl.constexpr,
                   a_d: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HS: gl.constexpr,
                   STAGES: gl.constexpr, A_REGS: gl.constexpr):
        """dk, dv (fp32, dk unscaled) of the key block at n0 over its n_tiles query tiles, transposed (keys x
        queries) as in the tl.dot kernel. The first STAGES tiles are already on their way into the rings.
        A_REGS bit 0 (1): k, the score product's A operand, from registers instead of shared memory (8 kB less
        read from shared memory a tile); bit 1 (2): v, dP^T's."""
        a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
        if A_REGS & 1:
            k_op = k_smem.load(a_s)
        else:
            k_op = k_smem
        if A_REGS & 2:
            v_op = v_smem.load(a_s)
        else:
            v_op = v_smem
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HS], gl.float32, mma_d))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HS], gl.float32, mma_d))
        for j in range(n_tiles):
            slot = j % STAGES
            q_tile = q_ring.index(slot)
            do_tile = do_ring.index(slot)
            # the tile's rows, their log-sum-exp in base 2 and their delta, loaded under the products
            offs_m = n0 + j * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
            lse2 = gl.load(lse_base + offs_m) * 1.4426950408889634
            delta = gl.load(delta_base + offs_m)
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            sT = warpgroup_mma(k_op, q_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpT = warpgroup_mma(v_op, do_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # S^T done, dP^T may still run; products complete in order, so the last tile's dv, dk are done
            # too and its buffers can take the tile STAGES after it
            sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT, ))
            if j > 0:
                if j - 1 + STAGES < n_tiles:
                    _dkdv_tile_loads(q_desc, do_desc, q_ring, do_ring, bars, j - 1 + STAGES, n0, row0, col_q,
                                     STAGES, BLOCK_M)
            # P^T from the saved log-sum-exp, in base 2 (as the tl.dot kernel, expression for expression)
            pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse2, 0))
            if j * BLOCK_M < BLOCK_N:  # the diagonal: queries before the key are hidden
                pT = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), pT, 0.0)
            dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dpT, ))
            # dv, dk issued and left in flight
            dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), a_d), do_tile, dv, is_async=True)
            dsT = pT * (dpT - gl.expand_dims(delta, 0))
            dk = warpgroup_mma(gl.convert_layout(dsT.to(dtype), a_d), q_tile, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        return dk, dv

    @gluon.jit
    def _dq_loop(q_smem, do_smem, k_ring, v_ring, bars, kv_desc, lse2, delta, offs_m, m0, row0, col_k, col_v,
                 n_tiles, scale_log2, dtype: gl.constexpr, mma_d: gl.constexpr, a_d: gl.constexpr,
                 BLOCK_N: gl.constexpr, HS: gl.constexpr, STAGES: gl.constexpr):
        """dq (fp32, unscaled) of the query block at m0 (rows offs_m) over its n_tiles key tiles, the last one
        the diagonal. The first STAGES tiles are already on their way into the rings. (q and dout stay in shared
        memory: taken from registers, as the dk/dv half takes k, dq came out wrong after the first key tile under
        triton 3.6, bench/RESULTS.md run AL.)"""
        zero_d = gl.zeros([BLOCK_N, BLOCK_N], gl.float32, mma_d)
        dq = warpgroup_mma_init(gl.zeros([BLOCK_N, HS], gl.float32, mma_d))
        for i in range(n_tiles):
            slot = i % STAGES
            k_tile = k_ring.index(slot)
            v_tile = v_ring.index(slot)
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), zero_d, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_smem, v_tile.permute((1, 0)), zero_d, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # and the last tile's dq: its buffers are free
            if i > 0:
                if i - 1 + STAGES < n_tiles:
                    _dq_tile_loads(kv_desc, k_ring, v_ring, bars, i - 1 + STAGES, row0, col_k, col_v, STAGES, BLOCK_N)
            p = gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 1))
            if i * BLOCK_N >= m0:  # the diagonal: keys after the query are hidden
                offs_k = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_d))
                p = gl.where(gl.expand_dims(offs_k, 0) <= gl.expand_dims(offs_m, 1), p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
            ds = p * (dp - gl.expand_dims(delta, 1))
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_d), k_tile, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        return dq

    @gluon.jit
    def _flash_bwd_wgmma_kernel(q_desc, do_desc, kv_desc, do64_desc, dqkv_desc, lse_ptr, delta_ptr, q_sums_ptr,
                                T, NH, C, sm_scale, scale_log2,
                                HS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES1: gl.constexpr, STAGES2: gl.constexpr, Q_SUMS: gl.constexpr,
                                A_REGS: gl.constexpr, num_warps: gl.constexpr):
        """q_desc, do_desc: [BLOCK_M, HS] boxes of qkv (B*T, 3C) and dout (B*T, C); kv_desc, do64_desc,
        dqkv_desc: [BLOCK_N, HS] boxes of qkv, dout and dqkv. Program (i, b*NH + h): key block i's dk, dv,
        then query block i's dq. STAGES1, STAGES2: depths of the dk/dv and dq halves' rings. Q_SUMS: also
        q_sums[b*T/BLOCK_N + i, h*HS:(h+1)*HS] = the column sums of the block's dq (fp32, before rounding).
        A_REGS: which loop-invariant A operands of the dk/dv half's score products come from registers
        (_dkdv_loop)."""
        gl.static_assert(num_warps == 4 and BLOCK_N == 64, "one warpgroup a program, 64 rows a warpgroup")
        gl.static_assert(BLOCK_N % BLOCK_M == 0, "query tiles inside the diagonal block")
        gl.static_assert(min(STAGES1, STAGES2) >= 2, "a ring buffer is refilled while the next one is read")
        pid = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // NH
        h = bh % NH
        row0 = b * T
        col_q = h * HS
        col_k = C + h * HS
        col_v = 2 * C + h * HS
        lse_base = lse_ptr + bh.to(gl.int64) * T
        delta_base = delta_ptr + bh.to(gl.int64) * T
        dtype: gl.constexpr = q_desc.dtype

        # accumulators of 64 x 32 score tiles (dk/dv half) and of 64 x 64 tiles (dk, dv, the dq half);
        # the A operands that come from registers (P^T, dS^T, dS) take the layout of the latter's products
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HS, 16])
        a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)

        one_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(one_bar, count=1)

        # ---- dk, dv of key block n0 over the query tiles from n0 to T --------------------------------
        n0 = pid * BLOCK_N
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HS], kv_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HS], kv_desc.layout)
        q_ring, do_ring, bars1 = _rings(q_desc, do_desc, STAGES1)
        n_tiles = (T - n0) // BLOCK_M
        for s in gl.static_range(STAGES1):
            if s < n_tiles:
                _dkdv_tile_loads(q_desc, do_desc, q_ring, do_ring, bars1, s, n0, row0, col_q, STAGES1, BLOCK_M)
        mbarrier.expect(one_bar, 2 * kv_desc.block_type.nbytes)
        tma_load(kv_desc, [row0 + n0, col_k], one_bar, k_smem)
        tma_load(kv_desc, [row0 + n0, col_v], one_bar, v_smem)
        mbarrier.wait(one_bar, 0)
        dk, dv = _dkdv_loop(k_smem, v_smem, q_ring, do_ring, bars1, q_desc, do_desc, lse_base, delta_base, n0, row0,
                            col_q, n_tiles, scale_log2, dtype, mma_s, mma_d, a_d, BLOCK_M, BLOCK_N, HS, STAGES1, A_REGS)
        for s in gl.static_range(STAGES1):
            mbarrier.invalidate(bars1.index(s))

        # dk, dv leave through the buffers k and v came in (no products read them any more), so that no
        # third buffer counts against the programs an SM holds. dS is the gradient of the scaled scores:
        # the scale moves onto dk (and dq)
        k_smem.store((dk * sm_scale).to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        tma_store(dqkv_desc, [row0 + n0, col_k], k_smem)
        tma_store(dqkv_desc, [row0 + n0, col_v], v_smem)
        tma.store_wait(pendings=0)  # read out of shared memory before the dq half's buffers may reuse it

        # ---- dq of query block m0 over the key tiles from 0 to m0 (the last one the diagonal) ---------
        m0 = pid * BLOCK_N
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HS], kv_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HS], do64_desc.layout)
        k_ring, v_ring, bars2 = _rings(kv_desc, kv_desc, STAGES2)
        n_key_tiles = (m0 + BLOCK_N) // BLOCK_N  # pid + 1, written so: ptxas then takes 154 registers, not 160
        for s in gl.static_range(STAGES2):
            if s < n_key_tiles:
                _dq_tile_loads(kv_desc, k_ring, v_ring, bars2, s, row0, col_k, col_v, STAGES2, BLOCK_N)
        mbarrier.expect(one_bar, kv_desc.block_type.nbytes + do64_desc.block_type.nbytes)
        tma_load(kv_desc, [row0 + m0, col_q], one_bar, q_smem)
        tma_load(do64_desc, [row0 + m0, col_q], one_bar, do_smem)
        offs_m = m0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_d))
        lse2 = gl.load(lse_base + offs_m) * 1.4426950408889634
        delta = gl.load(delta_base + offs_m)
        mbarrier.wait(one_bar, 1)
        dq = _dq_loop(q_smem, do_smem, k_ring, v_ring, bars2, kv_desc, lse2, delta, offs_m, m0, row0, col_k, col_v,
                      n_key_tiles, scale_log2, dtype, mma_d, a_d, BLOCK_N, HS, STAGES2)
        for s in gl.static_range(STAGES2):
            mbarrier.invalidate(bars2.index(s))
        mbarrier.invalidate(one_bar)
        dq = dq * sm_scale
        q_smem.store(dq.to(dtype))  # q's buffer, as dk's above
        fence_async_shared()
        tma_store(dqkv_desc, [row0 + m0, col_q], q_smem)
        if Q_SUMS:
            # the QKV bias gradient's query part, a 64-row block at a time, under the store
            cols = gl.arange(0, HS, layout=gl.SliceLayout(0, mma_d))
            block_row = (row0 + m0) // BLOCK_N
            gl.store(q_sums_ptr + block_row.to(gl.int64) * C + col_q + cols, gl.sum(dq, axis=0))
        tma.store_wait(pendings=0)


# the shared-memory layouts of the [BLOCK_QUERIES, 64] and [BLOCK_KEYS, 64] bf16 boxes, once
_TILE_LAYOUTS = tuple(gl.NVMMASharedLayout.get_default_for([rows, HEAD_SIZE], gl.bfloat16)
                      for rows in (BLOCK_QUERIES, BLOCK_KEYS)) if GLUON else None


def flash_backward_wgmma(dqkv: torch.Tensor, dout: torch.Tensor, qkv: torch.Tensor, lse: torch.Tensor,
                         delta: torch.Tensor, num_heads: int, scale: float, scale_log2: float,
                         stages=(3, 3), q_sums: torch.Tensor | None = None, a_regs: int = 0,
                         maxnreg: int | None = None) -> torch.Tensor:
    """dq, dk, dv into dqkv (B, T, 3C) given delta (B, NH, T) already computed; the caller
    (flash_attention_backward) has checked shapes, dtypes and wgmma_backward_usable. stages: the TMA
    rings' depths in the dk/dv half and in the dq half. q_sums: None, or fp32 (B*T/BLOCK_KEYS, C) that
    receives the column sums of dq over each BLOCK_KEYS-row block (flash_attention_backward's q_sums, checked
    there). a_regs: the kernel's A_REGS (0: every A operand of the score products from shared memory, 1: k
    from registers, 2: v, 3: both; flash_config checks it); maxnreg: a register cap a thread (None: ptxas's
    choice)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    lay_q, lay_k = _TILE_LAYOUTS
    qkv2, dout2, dqkv2 = qkv.view(B * T, C3), dout.view(B * T, C), dqkv.view(B * T, C3)
    q_desc = GluonTensorDescriptor.from_tensor(qkv2, [BLOCK_QUERIES, HEAD_SIZE], lay_q)
    do_desc = GluonTensorDescriptor.from_tensor(dout2, [BLOCK_QUERIES, HEAD_SIZE], lay_q)
    kv_desc = GluonTensorDescriptor.from_tensor(qkv2, [BLOCK_KEYS, HEAD_SIZE], lay_k)
    do64_desc = GluonTensorDescriptor.from_tensor(dout2, [BLOCK_KEYS, HEAD_SIZE], lay_k)
    dqkv_desc = GluonTensorDescriptor.from_tensor(dqkv2, [BLOCK_KEYS, HEAD_SIZE], lay_k)
    global last_compiled
    last_compiled = _flash_bwd_wgmma_kernel[(T // BLOCK_KEYS, B * num_heads)](
        q_desc, do_desc, kv_desc, do64_desc, dqkv_desc, lse, delta, q_sums if q_sums is not None else delta,
        T, num_heads, C, scale, scale_log2, HS=HEAD_SIZE, BLOCK_M=BLOCK_QUERIES, BLOCK_N=BLOCK_KEYS,
        STAGES1=stages[0], STAGES2=stages[1], Q_SUMS=q_sums is not None, A_REGS=a_regs, num_warps=4,
        **register_cap(maxnreg))
    return dqkv


last_compiled = None  # the kernel the last call ran (its registers and shared memory, for the benchmarks)
