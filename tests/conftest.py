"""Test setup: kernels run on the GPU where CUDA is there, else in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection start.
"""
import os
from pathlib import Path

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


@pytest.fixture
def gluon_emulator():
    """tests/gluon_emulator.py, for the Gluon kernels' CPU tests: there only (the Triton kernels around them run
    in the interpreter; on a GPU machine the compiled kernels' own tests run instead), and where triton has Gluon."""
    if HAS_CUDA:
        pytest.skip("Gluon emulation runs where the Triton interpreter does (a GPU machine tests the compiled kernel)")
    from gluon_guard import require_gluon
    from llmpy.kernels.flash_backward_wgmma import GLUON
    require_gluon(GLUON)
    import gluon_emulator
    return gluon_emulator


# the shared data (GPT-2's tokenizer files, tinyshakespeare): ../shared/data beside the checkout, where CI lays
# it, else $LLMPY_SHARED_DATA
_SHARED_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data():
    """shared_data(*names): the shared data folder, after checking that the files `names` (relative to it)
    are there. One missing is a skip outside CI and a failure in CI (where shared/ is always laid beside the
    clone), so a test cannot pass there by not running."""
    env = os.environ.get("LLMPY_SHARED_DATA")
    root = Path(env) if env and not _SHARED_BESIDE.is_dir() else _SHARED_BESIDE

    def require(*names: str) -> Path:
        missing = [str(root / n) for n in names if not (root / n).is_file()]
        if missing:
            what = f"{', '.join(missing)} not found"
            if os.environ.get("CI"):
                pytest.fail(f"{what} in CI")
            pytest.skip(f"{what} (set LLMPY_SHARED_DATA)")
        return root
    return require
