"""bench/gpu_check.sh's test stages, run here with stand-ins for the GPU machine's tools on PATH: which test files
each stage hands pytest, and the memcheck stage's job limit, exit status and logs (the device call is the only
other place these run, and a device call is scarce)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# python3: records a pytest call's arguments (one line a call), passes anything else to this interpreter
PYTHON3 = f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m pytest" ]; then shift 2; echo "$*" >> "$RECORD"; exit 0; fi
exec {sys.executable} "$@"
"""
# compute-sanitizer: notes when each run starts and ends, takes a while, fails where the file is named in FAIL_ON
SANITIZER = """#!/usr/bin/env bash
echo "args $*" >> "$RECORD"
echo "start $$ $(date +%s%N) $*" >> "$RECORD"
sleep 0.4
echo "ERROR SUMMARY: 0 errors"; echo "1 passed in 0.40s"
echo "end $$ $(date +%s%N) $*" >> "$RECORD"
for arg in "$@"; do [ -n "$FAIL_ON" ] && [ "$arg" = "$FAIL_ON" ] && exit 99; done
exit 0
"""


def gpu_check(tmp_path, *stages, **env):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", PYTHON3), ("compute-sanitizer", SANITIZER), ("nvidia-smi", "#!/bin/sh\necho H0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "record.txt"
    record.write_text("")
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out),
                "RECORD": str(record), **env}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", *stages], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=120)
    return proc, record.read_text().splitlines(), out


def test_the_test_stages_run_every_test_file_once(tmp_path):
    """tests + model + suite + rest: the README's whole test command on a GPU machine, each file in one stage."""
    proc, calls, _ = gpu_check(tmp_path, "tests", "model", "suite", "rest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 4
    named = [word for call in calls for word in call.split() if word.startswith("tests/")]
    every = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(named) == every, "each test file in exactly one stage"
    assert "tests/test_gpt2.py" in calls[1].split() and "tests/test_resume.py" in calls[2].split()


def overlap(lines):
    """The most sanitizer runs in flight at one moment, from their start and end stamps."""
    stamps = [line.split() for line in lines if line.startswith(("start ", "end "))]
    events = sorted((int(words[2]), words[0] == "start") for words in stamps)
    most = now = 0
    for _, starts in events:  # at equal stamps an end sorts before a start: touching runs do not overlap
        now += 1 if starts else -1
        most = max(most, now)
    return most


def test_memcheck_stage_runs_every_file_a_few_at_a_time(tmp_path):
    proc, stamps, out = gpu_check(tmp_path, "sanitize", SANITIZE_JOBS="3")  # SANITIZE_GPU_JOBS: 1
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "sanitize.log").read_text().splitlines()
    kernel_files, gpu_files = 11, 4  # KERNEL_TESTS, and the default SANITIZE_GPU_TESTS
    assert len(summary) == kernel_files + gpu_files and len(stamps) == 3 * len(summary)
    assert all(line.endswith("ERROR SUMMARY: 0 errors | 1 passed in 0.40s") for line in summary), summary
    small = [line for line in stamps if "-m not gpu" in line]
    model_sized = [line for line in stamps if "-m gpu" in line]
    assert 2 <= overlap(small) <= 3 and overlap(model_sized) == 1
    # the model-sized runs start once every small one has ended (beside them they ran out of memory)
    assert min(int(line.split()[2]) for line in model_sized if line.startswith("start ")) >= \
        max(int(line.split()[2]) for line in small if line.startswith("end "))
    assert sorted(p.name for p in out.iterdir()) == ["gpu.txt", "sanitize.log"], "clean files' logs removed"
    # no host backtraces by default: compute-sanitizer 2025.3's keeps every Triton launch's Python frame alive (run BD)
    assert all("--show-backtrace device python3 -m pytest" in line for line in stamps if line.startswith("args "))


def test_memcheck_stage_fails_and_keeps_the_log_of_a_failing_file(tmp_path):
    proc, record, out = gpu_check(tmp_path, "sanitize", SANITIZE_JOBS="8", FAIL_ON="tests/test_cublaslt.py",
                                  SANITIZE_GPU_TESTS="tests/test_attention.py::cudnn", SANITIZE_BACKTRACE="yes")
    assert proc.returncode == 99, proc.stdout + proc.stderr
    assert "sanitize rc=99" in proc.stdout
    # the file's "not gpu" run failed; its name and the -k expression reach pytest as given
    assert sorted(p.name for p in out.iterdir()) == ["gpu.txt", "sanitize.log", "sanitize_test_cublaslt.log"]
    summary = (out / "sanitize.log").read_text().splitlines()
    assert len(summary) == 12 and summary[-1].startswith("sanitize_gpu_test_attention: ")
    runs = [line.split("python3 -m pytest -q -p no:cacheprovider ")[1] for line in record if line.startswith("args ")]
    assert "-m not gpu tests/test_cublaslt.py" in runs and "-m gpu -k cudnn tests/test_attention.py" in runs
    assert all("--show-backtrace yes python3" in line for line in record if line.startswith("args ")), "asked for"
