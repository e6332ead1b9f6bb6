"""The training loop and `llmpy train`'s flags (llm.c's train_gpt2.cu main, with its one-letter flags).

`llmpy train` with no arguments trains a small model on the embedded default corpus (the running
Python's standard library, byte-level tokens) on the CPU; `-i/-j` point at token shards, `-e` picks
the model. On the CPU the step runs the fp32 reference (`reference.GPT2Reference`); with a GPU it runs
`model.GPT2Model` (Triton kernels, cuBLAS, one CUDA graph a step), bf16 by default.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import numbers
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .config import ATTENTION_IMPLS, GPT2Config, looks_like_a_model_path, parse_descriptor
from .errors import LlmpyError
from .files import NO_LOCKS_ERRNOS, expand_user
from .outliers import OutlierDetector
from .rand import check_seed
from .sampler import check_sampling_options
from .schedulers import SCHEDULES, LRSchedule, check_final_frac

# The embedded default: the model and run that `llmpy train` with no arguments trains on 2 CPU cores
# in about 90 seconds (byte-level tokens, so vocab 257).
DEFAULT_CPU_MODEL = "layers=4,channels=192,heads=4,seq=128,vocab=257"

# --attention: "auto" (kernels.attention.default_attention_impl) or one of the paths
ATTENTION_CHOICES = ("auto",) + ATTENTION_IMPLS


# The options whose default depends on the run: (the default, the demo run on the CPU, the demo run on a GPU).
# The demo run is `llmpy train` without -i and -e: the embedded corpus, on the CPU a small model that trains in
# about 90 seconds on two cores, on a GPU GPT-2 124M (d12). A value given on the command line or to the API
# always wins, even where it equals the default.
RUN_DEFAULTS = {
    "batch_size": (4, 16, 16), "seq_len": (1024, 128, 1024), "learning_rate": (3e-4, 2e-3, 6e-4),
    "final_lr_frac": (1.0, 0.1, 0.1), "warmup_steps": (0, 20, 20), "max_steps": (-1, 300, 200),
    "val_every": (20, 50, 50), "val_max_steps": (20, 8, 8), "sample_every": (20, 0, 0), "gen_tokens": (64, 192, 256),
}


# where `llmpy prepare hellaswag` writes its eval file
_DEFAULT_HELLASWAG_FILE = os.path.join("data", "hellaswag", "hellaswag_val.bin")


@dataclass
class TrainOptions:
    """Every option of a run; the command line maps one flag to one field (llm.c's letters)."""
    train_data: str | None = None          # -i
    val_data: str | None = None            # -j
    model: str | None = None               # -e
    output_dir: str | None = None          # -o
    checkpoint_every: int = 0              # -n
    checkpoints_keep: int = 0              # -nk
    major_checkpoint_every: int = 0        # -nm
    resume: int = 0                        # -y
    batch_size: int | None = None          # -b (None: RUN_DEFAULTS, as the other fields marked so)
    seq_len: int | None = None             # -t (None: RUN_DEFAULTS)
    total_batch_size: int = -1             # -d
    learning_rate: float | None = None     # -l (None: RUN_DEFAULTS)
    final_lr_frac: float | None = None     # -q (None: RUN_DEFAULTS)
    warmup_steps: int | None = None        # -u (None: RUN_DEFAULTS)
    weight_decay: float = 0.0              # -c
    lr_schedule: str = "cosine"            # -k
    max_steps: int | None = None           # -x (None: RUN_DEFAULTS)
    val_every: int | None = None           # -v (None: RUN_DEFAULTS)
    val_max_steps: int | None = None       # -m (None: RUN_DEFAULTS)
    sample_every: int | None = None        # -s (None: RUN_DEFAULTS)
    gen_tokens: int | None = None          # -g (None: RUN_DEFAULTS)
    overfit_single_batch: int = 0          # -a
    tf32: int = 1                          # -f
    master_weights: int = 1                # -w
    recompute: int = 1                     # -r
    gelu_fusion: int = -1                  # -ge
    zero_stage: int = 0                    # -z
    skip_loss_z: float = 0.0               # -sl
    skip_grad_z: float = 0.0               # -sg
    hellaswag: int = 0                     # -h
    hellaswag_file: str = _DEFAULT_HELLASWAG_FILE
    hellaswag_examples: int = 0            # 0: every example of the file
    grad_clip: float = 1.0
    seed: int = 42
    device: str = "auto"
    dtype: str = ""                        # "" = bfloat16 on the GPU, float32 on the CPU
    attention: str = "auto"
    engine: str = "auto"                   # auto: the kernel model on GPUs, the reference on one CPU process
    overlap_reduction: int = 1             # several processes: reduce finished layers during the backward
    cuda_graph: int = 1
    shuffle: int = 0
    temperature: float = 1.0
    top_k: int = 0
    progress: int = -1                     # -1: a bar when stderr is a terminal

    def fill_run_defaults(self, demo: str | None = None):
        """Give each RUN_DEFAULTS field still unset its default: the demo run's on demo = "cpu" or "cuda"."""
        column = {None: 0, "cpu": 1, "cuda": 2}[demo]
        for name, values in RUN_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, values[column])

    def _check_types(self):
        """The API passes values argparse never sees: each must have its flag's type (a float flag takes an int;
        None stands for "unset" where the field's default is None)."""
        unset_ok = {f.name for f in fields(self) if f.default is None}
        for flag, name, typ in OPTION_FLAGS:
            value = getattr(self, name)
            if value is None and name in unset_ok:
                continue
            if typ is str and isinstance(value, os.PathLike):  # train_data=Path(...), output_dir=Path(...)
                setattr(self, name, os.fspath(value))
                continue
            allowed = {int: numbers.Integral, float: numbers.Real, str: str}[typ]  # numpy's numbers too
            if isinstance(value, bool) or not isinstance(value, allowed):
                kind = {int: "an integer", float: "a number", str: "text (a str)"}[typ]
                raise LlmpyError(f"{flag} ({name}={value!r}): must be {kind}")
            try:
                value = typ(value)
            except OverflowError:  # an integer beyond a float's range, say 10**400
                raise LlmpyError(f"{flag} ({name}={str(value)[:20]}...): too large for a number") from None
            setattr(self, name, value)  # numpy's numbers as Python's: the state's JSON takes only those

    def validate(self):
        """One LlmpyError naming the flag for the first impossible value (RUN_DEFAULTS fields still unset take
        their default first)."""
        self.fill_run_defaults()
        self._check_types()
        check_seed(self.seed)
        for name, flag in (("train_data", "-i"), ("val_data", "-j"), ("model", "-e"), ("output_dir", "-o"),
                           ("hellaswag_file", "--hellaswag-file")):
            value = getattr(self, name)
            if value is not None and not value.strip():  # "" is no file: it would read as "." or as "none"
                raise LlmpyError(f"{flag} ({name}={value!r}): an empty name; leave it out for its default")
            if value is not None and "\0" in value:  # the system refuses such names with a ValueError
                raise LlmpyError(f"{flag} ({name}={value!r}): a file name cannot hold a NUL character")
            if value is not None and value.startswith("~"):
                # the home folder, as the shell makes it of a word of its own but not after --name= (nor does
                # the Python API): `llmpy prepare` and the tokenizer folders read ~ so too
                try:
                    setattr(self, name, str(expand_user(value)))
                except LlmpyError as e:
                    raise LlmpyError(f"{flag}: {e}") from None
        if self.output_dir is not None:
            try:
                self.output_dir.encode("utf-8")
            except UnicodeEncodeError:  # TensorBoard's writer and the JSON log need the name as text
                raise LlmpyError(f"-o {os.fsencode(self.output_dir)!r}: the output directory's name must be UTF-8 "
                                 "text") from None
        for name, flag in (("batch_size", "-b"), ("seq_len", "-t")):
            if getattr(self, name) <= 0:
                raise LlmpyError(f"{flag} {getattr(self, name)}: must be positive")
        for name, flag, allowed in (("master_weights", "-w", (0, 1)), ("recompute", "-r", (0, 1, 2)),
                                    ("gelu_fusion", "-ge", (-1, 0, 1, 2)), ("zero_stage", "-z", (0, 1)),
                                    ("resume", "-y", (0, 1)), ("overfit_single_batch", "-a", (0, 1)),
                                    ("tf32", "-f", (0, 1)), ("hellaswag", "-h", (0, 1)),
                                    ("overlap_reduction", "--overlap-reduction", (0, 1))):
            if getattr(self, name) not in allowed:
                raise LlmpyError(f"{flag} {getattr(self, name)}: must be one of {', '.join(map(str, allowed))}")
        if self.lr_schedule not in SCHEDULES:
            raise LlmpyError(f"-k {self.lr_schedule}: unknown schedule; choose one of {', '.join(SCHEDULES)}")
        _check_device(self.device)
        if self.dtype not in ("", "bfloat16", "float32"):
            raise LlmpyError(f"--dtype {self.dtype}: must be bfloat16 or float32")
        if self.engine not in ("auto", "kernels", "reference"):
            raise LlmpyError(f"--engine {self.engine}: must be auto, kernels or reference")
        if self.attention not in ATTENTION_CHOICES:
            raise LlmpyError(f"--attention {self.attention}: must be one of {', '.join(ATTENTION_CHOICES)}")
        for name, flag, allowed in (("progress", "--progress", (-1, 0, 1)), ("shuffle", "--shuffle", (0, 1)),
                                    ("cuda_graph", "--cuda-graph", (0, 1))):
            if getattr(self, name) not in allowed:
                raise LlmpyError(f"{flag} {getattr(self, name)}: must be one of {', '.join(map(str, allowed))}")
        # a NaN passes every comparison below unnoticed, and an infinite rate ends in NaN weights
        for name, flag in (("learning_rate", "-l"), ("final_lr_frac", "-q"), ("weight_decay", "-c"),
                           ("skip_loss_z", "-sl"), ("skip_grad_z", "-sg"), ("grad_clip", "--grad-clip")):
            if not math.isfinite(getattr(self, name)):
                raise LlmpyError(f"{flag} {getattr(self, name)}: must be a finite number")
        for name, flag, zero in (("learning_rate", "-l", ""), ("warmup_steps", "-u", " (0: no warmup)"),
                                 ("grad_clip", "--grad-clip", " (0 turns clipping off)"), ("weight_decay", "-c", ""),
                                 ("skip_loss_z", "-sl", " (0: off)"), ("skip_grad_z", "-sg", " (0: off)"),
                                 ("val_every", "-v", " (0: never)"), ("sample_every", "-s", " (0: only at the end)"),
                                 ("checkpoint_every", "-n", ""), ("checkpoints_keep", "-nk", ""),
                                 ("major_checkpoint_every", "-nm", "")):
            if getattr(self, name) < 0:
                raise LlmpyError(f"{flag} {getattr(self, name)}: must be >= 0{zero}")
        # AdamW's first step moves by lr / (1 - beta1) = 10 lr and decays by lr * wd, in float32 on every path: past
        # its range the CPU reference stopped with a torch traceback and the GPU's weights turned to inf
        f32_max = float(torch.finfo(torch.float32).max)
        if self.learning_rate * 10.0 > f32_max:
            raise LlmpyError(f"-l {self.learning_rate}: too large; AdamW's first step (10 x lr) must fit in float32 "
                             f"(lr at most {f32_max / 10:.3g})")
        if self.learning_rate * self.weight_decay > f32_max:
            raise LlmpyError(f"-c {self.weight_decay}: too large with -l {self.learning_rate}; lr x weight decay must "
                             "fit in float32")
        check_final_frac(self.final_lr_frac)
        check_sampling_options(self.gen_tokens, self.temperature, self.top_k)
        if self.val_max_steps <= 0 and self.val_max_steps != -1:
            raise LlmpyError(f"-m {self.val_max_steps}: must be positive, or -1 for the whole validation split (-v 0 "
                             "turns validation off)")
        if self.max_steps == 0 or self.max_steps < -1:
            raise LlmpyError(f"-x {self.max_steps}: must be positive, or -1 for one epoch of the train data")
        if self.resume and not self.output_dir:
            raise LlmpyError("-y 1 resumes from the output directory: give it with -o")
        if self.hellaswag_examples < 0:
            raise LlmpyError(f"--hellaswag-examples {self.hellaswag_examples}: must be >= 0 (0: all)")
        if self.hellaswag and self.batch_size % 4:
            # the 4 completions of an example share one (B, T) forward; the GPU model is built for B rows
            raise LlmpyError(f"-h 1: -b {self.batch_size} must be a multiple of 4 (HellaSwag scores the 4 "
                             "completions of an example in one batch)")


