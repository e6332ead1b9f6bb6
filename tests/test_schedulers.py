"""Learning-rate schedules: warmup, shape, end points and parameter checks (llm.c's schedulers.h)."""
import math

import pytest

from llmpy.errors import LlmpyError
from llmpy.schedulers import SCHEDULES, LRSchedule

LR, WARMUP, TOTAL, FRAC = 6e-4, 10, 110, 0.1  # 100 steps after warmup, min lr 6e-5
MIN = LR * FRAC


def sched(kind, **kw):
    return LRSchedule(**{"kind": kind, "lr": LR, "warmup": WARMUP, "total_steps": TOTAL, "final_frac": FRAC, **kw})


@pytest.mark.parametrize("kind", SCHEDULES)
def test_warmup_is_linear_from_lr_over_warmup(kind):
    s = sched(kind)
    assert s(0) == pytest.approx(LR / WARMUP)
    assert s(4) == pytest.approx(LR * 5 / WARMUP)
    assert s(WARMUP - 1) == pytest.approx(LR)  # llm.c counts (step + 1) / warmup: the peak at warmup - 1
    assert all(s(i) < s(i + 1) for i in range(WARMUP - 1))


@pytest.mark.parametrize("kind", SCHEDULES)
def test_no_warmup_starts_at_the_peak(kind):
    assert sched(kind, warmup=0)(0) == pytest.approx(LR)


