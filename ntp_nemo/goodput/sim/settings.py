"""Validated simulator settings built from the `conf/sim` Hydra config.

Every check happens here, before any study runs, and raises ConfigError naming the key, so a bad
value exits with code 2 and nothing is simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.sim.domains import ClusterSpec
from ntp_nemo.goodput.sim.failures import BERNOULLI, EXACT, FailureSpec
from ntp_nemo.goodput.sim.policy_tables import POLICIES
from ntp_nemo.goodput.sim.stragglers import StragglerSpec
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape

STUDIES = ("availability", "throughput", "trace", "stragglers")


@dataclass(frozen=True)
class TrainSpec:
    """Global batch and pipeline schedule of the simulated job."""

    tokens_per_batch: int
    micro_batch_size: int = 1
    pp_interleave: int = 1


@dataclass(frozen=True)
class PlacementSpec:
    """Random-placement sweep: `num_fractions` failed fractions from 0 to `failed_fraction_max`."""

    samples: int = 100
    sampling: str = EXACT
    failed_fraction_max: float = 0.005
    num_fractions: int = 20

    @property
    def fractions(self) -> np.ndarray:
        return np.linspace(0.0, self.failed_fraction_max, self.num_fractions)


@dataclass(frozen=True)
class AvailabilitySpec:
    """Replica availability vs TP degree: replicas of one TP group (pp=1) in domains of the TP size."""

    tp: tuple[int, ...] = (8, 16, 32, 64)
    failed_fraction: float = 0.001
    num_gpus: int = 32768


@dataclass(frozen=True)
class SimSettings:
    cluster: ClusterSpec
    model: ModelShape
    device: DeviceModel
    links: LinkModel
    train: TrainSpec
    failures: FailureSpec
    placements: PlacementSpec
    availability: AvailabilitySpec
    policies: tuple[str, ...]
    studies: tuple[str, ...]
    power_boost_cap: float = 0.3
    seed: int = 0
    plots: bool = True
    stragglers: StragglerSpec = StragglerSpec()

    @property
    def seq_len(self) -> int:
        assert self.model.seq_len is not None
        return self.model.seq_len

    @property
    def local_batch(self) -> int:
        """Sequences per replica per step in the failure-free job."""
        return self.train.tokens_per_batch // self.seq_len // self.cluster.num_replicas


def _section(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = cfg.get(key)
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping of settings, got {value!r}.")
    return dict(value)


def _build(cls: type, data: Mapping[str, Any], key: str, tuples: tuple[str, ...] = ()) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(key, f"unknown field(s) {unknown}; known fields are {sorted(names)}.")
    data = dict(data)
    for name in tuples:
        value = data.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            data[name] = (value,)
        elif isinstance(value, list):
            data[name] = tuple(value)
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigError(key, f"{err}.") from err


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}.")


def settings_from_config(cfg: DictConfig | Mapping[str, Any]) -> SimSettings:
    """Validate the composed `conf/sim` config and turn it into value objects."""
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    assert isinstance(raw, dict)
    cluster = _build(ClusterSpec, _section(raw, "cluster"), "cluster")
    if cluster.degraded_tp is not None:
        cluster = dataclasses.replace(cluster, degraded_tp=tuple(cluster.degraded_tp))
    model = ModelShape.from_dict(_section(raw, "model"))
    if model.seq_len is None:
        raise ConfigError(
            "model.seq_len", "the simulator needs the training sequence length; set model.seq_len."
        )
    hardware = _section(raw, "hardware")
    device = DeviceModel.from_dict(_section(hardware, "device"), "hardware.device")
    links = LinkModel.from_dict(_section(hardware, "links"), "hardware.links")
    train = _build(TrainSpec, _section(raw, "train"), "train")
    for name in ("tokens_per_batch", "micro_batch_size", "pp_interleave"):
        _positive_int(f"train.{name}", getattr(train, name))
    failures = _build(
        FailureSpec, _section(raw, "failures"), "failures", ("rate_multipliers", "hardware_repair_hours")
    )
    placements = _build(PlacementSpec, _section(raw, "placements"), "placements")
    _positive_int("placements.samples", placements.samples)
    _positive_int("placements.num_fractions", placements.num_fractions)
    if placements.sampling not in (EXACT, BERNOULLI):
        raise ConfigError("placements.sampling", f"{placements.sampling!r}; use {EXACT!r} or {BERNOULLI!r}.")
    if not 0 <= placements.failed_fraction_max < 1:
        raise ConfigError(
            "placements.failed_fraction_max", f"must be in [0, 1), got {placements.failed_fraction_max}."
        )
    availability = _build(AvailabilitySpec, _section(raw, "availability"), "availability", ("tp",))
    for t in availability.tp:
        _positive_int("availability.tp", t)
        if availability.num_gpus % t:
            raise ConfigError(
                "availability.tp", f"{t} does not divide availability.num_gpus={availability.num_gpus}."
            )
    if not 0 <= availability.failed_fraction < 1:
        raise ConfigError(
            "availability.failed_fraction", f"must be in [0, 1), got {availability.failed_fraction}."
        )
    policies = tuple(raw.get("policies") or ())
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ConfigError("policies", f"{list(policies)}: choose one or more of {list(POLICIES)}.")
    studies = tuple(raw.get("studies") or ())
    bad = [s for s in studies if s not in STUDIES]
    if bad:
        raise ConfigError("studies", f"unknown {bad}; choose from {list(STUDIES)}.")
    stragglers = (_build(StragglerSpec, _section(raw, "stragglers"), "stragglers", ("speed", "policies"))
                  if raw.get("stragglers") is not None else StragglerSpec())
    cap = raw.get("power_boost_cap", 0.3)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
        raise ConfigError("power_boost_cap", f"must be a non-negative fraction (0.3 = +30%), got {cap!r}.")
    settings = SimSettings(
        cluster=cluster,
        model=model,
        device=device,
        links=links,
        train=train,
        failures=failures,
        placements=placements,
        availability=availability,
        policies=policies,
        studies=studies,
        power_boost_cap=float(cap),
        seed=int(raw.get("seed", 0)),
        plots=bool(raw.get("plots", True)),
        stragglers=stragglers,
    )
    _check_batch(settings)
    _check_units(settings)
    return settings


def _check_batch(s: SimSettings) -> None:
    seqs, rem = divmod(s.train.tokens_per_batch, s.seq_len)
    per_replica, rem2 = divmod(seqs, s.cluster.num_replicas)
    if rem or rem2 or per_replica % s.train.micro_batch_size or per_replica == 0:
        raise ConfigError(
            "train.tokens_per_batch",
            f"{s.train.tokens_per_batch} tokens of seq_len {s.seq_len} over "
            f"{s.cluster.num_replicas} replicas "
            f"is not a whole number of micro-batches of {s.train.micro_batch_size} per replica; choose a "
            f"multiple of seq_len x replicas x micro_batch_size = "
            f"{s.seq_len * s.cluster.num_replicas * s.train.micro_batch_size}.",
        )


def _check_units(s: SimSettings) -> None:
    units = min(s.model.num_heads, s.model.ffn_hidden_size)
    if s.cluster.tp > units:
        raise ConfigError(
            "cluster.tp",
            f"{s.cluster.tp} ranks but the model has only {units} attention heads or FFN columns to shard.",
        )
    if s.cluster.pp > s.model.num_layers:
        raise ConfigError("cluster.pp", f"{s.cluster.pp} stages for {s.model.num_layers} layers.")
