"""llm.c's `rand.h`: a Mersenne Twister that reproduces torch's CPU generator, vectorised with numpy.

torch.manual_seed(s) seeds a standard mt19937 (init_genrand(s & 0xffffffff)); numpy's MT19937 bit
generator has the same twist and tempering, so after loading the same key its `random_raw` stream is
torch's stream of 32-bit draws. On top of that stream this module mirrors torch's CPU sampling code:

- randfloat32 = (u32 & (2^24-1)) / 2^24; randfloat64 = (u64 & (2^53-1)) / 2^53, where a 64-bit draw is
  two 32-bit draws, the FIRST one the high half (torch's random64).
- normal_(n >= 16), float32: fill n uniforms, Box-Muller each block of 16 in place (lanes 0..7 give u1,
  lanes 8..15 give u2), and if n % 16 != 0 redraw the last 16 as fresh uniforms and transform again.
  The transform is torch's AVX2 kernel (used on every x86 CPU with AVX2, AVX-512 included): Cephes
  float32 log and sincos from avx_mathfun.h, evaluated here in float32 with the fused multiply-adds the
  compiler put into torch's build emulated exactly. Results are bitwise equal to torch's on such CPUs.
  (torch's scalar fallback, used without AVX2, on ARM or with ATEN_CPU_CAPABILITY=default, computes
  with libm instead: there about a third of the values differ, by at most ~2.5e-6 * std. llm.c's C
  rand.h computes that way too, with logf/cosf/sinf.) The transform runs on up to 8 threads.
- normal_(n < 16): torch's double-precision Box-Muller, one pair of randfloat64 per two samples; the
  second sample of a pair is cached IN THE GENERATOR and used by the next draw, even in a later call
  (torch keeps it across calls; llm.c's C port keeps it within a call, in float). A new seed clears it.
- uniform_ and randint as torch's; shuffle_ / random_permutation as llm.c's random_permutation.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np

from .errors import LlmpyError

_N = 624
_F32 = np.float32
_F64 = np.float64
_I32 = np.int32
_INV24 = _F32(2.0 ** -24)
_INV53 = 2.0 ** -53
_MASK24 = np.uint64((1 << 24) - 1)

# Cephes constants of torch's avx_mathfun.h, as float32 (they are the published Cephes coefficients)
_LOG_P = tuple(_F32(v) for v in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                                 1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                                 3.3333331174e-1))
_LOG_Q1 = _F32(-2.12194440e-4)
_LOG_Q2 = _F32(0.693359375)
_SQRTHF = _F32(0.707106781186547524)
_SQRTHF_BITS = _I32(_SQRTHF.view(_I32))  # positive floats order as their bit patterns do
_DP1 = _F32(-0.78515625)
_DP2 = _F32(-2.4187564849853515625e-4)
_DP3 = _F32(-3.77489497744594108e-8)
_SIN_P = tuple(_F32(v) for v in (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1))
_COS_P = tuple(_F32(v) for v in (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2))
_FOPI = _F32(1.27323954473516)  # 4 / pi
_TWO_PI = _F32(2.0 * math.pi)     # torch: _mm256_set1_ps(2.0f * c10::pi<double>)
_HALF = _F32(0.5)
_ONE = _F32(1.0)

_LOW29 = np.int64((1 << 29) - 1)  # the float64 mantissa bits below float32 precision
_MID29 = np.int64(1 << 28)        # ... a float32 rounding midpoint

# Box-Muller runs in chunks of this many 16-blocks: big enough to amortise the per-call overhead
# (which holds the GIL), small enough for the temporaries to stay in cache
_CHUNK_BLOCKS = 8192


def _fma(a, b, c):
    """float32 fused multiply-add round(a*b + c), exactly.

    a, b are float32 values (arrays or scalars, possibly held in float64): their product is exact in
    float64, so the only error of `a*b + c` in float64 is that sum's rounding; converting to float32
    then rounds twice, which differs from one rounding only when the float64 sum lands exactly on a
    float32 midpoint without being exact. Such lanes (about 1 in 2^29) are found and nudged off the
    midpoint in the direction of the lost error, after which the conversion rounds correctly.
    """
    p = np.multiply(a, b, dtype=_F64)
    t = p + c
    hit = (t.view(np.int64) & _LOW29) == _MID29
    if hit.any():
        idx = np.nonzero(hit)
        pb = np.broadcast_to(p, t.shape)[idx]
        cb = np.broadcast_to(np.asarray(c, dtype=_F64), t.shape)[idx]
        tt = t[idx]
        bv = tt - pb
        err = (pb - (tt - bv)) + (cb - bv)  # Knuth's TwoSum: exact error of pb + cb
        t[idx] = np.where(err == 0, tt, np.nextafter(tt, np.where(err > 0, np.inf, -np.inf)))
    return t.astype(_F32)


def _log_avx2(u1: np.ndarray) -> np.ndarray:
    """torch's log256_ps (Cephes logf, avx_mathfun.h) on float32 u1 in [2^-24, 1], as compiled: the
    Horner steps and `y*z + e*q1` are fused multiply-adds in torch's build.

    Each fused step is evaluated in float64 (a float32 product is exact there) and rounded to float32
    once more. That double rounding could in principle differ from one rounding, but it does not for
    any of the 2^24 possible inputs (checked against true fused multiply-adds: tests/test_rand.py
    re-checks a sample by default and all of them under -m slow). Every fused step matters: done as two
    float32 roundings instead, each changes some results.
    """
    bits = u1.view(_I32)
    e = bits >> 23
    mb = bits & _I32(0x007FFFFF)
    mb |= _I32(0x3F000000)              # mantissa m in [0.5, 1)
    d = mb - _SQRTHF_BITS
    d >>= 31                            # -1 where m < sqrt(1/2), else 0
    e += d
    e -= 126                            # exponent + 1, less one where m < sqrt(1/2)
    ef = e.astype(_F32)
    d <<= 23
    mb -= d                             # there m becomes 2m (exponent + 1)
    x = mb.view(_F32)
    x -= _ONE                           # exact: 2m-1 or m-1
    z = x * x
    x64 = x.astype(_F64)
    t = x64 * _F64(_LOG_P[0])
    t += _LOG_P[1]
    y = t.astype(_F32)
    for p in _LOG_P[2:]:
        np.multiply(y, x64, out=t)
        t += p
        y[...] = t
    y *= x
    np.multiply(y, z, out=t, dtype=_F64)
    t += ef * _LOG_Q1
    y[...] = t
    y -= z * _HALF                      # z*0.5 is exact: fused or not, one rounding
    y += x
    ef *= _LOG_Q2                       # exact (q2 has 9 bits)
    y += ef
    return y


def _sincos_avx2(theta: np.ndarray):
    """torch's sincos256_ps (Cephes sinf/cosf, avx_mathfun.h) on float32 theta in [0, 2pi), as
    compiled (fused: x + y*DP3, the Horner steps, yc*z - z/2 and ys*x + x). Same float64 evaluation
    and checks as _log_avx2."""
    j = (theta * _FOPI).astype(_I32)
    j += 1
    j &= ~1                             # octant, rounded up to even: 0, 2, .., 8
    yj = j.astype(_F32)
    x = yj * _DP1                       # yj*DP1 and yj*DP2 are exact (yj <= 8): fusing changes nothing
    x += theta
    x += yj * _DP2
    t = yj.astype(_F64)
    t *= _F64(_DP3)
    t += x
    x[...] = t
    z = x * x
    z64 = z.astype(_F64)
    zh = z * _HALF
    t = z64 * _F64(_COS_P[0])
    t += _COS_P[1]
    yc = t.astype(_F32)
    np.multiply(yc, z64, out=t)
    t += _COS_P[2]
    yc[...] = t
    yc *= z
    np.multiply(yc, z64, out=t)
    t -= zh
    yc[...] = t
    yc += _ONE                          # cosine polynomial
    np.multiply(z64, _F64(_SIN_P[0]), out=t)
    t += _SIN_P[1]
    ys = t.astype(_F32)
    np.multiply(ys, z64, out=t)
    t += _SIN_P[2]
    ys[...] = t
    ys *= z
    np.multiply(ys, x, out=t, dtype=_F64)
    t += x
    ys[...] = t                         # sine polynomial
    # choose the polynomial and the sign of each result with bit operations, as the AVX code does
    sb = ys.view(_I32)
    cb = yc.view(_I32)
    swap = j & 2
    swap <<= 30
    swap >>= 31                         # -1 where the cosine polynomial gives the sine
    diff = sb ^ cb
    diff &= swap
    sb ^= diff
    cb ^= diff
    sign = j & 4
    sign <<= 29
    sb ^= sign
    j -= 2
    np.invert(j, out=j)
    j &= 4
    j <<= 29
    cb ^= j
    return ys, yc


def _box_muller_raw(raw: np.ndarray, mean: np.float32, std: np.float32, out: np.ndarray) -> None:
    """torch's normal_fill_16 (AVX2) on 16-blocks of uniforms given as raw 32-bit draws (uint64, a
    multiple of 16 of them), written to the float32 vector out. Per block: u1 = 1 - u[0:8],
    u2 = u[8:16], radius = sqrt(-2 log u1), theta = 2pi u2, out = (radius cos, radius sin) * std + mean.
    """
    r = raw.reshape(-1, 16) & _MASK24
    out = out.reshape(-1, 16)
    u1 = (_F32(1 << 24) - r[:, :8].astype(_F32)) * _INV24   # = 1 - u exactly
    theta = r[:, 8:].astype(_F32)
    theta *= _INV24
    theta *= _TWO_PI
    radius = _log_avx2(u1.reshape(-1))
    radius *= _F32(-2)
    np.sqrt(radius, out=radius)
    s, c = _sincos_avx2(theta.reshape(-1))
    c *= radius
    s *= radius
    c = c.reshape(-1, 8)
    s = s.reshape(-1, 8)
    if mean == 0 and not np.signbit(mean):
        # fma(n, std, +0) is the rounded product, except that a -0 product becomes +0 (a -0 mean keeps it: _fma)
        np.multiply(c, std, out=out[:, :8])
        np.multiply(s, std, out=out[:, 8:])
        out += _F32(0)
    else:
        out[:, :8] = _fma(c, std, mean)
        out[:, 8:] = _fma(s, std, mean)


_POOL: ThreadPoolExecutor | None = None
_WORKERS = 1


def _pool() -> ThreadPoolExecutor | None:
    """Threads for the Box-Muller chunks (numpy releases the GIL in its loops); None on one core."""
    global _POOL, _WORKERS
    if _POOL is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        _WORKERS = max(1, min(8, cores))
        if _WORKERS == 1:
            return None
        _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="llmpy-rand")
    return _POOL


def _forget_pool_after_fork() -> None:
    """A forked child has none of the pool's threads (the executor would queue its work for ever): start anew."""
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


