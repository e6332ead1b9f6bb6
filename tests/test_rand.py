"""llmpy.rand (llm.c's rand.h) against torch's CPU generator, and llmpy.init (gpt2_build_from_random).

Tolerances: raw integers, rand, uniform_ and the n < 16 normals are exact everywhere. normal_(n >= 16)
is bitwise equal to torch's on x86 with AVX2 or AVX-512 (torch's AVX2 kernel runs on both); where torch
runs its scalar fallback (no AVX2, ARM, ATEN_CPU_CAPABILITY=default) about a third of the values differ,
measured by at most 2.5e-6 * std, so there the check is |diff| <= 1e-5 * std (+ float32 rounding of
mean).
"""
import math
import os
import secrets
import signal
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from llmpy import rand
from llmpy.config import GPT2Config, parameter_views, parse_descriptor
from llmpy.errors import LlmpyError
from llmpy.init import init_draws, init_parameters, residual_std
from llmpy.rand import MT19937

F32 = np.float32
TORCH_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
# fixed seeds (0, one past 2^32 which wraps, llm.c's 42) plus fresh random ones, named in failures
SEEDS = [0, 42, (1 << 32) + 5] + [secrets.randbelow(1 << 31) for _ in range(3)]


def _torch_normal(seed, n, mean, std):
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n).normal_(mean, std, generator=g).numpy()


