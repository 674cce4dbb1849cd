"""Stragglers in the cluster simulator: slow GPUs, and what each straggler policy makes of them.

A straggler is a GPU that computes at a fraction `speed` of its rate (throttled, mis-clocked, badly
cooled) for a while, then recovers.  Episodes arrive as a Poisson process at `rate_per_gpu_hour` per GPU
of the job; each picks a GPU uniformly, a speed uniformly in `speed` and a duration from an exponential
of mean `duration_hours`.  A replica runs at the pace of its slowest GPU (every stage of a pipeline, every
rank of a TP group waits for it), and every synchronous step waits for the slowest replica, as the
`fault.straggler` policies of training see it:

- `report`: nothing changes; the job runs at its slowest replica's pace (throughput = the lowest speed);
- `rebalance`: `detect_minutes` after the episode starts (the watch's `straggler_every x persist` steps)
  the batch is split by the replicas' speeds, whole micro-batches, the global batch kept (NTP-PW's
  capacity split fed by measured speed); the split goes back `detect_minutes` after the device recovers
  (meanwhile the recovered replica is under-loaded).  Below `floor` the GPU is excluded as under `exclude`.
  With `shards` (`fault.straggler_shards`: `on`, or `auto` in a one-replica job) the TP group holding
  the straggler also weighs its shards by the believed speeds, so its pace is
  `sum(w) / (tp * max_g(w_g / s_g))` (believed speeds `w`, actual `s`): the group's mean speed when the
  belief is right, its slowest GPU's speed when nothing is believed;
- `exclude`: `detect_minutes` after the episode starts the GPU leaves as a lost one does: its replica
  runs at one TP degree fewer, with the on-time micro-batches of the NTP policy table at that degree as
  its capacity, and comes back `detect_minutes` after the device recovers.

One step of the job, the global batch of `M` micro-batches kept: each replica `i` has a capacity `c_i`
the split believes (micro-batches per healthy step: the NTP table's on-time batch at its degree times its
believed speed) and a rate `r_i` it actually runs at (the same with its actual speed); the split is the
whole-micro-batch split minimising `max m_i / c_i`, and the step takes `max m_i / r_i` healthy steps.  The
study's throughput is the inverse, weighted by time over the trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_nemo.errors import ConfigError

REPORT, REBALANCE, EXCLUDE = "report", "rebalance", "exclude"
STRAGGLER_POLICIES = (REPORT, REBALANCE, EXCLUDE)
SHARD_MODES = ("auto", "on", "off")
_EPS = 1e-9


@dataclass(frozen=True)
class StragglerSpec:
    """Straggler episodes and the watch's delay (`conf/sim/config.yaml: stragglers`)."""

    rate_per_gpu_hour: float = 2e-5
    speed: tuple[float, float] = (0.3, 0.9)
    duration_hours: float = 1.0
    detect_minutes: float = 5.0
    floor: float = 0.2
    policies: tuple[str, ...] = STRAGGLER_POLICIES
    shards: str = "auto"  # rebalance weighs the straggler's TP-group shards: auto (one replica) | on | off

    def __post_init__(self) -> None:
        if isinstance(self.rate_per_gpu_hour, bool) or not self.rate_per_gpu_hour >= 0:
            raise ConfigError("stragglers.rate_per_gpu_hour", "must be a non-negative rate (episodes per "
                              f"GPU-hour), got {self.rate_per_gpu_hour!r}.")
        lo_hi = tuple(self.speed)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] <= 1:
            raise ConfigError("stragglers.speed", "must be [low, high] with 0 < low <= high <= 1 (the range "
                              f"a straggler's speed is drawn from), got {list(lo_hi)!r}.")
        if not self.duration_hours > 0:
            raise ConfigError("stragglers.duration_hours", "must be positive (mean episode length in "
                              f"hours), got {self.duration_hours!r}.")
        if not self.detect_minutes >= 0:
            raise ConfigError("stragglers.detect_minutes",
                              f"must be non-negative minutes, got {self.detect_minutes!r}.")
        if not 0 <= self.floor < 1:
            raise ConfigError("stragglers.floor", f"must be in [0, 1) (below it rebalance excludes the GPU), "
                              f"got {self.floor!r}.")
        if self.shards not in SHARD_MODES:
            raise ConfigError("stragglers.shards", f"{self.shards!r}: choose one of {list(SHARD_MODES)} "
                              "(auto: weighted shards in a one-replica job, as fault.straggler_shards).")
        bad = [p for p in self.policies if p not in STRAGGLER_POLICIES]
        if bad or not self.policies:
            raise ConfigError("stragglers.policies",
                              f"{list(self.policies)}: choose one or more of {list(STRAGGLER_POLICIES)}.")

    @property
    def detect_hours(self) -> float:
        return self.detect_minutes / 60.0

    def weighs_shards(self, num_replicas: int) -> bool:
        """Whether `rebalance` weighs the shards inside a straggler's TP group in a job of `num_replicas`
        (`resilience.straggler.shard_replicas`: on, or auto with one replica)."""
        return self.shards == "on" or (self.shards == "auto" and num_replicas == 1)