# ---------------------------------------------------------------------------------------------------
# command line

FLAGS = [  # (short, long, field, type, help)
    ("-i", "--train-data", "train_data", str, "train token shards (glob); default: the embedded stdlib corpus"),
    ("-j", "--val-data", "val_data", str, "validation token shards (glob); default: none (with no -i, the "
                                          "embedded corpus's validation split)"),
    ("-e", "--model", "model", str, "model: dN, gpt2:dN, gpt3:cN, gpt2[-medium|-large|-xl], "
                                    "layers=..,channels=..,heads=.., or a checkpoint file; default: d12 (with no -i "
                                    "on the CPU a small model; with -y the checkpoint's own)"),
    ("-o", "--output-dir", "output_dir", str, "output directory for the log and checkpoints; default: none "
                                              "(nothing written)"),
    ("-n", "--checkpoint-every", "checkpoint_every", int, "write a checkpoint every N steps (0: only at the end)"),
    ("-nk", "--checkpoints-keep", "checkpoints_keep", int, "keep only the last K checkpoints (0: all)"),
    ("-nm", "--major-checkpoint-every", "major_checkpoint_every", int,
     "keep the checkpoints of steps that are multiples of M for ever (llm.c's -nm)"),
    ("-y", "--resume", "resume", int, "1: resume from the latest checkpoint in -o (none there yet: start the run)"),
    ("-b", "--batch-size", "batch_size", int, "micro-batch size B"),
    ("-t", "--seq-len", "seq_len", int, "sequence length T"),
    ("-d", "--total-batch-size", "total_batch_size", int, "tokens per step; sets gradient accumulation (-1: B*T)"),
    ("-l", "--learning-rate", "learning_rate", float, "peak learning rate"),
    ("-q", "--final-lr-frac", "final_lr_frac", float, "final learning rate as a fraction of the peak"),
    ("-u", "--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("-c", "--weight-decay", "weight_decay", float, "AdamW weight decay (2-D tensors only)"),
    ("-k", "--lr-schedule", "lr_schedule", str, f"learning-rate schedule: {', '.join(SCHEDULES)}"),
    ("-x", "--max-steps", "max_steps", int, "number of steps (-1: one epoch of the train data)"),
    ("-v", "--val-every", "val_every", int, "validation loss every N steps (0: never)"),
    ("-m", "--val-max-steps", "val_max_steps", int, "batches per validation (-1: the whole validation split)"),
    ("-s", "--sample-every", "sample_every", int, "print a sample every N steps (0: only at the end)"),
    ("-g", "--gen-tokens", "gen_tokens", int, "tokens per sample"),
    ("-a", "--overfit-single-batch", "overfit_single_batch", int,
     "1: train on one batch only: the validation data's first (the train data's without -j), as llm.c"),
    ("-f", "--tf32", "tf32", int, "1: allow TF32 matrix products in fp32 (GPU)"),
    ("-w", "--master-weights", "master_weights", int, "1: keep fp32 master weights (GPU, bf16)"),
    ("-r", "--recompute", "recompute", int, "0 none, 1 GELU, 2 GELU + layernorm recomputed in the backward (GPU)"),
    ("-ge", "--gelu-fusion", "gelu_fusion", int, "GELU fusion into the matrix products: 0, 1, 2 (-1: per GPU)"),
    ("-z", "--zero-stage", "zero_stage", int, "0: all-reduce, 1: ZeRO-1 sharded optimizer (several GPUs)"),
    ("-sl", "--skip-loss-z", "skip_loss_z", float, "skip the update when the loss z-score is above this (0: off)"),
    ("-sg", "--skip-grad-z", "skip_grad_z", float, "skip the update when the grad-norm z-score is above this (0: off)"),
    ("-h", "--hellaswag", "hellaswag", int, "1: HellaSwag accuracy at each validation"),
]
EXTRA_FLAGS = [  # long-only flags
    ("--grad-clip", "grad_clip", float, "clip the gradient's global norm to this (0: off)"),
    ("--seed", "seed", int, "seed of the model's random init, shuffling and sampling"),
    ("--device", "device", str, "cpu, cuda or auto (cuda when a GPU is visible)"),
    ("--dtype", "dtype", str, "bfloat16 or float32; default: bfloat16 on the GPU (the CPU reference is float32)"),
    ("--attention", "attention", str, "GPU attention: " + ", ".join(ATTENTION_CHOICES)),
    ("--cuda-graph", "cuda_graph", int, "1: capture the whole step in a CUDA graph (GPU)"),
    ("--overlap-reduction", "overlap_reduction", int, "several processes: 1 reduces finished layers during the "
                                                      "backward, 0 after it"),
    ("--engine", "engine", str, "auto, kernels (the Triton model; on the CPU under TRITON_INTERPRET=1, slow) "
                                "or reference (the CPU oracle)"),
    ("--shuffle", "shuffle", int, "1: shuffle shards and batches each epoch"),
    ("--temperature", "temperature", float, "sampling temperature (0: greedy)"),
    ("--top-k", "top_k", int, "sample from the k most likely tokens (0: all)"),
    ("--progress", "progress", int, "1: show a progress bar, 0: not, -1: when stderr is a terminal"),
    ("--hellaswag-file", "hellaswag_file", str, "llm.c HellaSwag eval file for -h 1 (`llmpy prepare hellaswag`)"),
    ("--hellaswag-examples", "hellaswag_examples", int, "-h 1 scores the first N examples (0: all)"),
]
# (flag, TrainOptions field, type) of every option: its one-letter flag where it has one
OPTION_FLAGS = [(f[0], f[2], f[3]) for f in FLAGS] + [(f[0], f[1], f[2]) for f in EXTRA_FLAGS]


def _with_default(help_: str, name: str, default) -> str:
    # a default chosen at run time (None, "") is described in the help text itself, or by RUN_DEFAULTS
    if name in RUN_DEFAULTS:
        usual, cpu, gpu = RUN_DEFAULTS[name]
        demo = f"{cpu}" if cpu == gpu else f"{cpu} on the CPU, {gpu} on a GPU"
        return f"{help_} (default: {usual}; {demo} in the demo run, without -i and -e)"
    return help_ if default in (None, "") else f"{help_} (default: {default})"


def add_arguments(parser: argparse.ArgumentParser):
    parser.description = "Train a GPT-2-family model (llm.c's flags; each also has a long name)."
    defaults = TrainOptions()
    for short, long, name, typ, help_ in FLAGS:
        parser.add_argument(short, long, dest=name, type=typ, default=getattr(defaults, name),
                            help=_with_default(help_, name, getattr(defaults, name)))
    for long, name, typ, help_ in EXTRA_FLAGS:
        parser.add_argument(long, dest=name, type=typ, default=getattr(defaults, name),
                            help=_with_default(help_, name, getattr(defaults, name)))
    parser.add_argument("--help", action="help", help="show this help and exit")


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions) if hasattr(args, f.name)})


def run(args: argparse.Namespace) -> int:
    from .distributed import shutdown
    try:
        result = train(options_from_args(args))
    finally:
        shutdown()  # leave the torchrun group (a no-op in a single process)
    if result.stopped_by is not None:  # the shell's convention for "ended by signal N", after a clean save
        return 128 + int(getattr(signal, result.stopped_by))
    return 0


# ---------------------------------------------------------------------------------------------------
# building the pieces

def _check_device(device) -> None:
    if device not in ("auto", "cpu", "cuda"):
        raise LlmpyError(f"--device {device}: must be auto, cpu or cuda")


def _resolve_device(opts: TrainOptions) -> str:
    _check_device(opts.device)  # the demo run resolves it before validate() runs
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise LlmpyError("--device cuda: no CUDA GPU is visible to torch")
    if opts.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return opts.device


