"""Block (SUMMA) and row/column sharding of each matmul class, measured on real gloo runs beside the
model of `ntp-plan --patterns` (`ntp_nemo/planner/patterns.py`): bytes each rank receives and the memory
each rank keeps (weights with their gradient and AdamW state, and the activation saved for the backward).

    python bench/block_sharding.py [--degrees 4,9] [--batch 6] [--seq 32]

For each degree p (a q x q grid for block), forked gloo workers (one torch thread each) build one layer
of each matmul class of a small Llama-shaped model (qkv, attn out, mlp up (gate and up), mlp down, head;
shapes divisible by 2 and 3 so blocks are even) as the model builds it: `BlockLinear` on the grid
(`ntp_nemo.parallel.block`), and `ColumnParallelLinear` / `RowParallelLinear` on a 1D TP group of p
ranks.  One forward and backward of a micro-batch of `--batch` sequences of `--seq` tokens (m tokens)
runs, then one AdamW step.  Measured on every rank:

- bytes received: the collectives are wrapped while the layer runs and each call counted as the bytes
  this rank receives under the textbook algorithm of that collective (broadcast: the tensor, on every
  rank but the root; reduce: the other ranks' tensors, on the root; all-reduce: a ring's 2(n-1)/n of
  the tensor); the mean over ranks is printed (with even blocks every rank's is the same);
- memory kept: the bytes of the layer's parameters, gradients and AdamW state after the step, plus the
  tensors autograd saved for the backward that are not parameters (`saved_tensors_hooks`).

Predicted: `block_cost` / `row_column_cost` for the same k, n, m and p, with 8-byte activations and 32
bytes of state per parameter (float64 weight, gradient and two AdamW moments).  The ratio column is
measured / predicted.  Timings are not the point (2 shared cores): counts only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.parallel.block import BlockLinear  # noqa: E402
from ntp_nemo.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from ntp_nemo.planner.patterns import COLUMN, ROW, Matmul, block_cost, row_column_cost  # noqa: E402
from ntp_nemo.planner.shapes import DeviceModel  # noqa: E402
from ntp_nemo.runtime.runtime import RankPlace  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402

HIDDEN, KV, FFN, VOCAB = 96, 48, 192, 600
MATMULS = [Matmul("qkv", HIDDEN, HIDDEN + 2 * KV, COLUMN), Matmul("attn out", HIDDEN, HIDDEN, ROW),
           Matmul("mlp up", HIDDEN, 2 * FFN, COLUMN), Matmul("mlp down", FFN, HIDDEN, ROW),
           Matmul("head", HIDDEN, VOCAB, COLUMN)]
DEVICE = DeviceModel(name="cpu float64", peak_tflops=1.0, efficiency=1.0, act_bytes=8, grad_bytes=8,
                     state_bytes_per_param=32)


class Counter:
    """Wraps `dist.broadcast`, `dist.reduce` and `dist.all_reduce` while open: bytes this rank receives."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved: tuple = ()

    def __enter__(self) -> Counter:
        self._saved = (dist.broadcast, dist.reduce, dist.all_reduce)
        bcast, reduce, all_reduce = self._saved

        def counted_bcast(t, *a, group=None, group_src=None, **k):
            if dist.get_rank(group) != group_src:
                self.bytes += t.numel() * t.element_size()
            return bcast(t, *a, group=group, group_src=group_src, **k)

        def counted_reduce(t, *a, group=None, group_dst=None, **k):
            if dist.get_rank(group) == group_dst:
                self.bytes += (dist.get_world_size(group) - 1) * t.numel() * t.element_size()
            return reduce(t, *a, group=group, group_dst=group_dst, **k)

        def counted_all_reduce(t, *a, group=None, **k):
            n = dist.get_world_size(group)
            self.bytes += round(2 * (n - 1) / n * t.numel() * t.element_size())
            return all_reduce(t, *a, group=group, **k)

        dist.broadcast, dist.reduce, dist.all_reduce = counted_bcast, counted_reduce, counted_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.broadcast, dist.reduce, dist.all_reduce = self._saved


