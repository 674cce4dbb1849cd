"""One seeded failure trace replayed under every recovery policy, side by side, and the simulator's
prediction of each policy's time to the last step next to the measured one.

    python bench/failure_trace.py [--steps 200] [--seed 1] [--held-out 2] [--repair-after 30] [--every 10]
                                  [--policies live-ntp,ntp-pw,...] [--keep DIR [--reuse]] [overrides ...]

The job: the real `ntp-train` CLI (`python -m ntp_nemo.train`), the tiny model of the tests, 2 DP
replicas of TP 2 (4 forked gloo workers), global batch 12 in micro-batches of 1 (so that NTP-PW's boost
changes the split), checkpoints every `--every` steps, heartbeat timeout 4 s.  The trace
(`ntp_nemo.goodput.sim.replay.generate_trace`, seeded): a lost rank repaired `--repair-after` steps
later, a hung rank (caught by the heartbeats) repaired likewise, a straggler (a rank computing at 0.4-0.6
of its speed for 25-40 steps, `fault.factor`), and a late lost rank the run ends before repairing.
Policies (rows), all on the same data, seed and layout; every row but `live-rebalance` only reports the
straggler (`fault.straggler=report`):

- `live-ntp`   fault.policy=ntp fault.recovery=live: the survivors reshard in memory, the repaired rank
               rejoins live;
- `live-rebalance` the same with fault.straggler=rebalance: once the watch names the straggler its
               replica gets a batch share by its measured speed, and the even split comes back when the
               device recovers;
- `ntp-pw`     the same with ntp.power_boost=1.3: the degraded replica takes a larger share of the
               micro-batches (on a CPU there is no clock to boost: its ranks simply do more work);
- `ntp-restart` fault.policy=ntp fault.recovery=restart: relaunch on the shrunk layout from the last
               checkpoint, back to the full layout at the first checkpoint boundary after the repair;
- `dp-drop`    fault.policy=dp_drop fault.recovery=live: the whole replica leaves (as torchft does) and
               comes back live when repaired.  Unlike torchft, the project's DP-drop keeps the global
               batch (the remaining replica takes the dropped one's micro-batches);
- `spare`      fault.policy=restart: checkpoint-restart with a spare in the lost GPU's place at once;
- `wait-repair` checkpoint-restart that waits for the repair on the full layout.  No `fault.*` key makes
               a job idle until a repair, so it is run as a scheduler would: fault.max_restarts=0 (a lost
               rank stops the command, exit 1), a wait of the repair's duration (`--repair-after` steps
               of the failure-free run), then the same command again with resume=auto (the faults that
               fired do not fire again).

Per policy: time from the command's start to the end of the last step, goodput
(`ntp_nemo.goodput.compute_goodput`), steps redone, time on a degraded layout, and the largest relative
difference of the loss (last execution of every step) from the failure-free run.  Every policy here keeps
the global batch (tokens per step are checked), so every curve must be the failure-free one.

Then the simulator (`ntp_nemo.goodput.sim.replay`) replays the same trace under each policy with the
per-event costs measured in that policy's run (startup, step time per layout, the slow rank's compute per
step from the steps it slowed before any rebalance, detection per kind, live reshard, rejoin, restart,
repair relaunch) and prints its time to the last step next to the measured one, with the step the watch
named the straggler at and what the straggler cost (measured and predicted). `--held-out SEED` runs every
row on a second seed's trace too (each row on both seeds back to back, so the two meet the same load) and
predicts each seed's times with the costs measured on the other seed's runs (a layout the calibrating run
never trained on takes its mirror image's step time). The rows run one after another, so on a shared
machine their times differ by load as much as by policy: two more lines replay every policy with the same
step times and start-up (the median over the runs), and with each layout's step time from its busiest
rank's work (`rank_work`: a degraded rank as fast as a healthy one). `--keep DIR --reuse` reads the runs
a previous `--keep DIR` left instead of running them. The last line: `failure trace: live NTP time-to-N /
failure-free R0, restart R1, DP-drop R2, wait-for-repair R3` (measured times; restart is NTP by restart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import ROOT, TOY_JOB, load_average, thread_env  # noqa: E402
from ntp_nemo.goodput import compute_goodput
from ntp_nemo.goodput.sim.replay import (
    FULL,
    HANG,
    LOSE,
    SLOW,
    FailureTrace,
    ReplayCosts,
    ReplayPolicy,
    StragglerModel,
    generate_trace,
    replay,
)

# micro-batches of 1: NTP-PW's boost changes the split of the global batch
TINY = [a if not a.startswith("data.micro_batch_size=") else "data.micro_batch_size=1" for a in TOY_JOB]
DP, TP = 2, 2
# Heartbeats catch the hang in seconds; the step timeout stays out of the way of the straggler.
TIMEOUTS = ["fault.heartbeat_timeout_s=4", "fault.collective_timeout_s=30", "fault.step_timeout_s=600"]
POLICIES = {
    "live-ntp": (["fault.policy=ntp", "fault.recovery=live"], "live", "ntp"),
    "live-rebalance": (["fault.policy=ntp", "fault.recovery=live"], "live", "ntp"),
    "ntp-pw": (["fault.policy=ntp", "fault.recovery=live", "ntp.power_boost=1.3"], "live", "ntp"),
    "ntp-restart": (["fault.policy=ntp", "fault.recovery=restart"], "restart", "ntp"),
    "dp-drop": (["fault.policy=dp_drop", "fault.recovery=live"], "live", "dp_drop"),
    "spare": (["fault.policy=restart", "fault.recovery=restart"], "spare", "restart"),
    "wait-repair": (["fault.policy=restart", "fault.recovery=restart", "fault.max_restarts=0"], "wait",
                    "restart"),
}

# What each row does with the trace's straggler (`fault.straggler`): live-rebalance gives its replica a
# batch share by its measured speed; every other row only reports it.
STRAGGLER = {name: "rebalance" if name == "live-rebalance" else "report" for name in POLICIES}
WATCH = (5, 3)  # fault.straggler_every, fault.straggler_persist (the defaults)
MICROBATCHES = 12  # global batch 12 in micro-batches of 1


def split(speeds: tuple[float, ...]) -> list[int]:
    """Micro-batches per replica of the full layout for replica `speeds`, as the job's layout splits them."""
    from ntp_nemo.topology import ResolvedLayout, Topology

    layout = ResolvedLayout.make(Topology(TP, [TP] * DP, [TP] * DP * TP), num_microbatches=MICROBATCHES)
    return layout.with_changes(speeds=speeds).microbatch_counts()


