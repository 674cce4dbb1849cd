"""Attention head split of a reduced replica: whole KV groups (the former split) against balanced query
heads with shared KV heads, side by side in one run.

    python bench/head_split.py [--reps 15] [--heads 16] [--kv-heads 4] [--degree 3] [--seq 256]

1. Per-rank step time on this machine: `llama_tiny` with `--heads` query heads over `--kv-heads` KV heads
   (hidden 256, 4 layers, micro-batch 2 x `--seq`); each of the `--degree` ranks' model slices runs
   forward + backward in this one process (one thread, its collectives on a one-process gloo group, so
   what is timed is the rank's own work: the waits on its peers that a real step adds are left out).
   Both splits and all ranks take turns, repetition by repetition, so load from other processes falls
   on all alike.  Figures: the median time per rank, and the slowest rank's time over the ranks' mean.
2. Llama-3-8B's TP-7 replica (`ntp.replica_tp=[8,...,8,7]`): parameters of every rank's slice (built on
   the meta device) with both splits, against a healthy TP-8 rank, and the modelled work per rank of
   the balanced split (`ntp_nemo.topology.work`), relative to a healthy rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import ntp_nemo.models.transformer as transformer
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.models.transformer import DecoderLM
from ntp_nemo.topology import Topology
from ntp_nemo.topology.tp_context import TPContext
from ntp_nemo.topology.work import WorkShape, healthy_cost, rank_costs

SPLITS = {"whole KV groups (before)": transformer._whole_kv_group_intervals,
          "balanced query heads (after)": transformer.attention_head_intervals}
LLAMA3_8B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192, tie_embeddings=False)


class _Plan:
    """Every slot at position `rank` of a `size`-rank group."""

    def __init__(self, size: int, rank: int, group) -> None:
        self.tp = TPContext(size=size, rank=rank, group=group)

    def context(self, slot: int) -> TPContext:
        return self.tp


def _build(split, cfg: ModelConfig, size: int, rank: int, group=None, meta: bool = False) -> DecoderLM:
    """One rank's model slice under `split` (the module's interval function, swapped for the build)."""
    keep = transformer.attention_head_intervals
    transformer.attention_head_intervals = split
    try:
        if meta:
            with torch.device("meta"):
                return DecoderLM(cfg, _Plan(size, rank, group))
        model = DecoderLM(cfg, _Plan(size, rank, group))
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return model
    finally:
        transformer.attention_head_intervals = keep


def time_ranks(args) -> None:
    cfg = ModelConfig(arch="llama", vocab_size=257, hidden_size=256, num_layers=4, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, ffn_hidden_size=688, max_seq_len=args.seq,
                      tie_embeddings=False)
    models = {name: [_build(split, cfg, args.degree, r, dist.group.WORLD) for r in range(args.degree)]
              for name, split in SPLITS.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, args.seq, cfg.hidden_size, generator=gen)
    times = {name: [[] for _ in range(args.degree)] for name in SPLITS}
    for rep in range(args.reps + 2):
        for name, ranks in models.items():
            for r, model in enumerate(ranks):
                t0 = time.perf_counter()
                model.run_blocks(x.clone().requires_grad_()).sum().backward()
                if rep >= 2:  # two warm-up repetitions
                    times[name][r].append(time.perf_counter() - t0)
    print(f"llama_tiny, {args.heads} query heads / {args.kv_heads} KV heads, degree {args.degree}, "
          f"micro-batch "
          f"2 x {args.seq}: forward+backward of the transformer layers per rank slice, median of {args.reps}")
    for name in SPLITS:
        med = [statistics.median(t) for t in times[name]]
        heads = [hi - lo for (lo, hi), _ in (SPLITS[name](args.heads, args.kv_heads,
                                                           TPContext(size=args.degree, rank=r))
                                              for r in range(args.degree))]
        print(f"  {name:30s} query heads {heads}  ms {[round(1e3 * m, 1) for m in med]}  "
              f"slowest/mean {max(med) / statistics.mean(med):.3f}")


def llama3_8b_tp7() -> None:
    healthy = sum(p.numel() for p in _build(transformer.attention_head_intervals, LLAMA3_8B, 8, 0,
                                            meta=True).parameters())
    print(f"llama3_8b, TP-7 replica: parameters per rank slice (healthy TP-8 rank {healthy / 1e6:,.1f}M)")
    for name, split in SPLITS.items():
        params = [sum(p.numel() for p in _build(split, LLAMA3_8B, 7, r, meta=True).parameters())
                  for r in range(7)]
        print(f"  {name:30s} M {[round(p / 1e6, 1) for p in params]}  largest/healthy "
              f"{max(params) / healthy:.3f}")
    shape = WorkShape(4096, 32, 32, 8, 14336, 128256, 8192)
    topo = Topology(8, [8] * 7 + [7], [8] * 34)
    work = [c / healthy_cost(shape, topo) for c in rank_costs(shape, topo)][56:]
    print(f"  modelled work per rank of the balanced split / healthy rank {[round(w, 3) for w in work]}, "
          f"largest {max(work):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--degree", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            time_ranks(args)
        finally:
            dist.destroy_process_group()
    llama3_8b_tp7()


if __name__ == "__main__":
    main()