def split(capacity: np.ndarray, total: int) -> np.ndarray:
    """Whole micro-batches per replica summing to `total` that minimise `max m_i / capacity_i` (replicas of
    capacity 0 get none)."""
    c = np.asarray(capacity, dtype=float)
    m = np.zeros(len(c), dtype=np.int64)
    live = c > _EPS
    if total <= 0 or not live.any():
        return m
    cl = c[live]
    lo, hi = total / cl.sum(), (total + len(cl)) / cl.sum()
    cands = [k / ci for ci in np.unique(cl) for k in range(max(1, math.ceil(lo * ci - _EPS)),
                                                           math.floor(hi * ci + _EPS) + 1)]
    best = hi
    for t in sorted(cands):
        if np.floor(t * cl + _EPS).sum() >= total:
            best = t
            break
    ml = np.floor(best * cl + _EPS).astype(np.int64)
    surplus = int(ml.sum() - total)
    if surplus > 0:  # take the extra micro-batches from the replicas at the bound
        order = np.argsort(-(ml / cl), kind="stable")
        for i in order[:surplus]:
            ml[i] -= 1
    m[live] = ml
    return m


def step_time(believed: np.ndarray, actual: np.ndarray, total: int) -> float:
    """Healthy steps one job step takes: the batch split by the `believed` capacities, each replica at its
    `actual` rate (both in micro-batches per healthy step)."""
    m = split(believed, total)
    busy = m > 0
    if not busy.any():
        return math.inf
    r = np.asarray(actual, dtype=float)[busy]
    if np.any(r <= _EPS):
        return math.inf
    return float(np.max(m[busy] / r))


@dataclass(frozen=True)
class Episodes:
    """Straggler episodes of one trace (hours; `gpu` a job GPU)."""

    gpu: np.ndarray
    start: np.ndarray
    end: np.ndarray
    speed: np.ndarray
    horizon_hours: float

    @property
    def count(self) -> int:
        return len(self.gpu)


def generate_episodes(num_gpus: int, spec: StragglerSpec, hours: float, rng: np.random.Generator) -> Episodes:
    n = int(rng.poisson(spec.rate_per_gpu_hour * num_gpus * hours))
    start = np.sort(rng.uniform(0.0, hours, size=n))
    return Episodes(rng.integers(0, num_gpus, size=n), start,
                    start + rng.exponential(spec.duration_hours, size=n),
                    rng.uniform(spec.speed[0], spec.speed[1], size=n), hours)


@dataclass(frozen=True)
class JobShape:
    """What the straggler study needs of the job: replicas, GPUs per replica, the nominal micro-batches
    per replica and the NTP table's on-time micro-batches per degree (`ntp_batch[t]`, t = 0..tp)."""

    num_replicas: int
    tp: int
    pp: int
    microbatches: int
    ntp_batch: tuple[int, ...]

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp


def weighted_pace(job: JobShape, replica: int, actual: dict[int, float], believed: dict[int, float]
                  ) -> tuple[float, float]:
    """(believed, actual) pace of `replica` whose TP groups weigh their shards by the `believed` speeds
    (GPU -> speed, absent = 1): per stage, a GPU holds `w_g / sum(w)` of the work and takes
    `w_g / (sum(w) s_g)` against a balanced `1 / tp`; the replica runs at its slowest stage."""
    believed_pace = actual_pace = 1.0
    for stage in range(job.pp):
        gpus = [replica * job.gpus_per_replica + stage * job.tp + j for j in range(job.tp)]
        w = [believed.get(g, 1.0) for g in gpus]
        a = [actual.get(g, 1.0) for g in gpus]
        believed_pace = min(believed_pace, sum(w) / job.tp)
        longest = max(wg / max(ag, _EPS) for wg, ag in zip(w, a, strict=True))  # x (sum(w) / tp)
        actual_pace = min(actual_pace, sum(w) / (job.tp * longest))
    return believed_pace, actual_pace


