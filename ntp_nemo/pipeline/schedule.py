"""Pipeline schedules as pure per-stage action lists, and a timing simulator for them.

A schedule says, for one stage of a `pp`-stage pipeline running `m` micro-batches, in which order
the stage runs the forward (F) and backward (B) of each micro-batch.  Both schedules keep forwards
and backwards in micro-batch order on every stage, so the activations and gradients crossing a
stage boundary arrive in the order they are received (FIFO matching, no tags needed).

- GPipe: all forwards, then all backwards; a stage holds the activations of all `m` micro-batches.
- 1F1B: `pp - stage - 1` warm-up forwards, then alternate one forward and one backward, then drain;
  a stage holds at most `min(m, pp - stage)` micro-batches.  `m < pp` needs no special case (the
  warm-up is cut short and the bubble grows), so no minimum micro-batch count is required.

With equal forward and backward times per stage both have the same bubble, (p - 1) / (m + p - 1)
of the step; `simulate` reproduces that and reports the peak activations each stage holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD | BACKWARD
    microbatch: int


def gpipe_order(stage: int, pp: int, m: int) -> list[Action]:
    return [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]


def one_f_one_b_order(stage: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - stage - 1, m)
    order = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [Action(FORWARD, i), Action(BACKWARD, i - warmup)]
    order += [Action(BACKWARD, i) for i in range(m - warmup, m)]
    return order


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
}


def schedule_order(name: str, stage: int, pp: int, m: int) -> list[Action]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[name](stage, pp, m)


def analytical_bubble(pp: int, m: int) -> float:
    """Idle fraction of a synchronous pipeline step with uniform stages: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (m + pp - 1) if m > 0 else 0.0


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: list[float]  # per stage
    peak_in_flight: list[int]  # per stage: most micro-batches whose activations are held at once

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the stages."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(name: str, pp: int, m: int, t_fwd: float = 1.0, t_bwd: float = 2.0,
             t_send: float = 0.0) -> SimResult:
    """Event-driven timing of a schedule: each stage runs its actions in order, as soon as their input
    (the previous stage's forward, the next stage's backward) has arrived `t_send` later."""
    orders = [schedule_order(name, s, pp, m) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    in_flight, peak = [0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                dep = (FORWARD, s - 1, a.microbatch) if a.kind == FORWARD else (BACKWARD, s + 1, a.microbatch)
                if a.kind == BACKWARD and s == pp - 1:
                    dep = (FORWARD, s, a.microbatch)
                if a.kind == FORWARD and s == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep] + (t_send if dep[1] != s else 0.0)
                else:
                    break
                start = max(clock[s], ready)
                clock[s] = start + (t_fwd if a.kind == FORWARD else t_bwd)
                done[(a.kind, s, a.microbatch)] = clock[s]
                in_flight[s] += 1 if a.kind == FORWARD else -1
                peak[s] = max(peak[s], in_flight[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks with pp={pp}, m={m}")
    return SimResult(max(clock), [m * (t_fwd + t_bwd)] * pp, peak)
