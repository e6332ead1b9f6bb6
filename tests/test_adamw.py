"""AdamW kernel against reference.adamw_update, per-tensor weight decay, master weights, stochastic
rounding, shards, determinism. Runs on the GPU where there is one, else in Triton's interpreter."""
import pytest
import torch

from llmpy import reference as ref
from llmpy.kernels.adamw import (GRAD_SCALE, adamw_update, decay_ranges_tensor, hyper_tensor, init_from_master,
                                 set_hyper)

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
RANGES = [(0, 700), (1500, 2300)]  # decayed spans; the rest gets no decay
N = 3001


def reference_step(p, g, m, v, step, grad_scale):
    """The reference applied span by span with each span's weight decay (fp32, in place)."""
    bounds = sorted({0, N, *[x for r in RANGES for x in r]})
    for a, b in zip(bounds, bounds[1:]):
        wd = HP["weight_decay"] if any(s <= a and b <= e for s, e in RANGES) else 0.0
        ref.adamw_update(p[a:b], g[a:b], m[a:b], v[a:b], step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd,
                         grad_scale)


def setup(device, dtype, master):
    p32 = torch.randn(N, device=device)
    params = p32.to(dtype)
    state = dict(params=params, m=torch.zeros(N, device=device), v=torch.zeros(N, device=device),
                 master=params.float().clone() if master else None,
                 hyper=hyper_tensor(device), ranges=decay_ranges_tensor(RANGES, device),
                 seed=torch.tensor([1234], dtype=torch.int64, device=device))
    return state


def kernel_step(state, grad, step, grad_scale=0.7, seed=1235, stochastic=True):
    """adamw_update of state at step `step` with grad as it is (its dtype kept: fp32 grads on bf16 params too)."""
    set_hyper(state["hyper"], HP["lr"], step, HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], grad_scale)
    state["seed"].fill_(seed)
    adamw_update(state["params"], grad, state["m"], state["v"], state["hyper"], state["seed"], state["ranges"],
                 master=state["master"], stochastic=stochastic)


def run_steps(state, grads, steps, grad_scale=0.7, seed0=1234, stochastic=True):
    for step in range(1, steps + 1):
        kernel_step(state, grads[step - 1].to(state["params"].dtype), step, grad_scale, seed0 + step, stochastic)


def test_fp32_matches_reference(device):
    state = setup(device, torch.float32, master=False)
    p, m, v = state["params"].cpu().clone(), torch.zeros(N), torch.zeros(N)
    grads = [torch.randn(N, device=device) for _ in range(3)]
    run_steps(state, grads, 3)
    for step in range(1, 4):
        reference_step(p, grads[step - 1].cpu(), m, v, step, 0.7)
    assert torch.allclose(state["params"].cpu(), p, rtol=1e-5, atol=1e-6)
    # m and v: the kernel's lerp (two FMAs) and torch's round differently, each within an ulp or so of
    # the largest term it adds; where the terms cancel (m ~ 1e-3 from g ~ 1) a tolerance relative to the
    # result is too tight (it failed ~1 seed in 5), so bound the difference by 4 ulps of that term
    ulp = 2.0 ** -23
    scale = torch.stack(grads).abs().amax(0).cpu() * 0.7
    assert ((state["m"].cpu() - m).abs() <= 4 * ulp * scale).all()
    assert ((state["v"].cpu() - v).abs() <= 4 * ulp * scale ** 2).all()


def bf16_neighbours(x):
    """The two bf16 values around each fp32 x (equal when x is representable): truncate the low 16
    bits of the fp32 pattern (towards zero), and the next bf16 away from zero."""
    bits = x.float().contiguous().view(torch.int32)
    toward_zero = (bits & ~0xFFFF).view(torch.float32)
    away = torch.where((bits & 0xFFFF) != 0, (bits & ~0xFFFF) + 0x10000, bits & ~0xFFFF).view(torch.float32)
    return torch.minimum(toward_zero, away), torch.maximum(toward_zero, away)


def test_bf16_with_master_weights(device):
    state = setup(device, torch.bfloat16, master=True)
    p, m, v = state["master"].cpu().clone(), torch.zeros(N), torch.zeros(N)
    grads = [torch.randn(N, device=device).bfloat16() for _ in range(3)]
    run_steps(state, grads, 3)
    for step in range(1, 4):
        reference_step(p, grads[step - 1].float().cpu(), m, v, step, 0.7)
    master = state["master"].cpu()
    assert torch.allclose(master, p, rtol=1e-5, atol=1e-6)
    lo, hi = bf16_neighbours(master)
    got = state["params"].cpu().float()
    assert torch.all((got == lo) | (got == hi)), "bf16 weights must be one of the two neighbours of the master"


