"""Hydra ConfigStore registration: the typed root schema and the recipes group."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ntp_nemo.config.paths import recipes_dir
from ntp_nemo.config.schema import RootConfig

_registered = False


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def register_configs() -> None:
    """Register `base_config` (typed defaults) and every `recipes/NAME.yaml` as `recipe=NAME`.

    Recipes live in the top-level `recipes/` folder rather than inside `conf/`, so they are stored
    in the ConfigStore as `_global_` packages, exactly as a `# @package _global_` file would be.
    """
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = True
