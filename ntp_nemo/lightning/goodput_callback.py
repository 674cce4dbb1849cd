"""Lightning callback that records goodput events for the trainer's loop.

Only global rank 0 writes. The strategy and other components record their own events
(job start, restores, failures, asynchronous save ends) through `GoodputCallback.record`,
so all of a process's events go through one recorder and one state machine.

While training, rank 0 also logs the running goodput through the trainer's loggers (TensorBoard shows
it live): every `log_every_n_steps` steps (default: the trainer's) it calls each logger's `log_metrics`
with `goodput/goodput`, `goodput/progress`, `goodput/capacity_fraction`, `goodput/total_s`,
`goodput/productive_s` and `goodput/<category>_s` for every badput category (cumulative, the figures
`ntp-goodput RUN_DIR` prints), and the same over the last `window_s` seconds of job time as
`goodput/window/goodput`, `goodput/window/total_s`, `goodput/window/productive_s` and
`goodput/window/<category>_s`.  The figures come from an incremental `GoodputCalculator` fed each event
as it is recorded (the file's earlier events, read once, first), so each costs the same at step 100,000
as at step 10 and the logging never stops.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.calculator import GoodputCalculator, GoodputReport, WindowFigures, replay_file
from ntp_nemo.goodput.recorder import GoodputRecorder

DEFAULT_LAYOUT = {"layout": "single", "capacity": 1.0, "tokens_per_step": None}
DATA_WAIT_FLUSH_S = 0.005  # shorter waits are summed until they reach this, then recorded as one
WINDOW_S = 3600.0  # the rolling goodput's window: the last hour of job time


def goodput_metrics(report: GoodputReport, window: WindowFigures | None = None) -> dict[str, float]:
    """The scalars a logger receives for a (running) goodput report and its rolling window."""
    metrics = {
        "goodput/goodput": report.goodput,
        "goodput/progress": report.progress_goodput,
        "goodput/capacity_fraction": report.capacity_fraction,
        "goodput/total_s": report.total_s,
        "goodput/productive_s": report.productive_s,
    }
    metrics.update({f"goodput/{c}_s": report.badput_s[c] for c in ev.BADPUT_CATEGORIES})
    if window is not None:
        metrics.update({"goodput/window/goodput": window.goodput, "goodput/window/total_s": window.total_s,
                        "goodput/window/productive_s": window.productive_s})
        metrics.update({f"goodput/window/{c}_s": window.badput_s[c] for c in ev.BADPUT_CATEGORIES})
    return metrics


def _calculator_from(path: Path, window_s: float) -> GoodputCalculator:
    """A calculator fed the events already in the run's file (earlier lifetimes, the launcher's job_start)."""
    calc = GoodputCalculator(window_s=window_s)
    if not path.is_file():
        return calc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a line another process is writing right now
        try:
            return replay_file(path, GoodputCalculator(window_s=window_s))
        except (ConfigError, ValueError, KeyError, TypeError):
            return calc


class GoodputCallback(Callback):
    """Writes `run_dir/goodput.jsonl`: init done, step start/end with layout and capacity,
    checkpoint saves and job end (the recorder fsyncs only at the events that must survive a crash).

    `job_started`: the entry point recorded this lifetime's `job_start` already (before forking the
    workers, which inherit this object); otherwise the callback records it at setup."""

    def __init__(self, run_dir: str, fsync: bool = True, job_started: bool = False,
                 log_every_n_steps: int | None = None, window_s: float = WINDOW_S) -> None:
        self.run_dir = Path(run_dir)
        self.fsync = fsync
        self.job_started = job_started
        self.log_every_n_steps = log_every_n_steps  # running goodput to the loggers; None: the trainer's
        self.window_s = window_s
        self._calc: GoodputCalculator | None = None  # the job's goodput so far, for the running figures
        self._kept: list[dict[str, Any]] = []  # events recorded since the calculator last took them
        self._recorder: GoodputRecorder | None = None
        self._is_zero: bool | None = None
        self._open_step: int | None = None
        self._last_step_end = -1
        self._save_open = False  # a ckpt_save_start without its end
        self._external_saves = False  # another component records save start/end itself
        self._ended = False
        self._data_wait_s = 0.0  # waits for data not yet recorded

    @classmethod
    def of(cls, trainer: Trainer) -> GoodputCallback | None:
        """The trainer's goodput callback, for components (the strategy) that record through it."""
        return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)

    # -- recording -------------------------------------------------------------------------
    def _writer(self) -> GoodputRecorder | None:
        if self._is_zero is None:  # record() before setup: ask Lightning's rank-zero tracker
            from lightning.fabric.utilities.rank_zero import rank_zero_only

            self._is_zero = getattr(rank_zero_only, "rank", 0) == 0
        if self._is_zero and self._recorder is None:
            self._recorder = GoodputRecorder(self.run_dir, fsync=self.fsync)
        return self._recorder if self._is_zero else None

    def set_global_zero(self, is_zero: bool) -> None:
        """This process became (or stopped being) global rank 0 during the run (live recovery)."""
        self._is_zero = is_zero
        self._calc = None  # a new rank 0 reads what the previous one wrote

    def record(self, event: str, **fields: Any) -> None:
        """Record an event on global rank 0 (no-op elsewhere); for the strategy and other components."""
        if event in (ev.CKPT_SAVE_START, ev.CKPT_SAVE_END, ev.CKPT_SAVE_ABORT):
            self._external_saves = True
            if event == ev.CKPT_SAVE_START and self._save_open:
                return  # on_save_checkpoint already opened this save
            self._save_open = event == ev.CKPT_SAVE_START
        if event == ev.JOB_START:
            self.job_started = True
        if event == ev.JOB_END:
            self._ended = True
        writer = self._writer()
        if writer is not None:
            writer.record(event, **fields)

    def _close_auto_save(self, trainer: Trainer) -> None:
        """Lightning has no hook after the file is written: the save ended when the loop resumed."""
        if self._save_open and not self._external_saves:
            self._save_open = False
            self._write(ev.CKPT_SAVE_END, step=trainer.global_step)

    def _write(self, event: str, **fields: Any) -> None:
        writer = self._writer()
        if writer is not None:
            writer.record(event, **fields)

    # -- Lightning hooks -----------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._is_zero = trainer.is_global_zero
        self._calc = None
        self._ended = False
        self._open_step, self._last_step_end = None, -1
        writer = self._writer()
        if writer is not None and not self.job_started:
            self.job_started = True
            writer.record(ev.JOB_START, source="GoodputCallback")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step_end = trainer.global_step
        self._write(ev.INIT_DONE, step=trainer.global_step)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close_auto_save(trainer)
        self._record_data_wait(trainer)
        if self._open_step is None:  # with gradient accumulation a step spans several batches
            self._open_step = trainer.global_step + 1
            self._write(ev.STEP_START, step=self._open_step)

    def _record_data_wait(self, trainer: Trainer) -> None:
        """The batch just fetched was built in this process (no loader workers): that time was spent
        waiting for data. Recorded as `data_wait` (summed until DATA_WAIT_FLUSH_S, to bound the writes)."""
        dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
        self._data_wait_s += float(getattr(dataset, "last_fetch_s", 0.0) or 0.0)
        if self._data_wait_s >= DATA_WAIT_FLUSH_S:
            self._write(ev.DATA_WAIT, seconds=self._data_wait_s, step=trainer.global_step + 1)
            self._data_wait_s = 0.0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step <= self._last_step_end:
            return  # accumulating: the optimizer has not stepped yet
        info = getattr(trainer.strategy, "layout_info", None) or DEFAULT_LAYOUT
        tokens = (getattr(pl_module, "last_step", None) or {}).get("tokens", info.get("tokens_per_step"))
        self._write(
            ev.STEP_END,
            step=step,
            layout=str(info.get("layout", "single")),
            capacity=float(info.get("capacity", 1.0)),
            tokens=int(tokens) if tokens is not None else None,  # the step's tokens, from the module
        )
        self._open_step, self._last_step_end = None, step
        self._log_running_goodput(trainer, step)

    def running_calculator(self) -> GoodputCalculator | None:
        """The calculator of the job so far (None off rank 0): the file's events read once, then each event
        this process's recorder writes (the recorder keeps them until taken here)."""
        writer = self._writer()
        if writer is None:
            return None
        if self._calc is None:
            def earlier() -> list[dict[str, Any]]:  # under the recorder's lock: no event falls in between
                self._calc = _calculator_from(writer.path, self.window_s)
                return []

            self._kept = writer.remember(earlier)
        calc = self._calc
        assert calc is not None
        kept = self._kept
        if kept:
            taken = kept[:]  # another thread may append meanwhile: only what was taken goes
            del kept[: len(taken)]
            calc.feed_all(taken)
        return calc

    def running_report(self) -> GoodputReport | None:
        """The goodput of the job so far (None off rank 0, or before the calculator can place any time)."""
        calc = self.running_calculator()
        try:
            return calc.report() if calc is not None else None
        except ValueError:  # no events yet, or one the calculator cannot place: no figure this time
            return None

    def _log_running_goodput(self, trainer: Trainer, step: int) -> None:
        loggers = getattr(trainer, "loggers", None)
        every = self.log_every_n_steps or int(getattr(trainer, "log_every_n_steps", 0) or 0)
        if not loggers or not self._is_zero or every <= 0 or step % every:
            return
        report = self.running_report()
        if report is None:
            return
        assert self._calc is not None
        metrics = goodput_metrics(report, self._calc.window())
        for logger in loggers:
            logger.log_metrics(metrics, step=step)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A strategy that records its saves (NTPStrategy) opens and closes each one itself; Lightning
        # also calls this hook when it only builds the state dict (a live rejoin's hand-over), which
        # writes nothing and would leave a save without an end.
        if getattr(getattr(trainer, "strategy", None), "records_checkpoint_events", False):
            return
        if not self._save_open:
            self._save_open = True
            self._write(ev.CKPT_SAVE_START, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_auto_save(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_auto_save(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, ev.STATUS_OK)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(trainer, ev.STATUS_FAILED, reason=f"{type(exception).__name__}: {exception}"[:500])

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._finish(trainer, ev.STATUS_OK)
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        self._calc, self._kept = None, []

    def _finish(self, trainer: Trainer, status: str, **fields: Any) -> None:
        self._close_auto_save(trainer)
        if self._data_wait_s > 0 and not self._ended:
            self._write(ev.DATA_WAIT, seconds=self._data_wait_s, step=trainer.global_step)
            self._data_wait_s = 0.0
        if not self._ended:
            self._ended = True
            self._write(ev.JOB_END, status=status, step=trainer.global_step, **fields)
            self.job_started = False