def assert_normals_match(ours, ref, mean, std, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape and ours.dtype == np.float32, what
    if TORCH_AVX2:
        bad = np.nonzero(ours.view(np.int32) != ref.view(np.int32))[0]
        assert bad.size == 0, f"{what}: {bad.size} values differ from torch, first at {bad[:5]}"
    else:
        tol = 1e-5 * std + float(np.spacing(F32(abs(mean))))
        diff = np.abs(ours.astype(np.float64) - ref)
        assert diff.max() <= tol, f"{what}: max |diff| {diff.max():.3g} > {tol:.3g}"


# ---------------------------------------------------------------- the raw stream

def test_seeding_is_init_genrand():
    # numpy's legacy RandomState(int) seeds its MT19937 with init_genrand too: its key must be ours
    for seed in SEEDS:
        key = np.random.RandomState(seed & 0xFFFFFFFF).get_state()[1]
        assert np.array_equal(key, rand.init_genrand(seed)), seed



def test_edge_seeds_seed_torchs_stream_and_check_seed_bounds():
    # torch.manual_seed takes any 64-bit value (a negative one as its two's complement) and keeps the low 32 bits
    r = secrets.randbelow(1 << 32)
    for seed in [0, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 63, (1 << 64) - 1, -1, -(1 << 63), r, -r,
                 np.uint64((1 << 63) + r), np.int64(-r), np.uint32(r), True]:
        ref = torch.randn(37, generator=torch.Generator().manual_seed(int(seed))).numpy()
        assert_normals_match(MT19937(seed).normal_(37), ref, 0.0, 1.0, f"seed={seed!r}")
    # llm.c's seeds (--seed, seed=): integers 0 .. 2^32 - 1, numpy's included; anything else is one line
    for seed in [0, (1 << 32) - 1, r, np.uint32(r), np.int64(r), np.uint64(r)]:
        rand.check_seed(seed)
    for seed in [-1, 1 << 32, 1 << 63, True, np.bool_(False), np.int64(-r - 1), 3.0, "7", None]:
        with pytest.raises(LlmpyError) as e:
            rand.check_seed(seed, "--seed")
        assert str(e.value) == f"--seed {seed!r}: must be an integer from 0 to 4294967295"

@pytest.mark.parametrize("seed", SEEDS)
def test_raw_draws_match_torch(seed):
    n = 3000
    # torch's full-range int64 random_ returns random64 itself: two draws, the first the high half
    t64 = torch.empty(n, dtype=torch.int64).random_(-2**63, None, generator=torch.Generator().manual_seed(seed))
    assert np.array_equal(MT19937(seed).raw_uint64(n), t64.numpy().view(np.uint64)), seed
    # int32 random_ is random() % 2^31 (one 32-bit draw)
    t32 = torch.empty(n, dtype=torch.int32).random_(generator=torch.Generator().manual_seed(seed))
    assert np.array_equal(MT19937(seed).raw_uint32(n) & 0x7FFFFFFF, t32.numpy()), seed
    # the scalar draws walk the same stream
    g = MT19937(seed)
    ref = MT19937(seed).raw_uint32(8).tolist()
    assert [g.randint32(), g.randint32()] == ref[:2]
    assert g.randint64() == (ref[2] << 32) | ref[3]
    assert g.randfloat32() == (ref[4] & 0xFFFFFF) / 2**24
    assert g.randfloat64() == (((ref[5] << 32) | ref[6]) & ((1 << 53) - 1)) / 2**53


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_rand_and_uniform_match_torch(seed):
    n = 20000
    g = torch.Generator().manual_seed(seed)
    assert np.array_equal(MT19937(seed).rand(n), torch.rand(n, generator=g).numpy())
    # float64 uniforms are randfloat64
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(5, dtype=torch.float64, generator=g).tolist()
    m = MT19937(seed)
    assert [m.randfloat64() for _ in range(5)] == t
    for low, high in [(0.0, 1.0), (-1.0, 2.0), (-3.3, 1e-3), (5.0, 5.5), (-0.02, 0.02)]:
        g = torch.Generator().manual_seed(seed)
        ref = torch.empty(n).uniform_(low, high, generator=g).numpy()
        ours = MT19937(seed).uniform_(n, low, high)
        assert ours.dtype == np.float32 and np.array_equal(ours, ref), (seed, low, high)


@pytest.mark.parametrize("low,high", [(0, 10), (-5, 5), (0, 2**31), (0, 2**32 - 1), (7, 7 + 2**32),
                                      (-2**40, 2**40), (-2**63, 2**63 - 1)])
def test_randint_matches_torch(low, high):
    seed = SEEDS[-1]
    g = torch.Generator().manual_seed(seed)
    ref = torch.randint(low, high, (2000,), generator=g).numpy()
    assert np.array_equal(MT19937(seed).randint(low, high, 2000), ref), (seed, low, high)


# ---------------------------------------------------------------- normal_

@pytest.mark.parametrize("seed", SEEDS)
def test_normal_matches_torch(seed):
    for n in list(range(1, 18)) + [31, 32, 33, 1000]:
        for mean, std in [(0.0, 1.0), (0.0, 0.02), (0.5, 3.0), (-1.25, 0.1)]:
            ours = MT19937(seed).normal_(n, mean, std)
            assert_normals_match(ours, _torch_normal(seed, n, mean, std), mean, std,
                                 f"seed={seed} n={n} mean={mean} std={std}")


@pytest.mark.parametrize("seed", SEEDS[:2] + SEEDS[-1:])
def test_normal_large_matches_torch(seed):
    # 10^6 is not a multiple of 16 (the tail is redrawn) and spans several chunks (the threaded path)
    for n, mean, std in [(10**6 + 7, 0.0, 0.02), (10**6, 0.3, 2.0)]:
        ours = MT19937(seed).normal_(n, mean, std)
        assert_normals_match(ours, _torch_normal(seed, n, mean, std), mean, std, f"seed={seed} n={n}")


def test_normal_keeps_the_sign_of_zero_as_torch():
    # mean -0.0: torch's v * std + mean keeps a -0 product's sign; both of our paths turned every zero into +0
    seed = secrets.randbelow(1 << 31)
    for n in (secrets.randbelow(15) + 1, 16 * (secrets.randbelow(8) + 2) + secrets.randbelow(16)):
        for std in (0.0, -0.0):
            ref = _torch_normal(seed, n, -0.0, std)
            assert n < 16 or 0 < np.signbit(ref).sum() < n  # both signs occur (32 or more zeros)
            ours = MT19937(seed).normal_(n, -0.0, std)
            assert np.array_equal(ours.view(np.int32), ref.view(np.int32)), (seed, n, std)


def test_normal_out_and_errors():
    buf = np.full(40, 7.0, dtype=np.float32)
    res = MT19937(3).normal_(40, 0.0, 1.0, out=buf)
    assert res is buf
    assert np.array_equal(buf, MT19937(3).normal_(40))
    with pytest.raises(ValueError):
        MT19937(3).normal_(40, out=np.zeros(39, np.float32))
    assert MT19937(3).normal_(0).shape == (0,)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# forking beside live threads is what this test is about; Python 3.12 warns of it where it sees them (a GPU host)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_normal_in_a_forked_child_does_not_hang(monkeypatch):
    """The Box-Muller thread pool's threads do not survive fork(): a child (multiprocessing's default start on
    Linux) that drew a large normal_ after its parent had hung for ever in the pool's queue."""
    if rand._pool() is None:  # one core: make the pool anyway, so that the threaded path runs in the parent
        from concurrent.futures import ThreadPoolExecutor
        monkeypatch.setattr(rand, "_POOL", ThreadPoolExecutor(max_workers=2))
        monkeypatch.setattr(rand, "_WORKERS", 2)
    seed, n = secrets.randbelow(1 << 31), 16 * rand._CHUNK_BLOCKS * 3 + 5  # several chunks: the threaded path
    want = MT19937(seed).normal_(n, 0.1, 0.02)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 on the same numbers, 3 on others; SIGALRM if it hangs
        try:
            signal.alarm(30)
            os._exit(0 if np.array_equal(MT19937(seed).normal_(n, 0.1, 0.02), want) else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("normal_ hung in a forked child")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, f"seed={seed}: child status {status}"


def test_consecutive_calls_continue_the_stream():
    """One generator across calls of mixed kinds and sizes; the cached second sample of the n < 16 path
    lives in the generator (torch's next_double_normal_sample), across calls and across n >= 16 calls."""
    seed = SEEDS[-2]
    g = torch.Generator().manual_seed(seed)
    m = MT19937(seed)
    calls = [("normal", 3, 0.0, 1.0), ("normal", 1, 0.0, 1.0), ("normal", 20, 0.1, 0.5), ("normal", 1, 2.0, 1.0),
             ("rand", 7), ("normal", 5, 0.0, 0.02), ("normal", 16, 0.0, 1.0), ("uniform", 9, -1.0, 1.0),
             ("normal", 100, 0.0, 0.02), ("normal", 2, 0.0, 1.0), ("randint", 11, 0, 1000)]
    for call in calls:
        kind, n = call[0], call[1]
        if kind == "normal":
            mean, std = call[2], call[3]
            assert_normals_match(m.normal_(n, mean, std), torch.empty(n).normal_(mean, std, generator=g).numpy(),
                                 mean, std, f"seed={seed} {call}")
        elif kind == "rand":
            assert np.array_equal(m.rand(n), torch.rand(n, generator=g).numpy()), call
        elif kind == "uniform":
            ref = torch.empty(n).uniform_(call[2], call[3], generator=g).numpy()
            assert np.array_equal(m.uniform_(n, call[2], call[3]), ref), call
        else:
            ref = torch.randint(call[2], call[3], (n,), generator=g).numpy()
            assert np.array_equal(m.randint(call[2], call[3], n), ref), call


def test_state_save_restore():
    seed = SEEDS[-1]
    m = MT19937(seed)
    m.normal_(5)                      # odd count: leaves a cached normal in the state
    m.rand(1000)
    saved = m.state
    assert saved["next_normal"] is not None
    first = [m.normal_(3), m.normal_(50), m.rand(700), m.normal_(1)]
    m.rand(5000)                      # move on, then go back
    m.state = saved
    again = [m.normal_(3), m.normal_(50), m.rand(700), m.normal_(1)]
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    # a fresh generator given the state continues it too; manual_seed clears the cached normal
    other = MT19937(0)
    other.state = saved
    assert np.array_equal(other.normal_(3), first[0])
    other.manual_seed(seed)
    assert other.state["next_normal"] is None
    # and the restored stream is still torch's
    g = torch.Generator().manual_seed(seed)
    torch.empty(5).normal_(generator=g)
    torch.rand(1000, generator=g)
    m.state = saved
    assert_normals_match(m.normal_(3), torch.empty(3).normal_(generator=g).numpy(), 0.0, 1.0, "restored")
    with pytest.raises(ValueError):
        m.state = {"key": np.zeros(10, np.uint32), "pos": 0}


def test_random_permutation_is_llmc_fisher_yates():
    seed = SEEDS[-1]
    for n in [0, 1, 2, 10, 1000]:
        perm = MT19937(seed).random_permutation(n)
        # llm.c: for i = n-1 .. 1: j = randint32() % (i + 1); swap(data[i], data[j])
        g = MT19937(seed)
        ref = list(range(n))
        for i in range(n - 1, 0, -1):
            j = g.randint32() % (i + 1)
            ref[i], ref[j] = ref[j], ref[i]
        assert perm.tolist() == ref
        assert sorted(perm.tolist()) == list(range(n))
    # shuffle_ permutes whatever order the data has (llm.c reshuffles shard indices in place)
    g = MT19937(seed)
    data = np.arange(50, dtype=np.int32) * 3
    g.shuffle_(data)
    again = data.copy()
    g.shuffle_(data)
    h = MT19937(seed)
    ref = np.arange(50, dtype=np.int32) * 3
    h.shuffle_(ref)
    assert np.array_equal(ref, again)
    h.shuffle_(ref)
    assert np.array_equal(ref, data) and data.dtype == np.int32


# ---------------------------------------------------------------- the Box-Muller kernel itself

def test_fma_is_correctly_rounded():
    f = F32
    # a product just below half an ulp of an odd c: one rounding keeps c, rounding twice (to the float64
    # midpoint, then ties-to-even) would move up
    a, b, c = f(1 + 2**-23), f(2**-24 * (1 - 2**-23)), f(1 + 2**-23)
    assert float(np.float64(a) * np.float64(b) + np.float64(c)) == 1 + 2**-23 + 2**-24   # the trap
    assert rand._fma(np.array([a]), b, c)[0] == c
    assert rand._fma(np.array([-a]), b, -c)[0] == -c
    rng = np.random.default_rng(5)
    x = rng.standard_normal(2000).astype(f) * f(3)
    y = rng.standard_normal(2000).astype(f)
    z = (rng.standard_normal(2000) * 10.0 ** rng.integers(-8, 3, 2000)).astype(f)
    got = rand._fma(x, y, z)
    for i in range(0, 2000, 7):
        exact = Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i]))
        # correctly rounded: no float32 neighbour is nearer the exact value
        cand = [np.nextafter(got[i], f(-np.inf)), got[i], np.nextafter(got[i], f(np.inf))]
        errs = [abs(Fraction(float(v)) - exact) for v in cand]
        assert errs[1] <= min(errs), i