def policy_of(name: str) -> ReplayPolicy:
    """The replay's policy for row `name`: its recovery mode, layouts after losses and straggler watch."""
    _, mode, rule = POLICIES[name]
    watch = StragglerModel(STRAGGLER[name], WATCH[0], WATCH[1], nominal=(MICROBATCHES // DP,) * DP,
                           replica_of=lambda r: r // TP, split=split)
    return ReplayPolicy(name, mode, shrink(rule), watch)


def shrink(rule: str):
    """Layout after losing `lost` (global ranks of the full layout) under `rule`, as
    `ntp_nemo.resilience.policies` re-plans it, written as `ResolvedLayout.describe()` writes it."""

    def layout(lost: frozenset[int]) -> str:
        if not lost or rule == "restart":
            return FULL
        sizes = [TP] * DP
        for r in lost:
            sizes[r // TP] -= 1 if rule == "ntp" else TP
        kept = [max(0, s) for s in sizes if s > 0]
        return "(" + ",".join(str(s) for s in kept) + ")"

    return layout


# ---- running -----------------------------------------------------------------------------------------
@dataclass
class Command:
    start: float
    end: float
    rc: int


@dataclass
class Run:
    name: str
    run_dir: Path
    commands: list[Command] = field(default_factory=list)
    repair_wait_s: float = 0.0


def launch(args: list[str], run_dir: Path, log: Path, timeout: float) -> Command:
    t0 = time.time()
    with log.open("a") as out:
        proc = subprocess.run([sys.executable, "-m", "ntp_nemo.train", *args, f"hydra.run.dir={run_dir}"],
                              cwd=run_dir.parent, env=thread_env(1), stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout)
    return Command(t0, time.time(), proc.returncode)


def run_policy(name: str, job: list[str], trace: FailureTrace, work: Path, repair_wait_s: float,
               timeout: float, reuse: bool = False) -> Run:
    """Run one row (or, with `reuse`, read the one a previous `--keep` run left in `work`)."""
    extra, mode, _ = POLICIES[name] if name in POLICIES else ([], "none", "")
    run_dir = work / name
    log = work / f"{name}.log"
    record = work / f"{name}.commands.json"
    if reuse and record.exists():
        doc = json.loads(record.read_text())
        return Run(name, run_dir, [Command(**c) for c in doc["commands"]], doc["repair_wait_s"])
    faults = trace.fault_overrides() if name != "failure-free" else [
        "fault=none", f"checkpoint.every_n_steps={trace.checkpoint_every}"]
    watch = [f"fault.straggler={STRAGGLER[name]}"] if name in STRAGGLER else []
    args = [*job, *faults, *extra, *watch]
    run = Run(name, run_dir)
    run.commands.append(launch(args, run_dir, log, timeout))
    while mode == "wait" and run.commands[-1].rc != 0 and len(run.commands) <= len(trace.losses()):
        time.sleep(repair_wait_s)  # the repair; then the scheduler starts the job again
        run.repair_wait_s = repair_wait_s
        run.commands.append(launch([*args, "resume=auto"], run_dir, log, timeout))
    record.write_text(json.dumps({"commands": [vars(c) for c in run.commands],
                                  "repair_wait_s": run.repair_wait_s}))
    if run.commands[-1].rc != 0:
        raise RuntimeError(f"{name}: ntp-train exited {run.commands[-1].rc}; see {log}:\n"
                           + log.read_text()[-3000:])
    return run


# ---- reading a run's files ---------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed writer
        if isinstance(doc, dict):
            out.append(doc)
    return out


def fired_faults(run_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (run_dir / "failover" / "faults").glob("fired_*.json")),
                  key=lambda f: f["t"]) if (run_dir / "failover" / "faults").exists() else []


@dataclass
class Measured:
    time_to_last_step_s: float
    goodput: float
    steps_redone: int
    degraded_s: float
    degraded_steps: int
    max_rel_loss_diff: float
    batch_kept: bool
    repairs: int
    costs: ReplayCosts
    layouts: dict[str, int]
    failures: int  # failures detected (the trace's losses and hangs, plus any the recovery caused)
    fallbacks: int  # live recoveries that fell back to the restart path

    work: dict[str, float]  # per layout key: the busiest rank's micro-batches per step (see `rank_work`)
    straggler_named: tuple[int, ...] = ()  # the steps of the run's `straggler` events
    rebalanced_steps: int = 0  # full-layout steps run on a split other than the nominal one
    straggler_s: float = 0.0  # seconds the straggler added to the full-layout steps it slowed or rebalanced


def _mean(xs: list[float], default: float = 0.0) -> float:
    return statistics.fmean(xs) if xs else default


def measure(run: Run, trace: FailureTrace, reference: dict[int, float] | None,
            full_layout: str, boost: float = 1.0) -> Measured:
    """Figures and per-event costs of one run, from its metrics.jsonl, goodput.jsonl, fault markers and
    the commands' start and end times; `boost`: the run's ntp.power_boost."""
    recs = read_jsonl(run.run_dir / "metrics.jsonl")
    events = read_jsonl(run.run_dir / "goodput.jsonl")
    fired = fired_faults(run.run_dir)
    t0 = run.commands[0].start
    last_end = max(r["time"] for r in recs if r["step"] == trace.steps)
    report = compute_goodput(events)
    last_loss = {r["step"]: r["loss"] for r in recs}
    tokens = {r["tokens"] for r in recs}
    diff = max((abs(last_loss[s] - v) / abs(v) for s, v in reference.items()), default=0.0) \
        if reference else 0.0
    # Times where something other than a step happened: a step ending after one is no plain step.
    marks = sorted([f["t"] for f in fired if f["kind"] != "slow"]
                   + [e["t"] for e in events
                      if e["event"] in ("failure_detected", "recovery_done", "job_start")])
    slow = [e for e in trace.events if e.kind == SLOW] if run.name != "failure-free" else []

    def key(r: dict) -> str:
        return FULL if r["layout"] == full_layout else r["layout"]

    full_recs = [tuple(r["microbatches"]) for r in recs if key(r) == FULL]
    nominal = statistics.mode(full_recs) if full_recs else ()

    def plain_split(r: dict) -> bool:  # a full-layout step on the nominal split (not one rebalanced)
        return key(r) != FULL or tuple(r["microbatches"]) == nominal

    periods: dict[str, list[float]] = {}
    slowed_periods: list[tuple[float, float]] = []  # (period, factor) of unmitigated slow full steps
    rejoin_steps: list[float] = []
    prev = None
    for r in recs:
        if prev is not None and r["step"] == prev["step"] + 1:
            between = [m for m in marks if prev["time"] < m <= r["time"]]
            slowed = [e for e in slow if e.slows(r["step"])]
            if not between and not slowed and plain_split(r):
                periods.setdefault(key(r), []).append(r["time"] - prev["time"])
            elif not between and slowed and key(r) == FULL and plain_split(r) and slowed[0].factor:
                slowed_periods.append((r["time"] - prev["time"], slowed[0].factor))
        prev = r
    step_s = {k: _mean(v) for k, v in periods.items()}
    # What the straggler cost: the full-layout steps it slowed or that ran on a split by speed, beyond a
    # plain full step (steps with a recovery or a failure inside are left out, as above).
    straggler_s = 0.0
    prev = None
    for r in recs:
        if prev is not None and r["step"] == prev["step"] + 1 and key(r) == FULL:
            between = [m for m in marks if prev["time"] < m <= r["time"]]
            if not between and (any(e.slows(r["step"]) for e in slow) or not plain_split(r)):
                straggler_s += r["time"] - prev["time"] - step_s.get(FULL, 0.0)
        prev = r
    # A slow device's compute: an unmitigated slow step takes compute_s * (1/factor - 1) more.
    compute = [(d - step_s.get(FULL, 0.0)) / (1 / f - 1) for d, f in slowed_periods]
    # Detection: fault fired -> the next failure_detected.
    detect: dict[str, list[float]] = {}
    detected = [e for e in events if e["event"] == "failure_detected"]
    for f in fired:
        if f["kind"] == "slow":
            continue
        after = [e["t"] for e in detected if e["t"] >= f["t"] - 0.5]
        if after:
            detect.setdefault(LOSE if f["kind"] == "kill_rank" else HANG, []).append(min(after) - f["t"])
    reshard, restart, relaunch, stop = [], [], [], []
    starts = [e for e in events if e["event"] == "step_start"]
    for d in detected:
        done = [e for e in events
                if e["event"] == "recovery_done" and e["t"] >= d["t"] and not e.get("rejoin")]
        if done and done[0].get("mode") == "live":
            reshard.append(done[0]["t"] - d["t"])
        else:
            nxt = [s["t"] for s in starts if s["t"] > d["t"]]
            ended = [c.end for c in run.commands if c.end >= d["t"]]
            if len(run.commands) > 1 and ended:  # wait mode: the command stops; the next one starts
                stop.append(min(ended) - d["t"])
                later = [c for c in run.commands if c.start > d["t"]]
                if later and nxt:
                    restart.append(min(nxt) - later[0].start)
            elif nxt:
                restart.append(min(nxt) - d["t"])
    # Live rejoin: the step it runs at, beyond a full-layout step.
    for e in events:
        if e["event"] == "recovery_done" and e.get("rejoin"):
            at = [r for r in recs if r["time"] >= e["t"]]
            before = [r for r in recs if r["time"] < e["t"]]
            if at and before:
                rejoin_steps.append(at[0]["time"] - before[-1]["time"] - step_s.get(FULL, 0.0))
    # Restart path repair: the degraded attempt's last step -> the first step on the repaired layout.
    attempts = read_jsonl(run.run_dir / "failover" / "attempts.jsonl")
    for a in attempts:
        if a.get("outcome") == "repair_stop" and a.get("end_t"):
            end = [r["time"] for r in recs if r["step"] == a["stop_at_step"] and r["time"] <= a["end_t"] + 1]
            nxt = [s["t"] for s in starts if s["t"] > a["end_t"]]
            if end and nxt:
                relaunch.append(min(nxt) - max(end))
    first_start = min(s["t"] for s in starts)
    saves = {(e["pid"], e.get("step")): e["t"] for e in events if e["event"] == "ckpt_save_start"}
    commits = [e["t"] - saves[e["pid"], e.get("step")] for e in events
               if e["event"] == "ckpt_commit" and (e["pid"], e.get("step")) in saves]
    costs = ReplayCosts(
        step_s=step_s,
        startup_s=first_start - t0,
        detect_s={k: _mean(v) for k, v in detect.items()},
        reshard_s=_mean(reshard),
        rejoin_s=_mean(rejoin_steps),
        restart_s=_mean(restart),
        repair_relaunch_s=_mean(relaunch),
        stop_s=_mean(stop),
        repair_wait_s=run.repair_wait_s,
        commit_s=_mean(commits),
        compute_s=_mean(compute),
    )
    degraded = [r for r in recs if key(r) != FULL]
    layouts: dict[str, int] = {}
    for r in recs:
        layouts[key(r)] = layouts.get(key(r), 0) + 1
    repairs = sum(1 for e in events if e["event"] == "recovery_done" and e.get("rejoin")) + \
        sum(1 for a in attempts if a.get("reason") == "repair") + max(0, len(run.commands) - 1)
    return Measured(
        time_to_last_step_s=last_end - t0,
        goodput=report.goodput,
        steps_redone=report.steps_redone,
        degraded_s=sum(r["step_time_s"] for r in degraded),
        degraded_steps=len(degraded),
        max_rel_loss_diff=diff,
        batch_kept=len(tokens) == 1,
        repairs=repairs,
        costs=costs,
        layouts=layouts,
        work={key(r): rank_work(r["layout"], r["microbatches"], boost) for r in recs},
        failures=len(detected),
        fallbacks=sum(1 for e in events if e["event"] == "recovery_done" and e.get("mode") == "restart"
                      and any(d.get("detail") == "live recovery" for d in detected)),
        straggler_named=tuple(e["step"] for e in events if e["event"] == "straggler"),
        rebalanced_steps=sum(1 for r in recs if not plain_split(r)),
        straggler_s=straggler_s,
    )


# ---- printing ----------------------------------------------------------------------------------------
def table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def costs_row(name: str, c: ReplayCosts) -> tuple:
    steps = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c.step_s.items()))
    det = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.detect_s.items())) or "-"

    def s(v: float) -> str:
        return f"{v:.2f}" if v else "-"

    return (name, f"{c.startup_s:.2f}", steps, s(c.compute_s), det, s(c.reshard_s), s(c.rejoin_s),
            s(c.restart_s), s(c.repair_relaunch_s), s(c.stop_s), s(c.repair_wait_s))