class CPUBackend:
    """The fp32 CPU reference trainer behind the interface the loop uses (GPT2Model's on the GPU)."""

    def __init__(self, config: GPT2Config, params: torch.Tensor):
        from .reference import GPT2Reference
        self.model = GPT2Reference(config, params)
        self.config = config
        self.last_step_skipped = False

    def describe(self) -> str:
        return f"fp32 CPU reference | torch threads {torch.get_num_threads()}"

    def train_step(self, batches, lr, step, weight_decay, grad_clip, skip=None):
        from .reference import clip_scale
        m = self.model
        m.zero_grad()
        loss = 0.0
        for x, y in batches:
            loss += m.forward(x, y)
            m.backward(1.0 / (x.numel() * len(batches)))
        loss /= len(batches)
        norm = m.grad_norm()
        self.last_step_skipped = bool(skip(loss, norm)) if skip is not None else False
        if not self.last_step_skipped and math.isfinite(loss):
            m.update(lr, step, weight_decay=weight_decay, grad_scale=clip_scale(norm, grad_clip))
        return loss, norm

    def validate(self, x, y) -> float:
        return self.model.forward(x, y)

    def position_losses(self, x, y) -> torch.Tensor:
        """(B, T) per-position losses (HellaSwag)."""
        self.model.forward(x, y)
        return self.model.losses

    def next_logits(self, ctx):
        self.model.forward(torch.tensor([ctx]))
        return self.model.logits[0, -1]

    def state_tensors(self, host: bool = True) -> dict:
        """What a resume needs besides the model file: the parameters and AdamW's m, v (zeros before
        the first update, which is what update() would start from). On the CPU already, whatever `host`."""
        m = self.model
        zeros = torch.zeros_like(m.params_flat)
        return {"params": m.params_flat, "m": zeros if m.m_flat is None else m.m_flat,
                "v": zeros.clone() if m.v_flat is None else m.v_flat}

    def seed_state(self):
        return None  # the fp32 reference rounds nothing stochastically

    def load_state(self, tensors: dict, seeds=None):
        m = self.model
        m.params_flat.copy_(tensors["params"].float().reshape(-1))  # in place: the views stay valid
        m.m_flat = tensors["m"].float().reshape(-1).clone()
        m.v_flat = tensors["v"].float().reshape(-1).clone()


class GPUBackend:
    """GPT2Model (Triton kernels, cuBLAS, whole-step CUDA graph) behind the loop's interface."""

    def __init__(self, config: GPT2Config, params: torch.Tensor, opts: "TrainOptions", device: str = "cuda",
                 data_parallel=None):
        from .model import GPT2Model
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[opts.dtype]
        torch.backends.cuda.matmul.allow_tf32 = bool(opts.tf32)
        # device "cpu": the same kernels in Triton's interpreter (several CPU processes under torchrun)
        self.model = GPT2Model(config, params, opts.batch_size, opts.seq_len, device=device, dtype=dtype,
                               master_weights=bool(opts.master_weights), recompute=opts.recompute,
                               gelu_fusion=opts.gelu_fusion, attention=opts.attention, seed=opts.seed,
                               cuda_graph=bool(opts.cuda_graph), data_parallel=data_parallel,
                               overlap_reduction=bool(opts.overlap_reduction))
        self.config = config

    @property
    def last_step_skipped(self) -> bool:
        return self.model.last_step_skipped

    def describe(self) -> str:
        return self.model.describe()

    def train_step(self, batches, lr, step, weight_decay, grad_clip, skip=None):
        return self.model.train_step(batches, lr, step, weight_decay, grad_clip, skip=skip)

    def validate(self, x, y) -> float:
        return self.model.validate(x, y)

    def position_losses(self, x, y) -> torch.Tensor:
        """(B, T) per-position losses (HellaSwag)."""
        self.model.forward(x, y)
        return self.model.position_losses()

    def next_logits(self, ctx):
        return self.model.logits_last(ctx)[0]

    def state_tensors(self, host: bool = True) -> dict:
        """The device's parameter storage in its own dtype (bf16 weights are not the round-to-nearest of
        the master weights: stochastic rounding made them), the fp32 master weights, AdamW's m and v.
        host=False (a rank that writes no checkpoint): the same collectives, but no CPU copies: the
        parameters and master weights stay on the device (for the finiteness check), m and v are left out."""
        md = self.model
        out = {"params": md.params_memory.detach().cpu().clone() if host else md.params_memory.detach()}
        mv = md.optimizer_state(host)  # whole, also under ZeRO-1 (gathered: every rank calls this)
        if mv is not None:
            out["m"], out["v"] = mv
        master = md.master_fp32(host)
        if master is not None:
            out["master"] = master
        return out

    def seed_state(self):
        return self.model.seed_state()

    def load_state(self, tensors: dict, seeds=None):
        md = self.model
        if "master" in tensors and md.master_memory is not None:
            md.load_master(tensors["master"].float())
        params = tensors["params"]
        if params.dtype == md.params_memory.dtype or md.master_memory is None:
            md.params_memory.copy_(params.to(md.params_memory.dtype))
        else:  # saved in another dtype: the working copy follows the master weights
            md.params_memory.copy_(tensors.get("master", params).float())
        md.load_optimizer_state(tensors["m"].float(), tensors["v"].float())
        if seeds is not None:
            md.load_seed_state(seeds)


def _check_model_precision(path: str, run_dtype: str, cpu_reference: bool = False):
    """An llm.c model file must be in the run's precision, as llm.c requires (v3 fp32 for fp32 runs,
    v5 bf16 for bf16 runs); HuggingFace files carry no such contract and are converted."""
    from .checkpoint import MODEL_MAGIC, VERSION_FP32, check_precision, read_llmc_header
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) != 4 or int.from_bytes(head, "little") != MODEL_MAGIC:
        return
    if cpu_reference and read_llmc_header(path).version != VERSION_FP32:  # "run in bf16" is no option here
        raise LlmpyError(f"{path} is a bf16 model file and the CPU reference trains in fp32: load an fp32 (version "
                         f"3) file, or its fp32 HuggingFace export (llmpy export {path} DIR, then -e DIR)")
    check_precision(path, run_dtype)


def _names_a_model_file(desc: str) -> bool:
    """Whether -e names a model file or folder rather than a descriptor. A descriptor wins over a folder of the same
    name that holds no model (a run's -o named d12); a model file or folder of that name makes it ambiguous."""
    if os.sep not in desc:
        try:
            parse_descriptor(desc)
        except LlmpyError:
            return os.path.exists(desc)
        from .checkpoint import HF_INDEX_NAME, HF_WEIGHTS_NAME
        if os.path.isfile(desc) or any(os.path.isfile(os.path.join(desc, n)) for n in (HF_WEIGHTS_NAME, HF_INDEX_NAME)):
            raise LlmpyError(f"-e {desc}: both a model descriptor and the model at ./{desc}; write ./{desc} for that "
                             "model, or run from another folder for the descriptor's random init")
        return False
    return os.path.exists(desc)


def load_or_create_model(desc: str, seed: int = 42) -> tuple[GPT2Config, torch.Tensor]:
    """(config, flat fp32 parameters) from a descriptor (llm.c's random init) or a model file."""
    if desc.startswith("~"):  # a home folder's file (train's options come expanded; the API's create_model does not)
        desc = str(expand_user(desc))
    if _names_a_model_file(desc):
        from .checkpoint import load_model_file
        config, flat, _dtype = load_model_file(desc)
        return config, flat.float()
    config = parse_descriptor(desc)
    from .init import init_parameters
    return config, init_parameters(config, seed=seed)


def _tokenizer_for(vocab_size: int, byte_data: bool = False):
    """(the tokenizer to print samples with, None), or (None, why not) when samples print as token ids: bytes for
    byte-level data or the 257-token vocab, GPT-2's BPE for 50257 from local files only (nothing is fetched)."""
    from .tokenizer import load_tokenizer
    if vocab_size == 257 or byte_data:
        return load_tokenizer("bytes"), None
    if vocab_size != 50257:
        return None, f"no tokenizer of llmpy's has a vocab of {vocab_size}"
    try:
        return load_tokenizer("gpt2"), None
    except LlmpyError as e:
        return None, str(e)


def _open_to_append(path: Path):
    """`path` opened to append lines to, after dropping a last line without its newline: the partial record of a
    run killed while writing it, which the next record would otherwise join into one unreadable line."""
    with open(path, "ab+") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # only after a hard kill: then the log is read once, whole
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
    return open(path, "a")


RUN_LOCK_NAME = ".llmpy.lock"
# what a run writes into -o under that lock, atomically (training_state's model_path, state_path, done_path)
CHECKPOINT_FILES = re.compile(r"(model_\d{8}\.bin|state_\d{8}\.safetensors|DONE_\d{8})")


