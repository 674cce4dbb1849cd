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

- Interleaved 1F1B (`interleaved_1f1b`, `v` virtual stages): each stage holds `v` model chunks
  (chunk `c` of stage `s` is virtual stage `c * p + s`; the last stage's chunk `c` feeds the first
  stage's chunk `c + 1`).  Forwards run micro-batches in groups of `p`, chunk by chunk inside a group
  (backwards: chunks in reverse), after `2 (p - s - 1) + (v - 1) p` warm-up forwards, as in
  Megatron-LM.  The bubble shrinks to (p - 1) / (v m + p - 1) of the step.  A group may be smaller
  than `p` (any `m` works; the bubble then grows).  On every link the messages of all chunks are sent
  and received in the same global (group, chunk, micro-batch) order, so FIFO matching still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD | BACKWARD
    microbatch: int
    chunk: int = 0  # model chunk (virtual stage index on this stage) of an interleaved schedule


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
INTERLEAVED = "interleaved_1f1b"


def interleaved_layers(num_layers: int, pp: int, v: int, stage: int) -> list[range]:
    """Global layer indices of each chunk of `stage`: virtual stage `c * pp + stage` of an even split
    of the layers into `pp * v` virtual stages."""
    n = pp * v
    if num_layers < n:
        raise ValueError(f"{num_layers} layers cannot fill {pp} stages x {v} virtual stages")
    return [range(((c * pp + stage) * num_layers) // n, ((c * pp + stage + 1) * num_layers) // n)
            for c in range(v)]


def _interleaved_sequence(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in execution order: groups of `pp` micro-batches, chunk-major inside."""
    seq = []
    for g0 in range(0, m, pp):
        group = range(g0, min(g0 + pp, m))
        for c in (reversed(range(v)) if backward else range(v)):
            seq += [(c, mb) for mb in group]
    return seq


def _interleaved_stage_order(stage: int, pp: int, m: int, v: int, extra: int) -> list[Action]:
    fwd = [Action(FORWARD, mb, c) for c, mb in _interleaved_sequence(pp, m, v, False)]
    bwd = [Action(BACKWARD, mb, c) for c, mb in _interleaved_sequence(pp, m, v, True)]
    total = len(fwd)
    warmup = min(2 * (pp - stage - 1) + (v - 1) * pp + extra, total)
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup:]


def interleaved_order(stage: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's warm-up when `pp` divides `m`; with a partial last group that warm-up can deadlock
    (e.g. pp=4, v=3, m=5), so every stage adds the fewest extra warm-up forwards that make the whole
    pipeline run (a pure function of pp, m, v: all stages agree; all forwards first always runs)."""
    for extra in range(m * v + 1):
        orders = [_interleaved_stage_order(s, pp, m, v, extra) for s in range(pp)]
        if _runs(orders, pp, v):
            return orders[stage]
    raise AssertionError("unreachable: all forwards before all backwards never deadlocks")


def schedule_order(name: str, stage: int, pp: int, m: int, v: int = 1) -> list[Action]:
    if name == INTERLEAVED:
        return interleaved_order(stage, pp, m, v)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES) + [INTERLEAVED]}")
    return SCHEDULES[name](stage, pp, m)


def analytical_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step with uniform stages: (p - 1) / (v m + p - 1)
    (v = 1: GPipe and 1F1B; v virtual stages: interleaved 1F1B, whose bubble is (p - 1) / (v m) of
    the ideal step)."""
    return (pp - 1) / (v * m + pp - 1) if m > 0 else 0.0


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: list[float]  # per stage
    peak_in_flight: list[int]  # per stage: most micro-batches whose activations are held at once

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the stages."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def _dependency(a: Action, s: int, pp: int, v: int) -> tuple[str, int, int, int] | None:
    """The action whose output `a` on stage `s` consumes: (kind, stage, chunk, micro-batch)."""
    if a.kind == FORWARD:
        if s > 0:
            return (FORWARD, s - 1, a.chunk, a.microbatch)
        return (FORWARD, pp - 1, a.chunk - 1, a.microbatch) if a.chunk > 0 else None
    if s < pp - 1:
        return (BACKWARD, s + 1, a.chunk, a.microbatch)
    if a.chunk < v - 1:
        return (BACKWARD, 0, a.chunk + 1, a.microbatch)
    return (FORWARD, s, a.chunk, a.microbatch)


def _runs(orders: list[list[Action]], pp: int, v: int) -> bool:
    """Whether stages running `orders` (each in order, waiting for their inputs) all finish."""
    done: set[tuple[str, int, int, int]] = set()
    pos = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                dep = _dependency(a, s, pp, v)
                if dep is not None and dep not in done:
                    break
                done.add((a.kind, s, a.chunk, a.microbatch))
                pos[s] += 1
                progressed = True
    return all(p == len(o) for p, o in zip(pos, orders, strict=True))


def simulate(name: str, pp: int, m: int, t_fwd: float = 1.0, t_bwd: float = 2.0,
             t_send: float = 0.0, v: int = 1) -> SimResult:
    """Event-driven timing of a schedule: each stage runs its actions in order, as soon as their input
    (the previous stage's forward, the next stage's backward) has arrived `t_send` later.  With `v`
    virtual stages each chunk takes 1/v of the stage's forward/backward time."""
    v = v if name == INTERLEAVED else 1
    orders = [schedule_order(name, s, pp, m, v) for s in range(pp)]
    tf, tb = t_fwd / v, t_bwd / v
    done: dict[tuple[str, int, int, int], float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    in_flight, peak = [0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                dep = _dependency(a, s, pp, v)
                if dep is None:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep] + (t_send if dep[1] != s else 0.0)
                else:
                    break
                start = max(clock[s], ready)
                clock[s] = start + (tf if a.kind == FORWARD else tb)
                done[(a.kind, s, a.chunk, a.microbatch)] = clock[s]
                in_flight[s] += 1 if a.kind == FORWARD else -1
                peak[s] = max(peak[s], in_flight[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks with pp={pp}, m={m}, v={v}")
    return SimResult(max(clock), [m * (t_fwd + t_bwd)] * pp, peak)
