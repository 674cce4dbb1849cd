"""Checks of the pipeline keys (`mesh.pp`, `layout.stage_layers`, `layout.schedule`) before launch.

Both schedules run any micro-batch count, including fewer micro-batches than stages (1F1B then
cuts its warm-up short and the bubble grows, see `schedule.py`) and a replica that gets none in a
step, so no minimum count is enforced.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError
from ntp_nemo.pipeline.schedule import SCHEDULES


def validate_pipeline(cfg: DictConfig) -> None:
    """Raise ConfigError for an impossible pipeline layout."""
    pp, num_layers = int(cfg.mesh.pp), int(cfg.model.num_layers)
    schedule = cfg.layout.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise ConfigError("layout.schedule", f"unknown pipeline schedule {schedule!r}; use "
                          "layout.schedule=1f1b (bounded activation memory) or layout.schedule=gpipe.")
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
