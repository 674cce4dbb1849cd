"""Autograd-aware collectives for tensor parallelism (Megatron's "regions").

`copy_to_tp`: identity forward, all-reduce of the gradient backward (input of a column-parallel
layer).  `reduce_from_tp`: all-reduce forward, identity backward (output of a row-parallel layer).
With a group of one rank both are identities, so the same model runs unsharded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ntp_nemo.parallel.tp_context import TPContext


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group) if tp.sharded else x


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group) if tp.sharded else x


def all_reduce_(x: torch.Tensor, tp: TPContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (no-op for an unsharded layer)."""
    if tp.sharded:
        dist.all_reduce(x, op=op, group=tp.group)
    return x
