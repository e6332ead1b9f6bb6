"""Sampling tokens from a model's logits (temperature, top-k, a seeded generator), and the
`llmpy sample MODEL --prompt TEXT` command (an llm.c .bin or a HuggingFace safetensors model)."""
from __future__ import annotations

import argparse
import codecs
import math
import numbers
import re
import sys
from typing import Callable

import torch

from .errors import LlmpyError
from .rand import check_seed


def check_sampling_options(gen_tokens: int, temperature: float, top_k: int, seed: int | None = None) -> None:
    """-g, --temperature, --top-k (and --seed) as `llmpy train`, `llmpy sample` and the API take them: one line
    naming a bad one."""
    for value, flag in ((gen_tokens, "-g"), (top_k, "--top-k")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's integers too
            raise LlmpyError(f"{flag} {value!r}: must be an integer")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise LlmpyError(f"--temperature {temperature!r}: must be a number")
    if seed is not None:
        check_seed(seed)
    try:
        finite = math.isfinite(temperature)  # a NaN passes the comparison below
    except OverflowError:  # an integer beyond a float's range
        raise LlmpyError(f"--temperature {str(temperature)[:20]}...: too large for a number") from None
    if not finite:
        raise LlmpyError(f"--temperature {temperature}: must be a finite number")
    for value, flag, zero in ((gen_tokens, "-g", ""), (temperature, "--temperature", " (0: greedy)"),
                              (top_k, "--top-k", " (0: all)")):
        if value < 0:
            raise LlmpyError(f"{flag} {value}: must be >= 0{zero}")


# C0 controls but tab and newline, DEL and C1: a sample from a young model holds any byte, and an escape or carriage
# return printed raw would rewrite the terminal rather than show what the model wrote
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """text as a terminal or log should show it: control characters (but tab and newline) escaped as \\xNN."""
    return _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def sample_next(logits: torch.Tensor, vocab_size: int, generator: torch.Generator, temperature: float = 1.0,
                top_k: int = 0) -> int:
    """One token id from a row of logits (only the first vocab_size columns are real).

    temperature 0 takes the most likely token; top_k > 0 keeps the k most likely before sampling.
    """
    row = logits[:vocab_size].float().cpu()
    if not torch.isfinite(row).all():
        raise LlmpyError("sampling: the model's logits are not finite (its weights have diverged)")
    if temperature <= 0:
        return int(row.argmax())
    scaled = row / temperature
    if not torch.isfinite(scaled).all():  # a temperature so small that logits over it overflow: shift them first
        # in float64, where a temperature below float32's range stays > 0; the largest is 0, the others 0 (ties)
        # or -inf: greedy's limit
        scaled = (row.double() - row.max()) / temperature
    row = scaled
    if 0 < top_k < vocab_size:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(next_logits, prompt: list[int], steps: int, vocab_size: int, max_seq_len: int, seed: int = 1337,
             temperature: float = 1.0, top_k: int = 0, stop_token: int | None = None,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """Extend prompt by up to `steps` tokens. next_logits(tokens) returns the logits row that follows
    the given token list (the caller crops the context to max_seq_len; so do we); on_token(id) sees each new one."""
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(steps):
        context = tokens[-max_seq_len:]
        tok = sample_next(next_logits(context), vocab_size, gen, temperature, top_k)
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if stop_token is not None and tok == stop_token:
            break
    return tokens[len(prompt):]


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("model", metavar="MODEL", help="model file: llm.c .bin, model.safetensors or its folder")
    parser.add_argument("--prompt", default="", help="text to continue (default: start from end-of-text)")
    parser.add_argument("-g", "--gen-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default: 0, all)")
    parser.add_argument("--seed", type=int, default=1337, help="sampling seed (default: 1337)")
    parser.add_argument("--tokenizer", choices=("auto", "gpt2", "bytes"), default="auto",
                        help="auto: bytes for a 257-token vocab or a run on byte-level tokens (its state file "
                             "beside the model says so), else gpt2")
    parser.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                        help="folder with GPT-2's encoder.json and vocab.bpe (default: $LLMPY_GPT2_DIR, else "
                             "tiktoken's cache; nothing is downloaded)")


def check_prompt(prompt) -> None:
    """A prompt must be text that encodes as UTF-8: one line naming the bytes that do not."""
    if not isinstance(prompt, str):
        raise LlmpyError(f"prompt {prompt!r}: must be text (a str)")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end]
        if all("\udc80" <= c <= "\udcff" for c in bad):  # bytes the terminal passed that are not UTF-8 (Python keeps
            # them as these surrogates)
            raise LlmpyError(f"--prompt: not UTF-8 text (the bytes {bad.encode('utf-8', 'surrogateescape')!r} at "
                             f"character {e.start})") from None
        # a str made in Python ("\ud800"): no bytes behind it
        raise LlmpyError(f"--prompt: a lone surrogate {bad!r} at character {e.start}, not Unicode text") from None