def _lock_run_folder(out_dir: Path, log):
    """The open lock file that keeps a second run from writing into the same -o at the same time (its checkpoints
    over ours, its steps between ours in the log); the system drops the lock when the process ends, however it
    ends. None where there is no flock: on Windows, and on file systems without locks (Lustre mounted without
    -o flock, some NFS and FUSE mounts), which a note names."""
    try:
        import fcntl
    except ImportError:
        return None
    path = out_dir / RUN_LOCK_NAME
    try:
        f = open(path, "a+")
    except OSError as e:
        raise LlmpyError(f"{path}: cannot open the run's lock file ({e.strerror or e})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise _folder_in_use(out_dir, holder) from None
    except OSError as e:
        f.close()
        if e.errno in NO_LOCKS_ERRNOS:
            log(f"note: {path}: the file system takes no locks ({e.strerror}); nothing keeps a second run out of "
                f"-o {out_dir} while this one writes")
            return None
        raise LlmpyError(f"{path}: cannot lock the run's folder ({e.strerror or e})") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _folder_in_use(out_dir, holder: str) -> LlmpyError:
    return LlmpyError(f"-o {out_dir}: another run is writing there" + (f" (process {holder})" if holder else "")
                      + "; wait for it to end, or give another -o")


def _refuse_a_folder_in_use(out_dir: str) -> None:
    """Before the checks of what -o holds: a run writing there makes the folder look like an earlier run's (its log
    without a checkpoint yet), and that error's advice, -y 1, would only end at the lock. A probe, not the lock
    (RunLog takes it once every input is checked); where locks fail, RunLog says so."""
    try:
        import fcntl
        f = open(os.path.join(out_dir, RUN_LOCK_NAME))
    except (ImportError, OSError):  # no lock file: no run has written there
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _folder_in_use(out_dir, f.read().strip()) from None
        except OSError:
            pass


class RunLog:
    """llm.c's main.log lines (`s:STEP trl:LOSS`, `s:STEP tel:LOSS`, `s:STEP eval:ACC`), a JSONL twin with
    every field, and TensorBoard events under tensorboard/ when torch's TensorBoard writer (the
    `tensorboard` package) is installed."""

    # JSONL fields drawn as TensorBoard scalars, per kind: field -> tag
    TB_SCALARS = {"train": {"loss": "train/loss", "norm": "train/grad_norm", "lr": "train/lr",
                            "tok_s": "train/tokens_per_s", "mfu": "train/mfu", "loss_z": "train/loss_z",
                            "norm_z": "train/grad_norm_z"},
                  "val": {"loss": "val/loss"}, "eval": {"accuracy": "eval/hellaswag"}}

    FILES = ("main.log", "main.jsonl")  # the text log and its JSONL twin, in the run's folder

    def __init__(self, out_dir: Path | None, log=print, start_step: int = 0):
        self.text = self.jsonl = self.tb = self.lock = self._thread_hook = None
        self.folder = out_dir
        if not out_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: no tensorboard package, no events
            SummaryWriter = None
        events = out_dir / "tensorboard"
        if SummaryWriter is not None and (events.exists() or events.is_symlink()) and not events.is_dir():
            raise LlmpyError(f"{events}: not a folder (TensorBoard's events go there); move it away")
        self.lock = _lock_run_folder(out_dir, log)
        try:
            self.text = _open_to_append(out_dir / self.FILES[0])
            self.jsonl = _open_to_append(out_dir / self.FILES[1])
            if SummaryWriter is not None:
                self._thread_hook = _quiet_tensorboard_thread_errors()
                # a run resumed from step k re-runs steps k+1...: TensorBoard hides the points that an earlier run
                # wrote there (purge_step), which would otherwise be drawn twice
                self.tb = SummaryWriter(log_dir=str(events), purge_step=start_step + 1)  # writes its first event now
        except OSError as e:
            self.close()
            raise LlmpyError(self._cannot_write(e)) from None

    def write(self, step: int, kind: str, **values):
        if self.text is None:
            return
        try:
            self._write(step, kind, **values)
        except OSError as e:  # a full disk: say which file, as a checkpoint's failure does
            raise LlmpyError(self._cannot_write(e)) from None

    def _cannot_write(self, e: OSError) -> str:
        # the file where open() names it (main.log a folder, say), else the folder (a write's full disk)
        where = f"the log {e.filename}" if e.filename else f"the log in {self.folder}"
        return f"cannot write {where}: {e.strerror or e}"

    def _write(self, step: int, kind: str, **values):
        if kind == "train":  # llm.c numbers a train line by the updates before it: one less than its step line
            self.text.write(f"s:{step - 1} trl:{values['loss']:.6f} lr:{values['lr']:.6f} norm:{values['norm']:.2f}\n")
        elif kind == "val":
            self.text.write(f"s:{step} tel:{values['loss']:.6f}\n")
        elif kind == "eval":
            self.text.write(f"s:{step} eval:{values['accuracy']:.4f}\n")
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
        self.text.flush()
        self.jsonl.flush()
        if self.tb is not None:
            for key, tag in self.TB_SCALARS.get(kind, {}).items():
                if isinstance(values.get(key), (int, float)) and not isinstance(values.get(key), bool):
                    self.tb.add_scalar(tag, values[key], step)

    def close(self) -> str | None:
        """Close every file, the lock last (the folder is free once all is out). A failure to write what was still
        buffered (a full disk) comes back as the error's line, for the caller to raise unless an error of its own is
        already on its way out: raising here, in the trainer's `finally`, would put this line in that error's place."""
        failed = None
        for f in (self.text, self.jsonl, self.tb, self.lock):
            if f is not None:
                try:
                    f.close()
                except OSError as e:  # the file is closed all the same
                    failed = failed or self._cannot_write(e)
        if self._thread_hook is not None and threading.excepthook is self._thread_hook:
            threading.excepthook = self._thread_hook.previous
        self.text = self.jsonl = self.tb = self.lock = self._thread_hook = None
        return failed


def _quiet_tensorboard_thread_errors():
    """TensorBoard writes its events on a thread of its own, which prints a traceback when a write fails (a full disk);
    the same error reaches the run at its next TensorBoard write or at close, where it becomes one line naming the
    folder. This hook keeps that thread's OSError quiet and passes everything else on; RunLog.close puts the previous
    hook back."""
    previous = threading.excepthook

    def hook(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)
    hook.previous = previous
    threading.excepthook = hook
    return hook


def _quiet(*_args, **_kw):
    pass


# options a process may hold for itself: the rest must be every process's (a torchrun job's command lines)
_PER_PROCESS_OPTIONS = ("progress",)


def _first_differing(dp, values: list[int], device) -> int | None:
    """The index of the first of this rank's values that some other rank holds otherwise; None if all agree."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    differs = (dp.all_gather_scalars(mine) != mine).any(dim=0)  # by value, over the ranks
    return int(differs.nonzero()[0]) if differs.any() else None


def _check_same_options(dp, opts: TrainOptions, device) -> None:
    """Every process of a run must be given the same options: a -b or --seed of its own would train on without a
    word (the reduction only adds gradients up), and a model of its own would fail inside a collective."""
    import zlib
    names = [f.name for f in fields(TrainOptions) if f.name not in _PER_PROCESS_OPTIONS]
    k = _first_differing(dp, [zlib.crc32(repr(getattr(opts, n)).encode()) for n in names], device)
    if k is not None:
        name = names[k]
        flag = next(flag for flag, field_name, _ in OPTION_FLAGS if field_name == name)
        raise LlmpyError(f"the processes of this run were given different {flag} (this one, rank {dp.rank}: "
                         f"{getattr(opts, name)!r}): give every process the same options")


def _check_same_data(dp, sources: list, device) -> None:
    """Every process must read the same shards: the same pattern resolving to other files on another node (its own
    local copy, another version of the dataset) would train on without a word, each rank on its slice of another
    stream. sources: [(flag, pattern, loader)], the same flags on every rank."""
    import zlib
    k = _first_differing(dp, [zlib.crc32(loader.fingerprint().encode()) for _, _, loader in sources], device)
    if k is not None:
        flag, pattern, loader = sources[k]
        files = loader.files[0].name + (f" .. {loader.files[-1].name}" if len(loader.files) > 1 else "")
        raise LlmpyError(f"the processes of this run found different shards for {flag} {pattern} (this one, rank "
                         f"{dp.rank}: {len(loader.files)} shard(s), {files}, {loader.num_tokens:,} tokens): give "
                         "every process the same data")


def _unused_option_notes(opts: TrainOptions, steps: int) -> list[str]:
    """Notes for options that this run's other options leave without effect: a flag that silently did nothing read
    as one that had worked."""
    from .outliers import OUTLIER_WINDOW
    notes = []
    hellaswag = [flag for flag, given in (("--hellaswag-file", opts.hellaswag_file != _DEFAULT_HELLASWAG_FILE),
                                          ("--hellaswag-examples", opts.hellaswag_examples != 0)) if given]
    if hellaswag and not opts.hellaswag:  # a forgotten -h 1 read as an evaluation that ran
        notes.append(f"note: {' and '.join(hellaswag)} without -h 1: HellaSwag is off, so "
                     f"{'they go' if len(hellaswag) > 1 else 'it goes'} unused")
    if opts.major_checkpoint_every and not opts.checkpoints_keep and opts.output_dir:
        notes.append(f"note: -nm {opts.major_checkpoint_every} without -nk: every checkpoint is kept, so -nm has none "
                     "to keep apart")
    if opts.lr_schedule == "constant" and opts.final_lr_frac != 1.0:
        notes.append(f"note: -q {opts.final_lr_frac:g} with -k constant: the constant schedule does not decay, so -q "
                     "goes unused")
    skips = [f"{flag} {z:g}" for flag, z in (("-sl", opts.skip_loss_z), ("-sg", opts.skip_grad_z)) if z > 0]
    if skips and steps <= OUTLIER_WINDOW:  # counted from step 1, as a resumed run's windows come back as they were
        notes.append(f"note: {', '.join(skips)}: scores begin at step {OUTLIER_WINDOW + 1}, once {OUTLIER_WINDOW} "
                     f"steps fill their window, and this run has {steps} steps, so none is skipped")
    defaults = TrainOptions()
    sampling = [f"{flag} {getattr(opts, name):g}" for name, flag in (("temperature", "--temperature"),
                                                                      ("top_k", "--top-k"))
                if getattr(opts, name) != getattr(defaults, name)]
    if sampling and opts.gen_tokens == 0:
        notes.append(f"note: {', '.join(sampling)} with -g 0: no sample is drawn, so "
                     f"{'they go' if len(sampling) > 1 else 'it goes'} unused")
    if opts.overfit_single_batch and opts.shuffle:
        notes.append("note: --shuffle 1 with -a 1: the one batch is the data's first, in file order, so --shuffle "
                     "goes unused")
    return notes


def _check_same_model(dp, model: str, config: GPT2Config, params: torch.Tensor, device) -> None:
    """Every process must start from the same weights: an -e model file of each node's own copy (another version, a
    checkpoint of another step) trained on without a word, each rank applying the shared gradients to its own
    weights, and one of another shape died inside a collective."""
    import zlib
    weights = zlib.crc32(memoryview(params.detach().cpu().contiguous().view(torch.uint8).numpy()))
    if _first_differing(dp, [zlib.crc32(config.describe().encode()), weights], device) is not None:
        raise LlmpyError(f"the processes of this run loaded different models for -e {model} (this one, rank "
                         f"{dp.rank}: {config.describe()}, weights' crc32 {weights:08x}): give every process the same "
                         "model file")


def _check_same_checkpoint(dp, output_dir: str, found: int | None, device) -> None:
    """-y 1: every process must resume from the same checkpoint. An -o on each node's own disk holds rank 0's
    checkpoints on its node only: the others would start afresh, and the ranks' steps (validations, the end) then
    call other collectives, which wait for each other until the group's timeout."""
    if _first_differing(dp, [-1 if found is None else found], device) is not None:
        have = "none" if found is None else f"step {found}"
        raise LlmpyError(f"-y 1: the processes of this run found different checkpoints in -o {output_dir} (this one, "
                         f"rank {dp.rank}: {have}): give every process the same -o, a folder that every node sees")


