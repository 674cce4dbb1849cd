"""Largest-remainder micro-batch assignment: exact totals, proportional within one, deterministic ties."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from ntp_nemo.data.rebalance import assign_microbatches, replica_microbatch_slices


@pytest.mark.parametrize(
    "m,caps,expected",
    [
        (8, [1, 0.5], [5, 3]),  # quotas 5.33 / 2.67: the larger remainder wins the spare
        (8, [1, 1, 0.75], [3, 3, 2]),  # quotas 2.91 / 2.91 / 2.18
        (4, [1, 1, 1], [2, 1, 1]),  # equal remainders: lower replica index first
        (6, [1, 0, 1], [3, 0, 3]),
        (7, [0.75, 1.0], [3, 4]),  # quotas 3.0 / 4.0 exactly
        (0, [1, 0.5], [0, 0]),
        (5, [0, 0, 2], [0, 0, 5]),
    ],
)
def test_known_cases(m, caps, expected):
    assert assign_microbatches(m, caps) == expected


def _check_largest_remainder(m, caps, counts):
    total = sum(Fraction(c) for c in caps)
    quotas = [m * Fraction(c) / total for c in caps]
    assert sum(counts) == m
    for c, q, n in zip(caps, quotas, counts, strict=True):
        assert abs(n - q) < 1
        if c == 0:
            assert n == 0
    rounded_up = [i for i, (n, q) in enumerate(zip(counts, quotas, strict=True)) if n > q]
    rounded_down = [i for i, (n, q) in enumerate(zip(counts, quotas, strict=True)) if n <= q]
    for i in rounded_up:
        for j in rounded_down:
            fi, fj = quotas[i] - int(quotas[i]), quotas[j] - int(quotas[j])
            assert fi > fj or (fi == fj and i < j)


def test_random_capacities_satisfy_largest_remainder():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 6)
        caps = [rng.choice([0, 0.25, 0.5, 0.75, 7 / 8, 1.0, 1.3, rng.random()]) for _ in range(n)]
        if sum(caps) == 0:
            caps[0] = 1.0
        m = rng.randint(0, 64)
        _check_largest_remainder(m, caps, assign_microbatches(m, caps))


def test_equal_capacities_split_evenly_and_scale_invariance():
    assert assign_microbatches(12, [1, 1, 1, 1]) == [3, 3, 3, 3]
    assert assign_microbatches(10, [3, 2]) == assign_microbatches(10, [0.75, 0.5])


def test_invalid_capacities():
    for caps in ([], [1, -0.5], [float("nan")], [0, 0]):
        with pytest.raises(ValueError):
            assign_microbatches(4, caps)


def test_slices_are_consecutive_replica_zero_first():
    slices = replica_microbatch_slices([3, 0, 2])
    assert slices == [range(0, 3), range(3, 3), range(3, 5)]
    counts = assign_microbatches(9, [1, 0.5, 0.75])
    flat = [i for r in replica_microbatch_slices(counts) for i in r]
    assert flat == list(range(9))
