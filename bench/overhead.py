"""Framework overhead: `ntp-train` on one process vs the same training in a plain PyTorch loop.

    python bench/overhead.py [--rounds 3] [--steps 30] [--warmup 5] [--threads 1]

Both sides train the default recipe's model (gpt_tiny) on the same data, global batch, micro-batches,
AdamW and warmup-cosine schedule, from the same initial weights, with the same torch thread count
(OMP_NUM_THREADS in both processes; NTPStrategy sets no thread count for a one-process run, and
Lightning keeps OMP_NUM_THREADS when it is set; each side reports the count it ran with). The ntp-train
side is the real CLI in a subprocess (`mesh.dp=1 mesh.tp=1 ntp.replica_tp=null`), timed by its own
metrics.jsonl `step_time_s`; the plain side (`bench/_common.py`) times the same window. Both run at
once and take turns step by step, so load from other processes falls on both alike. Figures: medians
over the steps after the warm-up of every round, and the median of the per-step ratios (each ntp step
against the plain step next to it in time). The goal is a ratio of at most 1.10.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import (  # noqa: E402
    QUIET,
    SINGLE,
    load_average,
    loss_agreement,
    ntp_side,
    paired_ratio,
    plain_side,
    pooled_median,
    run_side_by_side,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="side-by-side runs")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the figures")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides applied to both sides")
    args = ap.parse_args()
    overrides = [*SINGLE, *QUIET, f"trainer.max_steps={args.steps}", *args.overrides]
    print(
        f"overhead: ntp-train {' '.join(overrides)}  vs  plain loop; {args.rounds} rounds of {args.steps} "
        f"steps taken in turns; threads {args.threads}; load average {load_average()}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"plain": [], "ntp": []}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            sides = [
                plain_side("plain", overrides, args.steps, work, args.threads),
                ntp_side("ntp", overrides, work, 1, args.threads),
            ]
            result = run_side_by_side(sides if r % 2 == 0 else sides[::-1], args.steps, work)
        for name, res in result.items():
            runs[name].append(res)
        pair = ([result["ntp"]], [result["plain"]])
        step_ratio, cpu_ratio = (paired_ratio(*pair, key, args.warmup) for key in ("step_time_s", "cpu_s"))
        print(f"  round {r}: step ratio {step_ratio:.3f}, CPU ratio {cpu_ratio:.3f}", flush=True)
    threads = {res["threads"] for side in runs.values() for res in side}
    if len(threads) != 1:
        raise RuntimeError(f"the two sides ran with different thread counts: {threads}")
    print(
        f"\nresult ({args.rounds} x {args.steps - args.warmup} steps per side, "
        f"{runs['ntp'][0]['records'][0]['tokens']} tokens/step, {threads.pop()} thread(s)); "
        f"load average now {load_average()}"
    )
    print(f"{'':28s} {'plain':>9s} {'ntp-train':>10s} {'ratio of medians':>17s} {'median ratio':>13s}")
    for key, label in (("step_time_s", "step time (step_time_s)"), ("cpu_s", "CPU time per step")):
        plain, ntp = (
            pooled_median(runs["plain"], key, args.warmup),
            pooled_median(runs["ntp"], key, args.warmup),
        )
        ratio = paired_ratio(runs["ntp"], runs["plain"], key, args.warmup)
        print(f"{label:28s} {plain * 1e3:7.1f}ms {ntp * 1e3:8.1f}ms {ntp / plain:17.3f} {ratio:13.3f}")
    print(loss_agreement(runs["ntp"], runs["plain"]) + " (max relative difference, same steps)")
    ratio = paired_ratio(runs["ntp"], runs["plain"], "step_time_s", args.warmup)
    print(f"step-time ratio {ratio:.3f} {'meets' if ratio <= 1.10 else 'misses'} the goal of <= 1.10")


if __name__ == "__main__":
    main()
