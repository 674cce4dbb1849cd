"""The cross replay's verdict: a suspect value that a replay on the same rank repeated, against the same
micro-batches computed by another replica (the integrity watch's bad-device test).

A rank of replica `p` whose own largest gradient element of a parameter (or largest layer input) stood
out of its stage's other ranks, on the step and again on its replay, is either a bad device or honest
data (a sample unlike the others).  The micro-batches of replica `p` are then computed again, forward and
backward with no DP sync and no update, by replica `(p - 1) % dp` (`cross_source`: each replica computes
the next one's, so every replica's step has a second opinion at the cost of one more step's compute).
The same micro-batches give the same gradient whatever the TP degree, up to the rounding of a different
summation order: each replica's row (the largest over its ranks of the stage, `replica_rows`: the same
quantity whatever the sharding) agrees with the other's within `tolerance(dtype)`.  A value the other
replica does not reproduce is the device's; one it reproduces is the data's.

The tolerance is the square root of the compute dtype's machine epsilon (float32: 3.5e-4, bfloat16:
0.088), relative to the larger of the two values and of the other replica's largest gradient element
of the stage (the scale of the step's rounding); a flipped exponent bit that makes a value stand out
changes it by 2x at least (a relative difference of 0.5 or more).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def tolerance(dtype: torch.dtype) -> float:
    """How far two computations of the same gradients in `dtype` may differ, relatively (sqrt(eps))."""
    return float(torch.finfo(dtype).eps) ** 0.5


def cross_source(replica: int, dp: int) -> int:
    """The replica whose micro-batches `replica` computes in a cross replay (the next one)."""
    return (replica + 1) % dp


def replica_rows(own: Sequence[float], stages: Sequence[int], replicas: Sequence[int]
                 ) -> dict[tuple[int, int], torch.Tensor]:
    """(replica, stage) -> the largest of each slot over the replica's ranks of the stage (NaN when one
    is NaN; < 0: held by none), from every rank's row flattened (index = global rank)."""
    world = len(stages)
    vals = torch.tensor(list(own), dtype=torch.float64).view(world, -1)
    out = {}
    for key in sorted(set(zip(replicas, stages, strict=True))):
        idx = [r for r in range(world) if (replicas[r], stages[r]) == key]
        out[key] = vals[idx].amax(dim=0)  # amax propagates NaN
    return out


def relative_difference(a: float, b: float, scale: float) -> float:
    """|a - b| relative to max(|a|, |b|, scale); 0 when both are not finite, inf when one is."""
    fa, fb = a == a and abs(a) != float("inf"), b == b and abs(b) != float("inf")
    if not fa or not fb:
        return 0.0 if fa == fb else float("inf")
    denom = max(abs(a), abs(b), scale)
    return abs(a - b) / denom if denom > 0 else 0.0


@dataclass(frozen=True)
class CrossVerdict:
    """What the cross replay found: the suspect (rank, slot)s the other replica did not reproduce, the
    largest relative difference among the suspects' slots, and among every other slot of the suspects'
    replicas held by both (the honest agreement of the two computations, the margin below `tolerance`,
    when the fault touched one element only: a corrupted activation moves every gradient computed after
    it; the suspect replicas' own computations of the other replicas' micro-batches are not compared: a
    bad device may be among them)."""

    unreproduced: tuple[tuple[int, int], ...]
    suspect_diff: float
    honest_diff: float


def cross_verdict(suspects: Sequence[tuple[int, int]], replayed: Sequence[float], crossed: Sequence[float],
                  stages: Sequence[int], replicas: Sequence[int], dp: int, tol: float) -> CrossVerdict:
    """`suspects`: (rank, slot) pairs the replay repeated; `replayed`: every rank's row of the replay on
    the same ranks; `crossed`: every rank's row of the cross replay (replica q computed the micro-batches
    of replica `cross_source(q, dp)`).  Compares, per (replica, stage), the replica's replayed row with
    the row of the replica that computed its micro-batches."""
    mine = replica_rows(replayed, stages, replicas)
    other = replica_rows(crossed, stages, replicas)
    by_source = {(cross_source(q, dp), stage): row for (q, stage), row in other.items()}
    suspect_slots = {(replicas[r], stages[r], slot) for r, slot in suspects}
    unreproduced, suspect_diff, honest_diff = [], 0.0, 0.0
    diffs: dict[tuple[int, int, int], float] = {}
    suspect_replicas = {replicas[r] for r, _ in suspects}
    for (p, stage), a_row in mine.items():
        b_row = by_source.get((p, stage))
        if b_row is None or p == cross_source(p, dp) or p not in suspect_replicas:
            continue
        grads = b_row[:-1]
        held = grads[(grads >= 0) & torch.isfinite(grads)]
        grad_scale = float(held.max()) if held.numel() else 0.0
        for j in range(a_row.numel()):
            a, b = float(a_row[j]), float(b_row[j])
            if (a == a and a < 0) or (b == b and b < 0):
                continue  # not held by one of them
            d = relative_difference(a, b, grad_scale if j < a_row.numel() - 1 else 0.0)
            diffs[(p, stage, j)] = d
            if (p, stage, j) not in suspect_slots:
                honest_diff = max(honest_diff, d)
    for r, slot in suspects:
        d = diffs.get((replicas[r], stages[r], slot))
        if d is None:
            continue
        suspect_diff = max(suspect_diff, d)
        if d > tol:
            unreproduced.append((r, slot))
    return CrossVerdict(tuple(unreproduced), suspect_diff, honest_diff)


__all__ = ["CrossVerdict", "cross_source", "cross_verdict", "relative_difference", "replica_rows",
           "tolerance"]
