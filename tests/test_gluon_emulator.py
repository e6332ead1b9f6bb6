"""The Gluon emulator (tests/gluon_emulator.py) on a small pipelined product written for it: right answers on
odd shapes in both TMA modes, and each pipeline mistake the library's kernels could make reported, not passed.

The kernels' own emulated tests are in test_flash_backward_wgmma.py and test_fused_classifier.py.
"""
import pytest
import torch

from gluon_guard import require_gluon
from llmpy.kernels.flash_backward_wgmma import GLUON

require_gluon(GLUON, module_level=True)

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from llmpy.kernels.gluon_compat import tma_load  # noqa: E402

import gluon_emulator as ge  # noqa: E402

# the mistakes _ring_product_kernel can be asked to make
BUGS = {
    "none": 0,
    "refill-before-retire": 1,  # a ring slot refilled while the product reading it is still in flight
    "product-before-wait": 2,   # a product issued on a slot before its TMA load was waited for
    "wrong-phase": 3,           # the barrier waited on with the tile's parity instead of the ring lap's
    "store-out-of-bounds": 4,   # the epilogue's mask forgets the last rows
    "never-retired": 5,         # the last product waited for with one still allowed in flight
    "tile-read-before-wait": 6, # a ring slot read into registers before its wait
}


@gluon.jit
def _ring_load(a_desc, b_desc, a_ring, b_ring, bars, j, m0, n0, BK: gl.constexpr, STAGES: gl.constexpr):
    slot = j % STAGES
    mbarrier.expect(bars.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [m0, j * BK], bars.index(slot), a_ring.index(slot))
    tma_load(b_desc, [j * BK, n0], bars.index(slot), b_ring.index(slot))


@gluon.jit
def _ring_product_kernel(a_desc, b_desc, out_ptr, M, N, K_TILES, BM: gl.constexpr, BN: gl.constexpr,
                         BK: gl.constexpr, STAGES: gl.constexpr, BUG: gl.constexpr, num_warps: gl.constexpr):
    """out[m0:m0+BM, n0:n0+BN] = a @ b, both operands through a TMA ring of STAGES slots, one asynchronous
    wgmma in flight: the pipeline of a Gluon product with its A tile from a TMA ring."""
    m0 = gl.program_id(0) * BM
    n0 = gl.program_id(1) * BN
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        if i < K_TILES:
            _ring_load(a_desc, b_desc, a_ring, b_ring, bars, i, m0, n0, BK, STAGES)
    acc = warpgroup_mma_init(gl.zeros([BM, BN], gl.float32, mma))
    for j in range(K_TILES):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        if BUG == 3:
            phase = j & 1
        a_op = a_ring.index(slot)
        if BUG == 6:  # A from registers, read before the wait
            a_op = a_ring.index(slot).load(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
        if BUG != 2:
            mbarrier.wait(bars.index(slot), phase)
        acc = warpgroup_mma(a_op, b_ring.index(slot), acc, is_async=True)
        if BUG == 2:
            mbarrier.wait(bars.index(slot), phase)
        if BUG != 1:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if j > 0:
            if j - 1 + STAGES < K_TILES:  # tile j - 1's slot takes tile j - 1 + STAGES
                _ring_load(a_desc, b_desc, a_ring, b_ring, bars, j - 1 + STAGES, m0, n0, BK, STAGES)
        if BUG == 1:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    if BUG == 5:
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    limit = M
    if BUG == 4:
        limit = M + BM
    mask = gl.expand_dims(rows < limit, 1) & gl.expand_dims(cols < N, 0)
    gl.store(out_ptr + gl.expand_dims(rows * N, 1) + gl.expand_dims(cols, 0), acc, mask=mask)


def _ring_product(a, b, bug="none", tma_loads="at-issue", BM=64, BN=32, BK=32, STAGES=2):
    M, K = a.shape
    N = b.shape[1]
    kernel = ge.emulate(_ring_product_kernel, tma_loads)
    layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], layout)
    b_desc = TensorDescriptor.from_tensor(b, [BK, BN], gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16))
    out = torch.full((M, N), float("nan"))
    kernel[(triton_cdiv(M, BM), triton_cdiv(N, BN))](a_desc, b_desc, out, M, N, triton_cdiv(K, BK), BM=BM, BN=BN,
                                                     BK=BK, STAGES=STAGES, BUG=BUGS[bug], num_warps=4)
    return out


def triton_cdiv(a, b):
    return -(-a // b)


def _operands(M, K, N, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=gen).to(torch.bfloat16), torch.randn(K, N, generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("tma_loads", ge.TMA_MODES)
@pytest.mark.parametrize("M,K,N,stages", [(200, 152, 40, 2), (64, 32, 32, 3), (131, 296, 72, 4)])
def test_ring_product_right_on_odd_shapes(tma_loads, M, K, N, stages):
    """Rows, columns and depth off the tiles (K and N on the 16-byte grid TMA needs): its zero fill past the
    edges, the masked epilogue."""
    a, b = _operands(M, K, N, seed=M + K)
    out = _ring_product(a, b, tma_loads=tma_loads, STAGES=stages)
    expected = a.double() @ b.double()
    assert (out.double() - expected).abs().max() < 1e-4 * expected.abs().max()


@pytest.mark.parametrize("bug,tma_loads,message", [
    ("refill-before-retire", "at-issue", "still in flight reads"),
    ("product-before-wait", "at-wait", "a warpgroup_mma of shared memory whose TMA load has not been waited"),
    ("tile-read-before-wait", "at-wait", "a shared-memory read of shared memory whose TMA load has not been"),
    ("wrong-phase", "at-issue", "would never return"),
    # a wait on the parity of a phase not yet begun returns at once, as on the GPU: the product then reads
    # a slot still loading
    ("wrong-phase", "at-wait", "TMA load has not been waited for"),
    ("store-out-of-bounds", "at-issue", "out_ptr: offsets"),
    ("never-retired", "at-issue", "never retired"),
])
def test_pipeline_mistakes_are_reported(bug, tma_loads, message):
    a, b = _operands(200, 152, 40, seed=1)
    with pytest.raises(ge.EmulationError, match=message):
        _ring_product(a, b, bug=bug, tma_loads=tma_loads)


def test_the_other_tma_mode_cannot_see_some_mistakes():
    """Why the kernels' tests run both modes: a load landing at its issue hides a read before the wait; one
    landing at the wait hides a refill under a product in flight (the product retires before the wait)."""
    a, b = _operands(200, 152, 40, seed=2)
    expected = a.double() @ b.double()
    for bug, blind in (("product-before-wait", "at-issue"), ("tile-read-before-wait", "at-issue")):
        out = _ring_product(a, b, bug=bug, tma_loads=blind)
        assert (out.double() - expected).abs().max() < 1e-4 * expected.abs().max()


def test_shared_memory_poison_and_store_dtype():
    """New shared memory is NaN (a read before any write shows), a store of another dtype is refused."""
    smem = ge._allocate_shared_memory(torch.bfloat16, [4, 8])
    assert torch.isnan(smem.data).all()
    ge._current = ge._Program((0, 0, 0), (1, 1, 1), "at-issue", "test")
    try:
        with pytest.raises(ge.EmulationError, match="shared-memory store of torch.float32"):
            smem.store(torch.zeros(4, 8))
    finally:
        ge._current = None
