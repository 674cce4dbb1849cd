"""TP communication overlapped with compute (`ntp.tp_overlap`) against the serial path, in the same run.

    python bench/tp_overlap.py [--tp 2] [--rounds 12] [--warmup 2] [--model gpt_tiny|llama_tiny]
                               [--modes tp,sp] [--seq 128] [--global-batch 12] [--micro-batch 2]

Per mode (TP `--tp`, then TP `--tp` with sequence parallelism), `--tp` forked gloo processes (one torch
thread each) each assemble the model twice from the same seed, `tp_overlap` off and on
(`runtime.assemble`), and train both through `runtime.step.train_step` (AdamW, clipping at 1.0) on the
same batches, alternating: each round runs one step of each kind, the kind that goes first swapping from
round to round; a barrier precedes every step.  With the option on, each asynchronous collective's
window (from its launch to its `wait()`: the weight gradients computed beside it) and the time its
`wait()` still blocked are summed per step (rank 0's median printed).  A step's wall time is the slowest
rank's; printed: medians over the rounds after `--warmup`, the ratio of the medians on/off (below 1: the
overlap is faster) and the median of each round's ratio (`paired`: the two steps of a round ran next to
each other), each rank's median process CPU per step, and the largest difference of the two kinds' losses
(an exactness check on the side: 0 where the operations are the same, float32 rounding where the order
of a sum differs).
The load average before and after is printed: on a machine with fewer free cores than ranks x 2 (each
rank's compute thread and gloo's communication thread), communication and compute compete for the
same cores and little can be hidden.  The model is the default recipe's (gpt_tiny: 4 layers, hidden 256,
sequence 128, 12 sequences per step in micro-batches of 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ntp_nemo.parallel.sequence as sequence  # noqa: E402
from bench.alternate import alternate, compare  # noqa: E402
from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from tests.shapes import adamw, gpt_tiny, llama_tiny  # noqa: E402

KINDS = ("off", "on")


def _meter_pending() -> dict[str, float]:
    """In this (forked) process: every asynchronous TP collective's window (launch to `wait()`: the
    compute that ran beside it) and the time `wait()` still blocked, summed."""
    meter = {"window": 0.0, "wait": 0.0, "count": 0}
    init, wait = sequence.Pending.__init__, sequence.Pending.wait

    def timed_init(self, *args) -> None:
        init(self, *args)
        self.launched = time.perf_counter()

    def timed_wait(self):
        t = time.perf_counter()
        out = wait(self)
        meter["window"] += t - self.launched
        meter["wait"] += time.perf_counter() - t
        meter["count"] += 1
        return out

    sequence.Pending.__init__, sequence.Pending.wait = timed_init, timed_wait
    return meter


def metered_alternate(states: dict, vocab: int, args: argparse.Namespace, metered: str) -> dict:
    """`bench.alternate.alternate` over `states`, with the asynchronous collectives of kind `metered`'s
    steps after the warm-up metered (`_meter_pending`): their medians per step under `overlap`."""
    meter = _meter_pending()
    overlap: dict[str, list[float]] = {"window": [], "wait": [], "count": []}

    def record(kind: str, step: int) -> None:
        if kind == metered and step >= args.warmup:
            for key in overlap:
                overlap[key].append(meter[key])

    def reset(kind: str) -> None:
        meter.update(window=0.0, wait=0.0, count=0)

    out = alternate(states, vocab, args, 2000, before=reset, after=record)
    return {**out, "overlap": {k: statistics.median(v) for k, v in overlap.items()}}


def worker(rank: int, world: int, args: argparse.Namespace, sp: bool) -> dict:
    torch.set_num_threads(1)
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    layout = ResolvedLayout.make(Topology(world, [world], [world] * (cfg.num_layers + 2)),
                                 num_microbatches=args.global_batch // args.micro_batch, sequence_parallel=sp)
    states = {kind: assemble(layout, rank, cfg, adamw(), "cpu", seed=1234, tp_overlap=kind == "on")
              for kind in KINDS}
    return metered_alternate(states, cfg.vocab_size, args, "on")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default="gpt_tiny", choices=["gpt_tiny", "llama_tiny"])
    ap.add_argument("--modes", default="tp,sp", help="comma-separated: tp (no SP), sp (sequence parallel)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()
    print(f"tp_overlap: {args.model}, TP{args.tp}, {args.global_batch}x{args.seq} tokens per step in "
          f"micro-batches of {args.micro_batch}; gloo, 1 thread per rank; {args.rounds} rounds after "
          f"{args.warmup} warm-up, off/on alternating; load average before: {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    print(f"{'mode':<8} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'paired':>7}   CPU per step per rank, "
          "off -> on (ms)"
          "   losses on vs off")
    for mode in args.modes.split(","):
        res = run_workers(worker, args.tp, args, mode == "sp", timeout_s=600.0)
        med, paired = compare(res, "off", "on")
        cpu = "  ".join(f"r{i} {statistics.median(r['cpu']['off']) * 1e3:.0f} -> "
                        f"{statistics.median(r['cpu']['on']) * 1e3:.0f}" for i, r in enumerate(res))
        same = max(abs(a - b) for a, b in zip(res[0]["losses"]["off"], res[0]["losses"]["on"], strict=True))
        print(f"{mode:<8} {med['off'] * 1e3:>8.1f} {med['on'] * 1e3:>8.1f} {med['on'] / med['off']:>7.3f} "
              f"{paired:>7.3f}   "
              f"{cpu}   max |diff| {same:.1e}", flush=True)
        ov = res[0]["overlap"]
        print(f"         on, rank 0: {int(ov['count'])} asynchronous collectives per step; compute beside "
              f"them {ov['window'] * 1e3:.1f} ms, then still waited for {ov['wait'] * 1e3:.1f} ms",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
