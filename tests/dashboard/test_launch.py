"""`dashboard.port=N` with ntp-train: a value that is no port is the key's error (exit 2), before any
process starts; the dashboard the launching process starts is covered by tests/dashboard/test_browser.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ntp_nemo.dashboard.launch import command, dashboard_beside
from ntp_nemo.errors import ConfigError
from tests.conftest import TINY, run_cli


def test_a_port_that_is_not_one_is_the_keys_error(tmp_path):
    proc = run_cli([*TINY, "dashboard.port=70000", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "dashboard.port" in proc.stderr and "Traceback" not in proc.stderr
    for bad in (-1, 65536, True, "80"):
        with pytest.raises(ConfigError, match="dashboard.port"), \
                dashboard_beside(SimpleNamespace(port=bad, host="127.0.0.1"), tmp_path):
            pass


def test_off_unless_asked_and_on_loopback_with_the_launcher_as_parent(tmp_path):
    with dashboard_beside(SimpleNamespace(port=None, host="127.0.0.1"), tmp_path) as proc:
        assert proc is None
    with dashboard_beside(SimpleNamespace(port=0, host="127.0.0.1"), tmp_path, enabled=False) as proc:
        assert proc is None  # not the launcher's rank 0
    cmd = command(tmp_path, 0, "127.0.0.1")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--parent" in cmd
