"""Domino-style chunks (`ntp.tp_chunks`) against the unchunked step, in the same run.

    python bench/tp_chunks.py [--tp 2] [--chunks 2] [--rounds 12] [--warmup 2] [--model gpt_tiny|llama_tiny]
                              [--modes tp,sp] [--backends gloo,ntpdirect] [--seq 128] [--global-batch 12]
                              [--micro-batch 2]

Per TP-group backend (gloo: asynchronous collectives run on gloo's thread while the caller computes;
ntpdirect, the CPU default: a collective is done when its call returns) and mode (TP `--tp`, then with
sequence parallelism), `--tp` forked processes (one torch thread each) each assemble the model twice from
the same seed, unchunked and in `--chunks` chunks (`runtime.assemble(tp_chunks=...)`), and train both
through `runtime.step.train_step` (AdamW, clipping at 1.0) on the same batches, alternating: each round
runs one step of each kind, the kind that goes first swapping from round to round; a barrier precedes
every step.  With chunks, each asynchronous exit's window (from its launch to its `wait()`: the other
chunk's compute beside it) and the time its `wait()` still blocked are summed per step (rank 0's median).
A step's wall time is the slowest rank's; printed: medians over the rounds after `--warmup`, the ratio of
the medians chunked/unchunked (below 1: chunks are faster), the median of each round's ratio (`paired`),
each rank's median process CPU per step, and the largest difference of the two kinds' losses.  The model
is the default recipe's (gpt_tiny: 4 layers, hidden 256, sequence 128, 12 sequences per step in
micro-batches of 2, so 2 chunks of one sequence each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.alternate import compare  # noqa: E402
from bench.tp_overlap import metered_alternate  # noqa: E402
from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from ntp_nemo.topology.groups import CPU_TP_BACKEND_ENV  # noqa: E402
from tests.shapes import adamw, gpt_tiny, llama_tiny  # noqa: E402


def worker(rank: int, world: int, args: argparse.Namespace, sp: bool, backend: str) -> dict:
    torch.set_num_threads(1)
    os.environ[CPU_TP_BACKEND_ENV] = backend
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    layout = ResolvedLayout.make(Topology(world, [world], [world] * (cfg.num_layers + 2)),
                                 num_microbatches=args.global_batch // args.micro_batch, sequence_parallel=sp)
    kinds = {"1": 1, "chunks": args.chunks}
    states = {kind: assemble(layout, rank, cfg, adamw(), "cpu", seed=1234, tp_chunks=n)
              for kind, n in kinds.items()}
    return metered_alternate(states, cfg.vocab_size, args, "chunks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default="gpt_tiny", choices=["gpt_tiny", "llama_tiny"])
    ap.add_argument("--modes", default="tp,sp", help="comma-separated: tp (no SP), sp (sequence parallel)")
    ap.add_argument("--backends", default="gloo,ntpdirect", help="comma-separated TP-group backends")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()
    print(f"tp_chunks: {args.model}, TP{args.tp}, {args.global_batch}x{args.seq} tokens per step in "
          f"micro-batches of {args.micro_batch}, {args.chunks} chunks; 1 thread per rank; "
          f"{args.rounds} rounds after {args.warmup} warm-up, unchunked/chunked alternating; "
          "load average before: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'backend':<10} {'mode':<5} {'1 ms':>8} {'chunks ms':>10} {'ratio':>7} {'paired':>7}   "
          "CPU per step per rank, 1 -> chunks (ms)   losses chunked vs not")
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            res = run_workers(worker, args.tp, args, mode == "sp", backend, timeout_s=900.0)
            med, paired = compare(res, "1", "chunks")
            cpu = "  ".join(f"r{i} {statistics.median(r['cpu']['1']) * 1e3:.0f} -> "
                            f"{statistics.median(r['cpu']['chunks']) * 1e3:.0f}" for i, r in enumerate(res))
            losses = res[0]["losses"]
            same = max(abs(a - b) for a, b in zip(losses["1"], losses["chunks"], strict=True))
            print(f"{backend:<10} {mode:<5} {med['1'] * 1e3:>8.1f} {med['chunks'] * 1e3:>10.1f} "
                  f"{med['chunks'] / med['1']:>7.3f} {paired:>7.3f}   {cpu}   max |diff| {same:.1e}",
                  flush=True)
            ov = res[0]["overlap"]
            print(f"{'':<16} chunked, rank 0: {int(ov['count'])} asynchronous collectives per step; compute "
                  f"beside them {ov['window'] * 1e3:.1f} ms, then still waited for {ov['wait'] * 1e3:.1f} ms",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
