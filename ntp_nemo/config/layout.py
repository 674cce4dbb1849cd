"""Resolve a validated config into the run's `ResolvedLayout`, once, before anything is launched."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.topology.layout import ResolvedLayout
from ntp_nemo.topology.work import WorkShape


def work_shape(cfg: DictConfig) -> WorkShape:
    """The model and sequence shape the per-rank work model (batch shares) reads."""
    m = cfg.model
    return WorkShape(
        hidden_size=int(m.hidden_size), num_layers=int(m.num_layers), num_heads=int(m.num_heads),
        num_kv_heads=int(m.num_kv_heads or m.num_heads), ffn_hidden_size=int(m.ffn_hidden_size),
        vocab_size=int(m.vocab_size), seq_len=int(cfg.data.seq_len), gated_mlp=str(m.arch) == "llama",
        tie_embeddings=bool(m.tie_embeddings),
    )


def resolve_layout(cfg: DictConfig, layer_tp: Sequence[int] | None = None) -> ResolvedLayout:
    """The layout of `cfg` (validated): per-slot degrees (planned when `layout.layer_tp=auto`), the
    pipeline split (cost-balanced unless `layout.stage_layers` is given) and the batch shares.

    `layer_tp`, when given, is taken as already resolved (skips the planner)."""
    from ntp_nemo.config.validate import resolve_layer_tp, resolved_replica_tp
    from ntp_nemo.pipeline.partition import resolve_stage_layers
    from ntp_nemo.pipeline.schedule import INTERLEAVED, interleaved_layers

    v = int(cfg.layout.get("virtual_stages", 1))

    if layer_tp is None:
        layer_tp = resolve_layer_tp(cfg)
    pb = cfg.ntp.power_boost
    power_boost = OmegaConf.to_container(pb) if OmegaConf.is_list(pb) else pb
    return ResolvedLayout.make(
        tp=int(cfg.mesh.tp),
        replica_tp=resolved_replica_tp(cfg),
        layer_tp=layer_tp,
        pp=int(cfg.mesh.pp),
        stage_layers=resolve_stage_layers(cfg, layer_tp) if str(cfg.layout.schedule) != INTERLEAVED else [
            sum(map(len, interleaved_layers(int(cfg.model.num_layers), int(cfg.mesh.pp), v, s)))
            for s in range(int(cfg.mesh.pp))],
        schedule=str(cfg.layout.schedule),
        virtual_stages=v,
        power_boost=power_boost,
        nominal_replicas=cfg.ntp.nominal_replicas,
        num_microbatches=int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size),
        sequence_parallel=bool(cfg.ntp.get("sequence_parallel", False)),
        shard_align=int(cfg.ntp.get("shard_align", 1)),
        work=work_shape(cfg),
        capacity=str(cfg.ntp.get("capacity", "ranks")),
    )
