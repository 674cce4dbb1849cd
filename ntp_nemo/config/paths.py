"""Where the packaged Hydra config tree and recipes live (editable or regular install)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def conf_dir() -> Path:
    """Directory of the top-level `conf/` tree (installed as package data `ntp_nemo.conf`)."""
    return Path(str(resources.files("ntp_nemo.conf")))


def recipes_dir() -> Path:
    """Directory of the top-level `recipes/` (installed as package data `ntp_nemo.recipes`)."""
    return Path(str(resources.files("ntp_nemo.recipes")))
