"""`train_step`: the one optimizer step of a rank, shared by the Lightning module, the dry run, the
tests' exactness cases and the benchmarks.

One step: this replica's micro-batches forward and backward through the runtime (the pipeline engine
when the layout has stages), the DP gradient sync of the rank's `GradientPath` (blocking, overlapped or
reduce-scattered), the step's scalars in one fused all-reduce (`NTPRuntime.step_scalars`), the
clipping by the global norm, then the optimizer (skipped on every rank alike when some rank found a
non-finite gradient), `zero_grad` and the LR schedule.  Device work only, except one host read of the
fused scalars, which decides the skip identically on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ntp_nemo.runtime.assemble import RankState
from ntp_nemo.runtime.compute_time import ComputeTimer

PHASES = ("microbatches", "grad_sync", "scalars", "optimizer")


@dataclass(frozen=True)
class StepResult:
    """What one `train_step` returns: the fused scalars on the device and their one host read."""

    scalars: torch.Tensor  # [loss_sum, grad_norm_sq, nonfinite, stop], summed over the world
    values: dict[str, float] | None  # `NTPRuntime.read_step_scalars(scalars)`; None when not read
    global_tokens: int

    @property
    def compute_s(self) -> tuple[float, ...] | None:
        """Every rank's compute seconds of this step (index = global rank), when it was timed."""
        return None if self.values is None else self.values.get("compute_s")

    @property
    def loss(self) -> float:
        """Mean token loss of the global batch (NaN when the scalars were not read)."""
        return math.nan if self.values is None else self.values["loss_sum"] / self.global_tokens

    @property
    def grad_norm(self) -> float:
        """Norm of the logical (unsharded) gradient before clipping."""
        sq = math.nan if self.values is None else self.values["grad_norm_sq"]
        return math.sqrt(sq) if sq >= 0 else math.nan

    @property
    def skipped(self) -> bool:
        """Some rank found a non-finite gradient, or the step's `guard` held it suspect: no update."""
        return self.values is not None and (self.values["nonfinite"] > 0 or bool(self.values.get("suspect")))

    @property
    def own(self) -> tuple[float, ...] | None:
        """Every rank's `own` statistic of this step (index = global rank), when it was gathered."""
        return None if self.values is None else self.values.get("own")

    @property
    def stop(self) -> bool:
        """Some rank asked to stop (preemption)."""
        return self.values is not None and self.values["stop"] > 0


def _no_phase(name: str) -> AbstractContextManager:
    return nullcontext()


def train_step(
    state: RankState,
    micro_batches: Sequence[torch.Tensor],
    global_tokens: int,
    *,
    max_norm: float | None,
    optimizer: Any = None,
    scheduler: Any = None,
    backward: Callable[[torch.Tensor], None] | None = None,
    stop: bool | Callable[[], bool] = False,
    before_update: Callable[[], None] | None = None,
    commit_check: Callable[[], None] | None = None,
    on_skip: Callable[[Any], None] | None = None,
    phase: Callable[[str], AbstractContextManager] | None = None,
    grad_norm: bool = True,
    read_scalars: bool = True,
    timer: ComputeTimer | None = None,
    own: Callable[[], torch.Tensor] | None = None,
    guard: Callable[[dict], bool] | None = None,
) -> StepResult:
    """One optimizer step of `state` on this replica's `micro_batches` of a global batch of
    `global_tokens` target tokens (the loss is normalised by it, so every layout sees the same gradient).

    `max_norm`: clip by the global gradient norm (None or 0: no clipping).  `optimizer`: what steps
    (default `state.optimizer`; the Lightning module passes its `LightningOptimizer`); `scheduler`: an LR
    schedule stepped after the update.  `backward(loss)`: how a micro-batch's loss is backpropagated
    (default `loss.backward()`; Lightning's `manual_backward`).  `stop`: this rank asks to stop; a
    callable is asked after the backward.  `before_update()`: runs after the host read and before the
    optimizer (a recovery that must not apply a step of an aborted generation raises there).
    `commit_check()`: the same question asked again after the collectives of the optimizer's own step
    (the distributed optimizer's parameter all-gather) and before it writes anything: an optimizer
    that takes it (`commit_check` attribute) runs its step as a transaction, and raising there leaves
    the parameters and the optimizer state as they were.
    `on_skip(optimizer)`: runs in place of the optimizer's step when the update is skipped.
    `phase(name)`: a context manager entered around each of `PHASES` (the dry run counts there).
    `grad_norm=False` hands the fused all-reduce a zero squared norm (clipping then does nothing): the
    dry run's shape-only steps, where no figure comes from it.  `read_scalars=False` leaves the fused
    scalars unread on the device and the optimizer steps (meta tensors hold no values: the dry run).
    `timer`: times this rank's micro-batch phase, and every rank's time rides on the fused scalars
    (`StepResult.compute_s`: straggler detection).  `own()`: this rank's own gradient statistic, asked
    after the micro-batches and before the DP sync (the integrity watch's), every rank's riding on the
    fused scalars (`StepResult.own`); `guard(values)`, asked after the host read: True holds the step
    suspect, and no rank applies its update (`values["suspect"]`, `StepResult.skipped`)."""
    runtime, path, model = state.runtime, state.grad_path, state.model
    opt = state.optimizer if optimizer is None else optimizer
    phase = phase or _no_phase
    micro = list(micro_batches)
    path.begin_step(len(micro))
    with phase("microbatches"), timer.phase("microbatches") if timer is not None else nullcontext():
        loss_sum = runtime.train_microbatches(model, micro, global_tokens, backward)
    mine = own() if own is not None else None  # before the sync: this rank's gradients alone
    with phase("grad_sync"):
        path.finish_sync()
    if grad_norm:
        sq = path.grad_norm_sq_local()
    else:
        sq = torch.zeros((), dtype=runtime.acc_dtype, device=runtime.device)
    with phase("scalars"):
        fused = runtime.step_scalars(loss_sum, sq, stop=stop() if callable(stop) else stop,
                                     compute_s=None if timer is None else timer.reading(runtime.device),
                                     own=mine)
    path.clip_to_norm_(fused[1].sqrt(), max_norm)
    values = runtime.read_step_scalars(fused, own=0 if mine is None else runtime.topology.world_size
                                       * mine.numel()) \
        if read_scalars else None  # the step's one host read
    if values is not None and guard is not None and values["nonfinite"] <= 0 and guard(values):
        values["suspect"] = 1.0
    if before_update is not None:
        before_update()
    result = StepResult(fused, values, global_tokens)
    if result.skipped:
        if on_skip is not None:
            on_skip(opt)
    else:
        with phase("optimizer"):
            inner = state.optimizer  # the optimizer itself (`opt` may be Lightning's wrapper of it)
            guarded = commit_check is not None and hasattr(inner, "commit_check")
            if guarded:
                inner.commit_check = commit_check
            try:
                opt.step()
            finally:
                if guarded:
                    inner.commit_check = None
    path.zero_grad()  # bucket buffers zeroed, every other gradient set to None (GradientPath)
    if scheduler is not None:
        scheduler.step()
    return result


__all__ = ["PHASES", "StepResult", "train_step"]
