"""Gradient sync overlapped with the backward, measured against the blocking sync in the same run.

    python bench/overlap.py [--layers 4] [--hidden 512] [--seq-len 64] [--microbatches 2] [--bucket-mb 4]

Layouts DP 2 x TP 1 and replicas (2, 1) on gloo (one process per rank, one thread each).  Per layout
and per step (a barrier aligns the ranks' starts, median over `--steps` steps after one warm-up step):

- compute: forward/backward of this replica's micro-batches, no sync;
- sync alone: the blocking bucketed DP sync of the gradients just computed, timed by itself;
- blocking step: forward/backward, then the blocking sync (`GradientSynchronizer.sync`);
- overlapped step: forward/backward with the buckets launched from the post-accumulate-grad hooks
  (`OverlappedGradSync`), then `finish()` (wait for the rest);
- hidden = (blocking step - overlapped step) / sync alone: the part of the sync time the overlap hides;
- lead: how long before the end of the backward the first bucket was launched (median over steps,
  smallest over ranks): the window in which communication can run beside compute.

A step's time is the slowest rank's.  Each rank runs on one thread, and gloo's communication runs
on its own threads: with fewer free cores than ranks x 2, communication and compute compete for
the same cores and little can be hidden; the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.overlap import OverlappedGradSync
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.topology import ResolvedLayout, Topology

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import adamw  # noqa: E402

# The optimizer's hyperparameters change nothing this bench measures: its ranks are assembled with these.
OPTIM = adamw(1e-4, weight_decay=0.0)


def overlap_worker(rank: int, world: int, cfg: ModelConfig, replica_tp: list[int], m: int, mbs: int, seq: int,
                   bucket_mb: float, steps: int) -> dict:
    tp = max(replica_tp)
    layout = ResolvedLayout.make(Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2)))
    state = assemble(layout, rank, cfg, OPTIM, None, seed=0, bucket_mb=bucket_mb)
    rt, model, sync = state.runtime, state.model, state.grad_path.sync
    ov = OverlappedGradSync(model, sync.plan, sync.group_of, sync.bucket_bytes)
    gen = torch.Generator().manual_seed(0)
    total_mb = m * len(replica_tp)
    toks = torch.randint(0, cfg.vocab_size, (total_mb * mbs, seq + 1), generator=gen)
    micro = [toks[i * mbs : (i + 1) * mbs] for i in rt.my_microbatches(total_mb)]
    global_tokens = toks[:, 1:].numel()
    rows: dict[str, list[float]] = {"compute": [], "sync": [], "blocking": [], "overlapped": []}
    launched, lead = [], []
    for step in range(steps + 1):
        for kind in ("compute", "blocking", "overlapped"):
            model.zero_grad(set_to_none=False)
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "overlapped":
                ov.begin_step(len(micro))
            rt.train_microbatches(model, micro, global_tokens)
            if kind == "blocking":
                sync.sync()
            elif kind == "overlapped":
                launched.append(ov.launched_in_backward)
                if step:  # how long before the backward's end the first bucket was launched
                    lead.append(time.perf_counter() - min(ov.launch_times, default=time.perf_counter()))
                ov.finish()
            elapsed = time.perf_counter() - t0
            if kind == "compute":
                dist.barrier()
                t1 = time.perf_counter()
                sync.sync()
                if step:
                    rows["sync"].append(time.perf_counter() - t1)
            if step:
                rows[kind].append(elapsed)
    ov.remove()
    return {"rows": rows, "buckets": len(ov.buckets), "launched_in_backward": min(launched),
            "lead_s": statistics.median(lead) if lead else 0.0,
            "grad_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}


def summarize(results: list[dict]) -> dict[str, float]:
    """Per kind: median over steps of the slowest rank's time."""
    out = {}
    for kind in results[0]["rows"]:
        per_step = zip(*(r["rows"][kind] for r in results), strict=True)
        out[kind] = statistics.median(max(ts) for ts in per_step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2, help="per replica of full TP")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    cfg = ModelConfig(arch="gpt2", vocab_size=257, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(1, args.hidden // 64), ffn_hidden_size=4 * args.hidden,
                      max_seq_len=args.seq_len, tie_embeddings=True)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch_size}, {args.microbatches} micro-batches per replica, "
          f"buckets {args.bucket_mb} MiB; "
          f"gloo, 1 thread per rank; median of {args.steps} steps; load average before: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    header = ("layout", "compute ms", "sync ms", "blocking ms", "overlap ms", "hidden", "in bwd/buckets",
              "lead ms")
    print(f"{header[0]:<14} {header[1]:>10} {header[2]:>8} {header[3]:>11} {header[4]:>10} {header[5]:>7} "
          f"{header[6]:>15} {header[7]:>8}")
    out = []
    for name, replica_tp in (("DP2 x TP1", [1, 1]), ("replicas (2,1)", [2, 1])):
        res = run_workers(overlap_worker, sum(replica_tp), cfg, replica_tp, args.microbatches,
                          args.micro_batch_size, args.seq_len, args.bucket_mb, args.steps)
        t = summarize(res)
        hidden = (t["blocking"] - t["overlapped"]) / t["sync"] if t["sync"] > 0 else 0.0
        # over all ranks: buckets launched from the backward's hooks (fewest over the steps) / buckets
        buckets = f"{sum(r['launched_in_backward'] for r in res)}/{sum(r['buckets'] for r in res)}"
        lead = min(r["lead_s"] for r in res)
        row = {"layout": name, **{k + "_s": v for k, v in t.items()}, "hidden_fraction": hidden,
               "buckets": buckets, "lead_s": lead}
        out.append(row)
        print(f"{name:<14} {t['compute'] * 1e3:>10.1f} {t['sync'] * 1e3:>8.1f} {t['blocking'] * 1e3:>11.1f} "
              f"{t['overlapped'] * 1e3:>10.1f} {hidden:>7.2f} {buckets:>15} {lead * 1e3:>8.1f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
