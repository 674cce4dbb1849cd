"""One rank's NTP runtime: its place in the Topology, its model slice, gradient sync and batch share.

Kept free of Lightning so tests and benchmarks drive exactly the code the NTPStrategy runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.config.schema import ModelConfig
from ntp_nemo.data.rebalance import assign_microbatches
from ntp_nemo.parallel.grad_sync import GradientSynchronizer, build_sync_plan, param_descriptors
from ntp_nemo.topology import Topology


class NTPRuntime:
    def __init__(self, topology: Topology, rank: int, power_boost=None, schedule: str = "1f1b") -> None:
        self.topology = topology
        self.rank = rank
        self.coord = topology.coord(rank)
        self.power_boost = power_boost
        self.schedule = schedule  # pipeline schedule (gpipe | 1f1b), used when topology.pp > 1
        self.sync: GradientSynchronizer | None = None
        self.pipeline = None  # PipelineEngine, built by attach() when topology.pp > 1
        if topology.world_size > 1:
            topology.build_groups()
        self.plan = topology.plan_for(rank)

    # ---- model --------------------------------------------------------------------------------
    def build_model(self, cfg: ModelConfig, seed: int, dtype: torch.dtype | None = None) -> nn.Module:
        """This rank's slice of the model (its pipeline stage), initialised layout-independently."""
        from ntp_nemo.models import DecoderLM, initialize_

        stage, last = self.coord.stage, self.topology.pp - 1
        model = DecoderLM(
            cfg,
            self.plan,
            layers=self.topology.stage_layer_range(stage),
            has_embedding=stage == 0,
            has_head=stage == last,
        )
        if dtype is not None:
            model.to(dtype)
        initialize_(model, seed)
        if cfg.init_from:
            from ntp_nemo.hf import load_hf_into

            load_hf_into(model, cfg.init_from)  # each rank reads only its slices
        return model

    def attach(self, model: nn.Module, bucket_mb: float = 25.0) -> GradientSynchronizer:
        """Build the fragment sync plan (one all_gather_object) and its process groups."""
        desc = param_descriptors(model)
        if self.topology.world_size > 1:
            everyone: list = [None] * self.topology.world_size
            dist.all_gather_object(everyone, desc)
        else:
            everyone = [desc]
        replica_of = [c.replica for c in self.topology.coords]
        plan = build_sync_plan(self.rank, everyone, replica_of)
        if self.topology.world_size > 1:
            self.topology.build_groups(extra=plan.all_holder_sets)
        self.sync = GradientSynchronizer(model, plan, self.topology.group, int(bucket_mb * (1 << 20)))
        if self.topology.pp > 1:
            from ntp_nemo.pipeline.engine import PipelineEngine

            self.pipeline = PipelineEngine(model, self.topology, self.rank, self.schedule)
        return self.sync

    # ---- batch share ----------------------------------------------------------------------------
    def microbatch_counts(self, num_microbatches: int) -> list[int]:
        return assign_microbatches(num_microbatches, self.topology.capacities(self.power_boost))

    def my_microbatches(self, num_microbatches: int) -> range:
        counts = self.microbatch_counts(num_microbatches)
        start = sum(counts[: self.coord.replica])
        return range(start, start + counts[self.coord.replica])

    # ---- reductions -----------------------------------------------------------------------------
    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-replica quantity (identical on a replica's last-stage ranks) over replicas."""
        if self.topology.world_size == 1:
            return value
        n = self.topology.replica_tp[self.coord.replica]
        out = value.detach().double() / n
        if self.coord.stage != self.topology.pp - 1:
            out.zero_()  # with a pipeline only the last stage holds the loss
        dist.all_reduce(out)
        return out

    def train_microbatches(
        self, model: nn.Module, microbatches: Sequence[torch.Tensor], global_tokens: int, backward=None
    ) -> torch.Tensor:
        """Forward/backward this replica's micro-batches; loss normalised by the global token count.

        Returns the replica's summed token loss (not normalised).
        """
        if self.pipeline is not None:
            return self.pipeline.train(microbatches, global_tokens, backward)
        backward = backward or (lambda loss: loss.backward())
        total = torch.zeros((), dtype=torch.float64)
        for mb in microbatches:
            loss_sum = model.loss_sum(mb)
            backward(loss_sum / global_tokens)
            total += loss_sum.detach().double()
        return total

    def eval_microbatches(self, model: nn.Module, microbatches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward-only summed token loss of this replica's micro-batches (0 on non-last pipeline stages)."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(microbatches)
        total = torch.zeros((), dtype=torch.float64)
        for mb in microbatches:
            total += model.loss_sum(mb).detach().double()
        return total
