"""Shared kernel helpers (kernels/common.py): the pipelined-launch fallback."""
import warnings

import pytest

from llmpy.kernels.common import PIPELINE_FALLBACKS, launch_pipelined


class _FailsWhenPipelined:
    """Stands in for a Triton kernel whose pipelined build fails (as a compile or shared-memory error would)."""

    def __init__(self):
        self.stages = []

    def __getitem__(self, grid):
        def launch(*args, STAGES, **meta):
            self.stages.append(STAGES)
            if STAGES > 1:
                raise RuntimeError("PassManager::run failed")
        return launch


def test_pipelined_launch_falls_back_once():
    fake = _FailsWhenPipelined()
    with pytest.warns(UserWarning, match="unpipelined"):
        launch_pipelined(fake, (1,), (), 3, num_warps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch_pipelined(fake, (1,), (), 3, num_warps=4)  # remembered: no second try, no second warning
    launch_pipelined(fake, (1,), (), 1, num_warps=4)
    assert fake.stages == [3, 1, 1, 1]
    keys = [k for k in PIPELINE_FALLBACKS if k[0] == str(fake)]
    assert len(keys) == 1 and "PassManager" in PIPELINE_FALLBACKS[keys[0]]
    del PIPELINE_FALLBACKS[keys[0]]
