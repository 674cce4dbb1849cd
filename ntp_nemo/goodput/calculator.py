"""Goodput calculator: goodput.jsonl events -> time breakdown.

Two implementations of one set of rules, equal bit for bit (time is counted in integer ticks):
- `GoodputCalculator` (the one every figure comes from: `compute_goodput`, `ntp-goodput`, the running
  figures of the training callback, the dashboard) takes events one at a time with constant work per
  event, and gives the cumulative report, a rolling window and the badput per category over time at any
  moment (its docstring describes the API);
- the batch reference, two pure functions of the whole stream: `build_timeline` turns events (spanning
  any number of process lifetimes) into intervals, and `breakdown` assigns every instant of job time to
  exactly one category in one sweep (also what the timeline plot draws).
Either way productive time plus the badput categories add up to the total; `disagreement` replays a
stream and compares the two after its events.

Rules:
- A step is productive only in its last completed execution; earlier completed executions
  (undone by a restart from an older checkpoint) and executions cut short by a failure are
  wasted progress.
- Recovery downtime runs from a failure to the first step that completes after it, less the reshard.
  A live recovery's (or rejoin's) `recovery_done` with `recovery_s` marks its reshard: the
  `recovery_s` seconds before it are charged to `reshard`, even inside a step's execution (a rejoin
  runs at the start of a step).  A step
  recovered live (its `failure_detected` and `recovery_done` fall inside it, in the same process)
  is split: the part before the failure is wasted progress, the recovery is downtime, and the
  execution that counts starts at `recovery_done`.
  A lifetime that ran steps and then stopped without `job_end` (followed by a restart) or
  with status "failed", with no `failure_detected` recorded for it, counts as an implicit
  failure at its last event.
- A checkpoint save runs from `ckpt_save_start` to its `ckpt_save_end` (its blocking part) or
  `ckpt_save_abort`; a failure ends every save in progress (the save is lost with the peer), so a
  save whose end was never written (its writer died) counts up to the failure, not to the lifetime's
  end.  An asynchronous save's `ckpt_commit` happens in the background and costs no training time.
- Degraded throughput: a productive step of length d run at capacity c < 1 (its `step_end`'s
  `capacity`: active ranks / nominal ranks) made the progress the full layout makes in c*d, so c*d
  is productive and (1-c)*d is `degraded_throughput`: time the job spent training, but slower than
  its full capacity.  Goodput therefore counts capacity; `progress_goodput` is the share of time
  making progress at any speed (what definitions that ignore capacity report).
- When intervals overlap, the more specific measurement wins, in the order of `_PRIORITY`:
  a checkpoint save or restore, initialization, data wait or reshard inside another interval is
  charged to its own category, never to the step or the recovery around it.
- Gaps between a clean `job_end` and the next `job_start` (a finished run extended later)
  are idle, not job time.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import json
import operator
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ntp_nemo.goodput.events as ev
from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.recorder import goodput_path


@dataclass(frozen=True)
class Span:
    start: float
    end: float

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class StepRun:
    """One execution of one step; `completed` is False when a failure cut it short."""

    step: int
    start: float
    end: float
    layout: str
    capacity: float
    tokens: int | None
    completed: bool
    productive: bool = False


@dataclass(frozen=True)
class Failure:
    t: float
    rank: int | None
    reason: str
    implicit: bool = False
    process: int | None = None  # the process lost (its number in the launch), when it differs from the rank


@dataclass
class Timeline:
    """Intervals reconstructed from an event stream, in absolute Unix time."""

    start: float
    end: float
    lifetimes: list[Span] = field(default_factory=list)
    steps: list[StepRun] = field(default_factory=list)
    initializations: list[Span] = field(default_factory=list)
    saves: list[Span] = field(default_factory=list)
    restores: list[Span] = field(default_factory=list)
    waits: dict[str, list[Span]] = field(default_factory=dict)  # category -> waits recorded after them
    failures: list[Failure] = field(default_factory=list)
    recoveries: list[Span] = field(default_factory=list)
    reshards: list[Span] = field(default_factory=list)  # live recoveries' and rejoins' recovery_s
    idle: list[Span] = field(default_factory=list)
    recoveries_done: list[tuple[float, str]] = field(default_factory=list)
    recovery_modes: list[tuple[float, str]] = field(default_factory=list)  # live | restart, by time

    @property
    def data_waits(self) -> list[Span]:
        return self.waits.get(ev.DATA_LOADING, [])


@dataclass
class GoodputReport:
    """Where the job's time went. `badput_s` holds every category of `events.BADPUT_CATEGORIES`;
    `productive_s` plus those add up to `total_s`.  `capacity_fraction`: the time-weighted capacity
    of the productive steps' executions (productive / (productive + degraded throughput))."""

    total_s: float
    productive_s: float
    goodput: float
    badput_s: dict[str, float]
    capacity_fraction: float
    steps_completed: int
    steps_redone: int
    failures: int
    lifetimes: int = 1
    idle_s: float = 0.0
    productive_by_layout: dict[str, float] = field(default_factory=dict)
    # Per failure: how it was recovered (live | restart) and the time from it to the next completed step.
    failure_recoveries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def progress_goodput(self) -> float:
        """The share of job time making progress at any speed (productive plus degraded throughput):
        goodput as definitions that ignore capacity count it."""
        degraded = self.badput_s.get(ev.DEGRADED_THROUGHPUT, 0.0)
        return (self.productive_s + degraded) / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "progress_goodput": self.progress_goodput}


# Time is counted in integer ticks of 2**-30 s (about 1 ns): a timestamp times a power of two is exact,
# so every sum is exact and independent of its order (the incremental and the batch figures agree bit for
# bit however the time is split).
TICKS_PER_S = float(2**30)


def _ticks(t: float) -> int:
    return round(t * TICKS_PER_S)


# High to low: the first category whose interval covers an instant gets it.  A step's execution
# (productive or wasted) sits between the two groups.  A new badput category is a name in
# events.BADPUT_CATEGORIES, a place here, and the event that opens, closes or back-dates its interval
# (`_WAITS` for a wait recorded after it ended, like data_wait).
_IDLE = "idle"
_ABOVE_STEPS: tuple[str, ...] = (
    _IDLE,
    ev.CHECKPOINT_SAVE,
    ev.CHECKPOINT_RESTORE,
    ev.INITIALIZATION,
    ev.DATA_LOADING,
    ev.STRAGGLERS,
    ev.INTEGRITY,
    ev.RESHARD,
)
_BELOW_STEPS: tuple[str, ...] = (ev.RECOVERY_DOWNTIME,)
_PRIORITY: tuple[str, ...] = (*_ABOVE_STEPS, ev.PRODUCTIVE, ev.WASTED_PROGRESS, *_BELOW_STEPS)
_STEP_START, _STEP_END = ev.STEP_START, ev.STEP_END
# Events that charge the `seconds` before them (ending at `t`) to a category: recorded after the wait.
_WAITS: dict[str, str] = {ev.DATA_WAIT: ev.DATA_LOADING, ev.INTEGRITY_CHECK: ev.INTEGRITY,
                          ev.STRAGGLER_WAIT: ev.STRAGGLERS}
# Events after which an unfinished step can no longer be running.
_DISRUPTING = frozenset(
    {ev.FAILURE_DETECTED, ev.CKPT_RESTORE_START, ev.RECOVERY_DONE, ev.JOB_END, ev.INIT_DONE}
)


