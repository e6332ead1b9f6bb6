"""Encoder kernels against reference.encoder_forward / encoder_backward.

The backward accumulates (dwte, dwpe pre-filled with random values), must be atomic-free and bitwise
reproducible, and rounds bf16 gradients stochastically. Its dwte kernel walks the sorted positions in
fixed chunks and tiles: the `piece` (chunk), `tile` and `block_c` arguments make runs cross tile, chunk
and column-block boundaries on tiny inputs; every configuration the benchmark sweeps is run here too.
"""

import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.encoder import (ENC_COMBINE_TILE, WPE_SWEEP, WTE_SWEEP, encoder_backward,
                                   encoder_backward_scratch, encoder_backward_sort, encoder_forward,
                                   wpe_backward)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
# (B, T, C, Vp, maxT): C = 64, odd C = 40 and 24 (masked column blocks), odd B*T, T < maxT
SHAPES = [(2, 3, 64, 64, 8), (3, 5, 40, 50, 7), (1, 7, 24, 30, 9), (2, 16, 64, 64, 16)]
IDS_DTYPES = [torch.int32, torch.int64]  # the model's ids (and its sort scratch) are int32
# the gradient's dtype and the ids' meet nowhere in the kernels (the ids only index): where the product of both
# costs too much, the int64 ids of the earlier tests in both dtypes, and the model's int32 ids with bf16 gradients
DTYPE_IDS = [pytest.param(torch.float32, torch.int64, id="fp32-int64"),
             pytest.param(torch.bfloat16, torch.int64, id="bf16-int64"),
             pytest.param(torch.bfloat16, torch.int32, id="bf16-int32")]


def rel_err(out, expected):
    out, expected = out.double(), expected.to(out.device).double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def make_ids(kind, B, T, Vp, gen):
    if kind == "random":  # few distinct ids: many repeats
        return torch.randint(0, min(Vp, 7), (B, T), generator=gen)
    if kind == "same":  # one token everywhere: one run of B*T
        return torch.full((B, T), Vp - 1, dtype=torch.int64)
    if kind == "distinct":
        return torch.randperm(Vp, generator=gen)[: B * T].reshape(B, T) if B * T <= Vp else \
            torch.randint(0, Vp, (B, T), generator=gen)
    if kind == "mixed":  # one common token among random ones, runs of every length
        ids = torch.randint(0, Vp, (B, T), generator=gen)
        ids[torch.rand(B, T, generator=gen) < 0.5] = 3
        return ids
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", IDS_DTYPES)
@pytest.mark.parametrize("B,T,C,Vp,maxT", SHAPES)
def test_encoder_forward(device, dtype, ids_dtype, B, T, C, Vp, maxT):
    gen = torch.Generator().manual_seed(B * 100 + C)
    inp = make_ids("mixed", B, T, Vp, gen).to(ids_dtype)
    wte = torch.randn(Vp, C, generator=gen).to(dtype)
    wpe = torch.randn(maxT, C, generator=gen).to(dtype)
    out = torch.full((B, T, C), float("nan"), dtype=dtype, device=device)
    encoder_forward(out, inp.to(device), wte.to(device), wpe.to(device))
    expected = ref.encoder_forward(inp.long(), wte.float(), wpe.float())
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) elements"
    assert rel_err(out.float().cpu(), expected) < TOL[dtype]
    out2 = torch.full_like(out, float("nan"))
    encoder_forward(out2, inp.to(device), wte.to(device), wpe.to(device))
    assert torch.equal(out, out2)


def run_backward(dout, inp, dwte0, dwpe0, device, seed=1234, **kw):
    dwte, dwpe = dwte0.clone().to(device), dwpe0.clone().to(device)
    encoder_backward(dwte, dwpe, dout.to(device), inp.to(device), seed, **kw)
    return dwte, dwpe


