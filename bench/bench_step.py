"""Whole-step benchmark: GPT-2 training steps of llmpy side by side with the PyTorch baseline.

    PYTHONPATH=src:. python -m bench.bench_step [--systems torch-compile,llmpy] [--model d12] \
        [--B 64] [--T 1024] [--steps 40] [--warmup-median-from 11] [--json out.json]

Every system trains the same model from the same start: llm.c's random init (`init.init_parameters`,
seed --seed) and the same fresh random token batches (seed --data-seed), no gradient accumulation,
constant learning rate, AdamW, clipping at --grad-clip. Systems:

  torch-compile  bench/torch_gpt2.py (nn.Module, SDPA flash, bf16 autocast, fused AdamW) + torch.compile
  torch-eager    the same without torch.compile
  llmpy          llmpy.model.GPT2Model (Triton kernels, cuBLASLt, CUDA graph)
  llmc           llm.c's train_gpt2cu (cuDNN attention, bf16, fp32 master weights, -r from --recompute, else
                 llm.c's default 1), built from a checkout of llm.c by bench/llmc.py (not part of this tree;
                 see there); --model d12 --seed 42 only

Each system runs in its own subprocess, so the peak memory is its own and no compile cache is shared;
by default each gets fresh, empty TorchInductor/Triton cache directories (a cold start); --cache-dir DIR
keeps them in DIR (run twice for a warm start). Per system: median ms of steps
--warmup-median-from..--steps, tokens/s, MFU (llm.c's formula: config.flops_per_token(T) FLOPs a token
against --peak-tflops, 989 for H100/H200 bf16 dense), peak memory (torch.cuda.max_memory_allocated and
the device's used memory from cudaMemGetInfo), the first step's time (compile / kernel JIT / graph
capture included) and the time from the subprocess's spawn to the end of the first step. The losses of
the first steps are printed side by side: same init and data, so they must agree closely.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from llmpy.config import ConfigError, parse_descriptor

_IMPORT_TIME = time.time()  # the in-process stand-in for the spawn time (tests, --child without parent)
REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("torch-compile", "torch-eager", "llmpy", "llmc")
DEFAULT_SYSTEMS = "torch-compile,llmpy"
GB = 1e9

# measured 2026-11-30 on one H200 (shared/ANCHORS.md), printed under the table for scale
ANCHORS = {
    "llm.c cuDNN -r 0": {"ms": 112.3, "mem_gb": 27.9},
    "llm.c cuDNN -r 1": {"ms": 113.6, "mem_gb": 23.7},
    "torch.compile + SDPA flash": {"ms": 129.4, "mem_gb": 35.5},
    "torch eager + SDPA flash": {"ms": 372.1, "mem_gb": 81.9},
    "target": {"ms": 100.0, "mem_gb": 24.0},
}


def make_output_folders(*paths) -> None:
    """The folders of the output files asked for (None: not asked), made before any measuring: a bad path fails
    now, not after minutes of benchmarking."""
    for path in paths:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)


def check_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, least: dict):
    """One usage line, before any GPU work, for an option below its least value (least: option name -> value), a
    --model that is no descriptor or a --T beyond its context; returns the model's config."""
    for name, lo in least.items():
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be at least {lo}")
    try:
        config = parse_descriptor(args.model)
    except ConfigError as e:
        ap.error(f"--model {args.model}: {e}")
    if args.T > config.max_seq_len:
        ap.error(f"--T {args.T} is longer than the model's context {config.max_seq_len}")
    return config


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_step", description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--model", default="d12", help="llm.c model descriptor (d12, layers=2,channels=32,...)")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-median-from", type=int, default=11,
                    help="the median step time is over steps N..--steps (1-based)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42, help="seed of llm.c's random init (and llmpy's model seed)")
    ap.add_argument("--data-seed", type=int, default=1337, help="seed of the random token batches")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H100/H200: 989)")
    ap.add_argument("--print-steps", type=int, default=10, help="steps whose loss is printed side by side")
    ap.add_argument("--json", default=None, help="write every figure (and per-step times/losses) here")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only runs the torch systems (a smoke test)")
    ap.add_argument("--cache-dir", default=None,
                    help="keep TorchInductor/Triton caches here (default: fresh empty ones, a cold start)")
    ap.add_argument("--child-timeout", type=float, default=480.0, help="seconds a system may take in all")
    # the torch baseline
    ap.add_argument("--sdpa", default="flash", choices=("flash", "cudnn", "efficient", "math", "default"),
                    help="SDPA backend of the torch systems")
    # llmpy's options (passed to GPT2Model only when given, except those with a default here)
    ap.add_argument("--recompute", type=int, default=None, help="llmpy: llm.c's -r (0, 1, 2)")
    ap.add_argument("--attention", default="auto", help="llmpy: attention path")
    add_model_switches(ap)
    ap.add_argument("--untuned", action="store_true",
                    help="llmpy: every cuBLASLt product with its first-ranked algorithm (empty TUNED_ALGOS)")
    ap.add_argument("--tuned-from", default=None,
                    help="llmpy: TUNED_ALGOS replaced by the table a bench_cublaslt or search_cublaslt --json "
                         "file suggests")
    ap.add_argument("--no-graph", action="store_true", help="llmpy: no CUDA graph")
    ap.add_argument("--classifier-config", default=None,
                    help="llmpy: JSON of fused_classifier keywords replacing its TRAIN_CONFIG and VAL_CONFIG "
                         "(validation keeps training's reduction order), e.g. '{\"variant\": \"onepass\"}'")
    ap.add_argument("--llmc-binary", default=str(REPO / ".llmc" / "train_gpt2cu"),
                    help="llmc: llm.c's train_gpt2cu (python -m bench.llmc build)")
    ap.add_argument("--llmc-gelu-fusion", type=int, default=None, choices=(0, 1, 2),
                    help="llmc: llm.c's -ge (default: llm.c's own, 0 in the checkout we build)")
    ap.add_argument("--flash-config", default=None,
                    help='llmpy: JSON of flash attention tile fields to override, e.g. \'{"bwd_schedule": "fused"}\'')
    # internal: one system in this process, its result to a file
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spawn-time", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.system_list if s not in SYSTEMS]
    if bad or not args.system_list:
        ap.error(f"--systems: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(SYSTEMS)}")
    twice = [s for i, s in enumerate(args.system_list) if s in args.system_list[:i]]
    if twice:  # the results are keyed by system: one of the runs would be dropped unseen
        ap.error(f"--systems: {twice[0]} named twice")
    if args.child is not None and args.child not in SYSTEMS:
        ap.error(f"--child: unknown system {args.child}")
    check_sizes(ap, args, {"B": 1, "T": 1, "steps": 1, "warmup_median_from": 1})
    if not args.peak_tflops > 0:
        ap.error("--peak-tflops must be above 0")
    if "llmc" in args.system_list + [args.child] and (args.model != "d12" or args.seed != 42):
        ap.error("--systems llmc: llm.c's random init is -e d12 with its seed 42: --model d12 --seed 42 only")
    return args


