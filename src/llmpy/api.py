"""The Python API: the command line's three jobs as functions.

    import llmpy
    model = llmpy.create_model("layers=2,channels=64,heads=2,vocab=257")   # llm.c's random init
    result = llmpy.train(train_data="data/x_train_*.bin", model="d6", max_steps=100)
    print(llmpy.sample(result.model, "ROMEO:", tokenizer_dir="gpt2/"))   # d6: GPT-2's vocab, so its BPE
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields

from .config import GPT2Config
from .errors import LlmpyError, shown
from .rand import check_seed
from .reference import GPT2Reference
from .trainer import TrainOptions, TrainResult, load_or_create_model
from .trainer import train as _train


def _check_path_or_descriptor(value, name: str, what: str = "a descriptor or a model file's path") -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise LlmpyError(f"{name} {shown(value)}: must be {what} (a str)")
    return value


def create_model(descriptor: str = "d12", seed: int = 42) -> GPT2Reference:
    """A model from an `-e` descriptor with llm.c's random init (or from a model file's path)."""
    descriptor = _check_path_or_descriptor(descriptor, "descriptor")
    check_seed(seed, "seed")
    config, params = load_or_create_model(descriptor, int(seed))
    return GPT2Reference(config, params)


def load_model(path: str) -> GPT2Reference:
    """A model from an llm.c .bin file or a HuggingFace model.safetensors (file or folder)."""
    from .checkpoint import load_model_file
    config, flat, _dtype = load_model_file(_check_path_or_descriptor(path, "path", "a model file's path"))
    return GPT2Reference(config, flat.float())


def train(log=print, **options) -> TrainResult:
    """Train as `llmpy train` does; keyword names are TrainOptions' fields (batch_size=..., max_steps=...)."""
    if isinstance(log, (str, os.PathLike)):  # llmpy.train("data/*.bin"): the one positional argument is log
        raise LlmpyError(f"train({shown(log)}): options are given by name, as train(train_data=..., model=...); "
                         "the one positional argument is log, a function of one str")
    if not callable(log):  # checked before anything is read or written
        raise LlmpyError(f"train(): log={shown(log)} must be a function of one str (print, list.append, ...)")
    known = [f.name for f in fields(TrainOptions)]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise LlmpyError(f"train(): no option {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                                 "; the options are TrainOptions' fields"))
    return _train(TrainOptions(**options), log=log)


def sample(model, prompt: str = "", tokenizer: str = "auto", gen_tokens: int = 64,
           temperature: float = 1.0, top_k: int = 0, seed: int = 1337, tokenizer_dir=None) -> str:
    """Continue `prompt` with a GPT2Reference (create_model, load_model; train on the CPU) or the GPU
    model train returns on a GPU; returns the continuation, without the prompt. tokenizer "auto" picks bytes for a
    257-token vocab and GPT-2's BPE otherwise, whose files come from tokenizer_dir, else $LLMPY_GPT2_DIR, else
    tiktoken's cache; "bytes" also samples a larger vocab trained on byte-level tokens (train's demo run on a GPU),
    drawing from its first 257 ids."""
    from .sampler import check_sampling_options, sample_text, tokenizer_for_model
    from .tokenizer import refuse_files_for_bytes
    # llmpy's models only: another library's (a transformers GPT2LMHeadModel, with a config and a forward of its own)
    # passed a duck-typed check and failed inside sampling with an AttributeError traceback
    if not isinstance(getattr(model, "config", None), GPT2Config) or not (hasattr(model, "forward")
                                                                         or hasattr(model, "logits_last")):
        raise LlmpyError(f"sample(): model {shown(model)}: must be a model of llmpy's (create_model, load_model, or "
                         "train(...).model)" + (", not a path" if isinstance(model, (str, os.PathLike)) else
                                                "; load_model reads a model file or a transformers folder"))
    check_sampling_options(gen_tokens, temperature, top_k, seed)
    check_seed(seed)  # check_sampling_options lets None by (the trainer's samples): it would reach int()
    gen_tokens, temperature, top_k, seed = int(gen_tokens), float(temperature), int(top_k), int(seed)
    if not isinstance(tokenizer, str):
        raise LlmpyError(f"tokenizer {shown(tokenizer)}: must be 'auto', 'bytes' or 'gpt2'")
    if tokenizer_dir is not None and not isinstance(tokenizer_dir, (str, os.PathLike)):
        raise LlmpyError(f"tokenizer_dir {shown(tokenizer_dir)}: must be a folder's path")
    if tokenizer_dir is not None and not str(tokenizer_dir).strip():  # the tokenizer's own line named --tokenizer-dir
        raise LlmpyError(f"tokenizer_dir {str(tokenizer_dir)!r}: an empty folder name; leave it out (None) for "
                         "$LLMPY_GPT2_DIR or tiktoken's cache")
    refuse_files_for_bytes(tokenizer, tokenizer_dir, "tokenizer_dir")  # as `llmpy sample`
    tok = tokenizer_for_model(tokenizer, model.config.vocab_size, tokenizer_dir,
                              f"sample(): the model's vocab of {model.config.vocab_size}", "tokenizer_dir")
    return sample_text(model, tok, prompt, gen_tokens, temperature, top_k, seed)
