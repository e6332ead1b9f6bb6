"""Outlier detector: z-score of a new value against the moving window that holds it (llm.c's
outlier_detector.h: the value replaces the oldest, then mean and std are taken)."""
import json
import math

import numpy as np
import pytest

from llmpy.outliers import OUTLIER_WINDOW, OutlierDetector


def test_default_window_is_llmcs():
    assert OUTLIER_WINDOW == 128 and OutlierDetector().window == 128


def test_nan_until_the_window_fills():
    d = OutlierDetector(window=8)
    zs = [d.update(float(i)) for i in range(8)]
    assert all(math.isnan(z) for z in zs)
    assert not math.isnan(d.update(3.0))  # the 9th value is the first scored
    d = OutlierDetector()
    rng = np.random.default_rng(0)
    assert all(math.isnan(d.update(v)) for v in rng.normal(size=OUTLIER_WINDOW))
    assert math.isfinite(d.update(0.0))


@pytest.mark.parametrize("window", [4, 16, 128])
def test_z_matches_numpy(window):
    rng = np.random.default_rng(window)
    xs = np.concatenate([rng.normal(3.0, 0.5, size=3 * window), [50.0], rng.normal(3.0, 0.5, size=window)])
    d = OutlierDetector(window=window)
    for i, x in enumerate(xs):
        z = d.update(float(x))
        if i < window:
            assert math.isnan(z)
            continue
        win = xs[i - window + 1:i + 1]  # population std (ddof=0), as llm.c's sum / sum_sq form
        expect = (x - win.mean()) / win.std()
        assert z == pytest.approx(expect, rel=1e-9, abs=1e-9), i
    assert len(d.values) == window


def test_spike_scores_high_and_leaves_the_window():
    w = 16
    rng = np.random.default_rng(1)
    d = OutlierDetector(window=w)
    for v in rng.normal(size=w):
        d.update(float(v))
    # the spike is in its own window, so its z-score is bounded by sqrt(w - 1) (llm.c's too)
    assert math.sqrt(w - 1) * 0.95 < d.update(100.0) <= math.sqrt(w - 1)
    zs = [d.update(float(v)) for v in rng.normal(size=w)]
    assert abs(zs[-1]) < 5  # after w more values the spike has slid out


def test_constant_window_gives_zero():
    d = OutlierDetector(window=4)
    for _ in range(4):
        d.update(2.0)
    assert d.update(2.0) == 0.0  # std 0: llm.c returns 0 rather than nan


def test_state_round_trip():
    rng = np.random.default_rng(2)
    a = OutlierDetector(window=32)
    for v in rng.normal(size=50):
        a.update(float(v))
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = OutlierDetector()
    b.load_state_dict(state)
    assert b.window == 32 and list(b.values) == list(a.values)
    for v in rng.normal(size=40):
        assert b.update(float(v)) == a.update(float(v))
    assert len(b.values) == 32


def test_state_round_trip_part_filled():
    a = OutlierDetector(window=8)
    for v in (1.0, 2.0, 4.0):
        a.update(v)
    b = OutlierDetector(window=8)
    b.load_state_dict(a.state_dict())
    assert [math.isnan(b.update(1.0)) for _ in range(5)] == [True] * 5
    assert not math.isnan(b.update(1.0))


def test_z_matches_llmc_window_including_the_new_value():
    w = 8
    rng = np.random.default_rng(3)
    xs = rng.normal(size=w + 5)
    d = OutlierDetector(window=w)
    for i, x in enumerate(xs):
        z = d.update(float(x))
        if i >= w:
            win = xs[i - w + 1:i + 1]
            assert z == pytest.approx((x - win.mean()) / win.std(), rel=1e-9)


@pytest.mark.parametrize("state", [{"window": 0, "values": []}, {"window": -3, "values": [1.0]},
                                   {"window": 2.5, "values": []}, {"window": "x", "values": []},
                                   {"window": 4, "values": ["a"]}, {"window": 4, "values": 7},
                                   {"window": 4, "values": ["1.5"]}, {"window": 4, "values": [True, 1.0]},
                                   {"window": 2, "values": [1.0, 2.0, 3.0]}, {"window": 2, "values": "12"},
                                   {"window": 10**30, "values": []}, {"window": 4, "values": [10**400]}])
def test_load_state_dict_refuses_a_malformed_state(state):
    # a checkpoint's detector state that cannot be a window is a ValueError or TypeError, which `-y 1` reports as
    # a malformed training state in one line; a window of 0 loaded and then failed at the next step's update with
    # a ZeroDivisionError traceback
    d = OutlierDetector(window=4)
    with pytest.raises((ValueError, TypeError)):
        d.load_state_dict(state)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_value_in_the_window_gives_nan_not_zero(bad):
    # llm.c's detector scores a window holding a NaN or an infinity as NaN (unknown, never a skip); 0.0 would
    # claim the value perfectly typical, in the skip line's "grad-norm z" too
    d = OutlierDetector(window=4)
    for v in (1.0, 2.0, 3.0, 4.0):
        d.update(v)
    assert math.isnan(d.update(bad))
    assert math.isnan(d.update(2.5))  # still in the window
    for v in (1.0, 2.0, 3.0):
        d.update(v)
    assert math.isfinite(d.update(4.0))  # slid out: scored again


def test_numpy_float32_input_is_scored_in_float64():
    a, b = OutlierDetector(window=4), OutlierDetector(window=4)
    xs = np.asarray([1.1, 2.3, 0.7, 1.9, 3.3, 0.2], dtype=np.float32)
    for x in xs:
        za, zb = a.update(x), b.update(float(x))
        assert type(za) is float and (math.isnan(za) and math.isnan(zb) or za == zb)
