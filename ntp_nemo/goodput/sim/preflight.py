"""Compose and validate every job of a Hydra command line before Hydra launches anything.

Hydra reports composition errors (unknown key, missing group option, bad override syntax) with
exit code 1, and a multirun would run the good jobs before reaching a bad one. Composing each
job's overrides up front turns all of these into ConfigError (exit code 2, nothing launched).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from ntp_nemo.errors import ConfigError

# Flags that change what Hydra composes or that do not run jobs: leave those command lines to Hydra.
_HYDRA_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--resolve",
    "--package",
    "-p",
    "--info",
    "-i",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--shell-completion",
    "-sc",
    "--experimental-rerun",
}
_RUN_FLAGS = {"-m", "--multirun"}


def expand_sweep(overrides: Sequence[str], max_jobs: int = 256) -> list[list[str]]:
    """The override list of every job a basic-sweeper multirun would launch (at most `max_jobs`)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise ConfigError("overrides", f"{err}") from err
    choices: list[list[str]] = []
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override():
            if not ov.is_discrete_sweep():
                raise ConfigError(
                    "overrides", f"{ov.input_line!r}: only comma lists and range() sweeps are supported."
                )
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([f"{key}={ov.get_value_element_as_str()}"])
    jobs = [list(c) for c in itertools.islice(itertools.product(*choices), max_jobs)]
    return jobs or [[]]


def preflight(
    config_dir: Path, config_name: str, argv: Sequence[str], check: Callable[[DictConfig], Any]
) -> bool:
    """Compose every job of `argv` and run `check` on it; False when the command line is left to Hydra."""
    if any(a.split("=")[0] in _HYDRA_FLAGS for a in argv if a.startswith("-")):
        return False
    overrides = [a for a in argv if a not in _RUN_FLAGS]
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        raise ConfigError("argv", f"unknown option(s) {unknown}; pass settings as key=value overrides.")
    jobs = expand_sweep(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            for job in jobs:
                try:
                    cfg = compose(config_name=config_name, overrides=job)
                except (HydraException, OmegaConfBaseException) as err:
                    raise ConfigError("overrides", f"{' '.join(job)}: {err}".strip()) from err
                check(cfg)
    finally:
        GlobalHydra.instance().clear()
    return True
