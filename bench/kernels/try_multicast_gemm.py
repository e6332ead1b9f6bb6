"""Experiment: a Hopper GEMM in 2-CTA clusters with TMA multicast (triton >= 3.8 Gluon), plain or with
the DGELU epilogue: out (M, N) = (a (M, K) @ b (K, N)) [* gelu'(pre (M, N))].

A cluster of two CTAs takes a BM x 2*BN tile: both CTAs need the same BM rows of A, which the lead CTA
loads once and multicasts to both; each CTA loads its own BN columns of B. One producer warp feeds a
ring of STAGES slots; the consumer warpgroups (num_warps = 8: two warpgroups, 128 rows each) accumulate
in fp32 and write through shared memory and a TMA store. A slot's A is refilled (by the lead CTA, into
both CTAs) once the consumers of BOTH CTAs are done with it: they arrive on a barrier the cluster shares,
which only the lead waits on; its B once this CTA's consumers are (a barrier of its own). triton 3.8's
multicast mbarrier.arrive (cta_mask) lowers to an instruction ptxas rejects for sm_90a. Every kernel ends
with a cluster barrier: a CTA that exits while another still arrives on its barriers faults the launch.

Variants: the DGELU epilogue in the consumers (exact or with tanh.approx), in a warpgroup of its own
(ws3: pre_gelu from global memory; ws3t: pre_gelu through a TMA ring), interleaved slab by slab with the
next tile's products (mc_il), and a 2 x 2 cluster of 128 x 128 CTAs, two an SM (mc4; MC_A / MC_B pick
which operand is multicast). bench/RESULTS.md, run AG."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    cluster, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _gelu_grad(x):
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = gl.exp2(-2.0 * 1.4426950408889634 * gl.abs(z))
    t = gl.fdiv(1.0 - e, 1.0 + e)
    t = gl.where(z < 0, -t, t)
    return 0.5 * (1.0 + t) + x * 0.5 * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)


@gluon.jit
def _gelu_grad_approx(x):
    """GELU's derivative with the SFU's tanh (tanh.approx.f32, ~2^-11 relative): one MUFU op an element."""
    u = x * x
    z = x * (0.7978845608028654 + 0.035677408136300125 * u)
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [z], dtype=gl.float32, is_pure=True, pack=1)
    slope = 0.7978845608028654 + 0.10703222440890037 * u
    return 0.5 + 0.5 * t + (0.5 * x) * (1.0 - t * t) * slope


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, k_steps,
              STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BK: gl.constexpr = a_desc.block_shape[1]
    BN2: gl.constexpr = b_desc.block_shape[1]
    nbytes: gl.constexpr = a_desc.nbytes_per_cta + b_desc.nbytes_per_cta
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        for ks in range(k_steps):
            s = i % STAGES
            # the lead CTA refills A in both CTAs: it waits for both consumers (a barrier shared by the
            # cluster, waited on by the lead only); each CTA refills its own B once its consumer is done
            mbarrier.wait(empty_a.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_load(a_desc, [off_m, ks * BK], bar, a_ring.index(s), multicast=True)
            tma.async_load(b_desc, [ks * BK, off_n], bar, b_ring.index(s))
            i += 1


@gluon.jit
def _consumer(a_ring, b_ring, ready, empty, empty_a, c_desc, aux_desc, epi_smem, aux_bar, num_tiles, grid_n, k_steps,
              STAGES: gl.constexpr, DGELU: gl.constexpr, APPROX: gl.constexpr):
    BM: gl.constexpr = c_desc.block_shape[0]
    BN2: gl.constexpr = c_desc.block_shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN2 // 2, 16], cga_layout=[[0, 1]])
    i = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        acc = gl.zeros([BM, BN2], gl.float32, mma)
        for ks in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ks > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES))
                mbarrier.arrive(empty_a.index((i - 1) % STAGES))
            if DGELU:
                if ks == 0:
                    tma.store_wait(pendings=0)
                    mbarrier.expect(aux_bar, aux_desc.nbytes_per_cta)
                    tma.async_load(aux_desc, [off_m, off_n], aux_bar, epi_smem)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i - 1) % STAGES))
        mbarrier.arrive(empty_a.index((i - 1) % STAGES))
        if DGELU:
            mbarrier.wait(aux_bar, t & 1)
            pre = epi_smem.load(mma).to(gl.float32)
            if APPROX:
                out = (acc * _gelu_grad_approx(pre)).to(c_desc.dtype)
            else:
                out = (acc * _gelu_grad(pre)).to(c_desc.dtype)
        else:
            out = acc.to(c_desc.dtype)
            tma.store_wait(pendings=0)
        gl.barrier()
        epi_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], epi_smem)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def mc_gemm_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, STAGES: gl.constexpr, DGELU: gl.constexpr,
                   APPROX: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, ARRIVALS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    BK: gl.constexpr = a_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM) * grid_n
    k_steps = gl.cdiv(K, BK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    epi_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    aux_bar = mbarrier.allocate_mbarrier()
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=ARRIVALS)
        mbarrier.init(empty_a.index(s), count=ARRIVALS)
    mbarrier.init(aux_bar, count=1)
    gl.warp_specialize([
        (_consumer, (a_ring, b_ring, ready, empty, empty_a, c_desc, aux_desc, epi_smem, aux_bar, num_tiles, grid_n,
                     k_steps, STAGES, DGELU, APPROX)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, k_steps, STAGES)),
    ], [1], [PRODUCER_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


# ------------------------------------------------------------------------------------------------------
# three partitions: the epilogue in a warpgroup of its own, so that the consumers go on to the next tile's
# products while it runs. The consumers hand the fp32 accumulator over through shared memory (per CTA
# BM x BN fp32: 128 kB at 256 x 128), the epilogue warpgroup reads it row slab by row slab, loads pre_gelu
# and stores the result straight from registers (coalesced 16-byte accesses).

# layouts built here, not in the kernels: a list literal inside a jit function becomes a Triton tuple, which
# the layouts' equality test then trips over when two tensors are broadcast together
EPI_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0], cga_layout=[[0, 1]]))
EPI_LAYOUT8 = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0], cga_layout=[[0, 1]]))
STAGING_LAYOUTS = {"swizzled": gl.SwizzledSharedLayout(2, 1, 8, [1, 0], cga_layout=[[0, 1]]),
                   "nvmma": gl.NVMMASharedLayout.get_default_for([256, 256], gl.float32, cga_layout=[[0, 1]])}
STAGING2_LAYOUT = gl.constexpr(STAGING_LAYOUTS["swizzled"])



@gluon.jit
def _ws3_consumer(a_ring, b_ring, ready, empty, empty_a, staging, acc_full, acc_free, num_tiles, grid_n, k_steps,
                  STAGES: gl.constexpr):
    BM: gl.constexpr = staging.shape[0]
    BN2: gl.constexpr = staging.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN2 // 2, 16], cga_layout=[[0, 1]])
    i = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros([BM, BN2], gl.float32, mma)
        for ks in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ks > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES))
                mbarrier.arrive(empty_a.index((i - 1) % STAGES))
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i - 1) % STAGES))
        mbarrier.arrive(empty_a.index((i - 1) % STAGES))
        mbarrier.wait(acc_free, (t & 1) ^ 1)  # the epilogue has read the last tile's accumulator
        staging.store(acc)
        mbarrier.arrive(acc_full)
        t += 1


@gluon.jit
def _epi_pre(pre_ptr, off_m, r0: gl.constexpr, rows_in, c64, col_ok, M, stride_pre):
    rows = off_m + r0 + rows_in
    mask = gl.expand_dims(rows < M, 1) & col_ok
    return gl.load(pre_ptr + (gl.expand_dims(rows.to(gl.int64), 1) * stride_pre + c64), mask=mask, other=0.0)


@gluon.jit
def _ws3_epilogue(staging, acc_full, acc_free, out_ptr, pre_ptr, M, N, stride_out, stride_pre, num_tiles, grid_n,
                  EPI_ROWS: gl.constexpr, APPROX: gl.constexpr):
    """Row slabs of EPI_ROWS rows; pre_gelu is loaded two slabs ahead (the first two before the accumulator
    is even ready), so that the loads' latency overlaps the arithmetic instead of adding up slab by slab."""
    BM: gl.constexpr = staging.shape[0]
    BN2: gl.constexpr = staging.shape[1]
    NSLAB: gl.constexpr = BM // EPI_ROWS
    # a thread holds 4 consecutive columns (16 B of fp32 from shared memory, 8 B of bf16 to and from global
    # memory); each CTA holds its own BN columns
    lay: gl.constexpr = EPI_LAYOUT
    rows_in = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, lay))
    cols_in = gl.arange(0, BN2, layout=gl.SliceLayout(0, lay))
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        cols = off_n + cols_in
        col_ok = gl.expand_dims(cols < N, 0)
        c64 = gl.expand_dims(cols, 0).to(gl.int64)
        p0 = _epi_pre(pre_ptr, off_m, 0, rows_in, c64, col_ok, M, stride_pre)
        p1 = _epi_pre(pre_ptr, off_m, EPI_ROWS, rows_in, c64, col_ok, M, stride_pre)
        mbarrier.wait(acc_full, t & 1)
        for j in gl.static_range(NSLAB):
            cur = p0
            p0 = p1
            if j + 2 < NSLAB:
                p1 = _epi_pre(pre_ptr, off_m, (j + 2) * EPI_ROWS, rows_in, c64, col_ok, M, stride_pre)
            acc = staging.slice(j * EPI_ROWS, EPI_ROWS, 0).load(lay)
            x = cur.to(gl.float32)
            if APPROX:
                g = _gelu_grad_approx(x)
            else:
                g = _gelu_grad(x)
            res = acc * g
            rows = off_m + j * EPI_ROWS + rows_in
            mask = gl.expand_dims(rows < M, 1) & col_ok
            gl.store(out_ptr + (gl.expand_dims(rows.to(gl.int64), 1) * stride_out + c64), res.to(gl.bfloat16),
                     mask=mask)
        mbarrier.arrive(acc_free)
        t += 1


