"""Reruns that count: a test whose call failed runs once more, in a second pytest session, and every such
rerun is written down where CI shows it and kept for the next run to compare.

    python -m tests.rerun [--max 3] [--report .ci/out/reruns.txt] [--state DIR] -- PYTEST ARGS ...

1. `pytest PYTEST ARGS`: this module is a plugin of the suite (`pytest_plugins` in `tests/conftest.py`);
   `--failures-file F` makes it write the session's failed test calls (node id and the first lines of
   the exception) and how many set-ups or teardowns failed to F, from the controlling process.
2. When only test calls failed, and at most `--max` of them: the same command once more with pytest's
   `--last-failed` (its cache kept in a directory of this run's own, so another pytest run in the same
   tree cannot change what is rerun). A failed set-up is never rerun: a fixture or a shared sweep would
   fail the same way, so the first session's status stands.
3. Every rerun (node id, its first failure, the rerun's outcome) is written to `--report` and printed; the
   node ids go to `--state`/reruns.json. Exit status: the rerun session's, except 1 when more than `--max`
   tests failed (nothing is rerun), or when a test needed a rerun that also needed one in the run before
   (read from `--state` before it is overwritten).

Where the record lives: CI runs on a fresh clone, so the record of the previous run cannot be in the
clone; `--state` defaults to `$NTP_CI_STATE`, else `~/.cache/ntp_nemo/ci`, outside the clone. On a CI
machine that keeps its home directory between runs the two-runs rule holds; on one that does not, every
run starts without a record (the report says so) and the `--max` rule is the only bound.

Why a second session and not a rerun inside the first: pytest's public hooks cannot run an item twice
(a rerun inside the session needs `_pytest.runner.runtestprotocol` and a private fixture reset), and
pytest-rerunfailures, which does so, broke its xdist connection on a test that forks and kills ranks.
The plugin here uses public hooks only (`pytest_addoption`, `pytest_configure`, `pytest_runtest_logreport`,
`pytest_sessionfinish`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MAX_RERUNS = 3
MESSAGE_LINES = 8


def pytest_addoption(parser):
    parser.addoption("--failures-file", default=None, metavar="PATH",
                     help="write the failed test calls of the session here as JSON (tests/rerun.py)")


class FailureRecorder:
    """Collects the session's failed reports (on the controlling process under xdist, which receives every
    worker's reports) and writes them to `path` at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[dict[str, str]] = []
        self.other = 0  # failed set-ups and teardowns

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed:
            return
        if report.when != "call":
            self.other += 1
            return
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)  # the exception
        text = crash if crash else str(report.longrepr) if report.longrepr is not None else ""
        lines = text.splitlines()
        if not crash:
            lines = [ln for ln in lines if ln.startswith("E ")][-MESSAGE_LINES:]
        lines = lines[:MESSAGE_LINES]
        self.calls.append({"nodeid": report.nodeid, "message": "\n".join(lines)})

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        doc = {"exitstatus": int(exitstatus), "calls": self.calls, "other": self.other}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.path)


def pytest_configure(config):
    path = config.getoption("failures_file")
    if path and not hasattr(config, "workerinput"):  # the controlling process (or a run without xdist)
        config.pluginmanager.register(FailureRecorder(Path(path)), "ntp-failure-recorder")


def verdict(first: dict, rerun: dict | None, rerun_status: int | None, previous: list[str] | None,
            max_reruns: int = MAX_RERUNS) -> tuple[int, list[str]]:
    """(exit status, report lines) of a run: `first` and `rerun` as the plugin writes them (`rerun` None when
    nothing was rerun), `previous` the node ids rerun by the run before (None: no record)."""
    calls = first["calls"]
    if not calls:
        return first["exitstatus"], []
    names = [c["nodeid"] for c in calls]
    lines = [f"{len(names)} test(s) failed in the first session:"]
    if first["other"]:
        lines.append(f"  not rerun: {first['other']} set-up or teardown error(s) in that session (a rerun "
                     "would fail the same way)")
    elif len(names) > max_reruns:
        lines.append(f"  not rerun: more than {max_reruns} failed (a rerun would hide a broken run)")
    failed_again = {c["nodeid"] for c in rerun["calls"]} if rerun is not None else set(names)
    for call in calls:
        outcome = ("not rerun" if rerun is None else
                   "failed again on the rerun" if call["nodeid"] in failed_again else "passed on the rerun")
        lines.append(f"RERUN {call['nodeid']}: {outcome}")
        lines.extend(f"    {line}" for line in call["message"].splitlines())
    if rerun is None:
        return first["exitstatus"] or 1, lines
    code = rerun_status if rerun_status is not None else 1
    if previous is None:
        lines.append("no record of the previous run's reruns (the state directory is new or not kept)")
    else:
        again = sorted(set(names) & set(previous))
        if again:
            lines.append(f"FAIL: rerun in two consecutive runs: {', '.join(again)}")
            code = code or 1
    return code, lines


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=MAX_RERUNS, help="most failed tests that are rerun")
    ap.add_argument("--report", type=Path, default=Path(".ci/out/reruns.txt"),
                    help="the reruns, for CI to show")
    ap.add_argument("--state", type=Path, default=Path(os.environ.get("NTP_CI_STATE") or
                                                       Path.home() / ".cache" / "ntp_nemo" / "ci"),
                    help="where the run's reruns are kept for the next run (outside the clone)")
    ap.add_argument("pytest_args", nargs="*", help="the pytest command line (after --)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ntp-reruns-"))
    base = [sys.executable, "-m", "pytest", *args.pytest_args, "-o", f"cache_dir={work / 'cache'}"]
    status = subprocess.run([*base, "--failures-file", str(work / "first.json")]).returncode
    first = _read(work / "first.json")
    if first is None:  # the session ended before its end hook (an internal error, an interrupt)
        return status
    rerun = rerun_status = None
    if first["calls"] and not first["other"] and len(first["calls"]) <= args.max:
        print(f"\nrerun of {len(first['calls'])} failed test(s) (tests/rerun.py)", flush=True)
        rerun_status = subprocess.run([*base, "--last-failed", "--last-failed-no-failures", "none",
                                       "--failures-file", str(work / "rerun.json")]).returncode
        rerun = _read(work / "rerun.json") or {"exitstatus": rerun_status, "calls": first["calls"],
                                               "other": 0}
    record = args.state / "reruns.json"
    previous = (_read(record) or {}).get("reruns") if record.is_file() else None
    code, lines = verdict(first, rerun, rerun_status, previous, args.max)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(lines or ["no test needed a rerun"]) + "\n")
    args.state.mkdir(parents=True, exist_ok=True)
    reran = [c["nodeid"] for c in first["calls"]] if rerun is not None else []
    record.write_text(json.dumps({"reruns": reran}))
    if lines:
        print("\n" + "\n".join(lines), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
