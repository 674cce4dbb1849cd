"""What a sharded layer needs to know about its tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    copies: int = 1
    sequence_parallel: bool = False
    align: int = 1

    @property
    def sharded(self) -> bool:
        return self.size > 1


SINGLE = TPContext()
