"""Failure policies as lookup tables: replica degree -> local batch kept on time, and power factor.

- DP-DROP: a replica with any failed GPU drops out (batch 0 below the nominal degree).
- NTP: a degraded replica runs at its reduced degree with the largest whole number of
  micro-batches that keeps it within the healthy replicas' step time (the granularity effect).
- NTP-PW: as NTP, but the damaged replica's GPUs are power-boosted (compute rate x factor, up to
  1 + cap) just enough to keep the full batch; where the cap is not enough it keeps the largest
  batch the capped boost allows.
Because every policy is a table indexed by degree, one formed-replica array serves all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.sim.perf import ReplicaPerf

DP_DROP, NTP, NTP_PW = "DP-DROP", "NTP", "NTP-PW"
POLICIES = (DP_DROP, NTP, NTP_PW)


@dataclass(frozen=True)
class PolicyTable:
    """`batch[t]`: sequences a replica at degree t processes per step; `boost[t]`: its power factor."""

    name: str
    batch: np.ndarray
    boost: np.ndarray
    local_batch: int


def policy_table(name: str, perf: ReplicaPerf, local_batch: int, boost_cap: float = 0.3) -> PolicyTable:
    """Tabulate `name` over degrees 0..tp for a replica whose nominal local batch is `local_batch`."""
    tp = perf.tp
    batch = np.zeros(tp + 1, dtype=np.int64)
    boost = np.ones(tp + 1)
    batch[tp] = local_batch
    if name == DP_DROP:
        pass
    elif name == NTP:
        for t in range(1, tp):
            batch[t] = perf.on_time_batch(t, local_batch)
    elif name == NTP_PW:
        for t in range(1, tp):
            need = perf.boost_needed(t, local_batch)
            if need <= 1 + boost_cap:
                batch[t], boost[t] = local_batch, need
            else:
                batch[t] = perf.on_time_batch(t, local_batch, 1 + boost_cap)
                boost[t] = 1 + boost_cap if batch[t] else 1.0
    else:
        raise ConfigError("policies", f"unknown policy {name!r}; choose from {list(POLICIES)}.")
    return PolicyTable(name, batch, boost, local_batch)


def replica_metrics(
    replicas: np.ndarray, table: PolicyTable, num_replicas: int, tp: int
) -> dict[str, np.ndarray]:
    """Per-sample metrics of the job's `num_replicas` best formed replicas under one policy.

    `replicas` is the (samples, tp + 1) count of formed replicas per degree. Returns arrays over
    samples: throughput relative to failure-free, fraction of the job's replicas that run,
    fraction of its GPUs doing useful work, mean power factor of the boosted replicas.
    """
    desc = replicas[:, ::-1]
    better = np.cumsum(desc, axis=1) - desc
    used = np.clip(num_replicas - better, 0, desc)[:, ::-1]
    degree = np.arange(tp + 1)
    runs = table.batch > 0
    boosted = runs & (degree < tp)
    n_boosted = used[:, boosted].sum(axis=1)
    return {
        "throughput_rel": used @ table.batch / (num_replicas * table.local_batch),
        "replicas_available": used[:, runs].sum(axis=1) / num_replicas,
        "gpus_useful": used @ (degree * runs) / (num_replicas * tp),
        "power_boost": np.where(
            n_boosted > 0, used @ (table.boost * boosted) / np.maximum(n_boosted, 1), 1.0
        ),
    }


def capacity(replicas: np.ndarray, table: PolicyTable) -> np.ndarray:
    """Sequences per step all formed replicas can process on time (fixed mini-batch feasibility)."""
    return replicas @ table.batch
