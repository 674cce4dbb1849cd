"""The write-once rule: every unit of every tensor is written by exactly one of the ranks holding it,
and the bytes are spread over the holders (every replica writes, not only the first)."""

from __future__ import annotations

import random

import pytest
import torch

from ntp_nemo.checkpoint.ownership import assign_pieces, write_pieces
from ntp_nemo.topology.shard import ShardSpec, unit_interval

SHAPE = (12, 5)


def _spec(lo: int, hi: int, shape=SHAPE) -> ShardSpec:
    return ShardSpec.split(shape, 0, 1, lo, hi)


def _units(pieces: dict, name: str = "w") -> list[tuple[int, int]]:
    return [(p.lo, p.hi) for p in pieces.get(name, [])]


def _check_once(holdings: list[dict], assigned: list[dict], name: str = "w", units: int = 12) -> list[int]:
    """Each held unit written once, by a rank holding it; returns the units written per rank."""
    writes = [0] * units
    per_rank = []
    for rank, pieces in enumerate(assigned):
        n = 0
        for lo, hi in _units(pieces, name):
            held = holdings[rank][name]
            assert held.lo <= lo < hi <= held.hi
            for u in range(lo, hi):
                writes[u] += 1
            n += hi - lo
        per_rank.append(n)
    held_units = {u for h in holdings if name in h for u in range(h[name].lo, h[name].hi)}
    assert writes == [1 if u in held_units else 0 for u in range(units)]
    return per_rank


def test_healthy_and_degraded_replicas_both_write():
    # Replica 0 at TP 4 (ranks 0-3) and replica 1 degraded to TP 3 (ranks 4-6); split every run.
    holdings = [{"w": _spec(*unit_interval(i, 4, 12))} for i in range(4)]
    holdings += [{"w": _spec(*unit_interval(i, 3, 12))} for i in range(3)]
    per_rank = _check_once(holdings, assign_pieces(holdings, split_elements=1))
    assert sum(per_rank[:4]) > 0 and sum(per_rank[4:]) > 0
    assert max(per_rank) <= 2  # 12 units over 7 ranks


def test_two_replicas_share_every_large_tensor():
    holdings = [{"w": _spec(0, 12)}, {"w": _spec(0, 12)}]
    assert [_units(p) for p in assign_pieces(holdings, split_elements=1)] == [[(0, 6)], [(6, 12)]]
    # A small tensor goes whole to one holder; many of them are spread by bytes.
    small = [{f"b{i}": _spec(0, 12) for i in range(10)} for _ in range(2)]
    counts = [len([n for n, ps in p.items() if ps]) for p in assign_pieces(small)]
    assert counts == [5, 5]


def test_hole_in_one_holder_is_filled_by_the_other():
    holdings = [{"w": _spec(4, 6)}, {"w": _spec(0, 12)}]
    assigned = assign_pieces(holdings, split_elements=1)
    _check_once(holdings, assigned)
    assert _units(assigned[0]) == [(4, 6)] and _units(assigned[1]) == [(0, 4), (6, 12)]


def test_tensor_held_only_by_higher_ranks():
    holdings = [{}, {"w": _spec(0, 6)}, {"w": _spec(3, 12)}]  # e.g. pipeline stages
    _check_once(holdings, assign_pieces(holdings))
    assert write_pieces(0, holdings) == {}


def test_random_layouts_cover_each_unit_exactly_once_and_balance():
    rng = random.Random(0)
    for _ in range(300):
        world = rng.randint(1, 9)
        holdings = []
        for _ in range(world):
            lo = rng.randint(0, 12)
            hi = rng.randint(lo, 12)
            holdings.append({"w": _spec(lo, hi)} if rng.random() < 0.9 else {})
        _check_once(holdings, assign_pieces(holdings, split_elements=1))
    # Full replicas of a big tensor: each of k holders writes 1/k.
    for k in (2, 3, 4):
        holdings = [{"w": _spec(0, 12)} for _ in range(k)]
        assert _check_once(holdings, assign_pieces(holdings, split_elements=1)) == [12 // k] * k


def test_write_pieces_of_a_tp2_and_a_tp3_replica_by_hand():
    # Replica 0 at TP 2 holds units [0,6) and [6,12); replica 1 at TP 3 [0,4), [4,8), [8,12).  Runs
    # (5 elements a unit, all under SPLIT_ELEMENTS: whole to one holder): [0,4) by ranks 0 and 2, 20
    # elements; [8,12) by 1 and 4, 20; [4,6) by 0 and 3, 10; [6,8) by 1 and 3, 10.  Largest first to
    # the least-loaded holder (lower rank on ties): [0,4) -> 0, [8,12) -> 1, [4,6) -> 3 (0 has 20),
    # [6,8) -> 3 (1 has 20, 3 has 10), merged with [4,6) into one chunk.
    holdings = [{"w": _spec(0, 6)}, {"w": _spec(6, 12)}, {"w": _spec(0, 4)}, {"w": _spec(4, 8)},
                {"w": _spec(8, 12)}]
    expected = [[(0, 4)], [(8, 12)], [], [(4, 8)], []]
    assert [_units(write_pieces(r, holdings)) for r in range(5)] == expected
    pieces = [p for r in range(5) for p in write_pieces(r, holdings)["w"]]
    assert all(p.global_shape == SHAPE and p.dim == 0 for p in pieces)


def test_different_global_shapes_are_an_error():
    holdings = [{"w": _spec(0, 6)}, {"w": ShardSpec.split((12, 6), 1, 1, 0, 6)}]
    with pytest.raises(RuntimeError, match="shapes"):
        write_pieces(1, holdings)


def test_splits_along_different_dims_are_written_once_as_boxes():
    """Replicas of different sharding patterns (`ntp.pattern`) split one tensor along different dims
    (rows on one, a 2D block or columns on another): the pieces are boxes of the common refinement, every
    element written by exactly one rank holding it."""
    holdings = [{"w": _spec(0, 6)}, {"w": _spec(6, 12)}, {"w": ShardSpec.split(SHAPE, 1, 1, 0, 5)},
                {"w": ShardSpec.block(SHAPE, (0, 1, 4, 12), (1, 1, 2, 5))}]
    written = torch.zeros(SHAPE, dtype=torch.int64)
    for rank, pieces in enumerate(assign_pieces(holdings)):
        held = holdings[rank]["w"]
        for piece in pieces["w"]:
            assert all(h <= o and o + n <= h + m for o, n, h, m in
                       zip(piece.offsets, piece.local_shape, held.offsets, held.local_shape, strict=True))
            piece.narrow(written).add_(1)
    assert torch.equal(written, torch.ones(SHAPE, dtype=torch.int64))
