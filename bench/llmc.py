"""llm.c's train_gpt2cu as a side-by-side baseline for bench_step (system `llmc`).

The issue-5 goal is defined against llm.c (shared/ANCHORS.md: 112.3 ms a step at B=64, T=1024, cuDNN
attention, -r 0, on one H200), but the lent H200s differ from run to run by several per cent at the 700 W
cap, so a figure from another day's card says little about today's. This module builds llm.c and runs
it in the same bench_step call as the other systems: same card, same minutes.

llm.c's source is not part of this repository (it is karpathy/llm.c's, MIT licence, and our tree keeps
only our own code). Put a checkout of it (train_gpt2.cu, llmc/, ...) in `.llmc/src` (git-ignored; the
device tool carries it with `carry: [".llmc"]`), then build on any machine with nvcc 13 and PyTorch's
CUDA wheels (their cuBLAS and cuDNN headers and libraries) installed:

    python -m bench.llmc build            # -> .llmc/train_gpt2cu, for sm_90 (H100/H200)

and run `python -m bench.bench_step --systems llmc,torch-compile,llmpy`. The build uses llm.c's own
Makefile settings for a cuDNN, bf16, single-GPU binary (`-O3 --use_fast_math -std=c++17
-DENABLE_CUDNN -DENABLE_BF16`), the cuDNN frontend headers under `.vendor/include` (the same 1.16 the
llmpy cuDNN path uses) and no NCCL/MPI. It runs on the cuBLAS and cuDNN the system's loader finds, as
a Makefile build would (on the device: the CUDA toolkit's cuBLAS 13.1 and the system's cuDNN 9.14),
and on the wheels' only for what the system lacks; bench_step records which files it loaded.

Which llm.c: whatever checkout `.llmc/src` holds. The one of bench/RESULTS.md run AN (train_gpt2.cu as
of karpathy/llm.c commit 5afc570, with the llmc/ headers of its time) trains the same model (its losses
agree with llmpy's and torch.compile's to 1e-4) but runs ~15 % slower, relative to torch.compile on the
same card, than the llm.c of ANCHORS.md did; on the device's host it keeps the GPU busy only ~79 % of each
step (it synchronises with its host several times a step). A figure against it is a figure against that
checkout on that host.

What bench_step gives llm.c: its own random init (`-e d12`, the init llmpy's init.py reproduces, so
--seed must be llm.c's 42), the same random token batches as the other systems in the same order (one
shard, its batches placed where llm.c's shuffling loader will look for them; a batch's last target is
the next slot's first token, so one target in B*T differs), the same learning rate, weight decay,
clipping (llm.c's is fixed at 1.0), constant schedule, no warm-up, fp32 master weights, and no
sampling or checkpoints (llm.c validates one batch before the first step and after the last, outside
the timed steps). Step times, losses and norms are llm.c's own printed figures (its step time, from
CUDA events, spans forward, backward, update and the loss read, like bench_step's); energy, clock and
the device's used memory come from NVML around the same window.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from llmpy import data
from llmpy.data import MAX_TOKEN_ID

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SRC = REPO / ".llmc" / "src"
DEFAULT_BINARY = REPO / ".llmc" / "train_gpt2cu"
FRONTEND_INCLUDE = REPO / ".vendor" / "include"

# the libraries train_gpt2cu links: (link name, soname in the CUDA 13 wheels PyTorch installs)
_LIBRARIES = (("cublas", "libcublas.so.13"), ("cublasLt", "libcublasLt.so.13"), ("cudnn", "libcudnn.so.9"))

# "step   12/40 | loss 10.964123 (+nanz)| norm 1.2345 (+nanz)| lr 3.00e-04 | 112.34 ms | 47.3% bf16 MFU | 583712 tok/s"
_STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s*\|\s*loss\s+(\S+).*?\|\s*norm\s+(\S+).*?\|\s*([0-9.]+)\s*ms\b")


class LlmcError(RuntimeError):
    """A missing build input or binary, a failed build or run: one line that says what."""


def parse_step_line(line: str) -> dict | None:
    """llm.c's per-step log line as {step, steps, loss, norm, ms}; None for any other line."""
    m = _STEP_LINE.match(line.strip())
    if not m:
        return None
    step, steps, loss, norm, ms = m.groups()
    return {"step": int(step), "steps": int(steps), "loss": float(loss), "norm": float(norm), "ms": float(ms)}


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """One llm.c token shard holding `tokens` (llmpy.data's writer); an id outside uint16 is a ValueError."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_TOKEN_ID):
        raise ValueError("llm.c shards hold uint16 token ids")
    data.write_shard(path, tokens)


def train_order(num_samples: int, seed: int = 42) -> list[int]:
    """The shard slots llm.c's shuffling train loader reads, in step order: one shard of num_samples
    batches gets its intra-shard permutation from an MT19937 seeded 42 + rank (rank 0 here), a
    Fisher-Yates shuffle of the identity drawn from the top (llm.c's random_permutation)."""
    from llmpy.rand import MT19937  # llm.c's generator, ported for the random init
    return MT19937(seed).random_permutation(num_samples).tolist()


def shard_tokens(batches) -> np.ndarray:
    """The one-shard token stream from which llm.c's train loader serves `batches` ((inputs, targets)
    pairs of (B, T) tensors, as bench_step.make_batches gives) in their order: batch i's inputs go to
    the slot llm.c reads at step i. llm.c reads a slot's B*T inputs and the next token as the last
    target, so that target is the next slot's first input, not batch i's own (one target in B*T); the
    last slot's is its batch's own."""
    order = train_order(len(batches))
    slots = [None] * len(batches)
    for step, slot in enumerate(order):
        slots[slot] = np.asarray(batches[step][0]).reshape(-1)
    last = np.asarray(batches[order.index(len(batches) - 1)][1]).reshape(-1)[-1:]
    return np.concatenate(slots + [last])


def wheel_library_dirs() -> list[Path]:
    """The directories of libcublas, libcublasLt and libcudnn in NVIDIA's CUDA 13 wheels (PyTorch's)."""
    try:
        import nvidia  # the namespace package of NVIDIA's wheels, there wherever PyTorch's CUDA build is
    except ImportError:
        raise LlmcError("llm.c: NVIDIA's CUDA wheels (PyTorch's CUDA build) are not installed here") from None
    found = {}
    for root in nvidia.__path__:
        for _, soname in _LIBRARIES:
            for hit in glob.glob(os.path.join(root, "**", soname), recursive=True):
                found.setdefault(soname, Path(hit).parent)
    missing = [soname for _, soname in _LIBRARIES if soname not in found]
    if missing:
        raise LlmcError(f"llm.c: {', '.join(missing)} not found under {list(nvidia.__path__)} (PyTorch's CUDA wheels)")
    return sorted(set(found.values()))


def system_libraries() -> dict[str, str]:
    """soname -> path of the libraries the dynamic loader finds by itself (ldconfig's cache)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in listing.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)$", line)
        if m and ("x86-64" in m.group(2) or "AArch64" in m.group(2)):
            found.setdefault(m.group(1), m.group(3))
    return found


def runtime_library_dirs() -> list[Path]:
    """What train_gpt2cu's LD_LIBRARY_PATH needs: nothing for a library the system's loader finds (as
    for an llm.c built by its Makefile: on the device, the CUDA toolkit's cuBLAS and the system's cuDNN),
    the wheels' directory for one it does not."""
    system = system_libraries()
    if all(soname in system for _, soname in _LIBRARIES):
        return []
    wanted = [soname for _, soname in _LIBRARIES if soname not in system]
    return [d for d in wheel_library_dirs() if any((d / soname).exists() for soname in wanted)]


def resolved_libraries(binary: Path) -> dict[str, str]:
    """soname -> the file train_gpt2cu loads it from, in run_environment (ldd), for the record."""
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30,
                             env=run_environment(runtime_library_dirs())).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names = {soname for _, soname in _LIBRARIES}
    return {m.group(1): m.group(2) for m in re.finditer(r"(\S+) => (\S+)", out) if m.group(1) in names}


