"""Which rank writes which piece of every logical tensor: each element once, the work spread over holders.

Ranks' slices overlap: replicas hold the same units, a layer of lower degree is replicated inside
its replica, shared KV heads sit on several ranks.  The checkpoint stores disjoint chunks, so every
unit is written by exactly one of the ranks holding it.  Which one is chosen to balance the bytes
each rank writes (largest pieces first, each to its least-loaded holder), so all replicas write,
not only the first.  The rule is a pure function of every rank's `ShardSpec`s (exchanged once),
needs no further communication and gives every rank the same answer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from ntp_nemo.topology.shard import ShardSpec

SPLIT_ELEMENTS = 1 << 16


def _same_tensor(a: ShardSpec, b: ShardSpec) -> bool:
    return (a.global_shape, a.dim, a.unit_size) == (b.global_shape, b.dim, b.unit_size)


def _unit_elements(spec: ShardSpec) -> int:
    """Elements in one unit of `spec`'s tensor."""
    if not spec.global_shape:
        return 1
    return math.prod(spec.global_shape) // spec.num_units


def assign_pieces(holdings: Sequence[Mapping[str, ShardSpec]],
                  split_elements: int = SPLIT_ELEMENTS) -> list[dict[str, list[ShardSpec]]]:
    """For every rank, the disjoint sub-slices of its own holdings that it writes.

    `holdings[r]` maps tensor name -> the slice rank `r` holds.  Every unit of every tensor is
    assigned to exactly one rank holding it; the assignment balances elements written per rank
    (runs of at least `split_elements` elements are split among their holders, smaller ones go
    whole to the least-loaded holder).
    Returns, per rank, name -> pieces (maximal runs of adjacent units, each inside the rank's slice).
    """
    names = sorted({name for h in holdings for name in h})
    segments: list[tuple[int, str, int, int, list[int]]] = []  # (elements, name, lo, hi, holders)
    boxes: list[tuple[int, str, int, ShardSpec, list[int]]] = []  # (elements, name, index, piece, holders)
    for name in names:
        held = [(r, h[name]) for r, h in enumerate(holdings) if name in h]
        if any(s.is_block or not _same_tensor(held[0][1], s) for _, s in held):
            # some rank holds a block (or another pattern splits another dim): pieces are boxes
            boxes.extend((math.prod(piece.local_shape), name, i, piece, holders)
                         for i, (piece, holders) in enumerate(_box_pieces(held)))
            continue
        first = held[0][1]
        for _, spec in held[1:]:
            if not _same_tensor(first, spec):
                raise RuntimeError(f"tensor {name} is sharded differently across ranks: {first} vs {spec}")
        bounds = sorted({b for _, s in held for b in (s.lo, s.hi)})
        unit = _unit_elements(first)
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            holders = [r for r, s in held if s.lo <= a and b <= s.hi]
            if not holders:
                continue
            # A large run held by k ranks is cut into k parts, so every holder can take one.
            parts = min(len(holders), b - a) if (b - a) * unit >= split_elements else 1
            for i in range(parts):
                lo, hi = a + (i * (b - a)) // parts, a + ((i + 1) * (b - a)) // parts
                segments.append(((hi - lo) * unit, name, lo, hi, holders))
    load = [0] * len(holdings)
    owner: dict[tuple[str, int], int] = {}
    for size, name, a, _, holders in sorted(segments, key=lambda s: (-s[0], s[1], s[2])):
        r = min(holders, key=lambda x: (load[x], x))
        load[r] += size
        owner[(name, a)] = r
    out: list[dict[str, list[ShardSpec]]] = [{name: [] for name in h} for h in holdings]
    for size, name, _, piece, holders in sorted(boxes, key=lambda s: (-s[0], s[1], s[2])):
        r = min(holders, key=lambda x: (load[x], x))
        load[r] += size
        out[r][name].append(piece)
    for _, name, a, b, _ in sorted(segments, key=lambda s: (s[1], s[2])):
        r = owner[(name, a)]
        spec = holdings[r][name]
        pieces = out[r][name]
        if pieces and pieces[-1].hi == a:  # extend the previous piece: keep chunks maximal
            a = pieces.pop().lo
        pieces.append(ShardSpec(spec.global_shape, spec.dim, spec.unit_size, a, b))
    return out


def _box_pieces(held: Sequence[tuple[int, ShardSpec]]) -> list[tuple[ShardSpec, list[int]]]:
    """The common refinement of the boxes (element ranges per dim) that ranks hold of one tensor (1D or 2D)
    some hold as a block (`ntp.pattern=block`) or split along another dim: each piece as a spec of
    one-element units (a block spec in 2D), with its holders."""
    shape = held[0][1].global_shape
    for _, spec in held[1:]:
        if spec.global_shape != shape:
            raise RuntimeError(f"a tensor is held with shapes {shape} and {spec.global_shape}")
    spans = [(r, [(o, o + n) for o, n in zip(s.offsets, s.local_shape, strict=True)]) for r, s in held]
    cuts = [sorted({x for _, span in spans for x in span[d]}) for d in range(len(shape))]
    out = []
    for box in itertools.product(*(list(zip(c[:-1], c[1:], strict=False)) for c in cuts)):
        holders = [r for r, span in spans
                   if all(s[0] <= a and b <= s[1] for s, (a, b) in zip(span, box, strict=True))]
        if not holders:
            continue
        if len(box) == 1:
            out.append((ShardSpec.split(shape, 0, 1, *box[0]), holders))
        else:
            out.append((ShardSpec.block(shape, (0, 1, *box[0]), (1, 1, *box[1])), holders))
    return out


def write_pieces(rank: int, holdings: Sequence[Mapping[str, ShardSpec]]) -> dict[str, list[ShardSpec]]:
    """The pieces `rank` writes (see `assign_pieces`)."""
    return assign_pieces(holdings)[rank]