def rank_work(layout: str, microbatches: list[int], boost: float) -> float:
    """Micro-batches per step of the busiest rank of `layout` (e.g. `(1,2)`) splitting `microbatches`
    over its replicas: a replica of `n` ranks shares its micro-batches `n` ways (the tensor-parallel
    split), and a boosted degraded replica's ranks run `boost` times as fast (NTP-PW)."""
    sizes = [int(x) for x in layout.strip("()").split(",")]
    return max(mb / (n * (boost if n < TP else 1.0)) for mb, n in zip(microbatches, sizes, strict=True))


def at_common_load(trace: FailureTrace, measured: dict[str, Measured], names: list[str],
                   by_work: bool = False) -> dict[str, float]:
    """Each policy's time to the last step replayed with the step time of every layout and the start-up
    taken as the median over all runs (the runs ran one after another on a shared machine whose load
    changed), and its own event costs: the comparison at one load.  `by_work`: every layout's step time
    is instead the full layout's scaled by its busiest rank's work (`rank_work`): what a machine whose
    ranks do not share cores would give (on 2 shared cores, fewer processes run each step faster)."""
    by_layout: dict[str, list[float]] = {}
    for m in measured.values():
        for k, v in m.costs.step_s.items():
            by_layout.setdefault(k, []).append(v)
    step_s = {k: statistics.median(v) for k, v in by_layout.items()}
    startup = statistics.median(m.costs.startup_s for m in measured.values())
    out = {"failure-free": startup + trace.steps * step_s[FULL]}
    for name in names:
        steps = step_s
        if by_work:
            work = measured[name].work
            steps = {k: step_s[FULL] * w / work[FULL] for k, w in work.items()}
        costs = replace(measured[name].costs, step_s=steps, startup_s=startup)
        out[name] = replay(trace, policy_of(name), costs).time_to_last_step_s
    return out