def backward_case(B, T, C, Vp, maxT, dtype, kind, seed, ids_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    inp = make_ids(kind, B, T, Vp, gen).to(ids_dtype)
    dout = torch.randn(B, T, C, generator=gen).to(dtype)
    dwte0 = torch.randn(Vp, C, generator=gen).to(dtype)
    dwpe0 = torch.randn(maxT, C, generator=gen).to(dtype)
    return inp, dout, dwte0, dwpe0


def check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, dtype):
    """Everything on the kernel's device; the reference in fp32 from the same (bf16-rounded) inputs."""
    dev = dwte.device
    inp, dout, dwte0, dwpe0 = inp.to(dev), dout.to(dev), dwte0.to(dev), dwpe0.to(dev)
    B, T, C = dout.shape
    Vp, maxT = dwte0.shape[0], dwpe0.shape[0]
    with torch.device(dev):  # reference.encoder_backward allocates its outputs on the default device
        g_wte, g_wpe = ref.encoder_backward(dout.float(), inp.long(), Vp, maxT)
    exp_wte, exp_wpe = dwte0.float() + g_wte, dwpe0.float() + g_wpe
    assert rel_err(dwte.float(), exp_wte) < TOL[dtype]
    assert rel_err(dwpe.float(), exp_wpe) < TOL[dtype]
    # rows of tokens that do not occur and positions >= T are left exactly as they were
    untouched = torch.ones(Vp, dtype=torch.bool, device=dev)
    untouched[inp.reshape(-1).long()] = False
    assert torch.equal(dwte[untouched], dwte0[untouched])
    assert torch.equal(dwpe[T:], dwpe0[T:])
    # each touched row is close to its own expectation (a wrong row would hide in a global norm)
    touched = ~untouched
    row_err = (dwte.float()[touched] - exp_wte[touched]).norm(dim=1) / exp_wte[touched].norm(dim=1)
    assert float(row_err.max()) < 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", IDS_DTYPES, ids=["int32", "int64"])
@pytest.mark.parametrize("kind,B,T,C,Vp,maxT", [("random", *SHAPES[0]), ("mixed", *SHAPES[1]), ("same", *SHAPES[2]),
                                                ("distinct", *SHAPES[3]), ("mixed", *SHAPES[3]),
                                                ("same", *SHAPES[1])])
def test_encoder_backward(device, dtype, ids_dtype, kind, B, T, C, Vp, maxT):
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, dtype, kind, seed=B * 1000 + T * 10 + C,
                                            ids_dtype=ids_dtype)
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, dtype)


# (kind, piece, tile, block_c, scan) on (B, T, C) = (3, 7, 40): 21 sorted positions in chunks of `piece`,
# walked in tiles of `tile`, over column blocks of `block_c` (16: three blocks, the last one partial)
CHUNK_CASES = [
    ("same", 1, 2, 16, True),      # one run over every chunk; chunks shorter than the run and than a tile
    ("same", 4, 2, 64, False),     # one run, two tiles per chunk (the carry), 6 chunks combined
    ("same", 7, 8, 16, True),      # 3 whole chunks: the run starts on a chunk boundary and ends on one
    ("mixed", 3, 4, 16, True),     # tiles longer than chunks (masked rows); runs crossing boundaries
    ("mixed", 8, 2, 32, True),     # four tiles per chunk, runs crossing tiles and chunks
    ("mixed", 2, 2, 64, False),
    ("random", 5, 4, 16, True),    # 7 distinct ids: runs of ~3 crossing most boundaries
    ("random", 4, 16, 64, False),
    ("distinct", 4, 2, 16, True),  # no run crosses anything
]


@pytest.mark.parametrize("dtype,ids_dtype", DTYPE_IDS)
@pytest.mark.parametrize("kind,piece,tile,block_c,scan", CHUNK_CASES)
def test_encoder_backward_chunks(device, dtype, ids_dtype, kind, piece, tile, block_c, scan):
    """Runs cut by tile and chunk boundaries (partial sums, carries, the fix-up), partial column blocks,
    both forms of the segmented sums; twice, bit for bit."""
    B, T, C, Vp, maxT = 3, 7, 40, 48, 9
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, dtype, kind, seed=piece * 10 + tile,
                                            ids_dtype=ids_dtype)
    kw = dict(piece=piece, tile=tile, block_c=block_c, scan=scan)
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device, **kw)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, dtype)
    again = run_backward(dout, inp, dwte0, dwpe0, device, **kw)
    assert torch.equal(dwte, again[0]) and torch.equal(dwpe, again[1])


@pytest.mark.parametrize("dtype,ids_dtype", DTYPE_IDS)
def test_encoder_backward_run_over_many_chunks(device, dtype, ids_dtype):
    """A run over more chunks than the fix-up adds per iteration (ENC_COMBINE_TILE): its loop goes on."""
    B, T, C, Vp, maxT = 2, 4 + ENC_COMBINE_TILE // 2, 24, 16, 4 + ENC_COMBINE_TILE // 2
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, dtype, "same", seed=13, ids_dtype=ids_dtype)
    inp[0, 0] = 2  # one short run first: the long one (39 chunks of 1) starts in the second chunk
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device, piece=1, tile=2, block_c=16)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, dtype)


