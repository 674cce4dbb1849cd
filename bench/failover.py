"""Failover policies on the same run and the same failure: NTP vs DP-DROP vs restart-with-a-spare.

    python bench/failover.py [--steps 30] [--fail-step 15] [--every 10] [overrides ...]

Each policy trains the same job through the real `ntp-train` CLI: 2 DP replicas of TP 2 (4 processes),
global rank 1 killed hard (exit 137) when step `--fail-step` starts, checkpoints every `--every` steps.
A failure-free run of the same job is the reference for the loss curve and the goodput. Figures, from each
run's goodput.jsonl, metrics.jsonl and the fault marker:

- detection: fault fired -> `failure_detected` (the supervisor saw the exit status);
- recovery: fault fired -> first step completed after it (detection, relaunch, restore, redone step);
- lost steps: completed steps executed again after the restore, plus the step the failure cut short;
- goodput: productive time / job time (ntp_nemo.goodput.compute_goodput), and the badput it paid;
- capacity after: active ranks after the failure / nominal ranks of the job (DP-DROP's dropped replica
  counts as lost capacity); throughput after: tokens/s after recovery relative to before the failure
  (on a shared 2-core CPU box fewer processes are not slower: read this column with that in mind);
- max |loss - reference| / reference over the last execution of every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, load_average, thread_env

from ntp_nemo.goodput import compute_goodput, load_events

POLICIES = ("ntp", "dp_drop", "restart")


def run(overrides: list[str], run_dir: Path) -> None:
    args = [sys.executable, "-m", "ntp_nemo.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        args, cwd=run_dir.parent, env=thread_env(1), capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def figures(run_dir: Path, reference: dict[int, float], nominal_ranks: int) -> dict:
    events = load_events(run_dir)
    rep = compute_goodput(events)
    fired = json.loads(next((run_dir / "failover" / "faults").glob("fired_*.json")).read_text())
    t_fail = fired["t"]
    detected = min(e["t"] for e in events if e["event"] == "failure_detected")
    next_end = min(e["t"] for e in events if e["event"] == "step_end" and e["t"] > t_fail)
    recs = metrics(run_dir)
    before = [r["tokens_per_s"] for r in recs if r["time"] < t_fail][2:]
    after_recs = [r for r in recs if r["time"] > next_end]
    after = [r["tokens_per_s"] for r in after_recs]
    layout_after = after_recs[-1]["layout"]
    active = sum(int(x) for x in layout_after.strip("()").split(","))
    last = {r["step"]: r["loss"] for r in recs}
    return {
        "layout_after": layout_after,
        "detection_s": detected - t_fail,
        "recovery_s": next_end - t_fail,
        "lost_steps": rep.steps_redone + 1,
        "goodput": rep.goodput,
        "wasted_s": rep.badput_s["wasted_progress"],
        "downtime_s": rep.badput_s["recovery_downtime"],
        "restore_s": rep.badput_s["checkpoint_restore"],
        "capacity_after": active / nominal_ranks,
        "throughput_after": statistics.median(after) / statistics.median(before),
        "max_rel_loss_diff": max(abs(last[s] - ref) / abs(ref) for s, ref in reference.items()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fail-step", type=int, default=15)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides for every run")
    args = ap.parse_args()
    job = [
        "mesh.dp=2",
        "mesh.tp=2",
        "ntp.replica_tp=[2,2]",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.every}",
        "data.seq_len=64",
        "trainer.val_every_n_steps=1000000",
        "trainer.progress_bar=false",
        "logger=none",
        "callbacks=none",
        *args.overrides,
    ]
    fault = ["fault=kill_rank", "fault.rank=1", f"fault.step={args.fail_step}"]
    print(
        f"failover: ntp-train {' '.join(job)} {' '.join(fault)} fault.policy=POLICY; "
        f"load average {load_average()}",
        flush=True,
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(job, work / "reference")
        reference = {r["step"]: r["loss"] for r in metrics(work / "reference")}
        base = compute_goodput(load_events(work / "reference"))
        print(f"  failure-free: goodput {base.goodput:.3f}", flush=True)
        for policy in POLICIES:
            run([*job, *fault, f"fault.policy={policy}"], work / policy)
            rows[policy] = figures(work / policy, reference, nominal_ranks=4)
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[policy].items()}
            print(f"  {policy}: {json.dumps(shown)}", flush=True)
    header = (
        "policy",
        "layout after",
        "detect s",
        "recovery s",
        "lost steps",
        "goodput",
        "wasted s",
        "downtime s",
        "capacity after",
        "throughput after",
        "max rel loss diff",
    )
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for policy, r in rows.items():
        print(
            f"| {policy} | {r['layout_after']} | {r['detection_s']:.2f} | {r['recovery_s']:.2f} | "
            f"{r['lost_steps']} | {r['goodput']:.3f} | {r['wasted_s']:.2f} | {r['downtime_s']:.2f} | "
            f"{r['capacity_after']:.2f} | {r['throughput_after']:.2f} | {r['max_rel_loss_diff']:.1e} |"
        )
    print(f"\nreference goodput (no failure): {base.goodput:.3f}; repository: {ROOT}")


if __name__ == "__main__":
    main()