def _agree_between_steps(dp, received_signals: list[int], failed: bool, device) -> tuple[list[int], int | None]:
    """Every rank's view after a step: [the first signal of the lowest rank that got one] ([] if none did), so that
    all stop after the same step; and the lowest rank whose own work after the step failed (None if none did)."""
    seen = dp.all_gather_scalars(torch.tensor([received_signals[0] if received_signals else 0, int(failed)],
                                              dtype=torch.int64, device=device)).tolist()
    signals = [sig for sig, _ in seen if sig]
    return signals[:1], next((rank for rank, (_, f) in enumerate(seen) if f), None)


def _stop_if_a_rank_failed(own_error: Exception | None, failed_rank: int | None, what: str) -> None:
    """After the ranks have shared whether each failed: this rank's own error as it came, else, if another rank
    failed, one line naming it (its own line says why). `what` completes "rank R could not ..."."""
    if own_error is not None:
        raise own_error
    if failed_rank is not None:
        raise LlmpyError(f"rank {failed_rank} could not {what} (see its line); stopping")


def _rank_0_done(dp, error: Exception | None, device, what: str) -> None:
    """After work rank 0 alone did before the loop (the -o lock): its error, as it came, on rank 0, and one line naming
    rank 0 on the others, where they went on to the next collective and died there in gloo's or NCCL's words.
    `what` completes "rank R could not ..."."""
    if dp is None:
        if error is not None:
            raise error
        return
    failures = dp.all_gather_scalars(torch.tensor([error is not None], dtype=torch.int64, device=device))
    failures = failures.reshape(-1).tolist()
    _stop_if_a_rank_failed(error, failures.index(1) if any(failures) else None, what)


def _save_checkpoint(out_dir: Path, step: int, config: GPT2Config, backend, opts: TrainOptions, meta: dict,
                     write: bool = True):
    """llm.c's model file model_%08d.bin in the run's precision (version 3 fp32 or 5 bf16, as llm.c) and
    the training state state_%08d.safetensors that -y 1 resumes from; llm.c's DONE_%08d marker once the pair is
    whole; then -nk/-nm pruning."""
    from .training_state import done_path, prune_checkpoints, save_checkpoint
    # collectives under ZeRO-1; only the rank that writes copies the state to the CPU (about 18 bytes a parameter)
    tensors = backend.state_tensors(host=write)
    # the master weights when there are some (gathered once, under ZeRO-1), else the parameters themselves
    weights = tensors.get("master", tensors["params"])
    if not torch.isfinite(weights).all():  # the update after the last loss seen diverged: keep the good files
        raise LlmpyError(f"step {step}: the weights are not finite; no checkpoint written (lower -l)")
    if not write:
        return
    # the model file holds the weights the run computes with, as llm.c's: in bf16 the device's stochastically
    # rounded copy, not the master weights rounded to nearest (those are in the state file)
    save_checkpoint(out_dir, step, config, tensors["params"], tensors, meta, model_dtype=opts.dtype)
    try:
        done_path(out_dir, step).write_text("")
    except OSError as e:  # the pair is whole and -y 1 reads it; only the marker for llm.c's scripts is missing
        raise LlmpyError(f"{done_path(out_dir, step)}: cannot write ({e.strerror or e}); the checkpoint of step "
                         f"{step} is whole") from None
    prune_checkpoints(out_dir, opts.checkpoints_keep, opts.major_checkpoint_every, newest=step)


# options that only the GPU model reads: (TrainOptions field, flag)
_GPU_ONLY = (("master_weights", "-w"), ("recompute", "-r"), ("gelu_fusion", "-ge"), ("tf32", "-f"),
             ("attention", "--attention"), ("cuda_graph", "--cuda-graph"))


# what a resumed run must share with its checkpoint: (TrainOptions field, flag, saved-options key)
_RESUME_MUST_MATCH = (("batch_size", "-b", "batch_size"), ("seq_len", "-t", "seq_len"),
                      ("dtype", "--dtype", "dtype"), ("seed", "--seed", "seed"), ("shuffle", "--shuffle", "shuffle"))
# what may change on resume (with a note): the schedule and the optimizer's knobs
_RESUME_MAY_CHANGE = (("learning_rate", "-l"), ("lr_schedule", "-k"), ("warmup_steps", "-u"),
                      ("final_lr_frac", "-q"), ("weight_decay", "-c"), ("grad_clip", "--grad-clip"),
                      ("overfit_single_batch", "-a"), ("skip_loss_z", "-sl"), ("skip_grad_z", "-sg"),
                      # these change the arithmetic: the run goes on, no longer bitwise the uninterrupted one
                      ("master_weights", "-w"), ("tf32", "-f"), ("engine", "engine"))  # engine: as resolved


def _run_options(opts: TrainOptions, config: GPT2Config, accum: int, device: str, byte_data: bool) -> dict:
    """The options that define a run, as saved in each training state; "tokenizer" is "bytes" for the embedded
    byte-level corpus, which `llmpy sample` then decodes with even at GPT-2's vocab (null: the data's own)."""
    from .training_state import config_dict
    keep = ("model", "train_data", "batch_size", "seq_len", "total_batch_size", "learning_rate", "lr_schedule",
            "warmup_steps", "final_lr_frac", "weight_decay", "grad_clip", "max_steps", "seed", "dtype",
            "master_weights", "shuffle", "overfit_single_batch", "skip_loss_z", "skip_grad_z", "tf32", "engine")
    from .distributed import torchrun_env
    env = torchrun_env()
    return {**{k: getattr(opts, k) for k in keep}, "config": config_dict(config), "grad_accumulation": accum,
            "device": device, "world_size": env[1] if env else 1, "zero_stage": opts.zero_stage,
            "tokenizer": "bytes" if byte_data else None}


def _reference_step_floats(config: GPT2Config, B: int, T: int) -> tuple[int, int]:
    """At least what a micro-step of the CPU reference holds at once, in fp32 numbers, and the part of it that is
    the logits and their gradient: a layer's activations kept for the backward (16 B*T*C, the attention's
    B*NH*T*T, the LayerNorms' statistics), the final LayerNorm's input and output, and the logits, their softmax
    and their gradient at the backward's start (3 B*T*Vp; measured: 3.2 GB more at B=64 than at B=1 for
    layers=2,channels=64, where this says 2.5)."""
    BT, C = B * T, config.channels
    logits = 3 * BT * config.padded_vocab_size
    layer = 16 * BT * C + config.num_heads * B * T * T + 4 * BT
    return config.num_layers * layer + 2 * BT * C + logits, logits


def _check_step_fits_in_memory(opts: TrainOptions, accum: int, config: GPT2Config, reference: bool) -> None:
    """A step holds all its micro-batches on the host at once (the GPU model stages them for its CUDA graph):
    a -d with a few zeros too many would take the machine's memory before the first step and die unexplained.
    The CPU reference also holds a micro-step's activations there: a -b too large for them died in the first
    forward (an allocator's traceback, or the kernel's OOM killer without a word)."""
    B, T = opts.batch_size, opts.seq_len
    per_micro = 8 * (B * T + 1) + 1536 + 16 * B * T  # the loader's int64 window and its two tensors, the staging
    from . import config as config_module  # its host_memory_available, as tests replace it
    free = config_module.host_memory_available()
    if free is not None and accum * per_micro > free:
        # the flag with the zeros too many: -d when it asks for accumulation, else -b
        flag = f"-d {opts.total_batch_size}" if accum > 1 else f"-b {B}"
        raise LlmpyError(f"{flag}: a step of {accum:,} micro-batches of B={B}, T={T} needs "
                         f"{accum * per_micro / 1e9:,.1f} GB of host memory for its batches, more than the "
                         f"{free / 1e9:.1f} GB available")
    if reference and free is not None:
        floats, logits = _reference_step_floats(config, B, T)
        # the batches, the parameters and their gradient (AdamW's m and v come after the backward)
        need = 4 * floats + accum * per_micro + 8 * config.num_parameters
        if need > free:
            raise LlmpyError(f"-b {B}: a step of the CPU reference at B={B}, T={T} needs at least "
                             f"{need / 1e9:,.1f} GB of host memory (its activations, {4 * logits / 1e9:,.1f} GB of "
                             f"them the logits, their softmax and gradient), more than the {free / 1e9:.1f} GB "
                             "available; lower -b (-d keeps the tokens a step through accumulation)")


def _resumed_model_config(desc: str, state, log) -> GPT2Config:
    """The configuration -e names on a resume, only to compare with the checkpoint's (whose weights the run takes):
    an llm.c file's header alone is read, not GBs of weights, and a model file no longer there is a note (llm.c reads
    no -e on resume: the same command line resumes after the init file was cleaned away)."""
    from .checkpoint import load_model_file, read_llmc_header
    if looks_like_a_model_path(desc) and not os.path.exists(desc):
        log(f"note: -y 1: -e {desc} is not there; the run continues from the checkpoint's model "
            f"{state.model_file.name}")
        return state.config
    if not _names_a_model_file(desc):
        return parse_descriptor(desc)
    if os.path.isfile(desc):
        try:
            return read_llmc_header(desc).config
        except LlmpyError:
            pass  # not an llm.c file: load_model_file names what it is
    return load_model_file(desc)[0]


def _check_resumed_model(state, config: GPT2Config, model: str) -> None:
    """-e on a resume must name the checkpoint's shape: checked as soon as both are read, before -t and the data
    are checked against -e's model, which the run would not train."""
    from .training_state import CONFIG_FIELDS, config_dict
    mine, theirs = config_dict(config), config_dict(state.config)
    for k in CONFIG_FIELDS:
        if mine[k] != theirs[k]:
            raise LlmpyError(f"-y 1: the checkpoint {state.model_file.name} has {k}={theirs[k]} but this run's model "
                             f"(-e {model}) has {k}={mine[k]}")


