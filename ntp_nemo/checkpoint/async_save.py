"""Checkpoint saves that overlap training (the default: `checkpoint.async_save=true`).

`save` blocks only to record what to write: the write plan, every generator's state, the
optimizer hyperparameters, the caller's `extra` and layout (copied), and the views of the pieces
this rank writes.  A background thread then copies those pieces into host buffers that are reused
from save to save ("staging"); a second one, once the copy is done, writes, digests, indexes,
writes the manifest and commits.  The writer runs at the lowest CPU priority (its threads inherit
it), so on a busy host it takes CPU from training only when training leaves some; the copy runs at
the caller's priority, since the next optimizer step may be waiting for it.  The writer's
collectives go over a dedicated gloo process group, so they never interleave with the training
loop's collectives on the default group.

The staging overlaps the next step's forward and backward, which only read the parameters.  Until
it is done, the tensors it copies must not change; only an optimizer step or a load changes them.
So `save` installs a step pre-hook on the optimizer it is given (one per saver, reused by every
save, removed by `close`) that holds `optimizer.step()` until the staging of the save in flight is
done, and a load (`ntp_nemo.checkpoint.load`) waits for it too.  Training waits only when it reaches
its optimizer step before the copy is done.  A caller that changes the state some other way calls
`staged()` first.  Without an optimizer that takes step hooks the copy is made inside `save`, as are
copies of GPU tensors (into pinned buffers, one DMA each, on the caller's stream) and of quantizer
scales.

One save is in flight at a time: a new `save` (or `wait`) first waits for the previous commit, so
checkpoints commit in step order, the staging buffers are free again, and memory holds one snapshot.
A process killed during the background staging or write leaves only `NAME.tmp/`: the previous
checkpoint stays the latest valid one.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.checkpoint.sharded import (
    THREADS,
    Snapshot,
    Staging,
    WritePlan,
    stage_live,
    take_snapshot,
    write_snapshot,
)


def _yield_cpu() -> None:
    """Run the writing thread (and the file-writer threads it starts, which inherit it) at the lowest
    CPU priority, so that on a busy host the write takes CPU from training only when training leaves
    some (Linux sets the nice value per thread; elsewhere this does nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class AsyncCheckpointSaver:
    """Background checkpoint writer; `save` is collective (every rank calls it for the same steps).

    Two background threads: one copies (at the caller's CPU priority: training may be waiting for
    it), one writes and commits (at the lowest priority unless `background_nice=False`).
    `defer_staging=False` copies the state inside `save` (no step guard), as a save without an
    optimizer always does."""

    def __init__(self, threads: int = THREADS, defer_staging: bool = True,
                 background_nice: bool = True) -> None:
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ntp-checkpoint-stage")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ntp-checkpoint",
                                          initializer=_yield_cpu if background_nice else None)
        self._pending: Future | None = None
        self._group: Any = None
        self._group_ready = False
        self._plan = WritePlan()
        self._staging = Staging()
        self._staged = threading.Event()
        self._staged.set()
        self._guard: tuple[weakref.ref, Any] | None = None  # (optimizer, its step pre-hook handle)
        self.threads = threads
        self.defer_staging = defer_staging
        self.guard_wait_s = 0.0  # how long optimizer steps waited for the last save's staging

    def _checkpoint_group(self) -> Any:
        if not self._group_ready:  # collective, on the caller's thread, at the first save of every rank
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # gloo on purpose: the background save's records (objects) travel here, beside the
                # training thread's collectives (`ntp_nemo.topology.groups` lists every gloo group).
                from ntp_nemo.topology.groups import group_timeout

                self._group = dist.new_group(backend="gloo", timeout=group_timeout())
            self._group_ready = True
        return self._group

    def prepare(self) -> None:
        """Create the writer's process group now (collective: every rank, before the first step), so
        that a job too large for its open-file limit fails at start-up rather than at the first save."""
        self._checkpoint_group()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    @property
    def guarded_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps wait for this saver's staging (None: none)."""
        return self._guard[0]() if self._guard is not None else None

    def _guard_steps(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Make `optimizer.step()` wait for the staging in flight; False when it cannot be hooked."""
        if optimizer is not None and self.guarded_optimizer is optimizer:
            return True
        self._unguard()
        if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
            return False
        saver = weakref.ref(self)  # the hook must not keep a dropped saver (and its buffers) alive

        def hold_step(opt: Any, args: Any, kwargs: Any) -> None:
            live = saver()
            if live is not None:
                live.staged()

        self._guard = (weakref.ref(optimizer), optimizer.register_step_pre_hook(hold_step))
        return True

    def _unguard(self) -> None:
        if self._guard is not None:
            self._guard[1].remove()
            self._guard = None

    def save(self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, Any] | None = None, *, step: int, layout: Any = None,
             keep_last: int | None = None) -> Future:
        """Record what to write now; stage, write and commit `path` in the background; the Future
        yields `path`.

        Same contents and on-disk format as `save_checkpoint`: the state as it is at this call.
        Training may run forward and backward at once; `optimizer.step()` waits (if it must) until
        the state has been copied.  Anything else that changes the parameters or the optimizer
        state in place must call `staged()` first.
        """
        self.wait()
        group = self._checkpoint_group()
        defer = self._guard_steps(optimizer if self.defer_staging else None)
        snap = take_snapshot(model, optimizer, group=group, plan=self._plan, staging=self._staging,
                             defer=defer)
        extra, layout = copy.deepcopy(dict(extra or {})), copy.deepcopy(layout)
        self.guard_wait_s = 0.0
        staged = None
        if snap.live:
            self._staged.clear()
            try:
                staged = self._stager.submit(self._stage, snap)
            except BaseException:
                self._staging_done()
                raise
        self._pending = self._writer.submit(self._write, staged, path, snap, extra, step=step, layout=layout,
                                            keep_last=keep_last, group=group)
        return self._pending

    def _staging_done(self) -> None:
        self._staged.set()

    def _stage(self, snap: Snapshot) -> None:
        try:
            stage_live(snap, self._staging)
        finally:  # a failed copy must not hold training back: its error comes out of the save's Future
            self._staging_done()

    def _write(self, staged: Future | None, path: str | os.PathLike, snap: Snapshot, extra: dict[str, Any], *,
               step: int, layout: Any, keep_last: int | None, group: Any) -> Path:
        if staged is not None:
            staged.result()
        return write_snapshot(path, snap, extra, step=step, layout=layout, keep_last=keep_last, group=group,
                              threads=self.threads)

    def staged(self) -> None:
        """Block until the save in flight has copied the state it writes (at once when it has)."""
        if not self._staged.is_set():
            t0 = time.perf_counter()
            self._staged.wait()
            self.guard_wait_s += time.perf_counter() - t0

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; re-raises its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Finish the save in flight, release the optimizer and stop the background thread."""
        try:
            self.wait()
        finally:
            self._unguard()
            self._stager.shutdown(wait=True)
            self._writer.shutdown(wait=True)