def _fma(a, b, c):
    return rand._fma(np.asarray(a, dtype=np.float32), b, c)


def _reference_box_muller(k1, k2):
    """torch's normal_fill_16_AVX2 for 24-bit uniforms k1 (u1 = 1 - k1/2^24) and k2 (u2 = k2/2^24), line
    by line after avx_mathfun.h (log256_ps, sincos256_ps), with the fused multiply-adds of torch's build
    as explicit correctly rounded fma. Returns (radius*cos, radius*sin) in float32, for mean 0, std 1."""
    f, i32 = F32, np.int32
    x = f(1) - k1.astype(f) * f(2**-24)
    # log256_ps
    bits = x.view(i32)
    e = ((bits >> 23) - 127).astype(f) + f(1)
    x = ((bits & ~0x7F800000) | f(0.5).view(i32)).view(f)
    mask = x < f(0.707106781186547524)
    tmp = np.where(mask, x, f(0))
    x = x - f(1)
    e = e - np.where(mask, f(1), f(0))
    x = x + tmp
    z = x * x
    y = np.full_like(x, f(7.0376836292e-2))
    for p in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
              2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
        y = _fma(y, x, f(p))
    y = y * x
    y = _fma(y, z, e * f(-2.12194440e-4))
    y = y - z * f(0.5)
    logu1 = _fma(e, f(0.693359375), x + y)
    radius = np.sqrt(f(-2) * logu1)
    # sincos256_ps
    theta = f(2.0 * math.pi) * (k2.astype(f) * f(2**-24))
    x = np.abs(theta)
    j = (x * f(1.27323954473516)).astype(i32)
    j = (j + 1) & ~1
    y = j.astype(f)
    swap_sign_sin = (j & 4) != 0
    poly_mask = (j & 2) == 0
    x = _fma(y, f(-0.78515625), x)
    x = _fma(y, f(-2.4187564849853515625e-4), x)
    x = _fma(y, f(-3.77489497744594108e-8), x)
    sign_cos = ((~(j - 2)) & 4) != 0
    z = x * x
    yc = _fma(np.full_like(z, f(2.443315711809948e-5)), z, f(-1.388731625493765e-3))
    yc = _fma(yc, z, f(4.166664568298827e-2))
    yc = yc * z
    yc = _fma(yc, z, -(z * f(0.5)))
    yc = yc + f(1)
    ys = _fma(np.full_like(z, f(-1.9515295891e-4)), z, f(8.3321608736e-3))
    ys = _fma(ys, z, f(-1.6666654611e-1))
    ys = ys * z
    ys = _fma(ys, x, x)
    sin = np.where(poly_mask, ys, yc)
    cos = np.where(poly_mask, yc, ys)
    sin = np.where(swap_sign_sin, -sin, sin)
    cos = np.where(sign_cos, -cos, cos)
    return radius * cos, radius * sin


