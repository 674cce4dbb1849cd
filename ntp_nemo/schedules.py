"""Learning-rate schedules (plain functions: usable without Lightning, e.g. by benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(warmup: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR factor: linear warmup over `warmup` steps, then cosine decay to `min_ratio` at `max_steps`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