def add_model_switches(ap: argparse.ArgumentParser) -> None:
    """The GPT2Model switches bench_step and profile_step share (model_switches reads them back)."""
    ap.add_argument("--gelu-fusion", type=int, default=None, help="llmpy: llm.c's -ge; model default if not given")
    ap.add_argument("--cublaslt", default=None, choices=("on", "off"),
                    help="llmpy: -ge 1/2's epilogues and the tuned products through cuBLASLt (default: where it binds)")
    ap.add_argument("--proj-bias-in-ln", default=None, choices=("on", "off"),
                    help="llmpy: attproj/fcproj bias gradients summed in the LayerNorm backward "
                         "(proj_bias_in_layernorm; model default: on)")
    ap.add_argument("--fc-bias-in-product", default=None, choices=("on", "off"),
                    help="llmpy: fc's bias gradient from its weight-gradient product, or a reduction pass of its "
                         "own (fc_bias_in_product; model default: on at -ge 2)")
    ap.add_argument("--residual-in-product", action="store_true",
                    help="llmpy: the residual add in the projections' product (residual_in_product)")
    ap.add_argument("--classifier-chunks", type=int, default=None,
                    help="llmpy: the logits in this many chunks of rows (model default: at most 1 GiB a chunk)")
    ap.add_argument("--overlap-weight-grads", default=None, choices=("off", "on", "priority"),
                    help="llmpy: the backward's weight and bias gradients on a second stream "
                         "(overlap_weight_grads; priority: the input-gradient chain first; model default: off)")
    # switches of the kernel modules (module constants, set by set_kernel_switches)
    ap.add_argument("--bias-in-product", action="store_true",
                    help="llmpy: bias gradients by cuBLASLt's BGRADB, not our reduction (BIAS_GRAD_IN_PRODUCT)")
    ap.add_argument("--ln-proj-chunks", type=_at_least_one, default=None,
                    help="llmpy: row chunks of the LayerNorm backward that sums a projection's bias "
                         "(layernorm.LN_BACKWARD_PROJ_CHUNKS)")
    ap.add_argument("--ln-proj-pieces", type=int, default=None, choices=(1, 3),
                    help="llmpy: the LayerNorm backward that sums a projection's bias takes a row as 1 tile "
                         "or 3 (layernorm.BWD_PIECES_PROJ)")
    ap.add_argument("--ln-forward-pieces", type=int, default=None, choices=(1, 3),
                    help="llmpy: both LayerNorm forwards take a row as 1 tile or 3 (layernorm.FWD_PIECES)")
    ap.add_argument("--qkv-bias-full-pass", action="store_true",
                    help="llmpy: the QKV bias gradient by one reduction over all of dqkv, as llm.c, not from "
                         "attention's identities (matmul.QKV_BIAS_FROM_IDENTITIES = False)")
    ap.add_argument("--cublaslt-workspace-mib", type=_at_least_one, default=None,
                    help="llmpy: cuBLASLt's workspace in MiB (cublaslt.set_workspace_bytes; default 32, llm.c's): "
                         "room for the fp32 partial sums of a split-K configuration in a --tuned-from table")
    ap.add_argument("--q-sums-from-attention", default=None, choices=("on", "off"),
                    help="llmpy: the QKV bias gradient's query part from the column sums the Triton attention "
                         "backward makes as it writes dq, or a pass over dq (matmul.QKV_QUERY_SUMS_FROM_ATTENTION; "
                         "default: on)")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def set_kernel_switches(args) -> None:
    """Set the kernel modules' constants that add_model_switches' module flags name (before the model is built:
    some are read when it plans its buffers)."""
    from llmpy.kernels import cublaslt, layernorm, matmul
    if args.cublaslt_workspace_mib is not None:  # before the first product allocates the workspace
        cublaslt.set_workspace_bytes(args.cublaslt_workspace_mib << 20)
    if args.bias_in_product:
        matmul.BIAS_GRAD_IN_PRODUCT = True
    if args.ln_proj_chunks is not None:  # read when the model sizes its ln_scratch and at every backward
        layernorm.LN_BACKWARD_PROJ_CHUNKS = args.ln_proj_chunks
    if args.ln_proj_pieces is not None:  # read at every backward
        layernorm.BWD_PIECES_PROJ = args.ln_proj_pieces
    if args.ln_forward_pieces is not None:  # read at every forward
        layernorm.FWD_PIECES = args.ln_forward_pieces
    if args.qkv_bias_full_pass:
        matmul.QKV_BIAS_FROM_IDENTITIES = False
    if args.q_sums_from_attention is not None:  # read when the model plans its buffers
        matmul.QKV_QUERY_SUMS_FROM_ATTENTION = args.q_sums_from_attention == "on"