def _check_resume(state, opts: TrainOptions, config: GPT2Config, accum: int, log, world: int = 1, *, steps: int):
    """One line naming the field and both values when the run differs from its checkpoint where it must
    not; a note where it may (the schedule then differs from the original run's). `steps`: the run's length as
    resolved (-x, else the checkpoint's). -e's shape was compared where it was read (_check_resumed_model)."""
    name = state.model_file.name
    saved = state.meta.get("options", {})
    saved_world = saved.get("world_size", 1)
    if saved_world != world:  # the data position counts windows of B*T*processes tokens
        raise LlmpyError(f"-y 1: the checkpoint {name} was written by a run of {saved_world} process(es), this run "
                         f"has {world}: resume with torchrun --nproc_per_node={saved_world}")
    for fld, flag, key in _RESUME_MUST_MATCH:
        if key in saved and saved[key] != getattr(opts, fld):
            raise LlmpyError(f"-y 1: the checkpoint {name} was saved with {flag} {saved[key]} but this run has "
                             f"{flag} {getattr(opts, fld)}")
    if "grad_accumulation" in saved and saved["grad_accumulation"] != accum:
        raise LlmpyError(f"-y 1: the checkpoint {name} was saved with gradient accumulation "
                         f"{saved['grad_accumulation']} (-d {saved.get('total_batch_size')}) but this run has "
                         f"{accum} (-d {opts.total_batch_size})")
    changed = [f"{flag} {saved[fld]} -> {getattr(opts, fld)}" for fld, flag in _RESUME_MAY_CHANGE
               if fld in saved and saved[fld] != getattr(opts, fld)]
    # the lengths the two runs have, not their flags: -x -1 on resume keeps the checkpoint's, and a run of -x -1 (one
    # epoch) resumed with -x equal to that epoch's steps is the same schedule
    saved_steps = state.meta.get("total_steps")
    if "max_steps" in saved and (saved_steps if saved_steps is not None else saved["max_steps"]) != steps:
        # "raise -x to train further" (the message of a run already at its end): a decaying schedule then stretches
        decays = opts.lr_schedule != "constant" and opts.final_lr_frac != 1.0  # -q 1: nothing to stretch
        stretch = f": the {opts.lr_schedule} schedule now decays over -x {steps}" if decays else ""
        was = saved["max_steps"] if saved["max_steps"] == saved_steps or saved_steps is None else \
            f"{saved['max_steps']} ({saved_steps} steps)"
        changed.append(f"-x {was} -> {steps}{stretch}")
    if changed:
        log(f"note: resuming with changed settings ({', '.join(changed)})")
    if opts.model and _names_a_model_file(opts.model) and saved.get("model") != opts.model:
        # a model file gives a new run its weights; a resumed run has the checkpoint's (its shape is checked above)
        log(f"note: -y 1 continues from the weights of {name}; -e {opts.model} is not read for them")


# ---------------------------------------------------------------------------------------------------
# the loop

@dataclass
class TrainResult:
    config: GPT2Config
    model: object
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    eval_accuracies: list[tuple[int, float]] = field(default_factory=list)  # -h 1: (step, HellaSwag accuracy)
    step_ms: list[float] = field(default_factory=list)
    sample: str | None = None
    start_step: int = 0                    # the step a -y 1 run resumed from (0: a fresh run)
    stopped_by: str | None = None          # "SIGINT"/"SIGTERM" when a signal ended the run early
    last_step: int = 0                     # the last completed step


def _single_batch(opts: TrainOptions, train_loader, vocab_size: int, rank: int, world: int):
    """-a 1's one batch, as llm.c's: the first of the validation data when there is some (smaller, and the
    validation loss then follows the training loss), else the first of the train data."""
    from .data import DataLoader
    if not opts.val_data and not opts.shuffle:
        return train_loader.next_batch()
    # in file order: --shuffle's first batch is another one than the log line names (and validation scores)
    loader = DataLoader(opts.val_data or opts.train_data, opts.batch_size, opts.seq_len, rank=rank, world_size=world,
                        vocab_size=vocab_size)
    try:
        return loader.next_batch()
    finally:
        loader.close()


