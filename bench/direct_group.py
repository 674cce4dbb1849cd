"""One collective's cost: gloo groups against `ntpdirect` groups (ntp_nemo/topology/direct_group.py),
side by side in the same processes.

    python bench/direct_group.py [--worlds 2,3,4] [--numels 8,65536,262144,1048576] [--iters 200]
                                 [--rounds 3]

For each world size, forked gloo processes (one torch thread each) make one gloo group and one ntpdirect
group over all ranks, then time `--iters` back-to-back collectives of each kind (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor) and size (float32 elements per rank) on each group,
the two groups in turns, `--rounds` times.  Printed per row, medians over the rounds of rank 0: wall
and process CPU per collective on each group, and gloo / ntpdirect (how many times cheaper).  A third
group, ntpdirect with its two-phase all-reduce switched off (every all-reduce in one round: each rank
sends its whole tensor to every peer), takes its turn in the all-reduce rows: "one-phase", and
one-phase / ntpdirect.  At 2 ranks the two are the same path.  The
TP regions of the default recipe (gpt_tiny, micro-batches of 2 x 128 tokens, hidden 256) all-reduce
65,536 values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.topology.direct_group import register  # noqa: E402

KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _call(kind: str, group, world: int, x: torch.Tensor, out: dict) -> None:
    if kind == "all_reduce":
        dist.all_reduce(x, group=group)
    elif kind == "all_gather_into_tensor":
        dist.all_gather_into_tensor(out["gathered"], x, group=group)
    else:
        dist.reduce_scatter_tensor(out["scattered"], out["gathered"], group=group)


def worker(rank: int, world: int, numels: list[int], iters: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    register()
    groups = {"gloo": dist.new_group(list(range(world))),
              "ntpdirect": dist.new_group(list(range(world)), backend="ntpdirect"),
              "one-phase": dist.new_group(list(range(world)), backend="ntpdirect")}
    groups["one-phase"].two_phase_bytes = float("inf")
    rows: dict = {}
    for numel in numels:
        x = torch.zeros(numel)  # repeated sums stay finite (an add's cost does not depend on the values)
        buffers = {"gathered": torch.empty(numel * world), "scattered": torch.empty(numel)}
        for kind in KINDS:
            for _ in range(rounds):
                for name, group in groups.items():
                    if name == "one-phase" and kind != "all_reduce":
                        continue
                    for _ in range(10):  # warm-up
                        _call(kind, group, world, x.clone(), buffers)
                    dist.barrier()
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        _call(kind, group, world, x, buffers)
                    wall = (time.perf_counter() - t) / iters
                    cpu = (time.process_time() - c) / iters
                    rows.setdefault((numel, kind, name), []).append((wall, cpu))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--numels", default="8,65536,262144,1048576")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    numels = [int(n) for n in args.numels.split(",")]
    print("direct_group: ms per collective, medians of rank 0 over "
          f"{args.rounds} rounds of {args.iters}; float32 elements per rank")
    print(f" {'world':>5} {'kind':<24} {'numel':>8}  {'gloo wall':>9} {'cpu':>6}  {'direct wall':>11} "
          f"{'cpu':>6}  {'gloo/direct wall':>16} {'cpu':>5}  {'one-phase wall':>14} {'cpu':>6}  "
          f"{'one-phase/direct wall':>21} {'cpu':>5}")
    for world in (int(w) for w in args.worlds.split(",")):
        rows = run_workers(worker, world, numels, args.iters, args.rounds, timeout_s=300.0)[0]
        for numel in numels:
            for kind in KINDS:
                g = [statistics.median(v[i] for v in rows[(numel, kind, "gloo")]) * 1e3 for i in (0, 1)]
                d = [statistics.median(v[i] for v in rows[(numel, kind, "ntpdirect")]) * 1e3 for i in (0, 1)]
                line = (f" {world:>5} {kind:<24} {numel:>8}  {g[0]:>9.3f} {g[1]:>6.3f}  {d[0]:>11.3f} "
                        f"{d[1]:>6.3f}  {g[0] / d[0]:>16.1f} {g[1] / d[1]:>5.1f}")
                if (numel, kind, "one-phase") in rows:
                    one = rows[(numel, kind, "one-phase")]
                    o = [statistics.median(v[i] for v in one) * 1e3 for i in (0, 1)]
                    line += f"  {o[0]:>14.3f} {o[1]:>6.3f}  {o[0] / d[0]:>21.2f} {o[1] / d[1]:>5.2f}"
                print(line)


if __name__ == "__main__":
    main()
