"""Autograd-aware collectives for tensor parallelism (Megatron's "regions").

`copy_to_tp`: identity forward, all-reduce of the gradient backward (input of a column-parallel
layer).  `reduce_from_tp`: all-reduce forward, identity backward (output of a row-parallel layer).
With a group of one rank both are identities, so the same model runs unsharded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ntp_nemo.topology.tp_context import TPContext


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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a TP region computes in: autocast's where autocast is on for `x`'s device, else `x`'s."""
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if x.is_floating_point() and autocast:
        return torch.get_autocast_dtype(device)
    return x.dtype


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` cast to the region's compute dtype at the region boundary (as Megatron does under mixed
    precision): the norms keep their outputs in float32 under autocast, and without the cast the
    collectives of the region (the SP all-gathers, the input-gradient all-reduces) would move float32
    where the GEMMs read bfloat16.  Identity outside autocast."""
    dtype = compute_dtype(x)
    return x if dtype == x.dtype else x.to(dtype)


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group) if tp.sharded else x


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group) if tp.sharded else x


def all_reduce_(x: torch.Tensor, tp: TPContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (no-op for an unsharded layer)."""
    if tp.sharded:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


# ---- device-checked collectives of the training step ---------------------------------------------
def same_device(actual: torch.device, expected: torch.device) -> bool:
    """`cuda` (no index) matches any `cuda:i`; otherwise type and index must agree."""
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


def check_device(tensor: torch.Tensor, device: torch.device, what: str = "tensor") -> torch.Tensor:
    """Raise a clear RuntimeError when `tensor` is not on the runtime's `device`.

    On CPU with gloo a misplaced tensor would pass silently, while NCCL rejects (or hangs on) it; this
    check makes the mistake visible on any machine, including the meta device of a dry run."""
    if not same_device(tensor.device, device):
        raise RuntimeError(
            f"{what} is on {tensor.device} but the runtime's device is {device}: every tensor of the "
            f"training step must live on the runtime's device (a collective on a {device.type} process "
            "group cannot take it)."
        )
    return tensor


def all_reduce_on(tensor: torch.Tensor, device: torch.device, group=None, op=dist.ReduceOp.SUM,
                  what: str = "all-reduce buffer") -> torch.Tensor:
    """In-place all-reduce of a tensor that must be on `device` (checked first)."""
    check_device(tensor, device, what)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor
