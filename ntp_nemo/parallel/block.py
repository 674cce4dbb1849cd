"""Block (2D) sharding on a q x q grid: SUMMA linear layers, the embedding, norms and the relayouts.

Layout (`ntp_nemo.topology.grid.GridContext`).  An activation `[b, s, features]` of a micro-batch of `b`
sequences is split by sequences along grid rows and by features along grid columns: rank (i, c) holds
sequences `unit_interval(i, q, b)` and the feature units of position `c`.  A weight `W [out, in]` (the
`y = x W^T` of `torch.nn.Linear`) is split in blocks: rank (r, c) holds output units of position `r`
and input units of position `c`; its `ShardSpec` is a 2D interval (`ShardSpec.block`).  Every split
follows the balanced-interval rule (uneven where q does not divide), so intervals are those of a 1D
group of q ranks, applied once per grid axis.  A bias, a norm's weight and the position embedding are
split by features along grid columns and held by every grid row: their gradients are partial (each row
saw its sequences) and the gradient sync sums them over their holders, as it sums a KV head held by two
ranks (`ntp.parallel.grad_sync`; copies = the grid's copies in the replica).

SUMMA, `Y = X W^T` on the grid (`_SummaLinear`), in q steps each:
- forward: step l broadcasts the weight block of grid row l down each grid column (column group);
  every rank multiplies its input block by it and the partial products of a grid row are reduced onto
  its column l (row group): rank (i, l) holds `Y` of its sequences and output units of position l;
- backward: step l broadcasts the output gradient block of column l along each grid row and the
  weight block of row l down each column; every rank accumulates its input gradient (`dX = dY W`) and
  reduces its partial weight gradient `dY^T X` onto grid row l (column group).
Per rank and matmul (m tokens, k inputs, n outputs, p = q^2): it receives (q-1)/p of the weight three
times (two broadcasts, one reduction) and of the output twice (the forward's reduction and the output
gradient's broadcast): `(q-1)(3kn + 2mn)/p` elements; the input never moves (it stays where the previous
layer's output landed).  It keeps its input block `mk/p` for the backward.  A wide output (`2n > 3k`:
the MLP's up projection, an untied head; `out_columns`) puts W's output units over grid columns and its
inputs over grid rows instead, and moves the input instead of the output: `(q-1)(3mk + 3kn)/p`.

Collectives are broadcasts, reductions and all-reduces in the grid's row and column groups (created as
gloo subgroups: the `ntpdirect` TP backend has no reduce); none moves data between replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ntp_nemo.parallel.comm import compute_dtype
from ntp_nemo.parallel.layers import sharded_param
from ntp_nemo.topology.direct_group import BACKEND as DIRECT_BACKEND
from ntp_nemo.topology.grid import GridContext, is_grid
from ntp_nemo.topology.shard import ShardSpec, aligned_interval, unit_interval
from ntp_nemo.topology.tp_context import TPContext

Interval = tuple[int, int]


def rows_of(grid: GridContext, batch: int, row: int | None = None) -> Interval:
    """Sequences `[lo, hi)` of a `batch`-sequence micro-batch grid row `row` (default: this rank's) holds."""
    return unit_interval(grid.row if row is None else row, grid.q, batch)


def intervals(q: int, units: int, align: int = 1) -> tuple[Interval, ...]:
    """The units of every grid position (balanced; aligned to `align` for one-element units)."""
    return tuple(aligned_interval(p, q, units, align) for p in range(q))


def row_axis(grid: GridContext) -> TPContext:
    """The grid row as a 1D TP group: position = grid column (a vocabulary-parallel loss over it)."""
    return TPContext(size=grid.q, rank=grid.col, group=grid.row_group, copies=grid.copies)


# ---- collectives outside autograd ------------------------------------------------------------------
def _bcast(t: torch.Tensor, root: int, group) -> torch.Tensor:
    dist.broadcast(t, group=group, group_src=root)
    return t


def _reduce(t: torch.Tensor, root: int, group) -> torch.Tensor:
    """Sum onto group rank `root` (what other ranks hold afterwards is not read).  A grid row or column
    that is also a row/column layer's TP group on a CPU world is an `ntpdirect` group, which has no
    reduce: an all-reduce gives the root the same sum."""
    t = t.contiguous()
    if dist.get_backend(group) == DIRECT_BACKEND:
        dist.all_reduce(t, group=group)
    else:
        dist.reduce(t, group=group, group_dst=root)
    return t


def _held_or_empty(mine: torch.Tensor, held: bool, shape: Sequence[int]) -> torch.Tensor:
    return mine.contiguous() if held else mine.new_empty(tuple(shape))


class _SummaLinear(torch.autograd.Function):
    """`Y = X W^T` over the grid (module docstring).  `x`: [m_i, k_c], `weight`: [n_r, k_c];
    `out_lens[l]`: output elements of position l (rows of the weight block of grid row l)."""

    @staticmethod
    def forward(ctx, x, weight, grid, out_lens):  # type: ignore[override]
        q, row, col = grid.q, grid.row, grid.col
        y = None
        for step in range(q):
            w = _bcast(_held_or_empty(weight, row == step, (out_lens[step], x.shape[-1])), step,
                       grid.col_group)
            part = _reduce(x @ w.t(), step, grid.row_group)
            if col == step:
                y = part
        ctx.grid, ctx.out_lens = grid, out_lens
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grid, out_lens = ctx.grid, ctx.out_lens
        q, row, col = grid.q, grid.row, grid.col
        dx = torch.zeros_like(x)
        dw = None
        for step in range(q):
            g = _bcast(_held_or_empty(dy, col == step, (x.shape[0], out_lens[step])), step, grid.row_group)
            w = _bcast(_held_or_empty(weight, row == step, (out_lens[step], x.shape[-1])), step,
                       grid.col_group)
            dx.addmm_(g, w)
            part = _reduce(g.t() @ x, step, grid.col_group)
            if row == step:
                dw = part
        return dx, dw, None, None


class _SummaLinearOutColumns(torch.autograd.Function):
    """`Y = X W^T` with W's output units over grid columns and its input units over grid rows (the
    placement of a wide output, `BlockLinear.out_columns`): rank (r, c) holds W[n_c, k_r].  `x`:
    [m_i, k_c], `weight`: [n_c, k_r]; `in_lens[l]`: input elements of position l.  Output-stationary in
    the forward (X's blocks broadcast along rows, W's down columns); backward, W's and X's blocks are
    broadcast again and the partial dX (along rows) and dW (down columns) reduced onto their owners."""

    @staticmethod
    def forward(ctx, x, weight, grid, in_lens):  # type: ignore[override]
        q, row, col = grid.q, grid.row, grid.col
        y = x.new_zeros((x.shape[0], weight.shape[0]))
        for step in range(q):
            xs = _bcast(_held_or_empty(x, col == step, (x.shape[0], in_lens[step])), step, grid.row_group)
            w = _bcast(_held_or_empty(weight, row == step, (weight.shape[0], in_lens[step])), step,
                       grid.col_group)
            y.addmm_(xs, w.t())
        ctx.grid, ctx.in_lens = grid, in_lens
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grid, in_lens = ctx.grid, ctx.in_lens
        q, row, col = grid.q, grid.row, grid.col
        dx = dw = None
        for step in range(q):
            w = _bcast(_held_or_empty(weight, row == step, (weight.shape[0], in_lens[step])), step,
                       grid.col_group)
            xs = _bcast(_held_or_empty(x, col == step, (x.shape[0], in_lens[step])), step, grid.row_group)
            part = _reduce(dy @ w, step, grid.row_group)
            if col == step:
                dx = part
            part = _reduce(dy.t() @ xs, step, grid.col_group)
            if row == step:
                dw = part
        return dx, dw, None, None


class _GridSum(torch.autograd.Function):
    """All-reduce (sum) over `group` forward, identity backward: a value every holder then uses whole
    and counts once (the micro-batch's loss summed over grid rows)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class _GridStat(torch.autograd.Function):
    """All-reduce (sum) over `group` both ways: a per-token statistic over features split along a grid
    row (a norm's), which each rank then uses on its own features (so its gradient is partial)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def grid_sum(x: torch.Tensor, group) -> torch.Tensor:
    return _GridSum.apply(x, group) if group is not None else x


def _stat(x: torch.Tensor, group) -> torch.Tensor:
    return _GridStat.apply(x, group) if group is not None else x


def grid_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: GridContext,
              features: int, *, rms: bool, eps: float) -> torch.Tensor:
    """LayerNorm / RMSNorm of `x` [b_i, s, features_c] over all `features` (split along the grid row):
    the mean and the variance (or the mean square) are all-reduced over the row group."""
    if rms:
        ms = _stat(x.square().sum(-1, keepdim=True), grid.row_group) / features
        return x * torch.rsqrt(ms + eps) * weight
    mean = _stat(x.sum(-1, keepdim=True), grid.row_group) / features
    xc = x - mean
    var = _stat(xc.square().sum(-1, keepdim=True), grid.row_group) / features
    y = xc * torch.rsqrt(var + eps) * weight
    return y + bias if bias is not None else y


class _ReduceRowsToOwners(torch.autograd.Function):
    """Partial sums of a whole micro-batch `[b, ...]` (one per grid row of a column) to each row's own
    sequences: grid row i receives the sum of rows `rows_of(i)` (a reduction per grid row over the
    column group); backward, each row's gradient is broadcast back down the column."""

    @staticmethod
    def forward(ctx, partial, grid):  # type: ignore[override]
        ctx.grid, ctx.batch = grid, partial.shape[0]
        mine = None
        for i in range(grid.q):
            lo, hi = rows_of(grid, partial.shape[0], i)
            part = _reduce(partial[lo:hi], i, grid.col_group)
            if i == grid.row:
                mine = part
        return mine

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        grid, b = ctx.grid, ctx.batch
        parts = []
        for i in range(grid.q):
            lo, hi = rows_of(grid, b, i)
            parts.append(_bcast(_held_or_empty(g, i == grid.row, (hi - lo, *g.shape[1:])), i, grid.col_group))
        return torch.cat(parts), None


class _ToGrid(torch.autograd.Function):
    """A whole activation (replicated over the grid's ranks) to this rank's block; backward, the blocks'
    gradients assembled into the whole gradient on every rank (all-reduce of the zero-padded blocks over
    the grid's group)."""

    @staticmethod
    def forward(ctx, x, grid, feats):  # type: ignore[override]
        (blo, bhi), (flo, fhi) = rows_of(grid, x.shape[0]), feats[grid.col]
        ctx.grid, ctx.box, ctx.shape = grid, (blo, bhi, flo, fhi), x.shape
        return x[blo:bhi, ..., flo:fhi].contiguous()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        blo, bhi, flo, fhi = ctx.box
        full = g.new_zeros(ctx.shape)
        full[blo:bhi, ..., flo:fhi] = g
        dist.all_reduce(full, group=ctx.grid.group)
        return full, None, None


class _FromGrid(torch.autograd.Function):
    """This rank's block to the whole activation on every rank of the grid (all-reduce of the zero-padded
    blocks); backward, the (whole, replicated) gradient narrowed to the block."""

    @staticmethod
    def forward(ctx, x, grid, batch, feats):  # type: ignore[override]
        (blo, bhi), (flo, fhi) = rows_of(grid, batch), feats[grid.col]
        ctx.box = (blo, bhi, flo, fhi)
        full = x.new_zeros((batch, *x.shape[1:-1], feats[-1][1]))
        full[blo:bhi, ..., flo:fhi] = x
        dist.all_reduce(full, group=grid.group)
        return full

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        blo, bhi, flo, fhi = ctx.box
        return g[blo:bhi, ..., flo:fhi].contiguous(), None, None, None


def relayout(x: torch.Tensor, src: TPContext, dst: TPContext, batch: int, features: int,
             resplit: Callable[[torch.Tensor, TPContext, TPContext], torch.Tensor]) -> torch.Tensor:
    """The hidden state `x` (of `features` features, a `batch`-sequence micro-batch) from `src`'s layout
    to `dst`'s: identity on the same grid, a block of a whole activation, a whole activation from blocks,
    else `resplit` (the row/column layouts' sequence re-split)."""
    if is_grid(src) and is_grid(dst) and (src.q, src.row, src.col, src.group) == (
            dst.q, dst.row, dst.col, dst.group):
        return x
    if is_grid(src):
        x = _FromGrid.apply(x, src, batch, intervals(src.q, features))
        src = TPContext()
    if is_grid(dst):
        return _ToGrid.apply(resplit(x, src, TPContext()), dst, intervals(dst.q, features))
    return resplit(x, src, dst)


def out_columns(in_features: int, out_features: int) -> bool:
    """Whether a weight of a block-sharded layer puts its output units over grid columns (and its inputs
    over grid rows): where `2 n > 3 k` that moves (q-1)(3mk + 3kn)/p elements per rank instead of the
    (q-1)(3kn + 2mn)/p of the default placement (outputs over rows), which sends the wide output's
    partial sums."""
    return 2 * out_features > 3 * in_features


class BlockLinear(nn.Module):
    """`y = x W^T + b` with `W` in blocks over the grid (module docstring; a wide output, `out_columns`,
    puts W's output units over grid columns instead, `_SummaLinearOutColumns`).  `out_intervals[p]` /
    `in_intervals[p]`: the output / input units of grid position p (default balanced; a KV projection
    passes overlapping ones, a KV head read by two columns' query heads being held by both; the MLP's
    hidden columns and the vocabulary pass aligned ones, `ntp.shard_align`)."""

    def __init__(self, in_features: int, out_features: int, grid: GridContext, *, out_unit: int = 1,
                 in_unit: int = 1, out_intervals: Sequence[Interval] | None = None,
                 in_intervals: Sequence[Interval] | None = None, bias: bool = True,
                 std: float = 0.02) -> None:
        super().__init__()
        q = grid.q
        self.grid = self.tp = grid
        self.out_intervals = tuple(out_intervals or intervals(q, out_features // out_unit))
        self.in_intervals = tuple(in_intervals or intervals(q, in_features // in_unit))
        self.out_lens = tuple((hi - lo) * out_unit for lo, hi in self.out_intervals)
        self.in_lens = tuple((hi - lo) * in_unit for lo, hi in self.in_intervals)
        self.out_columns = out_columns(in_features, out_features)
        outs, ins = (grid.col, grid.row) if self.out_columns else (grid.row, grid.col)
        spec = ShardSpec.block((out_features, in_features), (0, out_unit, *self.out_intervals[outs]),
                               (1, in_unit, *self.in_intervals[ins]))
        self.weight = sharded_param(spec, grid.copies, ("normal", std))
        mine = self.out_intervals[grid.col]  # the output units of this rank's column
        self.bias = sharded_param(ShardSpec.split((out_features,), 0, out_unit, *mine), grid.copies,
                                  ("zeros",)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_columns:
            x, weight = _in_compute_dtype(x, self.weight)
            y = _SummaLinearOutColumns.apply(x.reshape(-1, x.shape[-1]), weight, self.grid, self.in_lens)
            y = y.view(*x.shape[:-1], y.shape[-1])
        else:
            y = block_linear(x, self.weight, self.grid, self.out_lens)
        return y + self.bias if self.bias is not None else y


def _in_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` and `weight` cast to the compute dtype (autocast's under mixed precision, else `x`'s), outside
    the SUMMA functions: their products, broadcasts and reductions then run in it forward and backward
    (the backward runs outside autocast), and autograd casts the weight's gradient back to its dtype."""
    dtype = compute_dtype(x)
    return x.to(dtype), weight.to(dtype)


def block_linear(x: torch.Tensor, weight: torch.Tensor, grid: GridContext, out_lens: Sequence[int]
                 ) -> torch.Tensor:
    """`x W^T` of a block-sharded `weight` for `x` [..., k_c]: [..., n of this rank's column]."""
    x, weight = _in_compute_dtype(x, weight)
    y = _SummaLinear.apply(x.reshape(-1, x.shape[-1]), weight, grid, tuple(out_lens))
    return y.view(*x.shape[:-1], y.shape[-1])


class BlockEmbedding(nn.Module):
    """The embedding table `[vocab, dim]` in blocks: rank (r, c) holds vocabulary rows of position r and
    features of position c (the placement of an output head's weight, so a tied head is `block_linear`
    of it).  Each rank looks up the ids of the whole micro-batch in its rows (zeros elsewhere); the
    partial rows of a grid column are reduced onto each grid row's sequences."""

    def __init__(self, num_embeddings: int, dim: int, grid: GridContext, *, std: float = 0.02) -> None:
        super().__init__()
        self.grid = self.tp = grid
        self.vocab_intervals = intervals(grid.q, num_embeddings, grid.align)
        self.feature_intervals = intervals(grid.q, dim)
        self.vocab_lo, self.vocab_hi = self.vocab_intervals[grid.row]
        self.out_lens = tuple(hi - lo for lo, hi in self.vocab_intervals)
        self.weight = sharded_param(
            ShardSpec.block((num_embeddings, dim), (0, 1, self.vocab_lo, self.vocab_hi),
                            (1, 1, *self.feature_intervals[grid.col])), grid.copies, ("normal", std))

    @property
    def vocab_start(self) -> int:
        """First vocabulary row of the logits this rank holds (a tied head's: its column's)."""
        return self.vocab_intervals[self.grid.col][0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.vocab_lo) & (ids < self.vocab_hi)
        local = torch.where(inside, ids - self.vocab_lo, torch.zeros_like(ids))
        partial = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return _ReduceRowsToOwners.apply(partial, self.grid)


def feature_param(shape: tuple[int, ...], dim: int, grid: GridContext, init: tuple) -> nn.Parameter:
    """A parameter split by features (`dim`) along grid columns and held by every grid row (a norm's
    weight, the position embedding): its rows' partial gradients are summed by the gradient sync."""
    lo, hi = intervals(grid.q, shape[dim])[grid.col]
    return sharded_param(ShardSpec.split(shape, dim, 1, lo, hi), grid.copies, init)


__all__ = ["BlockEmbedding", "BlockLinear", "block_linear", "feature_param", "grid_norm", "grid_sum",
           "intervals", "relayout", "row_axis", "rows_of"]
