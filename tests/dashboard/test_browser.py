"""The dashboard in a real browser (headless Chromium through Selenium) during `recipe=failover_demo`,
shortened to the fewest steps that show a loss and a repair: the page shows the empty state before the
run starts, then the replica view goes full -> degraded -> repaired, and at the end its goodput is
`ntp-goodput`'s (within 0.1 points) and its loss chart holds every step.

Chromium and its driver come from the system (`apt-get install chromium chromium-driver`, as `.ci/run`
does), never a browser download.  Where they are missing or Chromium cannot start, the test is skipped
and says why.  Screenshots of each state are kept in `$NTP_TEST_ARTIFACTS/dashboard/` (default:
`test-artifacts/dashboard/` in the repository).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.dashboard.test_server import served
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("NTP_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "dashboard"
MAX_STEPS = 16
# failover_demo (2 replicas of TP 2, rank 1 killed, the survivors reshard live, a new process rejoins):
# the loss at step 4, the repair 3 steps later (the rejoin lands a few steps after that)
# dashboard.port=0: ntp-train also starts a dashboard of its own beside the run (any free port)
RUN = ["recipe=failover_demo", f"trainer.max_steps={MAX_STEPS}", "fault.step=4", "fault.repair_after_steps=3",
       "checkpoint.every_n_steps=8", "trainer.progress_bar=false", "logger=none", "callbacks=none",
       "dashboard.port=0"]
STUCK_S = 90.0  # no new step on the page for this long, once training started: the run is stuck
URL = re.compile(r"ntp-dashboard: (http://127\.0\.0\.1:\d+/[^/\s]+/)")
PAGE_STATE = """
const d = window.ntpDashboard; const s = d && d.state;
return s ? {polls: d.polls, status: s.status, layout: document.getElementById('layout').dataset.state,
            empty: !document.getElementById('empty').hidden,
            emptyText: document.getElementById('empty').textContent,
            goodput: document.getElementById('goodput-value').dataset.value,
            steps: d.charts['loss-chart'] ? Array.from(d.charts['loss-chart'].data[0]) : [],
            losses: d.charts['loss-chart'] ? Array.from(d.charts['loss-chart'].data[1]) : [],
            markers: d.markers || null,
            lossScale: d.charts['loss-chart'] ? [d.charts['loss-chart'].scales.y.min,
                                                 d.charts['loss-chart'].scales.y.max] : null} : null;
"""


def _browser():
    """A headless Chromium driven by Selenium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    binary = os.environ.get("NTP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("NTP_CHROMEDRIVER") or shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("Chromium or chromedriver not found: apt-get install -y chromium chromium-driver "
                    "(.ci/run does), or set NTP_CHROMIUM and NTP_CHROMEDRIVER")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1700", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    try:
        browser = webdriver.Chrome(service=Service(driver), options=opts)
    except WebDriverException as err:
        pytest.skip(f"Chromium ({binary}) could not be started: {str(err).splitlines()[0]}")
    browser.set_page_load_timeout(30)
    browser.set_script_timeout(10)
    return browser


def _page(browser, after_polls: int = 0, timeout: float = 30) -> dict:
    """The page's state once it has polled more than `after_polls` times."""
    def updated():
        state = browser.execute_script(PAGE_STATE)
        return state if state and state["polls"] > after_polls else None

    return wait_until(updated, timeout, "the page to update", poll_s=0.1)


@pytest.mark.slow
def test_page_follows_a_failover_in_chromium(tmp_path):
    browser = _browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):  # this run's screenshots only
        old.unlink()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = None
    try:
        with served(run_dir) as (port, token, _):
            browser.get(f"http://127.0.0.1:{port}/{token}/")
            empty = _page(browser)
            browser.save_screenshot(str(ARTIFACTS / "0_not_started.png"))
            assert empty["status"] == "not_started" and empty["empty"] and "not started" in empty["emptyText"]

            log = (tmp_path / "train.log").open("w")
            command = [sys.executable, "-m", "ntp_nemo.train", *RUN, f"hydra.run.dir={run_dir}"]
            proc = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
            seen: list[str] = []
            last_steps, moved_at = 0, time.monotonic()
            beside = None  # the dashboard ntp-train started: its state once it answered
            deadline = time.monotonic() + 240  # the run takes 40 to 80 s on 2 busy cores
            while proc.poll() is None and time.monotonic() < deadline:
                m = URL.search((tmp_path / "train.log").read_text())
                if m and beside is None:
                    with urllib.request.urlopen(m.group(1) + "api/state", timeout=10) as resp:
                        beside = json.loads(resp.read())
                state = browser.execute_script(PAGE_STATE)
                layout = state["layout"] if state else "starting"
                if layout != "starting" and (not seen or seen[-1] != layout):
                    seen.append(layout)
                    browser.save_screenshot(str(ARTIFACTS / f"{len(seen)}_{layout}.png"))
                steps = len(state["steps"]) if state else 0
                if steps != last_steps:
                    last_steps, moved_at = steps, time.monotonic()
                elif steps and time.monotonic() - moved_at > STUCK_S:  # a step takes seconds, a rejoin tens
                    browser.save_screenshot(str(ARTIFACTS / "stuck.png"))
                    pytest.fail(f"the run made no step for {STUCK_S:.0f} s after step {steps} (page states "
                                f"{seen}):\n{(tmp_path / 'train.log').read_text()[-3000:]}")
                time.sleep(0.2)
            assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, \
                (tmp_path / "train.log").read_text()[-3000:]
            # full -> degraded -> repaired (a later loss of the repaired process shows as another
            # degraded -> repaired: the sequence says so if it happens)
            assert seen[:3] == ["full", "degraded", "repaired"] and seen[-1] == "repaired", seen
            assert beside is not None and beside["kind"] == "run"
            assert beside["run_dir"] == str(run_dir.resolve())
            with pytest.raises(urllib.error.URLError):  # it stopped with the job
                urllib.request.urlopen(m.group(1) + "api/state", timeout=10)

            from ntp_nemo.goodput.report import analyse

            report, _ = analyse(run_dir, plot=False)  # what `ntp-goodput RUN_DIR` prints
            want = 100 * report.goodput
            polls, deadline = 0, time.monotonic() + 30
            while time.monotonic() < deadline:  # the page catches up with the files' last lines
                final = _page(browser, polls)
                polls = final["polls"]
                if final["status"] == "finished" and final["goodput"] and \
                        abs(float(final["goodput"]) - want) < 0.1 and len(final["steps"]) == MAX_STEPS:
                    break
            browser.save_screenshot(str(ARTIFACTS / "4_finished.png"))
            assert final["status"] == "finished"
            assert float(final["goodput"]) == pytest.approx(want, abs=0.1)
            metrics = read_metrics(run_dir)
            assert final["steps"] == list(range(1, MAX_STEPS + 1)) == [m["step"] for m in metrics]
            assert final["losses"] == pytest.approx([m["loss"] for m in metrics], rel=1e-12)
            # the failure and both layout changes are marked on the loss chart
            assert [f["step"] for f in final["markers"]["failures"]][:1] == [4], final["markers"]
            assert len(final["markers"]["relayouts"]) >= 2, final["markers"]
            low, high = final["lossScale"]  # the curve is drawn: its axis spans the losses
            assert low is not None and high is not None
            assert low <= min(final["losses"]) <= max(final["losses"]) <= high
    finally:
        browser.quit()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