def _layer(mm: Matmul, pattern: str, ctx) -> torch.nn.Module:
    if pattern == "block":
        return BlockLinear(mm.k, mm.n, ctx, bias=False)
    if mm.side == COLUMN:
        return ColumnParallelLinear(mm.k, mm.n, ctx, bias=False)
    return RowParallelLinear(mm.k, mm.n, ctx, bias=False)


def _input(mm: Matmul, pattern: str, ctx, batch: int, seq: int) -> torch.Tensor:
    """This rank's input: the block (grid row's sequences, column's features), the whole input of a
    column-parallel layer, the rank's features of a row-parallel one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, mm.k, generator=gen, dtype=torch.float64)
    if pattern == "block":
        from ntp_nemo.parallel.block import intervals, rows_of

        lo, hi = rows_of(ctx, batch)
        flo, fhi = intervals(ctx.q, mm.k)[ctx.col]
        return x[lo:hi, :, flo:fhi].contiguous().requires_grad_()
    if mm.side == ROW:
        lo, hi = (ctx.rank * mm.k) // ctx.size, ((ctx.rank + 1) * mm.k) // ctx.size
        return x[..., lo:hi].contiguous().requires_grad_()
    return x.requires_grad_()


def worker(rank: int, world: int, batch: int, seq: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for pattern in ("block", "row_column"):
        layout = ResolvedLayout.make(Topology(world, [world], [world] * 3), pattern=pattern)
        ctx = RankPlace(layout, rank).plan.context(1)
        for mm in MATMULS:
            layer = _layer(mm, pattern, ctx).double()
            x = _input(mm, pattern, ctx, batch, seq)
            params = {p.data_ptr() for p in layer.parameters()}
            kept: dict[int, int] = {}

            def pack(t, kept=kept, params=params):
                if t.data_ptr() not in params:  # an activation (the input, or a view of it) saved
                    kept[t.data_ptr()] = t.numel() * t.element_size()
                return t

            with Counter() as counter:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = layer(x)
                y.backward(torch.ones_like(y))
            opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
            opt.step()
            state = sum(t.numel() * t.element_size() for p in layer.parameters()
                        for t in (p, p.grad, *opt.state[p].values()) if t.dim() > 0)
            out[(pattern, mm.name)] = {"bytes": counter.bytes, "memory": state + sum(kept.values())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", default="4,9")
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    m = args.batch * args.seq
    print(f"per rank, forward + backward of one micro-batch of {m} tokens ({args.batch} x {args.seq}), "
          "float64; measured on gloo workers, predicted by ntp_nemo/planner/patterns.py")
    print(f"{'p':>2}  {'matmul':<9} {'k x n':>9}  {'pattern':<10} {'KB moved':>9} {'model':>9} {'ratio':>6}"
          f"  {'KB kept':>8} {'model':>8} {'ratio':>6}")
    worst = 0.0
    for p in (int(d) for d in args.degrees.split(",")):
        results = run_workers(worker, p, args.batch, args.seq)
        for mm in MATMULS:
            for pattern, model in (("block", block_cost), ("row_column", row_column_cost)):
                cost = model(mm, m, p, DEVICE, 1e9, 0.0)
                moved = sum(r[(pattern, mm.name)]["bytes"] for r in results) / p
                kept = sum(r[(pattern, mm.name)]["memory"] for r in results) / p
                rb, rm = moved / cost.bytes_moved, kept / cost.memory_bytes
                worst = max(worst, abs(rb - 1), abs(rm - 1))
                name = pattern if pattern == "block" else f"1D {mm.side}"
                print(f"{p:>2}  {mm.name:<9} {f'{mm.k}x{mm.n}':>9}  {name:<10} {moved / 1e3:>9.1f} "
                      f"{cost.bytes_moved / 1e3:>9.1f} {rb:>6.3f}  {kept / 1e3:>8.1f} "
                      f"{cost.memory_bytes / 1e3:>8.1f} {rm:>6.3f}")
    print(f"largest deviation of measured from predicted: {100 * worst:.2f}%"
          f" ({'within' if worst <= 0.05 else 'beyond'} 5%)")
    assert math.isfinite(worst)


if __name__ == "__main__":
    main()
