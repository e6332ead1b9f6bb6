"""Learning-rate schedules (llm.c's schedulers.h and `-k -l -u -q` flags).

Every schedule warms up linearly over the first `warmup` steps from lr/warmup to lr, then follows its
shape: constant stays at lr, the others go down towards lr * final_frac, which they reach at step
`total_steps` (one past the last update, as in llm.c). Steps count from 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import LlmpyError

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def check_final_frac(final_frac: float) -> None:
    """-q's one check, made by the trainer's options before anything loads and by every schedule (NaN fails it)."""
    if not 0.0 <= final_frac <= 1.0:
        raise LlmpyError(f"-q {final_frac}: the final learning-rate fraction must be between 0 and 1")


@dataclass(frozen=True)
class LRSchedule:
    kind: str = "cosine"
    lr: float = 3e-4
    warmup: int = 0
    total_steps: int = 1
    final_frac: float = 1.0
    decay_frac: float = 0.2  # wsd: the share of the steps, at the end, spent decaying

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise LlmpyError(f"-k {self.kind}: unknown learning-rate schedule; choose one of {', '.join(SCHEDULES)}")
        # one line naming the flag at fault (a NaN fails every comparison, so the checks are written to catch it)
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise LlmpyError(f"-l {self.lr}: the learning rate must be a finite number >= 0")
        if not self.warmup >= 0:
            raise LlmpyError(f"-u {self.warmup}: the warmup steps must be >= 0 (0: no warmup)")
        check_final_frac(self.final_frac)
        if not 0.0 <= self.decay_frac <= 1.0:  # no flag sets it: the Python API's LRSchedule(decay_frac=...)
            raise LlmpyError(f"decay_frac {self.decay_frac}: wsd's share of steps spent decaying must be "
                             "between 0 and 1")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        min_lr = self.lr * self.final_frac
        span = max(1, self.total_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "constant":
            return self.lr
        if self.kind == "linear":
            return self.lr - progress * (self.lr - min_lr)
        if self.kind == "cosine":
            return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - min_lr)
        # wsd (llm.c): stable at lr, then over the last decay_frac of all steps a 1 - sqrt decay to min_lr
        decay_start = int(self.total_steps * (1.0 - self.decay_frac))
        if step < decay_start:
            return self.lr
        frac = min(1.0, (step - decay_start) / max(1, self.total_steps - decay_start))
        return min_lr + (1.0 - math.sqrt(frac)) * (self.lr - min_lr)
