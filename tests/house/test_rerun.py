"""Reruns that count (tests/rerun.py), on a small suite of its own in pytest processes: the plugin writes
down failed calls and broken set-ups; `python -m tests.rerun` reruns a test that failed once in a second
session and reports it; a test that fails twice fails the run; a failed set-up is not rerun; a test that
needed a rerun in the run before fails the run; more than `--max` failures are not rerun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.rerun import verdict

SUITE = '''
import os
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("set-up broke")

def _first(name):
    flag = os.path.join(os.environ["FLAGS"], name)
    if os.path.exists(flag):
        return False
    open(flag, "w").close()
    return True

def test_fails_once():
    assert not _first("once"), "the first attempt fails"

def test_fails_twice():
    assert False, "every attempt fails"

def test_setup_fails(broken):
    pass

def test_passes():
    pass
'''


def _env(tmp_path) -> dict:
    flags = tmp_path / "flags"
    flags.mkdir(exist_ok=True)
    for flag in flags.iterdir():
        flag.unlink()
    (tmp_path / "test_suite.py").write_text(SUITE)
    # No entry-point plugins: a pytest process then starts in a fraction of a second.
    return {**os.environ, "PYTHONPATH": str(ROOT), "FLAGS": str(flags), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _suite(tmp_path, *k: str) -> list[str]:
    return ["-p", "tests.rerun", "-q", str(tmp_path / "test_suite.py"), "-k", " or ".join(k)]


def _wrapped(tmp_path, *k: str) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """`python -m tests.rerun` on the tests named `k`: (process, report, node ids in the record)."""
    res = subprocess.run([sys.executable, "-m", "tests.rerun", "--report", str(tmp_path / "reruns.txt"),
                          "--state", str(tmp_path / "state"), "--", *_suite(tmp_path, *k)],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    record = json.loads((tmp_path / "state" / "reruns.json").read_text())["reruns"]
    return res, (tmp_path / "reruns.txt").read_text(), record


def test_the_plugin_writes_down_failed_calls_and_broken_set_ups(tmp_path):
    out = tmp_path / "failures.json"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          *_suite(tmp_path, "fails", "passes"), "--failures-file", str(out)],
                         cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout
    doc = json.loads(out.read_text())
    assert doc["exitstatus"] == 1 and doc["other"] == 1  # test_setup_fails' fixture
    assert [c["nodeid"] for c in doc["calls"]] == ["test_suite.py::test_fails_once",
                                                  "test_suite.py::test_fails_twice"]
    assert "the first attempt fails" in doc["calls"][0]["message"]


def test_a_rerun_is_reported_and_two_in_a_row_fail_the_run(tmp_path):
    res, report, record = _wrapped(tmp_path, "fails_once", "passes")
    assert res.returncode == 0, res.stdout + res.stderr  # it failed once: the rerun decides
    assert "RERUN test_suite.py::test_fails_once: passed on the rerun" in report
    assert "the first attempt fails" in report and "no record of the previous run" in report
    assert record == ["test_suite.py::test_fails_once"]
    assert "RERUN test_suite.py::test_fails_once" in res.stdout  # printed for CI as well
    # The next run: the same test needs a rerun again (the run fails, naming it), and a test that fails
    # twice fails the run.
    res, report, record = _wrapped(tmp_path, "fails_once", "fails_twice")
    assert res.returncode == 1, res.stdout
    assert "FAIL: rerun in two consecutive runs: test_suite.py::test_fails_once" in report
    assert "RERUN test_suite.py::test_fails_twice: failed again on the rerun" in report
    assert "RERUN test_suite.py::test_fails_once: passed on the rerun" in report


def test_a_failed_set_up_is_not_rerun(tmp_path):
    res, report, record = _wrapped(tmp_path, "fails_once", "setup_fails")
    assert res.returncode == 1 and record == []
    assert "not rerun: 1 set-up or teardown error(s)" in report
    assert "RERUN test_suite.py::test_fails_once: not rerun" in report
    assert "rerun of 1 failed test(s)" not in res.stdout


def test_more_failures_than_the_bound_are_not_rerun():
    calls = [{"nodeid": f"t.py::test_{i}", "message": "boom"} for i in range(4)]
    code, lines = verdict({"exitstatus": 1, "calls": calls, "other": 0}, None, None, None, max_reruns=3)
    assert code == 1 and "  not rerun: more than 3 failed (a rerun would hide a broken run)" in lines
    first = {"exitstatus": 1, "calls": calls[:1], "other": 0}
    assert verdict(first, {"exitstatus": 0, "calls": [], "other": 0}, 0, ["t.py::test_3"])[0] == 0
    assert verdict(first, {"exitstatus": 0, "calls": [], "other": 0}, 0, ["t.py::test_0"])[0] == 1
    assert verdict({"exitstatus": 0, "calls": [], "other": 0}, None, None, ["t.py::test_0"]) == (0, [])
