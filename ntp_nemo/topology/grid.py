"""Block sharding's device grid: the q x q grid a layer of square degree `q*q` runs on (`ntp.pattern`).

A layout slot whose pattern is `block` and whose effective degree `t` in a replica is a square `q*q > 1`
runs on the `t` ranks of its TP group (the same chunk of the stage's ranks a row/column layer of degree
`t` uses) arranged as a q x q grid: position `j` of the group is grid row `j // q`, grid column `j % q`.
Activations are split by batch along grid rows and by features along grid columns; weights are split in
blocks (output rows over grid rows, input columns over grid columns: `ntp_nemo.parallel.block`).  A
slot whose degree is not a square (a grid replica that lost a rank and shrank to 3) or is 1 runs
row/column: that is how a grid replica continues as a 1D replica at a reduced degree.

The grid's collectives run in its row groups (the `q` ranks of one grid row) and column groups (the `q`
ranks of one grid column); `grid_group_tuples` lists them so that every rank creates them alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ntp_nemo.topology.tp_context import TPContext

ROW_COLUMN, BLOCK = "row_column", "block"
PATTERNS = (ROW_COLUMN, BLOCK)


def grid_side(degree: int) -> int | None:
    """q with q * q == degree and q > 1, else None (no grid: the slot runs row/column)."""
    q = math.isqrt(degree)
    return q if q > 1 and q * q == degree else None


def slot_patterns(pattern: Sequence[str] | str, slots: int) -> tuple[str, ...]:
    """Per-slot patterns of a layout with `slots` slots: one name for all, or one per slot; empty means
    row/column everywhere.  A ValueError names an unknown pattern or a wrong count."""
    if isinstance(pattern, str):
        pattern = (pattern,) * slots
    out = tuple(str(p) for p in pattern) or (ROW_COLUMN,) * slots
    bad = [p for p in out if p not in PATTERNS]
    if bad:
        raise ValueError(f"unknown sharding pattern {bad[0]!r}: expected one of {', '.join(PATTERNS)}")
    if len(out) != slots:
        raise ValueError(f"{len(out)} sharding patterns for {slots} layout slots (embedding, layers, head)")
    return out


@dataclass(frozen=True)
class GridContext(TPContext):
    """A layer's q x q grid as seen from one rank (a TPContext: `size = q*q`, `rank` its position in the
    grid's TP group, `group` that group).  `row`, `col`: this rank's grid coordinates; `row_group`: the
    ranks of its grid row (group rank = grid column), `col_group`: those of its grid column (group rank
    = grid row).  `copies`: identical copies of the layer in the replica (as TPContext's)."""

    q: int = 1
    row: int = 0
    col: int = 0
    row_group: Any = None
    col_group: Any = None


def grid_ranks(ranks: Sequence[int], q: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(rows, columns) of the grid on `ranks` (q*q of them, in grid order)."""
    rows = [tuple(ranks[r * q:(r + 1) * q]) for r in range(q)]
    cols = [tuple(ranks[c::q]) for c in range(q)]
    return rows, cols


def grid_group_tuples(topology: Any, patterns: Sequence[str]) -> list[tuple[int, ...]]:
    """The row and column groups of every grid of `topology` under per-slot `patterns` (sorted; every
    rank computes the same list)."""
    seen: set[tuple[int, ...]] = set()
    for replica in range(topology.dp):
        degrees = {topology.degree(replica, s) for s, p in enumerate(patterns) if p == BLOCK}
        for t in degrees:
            q = grid_side(t)
            if q is None:
                continue
            for stage in range(topology.pp):
                ranks = topology.stage_ranks(replica, stage)
                for k in range(len(ranks) // t):
                    rows, cols = grid_ranks(ranks[k * t:(k + 1) * t], q)
                    seen.update(rows + cols)
    return sorted(seen)


class GridPlan:
    """A TP plan (`context(slot)`) whose block slots of square degree get a GridContext; the others keep
    the wrapped plan's TPContext (row/column)."""

    def __init__(self, plan: Any, topology: Any, rank: int, patterns: Sequence[str]) -> None:
        self.plan, self.topology, self.rank, self.patterns = plan, topology, rank, tuple(patterns)

    def context(self, slot: int) -> TPContext:
        ctx = self.plan.context(slot)
        q = grid_side(ctx.size)
        if self.patterns[slot] != BLOCK or q is None:
            return ctx
        ranks = self.topology.layer_group_ranks(self.rank, slot)
        rows, cols = grid_ranks(ranks, q)
        row, col = divmod(ctx.rank, q)
        return GridContext(**{k: getattr(ctx, k) for k in ("size", "rank", "group", "copies", "align")},
                           q=q, row=row, col=col, row_group=self.topology.group(rows[row]),
                           col_group=self.topology.group(cols[col]))


def is_grid(ctx: TPContext) -> bool:
    return isinstance(ctx, GridContext)


__all__ = ["BLOCK", "PATTERNS", "ROW_COLUMN", "GridContext", "GridPlan", "grid_group_tuples", "grid_ranks",
           "grid_side", "is_grid", "slot_patterns"]
