"""Run-directory callbacks: `metrics.jsonl` (one line per optimizer step) and `summary.json`."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar

from ntp_nemo.lightning.signals import FORWARDED_INTERRUPT, STOP_SIGNALS


class MetricsJSONL(Callback):
    """Appends `{step, loss, tokens, step_time_s, layout, ...}` per optimizer step (global rank 0 only)."""

    RECENT = 64  # records kept in memory for a process that becomes rank 0 (see `on_train_batch_end`)

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._t0 = 0.0
        # What the run summary needs, in constant memory however long the job: the first and last records,
        # the steps of this run, and the sums of the steps after the first; and the latest records
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.steps = 0
        self.steady_tokens = 0
        self.steady_s = 0.0
        self.recent: deque[dict[str, Any]] = deque(maxlen=self.RECENT)
        self._writer = False  # this process is global rank 0 and writes the file

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A command keeps only the steps up to the one it resumes from (all later ones are redone):
        a fresh start rewrites the file, a rerun that resumes never duplicates a step. Relaunches after
        a failure inside one command (a supervisor's attempt > 0) append, so the steps they redo stay
        visible next to the goodput report's wasted progress."""
        if not trainer.is_global_zero:
            return
        self._writer = True
        if any(getattr(cb, "attempt", 0) > 0 for cb in trainer.callbacks):
            return
        start = int(trainer.global_step)
        kept: list[str] = []
        if start > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if int(json.loads(line)["step"]) <= start:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash
        self.path.write_text("".join(line + "\n" for line in kept))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Every rank keeps the history (the step's figures are the same on all after the fused
        # all-reduce), so a rank that becomes rank 0 in a live recovery has it; rank 0 writes the file.
        dt = time.perf_counter() - self._t0
        rec = dict(pl_module.last_step)
        info = getattr(trainer.strategy, "layout_info", {}) or {}
        rec.update(
            step_time_s=dt,
            tokens_per_s=rec["tokens"] / dt if dt > 0 else 0.0,
            layout=info.get("layout", "single"),
            capacity=info.get("capacity", 1.0),
            time=time.time(),
        )
        self.recent.append(rec)
        self.steps += 1
        if self.first is None:
            self.first = rec
        else:
            self.steady_tokens += rec["tokens"]
            self.steady_s += rec["step_time_s"]
        self.last = rec
        if not trainer.is_global_zero:
            self._writer = False  # a rejoin gives rank 0 back to a repaired process 0
            return
        records = [rec]
        if not self._writer:
            # This process became global rank 0 in a live recovery (again, after a rejoin gave the rank
            # back): the lost writer may have died after the survivors completed a step it never
            # recorded. Write every recent step of this process that the file lacks, so each completed
            # step has its record.
            self._writer = True
            last = _last_step(self.path)
            records = [r for r in self.recent if int(r["step"]) > last]
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))


