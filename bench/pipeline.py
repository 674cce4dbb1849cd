"""Pipeline schedules measured: bubble fraction, step time and activation memory of GPipe, 1F1B and
interleaved 1F1B.

    python bench/pipeline.py [--pp 2] [--microbatches 1,2,4,8] [--steps 4] [--layers 4] [--hidden 256]
    python bench/pipeline.py --schedules 1f1b,interleaved_1f1b --virtual-stages 2 --layers 8 \
        --microbatches 2,4,8

Runs a GPT-style model split into `--pp` stages (one rank per stage, TP 1, one replica) on gloo and
times real training steps through `PipelineEngine`.  A step starts on all stages together
(barrier) and lasts until the slowest stage finishes.  Per stage: busy time = the summed
forward/backward compute of its actions; idle = the rest of the step (waiting for the neighbour's
activations or gradients, the sends, waiting for the other stages to finish); measured bubble =
mean over stages of idle / step time, compared with the analytical (p - 1) / (m + p - 1), and for
interleaved 1F1B with `v` virtual stages (each stage holds `v` chunks of layers) (p - 1) / (v m + p - 1)
(a bubble of (p - 1) / (v m) of the ideal step).
Activation memory is the peak of the engine's saved-tensor accounting on each stage.  Keep `--pp`
at or below the number of free cores: an oversubscribed core shows up as bubble.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.pipeline.schedule import INTERLEAVED, analytical_bubble, simulate
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.topology import ResolvedLayout, Topology

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import adamw  # noqa: E402

# The optimizer's hyperparameters change nothing this bench measures: its ranks are assembled with these.
OPTIM = adamw(1e-4, weight_decay=0.0)


def bench_worker(rank: int, world: int, cfg: ModelConfig, schedule: str, m: int, mbs: int, seq: int,
                 steps: int, v: int = 1) -> dict:
    topo = Topology(1, [1], [1] * (cfg.num_layers + 2), pp=world)
    layout = ResolvedLayout.make(topo, schedule, virtual_stages=v if schedule == INTERLEAVED else 1)
    state = assemble(layout, rank, cfg, OPTIM, None, seed=0)
    rt, model = state.runtime, state.model
    gen = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, cfg.vocab_size, (mbs, seq + 1), generator=gen) for _ in range(m)]
    rows = []
    for step in range(steps + 1):  # the first step warms up allocators and caches
        torch.distributed.barrier()
        rt.train_microbatches(model, micro, m * mbs * seq)
        model.zero_grad(set_to_none=False)
        if step:
            rows.append((rt.pipeline.trace.step_s, rt.pipeline.trace.busy_s))
    return {"steps": rows, "act_peak": rt.pipeline.meter.peak}


def summarize(results: list[dict]) -> tuple[float, float]:
    """(step time, bubble), medians over steps: a step lasts until its slowest stage finishes (the
    starts are aligned by a barrier); a stage's bubble is the part of that step it was not computing."""
    steps, bubbles = [], []
    for per_rank in zip(*(r["steps"] for r in results), strict=True):
        step = max(s for s, _ in per_rank)
        steps.append(step)
        bubbles.append(1.0 - sum(busy for _, busy in per_rank) / (len(per_rank) * step))
    return statistics.median(steps), statistics.median(bubbles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--virtual-stages", type=int, default=2, help="v of interleaved_1f1b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    cfg = ModelConfig(arch="gpt2", vocab_size=257, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(1, args.hidden // 64), ffn_hidden_size=4 * args.hidden,
                      max_seq_len=args.seq_len, tie_embeddings=True)
    rows = []
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch_size}; pp={args.pp}, TP 1, 1 replica, gloo; "
          f"median of {args.steps} steps; "
          f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    header = ("schedule", "m", "step ms", "bubble", "analytic", "simulated", "act MiB/stage (peak)")
    print(f"{header[0]:<20} {header[1]:>3} {header[2]:>9} {header[3]:>8} {header[4]:>9} {header[5]:>9} "
          f"{header[6]:>24}")
    for m in [int(x) for x in args.microbatches.split(",")]:
        for schedule in args.schedules.split(","):
            v = args.virtual_stages if schedule == INTERLEAVED else 1
            res = run_workers(bench_worker, args.pp, cfg, schedule, m, args.micro_batch_size, args.seq_len,
                              args.steps, v)
            step_s, bubble = summarize(res)
            name = f"{schedule} v={v}" if schedule == INTERLEAVED else schedule
            row = {"schedule": name, "pp": args.pp, "m": m, "step_s": step_s, "bubble": bubble,
                   "analytical_bubble": analytical_bubble(args.pp, m, v),
                   "simulated_bubble": simulate(schedule, args.pp, m, v=v).bubble,
                   "act_peak_bytes": [r["act_peak"] for r in res]}
            rows.append(row)
            acts = ",".join(f"{b / 2**20:.1f}" for b in row["act_peak_bytes"])
            print(f"{name:<20} {m:>3} {row['step_s'] * 1e3:>9.1f} {row['bubble']:>8.3f} "
                  f"{row['analytical_bubble']:>9.3f} {row['simulated_bubble']:>9.3f} {acts:>24}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