def test_encoder_backward_scan_matches_masked_sum(device):
    """The associative scan and the masked reduction compute the same run sums (fp32, up to rounding)."""
    B, T, C, Vp, maxT = 2, 12, 24, 20, 12
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.float32, "random", seed=3)
    a = run_backward(dout, inp, dwte0, dwpe0, device, piece=6, tile=4, block_c=16, scan=True)
    b = run_backward(dout, inp, dwte0, dwpe0, device, piece=6, tile=4, block_c=16, scan=False)
    assert rel_err(a[0], b[0]) < 1e-6 and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name", list(WTE_SWEEP))
def test_encoder_backward_sweep_candidates(device, name):
    """Every configuration the benchmark sweeps (chunk, tile, column block, rounding) is correct: bf16 with
    stochastic rounding, one long run and runs crossing chunks. (The interpreter ignores warps, stages and
    register caps; the GPU test below runs them for real.)"""
    B, T, C, Vp, maxT = 2, 40, 24, 64, 40
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.bfloat16, "mixed", seed=len(name))
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device, **WTE_SWEEP[name])
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, torch.bfloat16)


@pytest.mark.parametrize("name", list(WPE_SWEEP))
@pytest.mark.parametrize("dtype", DTYPES)
def test_wpe_backward_configs(device, dtype, name):
    """dwpe with every swept tiling: B=3 not a multiple of the unroll, T=7 and C=40 not multiples of the tile."""
    B, T, C, maxT = 3, 7, 40, 9
    gen = torch.Generator().manual_seed(21)
    dout = torch.randn(B, T, C, generator=gen).to(dtype)
    dwpe0 = torch.randn(maxT, C, generator=gen).to(dtype)
    dwpe = dwpe0.clone().to(device)
    wpe_backward(dwpe, dout.to(device), 99, 1000, **WPE_SWEEP[name])
    expected = dwpe0.float() + torch.cat([dout.float().sum(0), torch.zeros(maxT - T, C)])
    assert rel_err(dwpe.float().cpu(), expected) < TOL[dtype]
    assert torch.equal(dwpe[T:].cpu(), dwpe0[T:])


def test_encoder_backward_scratch_contents_do_not_matter(device):
    """The scratch may hold anything (NaN partials, stale sort results) and may be larger than needed;
    one too small is refused."""
    B, T, C, Vp, maxT = 3, 7, 40, 48, 9
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.float32, "mixed", seed=5)
    clean = run_backward(dout, inp, dwte0, dwpe0, device, piece=2, tile=2)
    scratch = encoder_backward_scratch(B, T, C, device, torch.int64, piece=1)  # room for piece=1
    scratch.partial.fill_(float("nan"))
    scratch.sorted_ids.fill_(3)
    scratch.perm.fill_(-7)
    dirty = run_backward(dout, inp, dwte0, dwpe0, device, piece=2, tile=2, scratch=scratch)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    small = encoder_backward_scratch(B, T, C, device, torch.int64, piece=4)
    with pytest.raises(AssertionError):
        run_backward(dout, inp, dwte0, dwpe0, device, piece=2, scratch=small)


def test_encoder_backward_strided_scratch_rejected(device):
    """The kernels read the sorted ids and the permutation as contiguous rows (torch.sort writes strided
    ones faithfully): a strided scratch is an error, not a scatter by the wrong ids."""
    from llmpy.kernels.encoder import EncoderBackwardScratch
    B, T, C, Vp, maxT = 2, 5, 24, 16, 8
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.float32, "mixed", seed=6)
    good = encoder_backward_scratch(B, T, C, device, torch.int64, piece=2)
    for field, dtype in (("sorted_ids", torch.int64), ("perm", torch.int64)):
        strided = torch.zeros(2 * B * T, dtype=dtype, device=device)[::2]
        scratch = EncoderBackwardScratch(**{**vars(good), field: strided})
        with pytest.raises(AssertionError):
            run_backward(dout, inp, dwte0, dwpe0, device, piece=2, scratch=scratch)


