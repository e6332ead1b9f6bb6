"""Experiment (run AJ): the DGELU product as a Gluon GEMM with ping-pong consumer warpgroups (triton >= 3.8).

out (M, N) = (a (M, K) @ b (K, N)) [* gelu'(pre (M, N))], GPT-2's fcproj input gradient at 65536 x 768 @ 768 x 3072.

Run AG (bench/RESULTS.md) built a GEMM in 2-CTA clusters with TMA multicast (`mc`, kept here as the baseline): two
consumer warpgroups cooperate on one 256 x 128 tile a CTA and match cuBLAS's plain product, but the DGELU epilogue
sits in their critical path (+0.17 ms). Here (`pp4`) each CTA's two consumer warpgroups take alternate tiles of
128 x 128, as CUTLASS's Hopper ping-pong kernels do, so that one warpgroup's epilogue runs while the other's
products keep the tensor cores busy. The CTAs form 2 x 2 clusters: A is multicast along the cluster's N pair and
B along its M pair, so a cluster's 256 x 256 of output reads as few bytes from L2 a FLOP as the 2-CTA kernel's.
One producer warp fills one ring in the order the two warpgroups consume it (tile n of the cluster's sequence goes
to warpgroup n % 2). Every kernel ends with a cluster barrier: a CTA that exits while another still arrives on
its barriers faults the launch (run AG)."""
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