def _last_step(path: Path, tail_bytes: int = 1 << 16) -> int:
    """The highest step among the last records of a metrics file (0 when there is none; lines cut short
    are skipped): its end only, since records are appended in step order and the file grows with the
    job."""
    last = 0
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all (temporary file + rename): a reader never sees it half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunSummary(Callback):
    """Writes `summary.json` at the end of training (final losses, throughput, goodput, layout)."""

    def __init__(self, run_dir: str | Path, metrics: MetricsJSONL) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = metrics
        self._start = time.time()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        m = self.metrics
        first, last = m.first, m.last
        tokens, secs = (m.steady_tokens, m.steady_s) if m.steps > 1 or first is None \
            else (first["tokens"], first["step_time_s"])
        summary: dict[str, Any] = {
            "steps": int(trainer.global_step),
            "steps_this_run": m.steps,
            "first_loss": first["loss"] if first else None,
            "final_loss": last["loss"] if last else None,
            "val_loss": getattr(pl_module, "last_val_loss", None),
            "tokens_per_s": tokens / secs if secs > 0 else None,
            "train_wall_s": time.time() - self._start,
            "layout": last["layout"]
            if last
            else getattr(trainer.strategy, "layout_info", {}).get("layout"),
            "run_dir": str(self.run_dir),
            "max_steps": int(trainer.max_steps),
        }
        stop = next((cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)), None)
        if stop is not None and stop.stopped and trainer.global_step < trainer.max_steps:
            summary["stopped_early"] = stop.signal_name or "signal"
        reason = callback_stop(trainer)
        if reason is not None:
            summary["stop_reason"] = reason
        goodput_file = self.run_dir / "goodput.jsonl"
        if goodput_file.exists():
            from ntp_nemo.goodput import compute_goodput, load_events

            report = compute_goodput(load_events(goodput_file))
            summary["goodput"] = report.goodput
            summary["capacity_fraction"] = report.capacity_fraction
        from ntp_nemo.goodput.incident_log import load_incidents
        from ntp_nemo.goodput.incident_log import summary as integrity_summary

        findings = load_incidents(self.run_dir)  # corruption and non-finite steps (`ntp-incidents RUN_DIR`)
        if findings:
            summary["integrity"] = integrity_summary(findings)
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint writing sharded checkpoint directories `step_000050` every N steps,
    plus one at the end of training; keep-last-k is applied by the strategy after each commit."""

    FILE_EXTENSION = ""

    def __init__(self, dirpath: str | Path, every_n_steps: int, save_on_end: bool = True) -> None:
        super().__init__(
            dirpath=str(dirpath),
            filename="step_{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_steps or None,
            every_n_epochs=0,
            save_top_k=-1,
            save_last=False,
            save_on_train_epoch_end=False,
            enable_version_counter=False,  # a step saved again replaces step_NNNNNN (no step_NNNNNN-v1)
        )
        self.save_on_end = save_on_end

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What Lightning's ModelCheckpoint restores (best/last paths and scores) names files of the run
        that saved it; with no monitored metric and every step's directory kept, none of it is used. A
        checkpoint from another run directory (`resume=PATH`) keeps this directory's (empty) state
        instead of Lightning's per-rank "dirpath has changed" warning."""
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            super().load_state_dict(state_dict)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not launcher_gone(trainer):  # a save is collective work the workers cannot finish alone
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if launcher_gone(trainer):
            return
        if self.save_on_end and trainer.global_step > 0:
            from ntp_nemo.checkpoint.manifest import checkpoint_problem
            from ntp_nemo.lightning.adapter import save_step_checkpoint

            path = Path(self.format_checkpoint_name({"step": trainer.global_step}))

            def committed() -> bool:
                saver = getattr(trainer.strategy, "saver", None)
                if saver is not None:  # an asynchronous save commits in the background
                    saver.wait()
                return checkpoint_problem(path) is None

            final = getattr(trainer.strategy, "final_save", None)
            if final is None:
                save_step_checkpoint(self, trainer)
            else:
                final(lambda again: save_step_checkpoint(self, trainer, again), committed)


class FinalValidation(Callback):
    """Validate after the last step even when `trainer.max_steps` is not a multiple of
    `trainer.val_every_n_steps`: at the last step, Lightning's own interval check is made to answer yes
    (`val_check_batch` set to this batch's count; training ends right after, so no later check reads it).
    Every rank decides from the same step numbers, so all of them validate together; nothing stops the
    loop early (a requested stop would change how Lightning ends the fit)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0 or trainer.global_step < trainer.max_steps:
            return
        every = trainer.val_check_batch
        done = trainer.fit_loop.epoch_loop.total_batch_idx + 1  # what Lightning's check counts
        if isinstance(every, int) and every > 0 and done % every != 0:
            trainer.val_check_batch = done


class StopAtStep(Callback):
    """Ends the invocation after `step` optimizer steps (a planned stop: the end checkpoint is written),
    while the LR schedule and data order still follow `trainer.max_steps`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


