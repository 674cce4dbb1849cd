"""Training step time with `ntp-dashboard` serving the run and its page polled, against the run unwatched.

    python bench/dashboard.py [--rounds 3] [--steps 30] [--warmup 5] [--pages 4] [--idle 200]

Both sides are the real `ntp-train` CLI on one process (the default recipe's model, `bench/_common.py`'s
QUIET settings), started at once and taking turns step by step (`run_side_by_side`), so load from other
processes falls on both alike. The watched side's run directory is served by an `ntp-dashboard` process
started before it, and `--pages` clients each fetch the page's state (`api/state`) every second, as an
open page does, while `--idle` more connections stay open and silent. Figures: the median over steps
after the warm-up of each side's `step_time_s`, and the median of the per-step ratios (each watched step
against the unwatched step next to it in time). The goal: no measurable cost, a ratio within 1.00 +- 0.03.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import (  # noqa: E402
    QUIET,
    SINGLE,
    load_average,
    ntp_side,
    paired_ratio,
    pooled_median,
    run_side_by_side,
)

URL = re.compile(r"http://127\.0\.0\.1:(\d+)/([^/\s]+)/")


def start_dashboard(run_dir: Path, log: Path, timeout: float = 60.0) -> tuple[subprocess.Popen, int, str]:
    """`ntp-dashboard run_dir` in its own process; returns it with its port and token once it printed them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "ntp_nemo.cli.dashboard", str(run_dir),  # stops with us
                             "--parent", str(os.getpid())], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = URL.search(log.read_text())
        if m:
            return proc, int(m.group(1)), m.group(2)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"ntp-dashboard did not start:\n{log.read_text()[-2000:]}")


class Pages:
    """`n` clients fetching the state every `period` s, plus `idle` silent open connections."""

    def __init__(self, port: int, token: str, n: int, idle: int, period: float = 1.0) -> None:
        self.port, self.token, self.period = port, token, period
        self.stop = threading.Event()
        self.fetches = self.errors = 0
        self.lock = threading.Lock()
        self.idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(idle)]
        self.threads = [threading.Thread(target=self._poll, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _poll(self, i: int) -> None:
        time.sleep(self.period * i / max(1, len(self.threads)))  # spread over the second
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop.is_set():
            try:
                conn.request("GET", f"/{self.token}/api/state")
                ok = conn.getresponse().read() and True
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            with self.lock:
                self.fetches += ok
                self.errors += not ok
            self.stop.wait(self.period)
        conn.close()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)
        for s in self.idle:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="side-by-side runs")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the figures")
    ap.add_argument("--pages", type=int, default=4, help="clients polling the state every second")
    ap.add_argument("--idle", type=int, default=200, help="idle connections held open to the dashboard")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides applied to both sides")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the runs and the dashboard too
    overrides = [*SINGLE, *QUIET, f"trainer.max_steps={args.steps}", *args.overrides]
    print(f"dashboard: ntp-train {' '.join(overrides)}, served by ntp-dashboard and polled by {args.pages} "
          f"page(s) every second with {args.idle} idle connections  vs  unwatched; {args.rounds} rounds of "
          f"{args.steps} steps taken in turns; load average {load_average()}", flush=True)
    runs: dict[str, list[dict]] = {"unwatched": [], "watched": []}
    fetched = errors = 0
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            dash, port, token = start_dashboard(work / "watched", work / "dashboard.log")
            pages = Pages(port, token, args.pages, args.idle)
            try:
                sides = [ntp_side(name, overrides, work, 1, 1) for name in ("unwatched", "watched")]
                result = run_side_by_side(sides if r % 2 == 0 else sides[::-1], args.steps, work)
            finally:
                pages.close()
                os.killpg(dash.pid, signal.SIGTERM)
                dash.wait(timeout=30)
            fetched, errors = fetched + pages.fetches, errors + pages.errors
        for name, res in result.items():
            runs[name].append(res)
        ratio = paired_ratio([result["watched"]], [result["unwatched"]], "step_time_s", args.warmup)
        print(f"  round {r}: watched / unwatched step-time ratio {ratio:.3f} ({pages.fetches} state fetches, "
              f"{pages.errors} failed)", flush=True)
    print(f"\nresult ({args.rounds} x {args.steps - args.warmup} steps per side); load average now "
          f"{load_average()}; {fetched} state fetches, {errors} failed")
    print(f"{'':26s} {'unwatched':>10s} {'watched':>9s} {'ratio of medians':>17s} {'median ratio':>13s}")
    for key, label in (("step_time_s", "step time (step_time_s)"), ("cpu_s", "CPU time per step")):
        base, watched = (pooled_median(runs[n], key, args.warmup) for n in ("unwatched", "watched"))
        ratio = paired_ratio(runs["watched"], runs["unwatched"], key, args.warmup)
        print(f"{label:26s} {base * 1e3:8.1f}ms {watched * 1e3:7.1f}ms {watched / base:17.3f} {ratio:13.3f}")
    ratio = paired_ratio(runs["watched"], runs["unwatched"], "step_time_s", args.warmup)
    print(f"dashboard: watched / unwatched step-time ratio {ratio:.3f} "
          f"({'within' if abs(ratio - 1) <= 0.03 else 'outside'} the goal of 1.00 +- 0.03)")


if __name__ == "__main__":
    main()
