"""Resolve a validated config into the run's `ResolvedLayout`, once, before anything is launched."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.config.pattern_keys import slot_patterns
from ntp_nemo.models import families
from ntp_nemo.topology.layout import ResolvedLayout
from ntp_nemo.topology.topology import Topology
from ntp_nemo.topology.work import WorkShape


def work_shape(cfg: DictConfig) -> WorkShape:
    """The model and sequence shape the per-rank work model (batch shares) reads."""
    return families.work_shape(cfg.model, int(cfg.data.seq_len))


def resolve_layout(cfg: DictConfig, layer_tp: Sequence[int] | None = None) -> ResolvedLayout:
    """The layout of `cfg` (validated): per-slot degrees (planned when `layout.layer_tp=auto`), the
    pipeline split (cost-balanced unless `layout.stage_layers` is given) and the batch shares.

    `layer_tp`, when given, is taken as already resolved (skips the planner)."""
    from ntp_nemo.config.validate import resolve_layer_tp, resolved_replica_tp
    from ntp_nemo.pipeline.schedule import INTERLEAVED, interleaved_layers

    v = int(cfg.layout.get("virtual_stages", 1))

    if layer_tp is None:
        layer_tp = resolve_layer_tp(cfg)
    pb = cfg.ntp.power_boost
    power_boost = OmegaConf.to_container(pb) if OmegaConf.is_list(pb) else pb
    pp = int(cfg.mesh.pp)
    if str(cfg.layout.schedule) != INTERLEAVED:
        stage_layers = resolve_stage_layers(cfg, layer_tp)
    else:
        n = int(cfg.model.num_layers)
        stage_layers = [sum(map(len, interleaved_layers(n, pp, v, s))) for s in range(pp)]
    topology = Topology(int(cfg.mesh.tp), resolved_replica_tp(cfg), layer_tp, pp, stage_layers,
                        shard_align=int(cfg.ntp.get("shard_align", 1)))
    return ResolvedLayout.make(
        topology,
        schedule=str(cfg.layout.schedule),
        virtual_stages=v,
        power_boost=power_boost,
        nominal_replicas=cfg.ntp.nominal_replicas,
        num_microbatches=int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size),
        sequence_parallel=bool(cfg.ntp.get("sequence_parallel", False)),
        work=work_shape(cfg),
        capacity=str(cfg.ntp.get("capacity", "ranks")),
        pattern=slot_patterns(cfg),
    )


def resolve_stage_layers(cfg: DictConfig, layer_tp: Sequence[int] | None = None) -> list[int]:
    """Layers per stage for a run: `layout.stage_layers` when given, else the cost-balanced split.

    Call after `validate_pipeline(cfg)`; the balanced split needs the resolved per-slot degrees
    `layer_tp` (`resolve_layout` passes them)."""
    from ntp_nemo.pipeline.partition import balanced_partition, item_costs

    pp, num_layers = int(cfg.mesh.pp), int(cfg.model.num_layers)
    explicit = cfg.layout.get("stage_layers")
    if explicit is not None:
        return [int(x) for x in explicit]
    if pp == 1:
        return [num_layers]
    if layer_tp is None:
        raise ValueError("the cost-balanced pipeline split needs the resolved per-slot degrees (layer_tp)")
    costs = item_costs(families.model_shape(cfg.model), layer_tp, int(cfg.data.seq_len),
                       int(cfg.data.micro_batch_size))
    return balanced_partition(costs, pp)
