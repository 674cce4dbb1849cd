"""Synthetic goodput event streams of any length, written through the real `GoodputRecorder`.

`write_stream(path, steps=..., failures=...)` writes what a long job's rank 0, launcher and supervisor
would record: a job_start and init_done, steps with their layout, capacity and tokens, periodic
checkpoint saves (blocking part and background commit), input stalls, and failures of three kinds drawn
from the fault campaign's: a loss recovered live inside a step (failure_detected and recovery_done with
`recovery_s`, the steps after it on the degraded layout, the repaired rank rejoining a few steps later
with its own recovery_done), a loss recovered by restart (the supervisor's failure_detected and a new
lifetime that restores the last checkpoint and redoes the steps after it), and a lifetime that dies
without a word (an implicit failure).  The clock is synthetic (`t` starts at `t0` and advances by the
modelled durations), so a stream of two million events is written in seconds and reads like a month of
training.  Used by the goodput tests and `bench/goodput_scale.py`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ntp_nemo.goodput.events as ev
from ntp_nemo.goodput.recorder import GoodputRecorder, goodput_path

LIVE, RESTART, SILENT = "live", "restart", "silent"
KINDS = (LIVE, RESTART, SILENT)


@dataclass(frozen=True)
class StreamShape:
    """What a synthetic stream holds (`write_stream`'s arguments, kept with the file's description)."""

    steps: int
    failures: int = 0
    seed: int = 0
    step_s: float = 0.5
    ckpt_every: int = 1000
    kinds: tuple[str, ...] = KINDS
    data_wait_every: int = 50
    repair_after: int = 20  # steps a live-recovered job runs degraded before the repaired rank rejoins
    t0: float = 1.8e9


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _failure_steps(shape: StreamShape, rng: random.Random) -> dict[int, str]:
    """Which steps fail, and how: spread evenly with jitter, never two within a repair of each other."""
    if shape.failures <= 0:
        return {}
    gap = shape.steps / (shape.failures + 1)
    if gap < shape.repair_after + 3:
        raise ValueError(f"{shape.failures} failures in {shape.steps} steps leave {gap:.1f} steps between "
                         f"failures; each needs more than repair_after + 3 = {shape.repair_after + 3}")
    out: dict[int, str] = {}
    for i in range(1, shape.failures + 1):
        jitter = int(rng.uniform(-0.2, 0.2) * gap)
        out[max(2, int(i * gap) + jitter)] = rng.choice(shape.kinds)
    return out


def write_stream(path: str | Path, shape: StreamShape) -> Path:
    """Append the events of `shape` to `path` (a run directory or a .jsonl file); returns the file."""
    file = goodput_path(path)
    rng = random.Random(shape.seed)
    clock = _Clock(shape.t0)
    fails = _failure_steps(shape, rng)
    full, degraded = "(4,4)", "(4,3)"
    with GoodputRecorder(file, fsync=False, clock=clock) as rec:

        def at(dt: float, event: str, **fields: object) -> None:
            clock.t += dt
            rec.record(event, **fields)

        def start_lifetime(attempt: int, reason: str) -> None:
            at(0.0, ev.JOB_START, layout=full, attempt=attempt, reason=reason)
            at(rng.uniform(20, 40), ev.INIT_DONE, step=0)

        start_lifetime(0, "start")
        step, ckpt, attempt, rejoin_at = 0, 0, 0, None
        layout, capacity = full, 1.0
        while step < shape.steps:
            step += 1
            if shape.data_wait_every and step % shape.data_wait_every == 0:
                wait = rng.uniform(0.002, 0.02)
                at(wait + 0.001, ev.DATA_WAIT, seconds=wait, step=step)
            at(0.002, ev.STEP_START, step=step)
            if rejoin_at == step:  # the repaired rank rejoins at the start of a step
                seconds = rng.uniform(0.5, 2.0)
                at(seconds, ev.RECOVERY_DONE, layout=full, step=step, mode=LIVE, rejoin=True,
                   recovery_s=seconds, generation=attempt)
                layout, capacity, rejoin_at = full, 1.0, None
            kind = fails.pop(step, None)  # a failure happens once: the redone step succeeds
            if kind == LIVE:
                rank = rng.randrange(16)
                at(rng.uniform(0.05, 0.9) * shape.step_s, ev.FAILURE_DETECTED, rank=rank, ranks=[rank],
                   process=rank, processes=[rank], reason="collective error", step=step,
                   detail="live recovery")
                seconds = rng.uniform(0.5, 5.0)
                at(seconds + rng.uniform(0.01, 0.1), ev.RECOVERY_DONE, layout=degraded, step=step,
                   mode=LIVE, recovery_s=seconds, generation=attempt)
                layout, capacity, rejoin_at = degraded, 15 / 16, step + shape.repair_after
            elif kind in (RESTART, SILENT):
                at(rng.uniform(0.05, 0.9) * shape.step_s, ev.STEP_END, step=step, layout=layout,
                   capacity=capacity, tokens=4096)
                at(0.002, ev.STEP_START, step=step + 1)  # dies in the next step
                clock.t += rng.uniform(0.1, 0.9) * shape.step_s
                if kind == RESTART:
                    rank = rng.randrange(16)
                    at(rng.uniform(1, 30), ev.FAILURE_DETECTED, rank=rank, ranks=[rank],
                       reason="exit code -9", step=step + 1, detail="worker died")
                attempt += 1
                clock.t += rng.uniform(1, 10)
                start_lifetime(attempt, "relaunch after a failure")
                if ckpt:
                    at(0.001, ev.CKPT_RESTORE_START)
                    at(rng.uniform(2, 8), ev.CKPT_RESTORE_END, step=ckpt)
                if kind == RESTART:
                    at(0.001, ev.RECOVERY_DONE, layout=full, step=ckpt + 1, mode=RESTART)
                step, layout, capacity, rejoin_at = ckpt, full, 1.0, None
                continue
            at(rng.uniform(0.9, 1.1) * shape.step_s, ev.STEP_END, step=step, layout=layout,
               capacity=capacity, tokens=4096)
            if shape.ckpt_every and step % shape.ckpt_every == 0:
                at(0.001, ev.CKPT_SAVE_START, step=step)
                blocking = rng.uniform(0.1, 0.5)
                at(blocking, ev.CKPT_SAVE_END, step=step, blocking_s=blocking)
                ckpt = step
                pending_commit = step
            else:
                pending_commit = None
            if pending_commit is not None:
                rec.record(ev.CKPT_COMMIT, step=pending_commit, ok=True)
        at(0.01, ev.JOB_END, status=ev.STATUS_OK, step=step)
    return file


def events_of(shape: StreamShape, directory: str | Path) -> Iterator[dict]:
    """Write `shape` into `directory` and read its events back (as `load_events` does)."""
    from ntp_nemo.goodput.calculator import load_events

    yield from load_events(write_stream(directory, shape))
