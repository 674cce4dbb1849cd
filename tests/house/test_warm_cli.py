"""The warm interpreter `run_cli` uses (tests/warm_cli.py) runs a command as a fresh `python -m` does: the
same exit code, stdout and stderr, relative paths read from the caller's working directory, the
caller's environment and umask, and an exception's traceback with exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import warm_cli


def _both(module: str, args: list[str], cwd, env: dict[str, str] | None = None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    assert os.environ.get(warm_cli.ENV), "the session's warm interpreter is not running"
    warm = warm_cli.run(module, args, cwd, env, timeout=120)
    cold = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    return warm, cold


def test_a_command_reads_its_working_directory_and_exits_as_a_fresh_one(tmp_path):
    (tmp_path / "doc.json").write_text(json.dumps({"b": [1, 2], "a": None}))
    warm, cold = _both("json.tool", ["--sort-keys", "doc.json"], tmp_path)
    assert warm.returncode == cold.returncode == 0 and warm.stdout == cold.stdout
    assert '"a": null' in warm.stdout
    warm, cold = _both("json.tool", ["missing.json"], tmp_path)
    assert warm.returncode == cold.returncode != 0
    assert warm.stderr == cold.stderr and "missing.json" in warm.stderr


def test_a_config_error_is_the_same_one_paragraph_and_exit_2(tmp_path):
    warm, cold = _both("ntp_nemo.train", ["trainer.max_stepz=3"], tmp_path)
    assert warm.returncode == cold.returncode == 2
    assert warm.stderr == cold.stderr and "trainer.max_stepz" in warm.stderr
    assert "Traceback" not in warm.stderr


def test_environment_umask_and_an_uncaught_exception(tmp_path):
    code = ("import os, sys; m = os.umask(0); print(os.environ['PROBE'], oct(m), os.getcwd()); "
            "sys.stdout.flush(); raise ValueError('probe')")
    (tmp_path / "probe_mod.py").write_text(code)
    old = os.umask(0o027)
    try:
        warm, cold = _both("probe_mod", [], tmp_path, {"PROBE": "seen"})
    finally:
        os.umask(old)
    assert warm.returncode == cold.returncode == 1
    assert warm.stdout == cold.stdout == f"seen 0o27 {tmp_path}\n"
    assert warm.stderr.startswith("Traceback") and warm.stderr.rstrip().endswith("ValueError: probe")


def test_help_is_printed_alike(tmp_path):
    warm, cold = _both("ntp_nemo.train", ["--help"], tmp_path)
    assert warm.returncode == cold.returncode == 0 and warm.stdout == cold.stdout and warm.stdout
