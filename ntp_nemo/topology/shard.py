"""Balanced contiguous intervals of units and the ShardSpec value object.

Every TP-sharded tensor splits along one dim into *units* (attention heads or KV groups,
MLP hidden columns, vocabulary rows).  A group of `n` ranks holds the units as balanced
contiguous intervals: rank `i` holds `[floor(i*U/n), floor((i+1)*U/n))`.  `n` need not
divide `U`.  Because every layout follows the same rule, two layouts relate by interval
intersection, which serves gradient sync across unequal replicas and checkpoint resharding.

Units of one element (MLP columns, vocabulary rows) can be aligned (`ntp.shard_align`): the
intervals are then balanced over blocks of `align` elements, so every boundary between two ranks
falls on a multiple of `align` (GEMM shapes a GPU's tensor cores take at full speed) and shards differ
by whole blocks; only the last rank's end is the tensor's end.  Aligned intervals are still
contiguous unit-1 intervals, so everything that relates layouts by intersection is unchanged.

Weighted intervals (`shard_interval` with `weights`, one per position: the straggler policy's measured
speeds, `ResolvedLayout.shard_speeds`) are contiguous too, sized in proportion to the weights: position
`i` starts at block `floor(B * W_i / W)` (`B` blocks of `align` units, `W_i` the weights before `i`, `W`
their sum, in exact rational arithmetic); where that leaves a position without a block (and `B >= n`),
every position gets one block and the other `B - n` are split by the same rule: `i + floor((B - n) W_i /
W)`.  Equal weights give the balanced intervals exactly; no weights (None) take the balanced rule itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the work model and the config checks import this without torch
    import torch


def unit_interval(index: int, n: int, units: int) -> tuple[int, int]:
    """Units `[lo, hi)` held by position `index` of `n` (balanced, contiguous, may be uneven)."""
    if not 0 <= index < n:
        raise ValueError(f"position {index} outside a group of {n}")
    return (index * units) // n, ((index + 1) * units) // n


def aligned_interval(index: int, n: int, units: int, align: int = 1) -> tuple[int, int]:
    """Units `[lo, hi)` of position `index` of `n`: balanced over blocks of `align` units (the last block
    may be short), so every interior boundary is a multiple of `align`."""
    if align <= 1:
        return unit_interval(index, n, units)
    lo, hi = unit_interval(index, n, -(-units // align))
    return min(lo * align, units), min(hi * align, units)


def aligned_sizes(n: int, units: int, align: int = 1, weights: Sequence[float] | None = None) -> list[int]:
    """The shard sizes of `units` over `n` ranks (`shard_interval` of each position)."""
    return [b - a for a, b in (shard_interval(i, n, units, align, weights) for i in range(n))]


def _block_starts(n: int, blocks: int, weights: Sequence[float]) -> list[int]:
    """First block of every position and the end (`n + 1` values): proportional to `weights`, at least one
    block each where there are as many blocks as positions."""
    w = [Fraction(str(float(x))) for x in weights]  # the decimal the weight prints as, exactly
    total = sum(w)
    before = [sum(w[:i], Fraction(0)) / total for i in range(n)]
    starts = [int(blocks * b) for b in before]  # floor: exact, the same on every rank
    if blocks >= n and any(a == b for a, b in zip(starts, starts[1:] + [blocks], strict=True)):
        # a weight too small for one block: one block each, the rest in proportion
        starts = [i + int((blocks - n) * b) for i, b in enumerate(before)]
    return starts + [blocks]


def shard_interval(index: int, n: int, units: int, align: int = 1,
                   weights: Sequence[float] | None = None) -> tuple[int, int]:
    """Units `[lo, hi)` of position `index` of `n`: `aligned_interval` without `weights`; with them (one
    positive weight per position), contiguous intervals of whole `align`-unit blocks in proportion to the
    weights (see the module docstring)."""
    if weights is None:
        return aligned_interval(index, n, units, align)
    if len(weights) != n or not all(float(x) > 0 for x in weights):
        raise ValueError(f"shard weights {list(weights)}: expected {n} positive weights")
    if not 0 <= index < n:
        raise ValueError(f"position {index} outside a group of {n}")
    align = max(1, align)
    starts = _block_starts(n, -(-units // align), weights)
    return min(starts[index] * align, units), min(starts[index + 1] * align, units)


@dataclass(frozen=True)
class ShardSpec:
    """One rank's slice of a logical tensor: units `[lo, hi)` of dim `dim`, `unit_size` elements each.

    A block-sharded weight (`ntp.pattern=block`, `ntp_nemo.parallel.block`) is a 2D interval: its
    second split is units `[lo2, hi2)` of dim `dim2` (`unit_size2` elements each); `dim2 = -1` (the
    default) means no second split.  Both splits follow the balanced-interval rule, so two layouts still
    relate by intersection, now of boxes (`ntp_nemo.parallel.grad_sync` refines both dims)."""

    global_shape: tuple[int, ...]
    dim: int
    unit_size: int
    lo: int
    hi: int
    dim2: int = -1
    unit_size2: int = 1
    lo2: int = 0
    hi2: int = 0

    @staticmethod
    def full(shape: tuple[int, ...] | torch.Size) -> ShardSpec:
        shape = tuple(shape)
        return ShardSpec(shape, 0, shape[0] if shape else 1, 0, 1)

    @staticmethod
    def split(shape: tuple[int, ...] | torch.Size, dim: int, unit_size: int, lo: int, hi: int) -> ShardSpec:
        shape = tuple(shape)
        if shape[dim] % unit_size:
            raise ValueError(f"dim {dim} of {shape} is not a multiple of unit size {unit_size}")
        return ShardSpec(shape, dim, unit_size, lo, hi)

    @staticmethod
    def block(shape: tuple[int, ...] | torch.Size, first: tuple[int, int, int, int],
              second: tuple[int, int, int, int]) -> ShardSpec:
        """Units `[lo, hi)` of `first = (dim, unit_size, lo, hi)` and of `second` (another dim): a block."""
        shape = tuple(shape)
        for dim, unit, _, _ in (first, second):
            if shape[dim] % unit:
                raise ValueError(f"dim {dim} of {shape} is not a multiple of unit size {unit}")
        if first[0] == second[0]:
            raise ValueError("a block splits two different dims")
        return ShardSpec(shape, *first, *second)

    @property
    def is_block(self) -> bool:
        return self.dim2 >= 0

    @property
    def start2(self) -> int:
        return self.lo2 * self.unit_size2

    @property
    def length2(self) -> int:
        return (self.hi2 - self.lo2) * self.unit_size2

    @property
    def num_units(self) -> int:
        return self.global_shape[self.dim] // self.unit_size if self.global_shape else 1

    @property
    def is_full(self) -> bool:
        second = not self.is_block or (
            self.lo2 == 0 and self.hi2 * self.unit_size2 == self.global_shape[self.dim2])
        return self.lo == 0 and self.hi == self.num_units and second

    @property
    def start(self) -> int:
        return self.lo * self.unit_size

    @property
    def length(self) -> int:
        return (self.hi - self.lo) * self.unit_size

    @property
    def local_shape(self) -> tuple[int, ...]:
        if not self.global_shape:
            return ()
        shape = list(self.global_shape)
        shape[self.dim] = self.length
        if self.is_block:
            shape[self.dim2] = self.length2
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global offset of the local chunk along every dim."""
        return tuple(self.start if d == self.dim else self.start2 if d == self.dim2 else 0
                     for d in range(len(self.global_shape)))

    def narrow(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's view of a full (unsharded) tensor."""
        if not self.global_shape:
            return full
        out = full.narrow(self.dim, self.start, self.length)
        return out.narrow(self.dim2, self.start2, self.length2) if self.is_block else out
