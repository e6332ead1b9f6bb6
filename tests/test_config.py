"""llmpy.config: the host memory a model may take, where a cgroup (a container's --memory) limits it."""
import pytest

import llmpy
from llmpy import config
from llmpy.errors import LlmpyError

GB = 10**9


def _fake_cgroups(tmp_path, monkeypatch, proc_self_cgroup: str, files: dict):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "proc_self_cgroup").write_text(proc_self_cgroup)
    monkeypatch.setattr(config, "_CGROUP_ROOT", str(tmp_path / "cg"))
    monkeypatch.setattr(config, "_PROC_SELF_CGROUP", str(tmp_path / "proc_self_cgroup"))


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cgroup_memory_limit_bounds_the_memory_available(tmp_path, monkeypatch, version):
    # MemAvailable is the host's: a container limited to 3 GB was told the host's free memory, and a model past its
    # limit was killed by the OOM killer instead of refused in one line
    if version == "v2":
        _fake_cgroups(tmp_path, monkeypatch, "0::/job/step\n", {
            "cg/job/memory.max": "4000000000\n", "cg/job/memory.current": "1500000000\n",
            "cg/job/memory.stat": "anon 1000000000\nfile 500000000\n",
            "cg/job/step/memory.max": "max\n", "cg/job/step/memory.current": "1500000000\n"})
    else:
        _fake_cgroups(tmp_path, monkeypatch, "5:cpu,cpuacct:/job\n4:memory:/job\n", {
            "cg/memory/memory.limit_in_bytes": "9223372036854771712\n", "cg/memory/memory.usage_in_bytes": "9\n",
            "cg/memory/job/memory.limit_in_bytes": "4000000000\n",
            "cg/memory/job/memory.usage_in_bytes": "1500000000\n",
            "cg/memory/job/memory.stat": "cache 500000000\nrss 1000000000\ntotal_cache 500000000\n"})
    free = config.host_memory_available()
    assert free == 3 * GB  # the limit less what the cgroup holds, its page cache counted as free
    desc = "layers=8,channels=4096,heads=32"  # 1.8 G parameters: 7.3 GB in fp32
    with pytest.raises(LlmpyError, match=r"fp32 parameters need 7\.3 GB of host memory, more than the 3\.0 GB avail"):
        llmpy.create_model(desc)


def test_no_cgroup_files_leave_meminfo_alone(tmp_path, monkeypatch):
    _fake_cgroups(tmp_path, monkeypatch, "0::/\n", {})
    assert config._cgroup_memory_left() is None
    assert config.host_memory_available() is not None  # /proc/meminfo's, on Linux


@pytest.mark.parametrize("extra", [-3, 3, -10**4])
def test_parameter_views_refuse_a_buffer_of_the_wrong_size_in_one_line(extra):
    # a short buffer failed inside reshape (torch's RuntimeError, numpy's ValueError) before the size was checked
    import numpy as np
    import torch
    cfg = config.parse_descriptor("layers=1,channels=8,heads=2,vocab=16,seq=8")
    n = max(cfg.num_parameters + extra, 0)
    for flat in (torch.zeros(n), np.zeros(n, np.float32)):
        with pytest.raises(LlmpyError, match=rf"flat buffer of shape \[{n}\]: the model \(.*\) needs "
                                             rf"{cfg.num_parameters} elements"):
            config.parameter_views(flat, cfg)
    assert config.parameter_views(torch.zeros(cfg.num_parameters), cfg)["lnfb"].shape == (8,)
