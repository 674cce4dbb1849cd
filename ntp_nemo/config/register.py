"""Hydra ConfigStore registration: the typed root schema and the recipes group."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ntp_nemo.config.paths import recipes_dir
from ntp_nemo.config.schema import RootConfig


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def mandatory_keys(recipe: str) -> list[str]:
    """Dotted keys that `recipes/NAME.yaml` marks `???` (must be given on the command line)."""
    path = recipes_dir() / f"{recipe}.yaml"
    if not path.is_file():
        return []
    out: list[str] = []

    def walk(node, prefix: str) -> None:
        for key in node:
            if key == "defaults":
                continue
            full = f"{prefix}{key}"
            if OmegaConf.is_missing(node, key):
                out.append(full)
            elif OmegaConf.is_dict(node[key]):
                walk(node[key], full + ".")

    walk(OmegaConf.load(path), "")
    return out


def register_configs() -> None:
    """Register `base_config` (typed defaults) and every `recipes/NAME.yaml` as `recipe=NAME`.

    Recipes live in the top-level `recipes/` folder rather than inside `conf/`, so they are stored
    in the ConfigStore as `_global_` packages, exactly as a `# @package _global_` file would be.
    """
    cs = ConfigStore.instance()
    if "base_config.yaml" in cs.list(""):  # the store (one per process) holds them already
        return
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    cs.store(name="base_config", node=RootConfig)  # last: its presence says the registration is complete
