"""Fused classifier against reference.fused_classifier: losses, in-place dlogits with zero padding,
the validation variant leaving the logits untouched, NaN-poisoned losses, determinism, several column
blocks per row (the online softmax merging across blocks and the mask-free main loop + masked tail), and
every variant (twopass, persistent twopass, onepass in each keep mode, split, legacy) on small shapes;
GPT-2 124M shapes on the GPU for the variants the benchmark sweeps."""
import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.fused_classifier import (FALLBACK_CONFIG, fused_classifier, onepass_tiles, row_chunks,
                                            split_scratch_numel)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(2, 3, 61, 128), (3, 5, 50, 64), (1, 7, 37, 40)]  # (B, T, V, Vp)

# Every variant on small shapes. onepass at num_warps=1 so that the chunks are [R, S] tiles with R > 1
# (several 16-byte vectors a thread) even at these sizes; Vp = 464 = 256 + 128 + 64 + 16 fills all four
# chunk slots; Vp = 1040 = 1024 + 16; Vp = 496 has more binary digits than slots (the last chunk
# overhangs Vp). twopass at progs_per_sm=1: 4 persistent programs (the interpreter's "SM count") walk
# the 6 or 12 rows. exact=False: one chunk of next_pow2(Vp) columns, masked past Vp (for the packed words at
# Vp = 464: 256 words where exact cuts the 232 into 128 + 64 + 32 + 16).
VARIANTS = {
    "twopass_b16": dict(variant="twopass", block_size=16),
    "twopass_b32_tile4": dict(variant="twopass", block_size=32, tile=4),
    "twopass_persistent": dict(variant="twopass", block_size=32, progs_per_sm=1),
    "onepass_p": dict(variant="onepass", keep="p", num_warps=1),
    "onepass_x": dict(variant="onepass", keep="x", num_warps=1),
    "onepass_pl": dict(variant="onepass", keep="pl", num_warps=1),
    "onepass_pw": dict(variant="onepass", keep="pw", num_warps=1),
    "onepass_xw": dict(variant="onepass", keep="xw", num_warps=1),
    "onepass_p_pow2": dict(variant="onepass", keep="p", num_warps=2, exact=False),
    "onepass_pw_pow2": dict(variant="onepass", keep="pw", num_warps=1, exact=False),
    "onepass_xw_pow2": dict(variant="onepass", keep="xw", num_warps=1, exact=False),
    "split_b64": dict(variant="split", block_size=64),
    "legacy_b16": dict(variant="legacy", block_size=16),
}
VARIANT_SHAPES = [(2, 3, 450, 464), (1, 6, 1001, 1040)]


def rel_err(out, expected):
    out, expected = out.double(), expected.to(out.device).double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def make_case(B, T, V, Vp, dtype, seed, scale=5.0, padding=0.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, Vp, generator=gen) * scale
    logits[..., V:] = padding  # what the model leaves there is not the kernel's business
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets.view(-1)[0] = 0  # the first and the last real column
    targets.view(-1)[-1] = V - 1
    return logits.to(dtype), targets


def reference(logits, targets, V, dloss):
    """fp32 reference of the (possibly bf16-rounded) logits, on their device (reference.fused_classifier
    builds its dloss tensor on the default device, hence the device context)."""
    with torch.device(logits.device):
        return ref.fused_classifier(logits.float(), targets.to(logits.device), V, dloss)


def run(logits, targets, V, dloss, device, write_dlogits=True, **kw):
    lg = logits.clone().to(device)
    losses = torch.full(targets.shape, float("nan"), dtype=torch.float32, device=device)
    fused_classifier(lg, losses, dloss, targets.to(device), V, write_dlogits=write_dlogits, **kw)
    return losses, lg


def check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, dtype):
    assert torch.isfinite(losses).all(), "NaN-poisoned losses not written"
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert torch.isfinite(dlogits).all()
    assert rel_err(dlogits.float(), exp_dlogits) < TOL[dtype]
    assert (dlogits[..., V:] == 0).all(), "padding columns must be zero"
    # per row the gradient sums to ~0 (the softmax sums to 1, minus the one-hot)
    assert float(dlogits.float().sum(-1).abs().max()) < 50 * TOL[dtype] * dloss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
