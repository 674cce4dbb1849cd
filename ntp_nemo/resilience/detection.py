"""Detecting a lost rank: the timeout hierarchy, the worker monitor and the failure classification.

Timeout hierarchy (`fault.*`), each level catching what the one below cannot:

1. `heartbeat_timeout_s` (supervisor): a training rank whose heartbeat has not advanced for this
   long stalls the job; the supervisor kills the workers and blames the rank(s) whose process is
   stopped, or else those furthest behind (`blame`).
2. `collective_timeout_s` (every collective, passed to NTPStrategy): a rank waiting this long in a
   collective raises, so that without a supervisor (torchrun/SLURM) a hang still turns into a crash.
   It exceeds the heartbeat timeout so that the supervisor, which knows who stopped first, acts first.
3. `step_timeout_s` (supervisor): no step completed for this long (start-up and checkpoint restore
   included) means a stall, whatever the heartbeats say; the last resort.

While the workers start, the supervisor also bounds the rendezvous (a worker with no heartbeat
`collective_timeout_s + heartbeat_timeout_s` after its start: the first one is written once it has joined;
the workers' own rendezvous gives up at `collective_timeout_s`) and the start-up
(`startup_timeout_s`: a worker not training this long after its start).  After a stop signal (SIGTERM,
Ctrl-C) the workers have `Timeouts.stop_grace_s` to checkpoint and exit before they are killed.

Whom a stall blames (`blame`): a worker whose process is stopped (SIGSTOP, a debugger: state `T`/`t` in
`/proc/<pid>/stat`) provably makes no progress, and its peers blocked on it in the same step report the
same progress as it does; when any training rank's process is stopped, those are blamed alone, else the
ranks furthest behind (`beats.suspects`).

A worker that exits while training is classified from the exit statuses: status 1 is a Python
exception (torch's convention); a signal or any other status is a lost rank (a fault-injected kill
exits 137).  Ranks the supervisor itself killed are not blamed.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_nemo.resilience.beats import Beat, read_beats, suspects
from ntp_nemo.resilience.fault_config import Timeouts

STOPPED_STATES = frozenset("Tt")  # /proc/<pid>/stat: stopped by a signal, stopped by a tracer


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (`R`, `S`, `D`, `T`, `t`, `Z`, ...; Linux /proc), None when it
    cannot be read (gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name in parentheses may hold anything
    return fields[0] if fields else None


def blame(beats: dict[int, Beat], world_size: int,
          state: Callable[[int], str | None] = process_state) -> tuple[int, ...]:
    """The ranks a stall is blamed on: the training ranks whose process is stopped (`state(pid)` in
    `STOPPED_STATES`) when some but not all are, else `suspects` (the ranks furthest behind).  Peers
    blocked on a stopped rank in the same step report the same progress as it does: progress alone
    cannot tell them apart, the state of the process can.  `state`: the process-state reader."""
    stopped = tuple(sorted(r for r, b in beats.items() if b.training and state(b.pid) in STOPPED_STATES))
    if stopped and len(stopped) < world_size:
        return stopped
    return suspects(beats, world_size)  # every rank stopped (the whole job was, e.g. Ctrl-Z): cannot tell


@dataclass(frozen=True)
class Verdict:
    """What the monitor saw: a stall (`heartbeat`, `step timeout`) or a worker exiting mid-training."""

    reason: str
    ranks: tuple[int, ...]
    step: int | None
    t: float
    detail: str = ""


@dataclass(frozen=True)
class LostRanks:
    """A recoverable failure: the ranks lost (empty when they cannot be told) and how it was detected."""

    ranks: tuple[int, ...]
    reason: str
    step: int | None
    detail: str


def is_lost_status(code: int | None) -> bool:
    """Exit statuses of a rank lost to the hardware or the OS, as opposed to a Python exception (1)."""
    if code is None or code in (0, 1):
        return False
    return code > 1 or -code not in (signal.SIGTERM, signal.SIGINT)


def classify(
    exit_codes: Sequence[int | None],
    killed: set[int],
    verdict: Verdict | None,
    error_text: str,
    behind: tuple[int, ...],
    step: int | None,
) -> LostRanks | None:
    """Turn an attempt's end into a recoverable failure, or None for an error to report (a bug, bad data)."""
    if verdict is not None and verdict.reason != "worker exit":
        return LostRanks(verdict.ranks, verdict.reason, verdict.step, verdict.detail)
    lost = tuple(r for r, c in enumerate(exit_codes) if r not in killed and is_lost_status(c))
    if lost:
        codes = ", ".join(f"rank {r}: {exit_codes[r]}" for r in lost)
        return LostRanks(lost, "exit status", step, codes)
    text = error_text.lower()
    if "timed out" in text or "timeout" in text:
        return LostRanks(behind, "collective timeout", step, error_text.strip().splitlines()[-1][:300])
    return None


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def kill_worker(pid: int) -> None:
    """SIGKILL a worker and everything it started (data-loader workers and their children).

    Workers stay in the job's process group, so that a signal sent to the whole job (a terminal's
    Ctrl-C, a scheduler) still reaches them; the supervisor therefore kills a worker's process tree
    rather than a process group, which would include itself."""
    stack, tree = [pid], []
    while stack:
        p = stack.pop()
        tree.append(p)
        stack += _children(p)
    for p in tree:  # the whole tree was collected first: a killed parent's children get re-parented
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class WorkerMonitor(threading.Thread):
    """Watches one attempt's workers from the launching process; kills them on a stall or a lost rank.

    Started before the launcher forks, it only sleeps until the worker processes exist (so the fork
    never copies a thread in the middle of anything)."""

    def __init__(
        self,
        procs: Callable[[], Sequence[Any]],
        heartbeat_dir: Path,
        world_size: int,
        timeouts: Timeouts,
        poll_s: float = 0.2,
        grace_s: float = 0.5,
        stop_requested: Callable[[], float | None] = lambda: None,
        state: Callable[[int], str | None] = process_state,
    ) -> None:
        """`stop_requested()`: when (time.time()) a stop signal reached the launcher, None if none has;
        `state`: the process-state reader a stall's blame consults (`blame`)."""
        super().__init__(name="ntp-worker-monitor", daemon=True)
        self._procs = procs
        self.heartbeat_dir = heartbeat_dir
        self.world_size = world_size
        self.timeouts = timeouts
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.verdict: Verdict | None = None
        self.killed: set[int] = set()
        self.last_beats: dict[int, Beat] = {}
        self.stop_requested = stop_requested
        self.state = state
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def _kill_all(self, procs: Sequence[Any]) -> None:
        for rank, p in enumerate(procs):
            if p.pid is not None and p.is_alive():
                kill_worker(p.pid)
                self.killed.add(rank)

    def run(self) -> None:
        procs: Sequence[Any] = ()
        while not self._halt.is_set():
            procs = self._procs() or ()
            if len(procs) == self.world_size:
                break
            time.sleep(self.poll_s)
        launched = time.time()
        while not self._halt.wait(self.poll_s):
            beats = read_beats(self.heartbeat_dir, self.world_size)
            self.last_beats = beats
            now = time.time()
            exited = [
                r
                for r, p in enumerate(procs)
                if p.sentinel in multiprocessing.connection.wait([p.sentinel], timeout=0)
            ]
            died = [r for r in exited if r not in beats or beats[r].phase != "end"]
            if died:
                step = max((b.step for b in beats.values()), default=None)
                self.verdict = Verdict(
                    "worker exit", tuple(died), step, now, f"rank(s) {died} exited mid-training"
                )
                self._halt.wait(self.grace_s)
                self._kill_all(procs)
                return
            verdict = (stop_overdue(self.stop_requested(), now, self.timeouts)
                       or start_verdict(beats, range(self.world_size), launched, now, self.timeouts)
                       or self._stall(beats, now, launched))
            if verdict is not None:
                self.verdict = verdict
                self._kill_all(procs)
                return

    def _stall(self, beats: dict[int, Beat], now: float, launched: float) -> Verdict | None:
        step = max((b.step for b in beats.values()), default=None)
        training = [b for b in beats.values() if b.training]
        if len(beats) == self.world_size and training:
            stale = [b for b in training if now - b.t > self.timeouts.heartbeat_s]
            if stale:
                behind = blame(beats, self.world_size, self.state)
                oldest = min(stale, key=lambda b: b.t)
                return Verdict(
                    "heartbeat",
                    behind,
                    step,
                    now,
                    f"rank {oldest.rank} silent for {now - oldest.t:.1f}s at step {oldest.step} "
                    f"({oldest.phase}); ranks behind: {list(behind) or 'none (all equal)'}",
                )
        return step_verdict(beats, self.world_size, launched, now, self.timeouts, self.state)