def _include_dirs(lib_dirs: list[Path]) -> list[Path]:
    return [d.parent / "include" for d in lib_dirs if (d.parent / "include").is_dir()]


def build_commands(src: Path, out: Path, frontend: Path, lib_dirs: list[Path], link_dir: Path,
                   arch: str = "90", nvcc: str = "nvcc") -> list[list[str]]:
    """The two nvcc calls of llm.c's Makefile for a cuDNN bf16 single-GPU train_gpt2cu: cudnn_att.o, then
    the binary. link_dir holds unversioned symlinks to the wheels' libraries (they ship only sonames)."""
    flags = ["-O3", "-t=0", "--use_fast_math", "-std=c++17",
             f"--generate-code=arch=compute_{arch},code=[compute_{arch},sm_{arch}]", "-DENABLE_CUDNN", "-DENABLE_BF16"]
    includes = [f"-I{frontend}"] + [f"-I{d}" for d in _include_dirs(lib_dirs)]
    obj = out.parent / "cudnn_att.o"
    compile_att = [nvcc, "-c", *flags, str(src / "llmc" / "cudnn_att.cpp"), *includes, "-o", str(obj)]
    link = [nvcc, *flags, str(src / "train_gpt2.cu"), str(obj), *includes, f"-L{link_dir}",
            *(f"-l{name}" for name, _ in _LIBRARIES), "-o", str(out)]
    return [compile_att, link]