def model_switches(args) -> dict:
    """GPT2Model keyword arguments from add_model_switches' flags: only those given (model defaults else)."""
    opts = {}
    if args.gelu_fusion is not None:
        opts["gelu_fusion"] = args.gelu_fusion
    if args.cublaslt is not None:
        opts["use_cublaslt"] = args.cublaslt == "on"
    if args.proj_bias_in_ln is not None:
        opts["proj_bias_in_layernorm"] = args.proj_bias_in_ln == "on"
    if args.residual_in_product:
        opts["residual_in_product"] = True
    if args.fc_bias_in_product is not None:
        opts["fc_bias_in_product"] = args.fc_bias_in_product == "on"
    if args.overlap_weight_grads is not None:
        opts["overlap_weight_grads"] = args.overlap_weight_grads
    if args.classifier_chunks is not None:
        opts["classifier_chunks"] = args.classifier_chunks
    return opts


def llmpy_options(args) -> dict:
    """The keyword arguments GPT2Model gets besides config, params, B, T."""
    opts = {"master_weights": True, "attention": args.attention, "seed": args.seed,
            "cuda_graph": not args.no_graph}
    if args.recompute is not None:
        opts["recompute"] = args.recompute
    opts.update(model_switches(args))
    return opts


def set_flash_config(text: str | None, config) -> None:
    """--flash-config: override fields of the flash attention tile table at the model's head size."""
    if text:
        import json
        from llmpy.kernels.flash_attention import FLASH_CONFIGS
        FLASH_CONFIGS[config.channels // config.num_heads] = json.loads(text)


# ----------------------------------------------------------------------------------------------------
# one system, in this process

def make_batches(vocab_size: int, B: int, T: int, steps: int, seed: int, pin: bool = False):
    """`steps` fresh batches of random token ids in [0, vocab): each a (B*T+1)-token stream cut into
    inputs and next-token targets as llm.c's loader does; int64 CPU tensors of shape (B, T)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        buf = torch.randint(0, vocab_size, (B * T + 1,), generator=g, dtype=torch.int64)
        if pin:
            buf = buf.pin_memory()
        batches.append((buf[:-1].view(B, T), buf[1:].view(B, T)))
    return batches


def _set_sdpa_backend(torch, name: str) -> None:
    """Allow only the chosen SDPA backend (global flags, so eager and torch.compile's trace both see it)."""
    if name == "default":
        return
    cuda = torch.backends.cuda
    cuda.enable_flash_sdp(name == "flash")
    cuda.enable_mem_efficient_sdp(name == "efficient")
    cuda.enable_math_sdp(name == "math")
    if hasattr(cuda, "enable_cudnn_sdp"):
        cuda.enable_cudnn_sdp(name == "cudnn")


def _build_torch(args, config, flat, compiled: bool):
    import torch
    from bench.torch_gpt2 import TorchTrainer, from_flat
    if args.device.startswith("cuda"):
        _set_sdpa_backend(torch, args.sdpa)
    module = from_flat(config, flat, device=args.device)
    model = torch.compile(module) if compiled else module  # mode default: max-autotune would take far longer
    trainer = TorchTrainer(module, model, lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip)
    return lambda step, batch: trainer.step(batch[0], batch[1], lr=args.lr)


def tuned_entries(table: dict) -> dict:
    """kernels.matmul.TUNED_ALGOS entries from a --tuned-from file (bench_cublaslt's or search_cublaslt's
    JSON): each names a rank in cuBLASLt's heuristic list or a whole configuration (an AlgoConfig)."""
    from llmpy.kernels.cublaslt import AlgoConfig
    capability = tuple(table["capability"])
    return {(*entry["key"], capability): AlgoConfig(**entry["config"]) if "config" in entry else entry["rank"]
            for entry in table["tuned"]}


def _build_llmpy(args, config, flat):
    import torch
    from llmpy.model import GPT2Model
    set_flash_config(args.flash_config, config)
    if args.classifier_config:
        from llmpy.kernels import fused_classifier as kfc
        chosen = json.loads(args.classifier_config)
        for mode in (kfc.TRAIN_CONFIG, kfc.VAL_CONFIG):
            mode.clear()
            mode.update(chosen)
    if args.untuned or args.tuned_from:
        from llmpy.kernels.matmul import TUNED_ALGOS
        TUNED_ALGOS.clear()
        if args.tuned_from:
            with open(args.tuned_from) as f:
                suggested = json.load(f)
            TUNED_ALGOS.update(tuned_entries(suggested))
            print(f"TUNED_ALGOS from {args.tuned_from}: {TUNED_ALGOS}", file=sys.stderr)
    set_kernel_switches(args)
    model = GPT2Model(config, flat, args.B, args.T, device=args.device, dtype=torch.bfloat16, **llmpy_options(args))
    # llm.c's AdamW step counter starts at 1 (gpt2_update(..., step + 1))
    return lambda step, batch: model.train_step([batch], args.lr, step, args.weight_decay, args.grad_clip)


def _used_bytes(torch) -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _energy_counter():
    """bench.energy's NVML counter, or None where NVML is missing (the figures are extra, never needed)."""
    try:
        import torch

        from bench.energy import EnergyCounter
        return EnergyCounter(torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001
        print(f"no energy figures: {type(e).__name__}: {e}", flush=True)
        return None


def _window_start(counter, res: dict) -> dict:
    """Open the median window's NVML reading (the energy counter, time, throttle counters; the die's
    temperature into res): what _window_end needs."""
    res["celsius_at_window"] = [counter.temperature_c()]
    return {"mj": counter.millijoules(), "t": time.perf_counter(), "throttled": counter.throttled_ms()}


def _window_end(counter, start: dict, steps: int, res: dict) -> None:
    """Close it over `steps` steps: joules a step and mean power (the step runs at the 700 W cap: run I), the
    temperature and SM clock after it, and the share of it the clock was held down by each limit."""
    joules, secs = (counter.millijoules() - start["mj"]) * 1e-3, time.perf_counter() - start["t"]
    res["joules_per_step"] = joules / steps
    res["watts"] = joules / secs
    res["celsius_at_window"].append(counter.temperature_c())
    res["sm_mhz_at_end"] = counter.sm_clock_mhz()
    throttled = counter.throttled_ms()
    if start["throttled"] is not None and throttled is not None:
        res["throttled_share"] = {k: (throttled[k] - start["throttled"][k]) / (secs * 1e3) for k in throttled}


def _record_step(res: dict, args, system: str, counter, i: int, ms: float, loss: float, norm: float,
                 t_spawn: float) -> None:
    """Step i's figures into res (its time, loss, norm; the SM clock after it: the power cap's swings move
    slow steps) and its log line, for every system alike."""
    if i == 0:
        res["time_to_first_step_s"] = time.time() - t_spawn
    res["step_ms"].append(ms)
    res["losses"].append(loss)
    res["norms"].append(norm)
    if counter is not None:
        res.setdefault("step_sm_mhz", []).append(counter.sm_clock_mhz())
        res.setdefault("step_clock_reasons", []).append(counter.clock_event_reasons())
    if not math.isfinite(loss):
        res["nonfinite_loss_step"] = res.get("nonfinite_loss_step", i + 1)
    if i < args.print_steps or (i + 1) % 10 == 0 or i + 1 == args.steps:
        print(f"[{system}] step {i + 1:3d}/{args.steps} | loss {loss:.6f} | norm {norm:.4f} | {ms:9.1f} ms",
              flush=True)


def _write(path, obj) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)


def run_system(args, system: str) -> dict:
    """Train `args.steps` steps of `system` here; returns the raw result (summarize() adds the figures).
    The result file is rewritten after every step, so a timeout still leaves the steps done so far."""
    import torch
    t_spawn = args.spawn_time if args.spawn_time is not None else _IMPORT_TIME
    cuda = args.device.startswith("cuda")
    res = {"system": system, "ok": False, "error": None, "device": args.device, "torch": torch.__version__,
           "step_ms": [], "losses": [], "norms": [], "import_s": time.time() - t_spawn}
    if system == "llmc":
        res["options"] = {"binary": args.llmc_binary, "recompute": args.recompute, "gelu_fusion": args.llmc_gelu_fusion}
        return _run_llmc(args, res)
    if system == "llmpy":
        res["options"] = llmpy_options(args)
    else:
        res["options"] = {"compile": system == "torch-compile", "sdpa": args.sdpa if cuda else "n/a",
                          "autocast": "bf16" if cuda else "off", "fused_adamw": cuda}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:  # the CPU smoke run may lack triton
        res["triton"] = None
    try:
        if cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda but no CUDA device here")
            res["device_name"] = torch.cuda.get_device_name()
            torch.cuda.init()
            res["used_at_start_bytes"] = _used_bytes(torch)  # the CUDA context and whatever else is there
            torch.cuda.reset_peak_memory_stats()
        config = parse_descriptor(args.model)
        t = time.perf_counter()
        from llmpy.init import init_parameters
        flat = init_parameters(config, args.seed)
        res["init_s"] = time.perf_counter() - t
        batches = make_batches(config.vocab_size, args.B, args.T, args.steps, args.data_seed, pin=cuda)
        t = time.perf_counter()
        if system == "llmpy":
            step_fn = _build_llmpy(args, config, flat)
        else:
            step_fn = _build_torch(args, config, flat, compiled=system == "torch-compile")
        if cuda:
            torch.cuda.synchronize()
        res["build_s"] = time.perf_counter() - t
        used = []
        counter = _energy_counter() if cuda else None
        lo = args.warmup_median_from - 1
        for i in range(args.steps):
            if counter is not None and i == lo:
                window = _window_start(counter, res)
            t0 = time.perf_counter()
            loss, norm = step_fn(i + 1, batches[i])
            loss, norm = float(loss), float(norm)  # reading the loss waits for the step, as llm.c's log does
            if cuda:
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if cuda and i in (0, args.warmup_median_from - 1, args.steps - 1):
                used.append(_used_bytes(torch))
            _record_step(res, args, system, counter, i, ms, loss, norm, t_spawn)
            if cuda:
                res["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
                res["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
                res["device_used_bytes"] = max(used) if used else None
            _write(args.result_file, res)
        if counter is not None and args.steps > lo:
            _window_end(counter, window, args.steps - lo, res)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 -- the parent reports it; KeyboardInterrupt too
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], file=sys.stderr, flush=True)
    _write(args.result_file, res)
    return res


def _run_llmc(args, res: dict) -> dict:
    """run_system for llm.c: its binary trains on the same batches in a subprocess of this one; the step
    lines it prints give the times, losses and norms, NVML the energy, clock and used memory."""
    from bench import llmc
    t_spawn = args.spawn_time if args.spawn_time is not None else _IMPORT_TIME
    lo = args.warmup_median_from - 1
    counter = None
    try:
        binary = Path(args.llmc_binary)
        llmc.check_binary(binary)
        res["options"]["libraries"] = llmc.resolved_libraries(binary)  # which cuBLAS and cuDNN it ran on
        counter = _energy_counter()
        config = parse_descriptor(args.model)
        batches = make_batches(config.vocab_size, args.B, args.T, args.steps, args.data_seed)
        if counter is not None:
            res["used_at_start_bytes"] = counter.memory_used_bytes()  # this process, before llm.c starts
        used, window = [], None

        def on_step(step: dict):
            nonlocal window
            i = step["step"] - 1
            _record_step(res, args, "llmc", counter, i, step["ms"], step["loss"], step["norm"], t_spawn)
            if counter is not None:
                if i in (0, lo - 1, args.steps - 1):
                    used.append(counter.memory_used_bytes() - res["used_at_start_bytes"])
                    res["device_used_bytes"] = max(used)
                if i == lo - 1:  # the step before the window has ended: it starts here (no figures if lo is 0)
                    window = _window_start(counter, res)
                if i == args.steps - 1 and window is not None:
                    _window_end(counter, window, args.steps - lo, res)
            _write(args.result_file, res)

        with tempfile.TemporaryDirectory(prefix="bench_step_llmc_") as work:
            def echo(line: str):  # llm.c's own lines (settings, allocations, validation) to the log, marked
                if llmc.parse_step_line(line) is None:
                    print(f"[llmc-out] {line.rstrip()}", flush=True)

            llmc.train(binary, batches, args.B, args.T, args.lr, args.weight_decay, args.recompute,
                       args.llmc_gelu_fusion, Path(work), on_step, echo=echo)
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 -- the parent reports it in one line
        res["error"] = f"{type(e).__name__}: {e}"
        print(res["error"], file=sys.stderr, flush=True)
    _write(args.result_file, res)
    return res


# ----------------------------------------------------------------------------------------------------
# the figures and the tables

def median_window(steps: int, args) -> list[int] | None:
    """[first, last] 1-based steps whose median summarize takes from a run of `steps` steps: from
    --warmup-median-from on; with no step that far, all but the first (best effort), or the one step."""
    if steps < 1:
        return None
    lo = args.warmup_median_from
    return [lo, steps] if steps >= lo else [min(2, steps), steps]


def summarize(res: dict, args) -> dict:
    """Add the derived figures to a system's raw result (in place; returns it)."""
    config = parse_descriptor(args.model)
    ms = res.get("step_ms") or []
    res["median_steps"] = median_window(len(ms), args)
    window = ms[res["median_steps"][0] - 1:] if ms else []
    if not window:
        res.update(median_ms=None, tokens_per_s=None, mfu=None, compile_s=None, first_step_s=None)
        return res
    med = statistics.median(window)
    tokens = args.B * args.T
    res["median_ms"] = med
    res["min_ms"] = min(window)
    # lower quartile: a step's time with the power cap's slow spells left out (bench.ab_step compares it too)
    # ("exclusive", the default, extrapolates below the fastest step for a window of two: "inclusive" there)
    method = "exclusive" if len(window) >= 3 else "inclusive"
    res["p25_ms"] = statistics.quantiles(window, n=4, method=method)[0] if len(window) >= 2 else med
    res["max_ms"] = max(window)
    res["tokens_per_s"] = tokens / (med * 1e-3)
    res["mfu"] = config.flops_per_token(args.T) * res["tokens_per_s"] / (args.peak_tflops * 1e12)
    res["first_step_s"] = ms[0] * 1e-3
    # what the first step spent beyond a normal one: torch.compile's compile, Triton's JIT, graph capture
    res["compile_s"] = max(0.0, (ms[0] - med) * 1e-3)
    res["completed_steps"] = len(ms)
    return res


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    """v * scale formatted by spec, or '-' padded to the spec's width when there is no value."""
    if v is None:
        width = "".join(itertools.takewhile(str.isdigit, spec.lstrip("<>^")))
        return "-".rjust(int(width or 0))
    return format(v * scale, spec)


def card_state(r: dict) -> str:
    """', 41->47 C, 1755 MHz, held by power 97 % / thermal 0 %': the die's temperature over the median window,
    the SM clock after it, and the share of the window NVML counts the clock held down by each limit."""
    temps = r.get("celsius_at_window") or []
    text = f", {temps[0]}->{temps[-1]} C" if len(temps) == 2 else ""
    text += f", {r['sm_mhz_at_end']} MHz" if r.get("sm_mhz_at_end") is not None else ""
    held = r.get("throttled_share")
    if held:
        text += f", held by power {held['power'] * 100:.0f} % / thermal {held['thermal'] * 100:.0f} %"
    return text


def format_table(results: dict, args) -> str:
    """The final comparison: one row per system."""
    lo = args.warmup_median_from
    asked = median_window(args.steps, args)
    base = results.get("torch-compile", {}).get("median_ms")
    hdr = (f"{'system':14s} {'ms/step':>9s} {'tok/s':>10s} {'MFU':>6s} {'vs tc':>6s} {'alloc GB':>9s} "
           f"{'used GB':>8s} {'step1 s':>8s} {'compile s':>9s} {'start->1 s':>10s}  status")
    window = f"{asked[0]}..{asked[1]}" if asked else "-"
    if asked and asked[0] != lo:
        window += f" (--steps {args.steps} ends before --warmup-median-from {lo})"
    lines = [f"median of steps {window}, B={args.B} T={args.T} ({args.B * args.T} tokens/step), "
             f"model {args.model}, MFU against {args.peak_tflops:g} TFLOP/s; GB = 1e9 bytes; "
             f"'vs tc' = torch-compile's ms / this system's ms", hdr, "-" * len(hdr)]
    for name, r in results.items():
        med = r.get("median_ms")
        speed = f"{base / med:.2f}x" if base and med else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        if r.get("ok"):
            status = "ok"
        else:
            status = f"FAILED ({r.get('error') or 'no result'})"[:80]
            if r.get("step_ms"):
                status += f" after {len(r['step_ms'])} steps"
        if r.get("nonfinite_loss_step"):
            status += f"; non-finite loss at step {r['nonfinite_loss_step']}"
        if r.get("median_steps") and r["median_steps"] != asked:
            status += f"; median of steps {r['median_steps'][0]}..{r['median_steps'][1]} only"
        lines.append(
            f"{name:14s} {_fmt(med, '9.1f')} {_fmt(r.get('tokens_per_s'), '10,.0f')} "
            f"{mfu:>6s} {speed:>6s} "
            f"{_fmt(r.get('peak_allocated_bytes'), '9.1f', 1 / GB)} {_fmt(r.get('device_used_bytes'), '8.1f', 1 / GB)} "
            f"{_fmt(r.get('first_step_s'), '8.1f')} {_fmt(r.get('compile_s'), '9.1f')} "
            f"{_fmt(r.get('time_to_first_step_s'), '10.1f')}  {status}")
    llmc_ms = results.get("llmc", {}).get("median_ms")
    if llmc_ms:
        # the issue-5 goal is 1.12x llm.c on the same card: the ratio measured in this run
        lines.append("vs llm.c (llm.c's ms / this system's ms, this run): " + ", ".join(
            f"{name} {llmc_ms / r['median_ms']:.2f}x" for name, r in results.items()
            if name != "llmc" and r.get("median_ms")))
    energy = [f"{name} {r['joules_per_step']:.1f} J/step at {r['watts']:.0f} W{card_state(r)}"
              for name, r in results.items() if r.get("joules_per_step") is not None]
    if energy:
        lines.append(f"energy (NVML, steps {lo}..{args.steps}): " + "; ".join(energy))
    lines.append("anchors (H200, shared/ANCHORS.md): " + "; ".join(
        f"{k} {v['ms']:.1f} ms, {v['mem_gb']:.1f} GB" for k, v in ANCHORS.items()))
    return "\n".join(lines)


def format_losses(results: dict, n: int) -> str:
    """The losses (and gradient norms) of the first n steps, one column per system; then, for each other
    system, the largest loss difference from the first one over EVERY step both ran (same init, same
    data: small, from bf16 rounding; the 100 ms issue's acceptance reads it over 40 steps)."""
    names = [k for k, r in results.items() if r.get("losses")]
    if not names:
        return "(no losses)"
    n = min(n, max(len(results[k]["losses"]) for k in names))
    hdr = f"{'step':>4s} " + " ".join(f"{k + ' loss':>20s} {'norm':>8s}" for k in names)
    lines = [hdr]
    for i in range(n):
        cells = []
        for k in names:
            L, N = results[k]["losses"], results[k].get("norms") or []
            cells.append(f"{L[i]:20.6f} {N[i]:8.4f}" if i < len(L) and i < len(N) else f"{'-':>20s} {'-':>8s}")
        lines.append(f"{i + 1:4d} " + " ".join(cells))
    # the acceptance check reads every step both systems ran (40), not only the printed ones
    ref = results[names[0]]["losses"]
    for k in names[1:]:
        other = results[k]["losses"]
        m = min(len(ref), len(other))
        if not m:
            continue
        diffs = [abs(a - b) for a, b in zip(ref[:m], other[:m])]
        bad = [i + 1 for i, d in enumerate(diffs) if not math.isfinite(d)]
        if bad:
            lines.append(f"max |loss({k}) - loss({names[0]})| over steps 1..{m}: not finite from step {bad[0]}")
            continue
        worst = max(range(m), key=diffs.__getitem__)
        lines.append(f"max |loss({k}) - loss({names[0]})| over steps 1..{m}: {diffs[worst]:.2e} at step "
                     f"{worst + 1} ({diffs[worst] / max(abs(ref[worst]), 1e-30):.1e} of the loss)")
    return "\n".join(lines)


def json_safe(obj):
    """obj with every non-finite float (a NaN loss, an infinite norm) as None: json.dump would write them as
    NaN / Infinity, which JSON does not have (strict readers refuse the file)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _git() -> dict:
    def q(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    return {"commit": q("rev-parse", "HEAD") or None, "dirty": bool(q("status", "--porcelain", "--untracked-files=no"))}


def build_report(results: dict, args, argv) -> dict:
    config = parse_descriptor(args.model)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_git(),
        "command": "python -m bench.bench_step " + " ".join(argv),
        "settings": {
            "model": args.model, "config": config.describe(), "num_parameters": config.num_parameters,
            "B": args.B, "T": args.T, "tokens_per_step": args.B * args.T, "steps": args.steps,
            "median_from_step": args.warmup_median_from, "lr": args.lr, "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip, "seed": args.seed, "data_seed": args.data_seed,
            "flops_per_token": config.flops_per_token(args.T), "peak_flops": args.peak_tflops * 1e12,
            "cache": args.cache_dir or "cold (fresh cache directories)", "device": args.device,
            "sdpa": args.sdpa, "llmpy_options": llmpy_options(args),
        },
        "anchors": ANCHORS,
        "results": results,
    }


# ----------------------------------------------------------------------------------------------------
# the parent: one subprocess per system

def run_child_process(system: str, args, argv) -> dict:
    """Run one system in a fresh Python process (own CUDA context, own caches); its result comes back
    through a JSON file. Killed with its whole process group (torch.compile's workers) on timeout."""
    work = Path(tempfile.mkdtemp(prefix=f"bench_step_{system}_"))
    result_file = work / "result.json"
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [str(REPO / "src"), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cache = Path(args.cache_dir) / system if args.cache_dir else work / "cache"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    cmd = [sys.executable, "-m", "bench.bench_step", *argv, "--child", system,
           "--result-file", str(result_file), "--spawn-time", repr(time.time())]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    error = None
    try:
        rc = proc.wait(timeout=args.child_timeout)
        if rc != 0:
            error = f"exit status {rc}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.child_timeout:g} s"
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: it and its compile workers
            except ProcessLookupError:
                pass
            proc.wait()
    try:
        res = json.loads(result_file.read_text())
    except (OSError, ValueError):
        res = {"system": system, "ok": False, "step_ms": [], "losses": [], "norms": []}
    if error:
        res["ok"] = False
        res["error"] = res.get("error") or error
    shutil.rmtree(work, ignore_errors=True)
    if error == "interrupted":
        raise KeyboardInterrupt
    return res


def main(argv=None, runner=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        res = run_system(args, args.child)
        return 0 if res.get("ok") else 1
    runner = runner or run_child_process
    make_output_folders(args.json)
    results = {}
    for system in args.system_list:
        print(f"=== {system}", flush=True)
        t = time.time()
        res = runner(system, args, argv)
        res["wall_s"] = time.time() - t
        results[system] = summarize(res, args)
        r = results[system]
        print(f"=== {system}: {'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))} | "
              f"median {_fmt(r.get('median_ms'), '.1f')} ms | first step {_fmt(r.get('first_step_s'), '.1f')} s "
              f"(compile/warm-up {_fmt(r.get('compile_s'), '.1f')} s) | spawn to first step "
              f"{_fmt(r.get('time_to_first_step_s'), '.1f')} s | wall {r['wall_s']:.0f} s", flush=True)
    print("\n=== losses of the first steps (same init, same data)")
    print(format_losses(results, args.print_steps))
    print("\n=== whole step")
    print(format_table(results, args), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_safe(build_report(results, args, argv)), f, indent=1, allow_nan=False)
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