def test_bf16_without_master_rounds_stochastically(device):
    state = setup(device, torch.bfloat16, master=False)
    start = state["params"].cpu().float()
    p, m, v = start.clone(), torch.zeros(N), torch.zeros(N)
    grads = [torch.randn(N, device=device).bfloat16()]
    run_steps(state, grads, 1)
    reference_step(p, grads[0].float().cpu(), m, v, 1, 0.7)
    # the kernel's fp32 value before rounding differs from the reference's by an ulp or so of the larger
    # of the two terms it subtracts; where they cancel (a weight of ~0.01 minus an update of ~0.01) that
    # is far more than an ulp of the result, and one seed in ~25 put a value across a bf16 boundary. So
    # the bf16 neighbours of the reference widened by 4 ulps of that term: still one of the two values
    # around it everywhere else.
    slack = 4 * 2.0 ** -23 * torch.maximum(start.abs(), (start - p).abs())
    lo, hi = bf16_neighbours(p - slack)[0], bf16_neighbours(p + slack)[1]
    got = state["params"].cpu().float()
    assert torch.all((got >= lo) & (got <= hi))


def step_against_float64(state, grad, step, stochastic=True, grad_scale=0.7):
    """One kernel step, and reference_step in float64 from the same state (the kernel's parameters - its master
    weights where it has them -, m and v): checks m, v and the master weights. Returns the exact parameters and
    the slack that bounds the kernel's fp32 parameter around them (before any rounding to bf16)."""
    w = state["params"] if state["master"] is None else state["master"]
    p0, m0, v0 = (t.cpu().double() for t in (w, state["m"], state["v"]))
    p, m, v, g = p0.clone(), m0.clone(), v0.clone(), grad.cpu().double()
    reference_step(p, g, m, v, step, grad_scale)
    kernel_step(state, grad, step, grad_scale, seed=4321 + step, stochastic=stochastic)
    # m and v: within 4 fp32 ulps of the largest term each one adds (as in test_fp32_matches_reference); rounding
    # the gradient to bf16 first is off by ~0.1 * |g| * 2^-9 in m, a thousand times more
    ulp, gs = 2.0 ** -23, (g * grad_scale).abs()
    assert ((state["m"].cpu().double() - m).abs() <= 4 * ulp * torch.maximum(m0.abs(), gs)).all()
    assert ((state["v"].cpu().double() - v).abs() <= 4 * ulp * torch.maximum(v0, gs * gs)).all()
    # the fp32 parameter p0 - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p0): half an ulp of p0 for the subtraction,
    # and a few ulps of the update's bound `upd` for m's error (above) and v's (v's rounding is relative to
    # max(v0, g^2), up to 20 times v itself: ~5 ulps of sqrt(v)) and the fp32 hyper-parameters: 16 ulps of both
    # (at most 1.3 measured over 200 steps); still ~2^-11 of a bf16 ulp
    bc1, bc2 = 1 - HP["beta1"] ** step, 1 - HP["beta2"] ** step
    den = (v / bc2).sqrt() + HP["eps"]
    upd = HP["lr"] * (torch.maximum(m0.abs(), gs) / bc1 / den + HP["weight_decay"] * p0.abs())
    slack = 16 * ulp * (p0.abs() + upd)
    if state["master"] is not None:
        assert ((state["master"].cpu().double() - p).abs() <= slack).all()
    return p, slack


@pytest.mark.parametrize("master", [True, False], ids=["master", "no_master"])
def test_bf16_params_with_fp32_grads(device, master):
    """bf16 parameters updated from an fp32 gradient (the model's fp32 accumulator of several micro-steps, or the
    gradient reduced over ranks): the kernel must use the fp32 values, not bf16-rounded ones. Three steps, each
    against the float64 reference from the kernel's state; the bf16 weights are one of the two bf16 values around
    the exact result (stochastic rounding: within one bf16 ulp of it), widened by the slack of the fp32 value."""
    state = setup(device, torch.bfloat16, master)
    for step in range(1, 4):
        grad = torch.randn(N, device=device)
        assert not torch.equal(grad, grad.bfloat16().float()), "a bf16-representable gradient tests nothing"
        p, slack = step_against_float64(state, grad, step)
        got = state["params"].cpu().float()
        lo, hi = bf16_neighbours((p - slack).float())[0], bf16_neighbours((p + slack).float())[1]
        assert torch.all((got >= lo) & (got <= hi)), f"step {step}"
        if master:  # and rounded from the master itself
            lo, hi = bf16_neighbours(state["master"].cpu())
            assert torch.all((got == lo) | (got == hi)), f"step {step}"


