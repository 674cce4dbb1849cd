"""One rank's NTP runtime: its place in the layout (`RankPlace`), and the runtime of its model slice
(`NTPRuntime`: the place with the slice's gradient sync and pipeline engine, complete when constructed).

Kept free of Lightning so tests, benchmarks and the dry run drive exactly the code the NTPStrategy
runs.  Every tensor of the training step lives on `runtime.device`; the step's scalars (loss sum,
squared gradient norm, non-finite flag, stop request) travel in one fused all-reduce
(`step_scalars`), whose result the caller reads on the host once per step (`read_step_scalars`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.comm import all_reduce_on, check_device
from ntp_nemo.parallel.grad_sync import (
    GradientSynchronizer,
    SyncPlan,
    accumulator_dtype,
    build_sync_plan,
    param_descriptors,
)
from ntp_nemo.topology import ResolvedLayout

STEP_SCALARS = ("loss_sum", "grad_norm_sq", "nonfinite", "stop")


class RankPlace:
    """`RankPlace(layout, rank, device=...)`: a rank's place (coordinates, process groups, device, TP
    plan), from which its model slice is built (`build_model`), with the batch share and the step's
    reductions.  It trains nothing by itself: `NTPRuntime(place, model)` (what `runtime.assemble`
    builds) adds the slice's gradient sync and, when pp > 1, its pipeline engine.

    `layout` is the run's `ResolvedLayout`, the only description of who runs what.  `device` defaults
    to the layout's device of this rank, else CPU; `torch.device("meta")` builds shapes only (dry run).
    `groups_from`: a topology of the same ranks whose process groups this place uses (a re-layout of the
    shards inside the running job, `Topology.share_groups`); only the groups it lacks are made.
    """

    def __init__(
        self, layout: ResolvedLayout, rank: int, *, device: torch.device | str | None = None,
        groups_from: Any = None,
    ) -> None:
        if not isinstance(layout, ResolvedLayout):
            raise TypeError(f"RankPlace takes a ResolvedLayout, got {type(layout).__name__}")
        self.topology = layout.topology()
        if groups_from is not None:
            self.topology.share_groups(groups_from)
        self.layout = layout
        self.rank = rank
        self.coord = self.topology.coord(rank)
        self.schedule = layout.schedule  # pipeline schedule (gpipe | 1f1b), used when pp > 1
        self.device = torch.device(device or layout.device_of(rank) or "cpu")
        self.acc_dtype = accumulator_dtype(self.device)
        self.world_group = None  # the default group: on CUDA it may be NCCL-only, so its tensors are CUDA
        if self.topology.world_size > 1:
            self.topology.build_groups(device=self.device)  # the TP groups' backend follows the device
        self.plan = self.topology.plan_for(rank)
        if layout.sequence_parallel:
            from ntp_nemo.parallel.sequence import SequenceParallelPlan

            self.plan = SequenceParallelPlan(self.plan)
        if layout.pattern:  # block slots run on grids: their row and column groups, their contexts
            from ntp_nemo.topology.grid import GridPlan, grid_group_tuples

            if self.topology.world_size > 1:
                self.topology.build_groups(extra=grid_group_tuples(self.topology, layout.pattern),
                                           device=self.device)
            self.plan = GridPlan(self.plan, self.topology, rank, layout.pattern)

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    # ---- model --------------------------------------------------------------------------------
    def _stage_layers(self, num_layers: int, stage: int):
        """Global indices of the layers this rank's stage holds (all of its chunks when interleaved)."""
        if self.schedule != "interleaved_1f1b":
            return self.topology.stage_layer_range(stage)
        from ntp_nemo.pipeline.schedule import interleaved_layers

        return [i for r in interleaved_layers(num_layers, self.topology.pp, self.layout.virtual_stages, stage)
                for i in r]

    def build_model(self, cfg: ModelConfig, seed: int, dtype: torch.dtype | None = None, *,
                    initialize: bool = True) -> nn.Module:
        """This rank's slice of the model (its pipeline stage), initialised layout-independently and
        placed on the runtime's device.  On `meta` only shapes exist (no initialisation, no import).
        `initialize=False` draws nothing (a checkpoint about to be loaded overwrites every value)."""
        from ntp_nemo.models import DecoderLM
        from ntp_nemo.models.init import build_slice

        stage, last = self.coord.stage, self.topology.pp - 1

        def make() -> nn.Module:
            return DecoderLM(
                cfg,
                self.plan,
                layers=self._stage_layers(cfg.num_layers, stage),
                has_embedding=stage == 0,
                has_head=stage == last,
            )

        if self.is_meta:
            with torch.device("meta"):
                model = make()
            return model.to(dtype) if dtype is not None else model
        # HF weights overwrite every parameter (padded vocabulary rows with zeros): nothing is drawn then
        model = build_slice(make, self.device, dtype, seed if initialize and not cfg.init_from else None)
        if cfg.init_from:
            from ntp_nemo.hf import load_hf_into

            load_hf_into(model, cfg.init_from)  # each rank reads only its slices
        return model

    def pipeline_for(self, model: nn.Module):
        """The pipeline engine that runs `model` (this rank's slice, or a copy of it in another dtype)
        between the stages, or None when the layout has one stage."""
        if self.topology.pp > 1 and self.schedule == "interleaved_1f1b":
            from ntp_nemo.pipeline.interleaved import InterleavedPipelineEngine

            return InterleavedPipelineEngine(model, self.topology, self.rank, self.layout.virtual_stages,
                                             acc_dtype=self.acc_dtype)
        if self.topology.pp > 1:
            from ntp_nemo.pipeline.engine import PipelineEngine

            return PipelineEngine(model, self.topology, self.rank, self.schedule, acc_dtype=self.acc_dtype)
        return None

    # ---- batch share ----------------------------------------------------------------------------
    def microbatch_counts(self, num_microbatches: int) -> list[int]:
        return self.layout.microbatch_counts(num_microbatches)

    def my_microbatches(self, num_microbatches: int) -> range:
        counts = self.microbatch_counts(num_microbatches)
        start = sum(counts[: self.coord.replica])
        return range(start, start + counts[self.coord.replica])

    # ---- reductions -----------------------------------------------------------------------------
    def _replica_share(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a per-replica quantity held by all of a replica's last-stage ranks."""
        check_device(value, self.device, "per-replica sum")
        out = value.detach().to(self.acc_dtype)
        if self.topology.world_size == 1:
            return out.clone()
        if self.coord.stage != self.topology.pp - 1:
            return torch.zeros_like(out)  # with a pipeline only the last stage holds the loss
        return out / self.topology.replica_tp[self.coord.replica]

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-replica quantity (identical on a replica's last-stage ranks) over replicas; a
        tensor on the runtime's device (used by evaluation, outside the fused step)."""
        out = self._replica_share(value)
        if self.topology.world_size > 1:
            all_reduce_on(out, self.device, self.world_group, what="global sum")
        return out

    def step_scalars(
        self,
        loss_sum: torch.Tensor,
        grad_norm_sq_local: torch.Tensor,
        nonfinite: torch.Tensor | bool | None = None,
        stop: bool | torch.Tensor = False,
        compute_s: torch.Tensor | None = None,
        own: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's one fused all-reduce: returns `[loss_sum, grad_norm_sq, nonfinite, stop]`,
        summed over the world, as a tensor on the runtime's device (float64, float32 without it).

        `loss_sum`: this replica's summed token loss (`train_microbatches`); `grad_norm_sq_local`:
        `GradientSynchronizer.grad_norm_sq_local()` after the sync; `nonfinite`: this rank found a
        non-finite gradient (default: the local norm is not finite); `stop`: this rank asks to stop
        (preemption).  Entries 2 and 3 are counts: > 0 means some rank raised the flag.  `compute_s`: this
        rank's compute seconds (`ComputeTimer`); when given, entries 4.. hold every rank's (each rank fills
        its own slot; the sum is the gather), read back as `compute_s` (straggler detection).  `own`:
        this rank's row of own gradient statistics (the integrity watch's, before the DP sync); when given,
        the last world-size rows hold every rank's, read back flat as `own` (`read_step_scalars(own=N)`,
        N the number of those entries).
        """
        check_device(grad_norm_sq_local, self.device, "squared gradient norm")
        sq = grad_norm_sq_local.detach().to(self.acc_dtype)
        if nonfinite is None:
            flag = (~torch.isfinite(sq)).to(self.acc_dtype)
        elif isinstance(nonfinite, torch.Tensor):
            flag = check_device(nonfinite, self.device, "non-finite flag").to(self.acc_dtype)
        else:
            flag = torch.full((), float(bool(nonfinite)), dtype=self.acc_dtype, device=self.device)
        if isinstance(stop, torch.Tensor):
            stop_t = check_device(stop, self.device, "stop flag").to(self.acc_dtype)
        else:
            stop_t = torch.full((), float(bool(stop)), dtype=self.acc_dtype, device=self.device)
        buf = torch.stack([self._replica_share(loss_sum), sq, flag.reshape(()), stop_t.reshape(())])
        if compute_s is not None:
            slots = torch.zeros(self.topology.world_size, dtype=self.acc_dtype, device=self.device)
            slots[self.rank] = check_device(compute_s, self.device, "compute seconds").to(self.acc_dtype)
            buf = torch.cat([buf, slots])
        if own is not None:
            row = check_device(own, self.device, "own gradient statistic").to(self.acc_dtype).reshape(-1)
            slots = torch.zeros(self.topology.world_size, row.numel(), dtype=self.acc_dtype,
                                device=self.device)
            slots[self.rank] = row
            buf = torch.cat([buf, slots.reshape(-1)])
        if self.topology.world_size > 1:
            all_reduce_on(buf, self.device, self.world_group, what="fused step scalars")
        return buf

    @staticmethod
    def read_step_scalars(buf: torch.Tensor, own: int = 0) -> dict[str, float]:
        """The step's single host read of the fused scalars (with `compute_s`, every rank's compute
        seconds as a tuple, when the step gathered them; `own`: how many of the last entries are every
        rank's `own` row, read back as one flat tuple)."""
        values = buf.tolist()
        if own:
            values, out_own = values[:-own], tuple(values[-own:])
        out: dict = dict(zip(STEP_SCALARS, values[: len(STEP_SCALARS)], strict=True))
        if len(values) > len(STEP_SCALARS):
            out["compute_s"] = tuple(values[len(STEP_SCALARS):])
        if own:
            out["own"] = out_own
        return out


class NTPRuntime(RankPlace):
    """`NTPRuntime(place, model)`: the runtime of rank `place.rank`'s model slice `model`, complete when
    constructed: the place (its process groups are the place's, built once), the slice's fragment
    gradient sync and, when pp > 1, its pipeline engine.  `runtime.assemble` builds the slice from the
    place and constructs this; nothing completes a runtime afterwards.

    Collective over the layout's ranks (the sync plan's exchange and its groups) unless `plan` (this
    rank's, computed up front) or `descriptors` (every rank's `param_descriptors`, index = global rank)
    is given: the dry run's fake process group moves no data.  `sync`: an existing sync to share (a
    runtime of another copy of the same slice, `for_model`)."""

    def __init__(self, place: RankPlace, model: nn.Module, *, bucket_mb: float = 25.0,
                 descriptors: Sequence[dict] | None = None, plan: SyncPlan | None = None,
                 sync: GradientSynchronizer | None = None) -> None:
        if not isinstance(place, RankPlace):
            raise TypeError(f"NTPRuntime takes a RankPlace and its model slice, got {type(place).__name__}")
        vars(self).update(vars(place))  # the place's coordinates and process groups, built once
        if sync is None:
            sync = self._build_sync(model, bucket_mb, descriptors, plan)
        self._sync = sync
        self.pipeline = self.pipeline_for(model)

    @property
    def sync(self) -> GradientSynchronizer:
        """The model's fragment gradient sync."""
        return self._sync

    def for_model(self, model: nn.Module) -> NTPRuntime:
        """This runtime for another copy of its slice (the dry run's slice in the compute dtype): the same
        place and gradient sync, a pipeline engine that runs `model`."""
        return NTPRuntime(self, model, sync=self._sync)

    def _build_sync(self, model: nn.Module, bucket_mb: float, descriptors: Sequence[dict] | None,
                    plan: SyncPlan | None) -> GradientSynchronizer:
        """The fragment sync plan, its process groups and the sync of `model`."""
        if plan is None:
            if descriptors is not None:
                everyone = list(descriptors)
            elif self.topology.world_size > 1:
                everyone = [None] * self.topology.world_size
                dist.all_gather_object(everyone, param_descriptors(model))
            else:
                everyone = [param_descriptors(model)]
            replica_of = [c.replica for c in self.topology.coords]
            plan = build_sync_plan(self.rank, everyone, replica_of)
        if self.topology.world_size > 1:
            self.topology.build_groups(extra=plan.all_holder_sets, device=self.device)
        return GradientSynchronizer(
            model, plan, self.topology.group, int(bucket_mb * (1 << 20)), self.world_group, self.device
        )

    # ---- micro-batches ----------------------------------------------------------------------------
    def train_microbatches(
        self, model: nn.Module, microbatches: Sequence[torch.Tensor], global_tokens: int, backward=None
    ) -> torch.Tensor:
        """Forward/backward this replica's micro-batches; loss normalised by the global token count.

        Returns the replica's summed token loss (not normalised), a 0-dim tensor on the device; no
        host synchronisation happens here.
        """
        microbatches = [mb.to(self.device, non_blocking=True) for mb in microbatches]
        if self.pipeline is not None:
            return self.pipeline.train(microbatches, global_tokens, backward)
        backward = backward or (lambda loss: loss.backward())
        total = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        for mb in microbatches:
            loss_sum = model.loss_sum(mb)
            check_device(loss_sum, self.device, "micro-batch loss")
            backward(loss_sum / global_tokens)
            total += loss_sum.detach().to(self.acc_dtype)
        return total

    def eval_microbatches(self, model: nn.Module, microbatches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward-only summed token loss of this replica's micro-batches (0 on non-last pipeline stages)."""
        microbatches = [mb.to(self.device, non_blocking=True) for mb in microbatches]
        if self.pipeline is not None:
            return self.pipeline.evaluate(microbatches)
        total = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        for mb in microbatches:
            loss_sum = check_device(model.loss_sum(mb), self.device, "micro-batch loss")
            total += loss_sum.detach().to(self.acc_dtype)
        return total
