"""Which rank writes which piece of every logical tensor, so each element is stored exactly once.

Ranks' slices overlap: replicas hold the same units, a layer of lower degree is replicated inside
its replica, shared KV heads sit on several ranks.  A storage format that reassembles chunks by
global offset (DCP) needs disjoint chunks, so every unit is written by the lowest global rank
holding it.  The rule is a pure function of every rank's `ShardSpec`s (exchanged once), needs
no further communication, and gives every rank the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ntp_nemo.parallel.shard import ShardSpec


def _same_tensor(a: ShardSpec, b: ShardSpec) -> bool:
    return (a.global_shape, a.dim, a.unit_size) == (b.global_shape, b.dim, b.unit_size)


def write_pieces(rank: int, holdings: Sequence[Mapping[str, ShardSpec]]) -> dict[str, list[ShardSpec]]:
    """The sub-slices of its own holdings that `rank` writes: the units no lower rank holds.

    `holdings[r]` maps tensor name -> the slice rank `r` holds.  Returns name -> disjoint
    sub-specs (usually one; none when a lower rank holds everything), each inside `rank`'s slice.
    """
    mine = holdings[rank]
    out: dict[str, list[ShardSpec]] = {}
    for name in sorted(mine):
        spec = mine[name]
        lower = [h[name] for h in holdings[:rank] if name in h]
        for other in lower:
            if not _same_tensor(spec, other):
                raise RuntimeError(f"tensor {name} is sharded differently across ranks: {spec} vs {other}")
        inner = {b for o in lower for b in (o.lo, o.hi) if spec.lo < b < spec.hi}
        bounds = sorted({spec.lo, spec.hi} | inner)
        pieces: list[ShardSpec] = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            if any(o.lo <= a and b <= o.hi for o in lower):
                continue
            if pieces and pieces[-1].hi == a:  # extend the previous piece: keep chunks maximal
                a = pieces.pop().lo
            pieces.append(ShardSpec(spec.global_shape, spec.dim, spec.unit_size, a, b))
        out[name] = pieces
    return out
