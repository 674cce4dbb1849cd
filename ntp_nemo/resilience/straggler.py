"""Straggler detection: which rank computes persistently slower than the work model says for its share.

Every step each rank times its own compute (`runtime.compute_time.ComputeTimer`: its micro-batches'
forward and backward, not its waits for peers) and the step's fused all-reduce hands every rank every
rank's time, so each rank runs this detector on the same numbers and reaches the same verdicts without a
collective of its own.  Per rank and step the time is divided by the rank's modelled work on the layout
that ran the step (`share_units`: the work model's cost per token of its slices, `topology/work.py`, times
its replica's micro-batches), which makes ranks with unequal shares comparable; shards weighted by speed
(`ResolvedLayout.shard_speeds`) are counted as they are where the timer leaves out the TP exchanges (a
CPU runtime's `ntpdirect` groups report them: a rank's time is then its own shard's work), and as
balanced elsewhere (`judged_units`: a GPU's CUDA events or gloo's TP groups include the waits inside
every layer, so a rank's time follows its group's pace, not its own shard); either way a slow rank whose
shards were cut keeps the speed it was measured at, and shows full speed again once its device
recovers.  Every `every` steps:

- a rank's speed is a window median (one slow step, a checkpoint or a GC pause, does not move it): for a
  rank with TP peers, how fast it runs against them at the same steps (its time per unit over the median
  of theirs, step by step: the peers computed the same micro-batches at the same moment, so neither a
  split that changed nor the load on a shared machine moves the ratio); for a TP-1 rank, its median time
  per unit against the lower median of the other TP-1 ranks' (a healthy majority sets the reference; a
  TP-1 rank alone of its degree is not judged: the work model's device constants, an H100's FLOPs per
  NVLink byte, need not hold on this machine).  A replica slow as a whole, all its TP ranks alike, is
  not found;
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
    margin: float = 0.4
    persist: int = 3
    floor: float = 0.2
    shards: str = "auto"  # rebalance inside a TP group: auto (a one-replica job) | on | off

    @classmethod
    def from_config(cls, fault) -> StragglerSettings:
        return cls(str(fault.straggler), int(fault.straggler_every), float(fault.straggler_margin),
                   int(fault.straggler_persist), float(fault.straggler_floor),
                   str(getattr(fault, "straggler_shards", "auto")))

    @property
    def slow_below(self) -> float:
        return 1.0 / (1.0 + self.margin)

    @property
    def recovered_above(self) -> float:
        return 1.0 / (1.0 + self.margin / 2)


def share_units(layout: ResolvedLayout) -> list[float]:
    """Per global rank, its modelled work per step on `layout` (arbitrary unit): the work model's cost per
    token of its slices (when the layout carries no work shape: 1 for every rank, or its shard weight)
    times its replica's micro-batches."""
    world = layout.world_size
    if layout.work is not None:
        costs = rank_costs(layout.work, layout.topology())
    else:  # no work shape: a rank's share of its group's shards is its shard weight
        costs = list(layout.shard_speeds) if layout.shard_speeds is not None else [1.0] * world
    counts = layout.microbatch_counts()
    return [costs[r] * counts[layout.replica_of(r)] for r in range(layout.world_size)]


def judged_units(layout: ResolvedLayout, own_work: bool = False) -> list[float]:
    """The work the detector divides each rank's time by: `share_units` of `layout`, with balanced shards
    unless `own_work` (see the module docstring)."""
    if own_work or layout.shard_speeds is None:
        return share_units(layout)
    return share_units(layout.with_changes(shard_speeds=None))