# Stop requests a worker answers by checkpointing and stopping together with the other ranks.
def parent_gone(launcher_pid: int) -> bool:
    """The process that forked this one (`launcher_pid`) is gone or going: this process has another parent
    now, or the launcher's main thread has exited (state Z in /proc). The second case matters after
    `kill -9` of a launcher with several threads: its threads die one by one, and when the main thread
    (which forked the workers) goes first, the kernel moves the workers to a surviving thread of the same
    process (their parent pid unchanged) and sends them their parent-death signal already."""
    if os.getppid() != launcher_pid:
        return True
    try:
        with open(f"/proc/{launcher_pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rpartition(")")[2].split()[:1]
    except OSError:  # no /proc (macOS): the parent pid is the only sign
        return False
    return state in (["Z"], ["X"])


def launcher_gone(trainer: pl.Trainer) -> bool:
    """This worker's launching process died (`kill -9` of `ntp-train`): its store and the coordination
    of the workers went with it, so the workers stop without announcing a checkpoint they cannot write."""
    stop = next((cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)), None)
    return stop is not None and stop.launcher_gone()


class PreemptionCheckpoint(Callback):
    """SIGTERM/SIGUSR1 (preemption notice) or SIGINT (Ctrl-C): finish the step, agree on the stop flag
    across all ranks (the flag rides in the training step's fused all-reduce, so no rank saves alone),
    then stop; the end-of-training checkpoint is written by `StepCheckpoint` when checkpointing is on.
    A second Ctrl-C stops the process at once (no checkpoint).

    Workers forked by `ntp-train` hold these signals from the fork (`hold_stop_signals`) and answer
    them from the start of training: a Ctrl-C before the first step stops after it. When the launching
    process dies, torch sends its workers SIGINT: they stop at the step's end without a checkpoint and
    say so (`launcher_gone`)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.sigint_seen = False  # a SIGINT reached this process itself (a second one stops it at once)
        self.stopped = False  # this run stopped on a signal (received here or by another rank)
        self.launcher_pid = os.getpid()  # built in the process that forks the workers (when one does)
        self.store_gone: str | None = None  # what hosted the job's store, when it died (a coordinator)

    def launcher_gone(self) -> bool:
        """The process hosting the job's store is gone: the launcher these workers were forked from
        (`launcher_pid`, dying or gone: `parent_gone`), or a cluster job's coordinator (`store_lost`)."""
        if self.store_gone is not None:
            return True
        return os.getpid() != self.launcher_pid and parent_gone(self.launcher_pid)

    def store_lost(self, what: str) -> None:
        """`what` (e.g. "the coordinator at HOST:PORT"), which hosted the job's store, died: stop at the end
        of the step with every rank agreeing, without a checkpoint (called from another thread)."""
        self.store_gone = what
        self.signal_name = "coordinator lost"
        self.requested = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Replaces the trainer's own SIGTERM handler (installed when the run started): that one broadcasts
        # from inside the handler, which can block in a collective the other ranks never join.
        import signal

        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._request)
        # Signals held since the fork are delivered now, to the handler just installed.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, n) for n in self.SIGNALS])

    def _request(self, signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        import signal

        if self.launcher_gone():
            self.requested = True
            self.signal_name = self.signal_name if self.store_gone is not None else "launcher lost"
            return
        if signum == signal.SIGINT and self.sigint_seen:
            # The second Ctrl-C: die of SIGINT now, as an uncaught Ctrl-C would (no checkpoint).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        self.sigint_seen = self.sigint_seen or signum == signal.SIGINT
        # The launcher's Ctrl-C, passed on (`kill -INT` of ntp-train, or the terminal's, seen here too).
        name = "SIGINT" if signal.Signals(signum).name == FORWARDED_INTERRUPT else signal.Signals(signum).name
        self.requested = True
        if self.signal_name is None or name == "SIGINT":
            self.signal_name = name

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The training step folds `requested` into its one fused all-reduce (NTPRuntime.step_scalars)
        # and leaves the agreed answer on the module: no collective or host read of its own here.
        agreed = getattr(pl_module, "stop_agreed", None)
        if agreed is None:  # a module without the fused step: agree with a MAX all-reduce on its device
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1.0 if self.requested else 0.0], device=trainer.strategy.root_device)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = bool(flag.item() > 0)
        if agreed:
            self.stopped = True
            if self.store_gone is not None:
                if trainer.is_global_zero:
                    print(f"{self.store_gone} is gone: stopping at step {trainer.global_step} without a "
                          "checkpoint (a save needs the job's store); the latest checkpoint stays valid; "
                          "resubmit with resume=auto", flush=True)
            elif self.launcher_gone():
                self.signal_name = "launcher lost"
                if trainer.is_global_zero:
                    print(f"the launching process (pid {self.launcher_pid}) is gone: stopping at step "
                          f"{trainer.global_step} without a checkpoint (the workers cannot finish a save "
                          "without it); a rerun resumes from the latest checkpoint written before",
                          flush=True)
            elif trainer.is_global_zero:
                ctrl_c = self.signal_name == "SIGINT"
                why = "interrupted (Ctrl-C)" if ctrl_c else "preemption signal received"
                more = "; press Ctrl-C again to stop at once without it" if ctrl_c else ""
                step = trainer.global_step
                saving = (f"checkpointing at step {step} and stopping" if _saves_on_stop(trainer)
                          else f"stopping at step {step} (checkpointing is off)")
                print(f"{why}: {saving}{more}", flush=True)
            trainer.should_stop = True