@pytest.mark.parametrize("dtype,ids_dtype", DTYPE_IDS)
def test_encoder_backward_deterministic_and_scratch(device, dtype, ids_dtype):
    """Same inputs and seed: the same bits; a preallocated scratch (of the ids' dtype: the model's int32 one) and
    a tensor seed give the same bits, against the reference too."""
    B, T, C, Vp, maxT = 2, 9, 64, 40, 12
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, dtype, "mixed", seed=11, ids_dtype=ids_dtype)
    a = run_backward(dout, inp, dwte0, dwpe0, device, seed=77)
    b = run_backward(dout, inp, dwte0, dwpe0, device, seed=77)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    scratch = encoder_backward_scratch(B, T, C, device, ids_dtype)
    seed_t = torch.tensor([77], dtype=torch.int64, device=device)
    c = run_backward(dout, inp, dwte0, dwpe0, device, seed=seed_t, scratch=scratch)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    check_backward(*c, inp, dout, dwte0, dwpe0, dtype)
    if dtype == torch.bfloat16:  # the seed matters when rounding stochastically
        d = run_backward(dout, inp, dwte0, dwpe0, device, seed=78)
        assert not torch.equal(a[0], d[0]) and not torch.equal(a[1], d[1])


def test_encoder_backward_presorted(device):
    """sort=False after encoder_backward_sort (the sort moved earlier in the step): the same bits."""
    B, T, C, Vp, maxT = 2, 9, 40, 24, 9
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.bfloat16, "mixed", seed=17)
    a = run_backward(dout, inp, dwte0, dwpe0, device, piece=4, tile=2)
    scratch = encoder_backward_scratch(B, T, C, device, torch.int64, piece=4)
    encoder_backward_sort(inp.to(device), scratch)
    b = run_backward(dout, inp, dwte0, dwpe0, device, piece=4, tile=2, scratch=scratch, sort=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("sr_hash", [True, False])
def test_encoder_backward_stochastic_rounding_is_unbiased(device, sr_hash):
    """bf16 gradients of 1..2 with increments of ~0.13 ulp: round-to-nearest never moves them,
    stochastic rounding (hash or Philox bits for dwte) moves them by the increment on average."""
    B, T, C, Vp = 2, 8, 256, 16
    gen = torch.Generator().manual_seed(5)
    inp = torch.randperm(Vp, generator=gen)[: B * T].reshape(B, T)  # every row of dwte touched once
    dout = (torch.rand(B, T, C, generator=gen) * 1e-3 + 0.5e-3).to(torch.bfloat16)
    dwte0 = (1 + torch.rand(Vp, C, generator=gen)).to(torch.bfloat16)
    dwpe0 = (1 + torch.rand(T, C, generator=gen)).to(torch.bfloat16)
    g_wte, g_wpe = ref.encoder_backward(dout.float(), inp, Vp, T)
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device, seed=2024, sr_hash=sr_hash)
    for got, init, inc in ((dwte, dwte0, g_wte), (dwpe, dwpe0, g_wpe)):
        moved = float((got.float().cpu() - init.float()).mean())
        want = float(inc.mean())
        assert abs(moved - want) < 0.2 * want, (moved, want)
    rtn = run_backward(dout, inp, dwte0, dwpe0, device, stochastic=False, sr_hash=sr_hash)
    assert torch.equal(rtn[0].cpu(), dwte0) and torch.equal(rtn[1].cpu(), dwpe0), \
        "round-to-nearest must leave them: else the test could not tell the roundings apart"


def test_encoder_backward_seed_one(device):
    """seed=1 as a Python int (Triton specialises arguments equal to 1 unless told not to)."""
    B, T, C, Vp, maxT = 2, 5, 24, 16, 5
    inp, dout, dwte0, dwpe0 = backward_case(B, T, C, Vp, maxT, torch.bfloat16, "random", seed=1)
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, device, seed=1)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, torch.bfloat16)


