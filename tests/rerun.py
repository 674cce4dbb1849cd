"""`--rerun-failed-once`: a test whose call fails runs once more; the first failure is listed, not hidden.

Many tests bound their waits in wall-clock seconds (a heartbeat, a start-up, a collective) on processes
that share two cores with the other pytest-xdist worker; one of a thousand such bounds overrun once in a
run would otherwise end every run that meets it. With the option, the first attempt's reports are logged
with the outcome `rerun` (`R` in the progress line, a count in the last line) and the terminal summary
prints each first failure's exception (its first 8 lines) under "failed once, passed or failed again
on the rerun"; the second attempt's outcome is the test's. Only a failure of the test's call is rerun:
a failed set-up (a fixture, a shared sweep) would fail the same way again.

Hooks imported by `conftest.py`. No socket, no state outside the reports: it works the same in a plain
run and on xdist workers (their reports reach the controller with the outcome they carry)."""

from __future__ import annotations

from _pytest.runner import runtestprotocol

RERUN = "rerun"


def pytest_addoption(parser):
    parser.addoption("--rerun-failed-once", action="store_true", default=False,
                     help="run a test whose call failed once more; list the first failure (tests/rerun.py)")


def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("rerun_failed_once"):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.when == "call" and r.failed for r in reports):
        for report in reports:
            if report.when == "call":
                report.outcome = RERUN  # listed (R) with its message; the second attempt decides
            item.ihook.pytest_runtest_logreport(report=report)
        item._initrequest()  # fresh function-scoped fixtures for the second attempt
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_report_teststatus(report, config):
    if report.outcome == RERUN:
        return RERUN, "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    reruns = terminalreporter.stats.get(RERUN, [])
    if not reruns:
        return
    terminalreporter.section("failed once, passed or failed again on the rerun (tests/rerun.py)",
                             sep="=", yellow=True)
    for report in reruns:
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)  # the exception
        text = crash if crash else str(report.longrepr) if report.longrepr is not None else ""
        lines = text.splitlines()
        lines = lines[:8] if crash else [ln for ln in lines if ln.startswith("E ")][-8:]
        terminalreporter.write_line(f"RERUN {report.nodeid}")
        for line in lines:
            terminalreporter.write_line(f"    {line}")

