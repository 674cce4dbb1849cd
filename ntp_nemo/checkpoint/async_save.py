"""Checkpoint saves that overlap training (the default: `checkpoint.async_save=true`).

Only the snapshot blocks: the pieces this rank writes are copied into host buffers that are
reused from save to save (pinned when the state is on a GPU), and every generator's state is
captured.  Writing, digesting, the index, the manifest and the commit run in a background thread,
whose collectives go over a dedicated gloo process group, so they never interleave with the
training loop's collectives on the default group.  One save is in flight at a time: a new `save`
(or `wait`) first waits for the previous commit, so checkpoints commit in step order, the staging
buffers are free again, and memory holds one snapshot.  A process killed during the background
write leaves only `NAME.tmp/`: the previous checkpoint stays the latest valid one.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.checkpoint.sharded import THREADS, Staging, WritePlan, take_snapshot, write_snapshot


class AsyncCheckpointSaver:
    """Background checkpoint writer; `save` is collective (every rank calls it for the same steps)."""

    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ntp-checkpoint")
        self._pending: Future | None = None
        self._group: Any = None
        self._group_ready = False
        self._plan = WritePlan()
        self._staging = Staging()
        self.threads = threads

    def _checkpoint_group(self) -> Any:
        if not self._group_ready:  # collective, on the caller's thread, at the first save of every rank
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")
            self._group_ready = True
        return self._group

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def save(self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, Any] | None = None, *, step: int, layout: Any = None,
             keep_last: int | None = None) -> Future:
        """Snapshot now, write and commit `path` in the background; the Future yields `path`.

        Same contents and on-disk format as `save_checkpoint`.  Training may change the model and
        optimizer as soon as this returns.
        """
        self.wait()
        group = self._checkpoint_group()
        snap = take_snapshot(model, optimizer, group=group, plan=self._plan, staging=self._staging)
        extra, layout = copy.deepcopy(dict(extra or {})), copy.deepcopy(layout)
        self._pending = self._pool.submit(write_snapshot, path, snap, extra, step=step, layout=layout,
                                          keep_last=keep_last, group=group, threads=self.threads)
        return self._pending

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; re-raises its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Finish the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
