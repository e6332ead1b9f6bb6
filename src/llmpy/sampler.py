"""Sampling tokens from a model's logits: temperature, top-k, a seeded generator."""
from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, vocab_size: int, generator: torch.Generator, temperature: float = 1.0,
                top_k: int = 0) -> int:
    """One token id from a row of logits (only the first vocab_size columns are real).

    temperature 0 takes the most likely token; top_k > 0 keeps the k most likely before sampling.
    """
    row = logits[:vocab_size].float().cpu()
    if temperature <= 0:
        return int(row.argmax())
    row = row / temperature
    if 0 < top_k < vocab_size:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(next_logits, prompt: list[int], steps: int, vocab_size: int, max_seq_len: int, seed: int = 1337,
             temperature: float = 1.0, top_k: int = 0, stop_token: int | None = None) -> list[int]:
    """Extend prompt by up to `steps` tokens. next_logits(tokens) returns the logits row that follows
    the given token list (the caller crops the context to max_seq_len; so do we)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(steps):
        context = tokens[-max_seq_len:]
        tok = sample_next(next_logits(context), vocab_size, gen, temperature, top_k)
        tokens.append(tok)
        if stop_token is not None and tok == stop_token:
            break
    return tokens[len(prompt):]