def tokenizer_for_model(name: str, vocab_size: int, tokenizer_dir, model_vocab: str,
                        dir_label: str = "--tokenizer-dir", byte_trained: bool = False):
    """The tokenizer `llmpy sample` and the API sample with: "auto" is bytes for a 257-token vocab or a model
    trained on byte-level tokens (`byte_trained`), GPT-2's BPE otherwise; its vocabulary must be the model's, but
    bytes also serve a larger vocab, as the ids 0-256 of it (`model_vocab` begins the error line, naming the model)."""
    from .tokenizer import GPT2_VOCAB_SIZE, TOKENIZER_NAMES, ByteTokenizer, load_tokenizer
    key = name.strip().lower()
    if key not in ("auto", "byte", *TOKENIZER_NAMES):  # load_tokenizer's own line would leave auto out
        raise LlmpyError(f"unknown tokenizer {name!r}: expected one of auto, {', '.join(TOKENIZER_NAMES)}")
    if key in ("bytes", "byte") and vocab_size > ByteTokenizer.vocab_size:
        # byte-level data in a larger vocab (the demo run on a GPU: GPT-2 124M on the embedded corpus); sampling
        # draws from the bytes' ids only (sample_text)
        return ByteTokenizer()
    if key == "auto" and byte_trained:
        if tokenizer_dir is not None:  # as for a 257-token vocab: a folder no one reads is one line
            raise LlmpyError(f"{dir_label} {str(tokenizer_dir)!r}: the model's run trained on byte-level tokens, "
                             "which the bytes tokenizer samples without files; leave it out, or give --tokenizer gpt2")
        return tokenizer_for_model("bytes", vocab_size, tokenizer_dir, model_vocab, dir_label)
    if key == "auto":
        if vocab_size not in (257, GPT2_VOCAB_SIZE):  # not GPT-2's files missing, as loading them would say
            raise LlmpyError(f"{model_vocab} fits neither of llmpy's tokenizers (bytes: 257 tokens, gpt2: "
                             f"{GPT2_VOCAB_SIZE}); sample a model of one of those vocabularies")
        name = "bytes" if vocab_size == 257 else "gpt2"
        if name == "bytes" and tokenizer_dir is not None:  # read by no one: even a missing folder passed silently
            raise LlmpyError(f"{dir_label} {str(tokenizer_dir)!r}: the model's 257-token vocab samples with the bytes "
                             "tokenizer, which has no files; leave it out")
    if name.strip().lower() == "gpt2" and vocab_size != GPT2_VOCAB_SIZE:  # before looking for files it cannot use
        raise LlmpyError(f"{model_vocab} does not match the gpt2 tokenizer's {GPT2_VOCAB_SIZE}")
    tokenizer = load_tokenizer(name, tokenizer_dir)
    if tokenizer.vocab_size != vocab_size:
        raise LlmpyError(f"{model_vocab} does not match the {tokenizer.name} tokenizer's {tokenizer.vocab_size}")
    return tokenizer