def callback_stop(trainer: pl.Trainer) -> str | None:
    """Why a callback of the user's (Lightning's `EarlyStopping`, or any that sets `trainer.should_stop`)
    ended training before trainer.max_steps: `EarlyStopping: <its message>`, or a line naming
    `trainer.should_stop`; None when training ran to the end or a stop signal or planned stop ended it."""
    step = int(trainer.global_step)
    if step >= int(trainer.max_steps):
        return None
    for cb in trainer.callbacks:
        if isinstance(cb, PreemptionCheckpoint) and cb.stopped:
            return None  # a stop signal: `stopped_early` says it
        if isinstance(cb, StopAtStep) and step >= cb.step:
            return None  # a planned stop of this invocation
    for cb in trainer.callbacks:
        message = getattr(cb, "stopping_reason_message", None)  # EarlyStopping (Lightning >= 2.5)
        if message:
            return f"{type(cb).__name__}: {message}"
    if trainer.should_stop:
        return "a callback set trainer.should_stop"
    return None


def _saves_on_stop(trainer: pl.Trainer) -> bool:
    return any(isinstance(cb, StepCheckpoint) and cb.save_on_end for cb in trainer.callbacks)


class MemoryReport(Callback):
    """Per-rank memory in one block, after `after_steps` steps of this run (or at the last step of a
    shorter one): one line per rank, each part as estimate (from the model slice and layout) / measured
    (parameters, gradients, optimizer state, activations; the estimate's total next to the process's
    max RSS).

    Every rank decides from the same step numbers, so all of them take part in the one gather. Not after
    a live recovery or rejoin (the state the report was set up with is gone, and a repaired process,
    whose start-up hook does not run, has none): the ranks of the new generation agree on skipping it.
    The gather runs as the strategy's other collectives between steps do (`NTPStrategy.between_steps`):
    a peer lost during it is recovered from like one lost during a checkpoint save, and the report is
    not printed."""

    def __init__(
        self, micro_batch_size: int, seq_len: int, global_microbatches: int, after_steps: int = 3
    ) -> None:
        self.mbs, self.seq, self.m, self.after = micro_batch_size, seq_len, global_microbatches, after_steps
        self._at: int | None = None  # the global step to report at (set at the start of training)
        self._state: Any = None  # the rank's state then

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(getattr(trainer.strategy, "recovery", None), "rejoining", False):
            return  # a repaired process: the survivors set theirs up long ago and skip it
        self._at = int(trainer.global_step) + self.after
        self._state = getattr(trainer.strategy, "state", None)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if self._at is None or (step != self._at and step < trainer.max_steps):
            return
        self._at = None  # once
        if getattr(trainer.strategy, "state", None) is not self._state:
            return
        import torch.distributed as dist

        from ntp_nemo.pipeline.memory import format_side_by_side, measure_memory, rank_memory_estimate

        est = rank_memory_estimate(pl_module.runtime, pl_module.model, global_microbatches=self.m,
                                   micro_batch_size=self.mbs, seq_len=self.seq)
        opt = trainer.optimizers[0] if trainer.optimizers else None
        line = format_side_by_side(est, measure_memory(pl_module.model, opt, pl_module.runtime.pipeline))
        lines: list | None = [line]
        if dist.is_available() and dist.is_initialized():
            gathered: list = [None] * dist.get_world_size()

            def gather() -> list:
                dist.all_gather_object(gathered, line)
                return gathered

            between = getattr(trainer.strategy, "between_steps", None)
            lines = between(gather, what="the memory report") if between is not None else gather()
        if lines is not None and trainer.is_global_zero:
            print(f"memory per rank after step {step}, MiB, estimate (model slice and layout) / measured:\n"
                  + "\n".join(f"  rank {r}: {s}" for r, s in enumerate(lines)), flush=True)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class StepProgress(ProgressBar):
    """Training progress in optimizer steps: `step N/total`, loss, tokens/s and ETA (no epochs).

    On a terminal a rich progress bar; otherwise (a pipe, a log file, a batch job) one plain line
    every `every` steps and at the last step. Only global rank 0 shows it: whichever process that is
    at the step (after a live recovery, a survivor)."""

    def __init__(self, every: int = 10, tty: bool | None = None) -> None:
        super().__init__()
        self.every = max(1, int(every))
        self.tty = tty
        self._enabled = True
        self._bar: Any = None
        self._task: Any = None
        self._t0 = 0.0
        self._first = 0
        self._tokens = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning's ProgressBar disables itself on every rank but 0 here; a live recovery can make any
        # process rank 0 later, so every rank keeps counting and whichever is rank 0 prints.
        self._trainer = trainer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first = int(trainer.global_step)
        self._t0, self._tokens = time.perf_counter(), 0
        if not trainer.is_global_zero or not self._enabled:
            return
        import os
        import sys

        if self.tty if self.tty is not None else os.isatty(sys.stdout.fileno()):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=trainer.max_steps, completed=self._first, stats="")

    def _stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[str, float | None]:
        step, total = int(trainer.global_step), int(trainer.max_steps)
        rec = getattr(pl_module, "last_step", {}) or {}
        elapsed = time.perf_counter() - self._t0
        done = step - self._first
        tps = self._tokens / elapsed if elapsed > 0 else 0.0
        eta = elapsed / done * (total - step) if done > 0 else None
        loss = rec.get("loss")
        text = f"loss {loss:.4f} | {tps:,.0f} tokens/s" if loss is not None else f"{tps:,.0f} tokens/s"
        return text, eta

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._enabled:
            return
        self._tokens += int((getattr(pl_module, "last_step", {}) or {}).get("tokens", 0))
        if not trainer.is_global_zero:
            return
        stats, eta = self._stats(trainer, pl_module)
        step, total = int(trainer.global_step), int(trainer.max_steps)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
        elif step % self.every == 0 or step >= total or trainer.should_stop:
            eta_text = _duration(eta) if eta is not None else "n/a"
            print(f"step {step}/{total} | {stats} | ETA {eta_text}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
