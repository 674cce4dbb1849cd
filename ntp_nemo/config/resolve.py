"""`resolve(cfg) -> RunSpec`: the validated config turned, once at the entry point, into the plain value
everything below the entry point takes (the model, the one `ResolvedLayout`, the data, optimizer,
trainer, checkpoint, NTP, quantisation and failover settings, the callbacks and loggers to build).
Nothing below the entry point receives a `DictConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.config.failover import FailoverSpec
from ntp_nemo.config.schema import CheckpointConfig, DataConfig, NTPConfig, OptimConfig, TrainerConfig
from ntp_nemo.models.config import ModelConfig
from ntp_nemo.quant.config import QuantConfig
from ntp_nemo.topology.layout import ResolvedLayout

T = TypeVar("T")


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: what the supervisor, the trainer factory and every rank are built from."""

    recipe: str
    seed: int
    model: ModelConfig  # `init_from`'s architecture applied
    layout: ResolvedLayout
    data: DataConfig  # tokenizer and vocabulary chosen
    optim: OptimConfig
    trainer: TrainerConfig
    checkpoint: CheckpointConfig
    ntp: NTPConfig
    quant: QuantConfig
    failover: FailoverSpec
    callbacks: tuple[dict[str, Any], ...]  # `_target_` specs, instantiated by the trainer factory
    loggers: tuple[dict[str, Any], ...]

    @property
    def num_microbatches(self) -> int:
        return self.data.global_batch_size // self.data.micro_batch_size

    def optim_options(self) -> dict[str, Any]:
        """The optimizer keys as `assemble` takes them."""
        return dataclasses.asdict(self.optim)


def _typed(node: Any, cls: type[T]) -> T:
    """A config group as its schema dataclass (a config composed without the schema: from its keys)."""
    value = OmegaConf.to_object(node)
    if isinstance(value, cls):
        return value
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in dict(value).items() if k in names})


def _specs(group: Any) -> tuple[dict[str, Any], ...]:
    if not group:
        return ()
    return tuple(OmegaConf.to_container(c, resolve=True) for c in group.values() if c is not None)


def resolve(cfg: DictConfig, layout: ResolvedLayout | None = None,
            failover: FailoverSpec | None = None) -> RunSpec:
    """The RunSpec of a validated config; `layout` and `failover` when already resolved from it."""
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.layout import resolve_layout
    from ntp_nemo.config.model import model_config

    return RunSpec(
        recipe=str(cfg.recipe),
        seed=int(cfg.seed),
        model=model_config(cfg.model),
        layout=layout if layout is not None else resolve_layout(cfg),
        data=_typed(cfg.data, DataConfig),
        optim=_typed(cfg.optim, OptimConfig),
        trainer=_typed(cfg.trainer, TrainerConfig),
        checkpoint=_typed(cfg.checkpoint, CheckpointConfig),
        ntp=_typed(cfg.ntp, NTPConfig),
        quant=_typed(cfg.quant, QuantConfig),
        failover=failover if failover is not None else failover_spec(cfg),
        callbacks=_specs(cfg.get("callbacks")),
        loggers=_specs(cfg.get("logger")),
    )


__all__ = ["RunSpec", "resolve"]
