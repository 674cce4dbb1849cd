"""A cluster job losing a task, live against restart, rehearsed on this machine (CPU, gloo).

    python bench/cluster_live.py [--steps 40] [--every 4] [--seed 0] [overrides ...]

Both paths start their processes the way the README's batch script does (`ntp_nemo.resilience.rehearsal`:
separate processes with the variables srun gives its tasks; nothing forked by `ntp-train`), layout (2,2),
four tasks; task 3 is killed with `kill -9` from outside when a step drawn from `--seed` has completed.

- live: `ntp-coordinator` and four tasks with `NTP_COORDINATOR` set, no checkpoints
  (`checkpoint.every_n_steps=0`): the survivors reshard from each other's memory and go on;
- restart: four tasks without a coordinator (`fault.recovery` resolves to restart under srun), checkpoints
  every `--every` steps: every task exits, four new processes start with `resume=auto` (what a
  resubmitted job or the batch script's relaunch loop does) and resume from the latest checkpoint.

With `--spares`: the time from the loss to the full layout training again, twice in one invocation: with a
spare task started with the job (its own srun step, `--ntasks=1`: it waits for a place, warm: Lightning,
torch and the model's shapes loaded meanwhile) and with a replacement started only after the loss (what a
batch script's relaunch loop does without spares: it imports and builds everything while the survivors
wait).  Last line: `cluster spares: loss -> full layout, replacement started after the loss X s, spare
waiting Y s: ratio R`.

Per path: caught up = from the kill until the step that was in flight completes again (its last record in
metrics.jsonl), and lost steps = steps executed again, the interrupted one included (live: from the first
step of the new layout, `recovery_done`; restart: from the checkpoint the relaunch resumes from).  Last line:
`cluster live / restart caught-up ratio R`.  On a cluster the restart path also pays the scheduler's
resubmission, thousands of processes importing torch and Lightning, NCCL initialisation and a checkpoint
read from shared storage; here those costs are a few seconds of one machine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from ntp_nemo.resilience.rehearsal import free_port, start_coordinator, start_task

if __package__ in (None, ""):  # run as `python bench/cluster_live.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import QUIET_RUN, TINY_DATA, TINY_MODEL, TINY_OPTIM  # noqa: E402

TINY = [*TINY_MODEL, *TINY_DATA, *TINY_OPTIM, *QUIET_RUN,
        "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]",
        "fault.heartbeat_timeout_s=4", "fault.collective_timeout_s=20", "fault.step_timeout_s=60"]
SECRET = "bench-cluster-live-secret"


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def last_step(run: Path) -> int:
    return max((r["step"] for r in records(run)), default=0)


def wait_step(run: Path, step: int, procs, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while last_step(run) < step:
        if time.time() > deadline or all(p.popen.poll() is not None for p in procs):
            said = "\n".join(p.output[-2000:] for p in procs)
            raise RuntimeError(f"step {step} not reached in {run}:\n{said}")
        time.sleep(0.02)


def caught_up(run: Path, in_flight: int, killed_t: float) -> float:
    """Seconds from the kill to the last completion of step `in_flight`."""
    return max(r["time"] for r in records(run) if r["step"] == in_flight) - killed_t


def live(base: list[str], steps: int, kill_after: int, work: Path) -> tuple[float, int, dict]:
    run = work / "live"
    over = [*base, f"trainer.max_steps={steps}", "checkpoint.every_n_steps=0", f"hydra.run.dir={run}"]
    port = free_port()
    coordinator = start_coordinator(over, port, SECRET, work)
    tasks = [start_task(over, i, 4, port, SECRET, work) for i in range(4)]
    try:
        wait_step(run, kill_after, tasks)
        killed_t = time.time()
        tasks[3].signal(signal.SIGKILL)
        for t in tasks[:3]:
            if t.wait(600) != 0:
                raise RuntimeError(f"{t.name} failed:\n{t.output[-3000:]}")
        coordinator.wait(60)
    finally:
        for p in [coordinator, *tasks]:
            p.kill()
    events = [json.loads(x) for x in (run / "goodput.jsonl").read_text().splitlines()]
    done = [e for e in events if e["event"] == "recovery_done"]
    if not done:
        raise RuntimeError("no live recovery recorded:\n" + tasks[0].output[-3000:])
    # The step the survivors ran first on the new layout; every step before it had completed.
    lost = kill_after + 1 - (int(done[0]["step"]) - 1)
    return caught_up(run, kill_after + 1, killed_t), lost, done[0]


def to_full(base: list[str], steps: int, kill_after: int, work: Path, *, spare: bool) -> tuple[float, float]:
    """(seconds from the kill of task 3 to the rejoin's `recovery_done`, seconds from the kill to the
    replacement's word that it is ready to join): `spare`: the replacement waits from the job's start;
    else it is started right after the kill."""
    run = work / ("spare" if spare else "cold")
    over = [*base, f"trainer.max_steps={steps}", "checkpoint.every_n_steps=0", f"hydra.run.dir={run}"]
    port = free_port()
    coordinator = start_coordinator(over, port, SECRET, work)
    tasks = [start_task(over, i, 4, port, SECRET, work) for i in range(4)]
    extra = []
    try:
        if spare:
            extra.append(start_task(over, 0, 1, port, SECRET, work, step_id=1))
            extra[0].wait_for("this spare is warm", 600)
        wait_step(run, kill_after, tasks)
        killed_t = time.time()
        tasks[3].signal(signal.SIGKILL)
        if not spare:
            extra.append(start_task(over, 0, 1, port, SECRET, work, step_id=1))
        for t in [*tasks[:3], *extra]:
            if t.wait(900) != 0:
                raise RuntimeError(f"{t.name} failed:\n{t.output[-3000:]}")
        coordinator.wait(60)
        ready_t = coordinator.wait_for("rejoin before step", 1)
    finally:
        for p in [coordinator, *tasks, *extra]:
            p.kill()
    events = [json.loads(x) for x in (run / "goodput.jsonl").read_text().splitlines()]
    back = [e for e in events if e["event"] == "recovery_done" and e.get("rejoin")]
    if not back:
        raise RuntimeError(f"the replacement never rejoined in {steps} steps (raise --steps):\n"
                           + coordinator.output[-3000:])
    return back[0]["t"] - killed_t, ready_t - killed_t


def spares(base: list[str], steps: int, kill_after: int, work: Path) -> None:
    cold, cold_ready = to_full(base, steps, kill_after, work, spare=False)
    warm, warm_ready = to_full(base, steps, kill_after, work, spare=True)
    print(f"{'replacement':<28} {'loss -> rejoin announced (s)':>29} {'loss -> full layout (s)':>24}")
    print(f"{'started after the loss':<28} {cold_ready:>29.2f} {cold:>24.2f}")
    print(f"{'spare waiting (warm)':<28} {warm_ready:>29.2f} {warm:>24.2f}")
    print(f"cluster spares: loss -> full layout, replacement started after the loss {cold:.2f} s, spare "
          f"waiting {warm:.2f} s: ratio {cold / warm:.2f}")


def restart(base: list[str], steps: int, kill_after: int, every: int, work: Path) -> tuple[float, int]:
    """(caught up, lost steps): the relaunched job redoes every step after the checkpoint it resumes from."""
    run = work / "restart"
    over = [*base, f"trainer.max_steps={steps}", f"checkpoint.every_n_steps={every}", f"hydra.run.dir={run}"]
    port = free_port()
    tasks = [start_task(over, i, 4, port, SECRET, work, coordinator=False) for i in range(4)]
    try:
        wait_step(run, kill_after, tasks)
        killed_t = time.time()
        tasks[3].signal(signal.SIGKILL)
        for t in tasks[:3]:
            t.wait(600)  # they fail: their peer is gone and no one recovers live
    finally:
        for p in tasks:
            p.kill()
    port = free_port()
    again = [start_task([*over, "resume=auto"], i, 4, port, SECRET, work, coordinator=False, step_id=1)
             for i in range(4)]
    try:
        for t in again:
            if t.wait(900) != 0:
                raise RuntimeError(f"{t.name} failed:\n{t.output[-3000:]}")
    finally:
        for p in again:
            p.kill()
    said = re.search(r"resuming from \S+ \(step (\d+);", again[0].output)
    if said is None:
        raise RuntimeError("the relaunch did not resume:\n" + again[0].output[-3000:])
    return caught_up(run, kill_after + 1, killed_t), kill_after + 1 - int(said.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spares", action="store_true",
                    help="compare a spare waiting with a replacement started after the loss (live only)")
    args, overrides = ap.parse_known_args()
    kill_after = random.Random(args.seed).randint(args.every + 2, args.steps // 2)
    base = [*TINY, *overrides]
    if args.spares:
        print(f"layout (2,2), 4 srun-like tasks, task 3 killed with kill -9 after step {kill_after} of "
              f"{args.steps}; live recovery, then a replacement rejoins", flush=True)
        with tempfile.TemporaryDirectory(prefix="cluster_spares_") as tmp:
            spares(base, args.steps, kill_after, Path(tmp))
        return
    print(f"layout (2,2), 4 srun-like tasks, task 3 killed with kill -9 after step {kill_after} of "
          f"{args.steps}; restart path: checkpoints every {args.every} steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="cluster_live_") as tmp:
        work = Path(tmp)
        live_s, live_lost, done = live(base, args.steps, kill_after, work)
        restart_s, restart_lost = restart(base, args.steps, kill_after, args.every, work)
    print(f"{'path':<8} {'caught up (s)':>14} {'lost steps':>11}")
    print(f"{'live':<8} {live_s:>14.2f} {live_lost:>11d}   (recovery_done: mode {done['mode']}, "
          f"layout {done['layout']}, {done['recovery_s']:.2f} s from detection to resharded)")
    print(f"{'restart':<8} {restart_s:>14.2f} {restart_lost:>11d}")
    print(f"cluster live / restart caught-up ratio {live_s / restart_s:.3f}")


if __name__ == "__main__":
    sys.exit(main())