@gluon.jit
def _ws3t_epilogue(staging, acc_full, acc_free, pre_desc, pre_ring, pre_bars, out_ptr, M, N, stride_out, num_tiles,
                   grid_n, APPROX: gl.constexpr):
    """pre_gelu row slabs stream through a ring of TMA buffers that runs ahead across tiles (the next tile's
    first slabs load while this warpgroup waits for its accumulator), so no load's latency is waited out."""
    BM: gl.constexpr = staging.shape[0]
    BN2: gl.constexpr = staging.shape[1]
    ROWS: gl.constexpr = pre_desc.block_shape[0]
    D: gl.constexpr = pre_ring.shape[0]
    NSLAB: gl.constexpr = BM // ROWS
    if gl.num_warps() == 8:
        lay: gl.constexpr = EPI_LAYOUT8
    else:
        lay: gl.constexpr = EPI_LAYOUT
    rows_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
    cols_in = gl.arange(0, BN2, layout=gl.SliceLayout(0, lay))
    first = gl.program_id(0)
    step = gl.num_programs(0)
    n_mine = (num_tiles - first + step - 1) // step
    total = n_mine * NSLAB
    # prologue: the first D slabs of the program
    for q in gl.static_range(D):
        if q < total:
            tq = first + (q // NSLAB) * step
            pq = tq // grid_n
            mbarrier.expect(pre_bars.index(q), pre_desc.nbytes_per_cta)
            tma.async_load(pre_desc, [pq * BM + (q % NSLAB) * ROWS, (tq - pq * grid_n) * BN2], pre_bars.index(q),
                           pre_ring.index(q))
    g_i = 0
    for t in range(n_mine):
        tile = first + t * step
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        cols = off_n + cols_in
        col_ok = gl.expand_dims(cols < N, 0)
        c64 = gl.expand_dims(cols, 0).to(gl.int64)
        mbarrier.wait(acc_full, t & 1)
        for j in gl.static_range(NSLAB):
            s = g_i % D
            mbarrier.wait(pre_bars.index(s), (g_i // D) & 1)
            x = pre_ring.index(s).load(lay).to(gl.float32)
            gl.barrier()  # every warp has read the slot before it is refilled
            nxt = g_i + D
            if nxt < total:
                tn = first + (nxt // NSLAB) * step
                pn = tn // grid_n
                mbarrier.expect(pre_bars.index(s), pre_desc.nbytes_per_cta)
                tma.async_load(pre_desc, [pn * BM + (nxt % NSLAB) * ROWS, (tn - pn * grid_n) * BN2],
                               pre_bars.index(s), pre_ring.index(s))
            acc = staging.slice(j * ROWS, ROWS, 0).load(lay)
            if APPROX:
                g = _gelu_grad_approx(x)
            else:
                g = _gelu_grad(x)
            res = acc * g
            rows = off_m + j * ROWS + rows_in
            mask = gl.expand_dims(rows < M, 1) & col_ok
            gl.store(out_ptr + (gl.expand_dims(rows.to(gl.int64), 1) * stride_out + c64), res.to(gl.bfloat16),
                     mask=mask)
            g_i += 1
        mbarrier.arrive(acc_free)


@gluon.jit
def mc_gemm_ws3t_kernel(a_desc, b_desc, pre_desc, out_ptr, M, N, K, stride_out, STAGES: gl.constexpr,
                        PRE_STAGES: gl.constexpr, APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        EPI_REGS: gl.constexpr, EPI_WARPS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    BK: gl.constexpr = a_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM) * grid_n
    k_steps = gl.cdiv(K, BK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    pre_ring = gl.allocate_shared_memory(pre_desc.dtype, [PRE_STAGES] + pre_desc.block_shape, pre_desc.layout)
    staging = gl.allocate_shared_memory(gl.float32, [BM, BN2], STAGING2_LAYOUT)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    pre_bars = mbarrier.allocate_mbarrier(batch=PRE_STAGES)
    acc_full = mbarrier.allocate_mbarrier()
    acc_free = mbarrier.allocate_mbarrier()
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
    for s in gl.static_range(PRE_STAGES):
        mbarrier.init(pre_bars.index(s), count=1)
    mbarrier.init(acc_full, count=1)
    mbarrier.init(acc_free, count=1)
    gl.warp_specialize([
        (_ws3_consumer, (a_ring, b_ring, ready, empty, empty_a, staging, acc_full, acc_free, num_tiles, grid_n,
                         k_steps, STAGES)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, k_steps, STAGES)),
        (_ws3t_epilogue, (staging, acc_full, acc_free, pre_desc, pre_ring, pre_bars, out_ptr, M, N, stride_out,
                          num_tiles, grid_n, APPROX)),
    ], [1, EPI_WARPS], [PRODUCER_REGS, EPI_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def mc_gemm_ws3t(a, b, c, pre, BM=256, BN=128, BK=32, stages=3, clusters=None, approx=False, pre_rows=16,
                 pre_stages=4, epi_regs=120, producer_regs=24, epi_warps=4):
    M, K = a.shape
    N = b.shape[1]
    ad, bd, _, _ = descriptors(a, b, c, c, BM, BN, BK)
    lp = gl.NVMMASharedLayout.get_default_for([pre_rows, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    pd = TensorDescriptor.from_tensor(pre, [pre_rows, 2 * BN], lp)
    tiles = -(-M // BM) * -(-N // (2 * BN))
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc_gemm_ws3t_kernel[(min(tiles, clusters),)](ad, bd, pd, c, M, N, K, c.stride(0), STAGES=stages,
                                                        PRE_STAGES=pre_stages, APPROX=approx,
                                                        PRODUCER_REGS=producer_regs, EPI_REGS=epi_regs,
                                                        EPI_WARPS=epi_warps, num_warps=8, num_ctas=2)


@gluon.jit
def mc_gemm_ws3_kernel(a_desc, b_desc, out_ptr, pre_ptr, M, N, K, stride_out, stride_pre, STAGES: gl.constexpr,
                       EPI_ROWS: gl.constexpr, APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       EPI_REGS: gl.constexpr, ST_LAYOUT: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    BK: gl.constexpr = a_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM) * grid_n
    k_steps = gl.cdiv(K, BK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    # fp32 rows, 2-element vectors XOR-swizzled by row so that the accumulator's fragments store without
    # bank conflicts
    staging = gl.allocate_shared_memory(gl.float32, [BM, BN2], ST_LAYOUT)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    acc_full = mbarrier.allocate_mbarrier()
    acc_free = mbarrier.allocate_mbarrier()
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
    mbarrier.init(acc_full, count=1)
    mbarrier.init(acc_free, count=1)
    gl.warp_specialize([
        (_ws3_consumer, (a_ring, b_ring, ready, empty, empty_a, staging, acc_full, acc_free, num_tiles, grid_n,
                         k_steps, STAGES)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, k_steps, STAGES)),
        (_ws3_epilogue, (staging, acc_full, acc_free, out_ptr, pre_ptr, M, N, stride_out, stride_pre, num_tiles,
                         grid_n, EPI_ROWS, APPROX)),
    ], [1, 4], [PRODUCER_REGS, EPI_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def mc_gemm_ws3(a, b, c, pre, BM=256, BN=128, BK=32, stages=4, clusters=None, approx=False, epi_rows=32,
                epi_regs=152, producer_regs=24, staging="swizzled"):
    M, K = a.shape
    N = b.shape[1]
    ad, bd, _, _ = descriptors(a, b, c, c, BM, BN, BK)
    tiles = -(-M // BM) * -(-N // (2 * BN))
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc_gemm_ws3_kernel[(min(tiles, clusters),)](ad, bd, c, pre, M, N, K, c.stride(0), pre.stride(0),
                                                       STAGES=stages, EPI_ROWS=epi_rows, APPROX=approx,
                                                       PRODUCER_REGS=producer_regs, EPI_REGS=epi_regs,
                                                       ST_LAYOUT=STAGING_LAYOUTS[staging], num_warps=8, num_ctas=2)


def descriptors(a, b, c, aux, BM=256, BN=128, BK=64):
    """BN: a CTA's columns; the cluster's tile is BM x 2*BN."""
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16, cga_layout=[[0, 0]])
    lb = gl.NVMMASharedLayout.get_default_for([BK, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    lc = gl.NVMMASharedLayout.get_default_for([BM, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    return (TensorDescriptor.from_tensor(a, [BM, BK], la), TensorDescriptor.from_tensor(b, [BK, 2 * BN], lb),
            TensorDescriptor.from_tensor(c, [BM, 2 * BN], lc), TensorDescriptor.from_tensor(aux, [BM, 2 * BN], lc))


def mc_gemm(a, b, c, aux=None, BM=256, BN=128, BK=64, stages=3, num_warps=8, clusters=None, cluster4=False,
            interleave=False,
            producer_regs=40, consumer_regs=232, arrivals=1, approx=False, ws3=False, epi_rows=32, epi_regs=120,
            staging="swizzled", ws3t=False, pre_stages=4, pre_rows=16, epi_warps=4):
    if interleave:
        return mc_il(a, b, c, aux, BK=BK, stages=stages, approx=approx)
    if cluster4:
        return mc4_gemm(a, b, c, aux, BK=BK, stages=stages, approx=approx, mc_a=arrivals in (1, 3),
                        mc_b=arrivals in (2, 3))
    if ws3t:
        return mc_gemm_ws3t(a, b, c, aux, BM, BN, BK, stages, clusters, approx, pre_rows, pre_stages,
                            epi_regs=epi_regs if epi_warps == 4 else 80, epi_warps=epi_warps)
    if ws3:
        return mc_gemm_ws3(a, b, c, aux, BM, BN, BK, stages, clusters, approx, epi_rows, epi_regs, staging=staging)
    M, K = a.shape
    N = b.shape[1]
    ad, bd, cd, xd = descriptors(a, b, c, aux if aux is not None else c, BM, BN, BK)
    tiles = -(-M // BM) * -(-N // (2 * BN))
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc_gemm_kernel[(min(tiles, clusters),)](ad, bd, cd, xd, M, N, K, STAGES=stages, DGELU=aux is not None,
                                                   APPROX=approx, PRODUCER_REGS=producer_regs,
                                                   CONSUMER_REGS=consumer_regs, ARRIVALS=arrivals,
                                                   num_warps=num_warps, num_ctas=2)


# ------------------------------------------------------------------------------------------------------
# four CTAs in a 2 x 2 cluster, 128 x 128 a CTA, two CTAs an SM: A multicast along the cluster's N pair, B
# along its M pair (L2 bytes a FLOP as the 256 x 128 tiles above), and one warpgroup a CTA with the
# epilogue in the consumer, where the other CTA on the SM keeps the tensor cores busy meanwhile.

MB4_EMPTY_A = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[0], [1]]))  # shared by CTAs differing in bit 0
MB4_EMPTY_B = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[1], [0]]))  # shared by CTAs differing in bit 1
MMA4_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16],
                                                     cga_layout=[[0, 1], [1, 0]]))


@gluon.jit
def _producer4(a_desc, b_desc, a_ring, b_ring, ready, empty_a, empty_b, empty_l, num_tiles, grid_n, k_steps,
               STAGES: gl.constexpr, MC_A: gl.constexpr, MC_B: gl.constexpr):
    BM2: gl.constexpr = a_desc.block_shape[0]
    BK: gl.constexpr = a_desc.block_shape[1]
    BN2: gl.constexpr = b_desc.block_shape[1]
    nbytes: gl.constexpr = a_desc.nbytes_per_cta + b_desc.nbytes_per_cta
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM2
        off_n = (tile - pm * grid_n) * BN2
        for ks in range(k_steps):
            s = i % STAGES
            if MC_A:
                mbarrier.wait(empty_a.index(s), ((i // STAGES) & 1) ^ 1)
            if MC_B:
                mbarrier.wait(empty_b.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.wait(empty_l.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_load(a_desc, [off_m, ks * BK], bar, a_ring.index(s), multicast=MC_A)
            tma.async_load(b_desc, [ks * BK, off_n], bar, b_ring.index(s), multicast=MC_B)
            i += 1


@gluon.jit
def _consumer4(a_ring, b_ring, ready, empty_a, empty_b, empty_l, c_desc, aux_desc, epi_smem, aux_bar, num_tiles, grid_n,
               k_steps, STAGES: gl.constexpr, DGELU: gl.constexpr, APPROX: gl.constexpr):
    BM2: gl.constexpr = c_desc.block_shape[0]
    BN2: gl.constexpr = c_desc.block_shape[1]
    mma: gl.constexpr = MMA4_LAYOUT
    i = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM2
        off_n = (tile - pm * grid_n) * BN2
        acc = gl.zeros([BM2, BN2], gl.float32, mma)
        for ks in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ks > 0:
                mbarrier.arrive(empty_a.index((i - 1) % STAGES))
                mbarrier.arrive(empty_b.index((i - 1) % STAGES))
                mbarrier.arrive(empty_l.index((i - 1) % STAGES))
            if DGELU:
                if ks == 0:
                    tma.store_wait(pendings=0)
                    mbarrier.expect(aux_bar, aux_desc.nbytes_per_cta)
                    tma.async_load(aux_desc, [off_m, off_n], aux_bar, epi_smem)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_a.index((i - 1) % STAGES))
        mbarrier.arrive(empty_b.index((i - 1) % STAGES))
        mbarrier.arrive(empty_l.index((i - 1) % STAGES))
        if DGELU:
            mbarrier.wait(aux_bar, t & 1)
            pre = epi_smem.load(mma).to(gl.float32)
            if APPROX:
                out = (acc * _gelu_grad_approx(pre)).to(c_desc.dtype)
            else:
                out = (acc * _gelu_grad(pre)).to(c_desc.dtype)
        else:
            out = acc.to(c_desc.dtype)
            tma.store_wait(pendings=0)
        gl.barrier()
        epi_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], epi_smem)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def mc4_gemm_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, STAGES: gl.constexpr, DGELU: gl.constexpr,
                    APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr, MC_A: gl.constexpr, MC_B: gl.constexpr):
    BM2: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    BK: gl.constexpr = a_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM2) * grid_n
    k_steps = gl.cdiv(K, BK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    epi_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = gl.allocate_shared_memory(gl.int64, [STAGES, 2], MB4_EMPTY_A)
    empty_b = gl.allocate_shared_memory(gl.int64, [STAGES, 2], MB4_EMPTY_B)
    empty_l = mbarrier.allocate_mbarrier(batch=STAGES)
    aux_bar = mbarrier.allocate_mbarrier()
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
        mbarrier.init(empty_b.index(s), count=1)
        mbarrier.init(empty_l.index(s), count=1)
    mbarrier.init(aux_bar, count=1)
    gl.warp_specialize([
        (_consumer4, (a_ring, b_ring, ready, empty_a, empty_b, empty_l, c_desc, aux_desc, epi_smem, aux_bar,
                      num_tiles, grid_n, k_steps, STAGES, DGELU, APPROX)),
        (_producer4, (a_desc, b_desc, a_ring, b_ring, ready, empty_a, empty_b, empty_l, num_tiles, grid_n, k_steps,
                      STAGES, MC_A, MC_B)),
    ], [1], [PRODUCER_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def descriptors4(a, b, c, aux, BM=128, BN=128, BK=32):
    """BM x BN a CTA; the 2 x 2 cluster's tile is 2*BM x 2*BN (CTA id bit 0: N half, bit 1: M half)."""
    la = gl.NVMMASharedLayout.get_default_for([2 * BM, BK], gl.bfloat16, cga_layout=[[0, 0], [1, 0]])
    lb = gl.NVMMASharedLayout.get_default_for([BK, 2 * BN], gl.bfloat16, cga_layout=[[0, 1], [0, 0]])
    lc = gl.NVMMASharedLayout.get_default_for([2 * BM, 2 * BN], gl.bfloat16, cga_layout=[[0, 1], [1, 0]])
    return (TensorDescriptor.from_tensor(a, [2 * BM, BK], la), TensorDescriptor.from_tensor(b, [BK, 2 * BN], lb),
            TensorDescriptor.from_tensor(c, [2 * BM, 2 * BN], lc),
            TensorDescriptor.from_tensor(aux, [2 * BM, 2 * BN], lc))


def mc4_gemm(a, b, c, aux=None, BK=32, stages=4, approx=False, clusters=None, producer_regs=24, mc_a=True, mc_b=True):
    M, K = a.shape
    N = b.shape[1]
    ad, bd, cd, xd = descriptors4(a, b, c, aux if aux is not None else c, BK=BK)
    tiles = -(-M // 256) * -(-N // 256)
    if clusters is None:  # two CTAs an SM
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc4_gemm_kernel[(min(tiles, clusters),)](ad, bd, cd, xd, M, N, K, STAGES=stages, DGELU=aux is not None,
                                                    APPROX=approx, PRODUCER_REGS=producer_regs, MC_A=mc_a, MC_B=mc_b,
                                                    num_warps=4,
                                                    num_ctas=4, maxnreg=128)  # 2 x 256 threads x 128 an SM


# ------------------------------------------------------------------------------------------------------
# the epilogue interleaved with the next tile's products: the consumers park the fp32 accumulator in shared
# memory (128 kB a CTA) and, between issuing a k-step's wgmma and waiting for it, finish one 16-row slab of
# the previous tile (pre_gelu loaded two slabs ahead into registers, the result stored from registers).

IL_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0], cga_layout=[[0, 1]]))
IL_STAGING = gl.constexpr(gl.SwizzledSharedLayout(2, 1, 8, [1, 0], cga_layout=[[0, 1]]))


@gluon.jit
def _il_pre(pre_ptr, off_m, off_n, j: gl.constexpr, ROWS: gl.constexpr, BN2: gl.constexpr, M, N, stride):
    rows = off_m + j * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, IL_LAYOUT))
    cols = off_n + gl.arange(0, BN2, layout=gl.SliceLayout(0, IL_LAYOUT))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    offs = gl.expand_dims(rows.to(gl.int64), 1) * stride + gl.expand_dims(cols, 0).to(gl.int64)
    return gl.load(pre_ptr + offs, mask=mask, other=0.0)


@gluon.jit
def _il_slab(staging, pre, out_ptr, off_m, off_n, j: gl.constexpr, ROWS: gl.constexpr, BN2: gl.constexpr, M, N,
             stride, APPROX: gl.constexpr):
    acc = staging.slice(j * ROWS, ROWS, 0).load(IL_LAYOUT)
    x = pre.to(gl.float32)
    if APPROX:
        g = _gelu_grad_approx(x)
    else:
        g = _gelu_grad(x)
    res = acc * g
    rows = off_m + j * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, IL_LAYOUT))
    cols = off_n + gl.arange(0, BN2, layout=gl.SliceLayout(0, IL_LAYOUT))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    offs = gl.expand_dims(rows.to(gl.int64), 1) * stride + gl.expand_dims(cols, 0).to(gl.int64)
    gl.store(out_ptr + offs, res.to(gl.bfloat16), mask=mask)


@gluon.jit
def _il_consumer(a_ring, b_ring, ready, empty, empty_a, staging, out_ptr, pre_ptr, M, N, stride_out, stride_pre,
                 num_tiles, grid_n, STAGES: gl.constexpr, K_STEPS: gl.constexpr, ROWS: gl.constexpr,
                 APPROX: gl.constexpr):
    BM: gl.constexpr = staging.shape[0]
    BN2: gl.constexpr = staging.shape[1]
    NSLAB: gl.constexpr = BM // ROWS
    gl.static_assert(NSLAB + 2 <= K_STEPS)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN2 // 2, 16],
                                                  cga_layout=[[0, 1]])
    i = 0
    t = 0
    prev_m = 0
    prev_n = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        have_prev = t > 0
        p0 = _il_pre(pre_ptr, prev_m, prev_n, 0, ROWS, BN2, M * have_prev.to(gl.int32), N, stride_pre)
        p1 = _il_pre(pre_ptr, prev_m, prev_n, 1, ROWS, BN2, M * have_prev.to(gl.int32), N, stride_pre)
        acc = gl.zeros([BM, BN2], gl.float32, mma)
        for ks in gl.static_range(K_STEPS):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s), acc, is_async=True)
            if ks < NSLAB:
                if have_prev:
                    cur = p0
                    p0 = p1
                    if ks + 2 < NSLAB:
                        p1 = _il_pre(pre_ptr, prev_m, prev_n, ks + 2, ROWS, BN2, M, N, stride_pre)
                    _il_slab(staging, cur, out_ptr, prev_m, prev_n, ks, ROWS, BN2, M, N, stride_out, APPROX)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ks > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES))
                mbarrier.arrive(empty_a.index((i - 1) % STAGES))
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i - 1) % STAGES))
        mbarrier.arrive(empty_a.index((i - 1) % STAGES))
        gl.barrier()  # every slab of the previous tile is read before the accumulator overwrites it
        staging.store(acc)
        gl.barrier()
        prev_m = off_m
        prev_n = off_n
        t += 1
    if t > 0:  # the last tile's epilogue, not overlapped
        for j in gl.static_range(NSLAB):
            pre = _il_pre(pre_ptr, prev_m, prev_n, j, ROWS, BN2, M, N, stride_pre)
            _il_slab(staging, pre, out_ptr, prev_m, prev_n, j, ROWS, BN2, M, N, stride_out, APPROX)


