"""Data parallelism (llmpy.distributed) on the CPU: two processes under torchrun on the gloo backend, the
kernel model in Triton's interpreter. The same global batch gives bitwise the same run on 2 processes
(one micro-step each) as on 1 process with 2 accumulation steps, for -z 0 and -z 1; ZeRO-1 keeps half
of the optimizer state a rank and gathers it whole into the checkpoint."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpy import distributed
from llmpy.data import write_shard
from llmpy.distributed import shard_bounds
from llmpy.errors import LlmpyError
from llmpy.trainer import TrainOptions, train
from llmpy.training_state import latest_complete_step, load_checkpoint, model_path

SRC = str(Path(__file__).resolve().parents[1] / "src")
# the kernel model on the CPU needs Triton's interpreter for the whole process (conftest sets it where
# there is no GPU); on a GPU machine bench/bench_dist.py checks the same equalities over NCCL
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo + interpreter) test")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the nvidia-h200-x2 kind)")
# a test of ranks' behaviour on both backends: gloo and the interpreter on the CPU, NCCL on two GPUs
on_gloo_or_nccl = pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreter_only),
                                                     pytest.param("cuda", marks=[pytest.mark.gpu, two_gpus])])
TINY = "layers=2,channels=32,heads=2,seq=16,vocab=257"
B, T, STEPS = 2, 16, 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp_data")
    rng = np.random.default_rng(5)
    write_shard(d / "t_train_000000.bin", rng.integers(0, 257, 4000))
    write_shard(d / "t_val_000000.bin", rng.integers(0, 257, 1000))
    return d / "t_train_000000.bin", d / "t_val_000000.bin"


def common_args(shards, dtype):
    train_f, val_f = shards
    return dict(train_data=str(train_f), val_data=str(val_f), model=TINY, batch_size=B, seq_len=T,
                total_batch_size=2 * B * T, max_steps=STEPS, val_every=3, val_max_steps=1, sample_every=0,
                gen_tokens=0, learning_rate=1e-2, warmup_steps=1, weight_decay=0.1, dtype=dtype, progress=0)


def child_env(**extra) -> dict:
    """This process's environment for a child that imports llmpy from this tree, with `extra` set."""
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def launch_torchrun(nproc, *target, device="cpu", timeout=900) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N TARGET...` on the CPU (gloo, Triton's interpreter) or GPUs (NCCL)."""
    env = child_env(OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", **({"TRITON_INTERPRET": "1"} if device == "cpu" else {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *map(str, target)], capture_output=True, text=True, env=env, timeout=timeout)


def torchrun(nproc, shards, out, dtype, *extra, device="cpu"):
    """`torchrun --standalone --nproc_per_node=N -m llmpy train ...` on the CPU (gloo) or GPUs (NCCL)."""
    a = common_args(shards, dtype)
    args = ["-i", a["train_data"], "-j", a["val_data"], "-e", TINY, "-b", B, "-t", T, "-d", a["total_batch_size"],
            "-x", STEPS, "-v", 3, "-m", 1, "-s", 0, "-g", 0, "-l", a["learning_rate"], "-u", 1, "-c", 0.1,
            "--dtype", dtype, "--device", device, "--progress", 0, "-o", out, *extra]
    return launch_torchrun(nproc, "-m", "llmpy", "train", *args, device=device)


def train_records(out):
    recs = [json.loads(line) for line in (Path(out) / "main.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"]


@pytest.fixture(scope="module")
def one_process_runs(shards, tmp_path_factory):
    """The reference: one process, the kernel model (interpreter), 2 accumulation steps a step."""
    runs = {}
    for master in (1, 0):
        out = tmp_path_factory.mktemp(f"one_w{master}")
        res = train(TrainOptions(**common_args(shards, "bfloat16"), engine="kernels", device="cpu",
                                 master_weights=master, output_dir=str(out)), log=lambda *_: None)
        assert len(res.train_losses) == STEPS
        runs[master] = out
    return runs


@interpreter_only
@pytest.mark.parametrize("zero,overlap,master", [(0, 1, 1), (1, 1, 1), (1, 0, 1), (1, 1, 0)],
                         ids=["z0", "z1", "z1-after-backward", "z1-w0"])
def test_two_processes_are_bitwise_one_process_with_accumulation(shards, one_process_runs, tmp_path, zero, overlap,
                                                                 master):
    """overlap 1 (the default): buckets of finished layers are reduced during the backward; 0: the whole
    buffer after it. Either way every element is summed in rank order: the same bits. -w 0: the bf16
    weights themselves are rounded stochastically, each shard's elements from their global index."""
    dtype = "bfloat16"
    out = tmp_path / "two"
    res = torchrun(2, shards, out, dtype, "-z", zero, "--overlap-reduction", overlap, "-w", master)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Warning" not in res.stderr, res.stderr[-3000:]  # torch's deprecation of all_gather_into_tensor, say
    # one voice: the step lines once (rank 0), and the start report names the parallel setup
    assert res.stdout.count(f"step {STEPS:5d}/{STEPS}") == 1
    assert "data parallel: 2 processes (gloo)" in res.stdout
    ref, two = train_records(one_process_runs[master]), train_records(out)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(ref, two):  # JSON floats are Python's repr: exact round trips
        assert (a["loss"], a["norm"]) == (b["loss"], b["norm"]), (a, b)
    # the final weights and the whole optimizer state, bit for bit (ZeRO-1: gathered from both shards)
    assert model_path(out, STEPS).read_bytes() == model_path(one_process_runs[master], STEPS).read_bytes()
    s_ref, s_two = load_checkpoint(one_process_runs[master], STEPS), load_checkpoint(out, STEPS)
    assert ("master" in s_two.tensors) == bool(master)
    for name in ("params", "master", "m", "v") if master else ("params", "m", "v"):
        assert torch.equal(s_ref.tensors[name], s_two.tensors[name]), name
    if zero == 1:
        n = s_ref.tensors["m"].numel()
        (lo0, hi0), (lo1, hi1) = shard_bounds(n, 2, _norm_chunk())
        kept = "AdamW state and master weights" if master else "AdamW state"  # -w 0: no master weights to shard
        assert f"ZeRO-1: {kept} of {hi0 - lo0:,} of {n:,} parameters" in res.stdout
        assert hi0 - lo0 < n and lo1 == hi0 and hi1 == n


@interpreter_only
def test_zero_1_with_a_model_of_one_norm_chunk(tmp_path):
    # one rank's shard is then the whole buffer and the other's empty: both must still join the sharded norm's
    # all-gather (a rank that chose by its shard's size skipped it, and gloo aborted on the mismatch)
    model, tokens, steps = "layers=1,channels=8,heads=1,seq=8,vocab=100", 2 * 8 * 2, 3
    data = tmp_path / "v_train_000000.bin"
    write_shard(data, np.random.default_rng(11).integers(0, 100, 2000))
    one, two = tmp_path / "one", tmp_path / "two"
    train(TrainOptions(train_data=str(data), model=model, batch_size=2, seq_len=8, total_batch_size=tokens,
                       max_steps=steps, val_every=0, sample_every=0, gen_tokens=0, learning_rate=1e-2, warmup_steps=1,
                       weight_decay=0.1, dtype="bfloat16", engine="kernels", device="cpu", output_dir=str(one),
                       progress=0), log=lambda *_: None)
    res = launch_torchrun(2, "-m", "llmpy", "train", "-i", data, "-e", model, "-b", 2, "-t", 8, "-d", tokens, "-x",
                          steps, "-v", 0, "-s", 0, "-g", 0, "-l", 1e-2, "-u", 1, "-c", 0.1, "-z", 1,
                          "--dtype", "bfloat16", "--device", "cpu", "--progress", 0, "-o", two)
    assert res.returncode == 0, res.stderr[-3000:]
    n = load_checkpoint(one, steps).config.num_parameters
    assert [hi - lo for lo, hi in shard_bounds(n, 2, _norm_chunk())] == [0, n]
    for a, b in zip(train_records(one), train_records(two), strict=True):
        assert (a["loss"], a["norm"]) == (b["loss"], b["norm"]), (a, b)
    assert model_path(two, steps).read_bytes() == model_path(one, steps).read_bytes()


def _norm_chunk() -> int:
    from llmpy.kernels.global_norm import NORM_CHUNK
    return NORM_CHUNK


@interpreter_only
def test_two_processes_resume_bitwise(shards, one_process_runs, tmp_path):
    """-z 1 on 2 processes, stopped at a checkpoint after step 3 (a shorter -x) and resumed with -y 1 to
    step 6: the same run as the uninterrupted one-process run."""
    out = tmp_path / "resumed"
    first = torchrun(2, shards, out, "bfloat16", "-z", 1, "-n", 3)
    assert first.returncode == 0, first.stderr[-3000:]
    # drop the final checkpoint of step 6, keep step 3's, then resume from it
    for f in out.glob("*00000006*"):
        f.unlink()
    second = torchrun(2, shards, out, "bfloat16", "-z", 1, "-y", 1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from model_00000003.bin" in second.stdout
    assert model_path(out, STEPS).read_bytes() == model_path(one_process_runs[1], STEPS).read_bytes()


@interpreter_only
def test_resume_on_another_process_count_is_refused(shards, tmp_path):
    """The checkpoint of a 2-process run holds the whole optimizer state, but its data position counts
    2-process windows: resuming it on 1 process stops with one line naming both counts."""
    out = tmp_path / "two"
    res = torchrun(2, shards, out, "bfloat16", "-x", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    with pytest.raises(LlmpyError, match="run of 2 process.*this run has 1.*--nproc_per_node=2"):
        train(TrainOptions(**{**common_args(shards, "bfloat16"), "max_steps": 4}, engine="kernels", device="cpu",
                           output_dir=str(out), resume=1), log=lambda *_: None)


@interpreter_only
def test_processes_that_find_different_checkpoints_are_refused(shards, tmp_path):
    # -o on each node's own disk: rank 0's node holds the run's checkpoints, the other's none. Rank 1 started afresh
    # while rank 0 resumed, and their steps' collectives (a validation against a step's reduction) waited for each
    # other until the group's timeout; each rank runs here in its own folder, with the same "-o out"
    res = torchrun(2, shards, tmp_path / "node0" / "out", "float32", "-x", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    (tmp_path / "node1" / "out").mkdir(parents=True)
    a = common_args(shards, "float32")
    args = [*map(str, ["-i", a["train_data"], "-j", a["val_data"], "-e", TINY, "-b", B, "-t", T, "-d",
                       a["total_batch_size"], "-x", 4, "-v", 3, "-m", 1, "-g", 0, "--dtype", "float32",
                       "--device", "cpu", "--progress", 0]), "-o", "out", "-y", "1"]
    res = launch_torchrun(2, _rank_cwd_script(tmp_path, args), timeout=300)
    assert_ranks_refused(res, [(str(rank), "-y 1: the processes of this run found different checkpoints in -o out "
                                f"(this one, rank {rank}: {have}): give every process the same -o, a folder that "
                                "every node sees") for rank, have in ((0, "step 2"), (1, "none"))])


def test_parallel_options_without_torchrun_are_one_line_errors(shards, tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    train_f, _ = shards
    base = [sys.executable, "-m", "llmpy", "train", "-i", str(train_f), "-e", TINY, "-b", "2", "-t", "16", "-x", "1",
            "--device", "cpu"]
    for extra, needle in ((["-z", "1"], "launch with torchrun"), (["--engine", "kernels"], "TRITON_INTERPRET=1"),
                          (["--engine", "nope"], "--engine nope")):
        res = subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=120)
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert res.returncode != 0 and len(lines) == 1 and needle in lines[0], res.stderr


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 40], ids=["a-layer-a-bucket", "one-bucket"])
def test_bucket_plan_covers_the_buffer_once(monkeypatch, bucket_bytes):
    """The overlapped reduction's buckets: layers from the top down, then wte/wpe/lnf after the encoder;
    their ranges cover every parameter exactly once."""
    from llmpy.config import parse_descriptor
    from llmpy.distributed import DataParallel
    from llmpy.init import init_parameters
    from llmpy.model import GPT2Model
    monkeypatch.setattr(GPT2Model, "BUCKET_BYTES", bucket_bytes)
    cfg = parse_descriptor("layers=5,channels=32,heads=2,seq=16,vocab=257")
    model = GPT2Model(cfg, init_parameters(cfg, 1), 1, 8, device="cpu", dtype=torch.float32, cuda_graph=False,
                      data_parallel=DataParallel(rank=0, world_size=2))
    model._prepare(1)
    triggers = [t for t, _ in model._buckets]
    assert triggers == ([4, 3, 2, 1, 0, -1] if bucket_bytes == 1 else [0, -1])
    covered = torch.zeros(cfg.num_parameters, dtype=torch.int32)
    for _, ranges in model._buckets:
        for a, b in ranges:
            covered[a:b] += 1
    assert bool((covered == 1).all())


class _GraphOwner:
    def __init__(self, fail=False):
        self.released, self.fail = 0, fail

    def release_graphs(self):
        self.released += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_shutdown_releases_captured_graphs_first_and_survives_a_failing_release():
    """Graphs that captured NCCL work must go before the communicator; on the way out of an error the
    release may fail, and that must not replace the error being reported."""
    kept, failing = _GraphOwner(), _GraphOwner(fail=True)
    distributed.release_before_shutdown(failing.release_graphs)
    distributed.release_before_shutdown(kept.release_graphs)
    gone = _GraphOwner()
    distributed.release_before_shutdown(gone.release_graphs)
    del gone  # held weakly: a freed model is skipped
    distributed.shutdown()
    assert failing.released == 1 and kept.released == 0  # the failure stops the releases, not shutdown
    distributed.release_before_shutdown(kept.release_graphs)
    distributed.shutdown()
    distributed.shutdown()  # the list is emptied: nothing is released twice
    assert kept.released == 1


@pytest.fixture(scope="module")
def one_gpu_run(shards, tmp_path_factory):
    """The NCCL tests' reference: one GPU, 2 accumulation steps a step (trained once for the three)."""
    one = tmp_path_factory.mktemp("one_gpu")
    res = train(TrainOptions(**common_args(shards, "bfloat16"), device="cuda", output_dir=str(one)),
                log=lambda *_: None)
    assert len(res.train_losses) == STEPS
    return one


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("zero,overlap", [(0, 1), (1, 1), (1, 0)], ids=["z0", "z1", "z1-after-backward"])
def test_two_gpus_are_bitwise_one_gpu_with_accumulation(shards, one_gpu_run, tmp_path, zero, overlap):
    """The same equality over NCCL: 2 GPUs, one micro-step each, against 1 GPU with 2 accumulation steps."""
    two = tmp_path / "two"
    run = torchrun(2, shards, two, "bfloat16", "-z", zero, "--overlap-reduction", overlap, device="cuda")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data parallel: 2 processes (nccl)" in run.stdout
    for a, b in zip(train_records(one_gpu_run), train_records(two)):
        assert (a["loss"], a["norm"]) == (b["loss"], b["norm"]), (a, b)
    assert model_path(two, STEPS).read_bytes() == model_path(one_gpu_run, STEPS).read_bytes()


def _rank_argv_script(tmp_path, per_rank: list[list]) -> Path:
    """A script for torchrun that runs `llmpy train` with rank r's own command line, per_rank[r]."""
    script = tmp_path / "rank_argv.py"
    script.write_text("import json, os, sys\nfrom llmpy.cli import main\n"
                      f"sys.exit(main(['train', *json.loads({json.dumps(json.dumps(per_rank))})"
                      "[int(os.environ['RANK'])]]))\n")
    return script


def _rank_cwd_script(tmp_path, argv: list) -> Path:
    """A script for torchrun that runs `llmpy train ARGV` with rank r in tmp_path/node{r}: one command line that
    each rank reads against its own folder, as nodes with their own disks do."""
    script = tmp_path / "rank_cwd.py"
    script.write_text("import os, sys\nfrom llmpy.cli import main\n"
                      f"os.chdir(os.path.join({str(tmp_path)!r}, 'node' + os.environ['RANK']))\n"
                      f"sys.exit(main(['train', *{[str(a) for a in argv]!r}]))\n")
    return script


def assert_ranks_refused(res, wants: list[tuple[str, str]]):
    """A torchrun job that failed with llmpy's one-line errors only (torchrun prints its own traceback of the failed
    child and stops the other rank, which may not have said its line yet), each (rank, line) one of wants."""
    assert res.returncode != 0 and "llmpy/" not in res.stderr, res.stderr[-3000:]
    lines = re.findall(r"^llmpy train: rank (\d) of 2: error: (.*)$", res.stderr, re.M)
    assert lines and all(line in wants for line in lines), (wants, res.stderr[-3000:])


@interpreter_only
def test_processes_given_different_options_are_refused(shards, tmp_path):
    # a torchrun job whose ranks were given different options (a command line a node) would train on without a word
    # (-b, --seed) or fail inside a collective (-e): a rank says so in one line, before any step
    train_f, val_f = shards
    base = ["-i", str(train_f), "-e", TINY, "-t", str(T), "-x", "1", "-v", "0", "-g", "0", "--progress", "0"]
    for differing, flag, values in ((["-b"], "-b", ("2", "4")), (["--seed"], "--seed", ("1", "2"))):
        script = _rank_argv_script(tmp_path, [[*base, *differing, v, *(["-b", "2"] if flag != "-b" else [])]
                                              for v in values])
        res = launch_torchrun(2, script, timeout=300)
        assert_ranks_refused(res, [(str(rank), f"the processes of this run were given different {flag} (this one, "
                                    f"rank {rank}: {int(value)}): give every process the same options")
                                   for rank, value in enumerate(values)])


@interpreter_only
def test_processes_that_find_different_shards_are_refused(tmp_path):
    # the same options, but "-i data/t_train_*.bin" resolves on each node to its own copy, and one node's is another
    # dataset: each rank would train on its slice of another stream without a word. Here each rank runs in its own
    # folder, rank 1's train shard other tokens (the same name and size would pass: shards are told by both)
    rng = np.random.default_rng()
    for rank, n in ((0, 4000), (1, 4100)):
        (tmp_path / f"node{rank}" / "data").mkdir(parents=True)
        write_shard(tmp_path / f"node{rank}" / "data" / "t_train_000000.bin", rng.integers(0, 257, n))
    argv = ["-i", "data/t_train_*.bin", "-e", TINY, "-b", 2, "-t", T, "-x", 1, "-v", 0, "-g", 0, "--progress", 0]
    res = launch_torchrun(2, _rank_cwd_script(tmp_path, argv), timeout=300)
    assert_ranks_refused(res, [(str(rank), "the processes of this run found different shards for -i "
                                f"data/t_train_*.bin (this one, rank {rank}: 1 shard(s), t_train_000000.bin, {n:,} "
                                "tokens): give every process the same data") for rank, n in ((0, 4000), (1, 4100))])


@interpreter_only
def test_processes_that_load_different_models_are_refused(tmp_path):
    # the same options, but "-e model.bin" is each node's own copy: other weights trained on without a word (each
    # rank applying the shared gradients to its own), another shape died inside a collective. Rank 1's copy differs
    # in one weight, then in its shape
    from llmpy.checkpoint import save_llmc
    from llmpy.config import parse_descriptor
    rng = np.random.default_rng()
    config = parse_descriptor(TINY)
    weights = torch.from_numpy(rng.normal(0, 0.02, config.num_parameters).astype(np.float32))
    tokens = rng.integers(0, 257, 4000)
    for rank in (0, 1):  # the same data on both nodes
        (tmp_path / f"node{rank}").mkdir()
        write_shard(tmp_path / f"node{rank}" / "t_train_000000.bin", tokens)
    argv = ["-i", "t_train_000000.bin", "-e", "model.bin", "-b", 2, "-t", T, "-x", 1, "-v", 0, "-g", 0, "--progress", 0]
    bigger = parse_descriptor(TINY.replace("layers=2", "layers=3"))
    for other_config, other in ((config, weights.clone().index_put_((torch.tensor([3]),), torch.tensor(0.5))),
                                (bigger, torch.from_numpy(rng.normal(0, 0.02, bigger.num_parameters)
                                                          .astype(np.float32)))):
        save_llmc(tmp_path / "node0" / "model.bin", config, weights)
        save_llmc(tmp_path / "node1" / "model.bin", other_config, other)
        res = launch_torchrun(2, _rank_cwd_script(tmp_path, argv), timeout=300)
        wants = []
        for rank, (cfg, flat) in enumerate(((config, weights), (other_config, other))):
            crc = zlib.crc32(memoryview(flat.contiguous().view(torch.uint8).numpy()))
            wants.append((str(rank), f"the processes of this run loaded different models for -e model.bin (this "
                                     f"one, rank {rank}: {cfg.describe()}, weights' crc32 {crc:08x}): give every "
                                     "process the same model file"))
        assert_ranks_refused(res, wants)


@interpreter_only
def test_a_rank_that_fails_before_the_group_forms_stops_the_other_at_once(shards, tmp_path):
    # rank 0 waits for rank 1 inside init_process_group (C++, where Python's handlers do not run) and rank 1 fails:
    # torchrun's SIGTERM must end rank 0 then, not its SIGKILL after a 30 s grace
    train_f, _ = shards
    waiting = tmp_path / "rank0_is_joining"
    script = tmp_path / "fail_before_group.py"
    script.write_text(f"""import os, sys, time
if os.environ["RANK"] == "1":
    while not os.path.exists({str(waiting)!r}):
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0 is in the group's wait by now
    sys.exit(3)
import torch.distributed as dist
join = dist.init_process_group
def joining(*a, **k):
    open({str(waiting)!r}, "w").close()
    return join(*a, **k)
dist.init_process_group = joining
from llmpy.cli import main
sys.exit(main(["train", "-i", {str(train_f)!r}, "-e", {TINY!r}, "-b", "2", "-t", "{T}", "-x", "1", "-o",
               {str(tmp_path / "out")!r}]))
""")
    res = launch_torchrun(2, script, timeout=300)
    assert res.returncode != 0 and waiting.exists(), res.stderr[-3000:]
    # torchrun's report: rank 1's own exit status, and rank 0 ended by SIGTERM (SIGKILL had it ignored SIGTERM)
    assert "exitcode  : 3 " in res.stderr and "exitcode  : -15 " in res.stderr, res.stderr[-3000:]
    assert "SIGKILL" not in res.stderr, res.stderr[-3000:]


def test_a_peers_closed_connection_under_gloo_is_one_line(monkeypatch, capsys):
    # gloo says a peer stopped as a plain RuntimeError; any other RuntimeError is a bug and keeps its traceback
    import llmpy.trainer as trainer
    from llmpy import cli

    def peer_gone(args):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                           "[127.0.0.1]:41234")
    monkeypatch.setattr(trainer, "run", peer_gone)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["llmpy train: error: data-parallel communication failed ([../third_party/gloo/gloo/transport/tcp/"
                   "pair.cc:561] Connection closed by peer [127.0.0.1]:41234); another process may have stopped "
                   "first: see its output"]

    # under torchrun every rank writes to the same output: each line says whose it is
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.startswith("llmpy train: rank 1 of 2: error: data-parallel communication failed")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.startswith("llmpy train: error: data-parallel communication failed")

    def bug(args):
        raise RuntimeError("an index out of range somewhere")
    monkeypatch.setattr(trainer, "run", bug)
    with pytest.raises(RuntimeError, match="an index out of range"):
        cli.main(["train"])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ranks(world, *target, device="cpu", ranks=None) -> list[subprocess.Popen]:
    """`python TARGET...` for each rank (of `ranks`, default all), with torchrun's environment but without torchrun:
    the test holds every process's pid (to stop one, signal another), which torchrun's children hide."""
    backend_env = {"TRITON_INTERPRET": "1"} if device == "cpu" else {"NCCL_NVLS_ENABLE": "0"}
    env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), **backend_env)
    return [subprocess.Popen([sys.executable, *map(str, target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in (range(world) if ranks is None else ranks)]


def _end(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate(timeout=60)


def stuck_line(rank, signame, where, seconds=10):
    """The pattern of StuckRankWatch's line; `where`: a regular expression of the place."""
    return (rf"llmpy: rank {rank} of 2: {signame} came while this process waited in {where}, and it has not moved "
            rf"for {seconds} s: another process has stopped or hangs; ending without saving \(checkpoints already "
            r"written are whole\)\n")


def _signal_rank0_at_a_barrier(tmp_path, rank1_joins_after_s, patient, patient_limit_s=None):
    """Rank 0 at a barrier (inside distributed.patient() or not) that rank 1 joins after rank1_joins_after_s, SIGTERM
    to rank 0 half a second into its wait: (rank 0's exit status, stdout, stderr, seconds from the signal to its
    exit). patient_limit_s: distributed.PATIENT_STUCK_AFTER_SIGNAL_S in the ranks, if given."""
    ready = tmp_path / "rank0_at_the_barrier"
    script = tmp_path / "wait_at_barrier.py"
    script.write_text(f"""import contextlib, os, signal, sys, time
from llmpy import distributed
from llmpy.distributed import init_data_parallel, patient, signals_watched
if {patient_limit_s is not None}:
    distributed.PATIENT_STUCK_AFTER_SIGNAL_S = {patient_limit_s}
dp = init_data_parallel("cpu", 0)
if dp.rank == 1:
    while not os.path.exists({str(ready)!r}):
        time.sleep(0.05)
    time.sleep({rank1_joins_after_s})
else:
    signal.signal(signal.SIGTERM, lambda signum, frame: print("handler ran"))
    open({str(ready)!r}, "w").close()
with signals_watched(), patient() if {patient} else contextlib.nullcontext():
    dp.barrier()
print("the barrier returned")
""")
    procs = _launch_ranks(2, script)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert ready.exists(), procs[0].communicate(timeout=60)
        time.sleep(0.5)
        signalled = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        out, err = procs[0].communicate(timeout=60)
        return procs[0].returncode, out, err, time.monotonic() - signalled
    finally:
        _end(procs)


def test_sigterm_ends_a_rank_waiting_in_a_collective_for_a_peer_that_never_comes(tmp_path):
    # Python's handler would run only once the barrier returned (after the group's 30 min timeout): the watch ends
    # the process 10 s after the signal instead, with one line naming where it waited
    rc, out, err, waited = _signal_rank0_at_a_barrier(tmp_path, 600, patient=False)
    assert rc == 128 + signal.SIGTERM, err
    assert 10 <= waited < 20, waited
    where = r"barrier \(distributed_c10d\.py:\d+\) from barrier \(llmpy/distributed\.py:\d+\)"
    assert re.fullmatch(stuck_line(0, "SIGTERM", where), err), err
    assert out == "", out  # neither the handler (it never got to run) nor anything after the barrier


def test_a_patient_wait_outlasts_the_watch(tmp_path):
    # rank 0 writing a checkpoint while the others wait at the barrier: a long wait, rightly; the signal is handled
    # once the barrier returns, 14 s on, past the 10 s after which an impatient wait would have ended the process
    rc, out, err, waited = _signal_rank0_at_a_barrier(tmp_path, 14, patient=True)
    assert rc == 0 and out == "handler ran\nthe barrier returned\n", (out, err)
    assert "llmpy: rank" not in err and waited >= 13, (err, waited)


def test_a_patient_wait_ends_too_at_its_own_limit(tmp_path):
    # a peer may fail inside a patient stretch as well: the wait there ends at its longer limit (120 s; 3 s here)
    rc, out, err, waited = _signal_rank0_at_a_barrier(tmp_path, 600, patient=True, patient_limit_s=3)
    assert rc == 128 + signal.SIGTERM and out == "", (out, err)
    assert 3 <= waited < 10, waited
    assert re.fullmatch(stuck_line(0, "SIGTERM", r"barrier \(distributed_c10d\.py:\d+\) from .*", seconds=3), err), err


def _train_ranks(shards, out, *extra, device="cpu"):
    train_f, _ = shards
    return _launch_ranks(2, "-m", "llmpy", "train", "-i", train_f, "-e", TINY, "-b", B, "-t", T, "-x", 100000, "-v", 0,
                         "-s", 0, "-g", 0, "-k", "constant", "-o", out, "--device", device, "--progress", 0, *extra,
                         device=device)


def _after_steps(proc, k):
    """Read rank 0's output up to its k-th step line."""
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("step ")
        if seen == k:
            return
    raise AssertionError(f"rank 0 ended before step {k}: {proc.communicate(timeout=60)[1][-3000:]}")


def _sigterm_every_rank_after_step_2(procs) -> list[tuple[str, str]]:
    """SIGTERM to every rank once rank 0 has logged step 2, as torchrun passes a stop on; each rank's (the rest of its
    stdout, stderr)."""
    try:
        _after_steps(procs[0], 2)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        return [p.communicate(timeout=120) for p in procs]
    finally:
        _end(procs)


@on_gloo_or_nccl
def test_sigterm_ends_a_training_rank_whose_peer_hangs(shards, tmp_path, device):
    # rank 1 frozen mid-run (a hung GPU or node, as far as rank 0 can tell) after rank 0 logged step 4: rank 0 waits
    # in the ranks' agreement on signals or in a step's reduction (over NCCL: in a CUDA synchronisation), where its
    # SIGTERM handler cannot run; the watch ends it, and the last checkpoint stays whole
    out = tmp_path / "o"
    procs = _train_ranks(shards, out, "-n", 3, device=device)
    try:
        _after_steps(procs[0], 4)
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        procs[0].send_signal(signal.SIGTERM)
        rest, err = procs[0].communicate(timeout=60)
    finally:
        _end(procs)
    assert procs[0].returncode == 128 + signal.SIGTERM, err
    place = r"\S+ \(\S+:\d+\)( from \S+ \(llmpy/\S+:\d+\))?"
    # the limit is 10 s, or three times the slowest step if that is longer (a slow machine's interpreter)
    assert re.fullmatch(r"(.*\n)*" + stuck_line(0, "SIGTERM", place, seconds=r"\d+"), err), err
    assert "Traceback" not in err and "stopped by SIGTERM" not in rest
    # the interpreter's steps take seconds, so rank 0 is still at step 5; a GPU's take milliseconds, and rank 0 may
    # have run (and saved) a few more before the test read its step 4 line and froze rank 1
    k = latest_complete_step(out)
    assert (k == 3) if device == "cpu" else (k is not None and k >= 3 and k % 3 == 0), k
    load_checkpoint(out, k)


def _each_ranks_end(script, device="cpu") -> tuple[list[int], list[str]]:
    """Two ranks of `script` run to their end: their exit statuses and stderrs."""
    procs = _launch_ranks(2, script, device=device)
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        _end(procs)
    return [p.returncode for p in procs], errs


@on_gloo_or_nccl
def test_a_checkpoint_that_rank_0_cannot_write_stops_every_rank_at_once(shards, tmp_path, device):
    # rank 0 alone writes (a full disk; here its -o holds a folder where the DONE marker goes): the others waited for
    # it at a barrier, over NCCL until the group's timeout or torchrun's SIGTERM; each rank says so in one line now
    (tmp_path / "node0" / "out" / "DONE_00000002").mkdir(parents=True)
    (tmp_path / "node1").mkdir()
    train_f, _ = shards
    argv = ["-i", train_f, "-e", TINY, "-b", B, "-t", T, "-x", 4, "-n", 2, "-v", 0, "-g", 0, "-o", "out",
            "--device", device, "--progress", 0]
    codes, errs = _each_ranks_end(_rank_cwd_script(tmp_path, argv), device)
    assert codes == [1, 1], errs
    assert errs == ["llmpy train: rank 0 of 2: error: out/DONE_00000002: cannot write (Is a directory); the checkpoint "
                    "of step 2 is whole\n",
                    "llmpy train: rank 1 of 2: error: rank 0 could not save the checkpoint of step 2 (see its line); "
                    "stopping\n"], errs


@on_gloo_or_nccl
def test_sigterm_to_every_rank_of_a_healthy_run_saves_and_stops(shards, tmp_path, device):
    # torchrun stops a job so (its own SIGTERM or Ctrl-C, passed to every worker): the watch must not cut it short
    out = tmp_path / "o"
    procs = _train_ranks(shards, out, device=device)
    ends = _sigterm_every_rank_after_step_2(procs)
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, [e[1][-2000:] for e in ends]
    assert all("llmpy: rank" not in err and "Traceback" not in err for _, err in ends), ends
    assert "stopped by SIGTERM" in ends[0][0]
    k = latest_complete_step(out)
    assert k is not None and k >= 2
    load_checkpoint(out, k)


def _tiny_hellaswag_file(path, seed=None) -> Path:
    """Three random examples of TINY's vocabulary in llm.c's eval file format."""
    from llmpy.hellaswag import Example, write_eval_file
    rng = np.random.default_rng(seed)
    examples = [Example(i, int(rng.integers(0, 4)), rng.integers(0, 257, 5).tolist(),
                        [rng.integers(0, 257, 3).tolist() for _ in range(4)]) for i in range(3)]
    return write_eval_file(path, examples)


@interpreter_only
def test_two_processes_sample_and_score_hellaswag_on_rank_0(shards, tmp_path):
    # rank 0 samples and scores HellaSwag alone while the others wait at a barrier: every rank meets it the same
    # number of times, and the run ends as a plain one does
    hs = _tiny_hellaswag_file(tmp_path / "hs.bin", seed=3)
    train_f, val_f = shards
    res = launch_torchrun(2, "-m", "llmpy", "train", "-i", train_f, "-j", val_f, "-e", TINY, "-b", 4, "-t", T,
                          "-x", 3, "-v", 2, "-m", 1, "-s", 2, "-g", 3, "-h", 1, "--hellaswag-file", hs,
                          "--device", "cpu", "--progress", 0, "-o", tmp_path / "o")
    assert res.returncode == 0, res.stderr[-3000:]
    # HellaSwag at steps 2 and 3 (not 0, as llm.c), samples at 2 and the end
    assert res.stdout.count("HellaSwag: ") == 2 and res.stdout.count("--- sample at step ") == 2, res.stdout
    assert latest_complete_step(tmp_path / "o") == 3


# what rank 0 does alone, made to fail there: (flags, module, its function replaced on rank 0, the failure's step),
# with rank 0's line and the end of rank 1's "rank 0 could not ..."
_FAILING_ON_RANK_0 = {
    "sample": (["-s", 2, "-g", 3], "llmpy.sampler", "generate", None,
               "step 2: it failed here; stopping (lower -l)", "sample at step 2"),
    "hellaswag": (["-h", 1], "llmpy.hellaswag", "score", None, "it failed here",
                  "log or score the validation of step 2"),
    "val log": ([], "llmpy.trainer", "RunLog.write", ("val", 2), "it failed here",
                "log or score the validation of step 2"),
    "train log": ([], "llmpy.trainer", "RunLog.write", ("train", 2), "it failed here", "log step 2"),
}


@interpreter_only
@pytest.mark.parametrize("work", list(_FAILING_ON_RANK_0))
def test_work_that_fails_on_rank_0_alone_stops_every_rank_at_once(shards, tmp_path, work):
    # rank 0 logs, samples and scores HellaSwag alone; its failure there (a full disk, a sample's non-finite logits)
    # left the others waiting for it at a barrier or in the next step's collectives, which over gloo fail with
    # "Connection closed by peer" and over NCCL wait for torchrun's SIGTERM and the stuck-rank watch
    flags, module, name, at, rank0_line, what = _FAILING_ON_RANK_0[work]
    hs = _tiny_hellaswag_file(tmp_path / "hs.bin")
    train_f, val_f = shards
    flags = [*flags, "--hellaswag-file", hs] if "-h" in flags else flags
    argv = [str(a) for a in ["train", "-i", train_f, "-j", val_f, "-e", TINY, "-b", 4, "-t", T, "-x", 3, "-v", 2,
                             "-m", 1, *flags, "--device", "cpu", "--progress", 0, "-o", tmp_path / "o"]]
    owner, _, attr = name.rpartition(".")
    script = tmp_path / "fail_on_rank_0.py"
    script.write_text(f"""import functools, importlib, os, sys
from llmpy.cli import main
from llmpy.errors import LlmpyError
where = importlib.import_module({module!r})
if {owner!r}:
    where = getattr(where, {owner!r})
real, at = getattr(where, {attr!r}), {at!r}
@functools.wraps(real)
def failing(*args, **kwargs):
    if at is None or (args[2], args[1]) == at:  # RunLog.write(self, step, kind, ...)
        raise LlmpyError("it failed here")
    return real(*args, **kwargs)
if os.environ["RANK"] == "0":
    setattr(where, {attr!r}, failing)
sys.exit(main({argv!r}))
""")
    codes, errs = _each_ranks_end(script)
    assert codes == [1, 1], errs
    assert errs == [f"llmpy train: rank 0 of 2: error: {rank0_line}\n",
                    f"llmpy train: rank 1 of 2: error: rank 0 could not {what} (see its line); stopping\n"], errs


@interpreter_only
@pytest.mark.parametrize("found_by", ["the probe", "the log's lock"])
def test_an_output_folder_in_use_stops_every_rank_with_one_line(shards, tmp_path, found_by):
    # rank 0 alone probes and locks -o; its refusal left rank 1 to die in the next collective, in gloo's words cut
    # mid-word ("Connection closed by peer ... Check the logs of the remote w")
    import fcntl
    out = tmp_path / "o"
    out.mkdir()
    train_f, _ = shards
    argv = [str(a) for a in ["train", "-i", train_f, "-e", TINY, "-b", B, "-t", T, "-x", 2, "-v", 0, "-g", 0,
                             "--device", "cpu", "--progress", 0, "-o", out]]
    script = tmp_path / "in_use.py"
    # "the log's lock": taken by another run after rank 0's probe (made to pass here), when rank 0 opens its log
    skip_probe = "trainer._refuse_a_folder_in_use = lambda out_dir: None\n" if found_by == "the log's lock" else ""
    script.write_text(f"import sys\nfrom llmpy import trainer\nfrom llmpy.cli import main\n{skip_probe}"
                      f"sys.exit(main({argv!r}))\n")
    with open(out / ".llmpy.lock", "a+") as held:  # as a run in progress holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        codes, errs = _each_ranks_end(script)
    what = f"write into -o {out}" if found_by == "the probe" else f"start the run's log in -o {out}"
    assert codes == [1, 1], errs
    assert errs == [f"llmpy train: rank 0 of 2: error: -o {out}: another run is writing there (process 4242); wait "
                    "for it to end, or give another -o\n",
                    f"llmpy train: rank 1 of 2: error: rank 0 could not {what} (see its line); stopping\n"], errs
    assert sorted(p.name for p in out.iterdir()) == [".llmpy.lock"]


@pytest.mark.gpu
@pytest.mark.parametrize("wait", ["stream", "item", "graph"])
def test_gpu_the_watch_runs_while_the_main_thread_waits_on_the_gpu(tmp_path, wait):
    # over NCCL a rank waiting for a peer sits in a CUDA synchronisation (the step's graph holds the collectives);
    # the watch's thread can act only if that wait lets go of the GIL. The GPU spins 30 s here; SIGTERM comes
    # after 0.5 s, and the watch (2 s) must end the process long before the spin does
    script = tmp_path / "wait_on_gpu.py"
    script.write_text(f"""import os, signal, threading, time
import torch
from llmpy.distributed import StuckRankWatch, signals_watched
StuckRankWatch(0, 2, grace_s=2.0).start()
watched = signals_watched()  # held: a context manager's generator left unreferenced would be closed at once
watched.__enter__()
signal.signal(signal.SIGTERM, lambda signum, frame: print("handler ran"))
x = torch.ones(1, device="cuda")
start = torch.cuda.Event(enable_timing=True); end = torch.cuda.Event(enable_timing=True)
start.record(); torch.cuda._sleep(10_000_000); end.record(); end.synchronize()
cycles = int(10_000_000 * 30_000 / start.elapsed_time(end))  # 30 s of spinning
if {wait!r} == "graph":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(cycles)
        y = x * 2
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
if {wait!r} == "stream":
    torch.cuda._sleep(cycles)
    torch.cuda.current_stream().synchronize()
elif {wait!r} == "item":
    torch.cuda._sleep(cycles)
    (x * 2).item()
else:
    graph.replay()
    torch.cuda.current_stream().synchronize()
print("the wait returned")
""")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=child_env(), timeout=120)
    took = time.monotonic() - t0
    assert res.returncode == 128 + signal.SIGTERM and res.stdout == "", (res.stdout, res.stderr[-2000:])
    assert "llmpy: rank 0 of 2: SIGTERM came while this process waited in " in res.stderr, res.stderr[-2000:]
    assert took < 25, took  # CUDA's start, 0.5 s, the watch's 2 s: not the 30 s spin


def test_the_watch_passes_signals_on_to_the_wakeup_fd_it_replaced_and_gives_it_back():
    # an asyncio loop in the main thread hears of signals through set_wakeup_fd: the watch must not deafen it
    from llmpy.distributed import StuckRankWatch
    theirs_r, theirs_w = os.pipe()
    os.set_blocking(theirs_w, False)
    os.set_blocking(theirs_r, False)
    before = signal.set_wakeup_fd(theirs_w)
    old_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    watch = StuckRankWatch(0, 2)
    try:
        watch.start()
        os.kill(os.getpid(), signal.SIGUSR1)
        heard = b""
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
            try:
                heard = os.read(theirs_r, 16)
            except BlockingIOError:
                pass
        assert heard == bytes([signal.SIGUSR1])
    finally:
        watch.stop()
        assert signal.set_wakeup_fd(before) == theirs_w  # the watch put theirs back
        signal.signal(signal.SIGUSR1, old_usr1)
        os.close(theirs_r)
        os.close(theirs_w)


def _run_script(tmp_path, text, timeout=120) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "script.py"
    script.write_text(text)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=child_env(),
                         timeout=timeout)
    return res, time.monotonic() - t0


def test_the_watch_counts_signals_only_inside_a_run_and_waits_out_a_few_steps(tmp_path):
    # a wait of under three steps' length is a step, not a hang (a graphed step is one wait); a signal belongs to
    # the run it came in: once that run has returned, a long call of the caller's is none of the watch's business
    res, took = _run_script(tmp_path, """import os, signal, time
from llmpy.distributed import StuckRankWatch, note_step_seconds, signals_watched
StuckRankWatch(0, 2, grace_s=1.0).start()
signal.signal(signal.SIGTERM, lambda signum, frame: None)
def wait(seconds, said):
    time.sleep(seconds)  # one call: the main thread's place does not move
    print(said, flush=True)
with signals_watched():
    note_step_seconds(1.0)  # limit 3 s
    os.kill(os.getpid(), signal.SIGTERM)
    wait(2.0, "a wait of two steps")
wait(2.0, "the signal ended with its run")
os.kill(os.getpid(), signal.SIGTERM)
wait(2.0, "a signal between runs")
with signals_watched():  # a new run: 1 s, its steps not yet timed
    os.kill(os.getpid(), signal.SIGTERM)
    t0 = time.monotonic()
    wait(30.0, "never")
""")
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-2000:]
    assert res.stdout == "a wait of two steps\nthe signal ended with its run\na signal between runs\n", res.stdout
    assert re.fullmatch(stuck_line(0, "SIGTERM", r"wait \(script\.py:\d+\)", seconds=1), res.stderr), res.stderr
    assert took < 25, took


def test_the_watch_ends_the_process_when_its_stderr_is_gone(tmp_path):
    # `torchrun ... 2>&1 | tee log` and a Ctrl-C: tee is gone, and the line's write fails (EPIPE, as Python ignores
    # SIGPIPE). The watch's thread died of it and the rank waited on, for torchrun's SIGKILL or the group's timeout
    res, took = _run_script(tmp_path, """import os, signal, time
from llmpy.distributed import StuckRankWatch, signals_watched
StuckRankWatch(0, 2, grace_s=1.0).start()
signal.signal(signal.SIGTERM, lambda signum, frame: None)
r, w = os.pipe()
os.close(r)
os.dup2(w, 2)
with signals_watched():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30.0)
""")
    assert res.returncode == 128 + signal.SIGTERM and took < 25, (res.returncode, took)


def test_the_watch_stopped_from_another_thread_leaves_its_pipe_registered_and_open():
    # set_wakeup_fd can only be changed from the main thread: closing the pipe it names would have Python's C
    # handler write signal numbers into whatever file took that number next
    import threading as th
    from llmpy.distributed import StuckRankWatch
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    old_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    watch = StuckRankWatch(0, 2)
    watch.start()
    fds = (watch._signals_r, watch._signals_w, watch._stop_r, watch._stop_w)
    try:
        stopper = th.Thread(target=watch.stop)
        stopper.start()
        stopper.join()
        assert watch._thread is None
        for fd in fds:
            os.fstat(fd)  # still open
        assert signal.set_wakeup_fd(fds[1]) == fds[1]  # still registered
        os.kill(os.getpid(), signal.SIGUSR1)
        assert os.read(fds[0], 16) == bytes([signal.SIGUSR1])
    finally:
        signal.set_wakeup_fd(before)
        signal.signal(signal.SIGUSR1, old_usr1)
        for fd in fds:
            os.close(fd)


@interpreter_only
def test_sigint_ends_a_rank_at_once_while_the_group_forms(tmp_path):
    # rank 0 waits inside init_process_group for a rank 1 that never comes; torchrun passes a Ctrl-C on as SIGINT,
    # whose Python handler could not run there
    joining = tmp_path / "joining"
    script = tmp_path / "join.py"
    script.write_text(f"""import torch.distributed as dist
join = dist.init_process_group
def joining(*a, **k):
    open({str(joining)!r}, "w").close()
    return join(*a, **k)
dist.init_process_group = joining
from llmpy.distributed import init_data_parallel
init_data_parallel("cpu", 0)
print("joined")
""")
    (rank0,) = _launch_ranks(2, script, ranks=[0])
    try:
        deadline = time.monotonic() + 120
        while not joining.exists() and time.monotonic() < deadline and rank0.poll() is None:
            time.sleep(0.05)
        assert joining.exists(), rank0.communicate(timeout=60)
        time.sleep(1.0)
        rank0.send_signal(signal.SIGINT)
        out, err = rank0.communicate(timeout=10)
    finally:
        _end([rank0])
    assert rank0.returncode == -signal.SIGINT and out == "", (rank0.returncode, out, err[-2000:])


@interpreter_only
def test_after_a_run_stopped_by_sigterm_returns_the_callers_long_call_is_not_cut_short(shards, tmp_path):
    # llmpy.train under torchrun returns stopped_by=SIGTERM with its checkpoint; the script goes on in one long
    # call, which the signal the run already acted on must not end
    train_f, _ = shards
    script = tmp_path / "api_then_wait.py"
    script.write_text(f"""import time
import llmpy
res = llmpy.train(train_data={str(train_f)!r}, model={TINY!r}, batch_size={B}, seq_len={T}, max_steps=100000,
                  val_every=0, sample_every=0, gen_tokens=0, lr_schedule="constant", device="cpu", progress=0,
                  output_dir={str(tmp_path / "o")!r})
print("stopped by", res.stopped_by, flush=True)
time.sleep(13)
print("script finished", flush=True)
""")
    procs = _launch_ranks(2, script)
    ends = _sigterm_every_rank_after_step_2(procs)
    assert [p.returncode for p in procs] == [0, 0], [e[1][-2000:] for e in ends]
    assert ends[0][0].endswith("stopped by SIGTERM\nscript finished\n"), ends[0][0][-2000:]
    assert ends[1][0] == "stopped by SIGTERM\nscript finished\n" and "llmpy: rank" not in ends[1][1], ends[1]


def test_the_first_two_steps_are_patient_until_one_step_is_timed(tmp_path, monkeypatch):
    # a SIGTERM during the second step waited 10 s (3x the longest step timed: none yet), then ended the process
    # unsaved as if a peer hung: a large model's step on a few GPUs is longer than that
    from llmpy.trainer import CPUBackend
    rng = np.random.default_rng()
    write_shard(tmp_path / "t_train_000000.bin", rng.integers(0, 257, 3000))
    depths = []
    original = CPUBackend.train_step

    def recording(self, *args, **kwargs):
        depths.append(distributed._patient_depth)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(CPUBackend, "train_step", recording)
    train(TrainOptions(train_data=str(tmp_path / "t_train_*.bin"), model="layers=1,channels=16,heads=2,seq=16,"
                       "vocab=257", batch_size=2, seq_len=16, max_steps=4, val_every=0, gen_tokens=0, progress=0,
                       device="cpu"), log=lambda _line: None)
    assert depths == [1, 1, 0, 0]


@pytest.mark.parametrize("env, gpus, picked, message", [
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 1, 0, None),  # each process shown its own GPU: that one
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 2, None,
     "LOCAL_RANK=3 but this node has 2 GPU(s): --nproc_per_node must be at most the GPU count"),
    ({"RANK": "9", "WORLD_SIZE": "16"}, 8, None,  # no LOCAL_RANK: the message named a variable never set
     "RANK (no LOCAL_RANK given)=9 but this node has 8 GPU(s): --nproc_per_node must be at most the GPU count")],
    ids=["one-visible-gpu", "too-few-gpus", "no-local-rank"])
def test_the_gpu_a_process_takes(monkeypatch, env, gpus, picked, message):
    import torch.distributed as dist
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    chosen = []

    class Joined(Exception):
        pass

    def set_device(index):
        chosen.append(index)
        raise Joined  # stop before the group forms: the choice is what is tested
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    if message is None:
        with pytest.raises(Joined):
            distributed.init_data_parallel("cuda", 0)
        assert chosen == [picked]
    else:
        with pytest.raises(LlmpyError) as e:
            distributed.init_data_parallel("cuda", 0)
        assert str(e.value) == message and chosen == []
