"""fcproj's input gradient times GELU's derivative, as one Hopper GEMM (Triton's Gluon dialect, sm_90).

dinp (M, N) = (dout (M, K) @ weight (K, N)) * gelu'(pre_gelu (M, N)): llm.c's DGELU epilogue (-ge 2).
Why a kernel of our own: cuBLASLt serves that epilogue with a legacy kernel (`sm90_xmma_gemm_..._aux`,
one 128 x 128 warpgroup tile) at 470 TFLOP/s where its plain products of the same step run at ~700
(bench/RESULTS.md, run AB): at K = 768 a tile's products are short, and an epilogue that loads pre_gelu,
evaluates GELU's derivative and stores is not hidden behind them.

Here a persistent program (one warpgroup, 128 x 128 tiles) streams its operands through a ring of TMA
buffers whose loads run on across tile boundaries, so the next tile's first operands arrive during this
tile's epilogue; the tile's pre_gelu is fetched by TMA when the tile starts and is waited for only in the
epilogue; the result leaves through shared memory and a TMA store that the next tile does not wait for.
Two programs share an SM, so one's epilogue runs while the other's products keep the tensor cores busy.
The products accumulate in fp32 in the same k order for every element (no split-K, no atomics):
bitwise repeatable. GELU's derivative is kernels/gelu.py's formula (tanh form, tanh from one exp of a
non-positive argument), evaluated in fp32; the result is rounded to nearest once.

GPU only (sm_90 with Gluon): no CPU interpreter. kernels.matmul routes the DGELU product here where
dgelu_wgmma_usable says so and DGELU_WGMMA is on, and to cuBLASLt's epilogue or the Triton GEMM elsewhere.

Measured (H200, bench/kernels/bench_dgelu_gemm.py, run AB): correct (tests/test_matmul_dgelu_wgmma.py)
but slower than cuBLASLt's 0.65 ms in every configuration: 0.85 ms (128 x 256 tiles, two warpgroups, one
program an SM), 0.91 (128 x 128, two programs an SM), 0.92 (a producer warp and two consumer warpgroups
in ping-pong, 24 bytes of spills); with two ring buffers 1.02, one program an SM 1.28-1.64. Off by default.
"""
from __future__ import annotations

import functools

import torch

try:  # Gluon ships with triton >= 3.5; anything missing here just means the other paths serve
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    GLUON = True
except Exception:  # noqa: BLE001 - an import of an experimental module may fail in many ways
    GLUON = False

BLOCK_M = 128
# the launcher's defaults: tile width (128: one warpgroup, 256: two), k a buffer holds, operand buffers a
# program, programs an SM, and the epilogue through shared memory and TMA (else straight from registers)
CONFIG = {"block_n": 128, "block_k": 32, "stages": 4, "programs_per_sm": 2, "epilogue_smem": True}


def dgelu_wgmma_usable(dinp: torch.Tensor, dout: torch.Tensor, weight: torch.Tensor, pre_gelu: torch.Tensor) -> bool:
    """Whether _dgelu_gemm_kernel serves this call: Gluon there, an sm_90 GPU, bf16 2-D row-major operands
    with unit column stride, 16-byte aligned rows and bases (TMA's rules)."""
    if not (GLUON and dout.is_cuda and dout.dtype == torch.bfloat16):
        return False
    for t in (dinp, dout, weight, pre_gelu):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return False
    if dinp.stride(0) != dinp.shape[1] or pre_gelu.stride(0) != pre_gelu.shape[1]:
        return False  # the epilogue straight from registers addresses rows with N as their stride
    return torch.cuda.get_device_capability(dout.device)[0] == 9


