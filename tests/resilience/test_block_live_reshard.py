"""The live reshard plan between sharding patterns (`ntp.pattern=block`): a 2x2 grid's weight blocks and
column-split biases to the row/column TP-3 replica it shrinks to after a failure, and back after the
repair.  Every element a participant needs comes exactly once, from a participant that holds it, and
the bytes moved are the minimum (what the participant does not hold itself)."""

from __future__ import annotations

import torch

from ntp_nemo.resilience.live import Holding, plan_reshard
from ntp_nemo.topology.shard import ShardSpec, unit_interval

SHAPE = (12, 10)  # a weight [out, in]; its bias [out]


def _grid(rank: int) -> dict[str, Holding]:
    row, col = divmod(rank, 2)
    rows, cols = unit_interval(row, 2, 12), unit_interval(col, 2, 10)
    return {"w": Holding(ShardSpec.block(SHAPE, (0, 1, *rows), (1, 1, *cols)), "float64", 8),
            "b": Holding(ShardSpec.split((12,), 0, 1, *unit_interval(col, 2, 12)), "float64", 8)}


def _tp3(rank: int) -> dict[str, Holding]:
    return {"w": Holding(ShardSpec.split(SHAPE, 0, 1, *unit_interval(rank, 3, 12)), "float64", 8),
            "b": Holding(ShardSpec.full((12,)), "float64", 8)}


def _check(held, wanted, replica_of) -> None:
    plan = plan_reshard(held, wanted, replica_of)
    missing = 0
    for dst, want in enumerate(wanted):
        for key, w in want.items():
            got = torch.zeros(w.spec.global_shape, dtype=torch.int64)
            for p in plan.pieces:
                if p.dst != dst or p.key != key:
                    continue
                box = p.box or ((p.start, p.stop),)
                src = held[p.src][key].spec
                assert all(o <= a and b <= o + n for (a, b), o, n in
                           zip(box, src.offsets, src.local_shape, strict=True)), (p, src)
                got[tuple(slice(a, b) for a, b in box)] += 1
                if p.src != dst:
                    missing += p.nbytes
            once = torch.ones(w.spec.local_shape, dtype=torch.int64)
            assert torch.equal(w.spec.narrow(got), once) and int(got.sum()) == once.numel(), (dst, key)
    assert plan.needed_bytes == plan.moved_bytes == missing > 0


def test_grid_to_tp3_after_a_failure_and_back_after_the_repair():
    # Two replicas: replica 0 keeps its 2x2 grid (ranks 0-3); replica 1 (ranks 4-7) lost rank 5 and
    # shrinks to TP 3 (row/column: 3 is no square) on its survivors 4, 6, 7.
    held = [_grid(r % 4) for r in (0, 1, 2, 3, 4, 6, 7)]
    replica_of = [0, 0, 0, 0, 1, 1, 1]
    _check(held, [_grid(r) for r in range(4)] + [_tp3(i) for i in range(3)], replica_of)
    # The repair: the TP-3 replica and the repaired process (empty) back on a 2x2 grid.
    back = [_grid(r) for r in range(4)] + [_tp3(i) for i in range(3)] + [{}]
    _check(back, [_grid(r % 4) for r in (0, 1, 2, 3, 4, 6, 7, 5)], replica_of + [1])
