"""Test setup: kernels run on the GPU where CUDA is there, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection start.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# kernel tests run where the kernels run: cuda on a GPU machine, the interpreter's CPU tensors elsewhere
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # tests marked slow (minutes on the CPU) run only when asked for: pytest -m slow
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture
def device():
    return DEVICE
