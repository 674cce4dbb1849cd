"""What a sharded layer needs to know about its tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ntp_nemo.topology.shard import shard_interval


@dataclass(frozen=True)
class TPContext:
    """A layer's TP group as seen from one rank.

    `size` ranks shard the layer (`rank` is this rank's position among them); `group` is the
    process group for its collectives (None when `size == 1`).  `copies` counts identical
    replicas of the layer inside this rank's DP replica (a layer of degree `t` in a replica of
    `n` ranks is replicated `n / t` times); gradient sync weighs contributions by `1 / copies`.
    `sequence_parallel`: the replicated regions hold this rank's slice of the sequence
    (`ntp_nemo.parallel.sequence`).
    `align`: elements per block of a split into one-element units (MLP columns, vocabulary rows;
    `ntp.shard_align`), so shard boundaries fall on its multiples.
    `weights`: one per position of the group, the shares of its sharded units (`shard.shard_interval`:
    contiguous, in proportion; the straggler policy's measured speeds); None: balanced.
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    copies: int = 1
    sequence_parallel: bool = False
    align: int = 1
    weights: tuple[float, ...] | None = None

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def interval(self, units: int, align: int = 1) -> tuple[int, int]:
        """This rank's units `[lo, hi)` of `units` (blocks of `align`): balanced, or by `weights`."""
        return shard_interval(self.rank, self.size, units, align, self.weights)


SINGLE = TPContext()