def sample_text(model, tokenizer, prompt: str = "", gen_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
                seed: int = 1337, on_text: Callable[[str], None] | None = None) -> str:
    """Continue `prompt` with the CPU reference model (forward(inputs), then .logits) or the GPU model
    (logits_last(tokens): its fixed (B, T) batch, the context cropped to its last T tokens). on_text, if given, gets
    the continuation piece by piece as it is generated, each piece whole UTF-8 characters where the tokens allow."""
    check_sampling_options(gen_tokens, temperature, top_k)  # the seed is the caller's (train's is seed + step)
    check_prompt(prompt)
    config = model.config
    start = [tokenizer.eot] + (tokenizer.encode(prompt) if prompt else [])

    def next_logits(ctx):
        if hasattr(model, "logits_last"):
            return model.logits_last([ctx])[0]
        model.forward(torch.tensor([ctx]))
        return model.logits[0, -1]
    # the tokens' bytes through an incremental UTF-8 decoder: a piece is let out as soon as its characters are
    # whole or certainly broken (at most 3 bytes held), and the pieces join to the decoded sample exactly
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def stream(token: int):
        piece = utf8.decode(tokenizer.token_bytes(token))
        if piece:
            on_text(piece)
    # a byte-level model of a larger vocab draws from the bytes' ids alone: the rest never came up in training
    drawn_vocab = min(config.vocab_size, tokenizer.vocab_size)
    ids = generate(next_logits, start, gen_tokens, drawn_vocab, config.max_seq_len, seed=seed,
                   temperature=temperature, top_k=top_k, on_token=stream if on_text is not None else None)
    if on_text is not None:
        rest = utf8.decode(b"", final=True)  # a character the sample ends inside of: U+FFFD
        if rest:
            on_text(rest)
    return tokenizer.decode(ids)


def run(args: argparse.Namespace) -> int:
    from .checkpoint import load_model_file
    from .reference import GPT2Reference
    from .tokenizer import refuse_files_for_bytes
    from .training_state import run_tokenizer
    check_sampling_options(args.gen_tokens, args.temperature, args.top_k, args.seed)
    check_prompt(args.prompt)  # before the model loads and the prompt is shown
    refuse_files_for_bytes(args.tokenizer, args.tokenizer_dir, "--tokenizer-dir")  # "auto": for GPT-2 models only
    config, flat, _ = load_model_file(args.model)
    byte_trained = args.tokenizer == "auto" and config.vocab_size != 257 and run_tokenizer(args.model) == "bytes"
    tokenizer = tokenizer_for_model(args.tokenizer, config.vocab_size, args.tokenizer_dir,
                                    f"{args.model}: vocab {config.vocab_size}", byte_trained=byte_trained)
    if byte_trained:
        print(f"note: {args.model}: its run trained on byte-level tokens (the state file beside it says so): "
              "sampled with the bytes tokenizer", file=sys.stderr)
    model = GPT2Reference(config, flat.float())
    seen = 1 + len(tokenizer.encode(args.prompt)) if args.prompt else 1  # the end-of-text token leads
    if seen > config.max_seq_len:
        print(f"note: the prompt is {seen} tokens with the end-of-text before it, and the model's context "
              f"{config.max_seq_len}: each token is drawn from the last {config.max_seq_len} only", file=sys.stderr)

    def show(piece: str):  # as it comes: a long sample is not silent until its end
        # what the output cannot encode is escaped (cli.main); print writes nothing where there is no stdout (>&-)
        print(printable(piece), end="", flush=True)
    show(args.prompt)
    try:
        sample_text(model, tokenizer, args.prompt, args.gen_tokens, args.temperature, args.top_k, args.seed,
                    on_text=show)
    finally:  # an error's line, or the shell's prompt, starts on a line of its own
        show("\n")
    return 0