def build(src: Path = DEFAULT_SRC, out: Path = DEFAULT_BINARY, frontend: Path = FRONTEND_INCLUDE,
          arch: str = "90", nvcc: str | None = None) -> Path:
    """Build train_gpt2cu from llm.c's source in `src`; returns the binary's path."""
    nvcc = nvcc or shutil.which("nvcc")
    for what, path in (("llm.c's train_gpt2.cu", src / "train_gpt2.cu"),
                       ("llm.c's llmc/cudnn_att.cpp", src / "llmc" / "cudnn_att.cpp"),
                       ("the cuDNN frontend's cudnn_frontend.h", frontend / "cudnn_frontend.h")):
        if not path.is_file():
            raise LlmcError(f"llm.c build: {what} not found at {path}")
    if not nvcc:
        raise LlmcError("llm.c build: nvcc not found on PATH")
    lib_dirs = wheel_library_dirs()
    out.parent.mkdir(parents=True, exist_ok=True)
    link_dir = out.parent / "lib"
    link_dir.mkdir(exist_ok=True)
    for name, soname in _LIBRARIES:
        target = next(d / soname for d in lib_dirs if (d / soname).exists())
        link = link_dir / f"lib{name}.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    for what, cmd in zip(("llmc/cudnn_att.cpp", "train_gpt2.cu"),
                         build_commands(src, out, frontend, lib_dirs, link_dir, arch, nvcc)):
        print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=src)
        if done.returncode != 0:
            raise LlmcError(f"llm.c build: nvcc failed (exit status {done.returncode}) on {what}")
    return out


def run_command(binary: Path, shard_dir: Path, B: int, T: int, steps: int, lr: float, weight_decay: float,
                recompute: int | None = None, gelu_fusion: int | None = None) -> list[str]:
    """train_gpt2cu's flags for bench_step's settings (see the module docstring)."""
    train, val = shard_dir / "train_000000.bin", shard_dir / "val_000000.bin"
    # -v: llm.c evaluates at step 0, every -v steps and after the last (-v 0 divides by zero there), so one
    # batch (-m 1) before the first step and after the last, outside every timed step
    return [str(binary), "-e", "d12", "-i", str(train), "-j", str(val),
            "-b", str(B), "-t", str(T), "-d", str(B * T), "-x", str(steps),
            "-l", repr(lr), "-c", repr(weight_decay), "-u", "0", "-q", "1.0", "-k", "constant",
            "-v", str(1 << 30), "-m", "1", "-s", "0", "-n", "0", "-h", "0", "-y", "0", "-z", "0", "-w", "1",
            *(["-r", str(recompute)] if recompute is not None else []),
            *(["-ge", str(gelu_fusion)] if gelu_fusion is not None else [])]


def write_shards(workdir: Path, batches) -> None:
    """The train shard of `batches` and a copy as the validation shard (llm.c wants one) in workdir."""
    write_shard(workdir / "train_000000.bin", shard_tokens(batches))
    shutil.copyfile(workdir / "train_000000.bin", workdir / "val_000000.bin")


def run_environment(lib_dirs: list[Path]) -> dict:
    """This process's environment with LD_LIBRARY_PATH exactly lib_dirs (none inherited: which cuBLAS and
    cuDNN llm.c loads should not depend on the shell it was started from)."""
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(str(d) for d in lib_dirs)
    return env


