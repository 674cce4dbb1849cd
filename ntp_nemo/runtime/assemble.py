"""`assemble`: the one place that builds what a rank trains with on a layout.

Start-up (the Lightning module), live recovery and the rejoin all call it, so a change to how a rank is
built (the model slice, the gradient sync, the optimizer, the batch share) is made once.  The strategy
swaps the result in with `NTPStrategy.adopt`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import SyncPlan
from ntp_nemo.parallel.layers import set_tp_overlap
from ntp_nemo.parallel.step_path import GradientPath, build_optimizer, use_fused_adamw
from ntp_nemo.runtime.compile import compile_blocks
from ntp_nemo.runtime.runtime import NTPRuntime, RankPlace
from ntp_nemo.topology.layout import ResolvedLayout


@dataclass
class RankState:
    """Everything one rank trains with on one layout: its runtime (place, process groups, device), its
    model slice, the optimizer and the step's gradient path (sync, clipping)."""

    layout: ResolvedLayout
    rank: int
    runtime: NTPRuntime
    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_path: GradientPath

    def my_microbatches(self, num_microbatches: int) -> range:
        """This rank's replica's share of the global batch's micro-batches."""
        return self.runtime.my_microbatches(num_microbatches)


def rebind_optimizer(optimizer: torch.optim.Optimizer, old_model: nn.Module, new_model: nn.Module) -> None:
    """Point `optimizer`'s groups at `new_model`'s parameters of the same names and drop its state, so
    that whatever references the optimizer (an LR scheduler, the trainer) goes on with the new layout;
    the caller then installs the state (a live reshard)."""
    names = {id(p): name for name, p in old_model.named_parameters()}
    params = dict(new_model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()


def assemble(
    layout: ResolvedLayout,
    rank: int,
    model_cfg: ModelConfig,
    optim_cfg: Mapping[str, Any],
    device: torch.device | str | None,
    *,
    seed: int,
    bucket_mb: float = 25.0,
    overlap_grad_sync: bool = False,
    tp_overlap: bool = False,
    tp_chunks: int = 1,
    compile: bool = False,
    keep: tuple[torch.optim.Optimizer, nn.Module] | None = None,
    make_model: Callable[[RankPlace], nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    sync_plan: SyncPlan | None = None,
    initialize: bool = True,
    groups_from: Any = None,
) -> RankState:
    """Build rank `rank`'s state on `layout` (collective over the layout's ranks: process groups and the
    sync plan).  `optim_cfg` holds the `optim` keys (lr, beta1, beta2, eps, weight_decay, distributed).

    `keep=(optimizer, old_model)` re-points an existing optimizer at the new parameters instead of
    building one (live recovery: the LR scheduler and Lightning hold that object); `make_model` builds
    the model slice in place of `place.build_model(model_cfg, seed)` (a model whose every value comes
    from elsewhere need not be initialised); `param_dtype` casts the parameters; `sync_plan` is this
    rank's gradient-sync plan computed up front (the dry run's fake process group moves no data);
    `tp_overlap`: the column-parallel layers overlap their input gradient's TP collective with their
    weight gradients (`ntp.tp_overlap`, `parallel.layers.set_tp_overlap`); `tp_chunks`: each
    micro-batch's layers run in that many chunks of the batch, each chunk's row-parallel collective beside
    the next chunk's compute (`ntp.tp_chunks`, `models.transformer.DecoderLM.run_blocks`).
    `compile`: each transformer block of the slice is compiled with torch.compile (`trainer.compile`,
    `runtime.compile.compile_blocks`; the config refuses the options it does not support).
    `initialize=False` draws no initial weight (`place.build_model(..., initialize=False)`): the
    caller overwrites every value before the first step (a checkpoint being resumed, the survivors'
    shards of a rejoin).  `groups_from`: the running topology whose process groups the new place uses
    (`RankPlace`; a re-layout of the shards among the same ranks)."""
    place = RankPlace(layout, rank, device=device, groups_from=groups_from)
    if make_model is not None:
        model = make_model(place)
    else:
        model = place.build_model(model_cfg, seed, param_dtype, initialize=initialize)
    set_tp_overlap(model, tp_overlap)
    if hasattr(model, "tp_chunks"):
        model.tp_chunks = int(tp_chunks)
    if compile:
        compile_blocks(model)
    runtime = NTPRuntime(place, model, bucket_mb=bucket_mb, plan=sync_plan)
    sync = runtime.sync
    # Every replica at one TP degree: each element's copies sit at the same position of their tensors.
    same_positions = len(set(layout.replica_tp)) == 1
    if keep is not None:
        optimizer, old_model = keep
        rebind_optimizer(optimizer, old_model, model)
        use_fused_adamw(optimizer, model, same_positions)
    else:
        o = optim_cfg
        optimizer = build_optimizer(model, sync, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                                    weight_decay=o["weight_decay"],
                                    distributed=bool(o.get("distributed", False)),
                                    same_positions=same_positions)
    grad_path = GradientPath(model, sync, optimizer, overlap=overlap_grad_sync)
    return RankState(layout, rank, runtime, model, optimizer, grad_path)


__all__ = ["RankState", "assemble", "rebind_optimizer"]
