"""Commands whose packages are extras (not in the default install) say clearly what they leave out without
them: the extra to install and the way around it named, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.goodput.test_report import run_dir  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]


def _without_matplotlib(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where `import matplotlib` fails, as in the default install."""
    prelude = "import sys; sys.modules['matplotlib'] = None\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_goodput_timeline_without_matplotlib_names_the_extra(run_dir: Path) -> None:  # noqa: F811
    """The table is what the user asked for: it is printed (exit 0), and the missing PNG is a note naming
    the extra to install and the way to leave the plot out."""
    call = "from ntp_nemo.cli.goodput import main; sys.argv = ['ntp-goodput', sys.argv[1]]; main()"
    proc = _without_matplotlib(call.replace("sys.argv[1]", repr(str(run_dir))))
    assert proc.returncode == 0 and "goodput" in proc.stdout, proc.stderr
    assert "goodput_timeline.png not written" in proc.stderr
    assert "pip install 'ntp_nemo[plots]'" in proc.stderr and "--no-plot" in proc.stderr
    assert "Traceback" not in proc.stderr
    call = call.replace("sys.argv[1]]", f"{str(run_dir)!r}, '--no-plot']")
    proc = _without_matplotlib(call)
    assert proc.returncode == 0 and "goodput" in proc.stdout, proc.stderr