def step_verdict(beats: dict[int, Beat], world_size: int, launched: float, now: float,
                 timeouts: Timeouts, state: Callable[[int], str | None] = process_state) -> Verdict | None:
    """No step completed for `fault.step_timeout_s` (counted from the launch before the first one).  A
    rank's beat says `step_start` for the whole of a step, so the time of its last completed step is the
    one its beats carry (`done_t`), not only a `step_end` beat a poll may never see."""
    done = [b.t for b in beats.values() if b.phase in ("step_end", "end")]
    done += [b.done_t for b in beats.values() if b.done_t is not None]
    since = max(done, default=launched)
    if now - since <= timeouts.step_s:
        return None
    behind = blame(beats, world_size, state)
    step = max((b.step for b in beats.values()), default=None)
    return Verdict("step timeout", behind, step, now,
                   f"no step completed for {now - since:.1f}s (fault.step_timeout_s={timeouts.step_s:g}); "
                   f"ranks behind: {list(behind) or 'none'}")


def start_verdict(beats: dict[int, Beat], ranks: Sequence[int], launched: float, now: float,
                  timeouts: Timeouts) -> Verdict | None:
    """A worker of `ranks` still in its rendezvous `fault.collective_timeout_s` (plus a heartbeat
    timeout: the workers' own rendezvous gives up first) after the launch (no heartbeat yet: the first
    is written once it has joined), or not yet training `fault.startup_timeout_s` after it.  The ranks
    blamed are those behind (none when all are)."""
    waited = now - launched
    ranks = list(ranks)
    missing = [r for r in ranks if r not in beats]
    if missing and waited > timeouts.collective_s + timeouts.heartbeat_s:
        return Verdict("rendezvous timeout", tuple(missing) if len(missing) < len(ranks) else (), None, now,
                       f"rank(s) {missing} not past the rendezvous {waited:.1f}s after their start "
                       f"(fault.collective_timeout_s={timeouts.collective_s:g} + "
                       f"fault.heartbeat_timeout_s={timeouts.heartbeat_s:g})")
    starting = [r for r in ranks if r not in beats or beats[r].phase == "setup"]
    if starting and waited > timeouts.startup_s:
        return Verdict("startup timeout", tuple(starting) if len(starting) < len(ranks) else (), None, now,
                       f"rank(s) {starting} not training {waited:.1f}s after their start "
                       f"(fault.startup_timeout_s={timeouts.startup_s:g})")
    return None


def stop_overdue(requested: float | None, now: float, timeouts: Timeouts) -> Verdict | None:
    """The workers were asked to stop (SIGTERM, Ctrl-C) more than `Timeouts.stop_grace_s` ago."""
    if requested is None or now - requested <= timeouts.stop_grace_s:
        return None
    return Verdict("stop timeout", (), None, now,
                   f"the workers did not checkpoint and stop within {timeouts.stop_grace_s:g}s of the stop "
                   f"signal (2 x fault.heartbeat_timeout_s)")
