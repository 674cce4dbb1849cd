"""`ntp-train --help` names every other program the package installs ([project.scripts])."""

from __future__ import annotations

import tomllib

from ntp_nemo.config.help import help_text
from tests.conftest import ROOT


def test_help_lists_every_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    listed = help_text().split("other commands", 1)[1].splitlines()[1:]
    assert sorted(line.split()[0] for line in listed) == sorted(set(scripts) - {"ntp-train"})
    assert "ntp-coordinator" in help_text()