def summary_line(steps: int, times: dict[str, float]) -> str:
    live = times["live-ntp"]

    def ratio(k: str) -> str:
        return f"{live / times[k]:.2f}" if k in times else "n/a"

    return (f"failure trace: live NTP time-to-{steps} / failure-free {ratio('failure-free')}, restart "
            f"{ratio('ntp-restart')}, DP-drop {ratio('dp-drop')}, wait-for-repair {ratio('wait-repair')}")


def for_trace(costs: ReplayCosts) -> ReplayCosts:
    """One run's costs made usable on another trace: a shrunk layout the run never trained on takes the
    step time of its mirror image ((1,2) for (2,1)) or, without one, of the known layouts with as many
    ranks (else the full layout's)."""
    step_s = dict(costs.step_s)
    keys = {"(1,2)", "(2,1)", "(1,1)", "(2)"}
    for k in sorted(keys - set(step_s)):
        sizes = k.strip("()").split(",")
        mirror = "(" + ",".join(reversed(sizes)) + ")"
        same = [v for q, v in costs.step_s.items() if q != FULL and sum(map(int, q.strip("()").split(",")))
                == sum(map(int, sizes))]
        step_s[k] = step_s.get(mirror) or (statistics.fmean(same) if same else costs.step_s[FULL])
    return replace(costs, step_s=step_s)


