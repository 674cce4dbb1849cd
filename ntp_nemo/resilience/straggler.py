"""Straggler detection: which rank computes persistently slower than the work model says for its share.

Every step each rank times its own compute (`runtime.compute_time.ComputeTimer`: its micro-batches'
forward and backward, not its waits for peers) and the step's fused all-reduce hands every rank every
rank's time, so each rank runs this detector on the same numbers and reaches the same verdicts without a
collective of its own.  Per rank and step the time is divided by the rank's modelled work on the layout
that ran the step (`share_units`: the work model's cost per token of its slices, `topology/work.py`, times
its replica's micro-batches), which makes ranks with unequal shares comparable.  Every `every` steps:

- each rank's figure is the median over the window (one slow step, a checkpoint or a GC pause, does not
  move it); the reference is the lower median over ranks (a healthy majority sets it), and a rank's speed
  is reference / its figure;
- a rank below `1 / (1 + margin)` for `persist` judgements in a row is a straggler; a straggler back above
  `1 / (1 + margin / 2)` for `persist` judgements has recovered (the gap keeps a borderline rank from
  flapping);
- the time lost waiting for slow ranks in the window: per step, how much longer the slowest of the ranks
  judged slow took than the work model's longest share at the reference speed.

Pure Python, no torch: the Lightning callback (`straggler_watch`), the tests and the benches feed it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ntp_nemo.topology.layout import ResolvedLayout
from ntp_nemo.topology.work import rank_costs


@dataclass(frozen=True)
class StragglerSettings:
    """The `fault.straggler*` keys (`fault_config.validate_straggler_config` checks them)."""

    policy: str = "rebalance"  # report | rebalance | exclude
    every: int = 5
    margin: float = 0.3
    persist: int = 2
    floor: float = 0.2

    @classmethod
    def from_config(cls, fault) -> StragglerSettings:
        return cls(str(fault.straggler), int(fault.straggler_every), float(fault.straggler_margin),
                   int(fault.straggler_persist), float(fault.straggler_floor))

    @property
    def slow_below(self) -> float:
        return 1.0 / (1.0 + self.margin)

    @property
    def recovered_above(self) -> float:
        return 1.0 / (1.0 + self.margin / 2)


def share_units(layout: ResolvedLayout) -> list[float]:
    """Per global rank, its modelled work per step on `layout` (arbitrary unit): the work model's cost per
    token of its slices (1 for every rank when the layout carries no work shape) times its replica's
    micro-batches."""
    world = layout.world_size
    costs = rank_costs(layout.work, layout.topology()) if layout.work is not None else [1.0] * world
    counts = layout.microbatch_counts()
    return [costs[r] * counts[layout.replica_of(r)] for r in range(layout.world_size)]


@dataclass(frozen=True)
class Judgement:
    """One judgement (every `every` steps) of every rank."""

    step: int  # the last step of the window
    speeds: tuple[float, ...]  # per rank: reference / its median time per unit (1: as the model says)
    slow: tuple[int, ...]  # ranks below the margin in this window
    stragglers: tuple[int, ...]  # ranks called stragglers after this judgement (persistent)
    new: tuple[int, ...]  # of those, called so by this judgement
    recovered: tuple[int, ...]  # ranks no longer stragglers since this judgement
    wait_s: float  # seconds the window's steps lost waiting for the slow ranks
    unit_s: float  # the reference: seconds per unit of modelled work (`share_units`)

    def speed_of(self, rank: int) -> float:
        return min(1.0, self.speeds[rank])


@dataclass
class StragglerDetector:
    settings: StragglerSettings
    _window: list[tuple[list[float], list[float]]] = field(default_factory=list)  # (compute_s, units)
    _slow_streak: dict[int, int] = field(default_factory=dict)
    _fast_streak: dict[int, int] = field(default_factory=dict)
    stragglers: set[int] = field(default_factory=set)
    world: int | None = None

    def reset(self) -> None:
        """Forget everything (the ranks were renumbered: a live recovery or rejoin)."""
        self._window.clear()
        self._slow_streak.clear()
        self._fast_streak.clear()
        self.stragglers = set()
        self.world = None

    def observe(self, step: int, compute_s: Sequence[float], units: Sequence[float]) -> Judgement | None:
        """Add step `step`'s per-rank compute seconds and modelled work; a judgement every `every` steps."""
        if self.world is not None and len(compute_s) != self.world:
            self.reset()
        self.world = len(compute_s)
        self._window.append((list(compute_s), list(units)))
        if step % self.settings.every:
            return None
        window, self._window = self._window, []
        return self._judge(step, window)

    def _judge(self, step: int, window: list[tuple[list[float], list[float]]]) -> Judgement | None:
        world = self.world or 0
        per_unit: list[float | None] = []
        for r in range(world):
            xs = [c[r] / u[r] for c, u in window if u[r] > 0 and c[r] > 0]
            per_unit.append(statistics.median(xs) if xs else None)
        known = [x for x in per_unit if x is not None]
        if not known:
            return None
        ref = statistics.median_low(known)
        speeds = tuple(1.0 if x is None else ref / x for x in per_unit)
        s = self.settings
        slow = tuple(r for r in range(world) if speeds[r] < s.slow_below)
        new, recovered = [], []
        for r in range(world):
            self._slow_streak[r] = self._slow_streak.get(r, 0) + 1 if r in slow else 0
            back = speeds[r] >= s.recovered_above
            self._fast_streak[r] = self._fast_streak.get(r, 0) + 1 if back else 0
            if r not in self.stragglers and self._slow_streak[r] >= s.persist:
                self.stragglers.add(r)
                new.append(r)
            elif r in self.stragglers and self._fast_streak[r] >= s.persist:
                self.stragglers.discard(r)
                recovered.append(r)
        wait = 0.0
        if slow:
            for c, u in window:
                wait += max(0.0, max(c[r] for r in slow) - ref * max(u))
        return Judgement(step, speeds, slow, tuple(sorted(self.stragglers)), tuple(new), tuple(recovered),
                         wait, ref)


def replica_speeds(layout: ResolvedLayout, judgement: Judgement, stragglers: Sequence[int],
                   step: float = 0.05) -> tuple[float, ...] | None:
    """Per replica of `layout`, the speed of its slowest straggler (1 without one), rounded down to a
    multiple of `step` (small changes of the estimate do not re-lay the job out); None when every replica
    runs at full speed."""
    out = [1.0] * layout.dp
    for r in stragglers:
        i = layout.replica_of(r)
        v = max(step, int(judgement.speed_of(r) / step) * step)
        out[i] = min(out[i], round(v, 6))
    return None if all(v == 1.0 for v in out) else tuple(out)


def predicted_compute_s(layout: ResolvedLayout, unit_s: float, rank_speeds: Sequence[float]) -> float:
    """The work model's compute time of a step on `layout`: the longest share at its rank's speed."""
    units = share_units(layout)
    return max(u * unit_s / max(v, 1e-9) for u, v in zip(units, rank_speeds, strict=True))


__all__ = ["Judgement", "StragglerDetector", "StragglerSettings", "predicted_compute_s", "replica_speeds",
           "share_units"]