def check_binary(binary: Path) -> None:
    """Raise LlmcError unless `binary` exists and loads here (its libraries found): llm.c prints its usage
    and exits before touching the GPU when a flag lacks its value."""
    if not binary.is_file():
        raise LlmcError(f"llm.c: no binary at {binary} (build it: python -m bench.llmc build)")
    done = subprocess.run([str(binary), "-x"], capture_output=True, text=True,
                          env=run_environment(runtime_library_dirs()), timeout=60)
    if "Usage" not in done.stdout + done.stderr:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise LlmcError(f"llm.c: {binary} does not run here: {tail[0]}")


def train(binary: Path, batches, B: int, T: int, lr: float, weight_decay: float, recompute: int | None,
          gelu_fusion: int | None, workdir: Path, on_step, echo=None) -> None:
    """Train llm.c on `batches` (bench_step's (inputs, targets) pairs) with shards written to workdir;
    on_step(parsed step line) after each step; echo(line) for every line of its output when given.
    Raises LlmcError, naming the last lines it printed, if it fails or prints fewer steps than batches."""
    write_shards(workdir, batches)
    cmd = run_command(binary, workdir, B, T, len(batches), lr, weight_decay, recompute, gelu_fusion)
    # llm.c's printf is block-buffered into a pipe: without line buffering its step lines would arrive
    # together at its exit, and the NVML window around them would measure nothing
    stdbuf = shutil.which("stdbuf")
    proc = subprocess.Popen(([stdbuf, "-oL"] if stdbuf else []) + cmd, cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=run_environment(runtime_library_dirs()))
    tail, steps = [], 0
    for line in proc.stdout:
        if echo is not None:
            echo(line)
        tail = (tail + [line.rstrip()])[-5:]
        parsed = parse_step_line(line)
        if parsed is not None:
            steps += 1
            on_step(parsed)
    rc = proc.wait()
    if rc != 0 or steps < len(batches):
        last = " / ".join(t for t in tail if t.strip())[-300:]
        raise LlmcError(f"llm.c: exit status {rc} after {steps} of {len(batches)} steps; it printed: {last}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llmc", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build train_gpt2cu from llm.c's source")
    b.add_argument("--src", type=Path, default=DEFAULT_SRC, help="llm.c's checkout (train_gpt2.cu, llmc/)")
    b.add_argument("--out", type=Path, default=DEFAULT_BINARY)
    b.add_argument("--frontend", type=Path, default=FRONTEND_INCLUDE, help="cuDNN frontend headers")
    b.add_argument("--arch", default="90", help="compute capability without the dot (H100/H200: 90)")
    c = sub.add_parser("check", help="say whether the binary runs here (its libraries found)")
    c.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    r = sub.add_parser("command", help="write bench_step's shards to --workdir and print the command that "
                                       "trains llm.c on them (to run it by hand, under ncu, ...)")
    r.add_argument("--binary", type=Path, default=DEFAULT_BINARY)
    r.add_argument("--workdir", type=Path, required=True)
    for flag, default in (("--B", 64), ("--T", 1024), ("--steps", 40), ("--data-seed", 1337)):
        r.add_argument(flag, type=int, default=default)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--recompute", type=int, default=None)
    r.add_argument("--gelu-fusion", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        if args.command == "build":
            build(args.src, args.out, args.frontend, args.arch)
            print(f"built {args.out}")
        elif args.command == "check":
            check_binary(args.binary)
            print(f"{args.binary} runs here")
        else:
            from bench.bench_step import make_batches
            args.workdir.mkdir(parents=True, exist_ok=True)
            write_shards(args.workdir, make_batches(50257, args.B, args.T, args.steps, args.data_seed))
            libs = os.pathsep.join(str(d) for d in runtime_library_dirs())
            cmd = run_command(args.binary, args.workdir, args.B, args.T, args.steps, args.lr, args.weight_decay,
                              args.recompute, args.gelu_fusion)
            print(f"env -u LD_LIBRARY_PATH {'LD_LIBRARY_PATH=' + libs + ' ' if libs else ''}" + " ".join(cmd))
    except LlmcError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