def gpt2_ids(B, T, V, gen):
    """A Zipf-like mix: a few very common tokens (runs of thousands, over many chunks) and a long tail."""
    inp = torch.randint(0, V, (B, T), generator=gen, device="cuda", dtype=torch.int32)
    r = torch.rand(B, T, generator=gen, device="cuda")
    inp[r < 0.05] = 13
    inp[r < 0.02] = 50256
    inp[r < 0.01] = 11
    return inp


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_gpt2_shapes_gpu(B, dtype):
    T, C, V, Vp, maxT = 1024, 768, 50257, 50304, 1024
    gen = torch.Generator(device="cuda").manual_seed(B)
    inp = gpt2_ids(B, T, V, gen)
    wte = torch.randn(Vp, C, generator=gen, device="cuda").to(dtype)
    wpe = torch.randn(maxT, C, generator=gen, device="cuda").to(dtype)
    out = torch.full((B, T, C), float("nan"), dtype=dtype, device="cuda")
    encoder_forward(out, inp, wte, wpe)
    expected = ref.encoder_forward(inp.long(), wte.float(), wpe.float())
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), expected) < TOL[dtype]

    dout = torch.randn(B, T, C, generator=gen, device="cuda").to(dtype)
    dwte0 = (torch.randn(Vp, C, generator=gen, device="cuda") * 0.1).to(dtype)
    dwpe0 = (torch.randn(maxT, C, generator=gen, device="cuda") * 0.1).to(dtype)
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, "cuda", seed=B)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, dtype)
    again = run_backward(dout, inp, dwte0, dwpe0, "cuda", seed=B)
    assert torch.equal(dwte, again[0]) and torch.equal(dwpe, again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WTE_SWEEP))
def test_encoder_backward_sweep_candidates_gpu(name):
    """Each benchmarked dwte configuration (warps, pipelining, register caps for real) at GPT-2 shapes."""
    B, T, C, V, Vp, maxT = 4, 1024, 768, 50257, 50304, 1024
    gen = torch.Generator(device="cuda").manual_seed(7)
    inp = gpt2_ids(B, T, V, gen)
    dout = torch.randn(B, T, C, generator=gen, device="cuda").to(torch.bfloat16)
    dwte0 = (torch.randn(Vp, C, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    dwpe0 = (torch.randn(maxT, C, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    cfg = WTE_SWEEP[name]
    dwte, dwpe = run_backward(dout, inp, dwte0, dwpe0, "cuda", seed=3, **cfg)
    check_backward(dwte, dwpe, inp, dout, dwte0, dwpe0, torch.bfloat16)
    again = run_backward(dout, inp, dwte0, dwpe0, "cuda", seed=3, **cfg)
    assert torch.equal(dwte, again[0]) and torch.equal(dwpe, again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WPE_SWEEP))
def test_wpe_backward_configs_gpu(name):
    B, T, C, maxT = 16, 1024, 768, 1024
    gen = torch.Generator(device="cuda").manual_seed(8)
    dout = torch.randn(B, T, C, generator=gen, device="cuda").to(torch.bfloat16)
    dwpe0 = (torch.randn(maxT, C, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    dwpe = dwpe0.clone()
    wpe_backward(dwpe, dout, 5, 50304 * C, **WPE_SWEEP[name])
    assert rel_err(dwpe.float(), dwpe0.float() + dout.float().sum(0)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_encoder_backward_in_cuda_graph():
    """The backward (device sort included) captures in a CUDA graph; replays with new ids and a new seed
    written into the seed tensor give the eager result bit for bit."""
    B, T, C, Vp, maxT = 4, 1024, 768, 50304, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    inp = torch.randint(0, 50257, (B, T), generator=gen, device="cuda", dtype=torch.int32)
    inp[torch.rand(B, T, generator=gen, device="cuda") < 0.1] = 198  # a run longer than a piece
    dout = torch.randn(B, T, C, generator=gen, device="cuda").to(torch.bfloat16)
    dwte0 = torch.randn(Vp, C, generator=gen, device="cuda").to(torch.bfloat16)
    dwpe0 = torch.randn(maxT, C, generator=gen, device="cuda").to(torch.bfloat16)
    dwte, dwpe = dwte0.clone(), dwpe0.clone()
    scratch = encoder_backward_scratch(B, T, C, "cuda", torch.int32)
    seed = torch.tensor([1], dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels before capture
        encoder_backward(dwte, dwpe, dout, inp, seed, scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        encoder_backward(dwte, dwpe, dout, inp, seed, scratch)
    for step, new_seed in enumerate((5, 6)):
        if step:
            inp.copy_(torch.randint(0, 64, (B, T), generator=gen, device="cuda", dtype=torch.int32))
        dwte.copy_(dwte0)
        dwpe.copy_(dwpe0)
        seed.fill_(new_seed)
        graph.replay()
        eager = run_backward(dout, inp, dwte0, dwpe0, "cuda", seed=new_seed)
        torch.cuda.synchronize()
        assert torch.equal(dwte, eager[0]) and torch.equal(dwpe, eager[1])
