"""Worker-side half of supervision: what a worker launched by the supervisor does differently.

- Lost ranks are handled by the supervisor (it SIGKILLs what is left of an attempt); SIGTERM and
  SIGUSR1 stay a coordinated preemption (`ntp_nemo.lightning.callbacks.PreemptionCheckpoint`).
- On the first step it completes in an attempt that follows a failure, global rank 0 records the
  goodput event `recovery_done` with the new layout.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.goodput import events as ev


class SupervisedWorker(Callback):
    def __init__(self, recovering: bool, attempt: int = 0) -> None:
        self.recovering = recovering
        self.attempt = attempt

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.recovering:
            return
        self.recovering = False
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        goodput = GoodputCallback.of(trainer)
        info = getattr(trainer.strategy, "layout_info", {}) or {}
        if goodput is not None:
            goodput.record(
                ev.RECOVERY_DONE, layout=info.get("layout"), step=trainer.global_step, attempt=self.attempt,
                mode="restart",
            )
