"""The `model` config group as a `ModelConfig`: written once for every entry point."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from ntp_nemo.models.model_config import ModelConfig


def model_config(model: Any) -> ModelConfig:
    """`model` (the config's `model` group, or a mapping of its keys) as the ModelConfig every rank
    builds from: the ModelConfig fields (Hydra's `_target_` and other keys dropped), with the
    architecture fields read from `init_from`'s config.json when one is given."""
    from ntp_nemo.hf import resolve_model_config

    raw = OmegaConf.to_container(model, resolve=True) if OmegaConf.is_config(model) else dict(model)
    assert isinstance(raw, Mapping)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return resolve_model_config(ModelConfig(**{k: v for k, v in raw.items() if k in names}))


__all__ = ["model_config"]
