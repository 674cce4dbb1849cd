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
"""

from __future__ import annotations

from dataclasses import dataclass
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


def aligned_sizes(n: int, units: int, align: int = 1) -> list[int]:
    """The shard sizes of `units` over `n` ranks (`aligned_interval` of each position)."""
    return [b - a for a, b in (aligned_interval(i, n, units, align) for i in range(n))]


@dataclass(frozen=True)
class ShardSpec:
    """One rank's slice of a logical tensor: units `[lo, hi)` of dim `dim`, `unit_size` elements each."""

    global_shape: tuple[int, ...]
    dim: int
    unit_size: int
    lo: int
    hi: int

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

    @property
    def num_units(self) -> int:
        return self.global_shape[self.dim] // self.unit_size if self.global_shape else 1

    @property
    def is_full(self) -> bool:
        return self.lo == 0 and self.hi == self.num_units

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
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global offset of the local chunk along every dim."""
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.global_shape)))

    def narrow(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's view of a full (unsharded) tensor."""
        if not self.global_shape:
            return full
        return full.narrow(self.dim, self.start, self.length)