@pytest.mark.parametrize("block,stages", [(None, 1), (16, 1), (32, 3)])
@pytest.mark.parametrize("tgt_dtype", [torch.int64, torch.int32])
def test_fused_classifier_train(device, dtype, B, T, V, Vp, block, stages, tgt_dtype):
    """The default variant with its block size, and small blocks: several full blocks a row plus the
    masked tail (V=61, BLOCK=16: 3 full blocks, the tail from 48 to Vp=128)."""
    logits, targets = make_case(B, T, V, Vp, dtype, seed=B * 100 + V)
    dloss = 1.0 / (B * T * 3)
    kw = {"stages": stages} if block is None else {"block_size": block, "stages": stages}
    losses, dlogits = run(logits, targets.to(tgt_dtype), V, dloss, device, **kw)
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,V,Vp", SHAPES)
@pytest.mark.parametrize("block", [None, 16])
def test_fused_classifier_validation_leaves_logits(device, dtype, B, T, V, Vp, block):
    logits, targets = make_case(B, T, V, Vp, dtype, seed=7 + V)
    kw = {} if block is None else {"block_size": block}
    losses, after = run(logits, targets, V, 0.5, device, write_dlogits=False, **kw)
    exp_losses, _ = reference(logits, targets, V, None)
    assert torch.isfinite(losses).all()
    assert rel_err(losses, exp_losses) < TOL[dtype]
    assert torch.equal(after, logits.to(device)), "validation must not touch the logits"


# bf16 for every variant, fp32 for those whose fp32 code differs (pw / xw on fp32 are pl / x; the twopass
# blocks are covered by the tests above): fewer kernels to compile on the GPU machine
VARIANT_CASES = [(n, torch.bfloat16) for n in VARIANTS] + [
    (n, torch.float32) for n in ("twopass_persistent", "onepass_p", "onepass_x", "onepass_pl", "split_b64",
                                 "legacy_b16")]


@pytest.mark.parametrize("name,dtype", VARIANT_CASES)
def test_fused_classifier_variants(device, name, dtype):
    """Each variant, training and validation, against the reference; NaN in the padding columns is
    ignored (they are dropped in registers, never summed)."""
    kw = VARIANTS[name]
    shapes = VARIANT_SHAPES if name in ("onepass_p", "twopass_persistent") else VARIANT_SHAPES[:1]
    for i, (B, T, V, Vp) in enumerate(shapes):
        logits, targets = make_case(B, T, V, Vp, dtype, seed=31 + i, padding=float("nan"))
        dloss = 1.0 / (B * T)
        exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
        losses, dlogits = run(logits, targets, V, dloss, device, **kw)
        check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, dtype)
        val_losses, after = run(logits, targets, V, 0.5, device, write_dlogits=False, **kw)
        assert torch.isfinite(val_losses).all()
        assert rel_err(val_losses, exp_losses) < TOL[dtype]
        assert torch.equal(after.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           logits.to(device).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
            "validation must not touch the logits (NaN padding included)"


@pytest.mark.parametrize("name", ["onepass_p", "onepass_pw", "onepass_xw"])
def test_fused_classifier_onepass_edge_chunks(device, name):
    """Vp = 496 has five binary digits: the fourth chunk overhangs Vp (its stores are masked); V odd, so
    the packed-words kernels split a word between a real column and the padding."""
    B, T, V, Vp = 1, 3, 481, 496
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=5, padding=float("nan"))
    flat = torch.full((B * T * Vp + 64,), 7.0, dtype=torch.bfloat16, device=device)  # a guard band after
    work = flat[:B * T * Vp].view(B, T, Vp)  # the last row, which the overhanging chunk must not touch
    work.copy_(logits.to(device))
    losses = torch.full((B, T), float("nan"), device=device)
    fused_classifier(work, losses, 0.25, targets.to(device), V, **VARIANTS[name])
    exp_losses, exp_dlogits = reference(logits, targets, V, 0.25)
    check_train(losses, work, exp_losses, exp_dlogits, V, 0.25, torch.bfloat16)
    assert (flat[B * T * Vp:] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_padding_garbage_and_extremes(device, dtype):
    """NaN in the padding is ignored; logits of scale 40 (probabilities that underflow, a target far
    below the max) give finite losses through the log-sum-exp form; a logit 300 above the rest, in the
    first or the last column of a row (the first or the last block or chunk), must set the row's max
    (exp of 300 overflows fp32)."""
    B, T, V, Vp = 2, 5, 450, 464  # onepass: four chunks, column V - 1 in the last one
    logits, targets = make_case(B, T, V, Vp, dtype, seed=3, scale=40.0, padding=float("nan"))
    logits[0, 1, V - 1] = 300.0
    logits[1, 2, 0] = 300.0
    # fp32 at |x| ~ 300: x * log2(e) - lse2 carries an absolute error of ~ulp(432) = 3e-5, which exp turns
    # into a relative one (the H200's exp2 measured 2.8e-5 here; the interpreter's is exact)
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    for kw in (dict(block_size=16), VARIANTS["onepass_p"], VARIANTS["onepass_pw"], VARIANTS["onepass_p_pow2"],
               VARIANTS["split_b64"], dict(variant="split", block_size=16)):
        losses, dlogits = run(logits, targets, V, 0.25, device, **kw)
        exp_losses, exp_dlogits = reference(logits, targets, V, 0.25)
        assert torch.isfinite(losses).all() and torch.isfinite(dlogits).all()
        assert rel_err(losses, exp_losses) < tol
        assert rel_err(dlogits.float(), exp_dlogits) < tol
        assert (dlogits[..., V:] == 0).all()


@pytest.mark.parametrize("name", ["onepass_pw", "onepass_xw", "onepass_pw_pow2", "onepass_xw_pow2"])
def test_fused_classifier_words_round_to_nearest(device, name):
    """The packed-words kernels round the gradient to bf16 with their own integer round-to-nearest-even:
    almost every element equals the fp32 reference rounded to nearest (truncation would miss ~half; pw
    rounds p once more before the gradient, so it gets less)."""
    B, T, V, Vp = 2, 3, 450, 464
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=9)
    _, dlogits = run(logits, targets, V, 0.01, device, **VARIANTS[name])
    _, exp_dlogits = reference(logits, targets, V, 0.01)
    same = (dlogits.cpu() == exp_dlogits.cpu().bfloat16()).float().mean().item()
    assert same > (0.97 if "xw" in name else 0.7), same


