"""Outlier detection for loss and gradient norm (llm.c's outlier_detector.h): the z-score of a new
value against a moving window of the last 128 values, the new one included, as llm.c scores it. The training
loop skips the update of a step whose z-score is above `-sl` (loss) or `-sg` (gradient norm)."""
from __future__ import annotations

import math
import numbers
from collections import deque

from .errors import shown

OUTLIER_WINDOW = 128


class OutlierDetector:
    def __init__(self, window: int = OUTLIER_WINDOW):
        self.window = window
        self.values: deque[float] = deque(maxlen=window)

    def update(self, x: float) -> float:
        """Add x; return its z-score (nan while the window is still filling, and while it holds a NaN or an
        infinity, as llm.c's). As llm.c's detector, once the window is full the new value replaces the oldest
        and is scored against the window holding it."""
        x = float(x)  # a numpy float32 or a 0-d tensor: scored in float64, returned as a float
        full = len(self.values) == self.window
        self.values.append(x)
        if not full:
            return float("nan")
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        if std == 0.0:  # every value alike: llm.c's 0 (a NaN std, from a non-finite value, gives NaN below)
            return 0.0
        return (x - mean) / std

    def state_dict(self) -> dict:
        return {"window": self.window, "values": list(self.values)}

    def load_state_dict(self, state: dict):
        """A state_dict's window and values; one that cannot be a window (a checkpoint's damaged state) is a
        ValueError or TypeError, here and not at the next update."""
        window = state["window"]
        # numpy's integers too; past 2**31 a deque's length overflows (and no run is that long)
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or not 1 <= window <= 2**31:
            raise ValueError(f"outlier window {shown(window)}: must be an integer from 1 to 2**31")
        values = state["values"]
        if not isinstance(values, list) or len(values) > window or \
                not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            # float() would take "1.5" and a deque of the window's length would drop the surplus unseen
            raise ValueError(f"outlier values: must be a list of at most {int(window)} numbers")
        try:
            floats = [float(v) for v in values]
        except OverflowError:  # a JSON integer past float's range
            raise ValueError("outlier values: a number too large for a float") from None
        self.values = deque(floats, maxlen=int(window))
        self.window = int(window)
