"""`resolve(cfg) -> RunSpec`: the composed config turned, once at each entry point (`ntp-train` and each
job of a sweep, the dry run, `ntp-coordinator`), into the plain value everything below the entry point
takes (the model, the one `ResolvedLayout`, the data, optimizer, trainer, checkpoint, NTP, quantisation
and failover settings, the callbacks and loggers to build).  Nothing below the entry point receives a
`DictConfig`.

`resolve` is pure: the composed config is never changed.  The values derived from it (a warmup clamped
to the run, a recipe's `ntp.replica_tp` following a `mesh.tp` given on the command line, the tokenizer
and `model.vocab_size` chosen from the data) live in the `RunSpec` only, which is sealed all the way down
(`ntp_nemo.sealed`: tuples, frozen mappings, dataclasses that refuse assignment).  The run directory
records it (`run_spec.json`, `RunSpec.to_dict`), and `ntp-export` reads the model from that record.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from ntp_nemo.config.failover import FailoverSpec
from ntp_nemo.config.schema import CheckpointConfig, DataConfig, NTPConfig, OptimConfig, TrainerConfig
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.quant.qat_config import QuantConfig
from ntp_nemo.sealed import frozen, seal
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
    record: str = ""  # the composed config with the derived values, as YAML: `.hydra/config.yaml`

    @property
    def num_microbatches(self) -> int:
        return self.data.global_batch_size // self.data.micro_batch_size

    def optim_options(self) -> dict[str, Any]:
        """The optimizer keys as `assemble` takes them."""
        return dataclasses.asdict(self.optim)

    def to_dict(self) -> dict[str, Any]:
        """The resolved run as plain JSON values (`run_spec.json` of the run directory)."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("layout", "record")}
        out["layout"] = self.layout.to_dict()
        return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _typed(node: Any, cls: type[T]) -> T:
    """A config group as its schema dataclass (a config composed without the schema: from its keys)."""
    value = OmegaConf.to_object(node)
    if isinstance(value, cls):
        return value
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in dict(value).items() if k in names})


def _specs(group: Any) -> tuple[dict[str, Any], ...]:
    """The `_target_` specs of a group, interpolations resolved; outside a Hydra run (the coordinator,
    `ntp-plan`), where nothing builds a callback or logger, a `${hydra:...}` path stays as written."""
    if not group:
        return ()
    try:
        return tuple(OmegaConf.to_container(c, resolve=True) for c in group.values() if c is not None)
    except InterpolationResolutionError:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            raise
        return tuple(OmegaConf.to_container(c, resolve=False) for c in group.values() if c is not None)


def with_values(cfg: DictConfig, values: dict[str, Any]) -> DictConfig:
    """A copy of `cfg` with `values` ({dotted key: value}) set; `cfg` is not changed."""
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    with open_dict(out):
        for key, value in values.items():
            OmegaConf.update(out, key, value, merge=False)
    return out


def resolve(cfg: DictConfig, explicit: Collection[str] = (), *, reads_data: bool = True) -> RunSpec:
    """The RunSpec of the composed config `cfg`, after every value check (`ConfigError` on bad input);
    `cfg` itself is not changed.  `explicit`: the keys set on the command line (a recipe's replica
    degrees follow a mesh given there; a `model.vocab_size` given there is checked against the
    tokenizer).  `reads_data=False` (the dry run, the coordinator): the data files are neither required
    nor read, and `model.vocab_size` is taken as given."""
    from ntp_nemo.config import checks
    from ntp_nemo.config.data_keys import resolve_data_config
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.model import model_config
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.config.validate import resolve_init_from, validate

    explicit = set(explicit)
    checks.require_mandatory(cfg, reads_data)
    # What is derived, each helper returning its values from the composed config: {key: value}.
    derived: dict[str, Any] = {f"data.{key}": None for key in ("path", "blend", "val_path")
                               if not reads_data and key in cfg.data}
    derived |= checks.adjust(cfg)
    derived |= checks.follow_mesh(cfg, explicit)  # a recipe's replica_tp that a mesh override no longer fits
    if reads_data:
        chosen = resolve_data_config(cfg, explicit)  # the tokenizer sizes model.vocab_size (unless given)
        derived |= {"data.tokenizer": chosen["tokenizer"], "model.vocab_size": chosen["vocab_size"]}
    # The architecture of model.init_from's config.json (given the vocabulary chosen above).
    derived |= resolve_init_from(with_values(cfg, derived))
    work = with_values(cfg, derived)  # the composed config with every derived value: what is checked and run
    validate(work)  # checks only
    layout = resolve_layout(work)  # once: the supervisor, the strategy and every rank take this value
    checks.check_batch_split(layout, int(work.data.micro_batch_size))
    checks.warn_no_ops(work, layout)
    spec = RunSpec(
        recipe=str(work.recipe),
        seed=int(work.seed),
        model=model_config(work.model),
        layout=layout,
        data=_typed(work.data, DataConfig),
        optim=_typed(work.optim, OptimConfig),
        trainer=_typed(work.trainer, TrainerConfig),
        checkpoint=_typed(work.checkpoint, CheckpointConfig),
        ntp=_typed(work.ntp, NTPConfig),
        quant=_typed(work.quant, QuantConfig),
        failover=failover_spec(work),
        callbacks=frozen(_specs(work.get("callbacks"))),
        loggers=frozen(_specs(work.get("logger"))),
        record=OmegaConf.to_yaml(work),
    )
    return seal(spec)


__all__ = ["RunSpec", "resolve", "with_values"]