def peer_groups(layout: ResolvedLayout) -> list[tuple[int, ...]]:
    """Per global rank, the other ranks of its replica's pipeline stage (its TP peers)."""
    out: list[tuple[int, ...]] = [()] * layout.world_size
    for i in range(layout.dp):
        for stage in layout.ranks_of(i):
            for r in stage:
                out[r] = tuple(q for q in stage if q != r)
    return out


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
    _window: list[tuple[list[float], list[float], list[list[int]]]] = field(default_factory=list)
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

    def observe(self, step: int, compute_s: Sequence[float], units: Sequence[float],
                peers: Sequence[Sequence[int]] | None = None) -> Judgement | None:
        """Add step `step`'s per-rank compute seconds and modelled work (and each rank's TP peers:
        `peer_groups`; None: none); a judgement every `every` steps."""
        if self.world is not None and len(compute_s) != self.world:
            self.reset()
        self.world = len(compute_s)
        self._window.append((list(compute_s), list(units), [list(p) for p in peers or [()] * self.world]))
        if step % self.settings.every:
            return None
        window, self._window = self._window, []
        return self._judge(step, window)

    def _judge(self, step: int, window: list[tuple[list[float], list[float], list[list[int]]]]
               ) -> Judgement | None:
        world = self.world or 0

        def per_unit(c: Sequence[float], u: Sequence[float], r: int) -> float | None:
            return c[r] / u[r] if u[r] > 0 and c[r] > 0 else None

        medians: list[float | None] = []
        relative: list[float] = []  # per rank: its time per unit over its peers' (median over the window)
        for r in range(world):
            xs = [x for c, u, _ in window if (x := per_unit(c, u, r)) is not None]
            medians.append(statistics.median(xs) if xs else None)
            ratios = []
            for c, u, peers in window:
                mine = per_unit(c, u, r)
                theirs = [x for q in peers[r] if (x := per_unit(c, u, q)) is not None]
                if mine is not None and theirs:
                    ratios.append(mine / statistics.median(theirs))
            relative.append(statistics.median(ratios) if ratios else 1.0)
        known = [x for x in medians if x is not None]
        if not known:
            return None
        ref = statistics.median_low(known)
        peers_now = window[-1][2]
        # Against the job: within ranks of the same TP degree only (the work model's device constants
        # weigh a TP rank's traffic against its FLOPs, which need not hold on this machine); a rank alone
        # of its degree is judged against its peers alone.
        cross = []
        for r in range(world):
            alike = [medians[q] for q in range(world)
                     if len(peers_now[q]) == len(peers_now[r]) and medians[q] is not None]
            mine = medians[r]
            cross.append(statistics.median_low(alike) / mine if mine is not None and len(alike) > 1 else 1.0)
        # A rank with TP peers is judged against them alone: on a shared machine the processes of one
        # replica were seen to get half the CPU together for 15 steps and more (three clean runs of 200
        # steps, 2 cores at load 11-26), which no margin tells from a replica slow as a whole.
        speeds = tuple(1.0 / max(relative[r], 1.0) if peers_now[r] else cross[r] for r in range(world))
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
            for c, u, _ in window:
                wait += max(0.0, max(c[r] for r in slow) - ref * max(u))
        return Judgement(step, speeds, slow, tuple(sorted(self.stragglers)), tuple(new), tuple(recovered),
                         wait, ref)


def _rounded(speed: float, step: float) -> float:
    return round(max(step, int(speed / step) * step), 6)


def rank_speeds(layout: ResolvedLayout, judgement: Judgement, stragglers: Sequence[int],
                step: float = 0.05) -> list[float]:
    """Per global rank of `layout`, its measured speed rounded down to a multiple of `step` if it is a
    straggler, else 1 (small changes of the estimate do not re-lay the job out)."""
    out = [1.0] * layout.world_size
    for r in stragglers:
        out[r] = _rounded(judgement.speed_of(r), step)
    return out


def replica_speeds(layout: ResolvedLayout, judgement: Judgement, stragglers: Sequence[int],
                   step: float = 0.05, weighted: Sequence[int] = (),
                   per_rank: Sequence[float] | None = None) -> tuple[float, ...] | None:
    """Per replica of `layout`, the speed of its slowest straggler (1 without one), rounded down to a
    multiple of `step`; for a replica in `weighted` (its shards follow its ranks' speeds, `shard_speeds`)
    its slowest stage's mean speed, the pace of shards in proportion.  `per_rank`: the ranks' speeds to
    use (default `rank_speeds`).  None when every replica runs at full speed."""
    speeds = rank_speeds(layout, judgement, stragglers, step) if per_rank is None else per_rank
    out = []
    for i in range(layout.dp):
        stages = [[speeds[r] for r in ranks] for ranks in layout.ranks_of(i)]
        if i in weighted:
            out.append(_rounded(min(sum(v) / len(v) for v in stages) + 1e-9, step))
        else:
            out.append(min(min(v) for v in stages))
    return None if all(v == 1.0 for v in out) else tuple(out)