_FIX = "pass a run directory written by ntp-train (it holds goodput.jsonl) or the .jsonl file itself"
_CHUNK_BYTES = 1 << 22  # read and parse a file this much at a time


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a run directory's (or a file's) goodput events; bad input raises ConfigError naming the path.

    A last line without its newline is what a crash in mid-write leaves: it is skipped with a warning.
    """
    return [e for chunk in iter_event_chunks(path) for e in chunk]


def _parse_line(file: Path, lineno: int, line: str, last: bool) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        if last:  # no trailing newline: interrupted write
            warnings.warn(f"{file}:{lineno}: skipping a truncated last line", stacklevel=4)
            return None
        raise ConfigError("run_dir", f"{file}:{lineno} is not valid JSON ({err.msg}); {_FIX}.") from None
    _check(file, lineno, obj)
    return obj


def _check(file: Path, lineno: int, obj: Any) -> None:
    if not (type(obj) is dict and isinstance(obj.get("t"), int | float)
            and isinstance(obj.get("event"), str)):
        what = "is not a goodput event (needs numeric 't' and string 'event')"
        raise ConfigError("run_dir", f"{file}:{lineno} {what}; {_FIX}.")


def _all_events(objs: list[Any]) -> bool:
    """Every object a goodput event (a dict with numeric 't' and string 'event'), checked at C speed."""
    try:
        times = [o["t"] for o in objs]
        names = [o["event"] for o in objs]
    except (TypeError, KeyError, IndexError):
        return False
    return set(map(type, times)) <= {int, float} and set(map(type, names)) <= {str}


def iter_event_chunks(path: str | Path) -> Iterator[list[dict[str, Any]]]:
    """A file's events in file order, a few megabytes at a time (memory stays flat however long the run),
    with `load_events`'s checks and messages.  Each chunk's lines are parsed by one `json.loads`."""
    file = goodput_path(path)
    if not file.is_file():
        raise ConfigError("run_dir", f"goodput event file {file} does not exist; {_FIX}.")
    lineno, found = 0, False
    with file.open("r", encoding="utf-8", errors="replace", newline="\n") as fh:
        while True:
            lines = fh.readlines(_CHUNK_BYTES)
            if not lines:
                break
            first = lineno + 1
            lineno += len(lines)
            truncated = not lines[-1].endswith("\n")  # only the file's last line can lack its newline
            objs: list[Any] | None = None
            if not truncated:  # the recorder's lines: one parse for the chunk (a blank line fails it)
                try:
                    objs = json.loads("[" + ",".join(lines) + "]")
                except json.JSONDecodeError:
                    objs = None
                if objs is not None and (len(objs) != len(lines) or not _all_events(objs)):
                    objs = None
            if objs is None:  # line by line: skip blank lines, name a bad one (or skip a truncated last one)
                objs = []
                for i, line in enumerate(lines):
                    if line.strip():
                        obj = _parse_line(file, first + i, line, last=truncated and i == len(lines) - 1)
                        if obj is not None:
                            objs.append(obj)
            if objs:
                found = True
                yield objs
    if not found:
        raise ConfigError("run_dir", f"goodput event file {file} holds no events; {_FIX}.")


def _int(e: Mapping[str, Any], key: str) -> int:
    value = e.get(key)
    return value if type(value) is int else int(_num(e, key))


def _num(e: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = e.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"event {e.get('event')!r} at t={e.get('t')} needs a numeric {key!r}, got {value!r}")
    return float(value)


def _split_lifetimes(events: list[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    lifetimes: list[list[Mapping[str, Any]]] = []
    for e in events:
        if e["event"] == ev.JOB_START or not lifetimes:
            lifetimes.append([])
        lifetimes[-1].append(e)
    return lifetimes


class _LifetimeParser:
    """Turns one process lifetime's events into spans; open intervals end at the lifetime's last event."""

    def __init__(self, tl: Timeline, events: list[Mapping[str, Any]]) -> None:
        self.tl = tl
        self.events = events
        self.open_step: tuple[int, float] | None = None
        self.disrupted_at: float | None = None
        self.failed_in_step: float | None = None  # a failure detected while the open step ran (live recovery)
        self.resumed_at: float | None = None  # ... and the recovery that followed it, in the same process
        self.open_saves: list[tuple[Any, float]] = []
        self.open_restore: float | None = None
        self.init_start: float | None = events[0]["t"] if events[0]["event"] == ev.JOB_START else None
        self.layout, self.capacity = "unknown", 1.0
        self.status: str | None = None

    def _interrupt(self, t: float) -> None:
        if self.open_step is not None:
            step, start = self.open_step
            end = self.disrupted_at if self.disrupted_at is not None else t
            self.tl.steps.append(StepRun(step, start, end, self.layout, self.capacity, None, completed=False))
        self.open_step, self.disrupted_at = None, None
        self.failed_in_step, self.resumed_at = None, None

    def parse(self) -> str | None:
        prev_t = self.events[0]["t"]
        for e in self.events:
            name, t = e["event"], float(e["t"])
            if name in _DISRUPTING and self.open_step is not None and self.disrupted_at is None:
                self.disrupted_at = t
            handler = getattr(self, "_on_data_wait" if name in _WAITS else f"_on_{name}", None)
            if handler is not None:
                handler(e, t, prev_t)
            prev_t = t
        end = float(self.events[-1]["t"])
        self._interrupt(end)
        if self.init_start is not None:
            self.tl.initializations.append(Span(self.init_start, end))
        self.tl.saves.extend(Span(start, end) for _, start in self.open_saves)
        if self.open_restore is not None:
            self.tl.restores.append(Span(self.open_restore, end))
        return self.status

    def _on_init_done(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        if self.init_start is not None:
            self.tl.initializations.append(Span(self.init_start, t))
            self.init_start = None

    def _on_step_start(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self._interrupt(t)
        self.open_step = (int(_num(e, "step")), t)

    def _on_step_end(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        step = int(_num(e, "step"))
        if self.open_step is not None and self.open_step[0] == step:
            start = self.open_step[1]
            if self.failed_in_step is not None:  # recovered live inside the step: the part before the
                # failure is wasted, the recovery is downtime, the redone part is the step's execution
                self.tl.steps.append(StepRun(step, start, self.failed_in_step, self.layout, self.capacity,
                                             None, completed=False))
                start = self.resumed_at if self.resumed_at is not None else self.failed_in_step
            self.open_step, self.disrupted_at = None, None
            self.failed_in_step, self.resumed_at = None, None
        else:  # no matching step_start: the step ran since the previous event
            self._interrupt(prev_t)
            start = prev_t
        capacity = _num(e, "capacity", 1.0)
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"step_end of step {step} at t={t} has capacity {capacity}, outside (0, 1]")
        self.layout, self.capacity = str(e.get("layout", "single")), capacity
        tokens = e.get("tokens")
        tokens = int(tokens) if isinstance(tokens, int | float) else None
        self.tl.steps.append(StepRun(step, start, t, self.layout, capacity, tokens, completed=True))

    def _on_ckpt_save_start(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self.open_saves.append((e.get("step"), t))

    def _on_ckpt_save_end(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        same_step = (i for i, (step, _) in enumerate(self.open_saves) if step == e.get("step"))
        match = next(same_step, 0 if self.open_saves else None)
        blocking = e.get("blocking_s")
        if match is not None:
            start = self.open_saves.pop(match)[1]
            end = min(t, start + float(blocking)) if isinstance(blocking, int | float) else t
            self.tl.saves.append(Span(start, end))
        elif isinstance(blocking, int | float):
            self.tl.saves.append(Span(t - float(blocking), t))

    def _on_ckpt_save_abort(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        same_step = (i for i, (step, _) in enumerate(self.open_saves) if step == e.get("step"))
        match = next(same_step, 0 if self.open_saves else None)
        if match is not None:
            self.tl.saves.append(Span(self.open_saves.pop(match)[1], t))

    def _on_ckpt_restore_start(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self.open_restore = t

    def _on_ckpt_restore_end(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        start = self.open_restore if self.open_restore is not None else prev_t
        self.tl.restores.append(Span(start, t))
        self.open_restore = None

    def _on_data_wait(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self.tl.waits.setdefault(_WAITS[e["event"]], []).append(Span(t - _num(e, "seconds"), t))

    def _on_failure_detected(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        rank, process = e.get("rank"), e.get("process")
        self.tl.failures.append(Failure(t, rank if isinstance(rank, int) else None, str(e.get("reason", "")),
                                        process=process if isinstance(process, int) else None))
        self.tl.saves.extend(Span(start, t) for _, start in self.open_saves)  # lost with the failure
        self.open_saves = []
        if self.open_step is not None and self.failed_in_step is None:
            self.failed_in_step = t

    def _on_recovery_done(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self.tl.recoveries_done.append((t, str(e.get("layout", ""))))
        mode = str(e.get("mode", "restart"))
        self.tl.recovery_modes.append((t, mode))
        seconds = e.get("recovery_s")
        live = mode == "live" and isinstance(seconds, int | float) and not isinstance(seconds, bool)
        if live and seconds > 0:
            self.tl.reshards.append(Span(t - float(seconds), t))
        if self.failed_in_step is not None:
            self.resumed_at = t

    def _on_job_end(self, e: Mapping[str, Any], t: float, prev_t: float) -> None:
        self.status = str(e.get("status", ev.STATUS_OK))


def _first_step_end_after(steps: list[StepRun], t: float, default: float) -> float:
    return min((s.end for s in steps if s.completed and s.end > t), default=default)


def build_timeline(events: Iterable[Mapping[str, Any]]) -> Timeline:
    """Reconstruct steps, checkpoints, failures and recoveries from events of any number of lifetimes."""
    stream = sorted((e for e in events if e.get("event") in ev.EVENTS), key=lambda e: float(e["t"]))
    if not stream:
        raise ValueError("no goodput events to analyse")
    tl = Timeline(start=float(stream[0]["t"]), end=float(stream[-1]["t"]))
    lifetimes = _split_lifetimes(stream)
    statuses = []
    for life in lifetimes:
        tl.lifetimes.append(Span(float(life[0]["t"]), float(life[-1]["t"])))
        statuses.append(_LifetimeParser(tl, life).parse())
    tl.steps.sort(key=lambda s: s.start)

    for i, (span, status) in enumerate(zip(tl.lifetimes, statuses, strict=True)):
        last = i + 1 == len(tl.lifetimes)
        if status == ev.STATUS_OK:
            if not last:
                tl.idle.append(Span(span.end, tl.lifetimes[i + 1].start))
            continue
        if last and status is None:
            continue  # still running, or killed with nothing after it to tell
        ran_steps = any(span.start <= s.start <= span.end for s in tl.steps)
        resumed_at = tl.end if last else _first_step_end_after(tl.steps, tl.lifetimes[i + 1].start, tl.end)
        if ran_steps and not any(span.start <= f.t <= resumed_at for f in tl.failures):
            reason = "process ended without job_end" if status is None else f"job_end status {status}"
            tl.failures.append(Failure(span.end, None, reason, implicit=True))
    tl.failures.sort(key=lambda f: f.t)
    tl.recoveries = [Span(f.t, _first_step_end_after(tl.steps, f.t, tl.end)) for f in tl.failures]

    last_completion: dict[int, StepRun] = {}
    for run in tl.steps:
        if run.completed and (run.step not in last_completion or run.end >= last_completion[run.step].end):
            last_completion[run.step] = run
    for run in last_completion.values():
        run.productive = True
    return tl


def _intervals(tl: Timeline) -> list[tuple[float, float, str, StepRun | None]]:
    out: list[tuple[float, float, str, StepRun | None]] = []
    for category, spans in (
        (_IDLE, tl.idle),
        (ev.CHECKPOINT_SAVE, tl.saves),
        (ev.CHECKPOINT_RESTORE, tl.restores),
        (ev.INITIALIZATION, tl.initializations),
        *tl.waits.items(),
        (ev.RESHARD, tl.reshards),
        (ev.RECOVERY_DOWNTIME, tl.recoveries),
    ):
        out.extend((s.start, s.end, category, None) for s in spans)
    for run in tl.steps:
        out.append((run.start, run.end, ev.PRODUCTIVE if run.productive else ev.WASTED_PROGRESS, run))
    # Clip to the stream's extent (a data wait may reach back before the first event).
    clipped = [(max(a, tl.start), min(b, tl.end), c, r) for a, b, c, r in out]
    return [(a, b, c, r) for a, b, c, r in clipped if b > a]


def compute_goodput(events: Iterable[Mapping[str, Any]]) -> GoodputReport:
    """Assign every instant of job time to productive or one badput category (they sum to total_s): the
    incremental `GoodputCalculator` over the events in time order (bit-equal to the batch
    `breakdown(build_timeline(events))`)."""
    return replay(events).report()


def breakdown(tl: Timeline) -> GoodputReport:
    """The report for an already built timeline: the batch sweep over every interval at once, the reference
    the incremental `GoodputCalculator` agrees with exactly (both count time in integer ticks)."""
    intervals = _intervals(tl)
    rank = {c: i for i, c in enumerate(_PRIORITY)}
    points: list[tuple[int, int, int]] = []
    for idx, (a, b, _, _) in enumerate(intervals):
        points += [(_ticks(a), 1, idx), (_ticks(b), -1, idx)]
    points.sort()

    ticks = dict.fromkeys((*_PRIORITY, ev.OTHER), 0)
    productive: dict[tuple[str, float], int] = {}
    active: list[dict[int, StepRun | None]] = [{} for _ in _PRIORITY]
    start, end = _ticks(tl.start), _ticks(tl.end)
    prev = start
    for t, kind, idx in points:
        if t > prev:
            winner = next((i for i, group in enumerate(active) if group), None)
            length = t - prev
            if winner is None:
                ticks[ev.OTHER] += length
            elif _PRIORITY[winner] == ev.PRODUCTIVE:  # progress at the step's capacity; the rest degraded
                run = next(iter(active[winner].values()))
                assert run is not None
                key = (run.layout, run.capacity)
                productive[key] = productive.get(key, 0) + length
            else:
                ticks[_PRIORITY[winner]] += length
            prev = t
        _, _, category, run = intervals[idx]
        group = active[rank[category]]
        if kind > 0:
            group[idx] = run
        else:
            group.pop(idx, None)
    ticks[ev.OTHER] += max(0, end - prev)

    completed = [s for s in tl.steps if s.completed]
    unique = {s.step for s in completed}
    modes = sorted(tl.recovery_modes)
    mode_times = [t for t, _ in modes]
    return _report(
        start=start, end=end, ticks=ticks, productive=productive, steps_completed=len(unique),
        steps_redone=len(completed) - len(unique), lifetimes=len(tl.lifetimes),
        failure_recoveries=[
            {"mode": modes[i][1] if (i := bisect.bisect_left(mode_times, f.t)) < len(modes) else "-",
             "recovery_s": span.end - span.start, "rank": f.rank, "process": f.process,
             "reason": f.reason, "t": f.t}
            for f, span in zip(tl.failures, tl.recoveries, strict=True)
        ],
    )


def _report(*, start: int, end: int, ticks: Mapping[str, int], productive: Mapping[tuple[str, float], int],
            steps_completed: int, steps_redone: int, lifetimes: int,
            failure_recoveries: list[dict[str, Any]]) -> GoodputReport:
    """The report from integer tick tallies: `ticks` per category of `_PRIORITY` (less the steps) and
    other, `productive` per (layout, capacity) of the productive executions.  One function for the batch
    and the incremental calculator, so equal tallies give bit-equal reports."""
    prod = degraded = 0.0
    by_layout: dict[str, float] = {}
    for (layout, capacity), n in sorted(productive.items()):
        if not n:
            continue  # a step redone: its first execution's layout made no progress after all
        seconds = n / TICKS_PER_S
        prod += capacity * seconds
        degraded += (1.0 - capacity) * seconds
        by_layout[layout] = by_layout.get(layout, 0.0) + capacity * seconds
    seconds = {c: ticks.get(c, 0) / TICKS_PER_S for c in ev.BADPUT_CATEGORIES}
    seconds[ev.WASTED_PROGRESS] = ticks.get(ev.WASTED_PROGRESS, 0) / TICKS_PER_S
    seconds[ev.DEGRADED_THROUGHPUT] = degraded
    idle = ticks.get(_IDLE, 0)
    total = (end - start - idle) / TICKS_PER_S
    stepping = prod + degraded  # the productive executions' full length
    return GoodputReport(
        total_s=total,
        productive_s=prod,
        goodput=prod / total if total > 0 else 0.0,
        badput_s=seconds,
        capacity_fraction=prod / stepping if stepping > 0 else 0.0,
        steps_completed=steps_completed,
        steps_redone=steps_redone,
        failures=len(failure_recoveries),
        lifetimes=lifetimes,
        idle_s=idle / TICKS_PER_S,
        productive_by_layout=by_layout,
        failure_recoveries=failure_recoveries,
    )


# -- the incremental calculator -----------------------------------------------------------------------

_N_ABOVE = len(_ABOVE_STEPS)
_COVERS: tuple[str, ...] = (*_ABOVE_STEPS, *_BELOW_STEPS)  # the interval categories other than steps
_CI = {c: i for i, c in enumerate(_COVERS)}
_OTHER_I = len(_COVERS)  # nothing covers the instant
_RUN_I = -1  # a step's execution covers it (productive or wasted: the run says which)
_PROD_SLOT, _DEGRADED_SLOT, _WASTED_SLOT = _OTHER_I + 1, _OTHER_I + 2, _OTHER_I + 3  # in a series bucket
_OPEN, _PRODUCTIVE, _WASTED = 0, 1, 2  # a run's state
_EMPTY: tuple[int, ...] = (0,) * len(_COVERS)
_TRIM_EVERY = 1024  # segments appended between two trims of the history


def _winner(cover: tuple[int, ...], run: _Run | None) -> int:
    for i in range(_N_ABOVE):
        if cover[i]:
            return i
    if run is not None:
        return _RUN_I
    for i in range(_N_ABOVE, _OTHER_I):
        if cover[i]:
            return i
    return _OTHER_I


def _bump(cover: tuple[int, ...], i: int, d: int) -> tuple[int, ...]:
    c = list(cover)
    c[i] += d
    return tuple(c) if any(c) else _EMPTY


class _Run:
    """One execution (or part of one) of a step; `ticks` is the time it wins, `key` its (layout, capacity)
    once completed."""

    __slots__ = ("bucket", "key", "state", "step", "ticks")

    def __init__(self, step: int, bucket: int) -> None:
        self.step, self.bucket, self.ticks, self.state = step, bucket, 0, _OPEN
        self.key: tuple[str, float] = ("", 1.0)


class _Fail:
    """A failure and its recovery (failure -> first completed step end after it)."""

    __slots__ = ("cancelled", "closed_at", "end_t", "failure", "mode", "mode_t", "resolve_t", "start")

    def __init__(self, failure: Failure, start: int) -> None:
        self.failure, self.start = failure, start
        self.end_t: float | None = None  # the step end that closed the recovery
        self.closed_at: int | None = None
        self.mode: str | None = None
        self.mode_t: float | None = None
        self.cancelled = False
        self.resolve_t: float | None = None


class _Life:
    """The open state of one process lifetime."""

    __slots__ = ("failed", "init", "ran_steps", "restore", "saves", "start_t", "status")

    def __init__(self, start_t: float, init: bool) -> None:
        self.start_t = start_t
        self.init = init
        self.saves: list[tuple[Any, float, int]] = []  # (step, t, ticks) of each open save
        self.restore: int | None = None
        self.status: str | None = None
        self.ran_steps = False
        self.failed = False


@dataclass(frozen=True)
class WindowFigures:
    """Goodput over the last `window_s` of job time (the series buckets it spans; see GoodputCalculator)."""

    window_s: float
    total_s: float
    productive_s: float
    goodput: float
    badput_s: dict[str, float]


class GoodputCalculator:
    """Goodput of an event stream, fed one event at a time: the same figures as the batch
    `breakdown(build_timeline(events))`, bit for bit, with constant work per event.

    Public API (the training callback, `ntp-goodput` and the live dashboard all read this one class):

    - `feed(event)`: take one event (a dict as the recorder writes it); events must come in time order
      (`compute_goodput` and `replay` sort a file's events first).  An event stamped before the last one
      fed (another thread's, by microseconds) is counted at the last one's time and counted in
      `late_events`.  `feed_all(events)` feeds many.
    - `report()`: the cumulative `GoodputReport` of every event fed so far, exactly what the batch
      calculator gives for the same prefix (the last lifetime still running: an unfinished step is wasted,
      open recoveries and saves end at the last event).  Its cost does not grow with the stream.
    - `window()`: `WindowFigures` over the last `window_s` seconds of job time (the rolling figure).
    - `series()`: badput per category over time, one dict per bucket of `bucket_s` seconds (the last
      `series_buckets` buckets): `start`/`end` (Unix time), `productive_s`, `total_s` and `badput_s`.
      Each second is placed in the bucket where it was spent (a step's execution in the bucket it started
      in), with what is known now: a step redone later moves its first execution's bucket from
      productive to wasted.

    How it works: the job's time is a sequence of segments between consecutive events, each with the
    intervals covering it (a count per category of `_COVERS`) and the step execution covering it; each
    segment's ticks are credited to the highest-priority category covering it, as in the batch sweep.
    What an event decides about the past (a wait recorded after it, a live recovery's reshard, a save's
    blocking part, a step interrupted after a disruption, an implicit failure found false) is applied to
    the segments it reaches back over, which the calculator keeps for `history_s` seconds (and as long as
    an interval that started before is still open).  A run redone later is moved from productive to
    wasted by its own tally, however old: the calculator keeps one small object per completed step (about
    150 bytes), the only memory that grows with the job.  Reaching back further than the history
    (`clipped_s`) is the only way the figures can differ from the batch ones.
    """

    __slots__ = ("_L", "_appended", "_awaiting_mode", "_bticks", "_buckets", "_candidates",
                 "_completed_runs", "_cover", "_disrupted", "_done", "_failed_in_step", "_fails", "_hist",
                 "_hist_ticks", "_keep_buckets", "_last_bucket", "_last_mode", "_last_t", "_life",
                 "_lifetimes", "_open_recoveries", "_prod", "_run", "_run_from", "_runs", "_start",
                 "_start_t", "_step", "_step_from", "_tally", "_wasted", "bucket_s", "clipped_s",
                 "events_fed", "late_events", "window_s")

    def __init__(self, window_s: float = 3600.0, bucket_s: float | None = None, series_buckets: int = 240,
                 history_s: float = 3600.0) -> None:
        if window_s <= 0 or (bucket_s is not None and bucket_s <= 0) or history_s <= 0 or series_buckets < 1:
            raise ValueError("window_s, bucket_s, history_s and series_buckets must be positive")
        self.window_s = float(window_s)
        self.bucket_s = float(bucket_s) if bucket_s is not None else self.window_s / 60.0
        self._bticks = max(1, _ticks(self.bucket_s))
        self._keep_buckets = max(series_buckets, int(self.window_s / self.bucket_s) + 2)
        self._hist_ticks = _ticks(history_s)
        self.events_fed = 0
        self.late_events = 0
        self.clipped_s = 0.0
        self._start: int | None = None  # ticks of the first event
        self._start_t = 0.0
        self._L = 0  # ticks of the last event: the time accounted so far
        self._last_t = 0.0
        self._hist: deque[list[Any]] = deque()  # [a, b, cover, run] segments, in time order
        self._appended = 0
        self._cover: tuple[int, ...] = _EMPTY  # what covers the time from the last event on
        self._tally = [0] * (_OTHER_I + 1)  # ticks per _COVERS category, then other
        self._prod: dict[tuple[str, float], int] = {}
        self._wasted = 0
        self._buckets: dict[int, list[float]] = {}
        self._last_bucket: tuple[int, list[float] | None] = (-1, None)  # the bucket used last (a cache)
        self._done: dict[int, _Run] = {}  # step -> its last completed execution (a redo makes it wasted)
        self._completed_runs = 0
        self._life: _Life | None = None
        self._lifetimes = 0
        # the open step: its number, runs (the part before a failure, the part after), the run covering
        # new time, the first disrupting event and the failure inside it (a live recovery)
        self._step: int | None = None
        self._runs: list[_Run] = []
        self._run: _Run | None = None
        self._run_from = 0  # ticks from which self._run covers
        self._step_from = 0  # ticks the open step started at
        self._disrupted: int | None = None
        self._failed_in_step: int | None = None
        self._fails: list[_Fail] = []
        self._open_recoveries: list[_Fail] = []
        self._awaiting_mode: list[_Fail] = []
        self._candidates: list[_Fail] = []  # implicit failures that a failure in their window cancels
        self._last_mode: tuple[float, str] | None = None  # the last recovery_done's time and mode

    # -- feeding ------------------------------------------------------------------------------------
    def feed_all(self, events: Iterable[Mapping[str, Any]]) -> GoodputCalculator:
        for e in events:
            self.feed(e)
        return self

    def feed(self, e: Mapping[str, Any]) -> None:
        name = e.get("event")
        if name == _STEP_END and self._cover is _EMPTY and self._failed_in_step is None:
            step = e.get("step")
            run = self._run
            if (step == self._step and type(step) is int and run is not None and not self._candidates
                    and not self._open_recoveries):  # the common case: the open step completes
                t = float(e["t"])
                if t >= self._last_t:
                    self.events_fed += 1
                    T = round(t * TICKS_PER_S)
                    L = self._L
                    if T > L:
                        hist = self._hist
                        last = hist[-1] if hist else None
                        if last is not None and last[3] is run and last[2] is _EMPTY and last[1] == L:
                            last[1] = T
                            run.ticks += T - L
                        elif self._appended < _TRIM_EVERY - 1:
                            hist.append([L, T, _EMPTY, run, L // self._bticks])
                            self._appended += 1
                            run.ticks += T - L
                        else:
                            self._advance(T)  # appends, credits the run and trims the history
                    self._L, self._last_t = T, t
                    self._complete(e, step, t)
                    return
        elif name == _STEP_START and self._step is None and not self._candidates and self._start is not None:
            t = float(e["t"])
            step = e.get("step")
            if t >= self._last_t and type(step) is int:  # the common case: a step starts
                self.events_fed += 1
                T = round(t * TICKS_PER_S)
                L = self._L
                if T > L:
                    if self._cover is _EMPTY and self._appended < _TRIM_EVERY - 1:  # other time
                        idx = L // self._bticks
                        self._hist.append([L, T, _EMPTY, None, idx])
                        self._appended += 1
                        self._tally[_OTHER_I] += T - L
                        bucket = self._last_bucket[1] if idx == self._last_bucket[0] else self._bucket(idx)
                        if bucket is not None:
                            bucket[_OTHER_I] += T - L
                        self._L = T
                    else:
                        self._advance(T)
                self._last_t = t
                run = _Run(step, T // self._bticks)
                self._step, self._runs, self._run, self._run_from, self._step_from = step, [run], run, T, T
                self._life.ran_steps = True  # type: ignore[union-attr]
                return
        if name not in ev.EVENTS:
            return
        t = float(e["t"])
        self.events_fed += 1
        if self._start is None:
            T = round(t * TICKS_PER_S)
            self._start, self._start_t, self._L, self._last_t = T, t, T, t
            self._new_life(t, T, init=name == ev.JOB_START)
            prev = T
        else:
            if t < self._last_t:
                t = self._last_t
                self.late_events += 1
            T = round(t * TICKS_PER_S)
            prev = self._L
            if name == ev.JOB_START:
                idle = self._end_life()
                if idle:
                    self._cover_now(_IDLE, 1)
                self._advance(T)
                if idle:
                    self._cover_now(_IDLE, -1)
                self._new_life(t, T, init=True)
                self._last_t = t
                self._resolve(t)
                return
        if name == _STEP_START:
            if self._step is None and not self._candidates:  # the common case, without the calls
                self._advance(T)
                self._last_t = t
                self._open_step(_int(e, "step"), T)
                return
        elif name == _STEP_END:
            step = _int(e, "step")
            if self._step != step:  # no matching step_start: the step ran since the previous event
                self._interrupt()
                self._open_step(step, prev)
            elif self._failed_in_step is None and not self._candidates and not self._open_recoveries:
                self._advance(T)  # the common case: the open step completes
                self._last_t = t
                self._complete(e, step, t)
                return
        self._advance(T)
        self._last_t = t
        if self._candidates:
            self._resolve(t)
        if self._step is not None and self._disrupted is None and name in _DISRUPTING:
            self._disrupted = T
        handler = _HANDLERS.get(name)
        if handler is not None:
            handler(self, e, t, T, prev)

    # -- segments and tallies -------------------------------------------------------------------------
    def _advance(self, T: int) -> None:
        """Account the time from the last event to T with what covers it now."""
        L = self._L
        if T <= L:
            return
        run = self._run
        cover = self._cover
        hist = self._hist
        last = hist[-1] if hist else None
        if last is not None and last[2] is cover and last[3] is run and last[1] == L:
            last[1] = T
            self._credit(last[4], cover, run, T - L)
        else:
            idx = L // self._bticks
            hist.append([L, T, cover, run, idx])
            if cover is _EMPTY and run is not None and run.state == _OPEN:
                run.ticks += T - L  # the common case: a step running, nothing else
            else:
                self._credit(idx, cover, run, T - L)
            self._appended += 1
            if self._appended >= _TRIM_EVERY:
                self._trim()
        self._L = T

    def _credit(self, idx: int, cover: tuple[int, ...], run: _Run | None, n: int) -> None:
        """Add n ticks (n < 0: remove) to what wins under `cover` and `run`; `idx`: the segment's bucket."""
        w = _winner(cover, run) if cover is not _EMPTY else (_OTHER_I if run is None else _RUN_I)
        if w == _RUN_I:
            assert run is not None
            run.ticks += n
            if run.state == _OPEN:
                return
            bucket = self._bucket(run.bucket)
            if run.state == _PRODUCTIVE:
                self._prod[run.key] += n
                if bucket is not None:
                    bucket[_PROD_SLOT] += run.key[1] * n
                    bucket[_DEGRADED_SLOT] += (1.0 - run.key[1]) * n
            else:
                self._wasted += n
                if bucket is not None:
                    bucket[_WASTED_SLOT] += n
        else:
            self._tally[w] += n
            bucket = self._bucket(idx)
            if bucket is not None:
                bucket[w] += n

    def _bucket(self, idx: int) -> list[float] | None:
        if idx == self._last_bucket[0]:
            return self._last_bucket[1]
        bucket = self._buckets.get(idx)
        if bucket is not None:
            self._last_bucket = (idx, bucket)
        else:
            if idx <= self._L // self._bticks - self._keep_buckets:
                return None  # older than the series keeps
            bucket = self._buckets[idx] = [0.0] * (_WASTED_SLOT + 1)
            if len(self._buckets) > self._keep_buckets:
                for old in sorted(self._buckets)[: len(self._buckets) - self._keep_buckets]:
                    del self._buckets[old]
            self._last_bucket = (idx, bucket)
        return bucket

    def _set_state(self, run: _Run, state: int) -> None:
        """Move a run's ticks from its state's tally to another's."""
        if run.state == state:
            return
        n = run.ticks
        bucket = self._bucket(run.bucket)
        cap = run.key[1]
        if run.state == _PRODUCTIVE:
            self._prod[run.key] -= n
            if bucket is not None:
                bucket[_PROD_SLOT] -= cap * n
                bucket[_DEGRADED_SLOT] -= (1.0 - cap) * n
        elif run.state == _WASTED:
            self._wasted -= n
            if bucket is not None:
                bucket[_WASTED_SLOT] -= n
        run.state = state
        if state == _PRODUCTIVE:
            self._prod[run.key] = self._prod.get(run.key, 0) + n
            if bucket is not None:
                bucket[_PROD_SLOT] += cap * n
                bucket[_DEGRADED_SLOT] += (1.0 - cap) * n
        elif state == _WASTED:
            self._wasted += n
            if bucket is not None:
                bucket[_WASTED_SLOT] += n

    def _retro(self, x: int, y: int | None, change: Callable[[tuple[int, ...], _Run | None],
                                                          tuple[tuple[int, ...], _Run | None]]) -> None:
        """Apply `change` to what covers [x, y) (y None: up to the last event), time already accounted."""
        hist = self._hist
        y = self._L if y is None else y
        assert self._start is not None
        x = max(x, self._start)  # the batch clips every interval to the stream's extent
        if hist and x < hist[0][0]:
            self.clipped_s += (min(y, hist[0][0]) - x) / TICKS_PER_S
            x = hist[0][0]
        if y <= x:
            return
        tail: list[list[Any]] = []
        while hist and hist[-1][1] > x:
            tail.append(hist.pop())
        tail.reverse()
        if tail and tail[0][0] < x:  # split at x; both parts keep the bucket they were credited to
            seg = tail[0]
            hist.append([seg[0], x, seg[2], seg[3], seg[4]])
            seg[0] = x
        for seg in tail:
            if seg[0] < y:
                if seg[1] > y:  # split at y
                    head = [seg[0], y, seg[2], seg[3], seg[4]]
                    seg[0] = y
                    self._change(head, change)
                    hist.append(head)
                else:
                    self._change(seg, change)
            hist.append(seg)

    def _change(self, seg: list[Any], change: Callable[[tuple[int, ...], _Run | None],
                                                       tuple[tuple[int, ...], _Run | None]]) -> None:
        a, b, cover, run, idx = seg
        new_cover, new_run = change(cover, run)
        if new_cover != cover or new_run is not run:
            self._credit(idx, cover, run, a - b)
            self._credit(idx, new_cover, new_run, b - a)
            seg[2], seg[3] = new_cover, new_run

    def _retro_cover(self, category: str, x: int, d: int, y: int | None = None) -> None:
        i = _CI[category]
        self._retro(x, y, lambda cover, run: (_bump(cover, i, d), run))

    def _retro_uncover_runs(self, x: int, runs: list[_Run]) -> None:
        ids = {id(r) for r in runs}
        self._retro(x, None, lambda cover, run: (cover, None if run is not None and id(run) in ids else run))

    def _cover_now(self, category: str, d: int) -> None:
        self._cover = _bump(self._cover, _CI[category], d)

    def _trim(self) -> None:
        """Forget segments no event can reach back to any more."""
        self._appended = 0
        life = self._life
        limit = self._L - self._hist_ticks
        opens = [f.start for f in self._open_recoveries] + [f.start for f in self._candidates]
        if self._step is not None:
            opens.append(self._step_from)
        if life is not None:
            opens += [s[2] for s in life.saves] + ([life.restore] if life.restore is not None else [])
        limit = min([limit, *opens])
        hist = self._hist
        while len(hist) > 1 and hist[0][1] <= limit:
            hist.popleft()  # a run in it keeps its own tally (a later redo moves it to wasted)

    # -- lifetimes and steps -----------------------------------------------------------------------------
    def _new_life(self, t: float, T: int, init: bool) -> None:
        self._life = _Life(t, init)
        self._lifetimes += 1
        if init:
            self._cover_now(ev.INITIALIZATION, 1)

    def _end_life(self) -> bool:
        """A job_start ends the previous lifetime at its last event; decides idle or an implicit failure."""
        life = self._life
        assert life is not None
        self._interrupt()
        if life.init:
            self._cover_now(ev.INITIALIZATION, -1)
        if life.saves:
            self._cover_now(ev.CHECKPOINT_SAVE, -len(life.saves))
        if life.restore is not None:
            self._cover_now(ev.CHECKPOINT_RESTORE, -1)
        if life.status == ev.STATUS_OK:
            return True  # idle until the next job_start: not job time
        if life.ran_steps and not life.failed:
            reason = ("process ended without job_end" if life.status is None
                      else f"job_end status {life.status}")
            rec = self._failure(Failure(self._last_t, None, reason, implicit=True), self._L)
            self._candidates.append(rec)
        return False

    def _open_step(self, step: int, T: int) -> None:
        run = _Run(step, T // self._bticks)
        self._step, self._runs, self._run, self._run_from, self._step_from = step, [run], run, T, T
        self._disrupted = self._failed_in_step = None
        self._life.ran_steps = True  # type: ignore[union-attr]

    def _interrupt(self) -> None:
        """The open step ends unfinished at its first disruption (else now): all of it is wasted."""
        if self._step is None:
            return
        if self._disrupted is not None and self._disrupted < self._L:
            self._retro_uncover_runs(self._disrupted, self._runs)
        for run in self._runs:
            self._set_state(run, _WASTED)
        self._close_step()

    def _close_step(self) -> None:
        self._step, self._runs, self._run = None, [], None
        self._disrupted = self._failed_in_step = None

    def _failure(self, failure: Failure, T: int) -> _Fail:
        rec = _Fail(failure, T)
        self._fails.append(rec)
        self._open_recoveries.append(rec)
        self._awaiting_mode.append(rec)
        self._cover_now(ev.RECOVERY_DOWNTIME, 1)
        if self._last_mode is not None and self._last_mode[0] == failure.t:  # a recovery_done at its time
            rec.mode, rec.mode_t = self._last_mode[1], failure.t
        return rec

    def _resolve(self, t: float) -> None:
        """Implicit failures whose window (up to the first completed step after them) has passed stand."""
        if self._candidates:
            self._candidates = [c for c in self._candidates if c.resolve_t is None or t <= c.resolve_t]

    def _cancel(self, rec: _Fail) -> None:
        """An implicit failure turned out to be a detected one: it never happened."""
        rec.cancelled = True
        self._fails.remove(rec)
        self._candidates.remove(rec)
        if rec in self._awaiting_mode:
            self._awaiting_mode.remove(rec)
        if rec in self._open_recoveries:
            self._open_recoveries.remove(rec)
            self._cover_now(ev.RECOVERY_DOWNTIME, -1)
        self._retro_cover(ev.RECOVERY_DOWNTIME, rec.start, -1, rec.closed_at)

    # -- event handlers -------------------------------------------------------------------------------------
    def _on_init_done(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        life = self._life
        assert life is not None
        if life.init:
            life.init = False
            self._cover_now(ev.INITIALIZATION, -1)

    def _on_step_start(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        self._interrupt()
        self._open_step(int(_num(e, "step")), T)

    def _complete(self, e: Mapping[str, Any], step: int, t: float) -> None:
        """The open step's step_end: its (last) run is the step's completed execution."""
        capacity = e.get("capacity", 1.0)
        if type(capacity) is not float:
            capacity = _num(e, "capacity", 1.0)
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"step_end of step {step} at t={t} has capacity {capacity}, outside (0, 1]")
        run = self._run
        assert run is not None and self._step == step
        if len(self._runs) > 1:
            for part in self._runs:
                if part is not run:
                    self._set_state(part, _WASTED)
        layout = e.get("layout", "single")
        run.key = (layout if type(layout) is str else str(layout), capacity)
        done = self._done
        earlier = done.get(step)
        if earlier is not None:  # redone: only the last completed execution counts
            self._set_state(earlier, _WASTED)
        done[step] = run
        self._completed_runs += 1
        if run.state == _OPEN:  # _set_state(run, _PRODUCTIVE), inline: most events are steps
            run.state = _PRODUCTIVE
            n = run.ticks
            prod = self._prod
            prod[run.key] = prod.get(run.key, 0) + n
            idx = run.bucket
            bucket = self._last_bucket[1] if idx == self._last_bucket[0] else self._bucket(idx)
            if bucket is not None:
                bucket[_PROD_SLOT] += capacity * n
                bucket[_DEGRADED_SLOT] += (1.0 - capacity) * n
        else:
            self._set_state(run, _PRODUCTIVE)
        self._step, self._runs, self._run = None, [], None
        self._disrupted = self._failed_in_step = None

    def _on_step_end(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        step = _int(e, "step")
        self._complete(e, step, t)
        still = []
        for rec in self._open_recoveries:
            if rec.failure.t < t:
                rec.end_t, rec.closed_at = t, T
                self._cover_now(ev.RECOVERY_DOWNTIME, -1)
            else:
                still.append(rec)
        self._open_recoveries = still
        for rec in self._candidates:
            if rec.resolve_t is None and rec.failure.t < t:
                rec.resolve_t = t

    def _on_ckpt_save_start(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        assert self._life is not None
        self._life.saves.append((e.get("step"), t, T))
        self._cover_now(ev.CHECKPOINT_SAVE, 1)

    def _match_save(self, e: Mapping[str, Any]) -> tuple[Any, float, int] | None:
        assert self._life is not None
        saves = self._life.saves
        same_step = (i for i, (step, _, _) in enumerate(saves) if step == e.get("step"))
        match = next(same_step, 0 if saves else None)
        if match is None:
            return None
        self._cover_now(ev.CHECKPOINT_SAVE, -1)
        return saves.pop(match)

    def _on_ckpt_save_end(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        blocking = e.get("blocking_s")
        save = self._match_save(e)
        if save is not None:
            if isinstance(blocking, int | float):
                end = _ticks(min(t, save[1] + float(blocking)))
                if end < T:  # the save blocked only until `end`: it stops covering the time after
                    self._retro_cover(ev.CHECKPOINT_SAVE, max(end, save[2]), -1)
        elif isinstance(blocking, int | float):
            self._retro_cover(ev.CHECKPOINT_SAVE, _ticks(t - float(blocking)), 1)

    def _on_ckpt_save_abort(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        self._match_save(e)

    def _on_ckpt_restore_start(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        life = self._life
        assert life is not None
        if life.restore is not None:  # a second start: the first one's interval is dropped
            self._retro_cover(ev.CHECKPOINT_RESTORE, life.restore, -1)
        else:
            self._cover_now(ev.CHECKPOINT_RESTORE, 1)
        life.restore = T

    def _on_ckpt_restore_end(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        life = self._life
        assert life is not None
        if life.restore is not None:
            life.restore = None
            self._cover_now(ev.CHECKPOINT_RESTORE, -1)
        else:  # no start: it ran since the previous event
            self._retro_cover(ev.CHECKPOINT_RESTORE, prev, 1)

    def _on_wait(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        self._retro_cover(_WAITS[e["event"]], _ticks(t - _num(e, "seconds")), 1)

    def _on_failure_detected(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        life = self._life
        assert life is not None
        rank, process = e.get("rank"), e.get("process")
        failure = Failure(t, rank if isinstance(rank, int) else None, str(e.get("reason", "")),
                          process=process if isinstance(process, int) else None)
        for rec in list(self._candidates):  # a failure found in an implicit failure's window: not implicit
            if rec.resolve_t is None or t <= rec.resolve_t:
                self._cancel(rec)
        life.failed = True
        if life.saves:  # lost with the failure
            self._cover_now(ev.CHECKPOINT_SAVE, -len(life.saves))
            life.saves = []
        if self._step is not None and self._failed_in_step is None:
            # recovered live inside the step: the part before the failure is wasted, the execution that
            # counts starts at the (last) recovery_done, or here when none comes
            self._failed_in_step = T
            before = self._run
            assert before is not None
            self._set_state(before, _WASTED)
            after = _Run(self._step, T // self._bticks)
            self._runs.append(after)
            self._run, self._run_from = after, T
        self._failure(failure, T)

    def _on_recovery_done(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        mode = str(e.get("mode", "restart"))
        for rec in self._awaiting_mode:
            if rec.mode is None or (rec.mode_t == t and mode < rec.mode):
                rec.mode, rec.mode_t = mode, t
        self._awaiting_mode = [r for r in self._awaiting_mode if r.mode_t == t]
        self._last_mode = (t, min(mode, self._last_mode[1]) if self._last_mode and self._last_mode[0] == t
                           else mode)
        seconds = e.get("recovery_s")
        live = mode == "live" and isinstance(seconds, int | float) and not isinstance(seconds, bool)
        if live and seconds > 0:
            self._retro_cover(ev.RESHARD, _ticks(t - float(seconds)), 1)
        if self._failed_in_step is not None and self._run is not None:
            if self._run_from < T:  # the execution that counts starts here, not at the earlier recovery
                self._retro_uncover_runs(self._run_from, [self._run])
            self._run_from = T

    def _on_job_end(self, e: Mapping[str, Any], t: float, T: int, prev: int) -> None:
        assert self._life is not None
        self._life.status = str(e.get("status", ev.STATUS_OK))

    # -- reading ------------------------------------------------------------------------------------------
    def report(self) -> GoodputReport:
        """The cumulative report of every event fed so far (see the class docstring)."""
        if self._start is None:
            raise ValueError("no goodput events to analyse")
        tally = list(self._tally)
        prod = dict(self._prod)
        wasted = self._wasted
        if self._step is not None:  # as if the stream ended now: the open step ends unfinished, at its
            adjust: dict[int, int] = {}  # first disruption if any (the time after it is not the step's)
            ids = {id(r) for r in self._runs}
            d = self._disrupted
            if d is not None and d < self._L:
                for a, b, cover, run, _ in reversed(self._hist):
                    if b <= d:
                        break
                    if run is not None and id(run) in ids and _winner(cover, run) == _RUN_I:
                        n = b - max(a, d)
                        adjust[id(run)] = adjust.get(id(run), 0) + n
                        tally[_winner(cover, None)] += n
            for run in self._runs:
                less = adjust.get(id(run), 0)
                wasted += run.ticks - less if run.state == _OPEN else -less
        ticks = {c: tally[i] for i, c in enumerate(_COVERS)}
        ticks[ev.OTHER] = tally[_OTHER_I]
        ticks[ev.WASTED_PROGRESS] = wasted
        life = self._life
        fails = list(self._fails)
        recoveries = [
            {"mode": rec.mode or "-", "recovery_s": (rec.end_t if rec.end_t is not None else self._last_t)
             - rec.failure.t, "rank": rec.failure.rank, "process": rec.failure.process,
             "reason": rec.failure.reason, "t": rec.failure.t}
            for rec in fails
        ]
        ended_failed = life is not None and life.status not in (None, ev.STATUS_OK)
        if ended_failed and life is not None and life.ran_steps and not life.failed:
            # the last lifetime ended failed with no failure seen: an implicit one at its last event
            tie = self._last_mode is not None and self._last_mode[0] == self._last_t
            recoveries.append({"mode": self._last_mode[1] if tie and self._last_mode else "-",
                               "recovery_s": self._last_t - self._last_t, "rank": None, "process": None,
                               "reason": f"job_end status {life.status}", "t": self._last_t})
        return _report(start=self._start, end=self._L, ticks=ticks, productive=prod,
                       steps_completed=len(self._done), steps_redone=self._completed_runs - len(self._done),
                       lifetimes=self._lifetimes, failure_recoveries=recoveries)

    def failures(self) -> list[Failure]:
        """The failures so far, detected and implicit, in time order."""
        return [rec.failure for rec in self._fails]

    def series(self) -> list[dict[str, Any]]:
        """Seconds per category in each retained bucket of `bucket_s` (oldest first)."""
        out = []
        for idx in sorted(self._buckets):
            b = self._buckets[idx]
            badput = {c: b[_CI[c]] / TICKS_PER_S for c in ev.BADPUT_CATEGORIES if c in _CI}
            badput[ev.OTHER] = b[_OTHER_I] / TICKS_PER_S
            badput[ev.WASTED_PROGRESS] = b[_WASTED_SLOT] / TICKS_PER_S
            badput[ev.DEGRADED_THROUGHPUT] = b[_DEGRADED_SLOT] / TICKS_PER_S
            productive = b[_PROD_SLOT] / TICKS_PER_S
            start = idx * self._bticks / TICKS_PER_S
            out.append({"start": start, "end": start + self.bucket_s, "productive_s": productive,
                        "total_s": productive + sum(badput.values()),
                        "badput_s": {c: badput.get(c, 0.0) for c in ev.BADPUT_CATEGORIES}})
        return out

    def window(self) -> WindowFigures:
        """Goodput over the buckets of the last `window_s` seconds (the step running now not yet counted)."""
        first = (self._L - _ticks(self.window_s)) // self._bticks
        slots = [0.0] * (_WASTED_SLOT + 1)
        for idx, b in self._buckets.items():
            if idx >= first:
                slots = [x + y for x, y in zip(slots, b, strict=True)]
        badput = {c: slots[_CI[c]] / TICKS_PER_S for c in ev.BADPUT_CATEGORIES if c in _CI}
        badput[ev.OTHER] = slots[_OTHER_I] / TICKS_PER_S
        badput[ev.WASTED_PROGRESS] = slots[_WASTED_SLOT] / TICKS_PER_S
        badput[ev.DEGRADED_THROUGHPUT] = slots[_DEGRADED_SLOT] / TICKS_PER_S
        badput = {c: badput.get(c, 0.0) for c in ev.BADPUT_CATEGORIES}
        productive = slots[_PROD_SLOT] / TICKS_PER_S
        total = productive + sum(badput.values())
        goodput = productive / total if total > 0 else 0.0
        return WindowFigures(self.window_s, total, productive, goodput, badput)


_HANDLERS: dict[str, Callable[[GoodputCalculator, Mapping[str, Any], float, int, int], None]] = {
    ev.INIT_DONE: GoodputCalculator._on_init_done,
    ev.STEP_START: GoodputCalculator._on_step_start,
    ev.STEP_END: GoodputCalculator._on_step_end,
    ev.CKPT_SAVE_START: GoodputCalculator._on_ckpt_save_start,
    ev.CKPT_SAVE_END: GoodputCalculator._on_ckpt_save_end,
    ev.CKPT_SAVE_ABORT: GoodputCalculator._on_ckpt_save_abort,
    ev.CKPT_RESTORE_START: GoodputCalculator._on_ckpt_restore_start,
    ev.CKPT_RESTORE_END: GoodputCalculator._on_ckpt_restore_end,
    ev.FAILURE_DETECTED: GoodputCalculator._on_failure_detected,
    ev.RECOVERY_DONE: GoodputCalculator._on_recovery_done,
    ev.JOB_END: GoodputCalculator._on_job_end,
    **{name: GoodputCalculator._on_wait for name in _WAITS},
}


def _in_order(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((e for e in events if e.get("event") in ev.EVENTS), key=lambda e: float(e["t"]))


def replay(events: Iterable[Mapping[str, Any]],
           calculator: GoodputCalculator | None = None) -> GoodputCalculator:
    """Feed a stream's events in time order (a stable sort, as the batch calculator orders them)."""
    calc = calculator if calculator is not None else GoodputCalculator()
    return calc.feed_all(_in_order(events))


class _OutOfOrder(Exception):
    pass


def _sorted_chunks(chunks: Iterable[list[dict[str, Any]]]) -> Iterator[list[dict[str, Any]]]:
    """A file's events in time order (the batch's stable sort) from its chunks, holding only a chunk or
    two: raises _OutOfOrder when an event is stamped before one already passed on (then sort it whole).
    A chunk is passed on once the next one starts no earlier than its last event (the usual case: a file
    written in time order is never sorted here)."""
    held: list[dict[str, Any]] = []  # in time order; passed on once no later event can come before them
    fed = float("-inf")
    for chunk in chunks:
        times = [e["t"] for e in chunk]
        low = min(times)
        if low < fed:
            raise _OutOfOrder
        if held and held[-1]["t"] <= low:
            yield held
            fed, held = held[-1]["t"], []
        elif held:
            cut = bisect.bisect_right(held, low, key=lambda e: e["t"])
            if cut:
                yield held[:cut]
                fed = held[cut - 1]["t"]
            held = held[cut:]
        if not held and all(map(operator.le, times, itertools.islice(times, 1, None))):
            held = chunk
        else:
            held += chunk
            held.sort(key=lambda e: e["t"])
    if held:
        yield held


def replay_file(path: str | Path, calculator: GoodputCalculator | None = None) -> GoodputCalculator:
    """Feed a run's goodput.jsonl (or a .jsonl file) to a calculator in time order, reading it a chunk at
    a time: the figures of `compute_goodput(load_events(path))` in flat memory."""
    make = (lambda: calculator) if calculator is not None else GoodputCalculator
    calc = make()
    collecting = gc.isenabled()
    gc.disable()  # nothing here makes a reference cycle; the collector would only walk the new objects
    try:
        for chunk in _sorted_chunks(iter_event_chunks(path)):
            calc.feed_all(chunk)
    except _OutOfOrder:  # stamped out of order further apart than a chunk: sort the whole stream
        if calculator is not None and calculator.events_fed:
            raise ValueError(f"{path}: events out of order across chunks; pass no calculator") from None
        calc = replay(load_events(path), GoodputCalculator() if calculator is None else calculator)
    finally:
        if collecting:
            gc.enable()
    return calc


def disagreement(events: Iterable[Mapping[str, Any]], prefixes: int = 50) -> str | None:
    """Replay a stream event by event and compare the incremental report with the batch one
    (`breakdown(build_timeline(prefix))`) after `prefixes` evenly spread events and after the last:
    None when they are equal (bit for bit), else the first difference."""
    stream = _in_order(events)
    if not stream:
        return None
    stride = max(1, len(stream) // max(1, prefixes))
    calc = GoodputCalculator()
    for i, e in enumerate(stream, start=1):
        calc.feed(e)
        if i % stride and i != len(stream):
            continue
        batch, incremental = breakdown(build_timeline(stream[:i])).to_dict(), calc.report().to_dict()
        if batch != incremental:
            diff = {k: (batch[k], incremental[k]) for k in batch if batch[k] != incremental[k]}
            return f"after {i} of {len(stream)} events (t={e['t']}): batch != incremental: {diff}"
    return None


_SHORT = {
    ev.INITIALIZATION: "init",
    ev.CHECKPOINT_SAVE: "ckpt save",
    ev.CHECKPOINT_RESTORE: "ckpt restore",
    ev.WASTED_PROGRESS: "wasted",
    ev.RECOVERY_DOWNTIME: "recovery",
    ev.RESHARD: "reshard",
    ev.DEGRADED_THROUGHPUT: "degraded",
    ev.DATA_LOADING: "data",
    ev.STRAGGLERS: "stragglers",
    ev.INTEGRITY: "integrity",
    ev.OTHER: "other",
}


def failure_kinds(report: GoodputReport) -> list[dict[str, Any]]:
    """The failures summarised by kind (recovery mode and reason), largest total recovery time first:
    count, total, mean and longest recovery seconds."""
    kinds: dict[tuple[str, str], list[float]] = {}
    for r in report.failure_recoveries:
        key = (str(r.get("mode", "-")), str(r.get("reason", "")))
        kinds.setdefault(key, []).append(float(r["recovery_s"]))
    rows = [{"mode": mode, "reason": reason, "count": len(xs), "total_s": sum(xs),
             "mean_s": sum(xs) / len(xs), "max_s": max(xs)} for (mode, reason), xs in kinds.items()]
    return sorted(rows, key=lambda row: (-row["total_s"], row["mode"], row["reason"]))


def longest_failures(report: GoodputReport, n: int = 5) -> list[tuple[int, dict[str, Any]]]:
    """The n failures with the longest recovery, as (their number from 1 in time order, entry)."""
    ranked = sorted(enumerate(report.failure_recoveries, start=1), key=lambda x: (-x[1]["recovery_s"], x[0]))
    return ranked[:n]


LIST_EACH_UP_TO = 5  # more failures than this are summarised by kind


def summary_line(report: GoodputReport) -> str:
    """One line for the end-of-run summary: goodput, the largest badput, capacity and failures."""
    badput = sorted(((s, c) for c, s in report.badput_s.items() if s > 0), reverse=True)[:3]
    parts = [f"goodput {100 * report.goodput:.1f}% ({report.productive_s:.1f} s of {report.total_s:.1f} s)"]
    if badput:
        parts.append("badput " + ", ".join(f"{_SHORT[c]} {s:.1f} s" for s, c in badput))
    if report.capacity_fraction < 1.0 and report.productive_s > 0:
        parts.append(f"NTP capacity {report.capacity_fraction:.3f}")
    if report.failures or report.steps_redone:
        parts.append(f"{report.failures} failure(s), {report.steps_redone} step(s) redone")
    if 0 < len(report.failure_recoveries) <= LIST_EACH_UP_TO:
        parts.append("recovered " + ", ".join(f"{r['mode']} in {r['recovery_s']:.1f} s"
                                              for r in report.failure_recoveries))
    elif report.failure_recoveries:
        by_mode: dict[str, list[float]] = {}
        for r in report.failure_recoveries:
            by_mode.setdefault(r["mode"], []).append(r["recovery_s"])
        parts.append("recovered " + ", ".join(
            f"{mode} {len(xs)}x (mean {sum(xs) / len(xs):.1f} s, longest {max(xs):.1f} s)"
            for mode, xs in sorted(by_mode.items(), key=lambda kv: -len(kv[1]))))
    return "; ".join(parts)