if GLUON:
    @gluon.jit
    def _gelu_grad(x):
        """kernels/gelu.py's gelu_grad_fp32 (tanh form; tanh(|z|) = (1 - e) / (1 + e), e = exp(-2|z|) <= 1)."""
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = gl.exp2(-2.0 * 1.4426950408889634 * gl.abs(z))
        t = gl.fdiv(1.0 - e, 1.0 + e)
        t = gl.where(z < 0, -t, t)
        return 0.5 * (1.0 + t) + x * 0.5 * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)

    @gluon.jit
    def _operand_loads(a_desc, b_desc, a_ring, b_ring, bars, slot, off_m, off_n, off_k):
        """A[off_m:, off_k:] and B[off_k:, off_n:] tiles into ring slot `slot`."""
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_ring.index(slot))
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_ring.index(slot))

    @gluon.jit
    def _next_load(ld_k, ld_tile, ld_m, ld_n, K, grid_n, num_programs, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr):
        """The load iterator one k-step on: the next k offset of this tile, or the first of the program's
        next tile (no division a k-step: only where the tile changes)."""
        ld_k += BK
        if ld_k >= K:
            ld_k = 0
            ld_tile += num_programs
            pm = ld_tile // grid_n
            ld_m = pm * BM
            ld_n = (ld_tile - pm * grid_n) * BN
        return ld_k, ld_tile, ld_m, ld_n

    @gluon.jit
    def _dgelu_gemm_kernel(a_desc, b_desc, io_desc, aux_desc, out_ptr, aux_ptr, M, N, K, num_programs,
                           STAGES: gl.constexpr, EPI_SMEM: gl.constexpr):
        """Program p takes output tiles p, p + num_programs, ... (row-major tile order: the programs at
        work share A's rows, and B (K x N) stays in L2)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        # one warpgroup a 128-row tile, or two (num_warps 8) taking 64 rows each of a 128 x 256 one
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, BN, 16])

        pid = gl.program_id(0)
        grid_m = gl.cdiv(M, BM)
        grid_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        n_mine = (grid_m * grid_n - pid + num_programs - 1) // num_programs
        total = n_mine * k_steps

        a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        if EPI_SMEM:
            # the epilogue tile: pre_gelu comes in here, the result goes out from here
            tile_smem = gl.allocate_shared_memory(dtype, io_desc.block_type.shape, io_desc.layout)
        rows_in = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        cols_in = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        aux_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        mbarrier.init(aux_bar, count=1)
        fence_async_shared()

        # the load iterator runs STAGES - 1 k-steps ahead of the products, across tile boundaries
        ld_k = 0
        ld_tile = pid
        ld_m = (pid // grid_n) * BM
        ld_n = (pid - (pid // grid_n) * grid_n) * BN
        for s in gl.static_range(STAGES - 1):
            if s < total:
                _operand_loads(a_desc, b_desc, a_ring, b_ring, bars, s, ld_m, ld_n, ld_k)
                ld_k, ld_tile, ld_m, ld_n = _next_load(ld_k, ld_tile, ld_m, ld_n, K, grid_n, num_programs, BM, BN, BK)

        it = 0
        for t in range(n_mine):
            tile = pid + t * num_programs
            pid_m = tile // grid_n
            pid_n = tile - pid_m * grid_n
            off_m = pid_m * BM
            off_n = pid_n * BN
            acc = gl.zeros([BM, BN], gl.float32, mma)
            for ks in range(k_steps):
                slot = it % STAGES
                mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
                acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot), acc, is_async=True)
                # at most this product in flight: the previous one's slot is free for the loads STAGES - 1 on
                acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_ring.index(slot), b_ring.index(slot)))
                if it + STAGES - 1 < total:
                    _operand_loads(a_desc, b_desc, a_ring, b_ring, bars, (it + STAGES - 1) % STAGES, ld_m, ld_n,
                                   ld_k)
                    ld_k, ld_tile, ld_m, ld_n = _next_load(ld_k, ld_tile, ld_m, ld_n, K, grid_n, num_programs,
                                                           BM, BN, BK)
                if EPI_SMEM:
                    if ks == 0:
                        # the last tile's result has left tile_smem (read by the TMA unit): fetch this
                        # tile's pre_gelu into it, to be waited for in the epilogue
                        tma.store_wait(pendings=0)
                        gl.thread_barrier()
                        mbarrier.expect(aux_bar, aux_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(aux_desc, [off_m, off_n], aux_bar, tile_smem)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

            if EPI_SMEM:
                mbarrier.wait(aux_bar, t & 1)
                pre = tile_smem.load(mma).to(gl.float32)
                out = (acc * _gelu_grad(pre)).to(dtype)
                gl.thread_barrier()  # every warp has read pre_gelu before the result overwrites it
                tile_smem.store(out)
                fence_async_shared()
                tma.async_copy_shared_to_global(io_desc, [off_m, off_n], tile_smem)
            else:
                # straight from and to global memory in the accumulator's layout (no shared memory: more
                # operand buffers fit)
                rows = off_m + rows_in
                cols = off_n + cols_in
                offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
                mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
                pre = gl.load(aux_ptr + offs, mask=mask, other=0.0).to(gl.float32)
                gl.store(out_ptr + offs, (acc * _gelu_grad(pre)).to(dtype), mask=mask)

        if EPI_SMEM:
            tma.store_wait(pendings=0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        mbarrier.invalidate(aux_bar)


if GLUON:
    @gluon.jit
    def _ws_producer(a_desc, b_desc, a_ring, b_ring, full, empty, pid, num_programs, n_mine, K, grid_n,
                     STAGES: gl.constexpr):
        """One warp: the operands of every (tile, k) of the program, in order, into the ring; a slot is
        refilled once its consumer has said its products are done (empty)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        k_steps = gl.cdiv(K, BK)
        g = 0
        for t in range(n_mine):
            tile = pid + t * num_programs
            pm = tile // grid_n
            off_m = pm * BM
            off_n = (tile - pm * grid_n) * BN
            for ks in range(k_steps):
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
                bar = full.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, ks * BK], bar, a_ring.index(slot))
                tma.async_copy_global_to_shared(b_desc, [ks * BK, off_n], bar, b_ring.index(slot))
                g += 1

    @gluon.jit
    def _ws_consumer(a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K,
                     grid_n, WHICH: gl.constexpr, STAGES: gl.constexpr):
        """A warpgroup taking every other tile of the program (WHICH = 0 or 1). The two take turns at the
        ring (turns: each waits for the other's products to be done before its own), so one's epilogue
        runs while the other's products do, and neither waits on a ring slot more than one phase ahead of
        the producer (a barrier's parity cannot tell further phases apart)."""
        BM: gl.constexpr = a_ring.shape[1]
        BK: gl.constexpr = a_ring.shape[2]
        BN: gl.constexpr = b_ring.shape[2]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        dtype: gl.constexpr = a_ring.dtype
        rows_in = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        cols_in = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        k_steps = gl.cdiv(K, BK)
        j = 0
        for t in range(WHICH, n_mine, 2):
            mbarrier.wait(turns.index(WHICH), (j & 1) ^ (1 - WHICH))
            tile = pid + t * num_programs
            pm = tile // grid_n
            off_m = pm * BM
            off_n = (tile - pm * grid_n) * BN
            g0 = t * k_steps
            acc = gl.zeros([BM, BN], gl.float32, mma)
            for ks in range(k_steps):
                g = g0 + ks
                slot = g % STAGES
                mbarrier.wait(full.index(slot), (g // STAGES) & 1)
                acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot), acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_ring.index(slot), b_ring.index(slot)))
                if ks > 0:  # the previous k-step's products are done: its slot may be refilled
                    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((g0 + k_steps - 1) % STAGES), count=1)
            mbarrier.arrive(turns.index(1 - WHICH), count=1)
            j += 1
            rows = off_m + rows_in
            cols = off_n + cols_in
            offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            pre = gl.load(aux_ptr + offs, mask=mask, other=0.0).to(gl.float32)
            gl.store(out_ptr + offs, (acc * _gelu_grad(pre)).to(dtype), mask=mask)

    @gluon.jit
    def _ws_consumer1(a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K,
                      grid_n, STAGES: gl.constexpr):
        _ws_consumer(a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K,
                     grid_n, 1, STAGES)

    @gluon.jit
    def _ws_consumer0(a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K,
                      grid_n, STAGES: gl.constexpr):
        _ws_consumer(a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K,
                     grid_n, 0, STAGES)

    @gluon.jit
    def _dgelu_gemm_ws_kernel(a_desc, b_desc, out_ptr, aux_ptr, M, N, K, num_programs, STAGES: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Warp-specialised: a producer warp feeding one ring, two consumer warpgroups (ping-pong)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        pid = gl.program_id(0)
        grid_m = gl.cdiv(M, BM)
        grid_n = gl.cdiv(N, BN)
        n_mine = (grid_m * grid_n - pid + num_programs - 1) // num_programs
        a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(turns.index(s), count=1)
        fence_async_shared()
        cargs = (a_ring, b_ring, full, empty, turns, out_ptr, aux_ptr, pid, num_programs, n_mine, M, N, K, grid_n,
                 STAGES)
        gl.warp_specialize([
            (_ws_consumer0, cargs),
            (_ws_consumer1, cargs),
            (_ws_producer, (a_desc, b_desc, a_ring, b_ring, full, empty, pid, num_programs, n_mine, K, grid_n,
                            STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _desc(t: torch.Tensor, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return GluonTensorDescriptor.from_tensor(t, block, layout)


def matmul_dgelu_wgmma(dinp: torch.Tensor, dout: torch.Tensor, weight: torch.Tensor, pre_gelu: torch.Tensor,
                       stages: int | None = None, programs_per_sm: int | None = None, block_k: int | None = None,
                       epilogue_smem: bool | None = None, block_n: int | None = None) -> torch.Tensor:
    """dinp (M, N) = (dout (M, K) @ weight (K, N)) * gelu'(pre_gelu (M, N)), overwritten; the caller has
    checked dgelu_wgmma_usable. dinp may not alias the operands (pre_gelu included). The knobs (None:
    CONFIG's): stages (operand buffers a program), programs_per_sm (of the persistent grid), block_k (k a
    buffer holds), epilogue_smem, block_n (128 or 256)."""
    given = dict(stages=stages, programs_per_sm=programs_per_sm, block_k=block_k, epilogue_smem=epilogue_smem,
                 block_n=block_n)
    k = {**CONFIG, **{name: v for name, v in given.items() if v is not None}}
    if k.get("warp_specialize"):
        return matmul_dgelu_wgmma_ws(dinp, dout, weight, pre_gelu, stages=k["stages"], block_k=k["block_k"])
    stages, programs_per_sm, block_k = k["stages"], k["programs_per_sm"], k["block_k"]
    epilogue_smem, block_n = k["epilogue_smem"], k["block_n"]
    M, K = dout.shape
    N = weight.shape[1]
    assert weight.shape == (K, N) and dinp.shape == (M, N) and pre_gelu.shape == (M, N)
    assert stages >= 2 and programs_per_sm >= 1 and block_k in (16, 32, 64, 128)
    # the direct epilogue addresses rows with N as their stride
    assert epilogue_smem or (dinp.stride(0) == N and pre_gelu.stride(0) == N)
    assert block_n in (128, 256)
    a_desc = _desc(dout, [BLOCK_M, block_k])
    b_desc = _desc(weight, [block_k, block_n])
    io_desc = _desc(dinp, [BLOCK_M, block_n])
    aux_desc = _desc(pre_gelu, [BLOCK_M, block_n])
    tiles = triton_cdiv(M, BLOCK_M) * triton_cdiv(N, block_n)
    programs = min(tiles, programs_per_sm * _sm_count(dout.device))
    global last_compiled
    last_compiled = _dgelu_gemm_kernel[(programs,)](a_desc, b_desc, io_desc, aux_desc, dinp, pre_gelu, M, N, K,
                                                    programs, STAGES=stages, EPI_SMEM=epilogue_smem,
                                                    num_warps=4 if block_n == 128 else 8)
    return dinp


def matmul_dgelu_wgmma_ws(dinp, dout, weight, pre_gelu, stages: int = 6, block_k: int = 64,
                          consumer_regs: int = 232, producer_regs: int = 40, programs_per_sm: int = 1):
    """The warp-specialised ping-pong variant (128 x 128 tiles a consumer warpgroup, epilogue straight
    from registers); same contract as matmul_dgelu_wgmma."""
    M, K = dout.shape
    N = weight.shape[1]
    assert weight.shape == (K, N) and dinp.shape == (M, N) and pre_gelu.shape == (M, N)
    assert dinp.stride(0) == N and pre_gelu.stride(0) == N
    a_desc = _desc(dout, [BLOCK_M, block_k])
    b_desc = _desc(weight, [block_k, 128])
    tiles = triton_cdiv(M, BLOCK_M) * triton_cdiv(N, 128)
    programs = min(tiles, programs_per_sm * _sm_count(dout.device))
    global last_compiled
    last_compiled = _dgelu_gemm_ws_kernel[(programs,)](a_desc, b_desc, dinp, pre_gelu, M, N, K, programs,
                                                       STAGES=stages, CONSUMER_REGS=consumer_regs,
                                                       PRODUCER_REGS=producer_regs, num_warps=4)
    return dinp


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


last_compiled = None  # the kernel the last call ran (its registers and shared memory, for the benchmarks)
