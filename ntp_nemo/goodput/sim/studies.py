"""The three studies the simulator runs; each returns result records (plain dicts for results.json).

- availability: fraction of replicas (one TP group each) untouched by failures vs TP degree,
  against the analytic expectation;
- throughput: throughput relative to failure-free vs failed fraction, per policy, over random
  placements (the same placements for every policy, so comparisons are paired);
- trace: a Poisson failure trace; time-weighted throughput per policy and the fewest spare
  domains that let fixed mini-batch training run without ever pausing;
- stragglers: a Poisson trace of slow GPUs; time-weighted throughput per straggler policy (report,
  rebalance, exclude: `stragglers.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ntp_nemo.goodput.sim.domains import (
    ClusterSpec,
    DamagedDomains,
    replica_histogram,
    replica_histogram_from_levels,
)
from ntp_nemo.goodput.sim.failures import BERNOULLI, Trace, generate_trace, sample_placements, trace_states
from ntp_nemo.goodput.sim.perf import ReplicaPerf
from ntp_nemo.goodput.sim.policy_tables import (
    DP_DROP,
    NTP,
    PolicyTable,
    capacity,
    policy_table,
    replica_metrics,
)
from ntp_nemo.goodput.sim.settings import SimSettings
from ntp_nemo.goodput.sim.stragglers import JobShape, generate_episodes, trace_throughput


def expected_availability(num_gpus: int, group: int, failed_fraction: float, sampling: str) -> float:
    """P(a given group of `group` GPUs has no failure).

    Bernoulli failures: (1-p)^g. Exactly k = round(p*N) failed GPUs: the hypergeometric
    C(N-g, k) / C(N, k).
    """
    if sampling == BERNOULLI:
        return (1.0 - failed_fraction) ** group
    k = int(round(failed_fraction * num_gpus))
    if k + group > num_gpus:
        return 0.0
    return math.exp(
        math.lgamma(num_gpus - group + 1)
        - math.lgamma(num_gpus - group - k + 1)
        - math.lgamma(num_gpus + 1)
        + math.lgamma(num_gpus - k + 1)
    )


def replica_perf(s: SimSettings) -> ReplicaPerf:
    c = s.cluster
    return ReplicaPerf(
        s.model,
        s.device,
        s.links,
        c.tp,
        c.pp,
        s.seq_len,
        s.train.micro_batch_size,
        s.train.pp_interleave,
        c.num_replicas,
    )


def policy_tables(s: SimSettings) -> list[PolicyTable]:
    perf = replica_perf(s)
    return [policy_table(p, perf, s.local_batch, s.power_boost_cap) for p in s.policies]


def run_availability(s: SimSettings, rng: np.random.Generator) -> list[dict]:
    a, fb = s.availability, s.failures.blast_radius
    records = []
    for tp in a.tp:
        spec = ClusterSpec(
            num_gpus=a.num_gpus,
            domain_size=tp,
            tp=tp,
            pp=1,
            min_degraded_fraction=s.cluster.min_degraded_fraction,
        )
        fails = sample_placements(
            spec.num_cells(),
            spec.cell_size,
            a.failed_fraction,
            s.placements.samples,
            rng,
            s.placements.sampling,
            fb if tp % fb == 0 else 1,
        )
        hist = replica_histogram(spec, fails)
        expected = (
            expected_availability(a.num_gpus, tp, a.failed_fraction, s.placements.sampling)
            if fb == 1
            else None
        )
        total = hist.sum(axis=1)
        for policy in (DP_DROP, NTP):
            running = hist[:, tp] if policy == DP_DROP else hist[:, 1:].sum(axis=1)
            useful = hist[:, tp] * tp if policy == DP_DROP else hist @ np.arange(tp + 1)
            records.append(
                {
                    "study": "availability",
                    "policy": policy,
                    "tp": tp,
                    "num_gpus": a.num_gpus,
                    "failed_fraction": a.failed_fraction,
                    "replicas_available": float(running.sum() / total.sum()),
                    "replicas_available_expected": expected if policy == DP_DROP else None,
                    "gpus_useful": float(useful.sum() / (total.sum() * tp)),
                    "throughput_rel": float(useful.sum() / (total.sum() * tp)),
                    "samples": s.placements.samples,
                }
            )
    return records


def _summary(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "min": float(values.min()), "p05": float(np.quantile(values, 0.05))}


def run_throughput(s: SimSettings, rng: np.random.Generator, tables: list[PolicyTable]) -> list[dict]:
    c = s.cluster
    records = []
    for p in s.placements.fractions:
        fails = sample_placements(
            c.num_cells(),
            c.cell_size,
            float(p),
            s.placements.samples,
            rng,
            s.placements.sampling,
            s.failures.blast_radius,
        )
        replicas = replica_histogram(c, fails)
        for table in tables:
            m = replica_metrics(replicas, table, c.num_replicas, c.tp)
            thr = _summary(m["throughput_rel"])
            records.append(
                {
                    "study": "throughput",
                    "policy": table.name,
                    "failed_fraction": float(p),
                    "throughput_rel": thr["mean"],
                    "throughput_rel_min": thr["min"],
                    "throughput_rel_p05": thr["p05"],
                    "replicas_available": float(m["replicas_available"].mean()),
                    "gpus_useful": float(m["gpus_useful"].mean()),
                    "power_boost": float(m["power_boost"].mean()),
                    "tp": c.tp,
                    "pp": c.pp,
                    "num_gpus": c.num_gpus,
                    "spare_domains": c.spare_domains,
                    "local_batch": s.local_batch,
                    "samples": s.placements.samples,
                }
            )
    return records


@dataclass(frozen=True)
class TraceTimeline:
    """Per-state series of one trace, kept for the trace plot."""

    rate_multiplier: float
    times_h: np.ndarray
    failed_gpus: np.ndarray
    throughput_rel: dict[str, np.ndarray]


def spares_needed(
    s: SimSettings, tables: list[PolicyTable], trace: Trace, max_spares: int
) -> dict[str, int | None]:
    """Per policy, the fewest spare domains keeping capacity >= the global batch in every state
    (None: more than `max_spares`).

    Capacity never decreases with more spares for a coupled trace (sorted packing dominates
    position by position), so a binary search is exact. Formed replicas do not depend on the
    policy, so each pool size is evaluated once for all policies.
    """
    c = s.cluster
    _, _, pool = trace_states(trace, c.domain_size, c.num_domains + max_spares)
    damaged = DamagedDomains.from_dense(pool, c.domain_size) if c.tp <= c.domain_size else None
    need = c.num_replicas * s.local_batch
    cache: dict[int, np.ndarray] = {}

    def replicas(spares: int) -> np.ndarray:
        if spares not in cache:
            n = c.num_domains + spares
            cache[spares] = (
                replica_histogram_from_levels(c, damaged.levels(n))
                if damaged is not None
                else replica_histogram(c, pool[:, :n])
            )
        return cache[spares]

    out: dict[str, int | None] = {}
    for table in tables:
        if not np.all(capacity(replicas(max_spares), table) >= need):
            out[table.name] = None
            continue
        lo, hi = 0, max_spares
        while lo < hi:
            mid = (lo + hi) // 2
            if np.all(capacity(replicas(mid), table) >= need):
                hi = mid
            else:
                lo = mid + 1
        out[table.name] = lo
    return out


def run_trace(
    s: SimSettings, rng: np.random.Generator, tables: list[PolicyTable]
) -> tuple[list[dict], list[TraceTimeline]]:
    c, f = s.cluster, s.failures
    max_spares = max(f.max_spare_domains, c.spare_domains) if c.packing else 0
    records, timelines = [], []
    for mult in f.rate_multipliers:
        # The job's GPUs (with its configured spares) and the extra spare pool draw from separate
        # streams, so the job's failures do not depend on how far the spare search may go.
        job_rng, pool_rng = (np.random.default_rng(int(x)) for x in rng.integers(2**63, size=2))
        job_trace = generate_trace(c.num_gpus + c.spare_domains * c.domain_size, f, mult, job_rng)
        extra = (max_spares - c.spare_domains) * c.domain_size
        trace = job_trace.extended_by(generate_trace(extra, f, mult, pool_rng)) if extra else job_trace
        times, durations, fails = trace_states(trace, c.cell_size, c.num_cells())
        weights = durations / durations.sum()
        replicas = replica_histogram(c, fails)
        failed = fails.sum(axis=1)
        series = {}
        spares = spares_needed(s, tables, trace, max_spares) if c.packing else {}
        for table in tables:
            m = replica_metrics(replicas, table, c.num_replicas, c.tp)
            series[table.name] = m["throughput_rel"]
            needed = spares.get(table.name)
            records.append(
                {
                    "study": "trace",
                    "policy": table.name,
                    "rate_multiplier": float(mult),
                    "failed_fraction": float(weights @ failed / c.num_gpus),
                    "throughput_rel": float(weights @ m["throughput_rel"]),
                    "throughput_rel_min": float(m["throughput_rel"].min()),
                    "replicas_available": float(weights @ m["replicas_available"]),
                    "gpus_useful": float(weights @ m["gpus_useful"]),
                    "spares_needed": needed,
                    "spare_gpus_fraction": None if needed is None else needed * c.domain_size / c.num_gpus,
                    "max_failed_gpus": int(failed.max()),
                    "events": job_trace.num_events,
                    "hardware_events": job_trace.num_hardware,
                    "days": f.days,
                    "hardware_repair_hours": list(f.hardware_repair_hours),
                    "tp": c.tp,
                    "pp": c.pp,
                    "num_gpus": c.num_gpus,
                    "spare_domains": c.spare_domains,
                }
            )
        timelines.append(TraceTimeline(float(mult), times, failed, series))
    return records, timelines


def straggler_job(s: SimSettings) -> JobShape:
    """The job as the straggler study sees it; a replica short of GPUs keeps the NTP table's on-time batch."""
    c, mbs = s.cluster, s.train.micro_batch_size
    table = policy_table(NTP, replica_perf(s), s.local_batch, s.power_boost_cap)
    return JobShape(c.num_replicas, c.tp, c.pp, s.local_batch // mbs,
                    tuple(int(b) // mbs for b in table.batch))


def run_stragglers(s: SimSettings) -> list[dict]:
    """One trace of straggler episodes over `failures.days` on the job's GPUs, under each straggler policy
    (a stream of its own, seeded by `seed`: the same episodes whichever other studies run)."""
    rng = np.random.default_rng([s.seed, 48])
    spec, job = s.stragglers, straggler_job(s)
    gpus = job.num_replicas * job.gpus_per_replica
    episodes = generate_episodes(gpus, spec, s.failures.days * 24.0, rng)
    records = []
    for policy in spec.policies:
        mean, low, slow = trace_throughput(job, spec, episodes, policy)
        records.append({
            "study": "stragglers", "policy": policy, "throughput_rel": mean, "throughput_rel_min": low,
            "slow_gpu_fraction": slow, "episodes": episodes.count, "days": s.failures.days,
            "rate_per_gpu_hour": spec.rate_per_gpu_hour, "speed": list(spec.speed),
            "duration_hours": spec.duration_hours, "detect_minutes": spec.detect_minutes, "floor": spec.floor,
            "tp": job.tp, "pp": job.pp, "num_gpus": gpus, "num_replicas": job.num_replicas,
            "shards": spec.shards, "weighs_shards": spec.weighs_shards(job.num_replicas),
        })
    return records


@dataclass
class SimResults:
    records: list[dict] = dataclasses.field(default_factory=list)
    timelines: list[TraceTimeline] = dataclasses.field(default_factory=list)
    policy_tables: list[PolicyTable] = dataclasses.field(default_factory=list)


def run_all(s: SimSettings) -> SimResults:
    """Run the configured studies with one seeded generator (same seed, same numbers)."""
    rng = np.random.default_rng(s.seed)
    out = SimResults(policy_tables=policy_tables(s))
    if "availability" in s.studies:
        out.records += run_availability(s, rng)
    if "throughput" in s.studies:
        out.records += run_throughput(s, rng, out.policy_tables)
    if "trace" in s.studies:
        recs, out.timelines = run_trace(s, rng, out.policy_tables)
        out.records += recs
    if "stragglers" in s.studies:
        out.records += run_stragglers(s)
    return out
