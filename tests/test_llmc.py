"""bench/llmc.py and bench_step's llmc system on the CPU: llm.c's log lines, its token shards, the order its
shuffling loader reads them in, and the whole run with a stand-in binary (the real one needs a GPU)."""
import json
import math
import stat
import sys

import numpy as np
import pytest

from bench import bench_step, llmc

# the format of llm.c's train_gpt2.cu step line (printf0("step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f ..."))
LINE = ("step {:4d}/{} | loss {:7.6f} (+0.12z)| norm {:6.4f} (-1.03z)| lr 3.00e-04 | {:.2f} ms | 47.3% bf16 MFU | "
        "583712 tok/s")


def test_step_lines_are_read_and_other_lines_are_not():
    got = llmc.parse_step_line(LINE.format(12, 40, 7.123456, 1.2345, 112.34) + "\n")
    assert got == {"step": 12, "steps": 40, "loss": 7.123456, "norm": 1.2345, "ms": 112.34}
    assert llmc.parse_step_line("val loss 10.987654") is None
    assert llmc.parse_step_line("| step count | 40 |") is None
    nan = llmc.parse_step_line("step    1/40 | loss nan (+nanz)| norm nan (+nanz)| lr 3.00e-04 | 1.50 ms | x")
    assert math.isnan(nan["loss"]) and math.isnan(nan["norm"]) and nan["ms"] == 1.5


