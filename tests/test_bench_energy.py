"""bench/kernels/bench_energy.py without a GPU: its classifier variants name real sweep entries, and its
workload sets are exclusive (the measurements themselves need a GPU and NVML)."""
import pytest

from bench.kernels import bench_energy


def test_classifier_variants_come_from_the_sweep_and_the_model():
    from llmpy.kernels.fused_classifier import TRAIN_CONFIG
    variants = bench_energy.classifier_variants()
    assert variants[0][1] == TRAIN_CONFIG
    assert [label for label, _ in variants[1:]] == bench_energy.CLASSIFIER_LABELS
    assert all(kw["variant"] in ("twopass", "tma") for _, kw in variants[1:])


def test_one_workload_set_at_a_time():
    with pytest.raises(SystemExit):
        bench_energy.main(["--flash", "--classifier"])


class _FakeNvml:
    """A stand-in for libnvidia-ml's two clock-limit queries: violation times in ns by policy, a reason mask."""

    def __init__(self, violation_ns=None, reasons=None, fail=False):
        self.violation_ns, self.reasons, self.fail = violation_ns or {}, reasons, fail
        if reasons is not None:
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self._reasons  # an older driver's name

    def nvmlDeviceGetViolationStatus(self, handle, policy, ref):
        if self.fail:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        ref._obj.violation_time = self.violation_ns[policy]
        return 0

    def _reasons(self, handle, ref):
        ref._obj.value = self.reasons
        return 0


def _counter(lib):
    from bench.energy import EnergyCounter
    counter = EnergyCounter.__new__(EnergyCounter)  # no NVML here: only the queries' decoding is under test
    counter._nvml, counter._handle = lib, None
    return counter


def test_clock_limits_read_from_nvml():
    counter = _counter(_FakeNvml({0: 2_500_000_000, 1: 7_000_000}, reasons=0x4 | 0x1))
    assert counter.throttled_ms() == {"power": 2500.0, "thermal": 7.0}
    assert counter.clock_event_reasons() == 0x5
    # not supported, or the functions missing from an old library: no figure, no error
    assert _counter(_FakeNvml(fail=True)).throttled_ms() is None
    assert _counter(object()).throttled_ms() is None and _counter(object()).clock_event_reasons() is None
