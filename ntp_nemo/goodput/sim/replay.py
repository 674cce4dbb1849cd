"""One job replayed through a failure trace: the time each recovery policy takes to reach the last step.

The cluster studies (`studies.py`) ask how much of a large cluster trains under a failure rate; this
module asks the user's question for one job: *with these failures, at these steps, when does my run
finish under each policy?*  It walks the steps one by one, as the project's recovery paths do:

- `live` (NTP live, NTP-PW live, DP-drop live): a lost or hung rank costs its detection and the
  survivors' reshard; the step it interrupted runs again on the shrunk layout (no step is redone
  beyond it); `repair_after_steps` steps after the recovery the repaired rank is announced to join
  `REJOIN_LEAD` steps later, and the step it joins at pays the rejoin; a repair announced past the
  last step never happens (the run ends degraded).
- `restart` (NTP by restart): every worker stops and the job relaunches on the shrunk layout from
  the last committed checkpoint, redoing the steps since it (an asynchronous save of the step just
  before a loss never commits: the lost process's writer dies with it); the degraded attempt stops
  at the first checkpoint boundary at least `repair_after_steps` steps after it resumed, and the job
  relaunches on the full layout from that checkpoint (nothing redone).
- `spare` (checkpoint-restart with a spare, `fault.policy=restart`): relaunch at once on the full
  layout from the last checkpoint.
- `wait` (checkpoint-restart that waits for the repair): the job stops; it is started again on the
  full layout, from the last checkpoint, once the repair is done (`repair_wait_s` after the stop).

A straggler adds its delay to every step it slows (the job runs at its pace); it slows only a layout
that still has its rank.  The costs are measured ones (`ReplayCosts`, e.g. by `bench/failure_trace.py`
from a real run), so the replay is a model of how the events compose (which steps run on which
layout, which are redone, when a repair lands), checked against measured time to the last step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

LOSE, HANG, SLOW = "lose", "hang", "slow"
EVENT_KINDS = (LOSE, HANG, SLOW)
MODES = ("live", "restart", "spare", "wait")
REJOIN_LEAD = 3  # a live rejoin is announced this many steps ahead of the step it joins at
FULL = "full"


@dataclass(frozen=True)
class TraceEvent:
    """`kind` lose (the rank's process is lost: `kill_rank`), hang (alive, silent: `hang`) or slow (a
    straggler: `seconds` more per step for `steps` steps); `rank`: global rank of the full layout;
    `step`: the step at whose start it strikes."""

    kind: str
    step: int
    rank: int
    seconds: float = 0.0
    steps: int = 0

    def fault(self) -> dict:
        """The `fault.more` entry of `ntp-train` that injects this event."""
        if self.kind == SLOW:
            return {"kind": "slow", "rank": self.rank, "step": self.step, "seconds": self.seconds,
                    "steps": self.steps}
        return {"kind": "kill_rank" if self.kind == LOSE else "hang", "rank": self.rank, "step": self.step}

    def describe(self) -> str:
        if self.kind == SLOW:
            return f"slow r{self.rank} @{self.step} (+{self.seconds:g} s x {self.steps} steps)"
        return f"{'loss' if self.kind == LOSE else 'hang'} r{self.rank} @{self.step}"


@dataclass(frozen=True)
class FailureTrace:
    """A run of `steps` steps with checkpoints every `checkpoint_every` and the `events`; every lost
    or hung rank is repaired `repair_after_steps` steps after its recovery (one value for the run, as
    `fault.repair_after_steps` has); a repair that would land after the last step never does."""

    steps: int
    repair_after_steps: int
    checkpoint_every: int
    events: tuple[TraceEvent, ...]
    seed: int | None = None

    def fault_overrides(self) -> list[str]:
        """`ntp-train` overrides that inject the events (every one in `fault.more`)."""
        more = ",".join("{" + ",".join(f"{k}:{v}" for k, v in e.fault().items()) + "}" for e in self.events)
        return ["fault=none", f"++fault.more=[{more}]", f"fault.repair_after_steps={self.repair_after_steps}",
                f"checkpoint.every_n_steps={self.checkpoint_every}"]

    def losses(self) -> list[TraceEvent]:
        return [e for e in self.events if e.kind in (LOSE, HANG)]

    def describe(self) -> str:
        return "; ".join(e.describe() for e in self.events)


def generate_trace(seed: int, steps: int, world: int = 4, repair_after_steps: int = 30,
                   checkpoint_every: int = 10) -> FailureTrace:
    """A seeded trace of four events over `steps` steps: a loss repaired during the run, a hang
    repaired during the run, a straggler, and a late loss the run ends before repairing.  Losses are
    spaced so that each strikes the full layout under every policy (the earlier one repaired, by a
    live rejoin or a restart's checkpoint boundary, before the next).  ValueError when `steps` leaves
    no room for that."""
    rng = random.Random(seed)
    c, r = checkpoint_every, repair_after_steps
    # A restart resumes up to c steps back, repairs at a boundary up to c steps later, and a live rejoin
    # lands REJOIN_LEAD (+1 for the heartbeat's lag) steps after its announcement.
    gap = r + 2 * c + REJOIN_LEAD + 2
    last_lo, last_hi = steps - r + REJOIN_LEAD + 1, steps - 2
    first_lo = c + 2
    need = first_lo + 2 * gap + 1
    if steps < need or last_lo > last_hi or last_lo < need:
        raise ValueError(
            f"a trace of {steps} steps has no room for its four events with repair_after_steps={r} and "
            f"checkpoint_every={c}: it needs at least {max(need, 2 * r)} steps"
        )
    first = rng.randint(first_lo, first_lo + c)
    hang = rng.randint(first + gap, first + gap + c // 2)
    late = rng.randint(max(last_lo, hang + gap), last_hi)
    slow_steps = rng.randint(4, 8)
    slow_lo, slow_hi = hang + gap, late - slow_steps - 2
    slow_at = rng.randint(slow_lo, slow_hi) if slow_hi >= slow_lo else rng.randint(2, first - 1)
    slow_at = min(slow_at, slow_hi) if slow_hi >= slow_lo else slow_at
    events = (
        TraceEvent(LOSE, first, rng.randrange(world)),
        TraceEvent(HANG, hang, rng.randrange(world)),
        TraceEvent(SLOW, slow_at, rng.randrange(world), round(rng.uniform(0.3, 0.6), 1), slow_steps),
        TraceEvent(LOSE, late, rng.randrange(world)),
    )
    return FailureTrace(steps, r, c, tuple(sorted(events, key=lambda e: e.step)), seed)


@dataclass(frozen=True)
class ReplayCosts:
    """Measured costs the replay composes (seconds).

    `step_s`: time per step on each layout (`FULL` is the healthy layout; a degraded one by its key,
    see `ReplayPolicy.shrink`), checkpoint saves included; `startup_s`: command start to the first
    step; `detect_s`: fault to detection, per kind (lose, hang); `reshard_s`: live, detection to the
    interrupted step running again; `rejoin_s`: live, what the step a repaired rank joins at takes beyond
    a step; `restart_s`: detection to the first step of the relaunched attempt (restore included);
    (wait mode: the start of the command run again to its first step); `repair_relaunch_s`: restart
    path, the end of the degraded attempt's last step to the first step on the repaired layout;
    `stop_s`: wait mode, detection to the end of the stopped command; `repair_wait_s`: wait mode, the
    repair's duration; `commit_s`: an asynchronous checkpoint's commit, after its blocking part (0:
    saves are synchronous)."""

    step_s: Mapping[str, float]
    startup_s: float
    detect_s: Mapping[str, float] = field(default_factory=dict)
    reshard_s: float = 0.0
    rejoin_s: float = 0.0
    restart_s: float = 0.0
    repair_relaunch_s: float = 0.0
    stop_s: float = 0.0
    repair_wait_s: float = 0.0
    commit_s: float = 0.0


@dataclass(frozen=True)
class ReplayPolicy:
    """How a job answers a loss: `mode` (one of MODES) and `shrink(lost_ranks) -> layout key` (the
    layout the survivors train on; `FULL` when nothing is lost)."""

    name: str
    mode: str
    shrink: Callable[[frozenset[int]], str]

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"replay mode {self.mode!r} is not one of {MODES}")


@dataclass(frozen=True)
class Replay:
    """What the replay predicts for one policy."""

    policy: str
    time_to_last_step_s: float
    steps_executed: int
    steps_redone: int
    degraded_s: float
    degraded_steps: int
    repairs: int
    layouts: dict[str, int]  # step executions per layout key


def replay(trace: FailureTrace, policy: ReplayPolicy, costs: ReplayCosts) -> Replay:
    """Walk `trace` under `policy` with `costs` (see the module docstring for the rules)."""
    events = sorted(trace.events, key=lambda e: e.step)
    fired: set[int] = set()
    lost: frozenset[int] = frozenset()
    layout = FULL
    t = costs.startup_s
    step = 1
    executed = redone = degraded_steps = repairs = 0
    degraded_s = 0.0
    done: set[int] = set()
    layouts: dict[str, int] = {}
    rejoin_at: int | None = None  # live: the step the repaired ranks join at
    degraded_since: int | None = None  # live: the step the last recovery ran on
    repair_stop: int | None = None  # restart: the last step of the degraded attempt
    c, r, n = trace.checkpoint_every, trace.repair_after_steps, trace.steps

    def last_checkpoint(before: int, kind: str) -> int:
        """The checkpoint a relaunch resumes from when step `before + 1` fails.  A lost process kills its
        own checkpoint writer: an asynchronous save of the step just before the loss is still committing
        (a loss strikes as the next step starts) and never completes, so the one before it is used.  A
        hung process's writer thread keeps running, and its save commits during the detection."""
        last = (before // c) * c if c > 0 else 0
        if kind == LOSE and last == before and last > 0 and costs.commit_s > 0:
            last -= c
        return last

    while step <= n:
        # A live repair: announced once the survivors reach `degraded_since + r`, joining REJOIN_LEAD
        # steps later (never past the end).
        if policy.mode == "live" and degraded_since is not None and step >= degraded_since + r \
                and rejoin_at is None:
            rejoin_at = step + REJOIN_LEAD
            degraded_since = None
            if rejoin_at > n:
                rejoin_at = None
        if rejoin_at is not None and step == rejoin_at:
            t += costs.rejoin_s
            lost, layout, rejoin_at = frozenset(), FULL, None
            repairs += 1
        strike = next((i for i, e in enumerate(events) if i not in fired and e.kind != SLOW
                       and step >= e.step and e.rank not in lost), None)
        if strike is not None:
            fired.add(strike)
            ev = events[strike]
            t += costs.detect_s.get(ev.kind, 0.0)
            if policy.mode == "live":
                lost = lost | {ev.rank}
                layout = policy.shrink(lost)
                t += costs.reshard_s
                degraded_since = step
            elif policy.mode in ("restart", "spare", "wait"):
                if policy.mode == "restart":
                    lost = lost | {ev.rank}
                    layout = policy.shrink(lost)
                    t += costs.restart_s
                elif policy.mode == "spare":
                    t += costs.restart_s
                else:
                    t += costs.stop_s + costs.repair_wait_s + costs.restart_s
                    repairs += 1
                resume = last_checkpoint(step - 1, ev.kind)
                redone += step - 1 - resume
                step = resume + 1
                if policy.mode == "restart":
                    target = math.ceil((resume + r) / c) * c if c > 0 else resume + r
                    repair_stop = target if target < n else None
                continue
        # The step itself, on the layout running now.
        d = costs.step_s[layout]
        d += sum(e.seconds for e in events if e.kind == SLOW and e.step <= step < e.step + e.steps
                 and e.rank not in lost)
        t += d
        executed += 1
        layouts[layout] = layouts.get(layout, 0) + 1
        if layout != FULL:
            degraded_s += d
            degraded_steps += 1
        done.add(step)
        if repair_stop is not None and step == repair_stop:
            t += costs.repair_relaunch_s
            lost, layout, repair_stop = frozenset(), FULL, None
            repairs += 1
        step += 1
    return Replay(policy.name, t, executed, redone, degraded_s, degraded_steps, repairs, layouts)
