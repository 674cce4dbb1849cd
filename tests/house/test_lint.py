"""The house style is checked, not hoped for: `ruff check` (the rules of `[tool.ruff]` in pyproject.toml:
pycodestyle, pyflakes, import order, bugbear, pyupgrade; lines up to 110) passes on the whole checkout.
A module renamed without its importers re-sorted, or an unused import left behind, fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return [found]


def test_ruff_passes_on_the_checkout():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}{out.stderr}"