def shard_replicas(settings: StragglerSettings, layout: ResolvedLayout) -> tuple[int, ...]:
    """The replicas whose shards `rebalance` weighs by speed: `fault.straggler_shards` on, or auto in a
    one-replica job (no other replica can take a share of the batch), each with TP groups of 2 ranks or
    more and the row/column pattern (a block grid's splits stay balanced)."""
    if settings.shards == "off" or layout.pattern or (settings.shards == "auto" and layout.dp > 1):
        return ()
    topo = layout.topology()
    return tuple(i for i in range(layout.dp)
                 if max(topo.degree(i, slot) for slot in range(len(layout.layer_tp))) > 1)


@dataclass(frozen=True)
class Decision:
    """What a policy does after a judgement: ranks to take out of the job, or a new layout (another batch
    split, other shard weights, or both)."""

    exclude: tuple[int, ...] = ()
    layout: ResolvedLayout | None = None  # the running layout with new `speeds`/`shard_speeds` (None: keep)


def decide(settings: StragglerSettings, layout: ResolvedLayout, judgement: Judgement) -> Decision:
    """`report`: nothing.  `exclude`: every straggler leaves.  `rebalance`: a straggler below `floor`
    leaves; otherwise inside the replicas of `shard_replicas` each rank's shards follow its measured speed
    (`ResolvedLayout.shard_speeds`; a straggler not slow in this window and not yet recovered keeps its
    weight, so noise around the margin does not move shards), and every replica's share of the batch
    follows its speed (`replica_speeds`).  Either changes only where the speeds moved by more than half
    the margin (the batch split also only where the micro-batch counts change); once no straggler is
    left, the balanced shards and the nominal split."""
    if settings.policy == "report" or not (judgement.new or judgement.recovered or judgement.stragglers):
        return Decision()
    excluded = tuple(r for r in judgement.stragglers
                     if settings.policy == "exclude" or judgement.speed_of(r) < settings.floor)
    if excluded:
        return Decision(exclude=excluded)
    weighted = shard_replicas(settings, layout)
    per_rank = rank_speeds(layout, judgement, judgement.stragglers)
    for r in judgement.stragglers:  # not slow in this window, not yet recovered: its weight stays
        if layout.shard_speeds is not None and judgement.speeds[r] >= settings.slow_below:
            per_rank[r] = layout.shard_speeds[r]
    speeds = replica_speeds(layout, judgement, judgement.stragglers, weighted=weighted, per_rank=per_rank)
    shards = tuple(v if layout.replica_of(r) in weighted else 1.0 for r, v in enumerate(per_rank))
    shards = None if all(v == 1.0 for v in shards) else shards
    rel = settings.margin / 2
    move = _worth_changing(layout.shard_speeds, shards, rel)
    split = _worth_changing(layout.speeds, speeds, rel) and (
        speeds is None or layout.with_changes(speeds=speeds).microbatches != layout.microbatches)
    if not (move or split):
        return Decision()
    return Decision(layout=layout.with_changes(speeds=speeds if split else layout.speeds,
                                               shard_speeds=shards if move else layout.shard_speeds))


def _worth_changing(current: tuple[float, ...] | None, wanted: tuple[float, ...] | None, rel: float) -> bool:
    if (current is None) != (wanted is None):
        return True
    if current is None or wanted is None:
        return False
    return any(abs(a - b) > rel * max(a, b) for a, b in zip(current, wanted, strict=True))


def predicted_compute_s(layout: ResolvedLayout, unit_s: float, rank_speeds: Sequence[float]) -> float:
    """The work model's compute time of a step on `layout`: the longest share at its rank's speed."""
    units = share_units(layout)
    return max(u * unit_s / max(v, 1e-9) for u, v in zip(units, rank_speeds, strict=True))


__all__ = ["Decision", "Judgement", "StragglerDetector", "StragglerSettings", "decide", "judged_units",
           "peer_groups", "predicted_compute_s", "rank_speeds", "replica_speeds", "shard_replicas",
           "share_units"]