class GridSpy:
    """A kernel's stand-in that records the grid of every launch, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("keep,progs_per_sm,dtype", [("p", 1, torch.bfloat16), ("p", 1, torch.float32),
                                                     ("x", 1, torch.bfloat16), ("pl", 2, torch.float32)])
def test_fused_classifier_onepass_persistent(device, monkeypatch, keep, progs_per_sm, dtype):
    """onepass with progs_per_sm: a grid of progs_per_sm programs an SM (the interpreter's 4 "SMs": 4 or 8 programs)
    smaller than the row count, so that the programs walk several rows each (11 rows over 4 programs: 3, 3, 3 and 2;
    over 8: 2 or 1; 12 rows: 3 each, or 2 and 1), training and validation against the reference; validation gives
    bitwise the training losses and leaves the logits (NaN padding included) as they were."""
    from llmpy.kernels import fused_classifier as fc
    spy = GridSpy(fc._fc_onepass_kernel)
    monkeypatch.setattr(fc, "_fc_onepass_kernel", spy)
    monkeypatch.setattr(fc, "_sm_count", lambda t: 4)  # on a GPU too (where the L2 prefetch of the next row runs)
    kw = dict(variant="onepass", keep=keep, num_warps=1, progs_per_sm=progs_per_sm)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    shapes = ((1, 11), (3, 4))
    for B, T in shapes:
        V, Vp = 450, 464  # four chunks
        logits, targets = make_case(B, T, V, Vp, dtype, seed=B * 10 + T, padding=float("nan"))
        dloss = 1.0 / (B * T)
        exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
        losses, dlogits = run(logits, targets, V, dloss, device, **kw)
        check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, dtype)
        val_losses, after = run(logits, targets, V, dloss, device, write_dlogits=False, **kw)
        assert torch.equal(val_losses, losses)
        assert torch.equal(after.view(bits), logits.to(device).view(bits))
    rows = [B * T for B, T in shapes for _ in ("train", "val")]
    assert [g[0] for g in spy.grids] == [4 * progs_per_sm] * len(rows)
    assert all(g[0] < r for g, r in zip(spy.grids, rows)), "persistent: fewer programs than rows"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_classifier_deterministic(device, dtype):
    logits, targets = make_case(3, 5, 50, 64, dtype, seed=11)
    for kw in (dict(block_size=16), VARIANTS["twopass_persistent"], VARIANTS["onepass_p"], VARIANTS["split_b64"]):
        a = run(logits, targets, 50, 0.1, device, **kw)
        b = run(logits, targets, 50, 0.1, device, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), kw


@pytest.mark.parametrize("V,Vp", [(300, 304), (1001, 1040), (50257, 50304)])
def test_validation_losses_are_training_losses(device, V, Vp):
    """With the default configs, a batch's validation losses are bitwise its training losses (one
    reduction order for both), on fresh logits of a few units."""
    rows = 4 if V > 10000 and device == "cpu" else 32
    gen = torch.Generator().manual_seed(V)
    logits = (torch.randn(rows, Vp, generator=gen) * 3).to(device)
    targets = torch.randint(0, V, (rows,), generator=gen).to(device)
    val, _ = run(logits, targets, V, 0.0, device, write_dlogits=False)
    train, _ = run(logits, targets, V, 1.0 / rows, device, write_dlogits=True)
    assert torch.equal(val.cpu(), train.cpu())


def test_fused_classifier_split_scratch(device):
    """A caller-provided scratch (how a CUDA graph captures "split" without an allocation) gives the
    same result as the launcher's own; a scratch too small is refused."""
    B, T, V, Vp = 2, 3, 61, 128
    logits, targets = make_case(B, T, V, Vp, torch.float32, seed=2)
    scratch = torch.full((split_scratch_numel(B * T, Vp, 32),), float("nan"), device=device)
    a = run(logits, targets, V, 0.1, device, variant="split", block_size=32, scratch=scratch)
    b = run(logits, targets, V, 0.1, device, variant="split", block_size=32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(AssertionError):
        run(logits, targets, V, 0.1, device, variant="split", block_size=32, scratch=scratch[:-1])


def test_row_chunks_and_tiles():
    """Chunk sizes are powers of two in decreasing order that cover Vp (exactly when Vp has at most 4
    binary digits above the granule); the tiles hold one 16-byte vector a thread per tile row."""
    assert row_chunks(50304) == [32768, 16384, 1024, 128]
    assert row_chunks(25152) == [16384, 8192, 512, 64]  # the packed words of a GPT-2 row
    assert row_chunks(50304, exact=False) == [65536, 0, 0, 0]
    for Vp in (16, 40, 64, 128, 336, 464, 496, 1040, 2000, 50304, 50257):
        parts = row_chunks(Vp)
        nz = [p for p in parts if p]
        assert len(parts) == 4 and all(p & (p - 1) == 0 for p in nz) and sum(nz) >= Vp
        assert sum(nz) - Vp < max(16, nz[-1]), (Vp, parts)  # the overhang stays inside the last chunk
    t = onepass_tiles(50304, 50257, 2, 16)
    assert (t["R0"], t["S0"], t["R1"], t["S1"], t["R2"], t["S2"], t["R3"], t["S3"]) == (8, 4096, 4, 4096, 1, 1024,
                                                                                        1, 128)
    assert (t["E0"], t["E1"], t["E2"], t["E3"]) == (False, False, False, True)


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,dtype", [
    ("default", {}, torch.bfloat16),
    ("default", {}, torch.float32),
    ("twopass_persistent", dict(variant="twopass", block_size=16384, num_warps=32, progs_per_sm=1), torch.bfloat16),
    ("onepass_p16", dict(variant="onepass", keep="p", num_warps=16), torch.bfloat16),
    ("onepass_p16", dict(variant="onepass", keep="p", num_warps=16), torch.float32),
    # persistent with the L2 prefetch of the next row (inline PTX: the interpreter runs it without)
    ("onepass_p16_prefetch", dict(variant="onepass", keep="p", num_warps=16, progs_per_sm=1, prefetch=True),
     torch.bfloat16),
    ("onepass_pw16", dict(variant="onepass", keep="pw", num_warps=16), torch.bfloat16),
    ("onepass_xw16", dict(variant="onepass", keep="xw", num_warps=16), torch.bfloat16),
    ("split", dict(variant="split", block_size=4096, num_warps=8), torch.bfloat16),
    ("tma", dict(variant="tma"), torch.bfloat16),
])
def test_fused_classifier_gpt2_shapes_gpu(name, kw, dtype):
    check_gpt2_shapes(kw, dtype)


