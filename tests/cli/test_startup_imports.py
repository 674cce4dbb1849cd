"""Startup: `ntp-train` answers a config mistake (exit 2) without importing the heavy libraries.

Each case runs the installed `ntp-train` console-script entry point in a fresh interpreter, in
process, and then reads that interpreter's `sys.modules`: a misspelt key is answered before Hydra is
imported, a bad value before torch, and neither imports Lightning, modelopt or matplotlib (which the
launching process imports only once the config is valid, just before it forks the workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.conftest import ROOT

PROBE = """
import json, sys
from importlib.metadata import entry_points

main = entry_points(group="console_scripts")["ntp-train"].load()
sys.argv = ["ntp-train", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = ("hydra", "torch", "torch.distributed", "lightning", "modelopt", "matplotlib", "transformers")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""

LIBRARIES = {"lightning", "modelopt", "matplotlib", "transformers", "torch.distributed"}


def _probe(args: list[str], tmp_path) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_misspelt_key_answers_before_hydra(tmp_path):
    got, err = _probe(["model.hiden_size=64"], tmp_path)
    assert got["code"] == 2, err
    assert "Did you mean model.hidden_size?" in err and "Traceback" not in err
    assert got["imported"] == [], got  # not even Hydra: the key is checked against the schema


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["model.hidden_size=-3"], "model.hidden_size: must be a positive integer"),
        (["trainer.max_steps=0"], "trainer.max_steps"),
        (["mesh.dp=3", "ntp.replica_tp=[2,2]"], "ntp.replica_tp"),
        (["data.path=/nonexistent/corpus.txt"], "data.path"),
        (["model.init_from=/nonexistent/model"], "model.init_from"),
        (["quant=fp8", "quant.start_step=500", "trainer.max_steps=10"], "quant.start_step"),
        (["model=gpt_tinyy"], "model/gpt_tinyy"),
        (["fault.recovery=sideways"], "fault.recovery"),
        (["fault=kill_rank", "fault.phase=during"], "fault.phase"),
        (["fault.heartbeat_timeout_s=700"], "fault.heartbeat_timeout_s"),
    ],
)
def test_bad_value_answers_before_torch(tmp_path, args, says):
    got, err = _probe(args, tmp_path)
    assert got["code"] == 2, err
    assert says in err and "Traceback" not in err
    assert not {"torch", *LIBRARIES} & set(got["imported"]), got
    assert not (tmp_path / "run").exists()


def test_probe_sees_the_imports_of_a_valid_command(tmp_path):
    """The probe itself: a command that gets past validation does import torch (a dry run, no worker)."""
    got, err = _probe(["trainer.dry_run=true", "model.num_layers=2"], tmp_path)
    assert got["code"] == 0, err
    assert "torch" in got["imported"], got


def test_entry_point_is_this_checkout():
    """The probes load the installed `ntp-train`; it must be this checkout's."""
    import ntp_nemo

    assert entry_points(group="console_scripts")["ntp-train"].value == "ntp_nemo.cli.train:main"
    assert ROOT in Path(ntp_nemo.__file__).resolve().parents
