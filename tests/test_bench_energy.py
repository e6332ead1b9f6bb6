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