def train(opts: TrainOptions, log=print) -> TrainResult:
    """Run one training as the options say; returns the losses and the trained model."""
    from .distributed import signals_watched
    tf32 = torch.backends.cuda.matmul.allow_tf32  # -f sets it for the run: the caller's own products keep theirs
    try:
        with signals_watched():  # a SIGINT/SIGTERM until it returns is this run's to act on (StuckRankWatch)
            return _run_training(opts, log)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run_training(opts: TrainOptions, log) -> TrainResult:
    from .data import DataLoader, EvalLoader, default_dataset
    from .sampler import generate, printable

    embedded = opts.train_data is None
    if embedded:
        # the offline default: the byte-level stdlib corpus; on the CPU a small model that trains in about
        # 90 seconds on two cores, on a GPU GPT-2 124M (d12)
        files = default_dataset()
        opts.train_data = files.train
        if opts.val_data is None:  # "" is left for validate() to refuse by name
            opts.val_data = files.val
        if opts.model is None:
            demo = _resolve_device(opts)
            opts.model = "d12" if demo == "cuda" else DEFAULT_CPU_MODEL
            opts.fill_run_defaults(demo)
    opts.validate()
    device = _resolve_device(opts)
    # under torchrun with several processes: data parallel over NCCL (GPUs) or gloo (CPU)
    from .distributed import init_data_parallel, note_step_seconds, patient, torchrun_env
    env = torchrun_env()
    several = env is not None and env[1] > 1
    kernels = device == "cuda" or several or opts.engine == "kernels"
    if opts.engine == "reference" and kernels:
        raise LlmpyError("--engine reference is the single-process CPU oracle: use --device cpu, one process")
    if kernels and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise LlmpyError(("several processes on the CPU run" if several else "--engine kernels on the CPU runs")
                         + " the kernel model in Triton's interpreter: set TRITON_INTERPRET=1 (slow; meant "
                         "for tests), or train on GPUs")
    opts.engine = "kernels" if kernels else "reference"  # resolved, as --dtype below: what a checkpoint records
    dp = init_data_parallel(device, opts.zero_stage)
    world, rank = (dp.world_size, dp.rank) if dp else (1, 0)
    if dp is not None:
        _check_same_options(dp, opts, device)
    if dp is None and opts.zero_stage:
        raise LlmpyError("-z 1 shards the optimizer over several processes: launch with torchrun "
                         "--nproc_per_node=N (N > 1)")
    if not opts.dtype:
        opts.dtype = "bfloat16" if device == "cuda" else "float32"
    if not kernels and opts.dtype != "float32":
        raise LlmpyError(f"--dtype {opts.dtype}: the CPU reference trains in float32")
    if rank != 0:  # one voice: rank 0 logs, prints, samples and writes
        log = _quiet

    state = None
    from .training_state import checkpoint_files, latest_complete_step, load_checkpoint
    if opts.output_dir:
        in_use = None
        try:
            if rank == 0:  # rank 0 alone takes the lock: another's probe could find rank 0's
                _refuse_a_folder_in_use(opts.output_dir)
        except LlmpyError as e:
            in_use = e
        _rank_0_done(dp, in_use, device, f"write into -o {opts.output_dir}")
    # checkpoints in -o are resumed (-y 1) and never overwritten: a run from step 0 needs an -o without any
    names = checkpoint_files(opts.output_dir) if opts.output_dir else []
    found = latest_complete_step(opts.output_dir) if opts.resume and names else None
    if dp is not None and opts.resume and opts.output_dir:
        _check_same_checkpoint(dp, opts.output_dir, found, device)
    if names and found is None:
        listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        if opts.resume:
            raise LlmpyError(f"-y 1: no complete checkpoint to resume from in {opts.output_dir} ({listed}: no "
                             "model_*.bin with its matching state_*.safetensors); move those files away to start "
                             "afresh")
        raise LlmpyError(f"-o {opts.output_dir} holds the checkpoints of a run ({listed}), which a new run would "
                         "overwrite: continue it with -y 1, or give another -o")
    if not opts.resume and opts.output_dir:
        # a run that stopped before its first checkpoint leaves only its log, which a run appends to (the last record
        # of a step wins): the same run started again (-y 1) logs the same steps again, another would mix with it
        logs = [n for n in RunLog.FILES if os.path.isfile(os.path.join(opts.output_dir, n))
                and os.path.getsize(os.path.join(opts.output_dir, n))]
        if logs:
            raise LlmpyError(f"-o {opts.output_dir} holds the log of an earlier run ({', '.join(logs)}), which a new "
                             "run would add its steps to: start that run again with -y 1, or give another -o")
    if found is not None:
        state = load_checkpoint(Path(opts.output_dir), found)
        newer = checkpoint_files(opts.output_dir, after=found)
        if newer:  # a run stopped while writing, or files copied in: say so before they may be written over
            log(f"note: -y 1 resumes from step {found}, the latest complete checkpoint; the newer "
                f"{', '.join(newer[:3])}{', ...' if len(newer) > 3 else ''} (no matching pair) will be replaced "
                "if the run checkpoints those steps")
        if opts.model is None:  # no -e: the checkpoint's own model
            opts.model = state.meta.get("options", {}).get("model") or str(state.model_file)
            config = state.config
        else:
            config = _resumed_model_config(opts.model, state, log)
            _check_resumed_model(state, config, opts.model)
        params = state.params_fp32
    else:
        if opts.model is None:
            opts.model = "d12"
        if _names_a_model_file(opts.model) and os.path.isfile(opts.model):
            _check_model_precision(opts.model, opts.dtype, cpu_reference=not kernels)
        config, params = load_or_create_model(opts.model, seed=opts.seed)
    if dp is not None:
        _check_same_model(dp, opts.model, config, params, device)
    B, T = opts.batch_size, opts.seq_len
    if T > config.max_seq_len:
        raise LlmpyError(f"-t {T}: longer than the model's context of {config.max_seq_len} tokens")
    tokens_per_micro = B * T * world  # one micro-step of every rank
    if opts.total_batch_size == -1:
        accum = 1
    elif opts.total_batch_size <= 0 or opts.total_batch_size % tokens_per_micro:
        raise LlmpyError(f"-d {opts.total_batch_size}: the total batch must be a positive multiple of B*T"
                         + (f"*processes = {B}*{T}*{world}" if world > 1 else "") + f" = {tokens_per_micro}")
    else:
        accum = opts.total_batch_size // tokens_per_micro
    _check_step_fits_in_memory(opts, accum, config, reference=not kernels)

    train_loader = DataLoader(opts.train_data, B, T, rank=rank, world_size=world, shuffle=bool(opts.shuffle),
                              seed=opts.seed, vocab_size=config.vocab_size)
    val_loader = None
    if opts.val_data and opts.val_every > 0:
        val_loader = EvalLoader(opts.val_data, B, T, rank=rank, world_size=world, vocab_size=config.vocab_size)
        val_batches = len(val_loader) if opts.val_max_steps == -1 else min(opts.val_max_steps, len(val_loader))
    if dp is not None:
        _check_same_data(dp, [("-i", opts.train_data, train_loader)]
                         + ([("-j", opts.val_data, val_loader)] if val_loader is not None else []), device)
    hs_examples = None
    if opts.hellaswag and opts.val_every > 0:
        from .hellaswag import read_eval_file
        hs_examples = read_eval_file(opts.hellaswag_file, vocab_size=config.vocab_size)
        if opts.hellaswag_examples:
            hs_examples = hs_examples[:opts.hellaswag_examples]
    if opts.max_steps > 0:
        steps = opts.max_steps
    elif state is not None and state.meta.get("total_steps"):
        steps = int(state.meta["total_steps"])  # no -x: the checkpointed run's length
    else:
        if accum > len(train_loader):  # -x -1 means one epoch, and one step would be more than one
            raise LlmpyError(f"-d {opts.total_batch_size}: one step reads {accum} batches of B={B} T={T}"
                             + (" a process" if world > 1 else "") + f", more than the {len(train_loader)} of one "
                             "epoch of the train data (-x -1: one epoch); lower -d, or give the steps with -x")
        steps = len(train_loader) // accum
    start_step = 0
    loss_outliers, grad_outliers = OutlierDetector(), OutlierDetector()
    first_batch = None
    if opts.overfit_single_batch:  # taken before a resume moves the train loader: the same batch at any position
        first_batch = _single_batch(opts, train_loader, config.vocab_size, rank, world)
    if state is not None:
        resume_notes: list[str] = []  # said after the run's header, beside the line that names the checkpoint
        _check_resume(state, opts, config, accum, resume_notes.append, world, steps=steps)
        try:
            try:
                train_loader.load_state_dict(state.meta["data"])
            except LlmpyError as e:  # the data position: the -i that differs, if one does, is the likely cause
                was = state.meta.get("options", {}).get("train_data")
                if was != opts.train_data:
                    raise LlmpyError(f"{e} (its run had -i {was}, this one -i {opts.train_data})") from None
                raise
            loss_outliers.load_state_dict(state.meta["outliers"]["loss"])
            grad_outliers.load_state_dict(state.meta["outliers"]["grad"])
        except LlmpyError as e:
            raise LlmpyError(f"-y 1: {state.state_file}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise LlmpyError(f"-y 1: {state.state_file}: malformed training state ({type(e).__name__}: {e})") \
                from None
        start_step = state.step
    schedule = LRSchedule(opts.lr_schedule, opts.learning_rate, opts.warmup_steps, steps, opts.final_lr_frac)
    tokenizer, no_tokenizer = _tokenizer_for(config.vocab_size, byte_data=embedded)
    out_dir = None
    writer = rank == 0  # the one rank that writes checkpoints and logs
    if opts.output_dir:  # after every check of the input
        from .files import writable_dir
        out_dir = writable_dir(opts.output_dir, "output directory", name=f"-o {opts.output_dir}")

    if kernels:
        backend = GPUBackend(config, params, opts, device=device, data_parallel=dp)
    else:
        backend = CPUBackend(config, params)
    if state is not None:
        try:
            backend.load_state(state.tensors, state.meta.get("rng", {}).get("sr_seeds"))
        except LlmpyError as e:  # the seeds' count: say which file
            raise LlmpyError(f"{state.state_file}: {e}") from None
        # the model holds its own copies now: the host's, about 20 bytes a parameter on every rank, would stay
        # for the whole run (a 1.5B model's 30 GB, on each of a node's processes)
        state.tensors.clear()
        state.params_fp32 = None
    params = None  # no host copy held here: the GPU model's weights are on the device, the CPU reference has its own
    model = backend.model
    log(f"llmpy train | device {device} | {backend.describe()}")
    log(f"model {opts.model}: {config.describe()} | padded vocab {config.padded_vocab_size} | "
        f"{config.num_parameters:,} parameters")
    log(f"data {opts.train_data}: {train_loader.num_tokens:,} tokens, {len(train_loader)} batches of B={B} T={T}"
        + (f" | val {opts.val_data}" if val_loader else "")
        + (f" | hellaswag {opts.hellaswag_file} ({len(hs_examples)} examples)" if hs_examples else ""))
    if opts.overfit_single_batch:
        log(f"-a 1: every step trains on the first batch of {opts.val_data or opts.train_data}")
    for loader in (train_loader, val_loader):
        if loader is not None and loader.skipped:
            shown = ", ".join(f"{f.name} ({n:,} tokens)" for f, n in loader.skipped[:3])
            more = f" and {len(loader.skipped) - 3} more" if len(loader.skipped) > 3 else ""
            log(f"note: set aside, too small for one batch of B*T*processes+1 = {loader.window + 1:,} tokens: "
                f"{shown}{more}")
    if dp is not None:
        log(f"data parallel: {world} processes ({'nccl' if device == 'cuda' else 'gloo'}), -z {opts.zero_stage}"
            + (" (ZeRO-1: each keeps 1/N of AdamW's m, v and the master weights)" if opts.zero_stage else
               " (every process updates the whole model)"))
    log(f"steps {steps} | grad accumulation {accum} ({tokens_per_micro * accum} tokens/step) | lr {opts.learning_rate} "
        f"{opts.lr_schedule} warmup {opts.warmup_steps} final x{opts.final_lr_frac} | weight decay {opts.weight_decay} "
        f"| clip {opts.grad_clip}")
    if out_dir:
        log(f"output {out_dir}")
    if no_tokenizer and opts.gen_tokens:
        log(f"note: samples print as token ids ({no_tokenizer})")
    if not kernels:
        defaults = TrainOptions()
        ignored = [f"{flag} {getattr(opts, name)}" for name, flag in _GPU_ONLY
                   if getattr(opts, name) != getattr(defaults, name)]
        if ignored:
            log(f"note: the CPU reference ignores GPU options: {', '.join(ignored)}")
    checkpoint_flags = (("checkpoint_every", "-n"), ("checkpoints_keep", "-nk"), ("major_checkpoint_every", "-nm"))
    unsaved = [f"{flag} {getattr(opts, name)}" for name, flag in checkpoint_flags if getattr(opts, name)]
    if unsaved and not opts.output_dir:
        log(f"note: {', '.join(unsaved)} without -o: no checkpoints are written")
    if opts.warmup_steps > steps:  # the learning rate never reaches -l: likely a -u meant for a longer run
        log(f"note: -u {opts.warmup_steps} is more than the run's {steps} steps: the warmup never ends (the learning "
            f"rate reaches {schedule(steps - 1):.3g}, not -l {opts.learning_rate:g})")
    if opts.hellaswag and opts.val_every == 0:  # HellaSwag is scored at the validation steps
        log("note: -h 1 with -v 0: HellaSwag runs at each validation, and -v 0 turns validation off, so it never runs")
    for note in _unused_option_notes(opts, steps):
        log(note)
    if state is not None:
        log(f"resuming from {state.model_file.name} + {state.state_file.name} (step {start_step} of {steps})")
        for note in resume_notes:
            log(note)
    elif opts.resume:  # llm.c's -y 1: the same command line starts a run, then resumes it
        log(f"-y 1: no checkpoint in {opts.output_dir} yet: starting from step 0")
    mfu_of = None
    if device == "cuda":
        from .mfu import estimate_mfu
        gpu_name = torch.cuda.get_device_name()
        mfu_of = lambda tok_s: estimate_mfu(config, T, tok_s / world, gpu_name, opts.dtype)  # noqa: E731  (per GPU)

    result = TrainResult(config=config, model=model, start_step=start_step, last_step=start_step)
    if start_step >= steps:
        log(f"the checkpoint is at step {start_step} and the run has {steps} steps: nothing to do "
            "(raise -x to train further)")
        return result
    run_log = no_log = None
    try:
        run_log = RunLog(out_dir if writer else None, log, start_step)
    except LlmpyError as e:  # the -o lock taken since the probe above, a log that cannot be opened
        no_log = e
    _rank_0_done(dp, no_log, device, f"start the run's log in -o {opts.output_dir}")
    if out_dir is not None and writer:
        from .files import remove_orphaned_temporaries
        # with the folder's lock, a checkpoint's temporary is a killed run's however new
        remove_orphaned_temporaries(out_dir, log, kept_out=CHECKPOINT_FILES if run_log.lock is not None else None)
    progress = None
    if writer and (opts.progress == 1 or (opts.progress == -1 and sys.stderr.isatty())):
        from tqdm import tqdm
        progress = tqdm(total=steps, initial=start_step, unit="step", dynamic_ncols=True, leave=False,
                        file=sys.stderr)
        caller_log = log

        def log(msg):  # step lines above the bar, through the caller's log (the API's callback too)
            with tqdm.external_write_mode():
                caller_log(msg)

    def alone_on_rank_0(work, what: str):
        """work() on every rank, where rank 0 alone writes, samples or scores while the others wait: a failure
        there (a full disk) reaches the others at once, where a barrier would have them wait for it until the
        group's timeout (NCCL) or say only that it left (gloo). `what` completes "rank R could not ..."."""
        if dp is None:
            return work()
        error = done = None
        try:
            done = work()
        except Exception as e:  # raised below, as it came
            error = e
        failures = dp.all_gather_scalars(torch.tensor([error is not None], dtype=torch.int64,
                                                      device=backend.model.device)).reshape(-1).tolist()
        _stop_if_a_rank_failed(error, failures.index(1) if any(failures) else None, what)
        return done

    def validate(step):
        with patient():  # the ranks' slices may differ in time; rank 0 scores HellaSwag alone
            validate_now(step)

    def validate_now(step):
        val = None
        if val_loader is not None:
            losses = [backend.validate(x, y) for x, y in val_loader.batches(val_batches)]
            if dp is not None:  # every rank's slices, averaged in rank order
                losses = dp.all_gather_scalars(torch.tensor(losses, dtype=torch.float64,
                                                            device=backend.model.device)).reshape(-1).tolist()
            val = sum(losses) / len(losses)
            if not math.isfinite(val):
                raise LlmpyError(f"step {step}: the validation loss is {val}; stopping (lower -l, or check "
                                 "the validation data)")
            result.val_losses.append((step, val))
        # as llm.c, not at step 0 (a random model, and a whole pass over the file), but at the last step
        hellaswag = hs_examples and (step > 0 or step == steps)
        if val_loader is not None or hellaswag:
            # rank 0 logs and scores HellaSwag alone; the others wait for it here, not in the next step's collectives
            alone_on_rank_0(lambda: record_validation(step, val, hellaswag) if writer else None,
                            f"log or score the validation of step {step}")

    def record_validation(step, val, hellaswag):
        if val_loader is not None:
            run_log.write(step, "val", loss=val)
            log(f"val loss {val:.6f}")
        if hellaswag:
            score_hellaswag(step)

    def score_hellaswag(step):  # rank 0 scores the whole eval file (the forward is local)
        from .hellaswag import score
        hs = score(hs_examples, backend.position_losses, B, T)
        result.eval_accuracies.append((step, hs.accuracy))
        run_log.write(step, "eval", accuracy=hs.accuracy, correct=hs.correct, total=hs.total)
        log(f"HellaSwag: {hs.correct}/{hs.total} = {hs.accuracy:.4f}")

    def sample(step):
        if opts.gen_tokens == 0:
            return None
        with patient():  # rank 0 samples alone, the others wait for it
            return alone_on_rank_0(lambda: sample_now(step) if writer else None, f"sample at step {step}")

    def sample_now(step):
        start = [tokenizer.eot] if tokenizer is not None else [config.vocab_size - 1]
        try:
            ids = generate(backend.next_logits, start, opts.gen_tokens, config.vocab_size, config.max_seq_len,
                           seed=opts.seed + step, temperature=opts.temperature, top_k=opts.top_k)
        except LlmpyError as e:
            raise LlmpyError(f"step {step}: {e}; stopping (lower -l)") from None
        if tokenizer is not None:  # a byte-trained GPT-2 vocab can still draw an id past the bytes early on
            text = tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
        else:
            text = " ".join(map(str, ids))
        log(f"--- sample at step {step} ---\n{printable(text)}\n---")
        return text

    def log_step(step, loss, norm, lr, ms, tok_s, mfu_frac, skip):
        if skip:
            log(f"step {step + 1}: skipped the update (loss z {last_z[0]:.2f}, grad-norm z {last_z[1]:.2f})")
        extra = {"mfu": mfu_frac} if mfu_frac > 0 else {}
        # the z-scores, null (and left off the step line) while the window fills or holds a non-finite value
        loss_z, norm_z = (z if math.isfinite(z) else None for z in last_z)
        # tokens: trained on through this step (llmpy plot -x tokens lines up runs of different batch sizes)
        run_log.write(step + 1, "train", loss=loss, norm=norm, lr=lr, ms=ms, tok_s=tok_s, skipped=skip,
                      loss_z=loss_z, norm_z=norm_z, tokens=(step + 1) * tokens_per_micro * accum, **extra)
        mfu = f" | {100 * mfu_frac:.1f}% MFU" if mfu_frac > 0 else ""
        loss_zs, norm_zs = ("" if z is None else f" ({z:+.2f}z)" for z in (loss_z, norm_z))  # llm.c's (+0.12z)
        log(f"step {step + 1:5d}/{steps} | loss {loss:.6f}{loss_zs} | norm {norm:.4f}{norm_zs} | lr {lr:.2e} | "
            f"{ms:.1f} ms | {tok_s:.0f} tok/s{mfu}")
        if progress is not None:
            progress.update(1)

    last_z = [float("nan"), float("nan")]

    def score_step(loss, norm):
        """Every step's loss and gradient norm join their windows, -sl/-sg or not (as llm.c's): the step line shows
        their z-scores, and a run resumed with -sl/-sg has its windows full from the first step (an older llmpy's
        checkpoint of a run without -sl/-sg holds empty windows: they fill over the next 128 steps)."""
        last_z[:] = loss_outliers.update(loss), grad_outliers.update(norm)

    def outlier(loss, norm) -> bool:
        """-sl/-sg: skip the update when the loss or gradient norm is an outlier of its recent window."""
        score_step(loss, norm)
        return (opts.skip_loss_z > 0 and last_z[0] > opts.skip_loss_z) or \
            (opts.skip_grad_z > 0 and last_z[1] > opts.skip_grad_z)
    # without -sl/-sg the step needs no decision before its update: it is scored after it
    skip_fn = outlier if (opts.skip_loss_z > 0 or opts.skip_grad_z > 0) else None

    from . import __version__
    run_options = _run_options(opts, config, accum, device, byte_data=embedded)

    def checkpoint(step_done: int):
        meta = {"llmpy_version": __version__, "total_steps": steps, "options": run_options,
                "data": train_loader.state_dict(),
                "outliers": {"loss": loss_outliers.state_dict(), "grad": grad_outliers.state_dict()},
                "rng": {"sr_seeds": backend.seed_state()}}
        # every rank takes part (ZeRO-1 gathers the optimizer shards), rank 0 writes, the others wait
        with patient():
            alone_on_rank_0(lambda: _save_checkpoint(out_dir, step_done, config, backend, opts, meta, write=writer),
                            f"save the checkpoint of step {step_done}")

    # SIGINT/SIGTERM only raise a flag, read between steps: the step in flight finishes, its checkpoint
    # is saved, and the run ends; a second signal to this process interrupts at once. The handler appends to
    # its own list, which nothing else writes: a signal landing while the ranks agree is kept for the next step
    received_signals: list[int] = []
    # one process, once the run's last checkpoint is written: only the sample is left, and a signal stops it at once
    nothing_to_save = [False]

    def on_signal(signum, frame):
        if received_signals or nothing_to_save[0]:
            raise KeyboardInterrupt
        received_signals.append(signum)
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, on_signal)

    stop_signal: list[int] = []
    try:
        for step in range(start_step, steps):
            if opts.val_every > 0 and step % opts.val_every == 0:
                validate(step)
            if opts.sample_every > 0 and step > 0 and step % opts.sample_every == 0:
                sample(step)
            t0 = time.perf_counter()
            batches = []
            with patient():  # a new shard from a slow file system may take long: no peer is waited for here
                for _ in range(accum):
                    if opts.overfit_single_batch:
                        batches.append(first_batch)
                    else:
                        batches.append(train_loader.next_batch())
            lr = schedule(step)
            stepped = time.perf_counter()
            # this process's first step compiles kernels and captures the graph: long, rightly; the second is the
            # first to be timed, so until it is, nothing says how long a step may take (a large model's step on a few
            # GPUs passes the 10 s a stop waits before it ends the process unsaved)
            with patient() if step <= start_step + 1 else contextlib.nullcontext():
                loss, norm = backend.train_step(batches, lr, step + 1, opts.weight_decay, opts.grad_clip,
                                                skip=skip_fn)
            if step > start_step:
                note_step_seconds(time.perf_counter() - stepped)
            if not math.isfinite(loss):
                raise LlmpyError(f"step {step + 1}: the loss is {loss}; stopping (lower -l, or check the data)")
            if skip_fn is None:
                score_step(loss, norm)
            skip = backend.last_step_skipped
            ms = (time.perf_counter() - t0) * 1000
            result.train_losses.append(loss)
            result.step_ms.append(ms)
            tok_s = tokens_per_micro * accum / (ms / 1000)
            mfu_frac = mfu_of(tok_s) if mfu_of is not None else -1.0
            step_log_error = None
            try:  # rank 0 alone logs: its failure (a full disk) is told to the others below, not left to a hang
                log_step(step, loss, norm, lr, ms, tok_s, mfu_frac, skip)
            except Exception as e:
                if dp is None:
                    raise
                step_log_error = e
            result.last_step = step + 1
            saved = False
            if out_dir and opts.checkpoint_every > 0 and (step + 1) % opts.checkpoint_every == 0 and step + 1 < steps:
                checkpoint(step + 1)
                saved = True
            # a signal reaches the ranks at different moments (torchrun passes one to each): they stop together
            stop_signal = received_signals[:1]
            if dp is not None:
                stop_signal, failed_rank = _agree_between_steps(dp, received_signals, step_log_error is not None,
                                                                backend.model.device)
                _stop_if_a_rank_failed(step_log_error, failed_rank, f"log step {step + 1}")
            if stop_signal and step + 1 < steps:
                result.stopped_by = signal.Signals(stop_signal[0]).name
                if out_dir and not saved:
                    checkpoint(step + 1)
                where = (f"checkpoint of step {step + 1} in {out_dir}; continue with -y 1" if out_dir
                         else "no -o, so nothing was saved")
                log(f"stopped by {result.stopped_by} after step {step + 1}/{steps}: {where}")
                break
        if result.stopped_by is None:
            # a signal during the last step (agreed by the ranks as after any step): the run is trained, so its
            # checkpoint is written and the final validation and sample are skipped
            skipped = ["validation"] * bool(stop_signal and val_loader is not None)
            if not stop_signal:
                validate(steps)
            if out_dir:  # before the sample, so that nothing in sampling can cost the run its last checkpoint
                checkpoint(steps)
            if dp is None:  # one during the final validation or checkpoint too (ranks would first have to agree)
                stop_signal = stop_signal or received_signals[:1]
            if stop_signal:
                result.stopped_by = signal.Signals(stop_signal[0]).name
                skipped += ["sample"] * (opts.gen_tokens > 0)
                where = f"checkpoint of step {steps} in {out_dir}" if out_dir else "no -o, so nothing was saved"
                log(f"stopped by {result.stopped_by} at the end of the run ({steps}/{steps} steps trained): {where}"
                    + (f"; the final {' and '.join(skipped)} skipped" if skipped else ""))
            else:
                nothing_to_save[0] = dp is None
                result.sample = sample(steps)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if progress is not None:
            progress.close()
        log_failed = run_log.close()
    if log_failed:  # reached only when nothing else failed
        raise LlmpyError(log_failed)
    if result.step_ms and writer:
        trained = result.last_step - start_step
        if len(result.step_ms) > 1:  # the median leaves out the first step, which compiles and warms up
            timed = sorted(result.step_ms[1:])
            speed = f"median {timed[len(timed) // 2]:.1f} ms/step"
        else:
            speed = f"{result.step_ms[0]:.1f} ms, warm-up included"
        log(f"done: {trained} step{'s' if trained != 1 else ''}, {speed}, "
            f"final train loss {result.train_losses[-1]:.4f}"
            + (f", val loss {result.val_losses[-1][1]:.4f}" if result.val_losses else ""))
    return result
