"""Framework overhead: `ntp-train` on one process vs the same training in a plain PyTorch loop.

    python bench/overhead.py [--rounds 4] [--steps 25] [--warmup 5] [--threads 1]

Both sides train the default recipe's model (gpt_tiny) on the same data, global batch, micro-batches,
AdamW and warmup-cosine schedule, from the same initial weights, with the same torch thread count
(OMP_NUM_THREADS in both processes; NTPStrategy sets no thread count for a one-process run, and
Lightning keeps OMP_NUM_THREADS when it is set). The ntp-train side is the real CLI in a subprocess
(`mesh.dp=1 mesh.tp=1 ntp.replica_tp=null`), timed by its own `metrics.jsonl` `step_time_s`; the
plain side (`bench/_common.py`) times the same window. Runs alternate (plain, ntp, ntp, plain, ...)
so drifting load from other processes hits both sides alike; the figures are medians over the steps
after the warm-up of every round. The goal is a ratio of at most 1.10.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import QUIET, SINGLE, load_average, loss_agreement, median, run_ntp_train, run_plain, steady


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="pairs of runs (one per side each round)")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the figures")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides applied to both sides")
    args = ap.parse_args()
    overrides = [*SINGLE, *QUIET, f"trainer.max_steps={args.steps}", *args.overrides]
    print(
        f"overhead: ntp-train {' '.join(overrides)}  vs  plain loop; {args.rounds} rounds, "
        f"threads {args.threads}; load average {load_average()}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"plain": [], "ntp": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for side in ("plain", "ntp") if r % 2 == 0 else ("ntp", "plain"):
                if side == "ntp":
                    res = run_ntp_train(overrides, work / f"ntp-{r}", args.threads)
                else:
                    res = run_plain(overrides, args.steps, args.threads, work)
                res["steady"] = steady(res["records"], args.warmup)
                runs[side].append(res)
                ms = {k: v * 1e3 for k, v in res["steady"].items()}
                print(
                    f"  round {r} {side:5s}: step {ms['step_s']:7.1f} ms  cpu {ms['cpu_s']:7.1f} ms  "
                    f"wall/step {ms['wall_s']:7.1f} ms  (threads {res['threads']})",
                    flush=True,
                )
    threads = {res["threads"] for side in runs.values() for res in side}
    if len(threads) != 1:
        raise RuntimeError(f"the two sides ran with different thread counts: {threads}")
    agreement = loss_agreement(runs["ntp"], runs["plain"])

    def pooled(side: str, key: str) -> float:
        field = {"step_s": "step_time_s", "cpu_s": "cpu_s"}[key]
        return median([rec[field] for res in runs[side] for rec in res["records"][args.warmup :]])

    rows = []
    for key, label in (
        ("step_s", "step time (metrics.jsonl window)"),
        ("cpu_s", "CPU time per step"),
        ("wall_s", "wall time per step, end to end"),
    ):
        if key == "wall_s":
            ntp, plain = (median([res["steady"]["wall_s"] for res in runs[s]]) for s in ("ntp", "plain"))
        else:
            ntp, plain = pooled("ntp", key), pooled("plain", key)
        pairs = zip(runs["ntp"], runs["plain"], strict=True)
        per_round = [a["steady"][key] / b["steady"][key] for a, b in pairs]
        rows.append((label, plain, ntp, ntp / plain, per_round))
    print(
        f"\nresult (medians over {args.rounds} x {args.steps - args.warmup} steps, "
        f"{runs['ntp'][0]['steady']['tokens']} tokens/step, {threads.pop()} thread(s)); "
        f"load average now {load_average()}"
    )
    print(f"{'':34s} {'plain':>9s} {'ntp-train':>10s} {'ratio':>7s}   per-round ratios")
    for label, plain, ntp, ratio, per_round in rows:
        print(
            f"{label:34s} {plain * 1e3:7.1f}ms {ntp * 1e3:8.1f}ms {ratio:7.3f}   "
            + " ".join(f"{x:.3f}" for x in per_round)
        )
    print(agreement + " (max relative difference, same steps)")
    verdict = "meets" if rows[0][3] <= 1.10 else "misses"
    print(f"step-time ratio {rows[0][3]:.3f} {verdict} the goal of <= 1.10")


if __name__ == "__main__":
    main()