@pytest.mark.parametrize("master", [True, False], ids=["master", "no_master"])
def test_bf16_round_to_nearest_per_element(device, master):
    """stochastic=False: each bf16 weight is the fp32 result rounded to nearest even. Per element against the
    float64 reference: bitwise RNE(fp32(exact)) except where the kernel's fp32 value may lie on the other side
    of a rounding midpoint (exact +- slack straddles one: ~2^-10 of the elements), where either neighbour is
    right; with master weights, bitwise RNE of the kernel's own fp32 master everywhere."""
    state = setup(device, torch.bfloat16, master)
    for step in range(1, 3):
        p, slack = step_against_float64(state, torch.randn(N, device=device).bfloat16(), step, stochastic=False)
        got = state["params"].cpu()
        lo, hi = (p - slack).float().bfloat16(), (p + slack).float().bfloat16()
        assert torch.all((got >= lo) & (got <= hi)), f"step {step}"
        pinned = lo == hi
        assert pinned.float().mean() > 0.99, "the slack must leave almost every element a single answer"
        assert torch.equal(got[pinned].view(torch.int16), p.float().bfloat16()[pinned].view(torch.int16))
        if master:
            assert torch.equal(got.view(torch.int16), state["master"].cpu().bfloat16().view(torch.int16))


def test_bf16_round_to_nearest_breaks_ties_to_even(device):
    """Master weights exactly halfway between two bf16 values, an update far below their fp32 ulp (the master
    keeps its bits): round to nearest even picks the even neighbour, up for some and down for others."""
    n = 4000
    base = ((torch.rand(n) + 0.5) * torch.randn(n).sign()).view(torch.int32)  # |w| in [0.5, 1.5)
    master = ((base & ~0xFFFF) | 0x8000).view(torch.float32).to(device)  # the low 16 bits: exactly half
    state = dict(params=torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device), master=master.clone(),
                 m=torch.zeros(n, device=device), v=torch.zeros(n, device=device), hyper=hyper_tensor(device),
                 ranges=decay_ranges_tensor([(0, n // 2)], device),
                 seed=torch.tensor([7], dtype=torch.int64, device=device))
    set_hyper(state["hyper"], 1e-12, 1, HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], 1.0)
    adamw_update(state["params"], torch.randn(n, device=device), state["m"], state["v"], state["hyper"],
                 state["seed"], state["ranges"], master=state["master"], stochastic=False)
    assert torch.equal(state["master"], master), "the update must not move the fp32 master (lr too large)"
    got = state["params"].cpu().view(torch.int16)
    expected = master.cpu().bfloat16().view(torch.int16)  # torch's RNE: ties to the even bf16
    assert torch.equal(got, expected)
    assert not (got & 1).any()
    up = (got.float() != (master.cpu().view(torch.int32) >> 16).float()).float().mean()
    assert 0.3 < up < 0.7, "ties rounded all one way cannot tell nearest-even from truncation or half-up"


def test_small_updates_survive_only_with_stochastic_rounding(device):
    """Updates far below half a bf16 ulp: round-to-nearest never moves the weights, stochastic rounding
    moves them by the right amount on average (the silent bug the seed warns about)."""
    n, steps, lr = 1 << 14, 8, 5e-4
    results = {}
    for stochastic in (True, False):
        params = torch.ones(n, dtype=torch.bfloat16, device=device)  # ulp at 1.0 is 2^-7 = 0.0078
        m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
        hyper, seed = hyper_tensor(device), torch.zeros(1, dtype=torch.int64, device=device)
        ranges = decay_ranges_tensor([], device)
        grad = torch.ones(n, dtype=torch.bfloat16, device=device)  # Adam's step is then ~lr every step
        for step in range(1, steps + 1):
            set_hyper(hyper, lr, step, 0.9, 0.95, 1e-8, 0.0, 1.0)
            seed.fill_(step * 7919)
            adamw_update(params, grad, m, v, hyper, seed, ranges, stochastic=stochastic)
        results[stochastic] = params.float().mean().item()
    assert results[False] == 1.0
    expected = 1.0 - steps * lr
    assert abs(results[True] - expected) < 0.1 * steps * lr, results


def test_deterministic_for_a_seed_and_sharding_changes_nothing(device):
    grads = [torch.randn(N, device=device).bfloat16() for _ in range(2)]
    a = setup(device, torch.bfloat16, master=False)
    b = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in a.items()}
    run_steps(a, grads, 2)
    run_steps(b, grads, 2)
    assert torch.equal(a["params"], b["params"]) and torch.equal(a["m"], b["m"])

    # the same update done in two shards, each told its offset, is bitwise the whole update
    c = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in setup(device, torch.bfloat16, False).items()}
    c["params"].copy_(b["params"])  # any start: compare whole vs sharded from equal states
    whole = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in c.items()}
    run_steps(whole, grads[:1], 1)
    cut = 1234
    set_hyper(c["hyper"], HP["lr"], 1, HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], 0.7)
    c["seed"].fill_(1235)
    for lo, hi in ((0, cut), (cut, N)):
        adamw_update(c["params"][lo:hi], grads[0][lo:hi], c["m"][lo:hi], c["v"][lo:hi], c["hyper"], c["seed"],
                     c["ranges"], offset=lo)
    assert torch.equal(c["params"], whole["params"]) and torch.equal(c["v"], whole["v"])

    d = setup(device, torch.bfloat16, master=False)
    d["params"].copy_(a["params"])
    e = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in d.items()}
    run_steps(d, grads[:1], 1, seed0=1)
    run_steps(e, grads[:1], 1, seed0=2)
    assert not torch.equal(d["params"], e["params"]), "a different seed must round differently"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_from_master(device, dtype):
    master = torch.randn(5000, device=device)
    params = torch.full((5000,), float("nan"), dtype=dtype, device=device)
    seed = torch.tensor([99], dtype=torch.int64, device=device)
    init_from_master(params, master, seed)
    if dtype == torch.float32:
        assert torch.equal(params, master)
    else:
        lo, hi = bf16_neighbours(master.cpu())
        got = params.cpu().float()
        assert torch.all((got == lo) | (got == hi))


