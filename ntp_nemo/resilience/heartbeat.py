"""Per-rank progress heartbeats: each worker rewrites `failover/heartbeats/rank_NNNNN.json` at every
phase of its loop (setup, start and end of each step, checkpoint saves, validation, end).

A heartbeat is progress, not mere liveness: it is written by the training thread, so a rank stuck in
a kernel, a collective or an endless sleep stops writing it.  When one rank hangs, its peers block in
their next collective a moment later, after having reported one phase more; the rank furthest behind
is therefore the suspect (`suspects`).

Only processes a monitor of ours watches write them (the supervisor's forked workers); under
torchrun/SLURM nothing reads them and the supervisor leaves the callback out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.resilience.beats import beat_path


class Heartbeat(Callback):
    """Writes this rank's heartbeat file at each phase (one small atomic file replace)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._path: Path | None = None
        self._tmp: Path | None = None
        self._done_t: float | None = None  # the end of this process's last completed step

    def beat(self, trainer: Trainer, phase: str, step: int) -> None:
        if self._path is None:  # one file per process, named by its rank at its first beat: the monitor
            # maps a beat to its process by pid (live recovery renumbers ranks and leaves some idle)
            self._path = beat_path(self.directory, trainer.global_rank)
            self._tmp = self._path.with_suffix(".tmp")
        doc: dict[str, Any] = {"step": step, "phase": phase, "t": time.time(), "pid": os.getpid()}
        if self._done_t is not None:  # kept in every later beat: a step's start replaces its end's beat
            doc["done_t"] = self._done_t
        assert self._tmp is not None
        self._tmp.write_text(json.dumps(doc))
        os.replace(self._tmp, self._path)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.beat(trainer, "setup", trainer.global_step)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.beat(trainer, "train_start", trainer.global_step)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done_t is None and getattr(pl_module, "compile_blocks", False):
            # `trainer.compile`: this process's first step compiles the blocks (15 to 50 s for the test
            # models on 2 cores, minutes for a large one) without a beat; it is start-up, bounded by
            # fault.startup_timeout_s, not a step that went silent past fault.heartbeat_timeout_s.
            self.beat(trainer, "setup", trainer.global_step + 1)
            return
        self.beat(trainer, "step_start", trainer.global_step + 1)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._done_t = time.time()
        self.beat(trainer, "step_end", trainer.global_step)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.beat(trainer, "save", trainer.global_step)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.beat(trainer, "validation", trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.beat(trainer, "end", trainer.global_step)
