"""The LayerNorm and residual kernels against reference.py's functions of the same names.

CPU (Triton interpreter) on tiny, odd shapes; the GPU tests at GPT-2 124M shapes. Outputs are poisoned
with NaN before each call (accumulated ones are pre-filled with random values), and every output buffer
has a guard band after it that must survive (no stray writes past the masks).
"""

import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels import layernorm
from llmpy.kernels.layernorm import (LN_BACKWARD_CHUNKS, LN_BACKWARD_PROJ_CHUNKS, LN_BWD_SWEEP, LN_FWD_SWEEP,
                                     fused_residual_forward, layernorm_backward, layernorm_backward_scratch_shape,
                                     layernorm_forward, residual_forward)

F32, BF16 = torch.float32, torch.bfloat16
# ||out - ref|| / ||ref||: outputs stored in floatX
TOL = {F32: 1e-5, BF16: 1e-2}
# mean and rstd are fp32 computed from the same (rounded) inputs as the reference, whatever floatX is
STATS_TOL = 1e-5
SHAPES = [(2, 3, 64), (3, 5, 40), (1, 7, 24)]
DTYPES = [F32, BF16]
GUARD = 37  # elements after each output buffer that must stay untouched
SENTINEL = 1024.0  # exact in bf16


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bits(t):
    """The raw bits, so NaNs compare equal to themselves and -0.0 differs from 0.0."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def bitwise_equal(a, b):
    return torch.equal(bits(a), bits(b))


class Guarded:
    """A contiguous output tensor followed, in the same allocation, by GUARD sentinel elements."""

    def __init__(self, shape, dtype, device, fill=float("nan"), values=None):
        n = 1
        for s in shape:
            n *= s
        self.n = n
        self.buf = torch.full((n + GUARD,), SENTINEL, dtype=dtype, device=device)
        self.t = self.buf[:n].view(shape)
        if values is None:
            self.t.fill_(fill)
        else:
            self.t.copy_(values)

    def check_guard(self):
        assert torch.all(self.buf[self.n:] == SENTINEL), "write past the end of the output"


def make_gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, gen, device, dtype=F32, scale=1.0, shift=0.0):
    """Fresh normal values drawn on the CPU (reproducible), moved to device, stored in dtype."""
    return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


def ln_params(C, gen, device, dtype):
    weight = randn((C,), gen, device, dtype, scale=0.2, shift=1.0)
    bias = randn((C,), gen, device, dtype, scale=0.2)
    return weight, bias


# ----------------------------------------------------------------------------------------------------
# forward

def run_layernorm_forward(inp, weight, bias, **cfg):
    shape, N = inp.shape, inp.numel() // inp.shape[-1]
    out = Guarded(shape, inp.dtype, inp.device)
    mean = Guarded((N,), F32, inp.device)
    rstd = Guarded((N,), F32, inp.device)
    layernorm_forward(out.t, mean.t.view(shape[:-1]), rstd.t.view(shape[:-1]), inp, weight, bias, **cfg)
    for g in (out, mean, rstd):
        g.check_guard()
    return out.t, mean.t.view(shape[:-1]), rstd.t.view(shape[:-1])


def check_layernorm_forward(shape, dtype, device, seed, **cfg):
    gen = make_gen(seed)
    C = shape[-1]
    # a non-zero mean, so a one-pass E[x^2] - E[x]^2 variance would lose digits
    inp = randn(shape, gen, device, dtype, scale=2.0, shift=3.0)
    weight, bias = ln_params(C, gen, device, dtype)
    out, mean, rstd = run_layernorm_forward(inp, weight, bias, **cfg)
    r_out, r_mean, r_rstd = ref.layernorm_forward(inp.float(), weight.float(), bias.float())
    assert out.dtype == dtype and mean.dtype == F32 and rstd.dtype == F32
    assert rel_err(out, r_out) < TOL[dtype]
    assert rel_err(mean, r_mean) < STATS_TOL
    assert rel_err(rstd, r_rstd) < STATS_TOL
    # determinism: a second run into fresh poisoned outputs is bitwise the same
    out2, mean2, rstd2 = run_layernorm_forward(inp, weight, bias, **cfg)
    assert bitwise_equal(out, out2) and bitwise_equal(mean, mean2) and bitwise_equal(rstd, rstd2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_forward(shape, dtype, device):
    check_layernorm_forward(shape, dtype, device, seed=1)


def test_layernorm_forward_many_rows_per_program(device):
    # C=24 packs many rows per program: 37 rows leave the last program partly masked
    check_layernorm_forward((37, 24), F32, device, seed=2)


@pytest.mark.parametrize("name", list(LN_FWD_SWEEP))
def test_layernorm_forward_sweep_candidates(name, device):
    # every benchmarked tiling, persistent grids included (19 rows: the last block partly masked, and
    # fewer programs than blocks, so programs loop); fused_residual_forward with the same tiling agrees
    # C = 48 = 3 x 16 runs the three-piece kernels where the tiling asks for them
    cfg = LN_FWD_SWEEP[name]
    check_layernorm_forward((19, 40), BF16, device, seed=21, **cfg)
    check_fused((19, 40), BF16, device, seed=22, **cfg)
    check_layernorm_forward((19, 48), BF16, device, seed=23, **cfg)
    check_fused((19, 48), BF16, device, seed=24, **cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rows,num_warps", [((3, 5, 48), 4, 4), ((37, 96), 2, 1), ((2, 3, 768), 1, 2)])
def test_layernorm_forward_three_pieces(shape, rows, num_warps, dtype, device):
    # C = 3 x a power of two as three tiles without padding (pieces=3), persistent or not; row counts
    # that leave the last block partly masked
    for programs_per_sm, stages in ((0, 1), (2, 2)):
        cfg = dict(rows=rows, num_warps=num_warps, programs_per_sm=programs_per_sm, stages=stages, pieces=3)
        check_layernorm_forward(shape, dtype, device, seed=25, **cfg)
        check_fused(shape, dtype, device, seed=26, **cfg)


def test_layernorm_forward_three_pieces_runs_its_own_kernel(device, monkeypatch):
    # pieces=3 at C = 48 launches the three-piece kernels; where C does not split (40) or the bias column's
    # padding is wider than a piece (24 > 16), the one-tile kernels, bit for bit as pieces=1
    launched = []
    real = layernorm.launch_pipelined
    monkeypatch.setattr(layernorm, "launch_pipelined",
                        lambda kernel, *a, **k: launched.append(getattr(kernel, "fn", kernel).__name__)
                        or real(kernel, *a, **k))
    gen = make_gen(27)
    for C, pad, want in ((48, 8, "pieces3"), (40, 8, "_kernel"), (48, 24, "_kernel")):
        inp1, inp2 = randn((5, C), gen, device, BF16, scale=2.0), randn((5, C), gen, device, BF16)
        weight, bias = ln_params(C, gen, device, BF16)
        outs = []
        for pieces in (3, 1):
            wide = torch.full((5, C + pad), float("nan"), dtype=BF16, device=device)
            residual, mean, rstd = torch.empty_like(inp1), torch.empty(5, device=device), torch.empty(5, device=device)
            launched.clear()
            fused_residual_forward(residual, wide[:, :C], mean, rstd, inp1, inp2, weight, bias, bias_column=True,
                                   pieces=pieces)
            layernorm.layernorm_forward(wide[:, :C], mean, rstd, residual, weight, bias, bias_column=True,
                                        pieces=pieces)
            assert len(launched) == 2
            in_pieces = pieces == 3 and want == "pieces3"
            assert all((name == "_forward_pieces3_kernel") == in_pieces for name in launched)
            outs.append((wide, mean, rstd))
        if want != "pieces3":
            assert all(bitwise_equal(x, y) for x, y in zip(*outs))


def test_layernorm_forward_persistent_matches_one_block_per_program(device):
    # the persistent grid changes which program normalises a row, not the row's arithmetic
    gen = make_gen(23)
    inp = randn((45, 64), gen, device, BF16, scale=2.0, shift=1.0)
    weight, bias = ln_params(64, gen, device, BF16)
    a = run_layernorm_forward(inp, weight, bias, rows=2, num_warps=1, programs_per_sm=0)
    b = run_layernorm_forward(inp, weight, bias, rows=2, num_warps=1, programs_per_sm=3, stages=2)
    assert all(bitwise_equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------------
# residual

def check_residual_forward(shape, dtype, device, seed):
    gen = make_gen(seed)
    a, b = randn(shape, gen, device, dtype), randn(shape, gen, device, dtype)
    out = Guarded(shape, dtype, device)
    residual_forward(out.t, a, b)
    out.check_guard()
    # one fp32 add rounded once to floatX is exactly what torch does
    assert bitwise_equal(out.t, a + b)
    assert rel_err(out.t, ref.residual_forward(a.float(), b.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(3, 1500)])
def test_residual_forward(shape, dtype, device):
    # (3, 1500): 4500 values, more than one program's block, the last one masked
    check_residual_forward(shape, dtype, device, seed=3)


# ----------------------------------------------------------------------------------------------------
# fused residual + layernorm

def run_fused(inp1, inp2, weight, bias, **cfg):
    shape, N = inp1.shape, inp1.numel() // inp1.shape[-1]
    residual = Guarded(shape, inp1.dtype, inp1.device)
    normed = Guarded(shape, inp1.dtype, inp1.device)
    mean = Guarded((N,), F32, inp1.device)
    rstd = Guarded((N,), F32, inp1.device)
    fused_residual_forward(residual.t, normed.t, mean.t.view(shape[:-1]), rstd.t.view(shape[:-1]),
                           inp1, inp2, weight, bias, **cfg)
    for g in (residual, normed, mean, rstd):
        g.check_guard()
    return residual.t, normed.t, mean.t.view(shape[:-1]), rstd.t.view(shape[:-1])


def check_fused(shape, dtype, device, seed, **cfg):
    gen = make_gen(seed)
    C = shape[-1]
    inp1 = randn(shape, gen, device, dtype, scale=2.0, shift=1.0)
    inp2 = randn(shape, gen, device, dtype)
    weight, bias = ln_params(C, gen, device, dtype)
    res, normed, mean, rstd = run_fused(inp1, inp2, weight, bias, **cfg)
    r_res, r_normed, r_mean, r_rstd = ref.fused_residual_forward(inp1.float(), inp2.float(), weight.float(),
                                                                 bias.float())
    assert rel_err(res, r_res) < TOL[dtype]
    assert rel_err(normed, r_normed) < TOL[dtype]
    # the statistics are those of the residual as stored (rounded to floatX), the one the backward reads
    s_normed, s_mean, s_rstd = ref.layernorm_forward(res.float(), weight.float(), bias.float())
    assert rel_err(mean, s_mean) < STATS_TOL
    assert rel_err(rstd, s_rstd) < STATS_TOL
    assert rel_err(normed, s_normed) < TOL[dtype]
    # and the whole thing is residual_forward then layernorm_forward, bit for bit
    res2 = torch.full_like(res, float("nan"))
    residual_forward(res2, inp1, inp2)
    out2, mean2, rstd2 = run_layernorm_forward(res2, weight, bias, **cfg)
    assert bitwise_equal(res, res2) and bitwise_equal(normed, out2)
    assert bitwise_equal(mean, mean2) and bitwise_equal(rstd, rstd2)
    # determinism
    again = run_fused(inp1, inp2, weight, bias, **cfg)
    assert all(bitwise_equal(x, y) for x, y in zip((res, normed, mean, rstd), again))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_residual_forward(shape, dtype, device):
    check_fused(shape, dtype, device, seed=4)


def test_fused_residual_normalises_the_rounded_residual(device):
    # bf16: the stats of the stored residual differ measurably from those of the fp32 sum
    gen = make_gen(5)
    shape = (4, 64)
    inp1 = randn(shape, gen, device, BF16, scale=3.0, shift=2.0)
    inp2 = randn(shape, gen, device, BF16, scale=3.0)
    weight, bias = ln_params(64, gen, device, BF16)
    res, _, _, rstd = run_fused(inp1, inp2, weight, bias)
    _, _, rstd_rounded = ref.layernorm_forward(res.float(), weight.float(), bias.float())
    _, _, rstd_exact = ref.layernorm_forward(inp1.float() + inp2.float(), weight.float(), bias.float())
    assert rel_err(rstd_rounded, rstd_exact) > 10 * STATS_TOL  # the test can tell them apart
    assert rel_err(rstd, rstd_rounded) < STATS_TOL


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("shape,pad", [((2, 3, 64), 8), ((3, 5, 40), 8), ((1, 7, 24), 1), ((3, 5, 48), 8),
                                       ((2, 96), 32)])
def test_bias_column_rows(shape, pad, pieces, dtype, device):
    """bias_column: the normed rows into the first C columns of wider rows (NaN-poisoned), what a
    contiguous output gets (to rounding: on the GPU another row stride may compile to another order of the
    row sums), with column C set to 1 and the rest of the padding to 0 exactly; both kernels."""
    gen = make_gen(21)
    C = shape[-1]
    inp1 = randn(shape, gen, device, dtype, scale=2.0, shift=1.0)
    inp2 = randn(shape, gen, device, dtype)
    weight, bias = ln_params(C, gen, device, dtype)
    want_padding = torch.zeros(*shape[:-1], pad, dtype=dtype, device=device)
    want_padding[..., 0] = 1.0
    fused_out = run_fused(inp1, inp2, weight, bias, pieces=pieces)
    plain_out = run_layernorm_forward(fused_out[0], weight, bias, pieces=pieces)
    for fused in (False, True):
        wide = torch.full((*shape[:-1], C + pad), float("nan"), dtype=dtype, device=device)
        m, r = torch.empty_like(fused_out[2]), torch.empty_like(fused_out[3])
        if fused:
            residual = torch.empty_like(fused_out[0])
            fused_residual_forward(residual, wide[..., :C], m, r, inp1, inp2, weight, bias, bias_column=True,
                                   pieces=pieces)
            assert bitwise_equal(residual, fused_out[0])
            want = fused_out[1:]
        else:
            layernorm.layernorm_forward(wide[..., :C], m, r, fused_out[0], weight, bias, bias_column=True,
                                        pieces=pieces)
            want = plain_out
        assert rel_err(wide[..., :C], want[0]) < TOL[dtype]
        assert rel_err(m, want[1]) < STATS_TOL and rel_err(r, want[2]) < STATS_TOL
        assert bitwise_equal(wide[..., C:], want_padding)


def test_bias_column_needs_a_wider_view(device):
    x = torch.randn(4, 32, device=device)
    w, b = torch.ones(32, device=device), torch.zeros(32, device=device)
    mean, rstd = torch.empty(4, device=device), torch.empty(4, device=device)
    with pytest.raises(AssertionError, match="wider rows"):
        layernorm.layernorm_forward(torch.empty(4, 32, device=device), mean, rstd, x, w, b, bias_column=True)


# ----------------------------------------------------------------------------------------------------
# backward

def backward_inputs(shape, dtype, device, seed):
    gen = make_gen(seed)
    C = shape[-1]
    inp = randn(shape, gen, device, dtype, scale=2.0, shift=1.0)
    weight, _ = ln_params(C, gen, device, dtype)
    dout = randn(shape, gen, device, dtype)
    _, mean, rstd = ref.layernorm_forward(inp.float(), weight.float(), weight.float())
    # the accumulated outputs start from random values, not zeros
    dinp0 = randn(shape, gen, device, dtype, scale=0.5)
    dweight0 = randn((C,), gen, device, dtype)
    dbias0 = randn((C,), gen, device, dtype)
    return inp, weight, dout, mean.contiguous(), rstd.contiguous(), dinp0, dweight0, dbias0


def run_backward(inp, weight, dout, mean, rstd, dinp0, dweight0, dbias0, num_chunks=None, seed=0,
                 stochastic=None, dproj_bias0=None, proj_seed=0, **cfg):
    """(dinp, dweight, dbias), and dproj_bias last when dproj_bias0 (its starting values) is given."""
    shape, C = inp.shape, inp.shape[-1]
    N = inp.numel() // C
    proj = dproj_bias0 is not None
    if num_chunks is None:
        sshape = layernorm_backward_scratch_shape(N, C, proj_bias=proj)
    else:
        sshape = (num_chunks, 3 if proj else 2, C)
    scratch = Guarded(sshape, F32, inp.device)  # NaN: every chunk row must be written before it is read
    dinp = Guarded(shape, inp.dtype, inp.device, values=dinp0)
    dweight = Guarded((C,), dweight0.dtype, inp.device, values=dweight0)
    dbias = Guarded((C,), dbias0.dtype, inp.device, values=dbias0)
    outs = [scratch, dinp, dweight, dbias]
    extra = {}
    if proj:
        dproj = Guarded((C,), dproj_bias0.dtype, inp.device, values=dproj_bias0)
        outs.append(dproj)
        extra = dict(dproj_bias=dproj.t, proj_seed=proj_seed)
    layernorm_backward(dinp.t, dweight.t, dbias.t, scratch.t, dout, inp, weight, mean, rstd,
                       seed=seed, stochastic=stochastic, **extra, **cfg)
    for g in outs:
        g.check_guard()
    return tuple(g.t for g in outs[1:])


def check_backward(shape, dtype, device, seed, num_chunks=None, **cfg):
    args = backward_inputs(shape, dtype, device, seed)
    inp, weight, dout, mean, rstd, dinp0, dweight0, dbias0 = args
    dinp, dweight, dbias = run_backward(*args, num_chunks=num_chunks, seed=123, **cfg)
    r_dinp, r_dweight, r_dbias = ref.layernorm_backward(dout.float(), inp.float(), weight.float(), mean, rstd)
    assert rel_err(dinp, dinp0.float() + r_dinp) < TOL[dtype]
    assert rel_err(dweight, dweight0.float() + r_dweight) < TOL[dtype]
    assert rel_err(dbias, dbias0.float() + r_dbias) < TOL[dtype]
    if dtype == F32:  # the increments themselves, not hidden behind the pre-fill
        assert rel_err(dinp - dinp0, r_dinp) < 10 * TOL[dtype]
        assert rel_err(dweight - dweight0, r_dweight) < 10 * TOL[dtype]
        assert rel_err(dbias - dbias0, r_dbias) < 10 * TOL[dtype]
    # determinism: same inputs, same scratch shape, same seed -> the same bits
    again = run_backward(*args, num_chunks=num_chunks, seed=123, **cfg)
    assert all(bitwise_equal(x, y) for x, y in zip((dinp, dweight, dbias), again))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_backward(shape, dtype, device):
    check_backward(shape, dtype, device, seed=6)


@pytest.mark.parametrize("num_chunks", [1, 2, 4, 40])
def test_layernorm_backward_chunking(num_chunks, device):
    # 15 rows: one chunk loops over all of them; 2 and 4 give uneven chunks (the last one shorter); 40
    # leaves empty chunks, which must write zeros into their scratch rows
    check_backward((3, 5, 40), F32, device, seed=7, num_chunks=num_chunks)


@pytest.mark.parametrize("name", list(LN_BWD_SWEEP))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_backward_sweep_candidates(name, dtype, device):
    # every benchmarked tiling; 37 rows in 3 chunks of 13 (not a multiple of the rows per iteration);
    # the swept chunk counts need more rows than a CPU test has and are covered by the chunking test
    cfg = {k: v for k, v in LN_BWD_SWEEP[name].items() if k != "chunks"}
    check_backward((37, 40), dtype, device, seed=24, num_chunks=3, **cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_backward_reduce_loops_over_chunk_blocks(dtype, device, monkeypatch):
    # the second level sums REDUCE_BLOCK_K (512) chunks a step, so the default 1024 chunks take two steps on
    # the GPU; more than 512 here would take as many first-level programs, ~2.7 s a call in the interpreter.
    # With a block of 8 the same loop takes three steps over 20 chunks, the last partial; 39 rows put at
    # least one row in every chunk (an empty chunk's zeros would hide a step that is skipped); with the
    # projection's bias (a third sum in the same loop) too
    monkeypatch.setattr(layernorm, "REDUCE_BLOCK_K", 8)
    check_backward((39, 40), dtype, device, seed=71, num_chunks=20)
    check_backward_proj_bias((39, 40), dtype, device, seed=72, num_chunks=20)


def test_layernorm_backward_scratch_shape():
    assert layernorm_backward_scratch_shape(15, 40) == (15, 2, 40)
    assert layernorm_backward_scratch_shape(64 * 1024, 768) == (LN_BACKWARD_CHUNKS, 2, 768)
    assert layernorm_backward_scratch_shape(64 * 1024, 768, proj_bias=True) == (LN_BACKWARD_PROJ_CHUNKS, 3, 768)
    assert layernorm_backward_scratch_shape(64 * 1024, 768, 512, proj_bias=True) == (512, 3, 768)


def check_backward_proj_bias(shape, dtype, device, seed, num_chunks=None, **cfg):
    """dproj_bias += the column sums of dinp as stored after the call (what matmul_backward's bias
    reduction of the projection would read); dinp bitwise that of the call without it, dweight/dbias
    too in bf16 and within a few fp32 ulps in fp32; the same bits again on a second call."""
    args = backward_inputs(shape, dtype, device, seed)
    C = shape[-1]
    dproj0 = randn((C,), make_gen(seed + 1000), device, dtype)
    # bf16: stochastic rounding, seeds as a graph passes them (device tensors)
    seeds = dict(seed=torch.tensor([5], device=device), proj_seed=torch.tensor([9], device=device))
    # the plain call with the same chunks and tiles (its defaults differ: LN_BACKWARD_CHUNKS, BWD_PIECES)
    inp_rows = args[0].numel() // C
    if num_chunks is None:
        num_chunks = layernorm_backward_scratch_shape(inp_rows, C, proj_bias=True)[0]
    cfg.setdefault("pieces", layernorm.BWD_PIECES_PROJ)
    dinp, dweight, dbias, dproj = run_backward(*args, num_chunks=num_chunks, dproj_bias0=dproj0, **seeds, **cfg)
    plain = run_backward(*args, num_chunks=num_chunks, seed=seeds["seed"], **cfg)
    assert bitwise_equal(dinp, plain[0])
    if dtype == F32:
        # the extra accumulator is a different compilation: on the H200 at C = 40 Triton reduced the chunk
        # sums of dweight/dbias in another order (up to 2e-6 off; bitwise at C = 64 and 768). bf16's rounding
        # of the result absorbs that (bitwise at every shape there), which is what the model trains in.
        for x, y in zip((dweight, dbias), plain[1:]):
            assert torch.allclose(x, y, rtol=1e-6, atol=1e-5)
    else:
        assert bitwise_equal(dweight, plain[1]) and bitwise_equal(dbias, plain[2])
    expect = dproj0.double() + dinp.double().reshape(-1, C).sum(0)
    assert rel_err(dproj, expect) < TOL[dtype]
    if dtype == F32:
        assert rel_err(dproj - dproj0, expect - dproj0.double()) < 10 * TOL[dtype]
    else:  # stochastic: within one bf16 ulp of the exact sum
        assert torch.all((dproj.double() - expect).abs() <= expect.abs() * 2.0 ** -7 * (1 + 1e-3) + 1e-5)
    again = run_backward(*args, num_chunks=num_chunks, dproj_bias0=dproj0, **seeds, **cfg)
    assert all(bitwise_equal(x, y) for x, y in zip((dinp, dweight, dbias, dproj), again))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,num_chunks", [((2, 3, 64), None), ((3, 5, 40), 4), ((37, 40), 40)])
def test_layernorm_backward_proj_bias(shape, num_chunks, dtype, device):
    check_backward_proj_bias(shape, dtype, device, seed=41, num_chunks=num_chunks)


@pytest.mark.parametrize("name", list(LN_BWD_SWEEP))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_backward_proj_bias_sweep_candidates(name, dtype, device):
    # every benchmarked tiling with the projection's bias summed along (bench_layernorm times both)
    cfg = {k: v for k, v in LN_BWD_SWEEP[name].items() if k != "chunks"}
    check_backward_proj_bias((37, 40), dtype, device, seed=25, num_chunks=3, **cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,pieces", [((3, 5, 40), 1), ((37, 48), 3)])
def test_layernorm_backward_proj_sum(shape, pieces, dtype, device):
    """dproj_sum (poisoned first) receives, in fp32, what the call adds to dproj_bias: the column sums of
    dinp as stored; dproj_bias and the rest bit for bit as without it."""
    args = backward_inputs(shape, dtype, device, seed=61)
    C = shape[-1]
    dproj0 = randn((C,), make_gen(62), device, dtype)
    seeds = dict(seed=torch.tensor([5], device=device), proj_seed=torch.tensor([9], device=device))
    without = run_backward(*args, num_chunks=3, dproj_bias0=dproj0, pieces=pieces, **seeds)
    proj_sum = Guarded((C,), F32, device)
    with_sum = run_backward(*args, num_chunks=3, dproj_bias0=dproj0, pieces=pieces, dproj_sum=proj_sum.t, **seeds)
    proj_sum.check_guard()
    assert all(bitwise_equal(x, y) for x, y in zip(without, with_sum))
    dinp = with_sum[0]
    assert rel_err(proj_sum.t, dinp.double().reshape(-1, C).sum(0)) < 1e-6
    if dtype == F32:
        assert rel_err(with_sum[3] - dproj0, proj_sum.t) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,num_chunks,rows", [((37, 48), 3, 1), ((2, 5, 96), 4, 2), ((3, 48), 8, 2)])
def test_layernorm_backward_three_pieces(shape, num_chunks, rows, dtype, device):
    # C = 3 x a power of two as three tiles without padding (pieces=3); 8 chunks over 3 rows leave empty
    # chunks, 37 rows in 3 chunks and 10 rows at 2 a time leave partial iterations
    check_backward(shape, dtype, device, seed=51, num_chunks=num_chunks, pieces=3, rows=rows, num_warps=2)
    check_backward_proj_bias(shape, dtype, device, seed=52, num_chunks=num_chunks, pieces=3, rows=rows,
                             num_warps=2)


def test_layernorm_backward_three_pieces_falls_back_where_c_does_not_split(device):
    # C = 40 is not 3 x a power of two: pieces=3 runs the one-tile kernel, bit for bit
    args = backward_inputs((5, 40), F32, device, seed=53)
    assert all(bitwise_equal(x, y) for x, y in zip(run_backward(*args, num_chunks=2, pieces=3),
                                                    run_backward(*args, num_chunks=2)))


def test_layernorm_backward_stochastic_rounding(device):
    args = backward_inputs((2, 3, 64), BF16, device, seed=8)
    inp, weight, dout, mean, rstd, dinp0, dweight0, dbias0 = args
    _, r_dweight, r_dbias = ref.layernorm_backward(dout.float(), inp.float(), weight.float(), mean, rstd)
    exact = torch.cat([dweight0.float() + r_dweight, dbias0.float() + r_dbias])
    nearest = exact.to(BF16)
    results = {}
    for seed in (1, 2):
        _, dw, db = run_backward(*args, seed=seed)
        got = torch.cat([dw, db])
        # within one bf16 ulp (at most 2^-7 relative) of the fp32 sum, rounded up or down
        assert torch.all((got.float() - exact).abs() <= exact.abs() * 2.0 ** -7 * (1 + 1e-3))
        # stochastic: some values went the other way than round-to-nearest (expected ~1/4 of them)
        assert int((got != nearest).sum()) > 0
        results[seed] = got
    assert not bitwise_equal(results[1], results[2])  # another seed, other roundings
    # the seed read from device memory (CUDA-graph friendly) is the same seed
    _, dw, db = run_backward(*args, seed=torch.tensor([2], dtype=torch.int64, device=device))
    assert bitwise_equal(torch.cat([dw, db]), results[2])
    # stochastic=False: round to nearest, at most half an ulp off
    _, dw, db = run_backward(*args, seed=1, stochastic=False)
    got = torch.cat([dw, db])
    assert torch.all((got.float() - exact).abs() <= exact.abs() * 2.0 ** -8 * (1 + 1e-3))


def test_layernorm_backward_stochastic_rounding_is_unbiased(device):
    # dbias += an increment of ~0.45 ulp: round-to-nearest (or truncation) would never move it;
    # stochastic rounding moves it by the increment on average over seeds
    gen = make_gen(9)
    shape, C = (1, 2, 64), 64
    inp = randn(shape, gen, device, BF16, scale=2.0)
    weight, _ = ln_params(C, gen, device, BF16)
    _, mean, rstd = ref.layernorm_forward(inp.float(), weight.float(), weight.float())
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    dout = ((torch.rand(shape, generator=gen) * 0.1 + 0.95) * 0.45 * ulp / 2).to(device=device, dtype=BF16)
    dbias0 = (1.0 + torch.rand(C, generator=gen) * 0.5).to(device=device, dtype=BF16)
    dinp0 = torch.zeros(shape, dtype=BF16, device=device)
    increment = dout.float().sum((0, 1))
    assert torch.all(increment < 0.5 * ulp)
    moved = torch.zeros(C, dtype=torch.float64, device=device)
    n_seeds = 12  # 768 samples: the ratio below has a standard deviation of ~0.04
    for seed in range(n_seeds):
        _, _, db = run_backward(inp, weight, dout, mean, rstd, dinp0, dbias0.clone(), dbias0, num_chunks=1,
                                seed=seed)
        moved += (db.float() - dbias0.float()).double()
    ratio = float(moved.sum() / n_seeds / increment.double().sum())
    assert abs(ratio - 1.0) < 0.2, ratio


# ----------------------------------------------------------------------------------------------------
# GPU: GPT-2 124M shapes, bf16, against the reference in fp32 on the GPU

GPU_SHAPES = [(4, 1024, 768), (16, 1024, 768), (64, 1024, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_layernorm_forward(shape):
    check_layernorm_forward(shape, BF16, "cuda", seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_residual_forward(shape):
    check_residual_forward(shape, BF16, "cuda", seed=12)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_fused_residual_forward(shape):
    check_fused(shape, BF16, "cuda", seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_layernorm_backward(shape):
    check_backward(shape, BF16, "cuda", seed=14)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_layernorm_backward_proj_bias(dtype):
    check_backward_proj_bias((16, 1024, 768), dtype, "cuda", seed=18)


@pytest.mark.gpu
def test_gpu_layernorm_fp32_storage():
    check_layernorm_forward((4, 1024, 768), F32, "cuda", seed=15)
    check_fused((4, 1024, 768), F32, "cuda", seed=16)
    check_backward((4, 1024, 768), F32, "cuda", seed=17)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LN_FWD_SWEEP))
def test_gpu_layernorm_forward_sweep_candidates(name):
    # each benchmarked forward tiling at GPT-2 shapes; fused == residual + layernorm, bit for bit
    check_layernorm_forward((8, 1024, 768), BF16, "cuda", seed=31, **LN_FWD_SWEEP[name])
    check_fused((8, 1024, 768), BF16, "cuda", seed=32, **LN_FWD_SWEEP[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LN_BWD_SWEEP))
def test_gpu_layernorm_backward_sweep_candidates(name):
    cfg = dict(LN_BWD_SWEEP[name])
    chunks = cfg.pop("chunks")
    check_backward((16, 1024, 768), BF16, "cuda", seed=33, num_chunks=chunks, **cfg)
