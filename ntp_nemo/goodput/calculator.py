"""Offline goodput calculator: goodput.jsonl events -> time breakdown.

Two stages, both pure functions of the event stream so tests can feed synthetic streams:
`build_timeline` turns events (spanning any number of process lifetimes) into intervals,
and `compute_goodput` assigns every instant of job time to exactly one category, so
productive time plus the badput categories add up to the total.

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

import json
import warnings
from collections.abc import Iterable, Mapping
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
    data_waits: list[Span] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    recoveries: list[Span] = field(default_factory=list)
    reshards: list[Span] = field(default_factory=list)  # live recoveries' and rejoins' recovery_s
    idle: list[Span] = field(default_factory=list)
    recoveries_done: list[tuple[float, str]] = field(default_factory=list)
    recovery_modes: list[tuple[float, str]] = field(default_factory=list)  # live | restart, by time


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


# High to low: the first category whose interval covers an instant gets it.
_IDLE = "idle"
_PRIORITY: tuple[str, ...] = (
    _IDLE,
    ev.CHECKPOINT_SAVE,
    ev.CHECKPOINT_RESTORE,
    ev.INITIALIZATION,
    ev.DATA_LOADING,
    ev.RESHARD,
    ev.PRODUCTIVE,
    ev.WASTED_PROGRESS,
    ev.RECOVERY_DOWNTIME,
)
# Events after which an unfinished step can no longer be running.
_DISRUPTING = frozenset(
    {ev.FAILURE_DETECTED, ev.CKPT_RESTORE_START, ev.RECOVERY_DONE, ev.JOB_END, ev.INIT_DONE}
)


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a run directory's (or a file's) goodput events; bad input raises ConfigError naming the path.

    A last line without its newline is what a crash in mid-write leaves: it is skipped with a warning.
    """
    file = goodput_path(path)
    fix = "pass a run directory written by ntp-train (it holds goodput.jsonl) or the .jsonl file itself"
    if not file.is_file():
        raise ConfigError("run_dir", f"goodput event file {file} does not exist; {fix}.")
    text = file.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):  # no trailing newline: interrupted write
                warnings.warn(f"{file}:{lineno}: skipping a truncated last line", stacklevel=2)
                continue
            raise ConfigError("run_dir", f"{file}:{lineno} is not valid JSON ({err.msg}); {fix}.") from None
        if not (
            isinstance(obj, dict)
            and isinstance(obj.get("t"), int | float)
            and isinstance(obj.get("event"), str)
        ):
            what = "is not a goodput event (needs numeric 't' and string 'event')"
            raise ConfigError("run_dir", f"{file}:{lineno} {what}; {fix}.")
        out.append(obj)
    if not out:
        raise ConfigError("run_dir", f"goodput event file {file} holds no events; {fix}.")
    return out


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
            handler = getattr(self, f"_on_{name}", None)
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
        self.tl.data_waits.append(Span(t - _num(e, "seconds"), t))

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
        (ev.DATA_LOADING, tl.data_waits),
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
    """Assign every instant of job time to productive or one badput category (they sum to total_s)."""
    return breakdown(build_timeline(events))


def breakdown(tl: Timeline) -> GoodputReport:
    """The report for an already built timeline (see `compute_goodput`)."""
    intervals = _intervals(tl)
    rank = {c: i for i, c in enumerate(_PRIORITY)}
    points: list[tuple[float, int, int]] = []
    for idx, (a, b, _, _) in enumerate(intervals):
        points += [(a, 1, idx), (b, -1, idx)]
    points.sort()

    seconds = dict.fromkeys((*_PRIORITY, ev.DEGRADED_THROUGHPUT, ev.OTHER), 0.0)
    by_layout: dict[str, float] = {}
    active: list[dict[int, StepRun | None]] = [{} for _ in _PRIORITY]
    prev = tl.start
    for t, kind, idx in points:
        if t > prev:
            winner = next((i for i, group in enumerate(active) if group), None)
            length = t - prev
            if winner is None:
                seconds[ev.OTHER] += length
            elif _PRIORITY[winner] == ev.PRODUCTIVE:  # progress at the step's capacity; the rest degraded
                run = next(iter(active[winner].values()))
                assert run is not None
                seconds[ev.PRODUCTIVE] += run.capacity * length
                seconds[ev.DEGRADED_THROUGHPUT] += (1.0 - run.capacity) * length
                by_layout[run.layout] = by_layout.get(run.layout, 0.0) + run.capacity * length
            else:
                seconds[_PRIORITY[winner]] += length
            prev = t
        _, _, category, run = intervals[idx]
        group = active[rank[category]]
        if kind > 0:
            group[idx] = run
        else:
            group.pop(idx, None)
    seconds[ev.OTHER] += max(0.0, tl.end - prev)

    idle = seconds.pop(_IDLE)
    productive = seconds.pop(ev.PRODUCTIVE)
    stepping = productive + seconds[ev.DEGRADED_THROUGHPUT]  # the productive executions' full length
    total = (tl.end - tl.start) - idle
    completed = [s for s in tl.steps if s.completed]
    unique = {s.step for s in completed}
    return GoodputReport(
        total_s=total,
        productive_s=productive,
        goodput=productive / total if total > 0 else 0.0,
        badput_s={c: seconds[c] for c in ev.BADPUT_CATEGORIES},
        capacity_fraction=productive / stepping if stepping > 0 else 0.0,
        steps_completed=len(unique),
        steps_redone=len(completed) - len(unique),
        failures=len(tl.failures),
        lifetimes=len(tl.lifetimes),
        idle_s=idle,
        productive_by_layout=by_layout,
        failure_recoveries=[
            {"mode": next((m for t, m in sorted(tl.recovery_modes) if t >= f.t), "-"),
             "recovery_s": span.end - span.start, "rank": f.rank, "process": f.process}
            for f, span in zip(tl.failures, tl.recoveries, strict=True)
        ],
    )


_SHORT = {
    ev.INITIALIZATION: "init",
    ev.CHECKPOINT_SAVE: "ckpt save",
    ev.CHECKPOINT_RESTORE: "ckpt restore",
    ev.WASTED_PROGRESS: "wasted",
    ev.RECOVERY_DOWNTIME: "recovery",
    ev.RESHARD: "reshard",
    ev.DEGRADED_THROUGHPUT: "degraded",
    ev.DATA_LOADING: "data",
    ev.OTHER: "other",
}


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
    if report.failure_recoveries:
        parts.append("recovered " + ", ".join(f"{r['mode']} in {r['recovery_s']:.1f} s"
                                              for r in report.failure_recoveries))
    return "; ".join(parts)
