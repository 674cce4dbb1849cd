"""A row-parallel region exit whose collective runs while the caller computes (`ntp.tp_chunks`).

Domino-style chunking splits each micro-batch along the batch into chunks and runs the transformer layers
chunk after chunk, sublayer by sublayer (`models.transformer.DecoderLM.run_blocks`): the all-reduce of
one chunk's attention or MLP output (the reduce-scatter under sequence parallelism) is launched without
waiting, and the next chunk's sublayer is computed while it runs; the caller waits for it only when that
chunk's next sublayer needs its input.  The exit is split into two autograd functions:

- `launch_exit(partial, tp)`: launches the collective on the row-parallel GEMM's partial sums and returns
  a `Launched` (the graph link and the `Pending` collective);
- `finish_exit(launched)`: waits for it and returns what `sequence.exit_tp_region` would have returned;
  its backward is the exit's (identity without SP, the all-gather of the slices under SP).

The values are those of the serial exit bit for bit: the same collective on the same partial sums.  On
CUDA `Pending.wait()` makes the current stream wait for the communication stream (not run on a GPU yet);
on gloo TP groups the collective runs on gloo's thread; on `ntpdirect` groups (the CPU default) it is
done when its call returns, so nothing overlaps there.
"""

from __future__ import annotations

import dataclasses

import torch

from ntp_nemo.parallel.sequence import (
    Pending,
    _all_gather_seq,
    seq_split,
    start_all_reduce,
    start_reduce_scatter_seq,
)
from ntp_nemo.topology.tp_context import TPContext


@dataclasses.dataclass
class Launched:
    """A region exit in flight: `link` carries the autograd graph from the partial sums to the result;
    `box` holds the collective (None: nothing to wait for, `link` is the result); `done`: the layer's
    whole output (bias included) is `link` already."""

    link: torch.Tensor
    tp: TPContext
    box: _Box | None = None
    done: bool = False


class _LaunchExit(torch.autograd.Function):
    """Forward: launch the exit's collective on `partial` and keep it in `box`; the output only links
    `partial` to `_FinishExit` in the graph (it is not read).  Backward: identity (`_FinishExit` has
    already turned the result's gradient into the partial sums')."""

    @staticmethod
    def forward(ctx, partial, tp, box):  # type: ignore[override]
        if seq_split(tp) > 1:
            box.pending = start_reduce_scatter_seq(partial, tp)
        else:
            partial = partial.contiguous()
            box.pending = start_all_reduce(partial, tp)
        return partial

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


class _FinishExit(torch.autograd.Function):
    """Forward: wait for the collective `box` holds and return its result.  Backward: the serial exit's
    (`sequence._ReduceFromTP`: identity; `sequence._ReduceScatterToSequence`: all-gather of the slices)."""

    @staticmethod
    def forward(ctx, link, tp, box):  # type: ignore[override]
        ctx.tp, ctx.seq_len = tp, link.shape[1]
        pending, box.pending = box.pending, None
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if seq_split(ctx.tp) > 1:
            return _all_gather_seq(grad.contiguous(), ctx.tp, ctx.seq_len), None, None
        return grad, None, None


class _Box:
    """The collective between the two functions of one exit."""

    pending: Pending | None = None


def launch_exit(partial: torch.Tensor, tp: TPContext) -> Launched:
    """The row-parallel exit of `partial` (this rank's partial sums, [b, S, ...]) launched: all-reduce,
    or reduce-scatter to the sequence slices under SP; nothing launched on an unsharded group."""
    if not tp.sharded:
        return Launched(partial, tp)
    box = _Box()
    link = _LaunchExit.apply(partial, tp, box)
    return Launched(link, tp, box)


def finish_exit(launched: Launched) -> torch.Tensor:
    """Wait for `launched` and return the exit's result (as `sequence.exit_tp_region` returns it)."""
    if launched.box is None:
        return launched.link
    return _FinishExit.apply(launched.link, launched.tp, launched.box)


def finished(result: torch.Tensor, tp: TPContext) -> Launched:
    """An exit already completed by the caller (a quantised layer's own forward): `finish_exit` returns
    `result`."""
    return Launched(result, tp, done=True)