def descriptors(a, b, c, aux, BM=256, BN=128, BK=64):
    """BN: a CTA's columns; the cluster's tile is BM x 2*BN."""
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16, cga_layout=[[0, 0]])
    lb = gl.NVMMASharedLayout.get_default_for([BK, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    lc = gl.NVMMASharedLayout.get_default_for([BM, 2 * BN], gl.bfloat16, cga_layout=[[0, 1]])
    return (TensorDescriptor.from_tensor(a, [BM, BK], la), TensorDescriptor.from_tensor(b, [BK, 2 * BN], lb),
            TensorDescriptor.from_tensor(c, [BM, 2 * BN], lc), TensorDescriptor.from_tensor(aux, [BM, 2 * BN], lc))



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
# ping-pong: 2 x 2 clusters of 128 x 128 CTA tiles, one CTA an SM, two consumer warpgroups a CTA on alternate
# tiles (the first is the default partition, the second a worker), one producer warp for both.

@gluon.jit
def _pp_consumer(a_ring, b_ring, ready, empty_a, empty_b, empty_l, c_desc, aux_desc, epi_smem, aux_bar, num_tiles,
                 grid_n, k_steps, STAGES: gl.constexpr, DGELU: gl.constexpr, APPROX: gl.constexpr, WG: gl.constexpr,
                 ORDERED: gl.constexpr, turn):
    BM2: gl.constexpr = c_desc.block_shape[0]
    BN2: gl.constexpr = c_desc.block_shape[1]
    mma: gl.constexpr = MMA4_LAYOUT
    nprog = gl.num_programs(0)
    n = WG  # this tile's place in the cluster's sequence, which the producer's ring follows
    t = 0
    for tile in range(gl.program_id(0) + WG * nprog, num_tiles, 2 * nprog):
        pm = tile // grid_n
        off_m = pm * BM2
        off_n = (tile - pm * grid_n) * BN2
        i = n * k_steps
        if ORDERED:  # tile n's products are issued once tile n - 1's all are (the other warpgroup's turn)
            if WG == 0:
                if t > 0:
                    mbarrier.wait(turn.index(0), (t - 1) & 1)
            else:
                mbarrier.wait(turn.index(1), t & 1)
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
        if ORDERED:
            mbarrier.arrive(turn.index(1 - WG))
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
        n += 2
    tma.store_wait(pendings=0)


@gluon.jit
def pp4_gemm_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, STAGES: gl.constexpr, DGELU: gl.constexpr,
                    APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    ORDERED: gl.constexpr):
    BM2: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    BK: gl.constexpr = a_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM2) * grid_n
    k_steps = gl.cdiv(K, BK)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    epi0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    epi1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = gl.allocate_shared_memory(gl.int64, [STAGES, 2], MB4_EMPTY_A)
    empty_b = gl.allocate_shared_memory(gl.int64, [STAGES, 2], MB4_EMPTY_B)
    empty_l = mbarrier.allocate_mbarrier(batch=STAGES)
    aux0 = mbarrier.allocate_mbarrier()
    aux1 = mbarrier.allocate_mbarrier()
    turn = mbarrier.allocate_mbarrier(batch=2)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
        mbarrier.init(empty_b.index(s), count=1)
        mbarrier.init(empty_l.index(s), count=1)
    mbarrier.init(aux0, count=1)
    mbarrier.init(aux1, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    gl.warp_specialize([
        (_pp_consumer, (a_ring, b_ring, ready, empty_a, empty_b, empty_l, c_desc, aux_desc, epi0, aux0, num_tiles,
                        grid_n, k_steps, STAGES, DGELU, APPROX, 0, ORDERED, turn)),
        (_producer4, (a_desc, b_desc, a_ring, b_ring, ready, empty_a, empty_b, empty_l, num_tiles, grid_n, k_steps,
                      STAGES, True, True)),
        (_pp_consumer, (a_ring, b_ring, ready, empty_a, empty_b, empty_l, c_desc, aux_desc, epi1, aux1, num_tiles,
                        grid_n, k_steps, STAGES, DGELU, APPROX, 1, ORDERED, turn)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def pp4_gemm(a, b, c, aux=None, BK=64, stages=4, approx=False, clusters=32, producer_regs=24, consumer_regs=240,
             ordered=False):
    """clusters: 2 x 2 clusters of one CTA an SM; 32 fit 128 of 132 SMs whatever the GPCs' sizes."""
    M, K = a.shape
    N = b.shape[1]
    ad, bd, cd, xd = descriptors4(a, b, c, aux if aux is not None else c, BK=BK)
    tiles = -(-M // 256) * -(-N // 256)
    return pp4_gemm_kernel[(min(tiles, clusters),)](ad, bd, cd, xd, M, N, K, STAGES=stages, DGELU=aux is not None,
                                                    APPROX=approx, PRODUCER_REGS=producer_regs,
                                                    CONSUMER_REGS=consumer_regs, ORDERED=ordered, num_warps=4,
                                                    num_ctas=4)



# ------------------------------------------------------------------------------------------------------
# mcd: run AG's cooperative 2-CTA kernel with the DGELU epilogue deferred into the next tile's products. At a
# tile's end the consumers round the accumulator to bf16 into `staging` (what the unfused path, a plain product
# then a DGELU pass, would store) and start the TMA load of that tile's pre_gelu into `buf`. During the next
# tile's k-steps LAG .. LAG + NSLAB - 1, between issuing a k-step's wgmma and waiting for it, they finish one
# slab of ROWS rows from shared memory (no global access in the slab), writing the result over pre_gelu in
# `buf`; at k-step LAG + NSLAB, one TMA store sends `buf` out.

SLAB_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0], cga_layout=[[0, 1]]))


@gluon.jit
def _mcd_slab(staging, buf, j: gl.constexpr, ROWS: gl.constexpr, APPROX: gl.constexpr, MODE: gl.constexpr):
    """MODE 0: the epilogue. Diagnostics (wrong results, for timing only): 1 the same shared-memory traffic without
    GELU's arithmetic; 2 the arithmetic on one load (pre_gelu not read); 3 nothing (buf leaves as loaded)."""
    if MODE == 0:
        x = staging.slice(j * ROWS, ROWS, 0).load(SLAB_LAYOUT).to(gl.float32)
        pre = buf.slice(j * ROWS, ROWS, 0).load(SLAB_LAYOUT).to(gl.float32)
        if APPROX:
            g = _gelu_grad_approx(pre)
        else:
            g = _gelu_grad(pre)
        buf.slice(j * ROWS, ROWS, 0).store((x * g).to(gl.bfloat16))
    elif MODE == 1:
        x = staging.slice(j * ROWS, ROWS, 0).load(SLAB_LAYOUT).to(gl.float32)
        pre = buf.slice(j * ROWS, ROWS, 0).load(SLAB_LAYOUT).to(gl.float32)
        buf.slice(j * ROWS, ROWS, 0).store((x * pre).to(gl.bfloat16))
    elif MODE == 2:
        x = staging.slice(j * ROWS, ROWS, 0).load(SLAB_LAYOUT).to(gl.float32)
        buf.slice(j * ROWS, ROWS, 0).store((x * _gelu_grad_approx(x)).to(gl.bfloat16))


@gluon.jit
def _mcd_consumer(a_ring, b_ring, ready, empty, empty_a, c_desc, aux_desc, staging, buf, aux_bar, num_tiles, grid_n,
                  STAGES: gl.constexpr, K_STEPS: gl.constexpr, ROWS: gl.constexpr, LAG: gl.constexpr,
                  APPROX: gl.constexpr, MODE: gl.constexpr):
    BM: gl.constexpr = c_desc.block_shape[0]
    BN2: gl.constexpr = c_desc.block_shape[1]
    NSLAB: gl.constexpr = BM // ROWS
    gl.static_assert(LAG + NSLAB < K_STEPS)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN2 // 2, 16], cga_layout=[[0, 1]])
    i = 0
    t = 0
    prev_m = 0
    prev_n = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pm = tile // grid_n
        off_m = pm * BM
        off_n = (tile - pm * grid_n) * BN2
        have_prev = t > 0
        acc = gl.zeros([BM, BN2], gl.float32, mma)
        for ks in gl.static_range(K_STEPS):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(s), b_ring.index(s), acc, is_async=True)
            if have_prev:
                if ks == LAG:
                    mbarrier.wait(aux_bar, (t - 1) & 1)
                if ks >= LAG:
                    if ks < LAG + NSLAB:
                        _mcd_slab(staging, buf, ks - LAG, ROWS, APPROX, MODE)
                if ks == LAG + NSLAB:
                    fence_async_shared()
                    gl.barrier()
                    tma.async_copy_shared_to_global(c_desc, [prev_m, prev_n], buf)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if ks > 0:
                mbarrier.arrive(empty.index((i - 1) % STAGES))
                mbarrier.arrive(empty_a.index((i - 1) % STAGES))
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i - 1) % STAGES))
        mbarrier.arrive(empty_a.index((i - 1) % STAGES))
        staging.store(acc.to(gl.bfloat16))
        tma.store_wait(pendings=0)  # the last tile's result has left buf before this tile's pre_gelu lands in it
        gl.barrier()
        mbarrier.expect(aux_bar, aux_desc.nbytes_per_cta)
        tma.async_load(aux_desc, [off_m, off_n], aux_bar, buf)
        prev_m = off_m
        prev_n = off_n
        t += 1
    if t > 0:  # the last tile's epilogue, not overlapped
        mbarrier.wait(aux_bar, (t - 1) & 1)
        for j in gl.static_range(NSLAB):
            _mcd_slab(staging, buf, j, ROWS, APPROX, MODE)
        fence_async_shared()
        gl.barrier()
        tma.async_copy_shared_to_global(c_desc, [prev_m, prev_n], buf)
    tma.store_wait(pendings=0)


