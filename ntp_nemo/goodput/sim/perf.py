"""Step-time model of one DP replica at a given TP degree, local batch and power-boost factor.

Per micro-batch, each pipeline stage spends compute time (FLOPs of its items on the busiest
rank / per-GPU rate x boost) plus TP all-reduce time over the scale-up links (not sped up by
boost), plus one activation send and one gradient receive over scale-out. The pipeline runs
m = batch / micro_batch_size micro-batches with a 1F1B bubble of (pp-1)/interleave periods.
After the pipeline drains, gradients are all-reduced across the DP replicas over scale-out (ring,
not overlapped): a rank at degree t holds ~tp/t times the parameters of a healthy rank, so
degraded replicas spend longer in the sync. The per-item costs come from `ntp_nemo.planner.cost`,
so the simulator and the planner share one cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ntp_nemo.planner.cost import item_cost, item_kinds, stage_of_items
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape

_EPS = 1e-6  # tolerance on micro-batch counts and boost factors (float noise, not physics)


@dataclass(frozen=True)
class ReplicaPerf:
    """Modelled step time of a replica with `tp` nominal ranks per stage and `pp` stages."""

    model: ModelShape
    device: DeviceModel
    links: LinkModel
    tp: int
    pp: int
    seq_len: int
    micro_batch_size: int = 1
    pp_interleave: int = 1
    num_replicas: int = 1
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _stages(self, degree: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(compute s, TP comm s) per stage per micro-batch, and gradient bytes of the fullest stage."""
        if degree not in self._cache:
            kinds = item_kinds(self.model)
            stages = stage_of_items(self.model.num_layers, self.pp)
            compute, comm, params = np.zeros(self.pp), np.zeros(self.pp), np.zeros(self.pp)
            costs = {
                k: item_cost(
                    self.model, k, degree, self.seq_len, self.micro_batch_size, self.device, self.links
                )
                for k in set(kinds)
            }
            for kind, s in zip(kinds, stages, strict=True):
                compute[s] += costs[kind].compute_s
                comm[s] += costs[kind].comm_s
                params[s] += costs[kind].params
            self._cache[degree] = (compute, comm, float(params.max()) * self.device.grad_bytes)
        return self._cache[degree]

    def pipeline_period(self, degree: int, boost: float = 1.0) -> float:
        """Time of one micro-batch through the slowest stage (compute scales with boost, links do not)."""
        compute, comm, _ = self._stages(degree)
        return float(np.max(compute / boost + comm)) + self._send_time()

    def _send_time(self) -> float:
        if self.pp == 1:
            return 0.0
        act = self.micro_batch_size * self.seq_len * self.model.hidden_size * self.device.act_bytes
        return 2 * self.links.send_time(act)

    def dp_sync_time(self, degree: int) -> float:
        _, _, grad_bytes = self._stages(degree)
        return self.links.allreduce_time(grad_bytes, self.num_replicas, scale_up=False)

    def bubble(self) -> float:
        return (self.pp - 1) / self.pp_interleave

    def step_time(self, local_batch: int, degree: int, boost: float = 1.0) -> float:
        """Seconds for one optimizer step of a replica processing `local_batch` sequences."""
        micro = local_batch / self.micro_batch_size
        return (micro + self.bubble()) * self.pipeline_period(degree, boost) + self.dp_sync_time(degree)

    def on_time_batch(self, degree: int, local_batch: int, boost: float = 1.0) -> int:
        """Largest batch (whole micro-batches, at most `local_batch`) a degraded replica finishes on time."""
        budget = self.step_time(local_batch, self.tp) - self.dp_sync_time(degree)
        micro = math.floor(budget / self.pipeline_period(degree, boost) - self.bubble() + _EPS)
        return int(min(local_batch, max(0, micro * self.micro_batch_size)))

    def boost_needed(self, degree: int, local_batch: int) -> float:
        """Smallest compute-rate factor that keeps the full `local_batch` on time (inf if none can)."""
        compute, comm, _ = self._stages(degree)
        budget = self.step_time(local_batch, self.tp) - self.dp_sync_time(degree)
        period = budget / (local_batch / self.micro_batch_size + self.bubble()) - self._send_time()
        room = period - comm
        if np.any(room <= 0):
            return math.inf
        return max(1.0, float(np.max(compute / room)) * (1 - _EPS))
