"""A seeded fault campaign: random sequences of two or three faults on a short run, each checked against
the invariants the project promises (Jepsen-style; the seed printed so any row replays).

    python bench/fault_campaign.py [--scenarios 30] [--seed 1] [--steps 10] [--only K] [overrides ...]

The job: the real `ntp-train` CLI, 2 DP replicas of TP 2 (4 forked gloo workers) on the tiny model,
checkpoints every 3 steps, tight timeouts (heartbeat 4 s, collective 12 s, step 45 s) so a fault is seen in
seconds. Each scenario draws 2-3 faults from:

- `kill`      kill -9 of a worker at a step (phase: step start, backward or optimizer) — `fault.more`;
- `save-kill` a worker killed while a checkpoint is written (the save never commits);
- `corrupt`   the newest checkpoint at a step damaged on disk (the restore falls back to an older one);
- `hang`      a worker stops making progress (alive, silent) until the heartbeat timeout sees it;
- `slow`      a straggler for a few steps (inside every timeout: nothing may be declared lost);
- `stop`      SIGSTOP of a worker beyond the heartbeat timeout, then SIGCONT (from outside the job);
- `launcher`  kill -9 of the launching process; the scenario then reruns the command with resume=auto;
- `term`      SIGTERM to the launcher (a scheduler's preemption): checkpoint, stop; rerun with resume=auto;
- `rejoin`    the first lost worker is repaired after 2 steps and rejoins (a fault may land during it);
- `wipe`      an outsider on the machine deletes or overwrites every key of the launcher's store (found
  among the launcher's listening ports; the store lists its keys to anyone);
- `damage-all` every checkpoint truncated after the run, then a rerun with resume=auto must stop with
  exit 2 naming them and delete nothing;
- with `--corruption` also `bitflip`: the top exponent bit of one element of a rank's gradient or of the
  activation leaving its first layer, once (`fault.more` kind `bitflip`, `target` grad or activation):
  the integrity watch's per-step check holds the step, which applies no update and is replayed, so the
  curve stays the failure-free one (`docs/integrity.md`).

Invariants checked after every scenario (a row fails when one does not hold):

1. bounded: every command ended by itself within a bound computed from the configured timeouts;
2. exit: every command's exit status is a documented one for what happened (0 for a recovered run or a
   preemption stop, 2 for "no valid checkpoint", 1 only with a stated reason);
3. steps: every step 1..N completed, and its last execution's loss equals the failure-free run's (1e-4);
   a run that stopped with exit 2 because no checkpoint was usable (the scenario damaged them, and every
   one left fails its check) completes only the steps before that stop;
4. checkpoints: every checkpoint left in the run directory verifies (except one the scenario damaged on
   purpose), and none a `damage-all` rerun saw was deleted;
5. goodput: every `failure_detected` in goodput.jsonl is followed by a `recovery_done` or the end of that
   process's job, and the incremental calculator (the running figures) equals the batch one after 50
   evenly spread events and the last (`ntp_nemo.goodput.calculator.disagreement`).

The last line: `fault campaign: N/M scenarios held (seed S)`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import ROOT, TOY_JOB, load_average, thread_env  # noqa: E402

TINY = TOY_JOB
TIMEOUTS = {"heartbeat": 4.0, "collective": 12.0, "step": 45.0}
KINDS = ("kill", "save-kill", "corrupt", "hang", "slow", "stop", "launcher", "term", "rejoin", "wipe",
         "damage-all")
DOCUMENTED_EXITS = {0, 1, 2, 75, 76, 77, 78}


@dataclass
class Scenario:
    index: int
    seed: int
    faults: list[dict]
    overrides: list[str] = field(default_factory=list)
    external: list[dict] = field(default_factory=list)
    damage_all: bool = False

    def describe(self) -> str:
        parts = []
        for f in self.faults + self.external:
            where = f"@{f['step']}" if "step" in f else ""
            who = f" r{f['rank']}" if "rank" in f else ""
            parts.append(f"{f['what']}{who}{where}")
        if self.damage_all:
            parts.append("damage-all")
        return ", ".join(parts)


def draw(index: int, seed: int, steps: int, kinds: tuple[str, ...] = KINDS) -> Scenario:
    """Scenario `index` of campaign `seed`: 2-3 faults at distinct steps, ranks valid for the layout the
    earlier faults leave (a lost rank shrinks the world by one). Redrawn until two faults remain."""
    for attempt in range(100):
        sc = _draw(random.Random((seed * 100003 + index) * 101 + attempt), index, seed, steps, kinds)
        if len(sc.faults) + len(sc.external) + sc.damage_all >= 2:
            return sc
    raise RuntimeError("no scenario with two faults drawn")


def _draw(rng: random.Random, index: int, seed: int, steps: int, pool: tuple[str, ...] = KINDS) -> Scenario:
    count = rng.choice((2, 2, 3))
    kinds = [rng.choice(pool) for _ in range(count)]
    if kinds.count("damage-all") > 1:
        kinds = [k for k in kinds if k != "damage-all"] + ["damage-all"]
    fault_steps = sorted(rng.sample(range(2, steps), k=min(count, steps - 2)))
    sc = Scenario(index, seed, [])
    world = 4
    more: list[dict] = []
    repair_strike = None  # a `rejoin` whose repaired process dies too (kill_rank phase rejoin/joining)
    for kind, step in zip(kinds, fault_steps, strict=False):
        rank = rng.randrange(world)
        if kind == "kill":
            phase = rng.choice(("step_start", "backward", "optimizer"))
            more.append({"kind": "kill_rank", "rank": rank, "step": step, "phase": phase})
            sc.faults.append({"what": f"kill({phase})", "rank": rank, "step": step})
            world -= 1
        elif kind == "save-kill":
            more.append({"kind": "kill_during_save", "rank": rank, "step": step})
            sc.faults.append({"what": "save-kill", "rank": rank, "step": step})
            world -= 1
        elif kind == "corrupt":
            more.append({"kind": "corrupt_checkpoint", "step": max(step, 3)})
            sc.faults.append({"what": "corrupt", "step": max(step, 3)})
        elif kind == "hang":
            more.append({"kind": "hang", "rank": rank, "step": step})
            sc.faults.append({"what": "hang", "rank": rank, "step": step})
            world -= 1
        elif kind == "slow":
            secs = round(rng.uniform(1.0, 3.0), 1)
            more.append({"kind": "slow", "rank": rank, "step": step, "seconds": secs, "steps": 2})
            sc.faults.append({"what": f"slow({secs}s)", "rank": rank, "step": step})
        elif kind in ("stop", "launcher", "term", "wipe"):
            sc.external.append({"what": kind, "step": step, "rank": rank})
        elif kind == "rejoin":
            sc.overrides += ["fault.repair_after_steps=2", "fault.recovery=live"]
            # the repaired process itself may die: before it is ready, or once it is to be taken in
            repair_strike = rng.choice((None, "rejoin", "joining"))
            dies = f"({repair_strike} dies)" if repair_strike else ""
            sc.faults.append({"what": f"rejoin-after-2{dies}"})
        elif kind == "damage-all":
            sc.damage_all = True
        elif kind == "bitflip":
            target = rng.choice(("grad", "activation"))
            more.append({"kind": "bitflip", "rank": rank, "step": step, "target": target, "bit": 30})
            sc.faults.append({"what": f"bitflip({target})", "rank": rank, "step": step})
        if world < 1:
            break
    lost = [f["rank"] for f in more if f["kind"] in ("kill_rank", "hang", "kill_during_save")]
    if repair_strike is not None and lost:  # strikes the first repaired process of the first lost rank
        more.append({"kind": "kill_rank", "rank": lost[0], "step": 1, "phase": repair_strike})
    # Every drawn fault goes in `fault.more` (the `fault` group itself stays `none`).
    if more:
        sc.overrides.append("++fault.more=" + json.dumps(more).replace('"', "").replace(" ", ""))
    if "fault.repair_after_steps=2" in sc.overrides and not any(f["kind"] in ("kill_rank", "hang")
                                                              for f in more):
        sc.overrides = [o for o in sc.overrides
                        if o not in ("fault.repair_after_steps=2", "fault.recovery=live")]
        sc.faults = [f for f in sc.faults if not f["what"].startswith("rejoin-after-2")]
    return sc


def base_job(steps: int, extra: list[str]) -> list[str]:
    return [
        *TINY,
        "mesh.dp=2",
        "mesh.tp=2",
        "ntp.replica_tp=[2,2]",
        f"trainer.max_steps={steps}",
        "checkpoint.every_n_steps=3",
        "checkpoint.keep_last=3",
        "fault=none",
        "fault.max_restarts=6",
        f"fault.heartbeat_timeout_s={TIMEOUTS['heartbeat']}",
        f"fault.collective_timeout_s={TIMEOUTS['collective']}",
        f"fault.step_timeout_s={TIMEOUTS['step']}",
        "seed=7",
        *extra,
    ]


@dataclass
class Result:
    rc: int
    wall: float
    timed_out: bool
    stdout: str
    stderr: str
    killed_by_us: bool = False


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def workers_of(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def launch(args: list[str], run_dir: Path, bound: float, external: list[dict]) -> Result:
    """Run `ntp-train ARGS` in its own session; fire the external faults when their step is reached;
    kill the whole session (and report a time-out) past `bound` seconds."""
    log_out, log_err = run_dir.parent / f"{run_dir.name}.out", run_dir.parent / f"{run_dir.name}.err"
    t0 = time.monotonic()
    # Each command appends to the scenario's logs; its own part starts at these offsets.
    start = {log: log.stat().st_size if log.exists() else 0 for log in (log_out, log_err)}
    with log_out.open("a") as out, log_err.open("a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_nemo.train", *args, f"hydra.run.dir={run_dir}"],
            cwd=run_dir.parent, env=thread_env(1), stdout=out, stderr=err, start_new_session=True,
        )
        pending = sorted(external, key=lambda e: e["step"])
        stopped: tuple[int, float] | None = None
        timed_out = killed = False
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > bound:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            done = max((r.get("step", 0) for r in metrics(run_dir)), default=0)
            if stopped and now >= stopped[1]:
                try:
                    os.kill(stopped[0], signal.SIGCONT)
                except ProcessLookupError:
                    pass
                stopped = None
            if pending and done >= pending[0]["step"] - 1:
                ev = pending.pop(0)
                kids = workers_of(proc.pid)
                if ev["what"] == "launcher":
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = True
                elif ev["what"] == "term":
                    os.kill(proc.pid, signal.SIGTERM)
                elif ev["what"] == "wipe":
                    reached = wipe_store(proc.pid, overwrite=ev["rank"] % 2 == 1)
                    print(f"fault_campaign: {reached} key(s) of the job's store wiped", file=err, flush=True)
                elif ev["what"] == "stop" and kids:
                    victim = kids[ev["rank"] % len(kids)]
                    os.kill(victim, signal.SIGSTOP)
                    stopped = (victim, now + TIMEOUTS["heartbeat"] + 3.0)
            time.sleep(0.2)
        if stopped:
            try:
                os.kill(stopped[0], signal.SIGCONT)
            except ProcessLookupError:
                pass
    # Anything the launcher left behind (a killed launcher's workers stop by themselves: wait, then sweep).
    deadline = time.monotonic() + TIMEOUTS["step"]
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Result(proc.returncode, time.monotonic() - t0, timed_out,
                  _since(log_out, start[log_out]), _since(log_err, start[log_err]), killed)


def _since(path: Path, offset: int) -> str:
    with path.open("rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def wipe_store(launcher: int, overwrite: bool) -> int:
    """Delete (or overwrite) every key of every store the launcher listens on, as any process of the
    machine can (torch's store has no authentication and lists its keys). Returns the keys hit."""
    from datetime import timedelta

    import psutil
    import torch.distributed as dist

    hit = 0
    try:
        conns = psutil.Process(launcher).net_connections(kind="tcp")
    except psutil.Error:
        return 0
    for port in sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}):
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            for key in store.list_keys():
                if overwrite:
                    store.set(key, b"not the job's")
                else:
                    store.delete_key(key)
                hit += 1
        except Exception:  # not a store, or gone already
            continue
    return hit


def checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")) \
        if root.exists() else []


def verify(ckpt: Path) -> str | None:
    from ntp_nemo.checkpoint.storage import verify_all_records

    try:
        return verify_all_records(ckpt)
    except Exception as e:  # a damaged checkpoint is a finding, not a crash of the campaign
        return f"{type(e).__name__}: {e}"


def damage_every_checkpoint(run_dir: Path) -> list[Path]:
    hit = []
    for ckpt in checkpoints(run_dir):
        data = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.stat().st_size > 64
                      and p.suffix not in (".json",))
        if data:
            with data[0].open("r+b") as fh:
                fh.truncate(data[0].stat().st_size // 2)
            hit.append(ckpt)
    return hit


def goodput_pairs(run_dir: Path) -> str | None:
    path = run_dir / "goodput.jsonl"
    if not path.exists():
        return "no goodput.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, e in enumerate(events):
        if e["event"] != "failure_detected":
            continue
        later = events[i + 1:]
        if not any(x["event"] in ("recovery_done", "job_end") for x in later):
            return f"failure_detected at t={e['t']:.1f} has no recovery_done or job_end after it"
    from ntp_nemo.goodput.calculator import disagreement

    differs = disagreement(events)  # the running (incremental) figures equal ntp-goodput's (batch) ones
    return f"goodput: {differs}" if differs else None


def check(sc: Scenario, work: Path, reference: dict[int, float], steps: int,
          bound: float) -> tuple[bool, str]:
    run_dir = work / f"s{sc.index:03d}"
    run_dir.mkdir(parents=True)
    args = base_job(steps, sc.overrides)
    results = [launch(args, run_dir, bound, sc.external)]
    problems: list[str] = []
    # A launcher killed or preempted from outside: the scheduler resubmits with resume=auto.
    resubmits = any(e["what"] in ("launcher", "term") for e in sc.external)
    while resubmits and len(results) < 4:
        last = results[-1]
        if last.timed_out or {r["step"] for r in metrics(run_dir)} >= set(range(1, steps + 1)):
            break
        if not (last.killed_by_us or last.rc in (0, 76, 78)):  # 78: stopped by SIGTERM, saved
            break
        results.append(launch([*args, "resume=auto"], run_dir, bound, []))
    for i, r in enumerate(results):
        if r.timed_out:
            problems.append(f"command {i + 1} still running after {bound:.0f} s (killed)")
        elif r.killed_by_us:
            continue
        elif r.rc not in DOCUMENTED_EXITS:
            problems.append(f"command {i + 1} exit {r.rc} is not documented")
        elif r.rc == 1:
            problems.append(f"command {i + 1} exit 1: {r.stderr.strip().splitlines()[-1:]}")
        if "Traceback (most recent call last)" in r.stderr:
            problems.append(f"command {i + 1} printed a traceback")
    damaged_on_purpose = any(f["what"] == "corrupt" for f in sc.faults)
    bad = [(c.name, why) for c in checkpoints(run_dir) if (why := verify(c))]
    # The documented stop of a run whose every checkpoint is damaged (a relaunch found none usable).
    stopped_unusable = (damaged_on_purpose and len(bad) == len(checkpoints(run_dir))
                        and any(r.rc == 2 and "none is usable" in r.stderr for r in results))
    recs = metrics(run_dir)
    last_loss = {}
    for r in recs:
        last_loss[r["step"]] = r["loss"]
    missing = sorted(set(range(1, steps + 1)) - set(last_loss))
    if missing and not stopped_unusable:
        problems.append(f"steps never completed: {missing}")
    diffs = [abs(last_loss[s] - reference[s]) / abs(reference[s]) for s in reference if s in last_loss]
    worst = max(diffs, default=0.0)
    if worst > 1e-4:
        problems.append(f"loss off the failure-free curve by {worst:.1e}")
    if bad and not damaged_on_purpose:
        problems.append(f"checkpoints that do not verify: {bad}")
    if not checkpoints(run_dir):
        problems.append("no checkpoint left in the run directory")
    if why := goodput_pairs(run_dir):
        problems.append(why)
    if sc.damage_all and not problems:
        before = {c.name for c in damage_every_checkpoint(run_dir)}
        r = launch([*args, "resume=auto"], run_dir, bound, [])
        results.append(r)
        after = {c.name for c in checkpoints(run_dir)}
        if r.timed_out or r.rc != 2:
            problems.append(f"every checkpoint damaged: exit {r.rc} (expected 2)")
        if before - after:
            problems.append(f"damaged checkpoints deleted: {sorted(before - after)}")
        if "Traceback" in r.stderr:
            problems.append("damaged checkpoints: a traceback")
    wall = sum(r.wall for r in results)
    codes = "/".join(str(r.rc) for r in results)
    status = "held" if not problems else "FAILED: " + "; ".join(problems)
    return not problems, f"| {sc.index} | {sc.describe()} | {codes} | {wall:.0f} | {worst:.1e} | {status} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", type=int, action="append", help="run only scenario K (repeatable)")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    ap.add_argument("--corruption", action="store_true",
                    help="also draw silent corruption (a bit flipped in a gradient or an activation)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    print(f"fault campaign: seed {args.seed}, {args.scenarios} scenarios of {args.steps} steps; "
          f"timeouts {TIMEOUTS}; load average {load_average()}; repository {ROOT}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ref_dir = work / "reference"
        ref_dir.mkdir(exist_ok=True)
        t0 = time.monotonic()
        ref = launch(base_job(args.steps, ["checkpoint.every_n_steps=0", *args.overrides]), ref_dir, 900, [])
        if ref.rc != 0:
            sys.exit(f"the failure-free run failed (exit {ref.rc}):\n{ref.stderr}")
        ref_wall = time.monotonic() - t0
        reference = {r["step"]: r["loss"] for r in metrics(ref_dir)}
        # The bound: three failure-free runs' time plus, per fault, the longest wait the timeouts allow
        # (a step timeout, a rendezvous, a relaunch's start-up) — per command of the scenario.
        bound = 3 * ref_wall + 3 * (TIMEOUTS["step"] + TIMEOUTS["collective"] + 60.0)
        print(f"failure-free run: {ref_wall:.0f} s; bound per command {bound:.0f} s\n", flush=True)
        header = ("#", "faults", "exit codes", "wall s", "max rel loss diff", "invariants")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
        held = total = 0
        indices = args.only or range(args.scenarios)
        for i in indices:
            sc = draw(i, args.seed, args.steps, KINDS + (("bitflip",) if args.corruption else ()))
            sc.overrides = [*sc.overrides, *args.overrides]
            ok, row = check(sc, work, reference, args.steps, bound)
            held += ok
            total += 1
            print(row, flush=True)
    print(f"\nfault campaign: {held}/{total} scenarios held (seed {args.seed})")


if __name__ == "__main__":
    main()
