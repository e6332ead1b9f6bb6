"""`llmpy export MODEL OUTDIR`: an llm.c .bin (fp32 or bf16) or HF safetensors model into a folder that
transformers' GPT2LMHeadModel.from_pretrained loads: model.safetensors (fp32), config.json and
generation_config.json. No tokenizer files are written (GPT-2's come from the hub: AutoTokenizer "gpt2")."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .errors import LlmpyError, shown

GENERATION_CONFIG_NAME = "generation_config.json"


def add_arguments(parser: argparse.ArgumentParser):
    parser.description = "Export a model to a HuggingFace transformers GPT2LMHeadModel folder."
    parser.add_argument("model", metavar="MODEL", help="model file: llm.c .bin, model.safetensors or its folder")
    parser.add_argument("out_dir", metavar="OUTDIR", help="folder to write (created if missing)")


def run(args: argparse.Namespace) -> int:
    from .checkpoint import HF_CONFIG_NAME, HF_WEIGHTS_NAME
    names = (HF_WEIGHTS_NAME, HF_CONFIG_NAME, GENERATION_CONFIG_NAME)
    from .files import expand_user
    replaced = [name for name in names if (expand_user(args.out_dir) / name).exists()]
    out = export_hf(args.model, args.out_dir)
    print(f"wrote {out}/ ({', '.join(names)})" + (f"; replaced the earlier {', '.join(replaced)}" if replaced else ""))
    return 0


def generation_config_dict(eos: int) -> dict:
    # what transformers derives from config.json itself; written so from_pretrained finds it
    return {"_from_model_config": True, "bos_token_id": eos, "eos_token_id": eos}


def export_hf(model_path, out_dir) -> Path:
    """Write the HF folder for `model_path` into out_dir; returns out_dir."""
    from .checkpoint import hf_config_dict, load_model_file, save_hf
    from .files import atomic_write, expand_user, refuse_non_file, writable_dir

    for value, name, what in ((model_path, "model", "a model file's path"),
                              (out_dir, "export folder", "a folder's path")):
        if not isinstance(value, (str, os.PathLike)):  # Path() raised a TypeError
            raise LlmpyError(f"{name} {shown(value)}: must be {what} (a str)")
    if not str(out_dir).strip():  # Path("") is the current folder: not what was meant
        raise LlmpyError("an empty export folder name")
    out = expand_user(out_dir)  # a quoted "~/hf" too, as train and prepare take it
    if out.exists() and not out.is_dir():
        raise LlmpyError(f"{out} exists and is not a directory")
    if out.suffix == ".safetensors":  # save_hf would read it as the weights file's own path, inside a new folder
        raise LlmpyError(f"{out}: the export is a folder (it gets model.safetensors, config.json, "
                         f"{GENERATION_CONFIG_NAME}); name one without the .safetensors suffix")
    src = expand_user(model_path)
    if src.exists() and out.exists() and src.resolve() == out.resolve():
        raise LlmpyError(f"{out}: exporting a folder onto itself")
    config, flat, _ = load_model_file(model_path)
    writable_dir(out, "export folder")
    refuse_non_file(out / GENERATION_CONFIG_NAME, "a file the export may replace")  # save_hf checks its two
    save_hf(out, config, flat.float())  # HF's GPT-2 is fp32 here; a bf16 .bin widens exactly
    eos = hf_config_dict(config)["eos_token_id"]
    text = json.dumps(generation_config_dict(eos), indent=2) + "\n"
    atomic_write(out / GENERATION_CONFIG_NAME, lambda f: f.write(text.encode()))
    return out