def state_throughput(job: JobShape, policy: str, actual: dict[int, float], believed: dict[int, float],
                     floor: float = 0.0, shards: bool = False) -> float:
    """Throughput relative to failure-free with the job GPUs' `actual` speeds (GPU -> speed, absent = 1) and
    the speeds the watch `believed` (GPU -> speed, the episodes it has named): report ignores `believed`;
    rebalance splits by it (below `floor` the GPU is excluded) and, with `shards`, weighs the shards of a
    replica that lost no GPU by it (`weighted_pace`); exclude takes every believed GPU out."""
    r_n = job.num_replicas
    degree = np.full(r_n, job.tp)
    a = np.ones(r_n)
    v = np.ones(r_n)
    out = {g for g, s in believed.items() if policy == EXCLUDE or (policy == REBALANCE and s < floor)}
    for g in out:
        degree[g // job.gpus_per_replica] -= 1
    for g, s in actual.items():
        if g not in out:
            i = g // job.gpus_per_replica
            a[i] = min(a[i], s)
    if policy == REBALANCE:
        for g, s in believed.items():
            if g not in out:
                i = g // job.gpus_per_replica
                v[i] = min(v[i], s)
        if shards:
            for i in {g // job.gpus_per_replica for g in believed} - {g // job.gpus_per_replica for g in out}:
                v[i], a[i] = weighted_pace(job, i, actual, believed)
    cap = np.array([job.ntp_batch[max(0, int(t))] for t in degree], dtype=float)
    t = step_time(cap * v, cap * a, job.num_replicas * job.microbatches)
    return 0.0 if math.isinf(t) else 1.0 / t


def trace_throughput(job: JobShape, spec: StragglerSpec, episodes: Episodes, policy: str
                     ) -> tuple[float, float, float]:
    """(time-weighted throughput, lowest throughput, time-weighted fraction of the job's GPUs slow) of one
    trace under `policy`."""
    d = spec.detect_hours if policy != REPORT else 0.0
    h = episodes.horizon_hours
    edges = np.concatenate([[0.0], episodes.start, episodes.end, episodes.start + d, episodes.end + d])
    edges = np.unique(edges[(edges >= 0) & (edges < h)])
    durations = np.diff(np.append(edges, h))
    thr = np.ones(len(edges))
    slow_frac = np.zeros(len(edges))
    cache: dict[tuple, float] = {}
    n_gpus = job.num_replicas * job.gpus_per_replica
    for k, (t0, dt) in enumerate(zip(edges, durations, strict=True)):
        mid = t0 + dt / 2
        actual: dict[int, float] = {}
        believed: dict[int, float] = {}
        for g, s0, e0, sp in zip(episodes.gpu.tolist(), episodes.start.tolist(), episodes.end.tolist(),
                                 episodes.speed.tolist(), strict=True):
            if s0 <= mid < e0:
                actual[g] = min(actual.get(g, 1.0), sp)
            if policy != REPORT and s0 + d <= mid < e0 + d:
                believed[g] = min(believed.get(g, 1.0), sp)
        slow_frac[k] = len(actual) / n_gpus
        key = (tuple(sorted(actual.items())), tuple(sorted(believed.items())))
        if key not in cache:
            cache[key] = state_throughput(job, policy, actual, believed, spec.floor,
                                          spec.weighs_shards(job.num_replicas))
        thr[k] = cache[key]
    w = durations / durations.sum()
    return float(w @ thr), float(thr.min()), float(w @ slow_frac)


__all__ = ["EXCLUDE", "REBALANCE", "REPORT", "SHARD_MODES", "STRAGGLER_POLICIES", "Episodes", "JobShape",
           "StragglerSpec", "generate_episodes", "split", "state_throughput", "step_time", "trace_throughput",
           "weighted_pace"]
