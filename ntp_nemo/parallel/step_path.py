"""The optimizer and the gradient path of a training step, as chosen by the memory/overlap options.

`build_optimizer` makes the AdamW of a run: `torch.optim.AdamW`, or `DistributedAdamW` (state sharded
along the fragment holder sets) with `distributed=True`.  `GradientPath` runs what happens between the
backward and `optimizer.step()`: the DP gradient sync (blocking, or overlapped with the backward) and
the clipping by the logical gradient's norm.  Used the same way by the Lightning module, the benchmarks
and the tests:

    path.begin_step(len(microbatches))       # before the first backward
    ... forward/backward of the micro-batches ...
    path.finish_sync()                        # after the last backward
    sq = path.grad_norm_sq_local()            # summed over the world (e.g. in the fused step all-reduce)
    path.clip_to_norm_(sq.sqrt(), max_norm)
    optimizer.step()

(`path.sync_and_clip(max_norm)` does the last three with its own all-reduce.)
"""

from __future__ import annotations

import torch
from torch import nn

from ntp_nemo.parallel.dist_optimizer import DistributedAdamW, adamw_param_groups
from ntp_nemo.parallel.grad_sync import GradientSynchronizer
from ntp_nemo.parallel.overlap import OverlappedGradSync

# Devices whose fused AdamW kernel torch ships for every floating dtype (not `meta`: the dry run).
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw_supported(model: nn.Module, same_positions: bool = True) -> bool:
    """Every parameter floating-point and on a device of `FUSED_ADAMW_DEVICES`, and, on CPU, every copy
    of an element held at the same position of its tensor (`same_positions`: every replica runs the same
    TP degree).  torch's fused CPU kernel updates a tensor's vectorised body and its scalar tail with
    differently rounded arithmetic, so two replicas holding one element at different offsets (an uneven
    layout: TP 2 and TP 1) would drift apart by units in the last place; the foreach AdamW rounds every
    position alike.  The CUDA kernel applies the same arithmetic to every element."""
    params = list(model.parameters())
    if not params or not all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params):
        return False
    return same_positions or all(p.device.type != "cpu" for p in params)


def use_fused_adamw(optimizer: torch.optim.Optimizer, model: nn.Module, same_positions: bool) -> None:
    """Switch a plain AdamW between its fused and foreach kernels for `model` on a new layout (a live
    reshard into or out of an uneven layout); the state (steps, moments) is the same for both."""
    if isinstance(optimizer, torch.optim.AdamW):
        fused = fused_adamw_supported(model, same_positions)
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = (True, None) if fused else (None, None)
        optimizer.defaults["fused"] = True if fused else None


def build_optimizer(model: nn.Module, sync: GradientSynchronizer, *, lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float, distributed: bool = False,
                    same_positions: bool = True) -> torch.optim.Optimizer:
    """AdamW with the decay (matrices) / no-decay (vectors) groups; sharded when `distributed`.

    The plain AdamW is torch's fused one (one kernel per parameter group instead of a dozen foreach
    passes; ~4x less optimizer CPU time on this machine) where the device has it and, on CPU, where every
    replica holds an element at the same position (`same_positions`, see `fused_adamw_supported`): it
    reorders the update's arithmetic, so its parameters differ from the foreach AdamW's by rounding (a
    few units in the last place over 5 steps: float64 within 1e-14, float32 within 1e-5, relative; the
    test pins it)."""
    groups = adamw_param_groups(model, weight_decay)
    if not distributed:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                                 fused=True if fused_adamw_supported(model, same_positions) else None)
    return DistributedAdamW(model, sync.plan, sync.group_of, groups, lr=lr, betas=betas, eps=eps,
                            weight_decay=weight_decay, bucket_bytes=sync.bucket_bytes,
                            world_group=getattr(sync, "world_group", None),
                            acc_dtype=getattr(sync, "acc_dtype", torch.float64))


class GradientPath:
    """Sync + clip of one step: plain (`GradientSynchronizer`), overlapped, and/or for a DistributedAdamW."""

    def __init__(self, model: nn.Module, sync: GradientSynchronizer, optimizer: torch.optim.Optimizer,
                 *, overlap: bool = False) -> None:
        self.sync = sync
        self.distributed = isinstance(optimizer, DistributedAdamW)
        self.optimizer = optimizer
        self.overlap = (OverlappedGradSync(model, sync.plan, sync.group_of, sync.bucket_bytes,
                                           optimizer if self.distributed else None) if overlap else None)

    def begin_step(self, backward_passes: int) -> None:
        if self.overlap is not None:
            self.overlap.begin_step(backward_passes)
        elif self.distributed:
            self.optimizer.prepare_grads()  # the backward accumulates into the optimizer's bucket buffers
        else:
            self.sync.prepare_grads()  # the backward accumulates into the sync's bucket buffers

    def finish_sync(self) -> None:
        """After the last backward: the whole DP sync (blocking, overlapped, or reduce-scatter)."""
        self._zero_missing_grads()
        if self.overlap is not None:
            self.overlap.finish()
        elif self.distributed:
            self.optimizer.reduce_scatter_grads()
        else:
            self.sync.sync()

    def grad_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the squared logical gradient norm (to be summed over the world)."""
        return (self.optimizer if self.distributed else self.sync).grad_norm_sq_local()

    def clip_to_norm_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        (self.optimizer if self.distributed else self.sync).clip_to_norm_(norm, max_norm)

    def sync_and_clip(self, max_norm: float) -> torch.Tensor | float:
        """`finish_sync`, then clip by the global norm (its own all-reduce); returns that norm."""
        self.finish_sync()
        if self.distributed:
            return self.optimizer.clip_grad_norm_(max_norm)
        return self.sync.clip_grad_norm_(max_norm)

    def _grad_buffers(self) -> list[torch.Tensor]:
        """The persistent flat buffers whose views are whole-fragment parameters' `.grad`s."""
        if self.distributed:
            return [buf for buf, _, _ in self.optimizer.grad_buffers.all()]
        if self.overlap is not None:
            return [buf for buf, _, _ in self.overlap.buffers.all()]
        return [b.buffer for b in self.sync.buckets() if b.buffer is not None]

    @torch.no_grad()
    def zero_grad(self) -> None:
        """After the update, for the next step: a `.grad` that is a view of a bucket buffer is zeroed with
        its buffer (one fill per bucket; the backward accumulates there, where the collective reads);
        every other `.grad` is set to None, so the next step's first backward writes it (autograd takes
        the computed gradient as it is) instead of a fill of zeros and an addition to them."""
        buffers = self._grad_buffers()
        held = {id(b) for b in buffers}
        for p in self.sync.params.values():
            g = p.grad
            if g is not None and not (g._base is not None and id(g._base) in held):
                p.grad = None
        for b in buffers:
            b.zero_()

    def _zero_missing_grads(self) -> None:
        """A parameter the backward did not reach (no `.grad`) gets a zero gradient, as a zero-filled
        `.grad` would have been: the optimizer decays it and the norm counts it like every other."""
        for p in self.sync.params.values():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)

    def remove(self) -> None:
        if self.overlap is not None:
            self.overlap.remove()