def test_cosine():
    s = sched("cosine")
    assert s(WARMUP) == pytest.approx(LR)                       # decay starts at the peak
    assert s(WARMUP + 50) == pytest.approx((LR + MIN) / 2)      # halfway: the mean of peak and floor
    assert s(WARMUP + 25) == pytest.approx(MIN + 0.5 * (1 + math.cos(math.pi / 4)) * (LR - MIN))
    assert s(TOTAL - 1) == pytest.approx(MIN + 0.5 * (1 + math.cos(math.pi * 99 / 100)) * (LR - MIN))
    assert s(TOTAL) == pytest.approx(MIN)                       # decay ratio 1 at total_steps
    assert s(TOTAL + 50) == pytest.approx(MIN)                  # and it stays at the floor past the end
    after = [s(i) for i in range(WARMUP, TOTAL + 1)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_linear():
    s = sched("linear")
    assert s(WARMUP) == pytest.approx(LR)
    assert s(WARMUP + 50) == pytest.approx((LR + MIN) / 2)
    assert s(WARMUP + 30) == pytest.approx(LR - 0.3 * (LR - MIN))
    assert s(TOTAL - 1) == pytest.approx(LR - 0.99 * (LR - MIN))
    assert s(TOTAL) == pytest.approx(MIN)
    assert s(TOTAL + 7) == pytest.approx(MIN)


def test_constant_ignores_final_fraction():
    s = sched("constant")
    assert [s(i) for i in (WARMUP, WARMUP + 50, TOTAL - 1, TOTAL)] == pytest.approx([LR] * 4)


def test_wsd_stable_then_decays_over_the_last_fifth():
    s = sched("wsd")  # decay_frac 0.2 of 110 steps: decay from step 88
    assert s.decay_frac == 0.2
    assert [s(i) for i in (WARMUP, 50, 87)] == pytest.approx([LR] * 3)
    assert s(88) == pytest.approx(LR)
    assert s(TOTAL - 1) < s(100) < s(89) < LR
    assert s(TOTAL) == pytest.approx(MIN)
    custom = sched("wsd", decay_frac=0.5)  # decay from step 55
    assert custom(54) == pytest.approx(LR) and custom(56) < LR


def test_wsd_decays_as_one_minus_sqrt_like_llmc():
    s = sched("wsd")
    ratio = (99 - 88) / (110 - 88)  # halfway through the decay
    assert s(99) == pytest.approx(MIN + (1 - math.sqrt(ratio)) * (LR - MIN))


@pytest.mark.parametrize("kind", SCHEDULES)
def test_final_fraction_is_the_floor(kind):
    for frac in (0.0, 0.5, 1.0):
        s = sched(kind, final_frac=frac)
        values = [s(i) for i in range(TOTAL + 1)]
        assert min(values[WARMUP:]) == pytest.approx(LR * frac if kind != "constant" else LR)
        assert max(values) == pytest.approx(LR)
    # final_frac 1 flattens every shape to the peak after warmup
    flat = sched(kind, final_frac=1.0)
    assert [flat(i) for i in range(WARMUP, TOTAL + 1)] == pytest.approx([LR] * (TOTAL + 1 - WARMUP))


def test_warmup_longer_than_the_run_still_warms_up():
    s = sched("cosine", warmup=200)
    assert s(99) == pytest.approx(LR * 100 / 200)
    assert s(199) == pytest.approx(LR)


@pytest.mark.parametrize("kw, message", [
    ({"kind": "step"}, "unknown learning-rate schedule"),
    ({"kind": ""}, "unknown learning-rate schedule"),
    ({"lr": -1e-3}, r"^-l -0\.001: the learning rate must be"),
    ({"lr": float("nan")}, r"^-l nan: the learning rate must be a finite number"),
    ({"lr": float("inf")}, r"^-l inf: the learning rate must be a finite number"),
    ({"warmup": -1}, r"^-u -1: the warmup steps must be >= 0"),
    ({"final_frac": -0.1}, r"^-q -0\.1: the final learning-rate fraction must be between 0 and 1"),
    ({"final_frac": 1.5}, r"^-q 1\.5: the final learning-rate fraction"),
    ({"final_frac": float("nan")}, r"^-q nan: the final learning-rate fraction"),
    # a wsd decay share past 1 began decaying before step 0 (with no warmup, step 0 at 0.42 lr); a NaN was a ValueError
    ({"decay_frac": 1.5}, r"^decay_frac 1\.5: wsd's share of steps spent decaying must be between 0 and 1"),
    ({"decay_frac": -0.2}, r"^decay_frac -0\.2: wsd's share"),
    ({"decay_frac": float("nan")}, r"^decay_frac nan: wsd's share"),
])
def test_bad_parameters(kw, message):
    # one line that names the flag at fault and its value alone (not every schedule value), as the trainer's
    # other checks do; a NaN or infinite rate is refused here too, not only by the trainer's option checks
    with pytest.raises(LlmpyError, match=message) as e:
        LRSchedule(**{"kind": "cosine", "lr": LR, "warmup": WARMUP, "total_steps": TOTAL, **kw})
    assert "\n" not in str(e.value)


def test_bad_kind_names_the_choices():
    with pytest.raises(LlmpyError) as e:
        LRSchedule(kind="cosinus")
    assert "-k cosinus" in str(e.value) and all(k in str(e.value) for k in SCHEDULES)


def _llmc(kind, lr, warmup, total, frac, step):
    """llm.c's schedulers.h, transcribed (its float32 arithmetic aside); "constant" is ours, warmed up (llm.c's
    constant schedule ignores -u)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    min_lr = lr * frac
    if kind == "wsd":
        decay_point = int(0.8 * total)
        if step < decay_point:
            return lr
        return min_lr + (1 - math.sqrt((step - decay_point) / (total - decay_point))) * (lr - min_lr)
    ratio = (step - warmup) / (total - warmup)
    if kind == "cosine":
        return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)
    return lr - ratio * (lr - min_lr) if kind == "linear" else lr


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 7), (1, 2), (3, 10), (9, 10), (700, 19073)])
def test_every_step_matches_llmc(kind, warmup, total):
    s = LRSchedule(kind, 6e-4, warmup, total, 0.0)
    steps = sorted({0, warmup - 1, warmup, warmup + 1, int(0.8 * total), total - 1, total} & set(range(total + 1))
                   | set(range(0, total + 1, max(1, total // 50))))
    for step in steps:
        assert s(step) == pytest.approx(_llmc(kind, 6e-4, warmup, total, 0.0, step), rel=1e-9, abs=1e-15), step
