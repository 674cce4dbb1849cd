"""Dry run: grouping ranks by slice shape against running every rank's step on its own.

    python bench/dry_run.py [--replica-tp 8,7] [--pp 1] [--plans-world 526]

1. The dry run of a Llama 3 8B layout (default (8,7): 15 ranks), twice in this process: grouped (one
   forward/backward per distinct step shape, every rank's sync plan in one pass) and per rank (every
   rank runs its own step and derives its own plan with `build_sync_plan`).  Both must give the same
   per-rank results; the figures are wall and CPU seconds and their ratio.
2. The sync plans alone for a large layout (default 526 ranks: 32 x TP 8 + TP 7, PP 2): all ranks in
   one pass (`build_sync_plans`) against `build_sync_plan` for the first 8 ranks (its time per rank, and
   the plans of those ranks compared).
3. The world-wide communicator splits before step 1 of that layout (`--plans-world`): the groups a
   rank's `StageLinks` creates (one per stage pair and direction) against two per link, and the total
   the dry run prints (`communicator_splits`).

Load from other processes changes wall time; CPU time (`time.process_time`) is printed next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from ntp_nemo.models.config import ModelConfig
from ntp_nemo.parallel.grad_sync import build_sync_plan, build_sync_plans, param_descriptors
from ntp_nemo.runtime.dry_run import StepShape, dry_run, fake_world
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology

LLAMA3_8B = ModelConfig(arch="llama", name="llama3_8b", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192,
                        tie_embeddings=False, rope_theta=500000.0)
SHAPE = StepShape(seq_len=8192, micro_batch_size=1, param_dtype=torch.float32, compute_dtype=torch.bfloat16)


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-tp", default="8,7", help="active TP ranks per replica (nominal TP = max)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--plans-world", type=int, default=526, help="0 skips part 2")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")

    replica_tp = [int(x) for x in args.replica_tp.split(",")]
    topology = Topology(max(replica_tp), replica_tp, [max(replica_tp)] * 34, pp=args.pp)
    layout = ResolvedLayout.make(topology, num_microbatches=8 * len(replica_tp))
    grouped, gw, gc = timed(lambda: dry_run(layout, LLAMA3_8B, SHAPE, measure_options=False))
    single, sw, sc = timed(lambda: dry_run(layout, LLAMA3_8B, SHAPE, measure_options=False,
                                           group_ranks=False))
    same = [dataclasses.asdict(a) for a in grouped.ranks] == [dataclasses.asdict(b) for b in single.ranks]
    print(f"\n1. dry run of {layout.describe()} ({layout.world_size} ranks, Llama 3 8B)")
    slices = len({r.signature for r in grouped.ranks})
    print(f"   grouped : {gw:7.1f} s wall {gc:7.1f} s CPU  ({slices} slices)")
    print(f"   per rank: {sw:7.1f} s wall {sc:7.1f} s CPU")
    print(f"   per rank / grouped: {sw / gw:.1f}x wall, {sc / gc:.1f}x CPU; "
          f"identical per-rank results: {same}")

    if args.plans_world:
        dp = (args.plans_world // 2 + 7) // 8
        sizes = [8] * (dp - 1) + [args.plans_world // 2 - 8 * (dp - 1)]
        big = ResolvedLayout.make(Topology(8, sizes, [8] * 34, pp=2))
        topo = big.topology()
        desc: dict = {}
        for r in range(big.world_size):  # one slice per signature, as the dry run builds them
            c = topo.coord(r)
            sig = (topo.replica_tp[c.replica], c.stage, c.slot)
            if sig not in desc:
                with fake_world(r, big.world_size):
                    desc[sig] = param_descriptors(NTPRuntime(big, r, device="meta").build_model(LLAMA3_8B, 0))
        everyone = [desc[(topo.replica_tp[c.replica], c.stage, c.slot)] for c in topo.coords]
        replica_of = [c.replica for c in topo.coords]
        plans, aw, ac = timed(lambda: build_sync_plans(everyone, replica_of))
        k = 8
        per, pw, pc = timed(lambda: [build_sync_plan(r, everyone, replica_of) for r in range(k)])
        same = all(per[r] == plans[r] for r in range(k))
        print(f"\n2. sync plans of {big.describe()[:24]}... ({big.world_size} ranks)")
        print(f"   all ranks in one pass     : {aw:7.2f} s wall {ac:7.2f} s CPU")
        print(f"   build_sync_plan, {k} ranks  : {pw:7.2f} s wall {pc:7.2f} s CPU "
              f"({pc / k:.3f} s CPU per rank; x {big.world_size} ranks = "
              f"{pc / k * big.world_size:.0f} s CPU, extrapolated)")
        print(f"   same plans for those ranks: {same}")

        from ntp_nemo.pipeline.p2p import StageLinks, link_pairs
        from ntp_nemo.runtime.dry_run import communicator_splits, splits_line

        made: list[list[int]] = []
        StageLinks(topo, 0, lambda ranks: made.append(list(ranks)))
        splits = communicator_splits(topo, plans, big.schedule, checkpoint_group=True)
        print(f"\n3. communicator splits before step 1 ({big.world_size} ranks, PP {topo.pp})")
        print(f"   pipeline link groups: {len(made)} (one per stage pair and direction); two per link "
              f"would be {2 * len(link_pairs(topo))}")
        print(f"   {splits_line(splits)}")


if __name__ == "__main__":
    main()
