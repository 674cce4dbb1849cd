"""Capacity-proportional assignment of a step's micro-batches to data-parallel replicas.

A replica running at reduced TP (or power-boosted) gets a share of the fixed global batch in
proportion to its capacity. Shares are rounded with the largest-remainder method, computed in
exact rational arithmetic so every process gets the same answer: each replica gets the floor of its
quota, and the micro-batches left over go to the largest fractional parts, ties to the lower
replica index. Every count is therefore within one of its exact quota, and the total is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction


def assign_microbatches(num_microbatches: int, capacities: Sequence[float]) -> list[int]:
    """Micro-batch count per replica, proportional to `capacities`, summing to `num_microbatches`."""
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    if not capacities:
        raise ValueError("capacities must name at least one replica")
    if any(not math.isfinite(c) or c < 0 for c in capacities):
        raise ValueError(f"capacities must be finite and >= 0, got {list(capacities)}")
    caps = [Fraction(c) for c in capacities]
    total = sum(caps)
    if total == 0:
        if num_microbatches == 0:
            return [0] * len(caps)
        raise ValueError("at least one replica needs a positive capacity")
    quotas = [num_microbatches * c / total for c in caps]
    counts = [math.floor(q) for q in quotas]
    leftover = num_microbatches - sum(counts)
    order = sorted(range(len(caps)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:leftover]:
        counts[i] += 1
    return counts


def replica_microbatch_slices(counts: Sequence[int]) -> list[range]:
    """Consecutive ranges of global micro-batch indices per replica, replica 0 first."""
    slices, begin = [], 0
    for n in counts:
        if n < 0:
            raise ValueError(f"counts must be >= 0, got {list(counts)}")
        slices.append(range(begin, begin + n))
        begin += n
    return slices