@dataclass
class Seed:
    """One seed's trace, job and failure-free reference, and the rows run on it so far."""

    seed: int
    trace: FailureTrace
    job: list[str]
    work: Path
    reference: dict[int, float] = field(default_factory=dict)
    repair_wait: float = 0.0
    measured: dict[str, Measured] = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)


FULL_LAYOUT = f"({TP},{TP})"


def start_seed(seed: int, args: argparse.Namespace, root: Path) -> Seed:
    """Seed `seed`'s trace (job seed `seed` too) and its failure-free run."""
    trace = generate_trace(seed, args.steps, DP * TP, args.repair_after, args.every)
    job = [*TINY, f"mesh.dp={DP}", f"mesh.tp={TP}", f"ntp.replica_tp=[{TP},{TP}]",
           f"trainer.max_steps={args.steps}", f"seed={seed}", *TIMEOUTS, *args.overrides]
    print(f"failure trace (seed {seed}, {args.steps} steps, checkpoints every {args.every}, repair "
          f"after {args.repair_after} steps): {trace.describe()}", flush=True)
    print(f"job: ntp-train {' '.join(job)} {' '.join(trace.fault_overrides())} POLICY "
          f"fault.straggler=report|rebalance; load average {load_average()}; repository {ROOT}", flush=True)
    sd = Seed(seed, trace, job, root / f"seed{seed}")
    sd.work.mkdir(parents=True, exist_ok=True)
    ref_run = run_policy("failure-free", job, trace, sd.work, 0.0, args.timeout, args.reuse)
    sd.reference = {r["step"]: r["loss"] for r in read_jsonl(ref_run.run_dir / "metrics.jsonl")}
    sd.measured["failure-free"] = measure(ref_run, trace, None, FULL_LAYOUT)
    full_step = sd.measured["failure-free"].costs.step_s[FULL]
    sd.repair_wait = args.repair_after * full_step
    print(f"  failure-free: {sd.measured['failure-free'].time_to_last_step_s:.1f} s to step {args.steps} "
          f"({full_step:.3f} s/step); a repair takes {args.repair_after} steps = {sd.repair_wait:.1f} s",
          flush=True)
    return sd


