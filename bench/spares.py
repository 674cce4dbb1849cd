"""Hot spares: the time from a lost process to the full layout training again, without and with
`fault.spares`, on the same job side by side.

    python bench/spares.py [--steps 40] [--losses 12,28] [--repair-after 8] [--spares 1] [overrides ...]

The job is `recipe=failover_demo` (2 DP replicas of TP 2, 4 processes on CPU/gloo) in float64 with
`fault.recovery=live`, no checkpoint, and one process killed hard (exit 137) at each step of `--losses`
(rank 3, then rank 1, ...).  Without spares, `fault.repair_after_steps` steps after each live recovery
the launcher forks a repaired process, which rejoins; with `fault.spares=K`, K processes started with the
job wait initialised, one of them takes the lost process's place at once, and a new spare starts in the
background (the second loss takes that refilled spare).  Figures, from each run's goodput.jsonl and
console:

- loss -> full layout: the survivors' `failure_detected` to the first step started on the full layout
  after the rejoin (`recovery_done` with `rejoin: true`);
- ready after announce: the rejoin's announcement to the launcher's word that the replacement is ready
  (`failover | live: process(es) ... ready to join X s after the rejoin was announced`): a forked
  process's start-up against a spare's hand-over;
- the loss curves of the two runs, which must agree over every step (to `LOSS_RTOL`, in float64: the
  layouts change at other steps, so sums run in another order).

The last line: `spares: loss -> full layout, mean without X s, with Y s: ratio R`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import load_average, thread_env  # noqa: E402

READY = re.compile(r"ready to join ([\d.]+) s after the rejoin was announced")
# In float64 (`trainer.precision=64-true`): the layouts change at other steps in the two runs, so sums run
# in another order, and in float32 failover_demo's loss spikes amplify that rounding past 1e-3 relative
# within 24 steps (measured, in both runs alike); in float64 it stays far below this bound.
LOSS_RTOL = 1e-8
RANKS = (3, 1, 2)  # the process killed at each loss (never 0: the source of the rejoins stays the same)


def job(steps: int, losses: list[int], repair_after: int) -> list[str]:
    more = ",".join(f"{{kind:kill_rank,rank:{RANKS[i % len(RANKS)]},step:{s}}}"
                    for i, s in enumerate(losses[1:], 1))
    return ["recipe=failover_demo", f"trainer.max_steps={steps}", "fault.recovery=live",
            f"fault.rank={RANKS[0]}", f"fault.step={losses[0]}", f"fault.more=[{more}]",
            f"fault.repair_after_steps={repair_after}", "checkpoint.every_n_steps=0",
            "checkpoint.save_on_end=false", "trainer.progress_bar=false", "logger=none", "callbacks=none",
            "trainer.precision=64-true"]


def run(overrides: list[str], run_dir: Path) -> str:
    args = [sys.executable, "-m", "ntp_nemo.cli.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=run_dir.parent, env=thread_env(1), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def figures(run_dir: Path, console: str) -> dict:
    text = (run_dir / "goodput.jsonl").read_text()
    events = [json.loads(line) for line in text.splitlines() if line.strip()]
    back, pending = [], None
    for i, e in enumerate(events):
        if e["event"] == "failure_detected" and pending is None:
            pending = e["t"]
        elif e["event"] == "recovery_done" and e.get("rejoin") and pending is not None:
            start = next(x["t"] for x in events[i:] if x["event"] == "step_start")
            back.append(start - pending)
            pending = None
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" in m and "step" in m:
            losses[m["step"]] = m["loss"]
    degraded = sum(1 for e in events if e["event"] == "step_end" and e.get("capacity", 1.0) < 1.0)
    return {"back": back, "ready": [float(x) for x in READY.findall(console)], "losses": losses,
            "degraded": degraded,
            "spare_lines": [ln for ln in console.splitlines() if "failover | spares:" in ln]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--losses", default="12,28", help="steps at which a process is killed")
    ap.add_argument("--repair-after", type=int, default=8, help="fault.repair_after_steps of both runs")
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    losses = [int(s) for s in args.losses.split(",")]
    base = [*job(args.steps, losses, args.repair_after), *args.overrides]
    print(f"spares: job {' '.join(base)} (load {load_average()})", flush=True)
    out = {}
    with tempfile.TemporaryDirectory(prefix="ntp-spares-") as tmp:
        for name, extra in (("without", []), ("with", [f"fault.spares={args.spares}"])):
            run_dir = Path(tmp) / name
            out[name] = figures(run_dir, run([*base, *extra], run_dir))
    a, b = out["without"], out["with"]
    print("\nthe spare pool (console of the run with spares):")
    for line in b["spare_lines"]:
        print(f"  {line}")
    n = min(len(a["back"]), len(b["back"]))
    print(f"\n{'':32s}{'without spares':>16s}{f'fault.spares={args.spares}':>16s}")
    for i in range(n):
        print(f"{f'loss {i + 1} -> full layout (s)':32s}{a['back'][i]:16.2f}{b['back'][i]:16.2f}")
    for i in range(min(len(a["ready"]), len(b["ready"]))):
        print(f"{f'rejoin {i + 1}: ready after announce (s)':32s}{a['ready'][i]:16.2f}{b['ready'][i]:16.2f}")
    print(f"{'steps on a degraded layout':32s}{a['degraded']:16d}{b['degraded']:16d}")
    worst = max((abs(a["losses"][s] - b["losses"][s]) / abs(a["losses"][s]) for s in a["losses"]
                 if s in b["losses"]), default=float("inf"))
    same = sorted(a["losses"]) == sorted(b["losses"]) == list(range(1, args.steps + 1)) and worst <= LOSS_RTOL
    print(f"loss curves: {len(a['losses'])} and {len(b['losses'])} steps, worst relative difference "
          f"{worst:.1e} ({'equal' if same else 'NOT equal'} within {LOSS_RTOL:g})")
    if n != len(losses) or not same:
        print(f"spares: expected {len(losses)} rejoins in each run, got {len(a['back'])} and {len(b['back'])}"
              if n != len(losses) else "spares: the loss curves differ")
        return 1
    mean_a, mean_b = sum(a["back"][:n]) / n, sum(b["back"][:n]) / n
    print(f"spares: loss -> full layout, mean without {mean_a:.2f} s, with {mean_b:.2f} s: ratio "
          f"{mean_a / mean_b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
