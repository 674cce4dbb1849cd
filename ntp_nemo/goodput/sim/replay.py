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

A straggler slows only a layout that still has its rank.  Its additive form adds its seconds to every
step it slows (the job runs at its pace).  Its speed form (`factor`, as `fault.factor`) stretches the
slow rank's compute: a step on the full layout takes `step_s - compute_s + compute_s * max_i(m_i /
(m_nominal * a_i))` (`compute_s`: the busiest rank's compute of a nominal step; per replica `i` its
micro-batches `m_i` and actual speed `a_i`), so under `report` the step takes `compute_s * (1/factor - 1)`
longer.  The straggler watch (`StragglerModel`: `fault.straggler_every`, `_persist`, the policy) judges a
window of `every` steps at each step that is a multiple of `every`, a window slow when most of its steps
are; `persist` slow windows in a row name the straggler, and from the next step `rebalance` splits the
batch by the replicas' believed speeds (the factor rounded down to a multiple of 0.05, as
`resilience.straggler.replica_speeds` does) and `exclude` takes the rank out as a lost one (its detection
is a loss's); `persist` fast windows put the nominal split back.  The costs are measured ones
(`ReplayCosts`, e.g. by `bench/failure_trace.py` from a real run), so the replay is a model of how the
events compose (which steps run on which layout, which are redone, when a repair lands), checked
against measured time to the last step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

LOSE, HANG, SLOW = "lose", "hang", "slow"
EVENT_KINDS = (LOSE, HANG, SLOW)
MODES = ("live", "restart", "spare", "wait")
REJOIN_LEAD = 3  # a live rejoin is announced this many steps ahead of the step it joins at
FULL = "full"


@dataclass(frozen=True)
class TraceEvent:
    """`kind` lose (the rank's process is lost: `kill_rank`), hang (alive, silent: `hang`) or slow (a
    straggler for `steps` steps: `seconds` more per step, or with `factor` computing at that speed);
    `rank`: global rank of the full layout; `step`: the step at whose start it strikes."""

    kind: str
    step: int
    rank: int
    seconds: float = 0.0
    steps: int = 0
    factor: float | None = None

    def fault(self) -> dict:
        """The `fault.more` entry of `ntp-train` that injects this event."""
        if self.kind == SLOW:
            how = {"factor": self.factor} if self.factor is not None else {"seconds": self.seconds}
            return {"kind": "slow", "rank": self.rank, "step": self.step, **how, "steps": self.steps}
        return {"kind": "kill_rank" if self.kind == LOSE else "hang", "rank": self.rank, "step": self.step}

    def slows(self, step: int) -> bool:
        return self.kind == SLOW and self.step <= step < self.step + self.steps

    def describe(self) -> str:
        if self.kind == SLOW:
            if self.factor is not None:
                return f"slow r{self.rank} @{self.step} (speed {self.factor:g} x {self.steps} steps)"
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


SLOW_STEPS = (25, 40)  # the trace's straggler lasts this many steps (room for the watch's 15-step verdict)
SLOW_FACTORS = (0.4, 0.45, 0.5, 0.55, 0.6)  # its speed


def generate_trace(seed: int, steps: int, world: int = 4, repair_after_steps: int = 30,
                   checkpoint_every: int = 10) -> FailureTrace:
    """A seeded trace of four events over `steps` steps: a loss repaired during the run, a hang
    repaired during the run, a straggler computing at a speed of 0.4-0.6 for 25-40 steps (`fault.factor`),
    and a late loss the run ends before repairing.  Losses are spaced so that each strikes the full layout
    under every policy (the earlier one repaired, by a live rejoin or a restart's checkpoint boundary,
    before the next), and the straggler strikes the full layout after the hang's repair and ends before the
    late loss.  ValueError when `steps` leaves no room for that."""
    rng = random.Random(seed)
    c, r = checkpoint_every, repair_after_steps
    # A restart resumes up to c steps back, repairs at a boundary up to c steps later, and a live rejoin
    # lands REJOIN_LEAD (+1 for the heartbeat's lag) steps after its announcement.
    gap = r + 2 * c + REJOIN_LEAD + 2
    last_lo, last_hi = steps - r + REJOIN_LEAD + 1, steps - 2
    first_lo = c + 2
    need = first_lo + c + 2 * (gap + c // 2) + SLOW_STEPS[1] + 2  # the latest the late loss may have to be
    if last_hi < need or last_lo > last_hi:
        raise ValueError(
            f"a trace of {steps} steps has no room for its four events with repair_after_steps={r} and "
            f"checkpoint_every={c}: it needs at least {max(need + 2, 2 * r)} steps"
        )
    first = rng.randint(first_lo, first_lo + c)
    hang = rng.randint(first + gap, first + gap + c // 2)
    slow_steps = rng.randint(*SLOW_STEPS)
    slow_at = rng.randint(hang + gap, hang + gap + c // 2)
    late = rng.randint(max(last_lo, slow_at + slow_steps + 2), last_hi)
    events = (
        TraceEvent(LOSE, first, rng.randrange(world)),
        TraceEvent(HANG, hang, rng.randrange(world)),
        TraceEvent(SLOW, slow_at, rng.randrange(world), steps=slow_steps, factor=rng.choice(SLOW_FACTORS)),
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
    saves are synchronous); `compute_s`: the busiest rank's compute of a step on the full layout at the
    nominal split (what a speed-factor straggler stretches)."""

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
    compute_s: float = 0.0


REPORT, REBALANCE, EXCLUDE = "report", "rebalance", "exclude"
STRAGGLER_POLICIES = (REPORT, REBALANCE, EXCLUDE)
SPEED_STEP = 0.05  # believed speeds are rounded down to a multiple of this (`replica_speeds`)


@dataclass(frozen=True)
class StragglerModel:
    """The straggler watch of a replayed job (`fault.straggler*`): `policy` report, rebalance or exclude;
    a judgement every `every` steps, `persist` in a row to name or release a straggler; `floor`: below
    it rebalance excludes.  `nominal`: micro-batches per replica of the full layout; `replica_of(rank)`;
    `split(speeds) -> micro-batches per replica` for believed replica speeds (rebalance: the layout's
    split, `ResolvedLayout.with_changes(speeds=...)`).  Without them every replica is taken alike."""

    policy: str = REPORT
    every: int = 5
    persist: int = 3
    floor: float = 0.2
    nominal: tuple[int, ...] = ()
    replica_of: Callable[[int], int] | None = None
    split: Callable[[tuple[float, ...]], Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if self.policy not in STRAGGLER_POLICIES:
            raise ValueError(f"straggler policy {self.policy!r} is not one of {STRAGGLER_POLICIES}")

    def believed(self, factor: float) -> float:
        """The speed the watch settles on for a rank at `factor`: rounded down to a multiple of 0.05, as
        `replica_speeds` does, strictly below the factor (the measured estimate of an injected factor
        lands a hair under it: 0.49 for 0.5, 0.44 for 0.45, the slowdown's sleep never wakes early)."""
        return round(max(SPEED_STEP, math.ceil(factor / SPEED_STEP - 1 - 1e-9) * SPEED_STEP), 6)

    def stretch(self, slow: Mapping[int, float], believed: Mapping[int, float]) -> float:
        """A full-layout step's compute over the nominal one: per replica its micro-batches (split by the
        `believed` speeds of ranks) over its actual speed (the `slow` ranks' factors)."""
        if not self.nominal or self.replica_of is None:
            return 1.0 / min([1.0, *slow.values()])
        actual = [1.0] * len(self.nominal)
        for r, f in slow.items():
            actual[self.replica_of(r)] = min(actual[self.replica_of(r)], f)
        m: Sequence[int] = self.nominal
        if believed and self.split is not None:
            speeds = [1.0] * len(self.nominal)
            for r, v in believed.items():
                speeds[self.replica_of(r)] = min(speeds[self.replica_of(r)], v)
            m = self.split(tuple(speeds))
        return max(mi / a for mi, a in zip(m, actual, strict=True)) / max(self.nominal)


@dataclass(frozen=True)
class ReplayPolicy:
    """How a job answers a loss: `mode` (one of MODES) and `shrink(lost_ranks) -> layout key` (the
    layout the survivors train on; `FULL` when nothing is lost); and a straggler (`straggler`)."""

    name: str
    mode: str
    shrink: Callable[[frozenset[int]], str]
    straggler: StragglerModel = StragglerModel()

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
    straggler_named: tuple[int, ...] = ()  # the steps after which the watch named a straggler
    straggler_s: float = 0.0  # what the stragglers added to the steps they slowed
    rebalanced_steps: int = 0  # steps run on a split by believed speeds


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

    watch = policy.straggler
    factor_events = [e for e in events if e.kind == SLOW and e.factor is not None]
    believed: dict[int, float] = {}  # rank -> the speed the watch believes it has
    streaks: dict[int, list[int]] = {}  # rank -> [slow windows in a row, fast windows in a row]
    window: list[int] = []  # steps executed since the last judgement
    excluded: dict[int, int] = {}  # rank -> the step at which it leaves (exclude)
    gone: set[int] = set()  # excluded ranks (the slow device left with its process)
    named: list[int] = []
    straggler_s = 0.0
    rebalanced = 0
    seen_layout = layout

    def slow_ranks(at: int) -> dict[int, float]:
        out: dict[int, float] = {}
        for e in factor_events:
            if e.slows(at) and e.rank not in lost and e.rank not in gone:
                out[e.rank] = min(out.get(e.rank, 1.0), float(e.factor or 1.0))
        return out

    def judge(at: int) -> None:
        """The watch's judgement after step `at` (a multiple of `every`) of the steps in `window`."""
        for e in factor_events:
            if e.rank in lost or e.rank in gone or not window:
                continue
            slow_steps = sum(1 for j in window if e.slows(j))
            st = streaks.setdefault(e.rank, [0, 0])
            is_slow = 2 * slow_steps > len(window)
            st[0], st[1] = (st[0] + 1, 0) if is_slow else (0, st[1] + 1)
            if e.rank not in believed and st[0] >= watch.persist and watch.policy != REPORT:
                named.append(at)
                if watch.policy == EXCLUDE or float(e.factor or 1.0) < watch.floor:
                    excluded[e.rank] = at + 1
                else:
                    believed[e.rank] = watch.believed(float(e.factor or 1.0))
            elif e.rank not in believed and st[0] == watch.persist:
                named.append(at)
            elif e.rank in believed and st[1] >= watch.persist:
                del believed[e.rank]
            elif e.rank in believed:  # the split follows each judgement's estimate (back to even when fast)
                believed[e.rank] = watch.believed(float(e.factor or 1.0)) if is_slow else 1.0
        window.clear()

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
        leaving = next((rk for rk, at in excluded.items() if step >= at and rk not in lost), None)
        strike = None if leaving is not None else next(
            (i for i, e in enumerate(events) if i not in fired and e.kind != SLOW and step >= e.step
             and e.rank not in lost), None)
        if leaving is not None or strike is not None:
            if strike is not None:
                fired.add(strike)
                ev = events[strike]
                kind, rank = ev.kind, ev.rank
            else:  # an excluded straggler leaves as a lost rank does (exit status 137)
                kind, rank = LOSE, leaving
                del excluded[leaving]
                gone.add(leaving)
            t += costs.detect_s.get(kind, 0.0)
            if policy.mode == "live":
                lost = lost | {rank}
                layout = policy.shrink(lost)
                t += costs.reshard_s
                degraded_since = step
            elif policy.mode in ("restart", "spare", "wait"):
                if policy.mode == "restart":
                    lost = lost | {rank}
                    layout = policy.shrink(lost)
                    t += costs.restart_s
                elif policy.mode == "spare":
                    t += costs.restart_s
                else:
                    t += costs.stop_s + costs.repair_wait_s + costs.restart_s
                    repairs += 1
                resume = last_checkpoint(step - 1, kind)
                redone += step - 1 - resume
                step = resume + 1
                if policy.mode == "restart":
                    target = math.ceil((resume + r) / c) * c if c > 0 else resume + r
                    repair_stop = target if target < n else None
                # a new process: a fresh watch
                believed.clear()
                streaks.clear()
                window.clear()
            continue
        if layout != seen_layout:  # renumbered ranks (a live recovery or rejoin): the watch starts over
            believed.clear()
            streaks.clear()
            window.clear()
            seen_layout = layout
        # The step itself, on the layout running now.
        d = costs.step_s[layout]
        d += sum(e.seconds for e in events if e.kind == SLOW and e.factor is None and e.slows(step)
                 and e.rank not in lost)
        slow_now = slow_ranks(step)
        mine = {rk: v for rk, v in believed.items() if rk not in lost}
        if slow_now or mine:
            if layout == FULL:
                stretch = watch.stretch(slow_now, mine)
                rebalanced += 1 if any(v < 1.0 for v in mine.values()) else 0
            else:  # a shrunk layout: the straggler alone sets the pace
                stretch = 1.0 / min([1.0, *slow_now.values()])
            straggler_s += costs.compute_s * (stretch - 1.0)
            d += costs.compute_s * (stretch - 1.0)
        t += d
        executed += 1
        layouts[layout] = layouts.get(layout, 0) + 1
        if layout != FULL:
            degraded_s += d
            degraded_steps += 1
        done.add(step)
        window.append(step)
        if factor_events and watch.every > 0 and step % watch.every == 0:
            judge(step)
        if repair_stop is not None and step == repair_stop:
            t += costs.repair_relaunch_s
            lost, layout, repair_stop = frozenset(), FULL, None
            repairs += 1
        step += 1
    return Replay(policy.name, t, executed, redone, degraded_s, degraded_steps, repairs, layouts,
                  tuple(named), straggler_s, rebalanced)