@gluon.jit
def mcd_gemm_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, STAGES: gl.constexpr, K_STEPS: gl.constexpr,
                    ROWS: gl.constexpr, LAG: gl.constexpr, APPROX: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    MODE: gl.constexpr):
    BM: gl.constexpr = a_desc.block_shape[0]
    BN2: gl.constexpr = b_desc.block_shape[1]
    grid_n = gl.cdiv(N, BN2)
    num_tiles = gl.cdiv(M, BM) * grid_n
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    staging = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_a = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    aux_bar = mbarrier.allocate_mbarrier()
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
        mbarrier.init(empty_a.index(s), count=1)
    mbarrier.init(aux_bar, count=1)
    gl.warp_specialize([
        (_mcd_consumer, (a_ring, b_ring, ready, empty, empty_a, c_desc, aux_desc, staging, buf, aux_bar, num_tiles,
                         grid_n, STAGES, K_STEPS, ROWS, LAG, APPROX, MODE)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, empty_a, num_tiles, grid_n, K_STEPS, STAGES)),
    ], [1], [PRODUCER_REGS])
    cluster.barrier()  # no CTA exits while another may still arrive on its barriers


def mcd_gemm(a, b, c, aux, BK=32, stages=4, rows=16, lag=4, approx=True, clusters=None, producer_regs=40, mode=0):
    M, K = a.shape
    N = b.shape[1]
    ad, bd, cd, xd = descriptors(a, b, c, aux, 256, 128, BK)
    tiles = -(-M // 256) * -(-N // 256)
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mcd_gemm_kernel[(min(tiles, clusters),)](ad, bd, cd, xd, M, N, K, STAGES=stages, K_STEPS=-(-K // BK),
                                                    ROWS=rows, LAG=lag, APPROX=approx, PRODUCER_REGS=producer_regs,
                                                    MODE=mode, num_warps=8, num_ctas=2)


def mc_gemm(a, b, c, aux=None, BM=256, BN=128, BK=32, stages=6, approx=False, clusters=None, producer_regs=40):
    """Run AG's kernel: 2-CTA clusters, the two consumer warpgroups on one 256 x 128 tile a CTA."""
    M, K = a.shape
    N = b.shape[1]
    ad, bd, cd, xd = descriptors(a, b, c, aux if aux is not None else c, BM, BN, BK)
    tiles = -(-M // BM) * -(-N // (2 * BN))
    if clusters is None:
        clusters = torch.cuda.get_device_properties(a.device).multi_processor_count // 2
    return mc_gemm_kernel[(min(tiles, clusters),)](ad, bd, cd, xd, M, N, K, STAGES=stages, DGELU=aux is not None,
                                                   APPROX=approx, PRODUCER_REGS=producer_regs, CONSUMER_REGS=232,
                                                   ARRIVALS=1, num_warps=8, num_ctas=2)


# ------------------------------------------------------------------------------------------------------
# the experiment: correctness against float32 products, then do_bench against cuBLAS(Lt) at GPT-2's shape.
# Run on the GPU with triton >= 3.8 first on the path: python bench/kernels/try_pingpong_gemm.py [names]

VARIANTS = {
    "mc plain k32 s6": (mc_gemm, dict()),
    "mc dgelu approx k32 s6": (mc_gemm, dict(approx=True, dgelu=True)),
    "mcd dgelu approx k32 s4 r16": (mcd_gemm, dict(dgelu=True)),
    "mcd dgelu exact k32 s4 r16": (mcd_gemm, dict(dgelu=True, approx=False)),
    "mcd dgelu approx k32 s4 r16 lag2": (mcd_gemm, dict(dgelu=True, lag=2)),
    "mcd diag loads+store, no math": (mcd_gemm, dict(dgelu=True, mode=1)),
    "mcd diag math, one load": (mcd_gemm, dict(dgelu=True, mode=2)),
    "mcd diag no slab work": (mcd_gemm, dict(dgelu=True, mode=3)),
    "pp4 plain k64 s4": (pp4_gemm, dict(BK=64, stages=4)),
    "pp4 plain k32 s8": (pp4_gemm, dict(BK=32, stages=8)),
    "pp4 plain k64 s4 ordered": (pp4_gemm, dict(BK=64, stages=4, ordered=True)),
    "pp4 dgelu approx k64 s4": (pp4_gemm, dict(BK=64, stages=4, approx=True, dgelu=True)),
    "pp4 dgelu exact k64 s4": (pp4_gemm, dict(BK=64, stages=4, dgelu=True)),
    "pp4 dgelu approx k32 s8": (pp4_gemm, dict(BK=32, stages=8, approx=True, dgelu=True)),
    "pp4 dgelu approx k64 s4 ordered": (pp4_gemm, dict(BK=64, stages=4, approx=True, dgelu=True, ordered=True)),
    "pp4 dgelu exact k64 s4 ordered": (pp4_gemm, dict(BK=64, stages=4, dgelu=True, ordered=True)),
    "pp4 plain k32 s8 ordered": (pp4_gemm, dict(BK=32, stages=8, ordered=True)),
    "pp4 dgelu approx k32 s8 ordered": (pp4_gemm, dict(BK=32, stages=8, approx=True, dgelu=True, ordered=True)),
}


def _run(name, a, b, c, pre):
    fn, cfg = VARIANTS[name]
    kw = {k: v for k, v in cfg.items() if k != "dgelu"}
    return fn(a, b, c, pre if cfg.get("dgelu") else None, **kw)


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


def check(name):
    dgelu = VARIANTS[name][1].get("dgelu", False)
    for M, K, N in [(512, 768, 512), (1000, 704, 640), (65536, 768, 3072)]:
        a, b, pre = _inputs(M, K, N)
        c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        _run(name, a, b, c, pre)
        torch.cuda.synchronize()
        ref = a.float() @ b.float()
        if dgelu:
            ref = ref * _gelu_grad_ref(pre.float())
        err = (c.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        c2 = torch.full_like(c, float("nan"))
        _run(name, a, b, c2, pre)
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
        fns[name] = lambda name=name: _run(name, a, b, out, pre)
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
        check(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--bench":
        bench(sys.argv[2:])
    else:
        ok = []
        for name in sys.argv[1:] or VARIANTS:  # each in its own process: a hang (a barrier never completing) costs one
            try:
                r = subprocess.run([sys.executable, __file__, "--check", name], timeout=45, capture_output=True,
                                   text=True)
                print(r.stdout + r.stderr[-3000:], flush=True)
                if r.returncode == 0 and "nan True" not in r.stdout:
                    ok.append(name)
            except subprocess.TimeoutExpired:
                print(f"{name}: TIMEOUT (hang?)", flush=True)
        if ok:
            r = subprocess.run([sys.executable, __file__, "--bench"] + ok, timeout=300, capture_output=True, text=True)
            print(r.stdout + r.stderr[-3000:], flush=True)