@pytest.mark.gpu
def test_gpt2_124m_sized_update_on_gpu():
    from llmpy.config import parse_descriptor
    cfg = parse_descriptor("d12")
    n = cfg.num_parameters
    dev = "cuda"
    params = (torch.randn(n, device=dev) * 0.02).bfloat16()
    master = params.float()
    grads = (torch.randn(n, device=dev) * 1e-3).bfloat16()
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    hyper, seed = hyper_tensor(dev), torch.tensor([5], dtype=torch.int64, device=dev)
    sizes = cfg.parameter_sizes()
    offsets, o = {}, 0
    for k, s in sizes.items():
        offsets[k] = (o, o + s)
        o += s
    decayed = [k for k, d in cfg.weight_decay_mask().items() if d]
    ranges = decay_ranges_tensor([offsets[k] for k in decayed], dev)
    set_hyper(hyper, 6e-4, 1, 0.9, 0.95, 1e-8, 0.1, 0.5)
    p_ref, m_ref, v_ref = master.clone(), m.clone(), v.clone()
    adamw_update(params, grads, m, v, hyper, seed, ranges, master=master)
    for k in sizes:
        a, b = offsets[k]
        wd = 0.1 if k in decayed else 0.0
        ref.adamw_update(p_ref[a:b], grads[a:b].float(), m_ref[a:b], v_ref[a:b], 1, 6e-4, 0.9, 0.95, 1e-8, wd, 0.5)
    assert torch.allclose(master, p_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(v, v_ref, rtol=1e-5, atol=1e-12)


def test_set_hyper_from_a_staging_buffer():
    """The values staged through a reused host buffer (the model's pinned one on CUDA) are those of a
    fresh host tensor, bit for bit, and the device's gradient-scale slot is left as it was."""
    fresh, staged = hyper_tensor("cpu"), hyper_tensor("cpu")
    fresh[GRAD_SCALE] = staged[GRAD_SCALE] = 0.25
    host = torch.full((GRAD_SCALE,), float("nan"))
    for step in (1, 7, 1000):
        set_hyper(fresh, 6e-4, step, 0.9, 0.95, 1e-8, 0.1)
        set_hyper(staged, 6e-4, step, 0.9, 0.95, 1e-8, 0.1, host=host)
        assert torch.equal(fresh, staged)
        assert staged[GRAD_SCALE] == 0.25


def test_shard_crossing_2_31_decays_by_64_bit_index(device):
    """A ZeRO-1 shard whose global indices cross 2^31 (d60, 2.75 G parameters, over two GPUs: rank 1 holds
    [1.38 G, 2.75 G)): the element index in the whole model (offset + local) must not wrap in 32 bits, or
    the decay ranges past 2^31 are missed."""
    n, offset = 3000, 2 ** 31 - 1000
    span = (1500, 2500)  # decayed, local indices: global [2^31 + 500, 2^31 + 1500)
    params = torch.randn(n, device=device)
    grad = torch.randn(n, device=device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    hyper, seed = hyper_tensor(device), torch.tensor([7], dtype=torch.int64, device=device)
    ranges = decay_ranges_tensor([(offset + span[0], offset + span[1])], device)
    set_hyper(hyper, HP["lr"], 1, HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], 1.0)
    p, mr, vr = params.cpu().clone(), torch.zeros(n), torch.zeros(n)
    adamw_update(params, grad, m, v, hyper, seed, ranges, offset=offset)
    g = grad.cpu()
    for a, b in ((0, span[0]), span, (span[1], n)):
        wd = HP["weight_decay"] if (a, b) == span else 0.0
        ref.adamw_update(p[a:b], g[a:b], mr[a:b], vr[a:b], 1, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd, 1.0)
    assert torch.allclose(params.cpu(), p, rtol=1e-5, atol=1e-6)

    # bf16, stochastic rounding: the same shard cut at 2^31 into two (the second's offset a 64-bit argument)
    # rounds bit for bit as the uncut one (the counter is the index modulo 2^32 either way)
    whole = torch.randn(n, device=device).bfloat16()
    cut = whole.clone()
    g16 = grad.bfloat16()
    for buf, pieces in ((whole, [(0, n)]), (cut, [(0, 1000), (1000, n)])):
        m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
        for lo, hi in pieces:
            adamw_update(buf[lo:hi], g16[lo:hi], m[lo:hi], v[lo:hi], hyper, seed, ranges, offset=offset + lo)
    assert torch.equal(whole, cut)


def test_update_rejects_strided_buffers(device):
    """The kernels index params and master as contiguous: a strided view is an error, not writes beside it."""
    n = 100
    state = setup(device, torch.float32, master=False)
    hyper, seed, ranges = state["hyper"], state["seed"], state["ranges"]
    grads, m, v = torch.zeros(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    strided = torch.zeros(2 * n, device=device)[::2]
    with pytest.raises(AssertionError):
        adamw_update(strided, grads, m, v, hyper, seed, ranges)
    with pytest.raises(AssertionError):
        adamw_update(torch.zeros(n, device=device), grads, m, v, hyper, seed, ranges, master=strided)
    with pytest.raises(AssertionError):
        init_from_master(strided, torch.zeros(n, device=device), seed)
    with pytest.raises(AssertionError):
        init_from_master(torch.zeros(n, device=device), strided, seed)


def test_both_index_widths_update_alike(device, monkeypatch):
    """64-bit indices only where an index can pass 2^31 (GPT-2 124M keeps the 32-bit arithmetic the step was tuned
    with); forced on a small ZeRO-1-like shard, the wide kernels give the narrow ones' bits, rounding included."""
    from llmpy.kernels import adamw as kadamw
    assert not kadamw._wide_index(124_475_904, 0, kadamw.UPDATE_BLOCK)
    assert kadamw._wide_index(1_000, 2**31 - 1_000, kadamw.UPDATE_BLOCK)
    n, offset = 2_500, 777
    master = torch.randn(n, device=device)
    grad = torch.randn(n, device=device).bfloat16()
    m0, v0 = torch.randn(n, device=device) * 1e-2, torch.rand(n, device=device) * 1e-3
    hyper, seed = hyper_tensor(device), torch.tensor([11], dtype=torch.int64, device=device)
    ranges = decay_ranges_tensor([(offset + 100, offset + 1_900)], device)
    set_hyper(hyper, HP["lr"], 3, HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], 1.0)
    results = []
    for wide in (False, True):
        monkeypatch.setattr(kadamw, "_wide_index", lambda n_, offset_, block_, wide=wide: wide)
        params = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)  # poisoned: init writes all
        mst, m, v = master.clone(), m0.clone(), v0.clone()
        kadamw.init_from_master(params, mst, seed, offset=offset)
        first = params.clone()
        assert not first.isnan().any()
        adamw_update(params, grad, m, v, hyper, seed, ranges, master=mst, offset=offset)
        results.append((first, params, mst, m, v))
    for a, b in zip(*results):
        assert torch.equal(a, b)