def run_row(sd: Seed, name: str, args: argparse.Namespace) -> None:
    run = run_policy(name, sd.job, sd.trace, sd.work, sd.repair_wait, args.timeout, args.reuse)
    boost = next((float(o.split("=")[1]) for o in POLICIES[name][0]
                  if o.startswith("ntp.power_boost=")), 1.0)
    m = sd.measured[name] = measure(run, sd.trace, sd.reference, FULL_LAYOUT, boost)
    sd.predicted[name] = replay(sd.trace, policy_of(name), m.costs)
    print(f"  seed {sd.seed} {name}: {m.time_to_last_step_s:.1f} s measured, "
          f"{sd.predicted[name].time_to_last_step_s:.1f} s predicted; load average {load_average()}",
          flush=True)


def report_seed(sd: Seed, args: argparse.Namespace, names: list[str]) -> None:
    """Seed `sd`'s table: each row measured and replayed with its own measured costs."""
    trace, measured, predicted = sd.trace, sd.measured, sd.predicted
    print(f"\n## seed {sd.seed}: {trace.describe()}")
    rows = []
    expected = len(trace.losses())
    for name, m in measured.items():
        p = predicted.get(name)
        notes = []
        if name != "failure-free" and m.failures != expected:
            notes.append(f"{m.failures} failures detected for the trace's {expected}")
        if m.fallbacks:
            notes.append(f"{m.fallbacks} live recovery(ies) fell back to a restart")
        if name != "failure-free" and m.max_rel_loss_diff > 1e-4:
            notes.append("loss OFF the failure-free curve (> 1e-4)")
        named = f"{m.straggler_named[0]}" if m.straggler_named else "-"
        rows.append((
            name, f"{m.time_to_last_step_s:.1f}",
            f"{p.time_to_last_step_s:.1f}" if p else "-",
            f"{p.time_to_last_step_s / m.time_to_last_step_s:.3f}" if p else "-", f"{m.goodput:.3f}",
            f"{m.steps_redone}" + (f" ({p.steps_redone})" if p else ""),
            f"{m.degraded_s:.1f} s / {m.degraded_steps}" + (f" ({p.degraded_steps})" if p else ""),
            f"{m.repairs}" + (f" ({p.repairs})" if p else ""),
            named + (f" ({p.straggler_named[0] if p.straggler_named else '-'})" if p else ""),
            f"{m.straggler_s:.1f} s / {m.rebalanced_steps}" + (f" ({p.straggler_s:.1f} s / "
                                                               f"{p.rebalanced_steps})" if p else ""),
            f"{m.max_rel_loss_diff:.1e}" if name != "failure-free" else "-",
            "yes" if m.batch_kept else "NO", "; ".join(notes) or "-",
        ))
    print("\n" + table(("policy", f"time to step {args.steps} s", "predicted s",
                        "predicted / measured",
                        "goodput", "steps redone (pred.)", "degraded time / steps (pred. steps)",
                        "repairs (pred.)", "straggler named at step (pred.)",
                        "straggler cost / rebalanced steps (pred.)", "max rel loss diff",
                        "global batch kept", "notes"), rows))
    print("\nmeasured per-event costs fed to the simulator (s):\n" + table(
        ("policy", "startup", "step per layout", "slow rank's compute", "detect", "reshard", "rejoin",
         "restart", "repair relaunch", "stop", "repair wait"),
        [costs_row(n, m.costs) for n, m in measured.items()]))
    worst = max(abs(p.time_to_last_step_s / measured[n].time_to_last_step_s - 1)
                for n, p in predicted.items())
    print(f"\nsimulator: every policy's time to step {args.steps} predicted within {worst * 100:.1f}% "
          f"({'inside' if worst <= 0.10 else 'OUTSIDE'} the 10% bound); load average {load_average()}")
    if "live-rebalance" in measured and "live-ntp" in measured:
        a, b = measured["live-ntp"], measured["live-rebalance"]
        pa, pb = predicted["live-ntp"], predicted["live-rebalance"]
        print(f"straggler ({next(e.describe() for e in trace.events if e.kind == SLOW)}): it cost live NTP "
              f"{a.straggler_s:.1f} s reported (predicted {pa.straggler_s:.1f} s) and {b.straggler_s:.1f} s "
              f"rebalanced (predicted {pb.straggler_s:.1f} s): rebalance saves "
              f"{a.straggler_s - b.straggler_s:.1f} s (predicted {pa.straggler_s - pb.straggler_s:.1f} s); "
              f"time to step {args.steps} "
              f"{a.time_to_last_step_s:.1f} s against {b.time_to_last_step_s:.1f} s (rows run one after "
              "another: load moves these)")
    common = at_common_load(trace, measured, names)
    print("simulator at one load (every policy's step times and start-up the median over the runs, its "
          "event costs its own): " + summary_line(args.steps, common).split(": ", 1)[1])
    ideal = at_common_load(trace, measured, names, by_work=True)
    print("simulator at one load, each layout's step time from its busiest rank's work (a degraded rank "
          "as fast as a healthy one, as on GPUs): " + summary_line(args.steps, ideal).split(": ", 1)[1])
    print(summary_line(args.steps, {n: m.time_to_last_step_s for n, m in measured.items()}))


