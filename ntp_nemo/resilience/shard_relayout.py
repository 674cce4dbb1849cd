"""Shard re-layout inside a running job: the same ranks take other shards, filled from their own memory.

The straggler policy `rebalance` weighs the shards inside a slow rank's TP group by measured speed
(`ResolvedLayout.shard_speeds`, `topology.shard.shard_interval`); every rank stays where it is, in the same
process groups.  `relayout` is the live reshard of a failure (`live.capture` then `live.reshard_snapshot`)
with every rank of the job as a survivor: each rank builds its state on the new layout (the caller's
`build`, e.g. `strategy_builder`: `runtime.assemble` with the running optimizer object pointed at the new
parameters and the running process groups), and the elements it now holds and did not hold come from the
peers of its TP group that held them; everything else is a local copy.  A fake-quantised model (QAT) is
quantised alike on the new shards first (`quant_state.restore_quant_state`, as a checkpoint load does), its
amax buffers resharded with the weights.  No restart, no disk; the global batch and the optimizer state
carry over, so the loss curve is the one the old layout would have given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ntp_nemo.resilience.live import ReshardResult, capture, reshard_snapshot
from ntp_nemo.topology.layout import ResolvedLayout

# build(layout, rank) -> the rank's state on `layout` (a `runtime.assemble.RankState`)
BuildFn = Callable[[ResolvedLayout, int], Any]


def relayout(state: Any, layout: ResolvedLayout, build: BuildFn) -> tuple[Any, ReshardResult]:
    """Collective over the job's ranks (the default group), called by every rank at the same point
    between steps: `state` (a `RankState`) re-laid out on `layout`, a layout of the same ranks and
    groups (`same_ranks`) whose shards differ.  Returns the new state, for the caller to adopt, and what
    the reshard moved."""
    if not layout.same_ranks(state.layout):
        raise ValueError(f"a shard re-layout keeps the ranks: {layout.describe()} is not "
                         f"{state.layout.describe()}")
    from ntp_nemo.quant.sharding import is_quantized

    snapshot = capture(state.model, state.optimizer)  # references: `build` may rebind the optimizer
    new = build(layout, state.rank)
    if is_quantized(state.model) and not is_quantized(new.model):
        from ntp_nemo.quant.quant_state import quant_state, restore_quant_state

        # the quantisers with their amax buffers of the new shards; the reshard fills the buffers
        restore_quant_state(new.model, quant_state(state.model))
    result = reshard_snapshot(snapshot, new.model, new.optimizer, state.layout.replica_of(state.rank))
    return new, result


def strategy_builder(strategy: Any, share_groups: bool = True) -> BuildFn:
    """build(layout, rank) -> RankState for an `NTPStrategy` holding a state: `runtime.assemble` with the
    Lightning module's options (as at start-up), the running optimizer object pointed at the new
    parameters (the LR scheduler and Lightning hold it), the parameters' running dtype (at start-up
    Lightning's precision plugin casts the model after `assemble`: a rebuilt model must match the
    optimizer state it inherits) and nothing drawn (the reshard writes every value).  `share_groups`: the
    running topology's process groups (a re-layout of the same ranks); else the groups are made on the
    current default group (a live recovery's new generation: `live_worker.LiveRecovery`).  The layout is
    taken as it is: sequence parallelism, shard alignment, work model and capacity rule follow it, so every
    rank computes the same batch split."""
    from ntp_nemo.runtime.assemble import assemble

    module = strategy.lightning_module
    keep = (strategy.torch_optimizer, module.model)
    param_dtype = next((p.dtype for p in module.model.parameters()), None)
    groups_from = strategy.state.runtime.topology if share_groups else None

    def build(layout: ResolvedLayout, rank: int) -> Any:
        return assemble(layout, rank, module.model_cfg, module.optim_cfg, strategy.root_device,
                        seed=module.seed, bucket_mb=strategy.bucket_mb,
                        overlap_grad_sync=module.overlap_grad_sync, tp_overlap=module.tp_overlap,
                        tp_chunks=module.tp_chunks, compile=module.compile_blocks, keep=keep,
                        param_dtype=param_dtype, initialize=False, groups_from=groups_from)

    return build


__all__ = ["relayout", "strategy_builder"]
