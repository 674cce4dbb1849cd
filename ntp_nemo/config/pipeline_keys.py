"""Checks of the pipeline keys (`mesh.pp`, `layout.stage_layers`, `layout.schedule`,
`layout.virtual_stages`) before launch: the config layer's, so that `pipeline/` never reads a config.

Both schedules run any micro-batch count, including fewer micro-batches than stages (1F1B then
cuts its warm-up short and the bubble grows, see `schedule.py`) and a replica that gets none in a
step, so no minimum count is enforced.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError
from ntp_nemo.pipeline.schedule import INTERLEAVED, SCHEDULES


def validate_pipeline(cfg: DictConfig) -> None:
    """Raise ConfigError for an impossible pipeline layout."""
    pp, num_layers = int(cfg.mesh.pp), int(cfg.model.num_layers)
    schedule = cfg.layout.get("schedule", "1f1b")
    if schedule not in SCHEDULES and schedule != INTERLEAVED:
        raise ConfigError("layout.schedule", f"unknown pipeline schedule {schedule!r}; use "
                          "layout.schedule=1f1b (bounded activation memory), layout.schedule=gpipe, or "
                          "layout.schedule=interleaved_1f1b with layout.virtual_stages=v (smaller bubble).")
    if schedule == INTERLEAVED:
        validate_interleaving(cfg)
    if pp < 1:
        raise ConfigError("mesh.pp", f"must be a positive integer, got {pp}.")
    if pp > num_layers:
        raise ConfigError("mesh.pp", f"mesh.pp={pp} stages for model.num_layers={num_layers} layers: every "
                          f"stage needs at least one transformer layer; use mesh.pp <= {num_layers}.")
    trainer = cfg.get("trainer")
    if pp > 1 and trainer is not None and trainer.get("precision") == "16-mixed":
        raise ConfigError("trainer.precision", "16-mixed scales the loss on every backward call, which a "
                          "pipeline makes once per stage; use trainer.precision=bf16-mixed or 32-true with "
                          "mesh.pp > 1.")
    explicit = cfg.layout.get("stage_layers")
    if explicit is None:
        return
    layers = OmegaConf.to_container(explicit) if OmegaConf.is_config(explicit) else explicit
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ConfigError("layout.stage_layers", f"must be a list of integers (layers per stage), got "
                          f"{layers!r}; e.g. layout.stage_layers=[2,2].")
    if len(layers) != pp:
        raise ConfigError("layout.stage_layers", f"{list(layers)} has {len(layers)} entries but "
                          f"mesh.pp={pp}; give one layer count per pipeline stage, or drop "
                          "layout.stage_layers for the cost-balanced split.")
    if any(x < 1 for x in layers):
        raise ConfigError("layout.stage_layers", f"{list(layers)}: every stage needs at least one "
                          "transformer layer.")
    if sum(layers) != num_layers:
        raise ConfigError("layout.stage_layers", f"{list(layers)} sums to {sum(layers)} but model.num_layers="
                          f"{num_layers}; the stages must hold every layer exactly once.")


def validate_interleaving(cfg: DictConfig) -> None:
    """`layout.schedule=interleaved_1f1b`: v >= 2 chunks per stage, pp >= 2, enough layers, even split."""
    pp, num_layers = int(cfg.mesh.pp), int(cfg.model.num_layers)
    v = cfg.layout.get("virtual_stages", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise ConfigError("layout.virtual_stages", f"interleaved_1f1b needs at least 2 model chunks per "
                          f"stage, got layout.virtual_stages={v!r}; e.g. layout.virtual_stages=2.")
    if pp < 2:
        raise ConfigError("layout.schedule", "interleaved_1f1b interleaves pipeline stages; it needs "
                          "mesh.pp >= 2 (use the default layout.schedule=1f1b with mesh.pp=1).")
    if pp * v > num_layers:
        raise ConfigError("layout.virtual_stages", f"mesh.pp={pp} x layout.virtual_stages={v} = {pp * v} "
                          f"virtual stages for model.num_layers={num_layers} layers: each needs a layer; use "
                          f"layout.virtual_stages <= {num_layers // pp}.")
    if cfg.layout.get("stage_layers") is not None:
        raise ConfigError("layout.stage_layers", "interleaved_1f1b splits the layers evenly into mesh.pp x "
                          "layout.virtual_stages chunks; drop layout.stage_layers.")
