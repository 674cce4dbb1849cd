"""Shared fixtures: composing real configs and running the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Small enough for 2 cores, big enough to learn: used by CLI tests unless they override it.
TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.max_seq_len=64",
    "data.seq_len=32",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",  # the tiny model is stable at 3e-3 (gpt_tiny's recipe uses 1e-3)
    "trainer.val_every_n_steps=1000",
    "trainer.progress_bar=false",
    "checkpoint.every_n_steps=0",
    "logger=none",
    "callbacks=none",
]
SINGLE = ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null"]


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One corpus/token cache for the whole session (the embedded corpus is tokenised once)."""
    if "NTP_NEMO_CACHE" not in os.environ:
        os.environ["NTP_NEMO_CACHE"] = str(tmp_path_factory.mktemp("ntp_cache"))


def run_cli(
    args: list[str], cwd: Path, timeout: int = 300, module: str = "ntp_nemo.train"
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)