def check_gpt2_shapes(kw, dtype):
    """The variant kw at GPT-2's vocabulary, 4096 rows, on the GPU: validation leaves the logits as they were,
    training against the reference, repeats bitwise."""
    B, T, V, Vp = 4, 1024, 50257, 50304
    logits, targets = make_case(B, T, V, Vp, dtype, seed=B)
    logits, targets = logits.cuda(), targets.cuda()
    dloss = 1.0 / (B * T)
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    val_losses, after = run(logits, targets, V, dloss, "cuda", write_dlogits=False, **kw)
    assert torch.equal(after, logits)
    assert rel_err(val_losses, exp_losses) < TOL[dtype]
    losses, dlogits = run(logits, targets, V, dloss, "cuda", **kw)
    check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, dtype)
    again = run(logits, targets, V, dloss, "cuda", **kw)
    assert torch.equal(losses, again[0]) and torch.equal(dlogits, again[1])


@pytest.mark.gpu
def test_gpt2_shapes_give_their_memory_back():
    """After check_gpt2_shapes returns, every byte it allocated is free again, without a garbage collection (a
    reference cycle would need one) and with one (a leak). Under memcheck on an H100 (run BC) this file's model-sized
    tests held ~7 GB more after each test: compute-sanitizer's host backtraces kept the Python frame of every Triton
    launch alive (run BD), so bench/gpu_check.sh's sanitize stage turns them off; without them this test passes."""
    import gc
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for kw in ({}, dict(variant="tma"), dict(variant="split", block_size=4096, num_warps=8)):
        check_gpt2_shapes(kw, torch.bfloat16)
        held = torch.cuda.memory_allocated() - before
        if held:  # a collection only to say which: what it frees a cycle held
            gc.collect()
        leaked = torch.cuda.memory_allocated() - before
        assert held == 0, f"{kw}: {held / 2**20:.1f} MiB still allocated after the test ({leaked / 2**20:.1f} after gc)"


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(variant="tma"), FALLBACK_CONFIG], ids=["tma", "twopass"])
def test_fused_classifier_in_cuda_graph(kw):
    """Captured once (tma: its descriptor baked into the graph), replayed on new logits and targets copied
    into the same buffers: the eager result."""
    B, T, V, Vp = 4, 1024, 50257, 50304
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=1)
    buf, tgt = logits.cuda(), targets.cuda()
    losses = torch.empty(B, T, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile before capture
        fused_classifier(buf, losses, 0.5, tgt, V, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_classifier(buf, losses, 0.5, tgt, V, **kw)
    for seed in (2, 3):
        new_logits, new_targets = make_case(B, T, V, Vp, torch.bfloat16, seed=seed)
        buf.copy_(new_logits)
        tgt.copy_(new_targets)
        graph.replay()
        eager_losses, eager_dlogits = run(new_logits, new_targets, V, 0.5, "cuda", **kw)
        torch.cuda.synchronize()
        assert torch.equal(losses, eager_losses) and torch.equal(buf, eager_dlogits)


@pytest.mark.parametrize("V,Vp", [(1, 16), (5, 16), (16, 16), (17, 32), (257, 384), (1000, 1024)])
@pytest.mark.parametrize("write_dlogits", [True, False], ids=["train", "val"])
def test_default_configs_on_any_vocabulary(device, V, Vp, write_dlogits):
    """The default training and validation configs (blocks of 8192 and 4096) on vocabularies far smaller
    than a block: the launcher narrows the block so that the unmasked loop over full blocks runs at least
    once (on the H200 a zero-trip loop there gave NaN losses and hung the validation kernel)."""
    dloss = 1.0 / 6
    logits, targets = make_case(2, 3, V, Vp, torch.float32, seed=V)
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    losses, out = run(logits, targets, V, dloss, device, write_dlogits=write_dlogits)
    assert torch.isfinite(losses).all()
    if V == 1:  # loss and gradient are 0 in exact math: an absolute bound (the GPU's exp2/log2 give ~1e-7)
        assert float((losses.cpu() - exp_losses.cpu()).abs().max()) < 1e-5
        if write_dlogits:
            assert float((out.cpu() - exp_dlogits.cpu()).abs().max()) < 1e-5 * dloss
    elif write_dlogits:
        check_train(losses, out, exp_losses, exp_dlogits, V, dloss, torch.float32)
    else:
        assert rel_err(losses, exp_losses) < TOL[torch.float32]
    if not write_dlogits:
        assert torch.equal(out.cpu(), logits)


def test_tma_variant_falls_back_off_hopper(device):
    """Where the Gluon kernel does not serve (the CPU, fp32 logits, Vp not a multiple of 128), the "tma"
    variant is the two-pass kernel of FALLBACK_CONFIG, bit for bit."""
    from llmpy.kernels.fused_classifier_tma import tma_classifier_usable
    for dtype, V, Vp in ((torch.float32, 450, 512), (torch.bfloat16, 61, 64)):
        logits, targets = make_case(2, 3, V, Vp, dtype, seed=V)
        assert not tma_classifier_usable(logits.to(device))
        a = run(logits, targets, V, 0.25, device, variant="tma")
        b = run(logits, targets, V, 0.25, device, **FALLBACK_CONFIG)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# the TMA kernel's odd cases: rows fewer than SMs and not a multiple of them, one box a row and a row's
# last box mostly past Vp, V far from Vp, targets at the first and last real column (make_case); V a
# multiple of the 4096-logit box (no masked box) and one past it (a last box with one real column)
TMA_SHAPES = [(1, 5, 77, 128), (3, 100, 1000, 1024), (2, 150, 4000, 4096), (1, 300, 50257, 50304),
              (1, 40, 8192, 8192), (1, 50, 8193, 8320)]


def check_tma_classifier(logits, targets, V, dloss, buffers):
    """The "tma" variant on logits' device: training and validation against the reference, validation leaving
    the logits untouched and giving bitwise the training losses. Returns the training (losses, dlogits)."""
    exp_losses, exp_dlogits = reference(logits, targets, V, dloss)
    kw = dict(variant="tma", buffers=buffers)
    val_losses, after = run(logits, targets, V, dloss, logits.device, write_dlogits=False, **kw)
    assert torch.equal(after.view(torch.int16), logits.view(torch.int16))
    losses, dlogits = run(logits, targets, V, dloss, logits.device, **kw)
    check_train(losses, dlogits, exp_losses, exp_dlogits, V, dloss, torch.bfloat16)
    assert torch.equal(val_losses, losses), "validation losses must be bitwise the training losses"
    return losses, dlogits


@pytest.mark.parametrize("tma_loads", ["at-issue", "at-wait"])
@pytest.mark.parametrize("B,T,V,Vp", [(1, 5, 77, 128), (3, 10, 1000, 1024), (1, 7, 8192, 8192), (1, 9, 8193, 8320)])
@pytest.mark.parametrize("buffers", [2, 1])
def test_tma_classifier_emulated_on_the_cpu(monkeypatch, gluon_emulator, B, T, V, Vp, buffers, tma_loads):
    """The Gluon kernel's own code on the CPU (tests/gluon_emulator.py; its bf16x2 max as torch.fmax, the same
    NaN rule): boxes, masks, the persistent programs' rows and buffers, against the reference; validation
    leaves the logits untouched and gives bitwise the training losses."""
    from llmpy.kernels import fused_classifier as fc
    from llmpy.kernels import fused_classifier_tma as fct
    emulated = gluon_emulator.emulate(fct._fc_tma_kernel, tma_loads, overrides={"_max_pairs": torch.fmax})
    monkeypatch.setattr(fct, "_fc_tma_kernel", emulated)
    monkeypatch.setattr(fc, "tma_classifier_usable", lambda logits: True)
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=T + V, padding=float("nan"))
    check_tma_classifier(logits, targets, V, 1.0 / (B * T), buffers)
    assert emulated.launches == 2


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,V,Vp", TMA_SHAPES)
@pytest.mark.parametrize("buffers", [2, 1])
def test_gpu_tma_classifier(B, T, V, Vp, buffers):
    """The Gluon kernel itself (asserted to serve, not its fallback): training and validation against
    the reference with NaN in the padding columns, validation leaving the logits untouched and giving
    bitwise the training losses, repeats bitwise."""
    from llmpy.kernels.fused_classifier_tma import tma_classifier_usable
    logits, targets = make_case(B, T, V, Vp, torch.bfloat16, seed=T + V, padding=float("nan"))
    logits, targets = logits.cuda(), targets.cuda()
    assert tma_classifier_usable(logits)
    dloss = 1.0 / (B * T)
    losses, dlogits = check_tma_classifier(logits, targets, V, dloss, buffers)
    again = run(logits, targets, V, dloss, "cuda", variant="tma", buffers=buffers)
    assert torch.equal(losses, again[0]) and torch.equal(dlogits, again[1])