def held_out(seeds: list[int], traces: dict, measured: dict, names: list[str], steps: int) -> float:
    """Each seed's trace replayed with another seed's measured costs (per row, the same row's), next to
    what the seed's own runs measured; the worst relative gap."""
    rows, worst, events_worst = [], 0.0, 0.0
    for name in names:
        for a in seeds:
            for b in seeds:
                if a == b:
                    continue
                # the repair's wait is the scheduler's (this bench's) choice for the run, not a cost
                costs = replace(for_trace(measured[a][name].costs),
                                repair_wait_s=measured[b][name].costs.repair_wait_s)
                p = replay(traces[b], policy_of(name), costs)
                m = measured[b][name].time_to_last_step_s
                gap = p.time_to_last_step_s / m - 1
                worst = max(worst, abs(gap))
                # the load's share of the gap: the same, with the predicted run's own step times and start-up
                own = measured[b][name].costs
                step_times = {**costs.step_s, **own.step_s}
                q = replay(traces[b], policy_of(name),
                           replace(costs, step_s=step_times, startup_s=own.startup_s))
                events_worst = max(events_worst, abs(q.time_to_last_step_s / m - 1))
                rows.append((name, a, b, f"{m:.1f}", f"{p.time_to_last_step_s:.1f}",
                             f"{p.time_to_last_step_s / m:.3f}", f"{q.time_to_last_step_s / m:.3f}",
                             f"{measured[b][name].straggler_s:.1f} ({p.straggler_s:.1f})"))
    print("\nheld out: each seed's trace predicted with the costs measured on the other seed's trace\n"
          + table(("policy", "calibrated on seed", "predicts seed", f"measured time to step {steps} s",
                   "predicted s", "predicted / measured",
                   "predicted / measured, the run's own step times and start-up", "straggler cost s (pred.)"),
                  rows))
    print(f"held out: every policy predicted within {worst * 100:.1f}% "
          f"({'inside' if worst <= 0.10 else 'OUTSIDE'} the 10% bound); with each run's own step times and "
          f"start-up (the other seed's event costs: detection, reshard, rejoin, restart, the slow rank's "
          f"compute) within {events_worst * 100:.1f}%")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--held-out", type=int, default=None, metavar="SEED",
                    help="also run every row on this seed's trace, and predict each seed's times with the "
                         "costs measured on the other's")
    ap.add_argument("--repair-after", type=int, default=30, help="fault.repair_after_steps")
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated rows to run")
    ap.add_argument("--keep", type=Path, help="keep the run directories here (one folder per seed)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: read the runs a previous run left there instead of running them again")
    ap.add_argument("--timeout", type=float, default=1800.0, help="bound on each ntp-train command (s)")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides for every run")
    args = ap.parse_args()
    names = [p for p in args.policies.split(",") if p]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or "live-ntp" not in names:
        sys.exit(f"--policies: {unknown or 'live-ntp missing'}; choose from {', '.join(POLICIES)} "
                 "(live-ntp is required: the last line compares against it)")
    seeds = [args.seed]
    if args.held_out is not None and args.held_out != args.seed:
        seeds.append(args.held_out)
    try:
        for seed in seeds:
            generate_trace(seed, args.steps, DP * TP, args.repair_after, args.every)
    except ValueError as err:
        sys.exit(f"--steps: {err}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        runs = [start_seed(seed, args, root) for seed in seeds]
        for name in names:  # one row on every seed back to back: the machine's load alike for both
            for sd in runs:
                run_row(sd, name, args)
    for sd in runs:
        report_seed(sd, args, names)
    if len(runs) > 1:
        held_out(seeds, {sd.seed: sd.trace for sd in runs}, {sd.seed: sd.measured for sd in runs}, names,
                 args.steps)

if __name__ == "__main__":
    main()
