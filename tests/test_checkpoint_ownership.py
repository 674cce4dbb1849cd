"""The write-once rule: every unit of every tensor is written by exactly one rank, the lowest holding it."""

from __future__ import annotations

import random

import pytest

from ntp_nemo.checkpoint.ownership import write_pieces
from ntp_nemo.parallel.shard import ShardSpec, unit_interval

SHAPE = (12, 5)


def _spec(lo: int, hi: int) -> ShardSpec:
    return ShardSpec.split(SHAPE, 0, 1, lo, hi)


def _intervals(rank: int, holdings: list[dict]) -> list[tuple[int, int]]:
    return [(p.lo, p.hi) for p in write_pieces(rank, holdings).get("w", [])]


def test_healthy_replica_writes_and_degraded_replica_skips():
    # Replica 0 at TP 4 (ranks 0-3) and replica 1 degraded to TP 3 (ranks 4-6).
    holdings = [{"w": _spec(*unit_interval(i, 4, 12))} for i in range(4)]
    holdings += [{"w": _spec(*unit_interval(i, 3, 12))} for i in range(3)]
    expected = [[(0, 3)], [(3, 6)], [(6, 9)], [(9, 12)], [], [], []]
    assert [_intervals(r, holdings) for r in range(7)] == expected


def test_replicated_layer_written_by_first_copy_only():
    holdings = [{"w": _spec(0, 12)}, {"w": _spec(0, 12)}]
    assert _intervals(0, holdings) == [(0, 12)]
    assert _intervals(1, holdings) == []


def test_hole_in_lower_ranks_gives_two_pieces():
    holdings = [{"w": _spec(4, 6)}, {"w": _spec(0, 12)}]
    assert _intervals(1, holdings) == [(0, 4), (6, 12)]


def test_tensor_held_only_by_higher_ranks():
    holdings = [{}, {"w": _spec(0, 6)}, {"w": _spec(3, 12)}]  # e.g. pipeline stages
    assert _intervals(1, holdings) == [(0, 6)]
    assert _intervals(2, holdings) == [(6, 12)]


def test_random_layouts_cover_each_unit_exactly_once():
    rng = random.Random(0)
    for _ in range(300):
        world = rng.randint(1, 9)
        holdings = []
        for _ in range(world):
            lo = rng.randint(0, 12)
            hi = rng.randint(lo, 12)
            holdings.append({"w": _spec(lo, hi)} if rng.random() < 0.9 else {})
        writes = [0] * 12
        for rank in range(world):
            for lo, hi in _intervals(rank, holdings):
                held = holdings[rank]["w"]
                assert held.lo <= lo < hi <= held.hi
                lower = [h["w"] for h in holdings[:rank] if "w" in h]
                assert not any(max(lo, o.lo) < min(hi, o.hi) for o in lower), "a lower rank holds it"
                for u in range(lo, hi):
                    writes[u] += 1
        held_units = {u for h in holdings if "w" in h for u in range(h["w"].lo, h["w"].hi)}
        assert writes == [1 if u in held_units else 0 for u in range(12)]


def test_inconsistent_sharding_is_an_error():
    holdings = [{"w": _spec(0, 6)}, {"w": ShardSpec.split(SHAPE, 1, 1, 0, 5)}]
    with pytest.raises(RuntimeError, match="sharded differently"):
        write_pieces(1, holdings)
