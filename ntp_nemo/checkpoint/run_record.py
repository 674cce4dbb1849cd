"""The run directory's record of the resolved run (`.hydra/run_spec.json`): written by `ntp-train` once
the config is valid (`config/run_dir.py: save_record`, from `RunSpec.to_dict`), read by what works on a
run's checkpoints without its config (`ntp-export`): the model and data settings the run trained with,
derived values included (the tokenizer and vocabulary chosen from the data, `model.init_from` applied).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ntp_nemo.data.bounded_json import read_json
from ntp_nemo.errors import ConfigError

RECORD_DIR = ".hydra"  # Hydra's name for a run's record (`config/run_dir.py` names it too: it stays light)
RUN_SPEC = "run_spec.json"


def run_spec_path(run_dir: Path) -> Path:
    return Path(run_dir) / RECORD_DIR / RUN_SPEC


def read_run_spec(run_dir: Path, key: str = "run") -> dict[str, Any] | None:
    """The resolved run `run_dir` recorded, or None for a run directory without the record (written
    before it was recorded, or by hand); an unreadable record is a `ConfigError` naming `key`."""
    path = run_spec_path(run_dir)
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{path} is not a readable run record ({err}); ntp-train writes it once the "
                          "config is valid: run ntp-train in that run directory again, or move the "
                          "file away to fall back to .hydra/config.yaml.") from None
    if not isinstance(doc, dict):
        raise ConfigError(key, f"{path} holds no run record (a JSON object is expected); move it away to "
                          "fall back to .hydra/config.yaml.")
    return doc


__all__ = ["RECORD_DIR", "RUN_SPEC", "read_run_spec", "run_spec_path"]
