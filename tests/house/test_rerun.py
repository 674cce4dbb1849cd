"""`--rerun-failed-once` (tests/rerun.py), run on a small suite of its own in a pytest process: a test that
fails once passes on its second attempt with the first failure printed; a test that fails twice fails
the run; a failed set-up is not rerun; without the option nothing is rerun."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

SUITE = '''
import os
import pytest

@pytest.fixture
def fresh():
    return []

@pytest.fixture
def broken():
    raise RuntimeError("set-up broke")

def _first(name):
    flag = os.path.join(os.environ["FLAGS"], name)
    if os.path.exists(flag):
        return False
    open(flag, "w").close()
    return True

def test_fails_once(fresh):
    fresh.append(1)
    assert fresh == [1]  # a fresh function-scoped fixture on the second attempt
    assert not _first("once"), "the first attempt fails"

def test_fails_twice():
    assert False, "every attempt fails"

def test_setup_fails(broken):
    pass
'''


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "flags").mkdir(exist_ok=True)
    for flag in (tmp_path / "flags").iterdir():
        flag.unlink()
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(
        "from tests.rerun import pytest_addoption, pytest_report_teststatus, pytest_runtest_protocol, "
        "pytest_terminal_summary  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLAGS": str(tmp_path / "flags")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-q", str(tmp_path / "test_suite.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_test_that_fails_once_passes_with_its_first_failure_listed(tmp_path):
    res = _run(tmp_path, "--rerun-failed-once")
    out = res.stdout
    assert res.returncode == 1, out  # the test that fails twice fails the run
    assert "1 failed, 1 passed, 1 error, 2 rerun" in out, out
    assert "RERUN test_suite.py::test_fails_once" in out and "the first attempt fails" in out
    assert "RERUN test_suite.py::test_fails_twice" in out
    assert "RERUN test_suite.py::test_setup_fails" not in out  # a set-up that broke is not rerun
    assert "FAILED test_suite.py::test_fails_twice" in out and "ERROR test_suite.py::test_setup_fails" in out
    res = _run(tmp_path, "--rerun-failed-once", "-k", "fails_once")
    assert res.returncode == 0 and "1 passed, 2 deselected, 1 rerun" in res.stdout, res.stdout


def test_without_the_option_nothing_is_rerun(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 1 and "2 failed, 1 error" in res.stdout and "rerun" not in res.stdout, res.stdout