@gluon.jit
def mc_il_kernel(a_desc, b_desc, out_ptr, pre_ptr, M, N, K, stride_out, stride_pre, STAGES: gl.constexpr,
                 K_STEPS: gl.constexpr, ROWS: gl.constexpr, APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM) * grid_n
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    staging = gl.allocate_shared_memory(gl.float32, [BM, BN2], IL_STAGING)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
    gl.warp_specialize([
        (_il_consumer, (a_ring, b_ring, ready, empty, empty_a, staging, out_ptr, pre_ptr, M, N, stride_out, stride_pre,
                        num_tiles, grid_n, STAGES, K_STEPS, ROWS, APPROX)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, K_STEPS, STAGES)),
    ], [1], [PRODUCER_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def mc_il(a, b, c, pre, BK=32, stages=4, approx=False, rows=16, clusters=None):
    M, K = a.shape
    N = b.shape[1]
    ad, bd, _, _ = descriptors(a, b, c, c, 256, 128, BK)
    tiles = -(-M // 256) * -(-N // 256)
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc_il_kernel[(min(tiles, clusters),)](ad, bd, c, pre, M, N, K, c.stride(0), pre.stride(0), STAGES=stages,
                                                 K_STEPS=-(-K // BK), ROWS=rows, APPROX=approx, PRODUCER_REGS=40,
                                                 num_warps=8, num_ctas=2)


# ------------------------------------------------------------------------------------------------------
# the experiment: correctness against float32 products, then do_bench against cuBLAS(Lt) at GPT-2's shape.
# Run on the GPU with triton >= 3.8 first on the path: python bench/kernels/try_multicast_gemm.py

VARIANTS = {
    "plain k32 s6": dict(BK=32, stages=6),
    "plain k32 s4": dict(BK=32, stages=4),
    "interleaved dgelu exact k32 s4": dict(BK=32, stages=4, dgelu=True, interleave=True),
    "interleaved dgelu approx k32 s4": dict(BK=32, stages=4, dgelu=True, interleave=True, approx=True),
}


def _gelu_grad_ref(x):
    z = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    t = torch.tanh(z)
    return 0.5 * (1 + t) + x * 0.5 * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x)


def _inputs(M, K, N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    b = (torch.randn(K, N, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    pre = (torch.randn(M, N, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return a, b, pre


def check(name, cfg):
    dgelu = cfg.get("dgelu", False)
    kw = {k: v for k, v in cfg.items() if k != "dgelu"}
    for M, K, N in [(512, 768, 512), (1000, 704, 640), (65536, 768, 3072)]:
        a, b, pre = _inputs(M, K, N)
        c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        mc_gemm(a, b, c, pre if dgelu else None, **kw)
        torch.cuda.synchronize()
        ref = a.float() @ b.float()
        if dgelu:
            ref = ref * _gelu_grad_ref(pre.float())
        err = (c.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        c2 = torch.full_like(c, float("nan"))
        mc_gemm(a, b, c2, pre if dgelu else None, **kw)
        same = torch.equal(c, c2)
        print(f"{name} M={M} K={K} N={N}: max err {err:.3e} of {scale:.2f}, nan {torch.isnan(c).any().item()}, "
              f"repeat bitwise {same}", flush=True)


def bench(names, rounds=3):
    import statistics
    from triton.testing import do_bench
    from llmpy.kernels import cublaslt
    M, K, N = 65536, 768, 3072
    a, b, pre = _inputs(M, K, N)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    fns = {"cuBLASLt DGELU epilogue (the model's)": lambda: cublaslt.linear_input_grad(out, a, b, pre_gelu=pre),
           "torch.mm, no epilogue": lambda: torch.mm(a, b, out=out)}
    for name in names:
        cfg = VARIANTS[name]
        kw = {k: v for k, v in cfg.items() if k != "dgelu"}
        fns[name] = lambda kw=kw, d=cfg.get("dgelu", False): mc_gemm(a, b, out, pre if d else None, **kw)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(do_bench(f, warmup=25, rep=200))
    for name, v in times.items():
        ms = statistics.median(v)
        print(f"{name:45s} {ms:.4f} ms  {2 * M * K * N / ms / 1e9:4.0f} TFLOP/s  rounds {['%.4f' % x for x in v]}",
              flush=True)


if __name__ == "__main__":
    import subprocess
    import sys
    if len(sys.argv) > 2 and sys.argv[1] == "--check":
        check(sys.argv[2], VARIANTS[sys.argv[2]])
    elif len(sys.argv) > 1 and sys.argv[1] == "--bench":
        bench(sys.argv[2:])
    else:
        ok = []
        for name in VARIANTS:  # each in its own process: a hang (a barrier never completing) costs one
            try:
                r = subprocess.run([sys.executable, __file__, "--check", name], timeout=45, capture_output=True,
                                   text=True)
                print(r.stdout + r.stderr[-3000:], flush=True)
                if r.returncode == 0 and "nan True" not in r.stdout:
                    ok.append(name)
            except subprocess.TimeoutExpired:
                print(f"{name}: TIMEOUT (hang?)", flush=True)
        if ok:
            r = subprocess.run([sys.executable, __file__, "--bench"] + ok, timeout=240, capture_output=True, text=True)
            print(r.stdout + r.stderr[-3000:], flush=True)