SEED_LIMIT = 1 << 32  # llm.c's seeds are unsigned 32-bit, and mt19937 keeps only those bits


def check_seed(seed, flag: str = "--seed") -> None:
    """One LlmpyError naming `flag` unless seed is an integer in [0, 2**32): a larger one would seed the same
    weights as its low 32 bits, and seed + step (each sample's generator) must stay within 64 bits."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise LlmpyError(f"{flag} {seed!r}: must be an integer from 0 to {SEED_LIMIT - 1}")


def init_genrand(seed: int) -> np.ndarray:
    """The 624-word key of a standard mt19937 seeded with init_genrand(seed & 0xffffffff)."""
    key = [seed & 0xFFFFFFFF]
    for i in range(1, _N):
        prev = key[-1]
        key.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return np.array(key, dtype=np.uint32)


class MT19937:
    """torch's CPU generator (and llm.c's mt19937_state): same seed, same numbers."""

    def __init__(self, seed: int = 5489):
        self._bg = np.random.MT19937(0)
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        seed = int(seed)
        self.seed = seed
        # pos = 624: the first draw twists, as torch's left_ = 1 after seeding
        self._bg.state = {"bit_generator": "MT19937", "state": {"key": init_genrand(seed), "pos": _N}}
        self._next_normal: float | None = None   # torch's next_double_normal_sample

    # ---- state, for a reproducible resume
    @property
    def state(self) -> dict:
        st = self._bg.state["state"]
        return {"seed": self.seed, "key": np.array(st["key"], dtype=np.uint32).copy(), "pos": int(st["pos"]),
                "next_normal": self._next_normal}

    @state.setter
    def state(self, value: dict) -> None:
        key = np.asarray(value["key"], dtype=np.uint32)
        if key.shape != (_N,) or not 0 <= int(value["pos"]) <= _N:
            raise ValueError("not an MT19937 state: need a 624-word key and 0 <= pos <= 624")
        self._bg.state = {"bit_generator": "MT19937", "state": {"key": key.copy(), "pos": int(value["pos"])}}
        self.seed = int(value.get("seed", 0))
        nxt = value.get("next_normal")
        self._next_normal = None if nxt is None else float(nxt)

    # ---- raw draws
    def raw_uint32(self, n: int) -> np.ndarray:
        """The next n 32-bit draws (uint32)."""
        return self._bg.random_raw(int(n)).astype(np.uint32)

    def raw_uint64(self, n: int) -> np.ndarray:
        """The next n 64-bit draws (uint64), each two 32-bit draws with the first as the high half."""
        r = self._bg.random_raw(2 * int(n))
        return (r[0::2] << np.uint64(32)) | r[1::2]

    def randint32(self) -> int:
        return int(self._bg.random_raw())

    def randint64(self) -> int:
        hi = int(self._bg.random_raw())
        return (hi << 32) | int(self._bg.random_raw())

    def randfloat32(self) -> float:
        return float(_F32(self.randint32() & 0xFFFFFF) * _INV24)

    def randfloat64(self) -> float:
        return (self.randint64() & ((1 << 53) - 1)) * _INV53

    def _uniform24(self, n: int) -> np.ndarray:
        return (self._bg.random_raw(n) & _MASK24).astype(_F32) * _INV24

    # ---- distributions (float32 results, as torch's on a float32 CPU tensor)
    def rand(self, n: int) -> np.ndarray:
        """torch.rand(n): n randfloat32 in [0, 1)."""
        return self._uniform24(int(n))

    def uniform_(self, n: int, low: float = 0.0, high: float = 1.0, out: np.ndarray | None = None) -> np.ndarray:
        """torch's tensor.uniform_(low, high) on n float32: x * (high - low) + low (one rounding, as the
        compiled fused multiply-add), a result that rounds up to `high` replaced by `low`."""
        n = int(n)
        out = np.empty(n, _F32) if out is None else out
        lo, hi = _F32(low), _F32(high)
        x = self._uniform24(n)
        if lo == 0 and hi == 1:
            out[:] = x
            return out
        v = _fma(x, hi - lo, lo)
        v[v == hi] = lo
        out[:] = v
        return out

    def normal_(self, n: int, mean: float = 0.0, std: float = 1.0, out: np.ndarray | None = None) -> np.ndarray:
        """torch's tensor.normal_(mean, std) on a contiguous float32 tensor of n elements."""
        n = int(n)
        out = np.empty(n, _F32) if out is None else out
        if out.shape != (n,) or out.dtype != _F32:
            raise ValueError(f"out must be a float32 vector of {n} elements")
        if not std >= 0:
            raise ValueError(f"normal_ needs std >= 0, got {std}")
        if n >= 16:
            self._normal_fill(out, _F32(mean), _F32(std))
        else:
            for t in range(n):
                out[t] = self._normal_double(float(mean), float(std))
        return out

    def _normal_fill(self, out: np.ndarray, mean: np.float32, std: np.float32) -> None:
        n = out.shape[0]
        full = n // 16 * 16
        step = 16 * _CHUNK_BLOCKS
        pool = _pool() if full > step else None
        pending = []
        # the draws are made in stream order here; their transforms may run on other threads
        for i in range(0, full, step):
            k = min(step, full - i)
            raw = self._bg.random_raw(k)
            if pool is None:
                _box_muller_raw(raw, mean, std, out[i:i + k])
                continue
            pending.append(pool.submit(_box_muller_raw, raw, mean, std, out[i:i + k]))
            if len(pending) > 2 * _WORKERS:   # bound the draws held in memory
                pending.pop(0).result()
        for f in pending:
            f.result()
        if full != n:
            # torch draws all n uniforms, then redraws the last 16 (overlapping the last full block)
            # and transforms them again: the partial block's own draws are only skipped over
            self._bg.random_raw(n - full)
            _box_muller_raw(self._bg.random_raw(16), mean, std, out[n - 16:])

    def _normal_double(self, mean: float, std: float) -> float:
        if self._next_normal is not None:
            v, self._next_normal = self._next_normal, None
        else:
            u1 = self.randfloat64()
            u2 = self.randfloat64()
            r = math.sqrt(-2.0 * math.log1p(-u2))
            theta = 2.0 * math.pi * u1
            self._next_normal = r * math.sin(theta)
            v = r * math.cos(theta)
        # v * std + mean in double, one rounding (torch's build fuses it), then to float32; an exact zero takes
        # IEEE's sign (-0 from a -0 product plus a -0 mean), which a Fraction has lost: the plain sum has it
        exact = Fraction(v) * Fraction(std) + Fraction(mean)
        return float(_F32(float(exact) if exact else v * std + mean))

    def randint(self, low: int, high: int, n: int) -> np.ndarray:
        """torch.randint(low, high, (n,)) (int64): a draw modulo the range, plus low. The draw is a 64-bit
        one when the range is 2^28 or more (torch's threshold since 2.x, to limit the modulo skew; it
        was 2^32 before), else a 32-bit one."""
        low, high, n = int(low), int(high), int(n)
        if high <= low:
            raise ValueError(f"randint needs low < high, got [{low}, {high})")
        span = high - low
        if span >= 1 << 28:
            v = self.raw_uint64(n) % np.uint64(span)
        else:
            v = self._bg.random_raw(n) % np.uint64(span)
        # wraps mod 2^64 like torch's unsigned arithmetic
        return (v + np.uint64(low & 0xFFFFFFFFFFFFFFFF)).view(np.int64)

    # ---- llm.c's permutations (dataloader shuffles)
    def shuffle_(self, data) -> None:
        """llm.c's random_permutation(data, numel, state): Fisher-Yates in place, for i = numel-1 down
        to 1 swap data[i] with data[randint32() % (i + 1)]. Shuffles whatever order data already has."""
        n = len(data)
        if n < 2:
            return
        i = np.arange(n - 1, 0, -1, dtype=np.uint64)
        js = (self._bg.random_raw(n - 1) % (i + np.uint64(1))).tolist()
        vals = data.tolist() if isinstance(data, np.ndarray) else list(data)
        for i, j in zip(range(n - 1, 0, -1), js):
            vals[i], vals[j] = vals[j], vals[i]
        data[:] = vals

    def random_permutation(self, n: int) -> np.ndarray:
        """llm.c's init_identity_permutation + random_permutation: a shuffled arange(n) (int64)."""
        perm = np.arange(int(n), dtype=np.int64)
        self.shuffle_(perm)
        return perm