def _kernel(k1, k2):
    raw = np.zeros((len(k1), 16), np.uint64)
    raw[:, 0] = k1
    raw[:, 8] = k2
    out = np.empty(raw.size, np.float32)
    rand._box_muller_raw(raw.reshape(-1), F32(0), F32(1), out)
    out = out.reshape(-1, 16)
    return out[:, 0], out[:, 8]


def _special_inputs():
    top = 1 << 24
    ks = [0, 1, 2, 3, top - 1, top - 2, 1 << 23, (1 << 23) + 1, (1 << 22) - 1]
    ks += [int(top * (1 - 0.707106781186547524)) + d for d in range(-3, 4)]         # u1 near sqrt(1/2)
    ks += [(top * q) // 8 + d for q in range(1, 8) for d in range(-3, 4)]            # theta near octants
    ks += [top >> s for s in range(1, 24)]
    return np.array(ks, dtype=np.uint64)


def test_box_muller_kernel_matches_reference_sample():
    rng = np.random.default_rng(secrets.randbelow(1 << 31))
    special = _special_inputs()
    k1 = np.concatenate([special, rng.integers(0, 1 << 24, 1 << 16, dtype=np.uint64)])
    k2 = np.concatenate([special, rng.integers(0, 1 << 24, 1 << 16, dtype=np.uint64)])
    for a, b in [(k1, k2), (k2, k1)]:
        c_ref, s_ref = _reference_box_muller(a, b)
        c, s = _kernel(a, b)
        assert np.array_equal(c.view(np.int32), (c_ref + F32(0)).view(np.int32))
        assert np.array_equal(s.view(np.int32), (s_ref + F32(0)).view(np.int32))


@pytest.mark.slow
def test_box_muller_kernel_matches_reference_exhaustive(request):
    """Every one of the 2^24 possible uniforms through both halves of the kernel: this is what shows
    the float64-then-float32 double rounding inside log/sincos never differs from a true fma."""
    step = 1 << 20
    for start in range(0, 1 << 24, step):
        k = np.arange(start, start + step, dtype=np.uint64)
        kr = k[::-1].copy()
        c_ref, s_ref = _reference_box_muller(k, kr)
        c, s = _kernel(k, kr)
        assert np.array_equal(c.view(np.int32), (c_ref + F32(0)).view(np.int32)), start
        assert np.array_equal(s.view(np.int32), (s_ref + F32(0)).view(np.int32)), start


# ---------------------------------------------------------------- init_parameters

TINY = GPT2Config(num_layers=2, channels=64, num_heads=2, vocab_size=300, max_seq_len=32)


def test_init_matches_torch_generator_slice_by_slice():
    for config in (TINY, GPT2Config(num_layers=3, channels=32, num_heads=2, vocab_size=129, max_seq_len=17)):
        seed = 42
        flat = init_parameters(config, seed)
        assert isinstance(flat, torch.Tensor) and flat.dtype == torch.float32
        assert flat.shape == (config.num_parameters,)
        views = parameter_views(flat.numpy(), config)
        g = torch.Generator().manual_seed(seed)
        for name, offset, n, std in init_draws(config):
            ref = torch.empty(n).normal_(0.0, float(std), generator=g).numpy()
            assert_normals_match(views[name].reshape(-1)[offset:offset + n], ref, 0.0, float(std),
                                 f"{config.describe()} {name}[{offset}:{offset + n}]")


def test_init_draw_order():
    L = TINY.num_layers
    draws = init_draws(TINY)
    names = [d[0] for d in draws]
    layer = ["qkvw", "attprojw", "fcw", "fcprojw"]
    assert names == ["wte", "wpe"] + layer * L
    assert draws[0][2] == TINY.vocab_size * TINY.channels          # the real vocab, not the padded one
    assert draws[2 + 4][1] == draws[2][2]                         # layer 1's qkvw slice follows layer 0's
    assert residual_std(12) == F32(0.02) * (F32(1) / np.sqrt(F32(24)))


def test_init_structure():
    config = GPT2Config(num_layers=4, channels=128, num_heads=4, vocab_size=1000, max_seq_len=64)
    p = parameter_views(init_parameters(config).numpy(), config)
    for name in ("ln1w", "ln2w", "lnfw"):
        assert np.all(p[name] == 1.0), name
    for name in ("ln1b", "ln2b", "lnfb", "qkvb", "attprojb", "fcb", "fcprojb"):
        assert np.all(p[name] == 0.0), name
    V, Vp = config.vocab_size, config.padded_vocab_size
    assert Vp > V and np.all(p["wte"][V:] == 0.0)
    assert np.all(p["wte"][:V].std(axis=1) > 0)                  # every real row is drawn
    assert abs(p["wte"][:V].std() / 0.02 - 1) < 0.02
    assert abs(p["wpe"].std() / 0.02 - 1) < 0.05
    assert abs(p["qkvw"].std() / 0.02 - 1) < 0.02
    rs = 0.02 / math.sqrt(2 * config.num_layers)
    for name in ("attprojw", "fcprojw"):
        assert abs(p[name].std() / rs - 1) < 0.03, name
    for name in ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"):
        assert abs(p[name].mean()) < 0.1 * p[name].std(), name


def test_init_is_deterministic_per_seed():
    a = init_parameters(TINY, 42)
    b = init_parameters(TINY, 42)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    c = init_parameters(TINY, 43)
    assert not torch.equal(a, c)


@pytest.mark.slow
def test_init_d12_time(request, capsys):
    config = parse_descriptor("d12")
    t = time.perf_counter()
    flat = init_parameters(config)
    ours = time.perf_counter() - t
    n = sum(d[2] for d in init_draws(config))
    t = time.perf_counter()
    torch.empty(n).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(42))
    ref = time.perf_counter() - t
    with capsys.disabled():
        print(f"\ninit_parameters(d12): {ours:.2f} s for {flat.numel():,} parameters ({n:,} normals); "
              f"torch's own normal_ of that many: {ref:.2f} s")