def test_a_shard_has_llm_c_s_header_and_uint16_tokens(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=1001)
    llmc.write_shard(tmp_path / "s.bin", tokens)
    raw = (tmp_path / "s.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    assert list(header[:3]) == [20240520, 1, 1001] and not header[3:].any()
    assert np.array_equal(np.frombuffer(raw[1024:], dtype=np.uint16), tokens)
    assert len(raw) == 1024 + 2 * 1001  # llm.c checks the file size against the count
    with pytest.raises(ValueError):
        llmc.write_shard(tmp_path / "t.bin", np.array([1 << 16]))


def _llm_c_order(n: int) -> list[int]:
    # the oracle: llm.c's random_permutation written out again on numpy's own MT19937 seeded 42 (the
    # legacy seeding is MT19937's init_genrand, as llm.c's manual_seed; 2**32-wide draws take one word)
    draws = iter(np.random.RandomState(42).randint(0, 2 ** 32, size=n, dtype=np.uint64).tolist())
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = next(draws) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


@pytest.mark.parametrize("steps", [1, 2, 7, 40])
def test_llm_c_s_loader_reads_bench_step_s_batches_in_their_order(steps):
    B, T = 3, 5
    batches = bench_step.make_batches(50257, B, T, steps, seed=steps)
    tokens = llmc.shard_tokens(batches)
    assert tokens.size == steps * B * T + 1  # llm.c: (ntok - 1) // (B*T) samples in the shard
    order = _llm_c_order(steps)
    assert llmc.train_order(steps) == order
    for i, (inputs, targets) in enumerate(batches):
        # llm.c's dataloader_load_batch: B*T+1 tokens at sample order[i] * B*T
        window = tokens[order[i] * B * T: order[i] * B * T + B * T + 1]
        assert np.array_equal(window[:-1], inputs.reshape(-1).numpy())
        assert np.array_equal(window[1:-1], targets.reshape(-1)[:-1].numpy())
        if order[i] == steps - 1:  # the last slot's last target is its batch's own
            assert window[-1] == targets.reshape(-1)[-1]


def test_the_flags_name_bench_step_s_settings(tmp_path):
    cmd = llmc.run_command(tmp_path / "bin", tmp_path, 64, 1024, 40, 3e-4, 0.1, 0, None)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-e"] == "d12" and flags["-b"] == "64" and flags["-t"] == "1024" and flags["-d"] == "65536"
    assert flags["-x"] == "40" and flags["-r"] == "0" and flags["-w"] == "1" and flags["-k"] == "constant"
    assert float(flags["-l"]) == 3e-4 and float(flags["-c"]) == 0.1 and flags["-u"] == "0"
    assert int(flags["-v"]) > 40 and flags["-m"] == "1"  # llm.c's -v 0 would divide by zero
    assert "-ge" not in flags
    assert llmc.run_command(tmp_path / "bin", tmp_path, 64, 1024, 40, 3e-4, 0.1, None, 2)[-2:] == ["-ge", "2"]
    assert "-r" not in llmc.run_command(tmp_path / "bin", tmp_path, 64, 1024, 40, 3e-4, 0.1, None, None)


STAND_IN = """#!{python}
# stands in for train_gpt2cu: usage for a flag without its value; else the step lines of -x steps, reading
# the shard it is given as llm.c would and printing the sum of each batch's targets as its "loss"
import sys
import numpy as np
args = sys.argv[1:]
if args == ["-x"]:
    print("Usage:   ./train_gpt2cu [options]")
    sys.exit(1)
flags = dict(zip(args[::2], args[1::2]))
steps, B, T = int(flags["-x"]), int(flags["-b"]), int(flags["-t"])
tokens = np.fromfile(flags["-i"], dtype=np.uint16, offset=1024).astype(np.int64)
order = {order}
fail_at = {fail_at}
print("| this stands in for llm.c |")
for i in range(steps):
    if i == fail_at:
        print("[CUDA ERROR] at file llmc/matmul.cuh:123: out of memory")
        sys.exit(1)
    s = order[i] * B * T
    print("{line}".format(i + 1, steps, float(tokens[s + 1:s + B * T + 1].sum()), 1.0 + i, 100.0 + i), flush=True)
"""


def _stand_in(tmp_path, steps, fail_at=None):
    path = tmp_path / "train_gpt2cu"
    path.write_text(STAND_IN.format(python=sys.executable, order=llmc.train_order(steps), fail_at=fail_at,
                                    line=LINE))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _run(tmp_path, monkeypatch, steps, fail_at=None):
    monkeypatch.setattr(llmc, "runtime_library_dirs", lambda: [])  # CI's torch may lack NVIDIA's wheels
    binary = _stand_in(tmp_path, steps, fail_at)
    result = tmp_path / "result.json"
    args = bench_step.parse_args(["--systems", "llmc", "--device", "cpu", "--steps", str(steps), "--B", "2",
                                  "--T", "8", "--llmc-binary", str(binary), "--result-file", str(result)])
    res = bench_step.run_system(args, "llmc")
    assert json.loads(result.read_text())["ok"] == res["ok"]
    return args, res


def test_llmc_runs_the_binary_on_the_batches_and_reads_its_steps(tmp_path, monkeypatch):
    args, res = _run(tmp_path, monkeypatch, steps=12)
    assert res["ok"] and res["error"] is None
    assert res["step_ms"] == [100.0 + i for i in range(12)] and res["norms"] == [1.0 + i for i in range(12)]
    batches = bench_step.make_batches(50257, 2, 8, 12, args.data_seed)
    # each step's "loss" is the sum of the targets the stand-in read: all but one of each batch's own
    for loss, (_, targets) in zip(res["losses"], batches):
        assert 0 <= loss - float(targets.reshape(-1)[:-1].sum()) < 50257
    summary = bench_step.summarize(res, args)
    assert summary["median_ms"] == float(np.median([100.0 + i for i in range(10, 12)]))


def test_a_failing_llmc_run_is_one_line_naming_what_it_printed(tmp_path, monkeypatch):
    _, res = _run(tmp_path, monkeypatch, steps=6, fail_at=3)
    assert not res["ok"] and len(res["step_ms"]) == 3
    assert res["error"].startswith("LlmcError: llm.c: exit status 1 after 3 of 6 steps")
    assert "out of memory" in res["error"] and "\n" not in res["error"]


def test_a_missing_binary_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(llmc, "runtime_library_dirs", lambda: [])
    args = bench_step.parse_args(["--systems", "llmc", "--device", "cpu", "--llmc-binary", str(tmp_path / "nope")])
    res = bench_step.run_system(args, "llmc")
    assert not res["ok"] and "no binary at" in res["error"] and "python -m bench.llmc build" in res["error"]


def test_llmc_takes_llm_c_s_own_init_only():
    for argv in (["--model", "d6"], ["--seed", "7"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(["--systems", "llmc,llmpy", *argv])
    bench_step.parse_args(["--systems", "torch-compile,llmpy", "--seed", "7"])  # the others take any seed


def test_llm_c_runs_on_the_system_s_libraries_and_on_the_wheels_only_for_what_the_system_lacks(tmp_path, monkeypatch):
    cu13, cudnn = tmp_path / "cu13" / "lib", tmp_path / "cudnn" / "lib"
    for d, names in ((cu13, ["libcublas.so.13", "libcublasLt.so.13"]), (cudnn, ["libcudnn.so.9"])):
        d.mkdir(parents=True)
        for name in names:
            (d / name).write_bytes(b"")
    monkeypatch.setattr(llmc, "wheel_library_dirs", lambda: [cu13, cudnn])
    every = {"libcublas.so.13": "/usr/local/cuda/lib64/libcublas.so.13",
             "libcublasLt.so.13": "/usr/local/cuda/lib64/libcublasLt.so.13", "libcudnn.so.9": "/lib/libcudnn.so.9"}
    monkeypatch.setattr(llmc, "system_libraries", lambda: every)
    assert llmc.runtime_library_dirs() == []  # as a Makefile build of llm.c would run
    monkeypatch.setattr(llmc, "system_libraries", lambda: {k: v for k, v in every.items() if "cudnn" not in k})
    assert llmc.runtime_library_dirs() == [cudnn]
    monkeypatch.setattr(llmc, "system_libraries", dict)
    assert llmc.runtime_library_dirs() == [cu13, cudnn]
    monkeypatch.setenv("LD_LIBRARY_PATH", "/somewhere/else")
    assert "LD_LIBRARY_PATH" not in llmc.run_environment([])  # nothing inherited
    assert llmc.run_environment([cu13, cudnn])["LD_LIBRARY_PATH"] == f"{cu13}:{cudnn}"


def test_the_build_is_llm_c_s_makefile_recipe(tmp_path):
    cmds = llmc.build_commands(tmp_path / "src", tmp_path / "out" / "train_gpt2cu", tmp_path / "fe",
                               [tmp_path / "cu13" / "lib"], tmp_path / "lib")
    assert [c[0] for c in cmds] == ["nvcc", "nvcc"] and cmds[0][1] == "-c"
    for cmd in cmds:
        assert {"-O3", "--use_fast_math", "-std=c++17", "-DENABLE_CUDNN", "-DENABLE_BF16"} <= set(cmd)
        assert "--generate-code=arch=compute_90,code=[compute_90,sm_90]" in cmd and f"-I{tmp_path / 'fe'}" in cmd
    assert cmds[0][cmds[0].index("-o") + 1].endswith("cudnn_att.o")
    assert {"-lcublas", "-lcublasLt", "-lcudnn"} <= set(cmds[1]) and cmds[1][-1].endswith("train_gpt2cu")


def test_a_build_without_llm_c_s_source_says_where_it_looked(tmp_path):
    with pytest.raises(llmc.LlmcError, match="train_gpt2.cu not found at"):
        llmc.build(tmp_path / "src", tmp_path / "bin", tmp_path)


def test_a_failing_compile_names_the_file(tmp_path, monkeypatch):
    src, frontend = tmp_path / "src", tmp_path / "fe"
    (src / "llmc").mkdir(parents=True)
    frontend.mkdir()
    for path in (src / "train_gpt2.cu", src / "llmc" / "cudnn_att.cpp", frontend / "cudnn_frontend.h"):
        path.write_text("")
    lib = tmp_path / "lib"
    lib.mkdir()
    for _, soname in llmc._LIBRARIES:
        (lib / soname).write_bytes(b"")
    monkeypatch.setattr(llmc, "wheel_library_dirs", lambda: [lib])
    nvcc = tmp_path / "nvcc"  # a compiler that fails on the second file it is given
    nvcc.write_text("#!/bin/sh\ncase \"$*\" in *train_gpt2.cu*) echo 'error: no' >&2; exit 2;; esac\nexit 0\n")
    nvcc.chmod(0o755)
    with pytest.raises(llmc.LlmcError, match=r"nvcc failed \(exit status 2\) on train_gpt2.cu"):
        llmc.build(src, tmp_path / "out" / "train_gpt2cu", frontend, nvcc=str(nvcc))


class _FakeCounter:
    """NVML's readings made up: 700 mJ a read apart, so a window's joules count its reads."""

    def __init__(self):
        self.mj = 0

    def millijoules(self):
        self.mj += 700
        return self.mj

    def temperature_c(self):
        return 50

    def sm_clock_mhz(self):
        return 1500

    def clock_event_reasons(self):
        return 4

    def throttled_ms(self):
        return {"power": 0.0, "thermal": 0.0}

    def memory_used_bytes(self):
        return 1 << 30


def test_llmc_reads_the_energy_window_around_the_median_steps(tmp_path, monkeypatch):
    counter = _FakeCounter()
    monkeypatch.setattr(bench_step, "_energy_counter", lambda: counter)
    args, res = _run(tmp_path, monkeypatch, steps=12)
    assert res["ok"] and len(res["step_sm_mhz"]) == 12
    # one counter read opens the window (after step 10), one closes it (after step 12): 700 mJ over 2 steps
    assert res["joules_per_step"] == pytest.approx(0.35)
    assert res["celsius_at_window"] == [50, 50] and res["sm_mhz_at_end"] == 1500
    assert res["throttled_share"] == {"power": 0.0, "thermal": 0.0} and res["device_used_bytes"] == 0
