"""Failure injection: the `fault` config group resolved into concrete faults, and the Lightning
callback that makes them happen inside the workers.

Kinds (each strikes global rank `rank` of the layout running at the time, at optimizer step `step`):

- `kill_rank`: the process exits at once with status 137 (`os._exit`, no cleanup), as a lost GPU or
  node looks to the launcher.  `phase` says when in the step: `step_start` (before the forward),
  `backward` (inside the first micro-batch's backward, when the gradient of this rank's first
  parameter is computed: before any gradient sync completes) or `optimizer` (right after this rank's
  optimizer step updated its weights, before the step ends) or `validation` (as the first validation
  after step `step` starts, before its collectives) or `rejoin` (live recovery: the repaired
  process started in place of rank `rank` dies during its start-up, before it joins the survivors) or
  `joining` (the repaired process dies once the launcher has decided to take it in, while the rejoin's
  generation forms: the survivors re-form without it) or `integrity` (as it enters the integrity watch's
  action on a finding at or after step `step`: its replays, cross replay, rollback or repair; the
  survivors are in that action's collectives).
- `hang`: the process stops making progress (sleeps forever); only heartbeats or timeouts reveal it.
- `slow`: a straggler for `steps` steps (None: to the end; after them the device is fine again): with
  `factor`, the rank computes at that speed (its forward and backward take 1/factor of their measured
  time: `runtime.compute_time.ComputeTimer.slowdown`), and the slow device stays with the process that
  held rank `rank` at the fault's first step, whatever rank it has later (a straggler excluded by the
  failover path takes it along); without, `seconds` of extra time per step.
- `kill_during_save`: the rank dies while the checkpoint of the first save at or after `step` is
  being written, leaving an uncommitted `.tmp` directory.
- `corrupt_checkpoint`: the newest committed checkpoint at or before `step` gets a flipped byte in
  one data file (done by global rank 0 when step `step + 1` starts); resuming skips it.

A fault with `step` or `rank` unset draws it from the run's seed.  Every fault except `slow` fires
once per run: the firing rank writes `failover/faults/fired_<i>.json` first, so a relaunch that
redoes the step does not fire it again.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.resilience.fault_config import FAULT_KINDS, KILL_PHASES, Fault, resolve_faults

__all__ = ["FAULT_KINDS", "KILL_EXIT_CODE", "KILL_PHASES", "Fault", "FaultInjector", "resolve_faults"]
KILL_EXIT_CODE = 137  # 128 + SIGKILL: what a shell reports for a process killed hard

def marker_path(fault_dir: Path, fault: Fault) -> Path:
    return fault_dir / f"fired_{fault.index}.json"


def fired_faults(fault_dir: Path) -> dict[int, dict]:
    """Markers of the faults fired so far: index -> {t, kind, rank, step, pid}."""
    out = {}
    for p in sorted(fault_dir.glob("fired_*.json")):
        try:
            out[int(p.stem.split("_")[1])] = json.loads(p.read_text())
        except (ValueError, json.JSONDecodeError):
            continue
    return out


def corrupt_latest_checkpoint(ckpt_dir: Path, up_to_step: int) -> Path | None:
    """Flip one byte in the middle of the largest data file of the newest committed checkpoint <= step
    (`step_NNNNNN` directories only: not one being written, nor one a load set aside as unreadable,
    `step_NNNNNN.unreadable`)."""
    from ntp_nemo.checkpoint.manifest import MANIFEST

    candidates = [
        p
        for p in ckpt_dir.glob("step_*")
        if p.is_dir()
        and (m := re.fullmatch(r"step_(\d+)", p.name)) is not None
        and (p / MANIFEST).exists()
        and int(m[1]) <= up_to_step
    ]
    if not candidates:
        return None
    latest = max(candidates, key=lambda p: p.name)
    files = [p for p in latest.iterdir() if p.is_file() and p.name != MANIFEST]
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target


class FaultInjector(Callback):
    """Fires the configured faults in the worker that holds the target rank."""

    def __init__(self, faults: list[Fault], fault_dir: str | Path, ckpt_dir: str | Path) -> None:
        self.faults = list(faults)
        self.fault_dir = Path(fault_dir)
        self.ckpt_dir = Path(ckpt_dir)
        self._armed: list[Any] = []  # hooks of a kill inside the current step (phase backward/optimizer)
        # per `slow` fault with a factor: whether this process holds the slow device (decided at the first
        # step of the fault it runs: the process at rank `rank` then keeps it when ranks are renumbered)
        self._slow_device: dict[int, bool] = {}

    def _claim(self, fault: Fault, step: int) -> bool:
        """Record that `fault` fires now; False if an earlier attempt already fired it."""
        path = marker_path(self.fault_dir, fault)
        if path.exists():
            return False
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        doc = {**asdict(fault), "t": time.time(), "at_step": step, "pid": os.getpid()}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides
        try:
            os.write(fd, json.dumps(doc).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def strike_rejoin(self, rank: int) -> None:
        """In a repaired process starting in place of `rank` (before it joins): a `kill_rank` fault of
        phase `rejoin` on that rank kills it now (once per run)."""
        for f in self.faults:
            if f.kind == "kill_rank" and f.phase == "rejoin" and f.rank == rank and self._claim(f, -1):
                os._exit(KILL_EXIT_CODE)

    def strike_joining(self, rank: int) -> Callable[[Any, int, float], None] | None:
        """In a repaired process starting in place of `rank`: for a `kill_rank` fault of phase `joining`
        on that rank (once per run), what the process runs once it has said it is ready: it waits for
        the launcher's decision to take it in, then dies."""
        for f in self.faults:
            if f.kind == "kill_rank" and f.phase == "joining" and f.rank == rank and self._claim(f, -1):
                return _die_once_decided
        return None

    def _mine(self, trainer: Trainer, kinds: tuple[str, ...]) -> list[Fault]:
        return [f for f in self.faults if f.kind in kinds and f.rank == trainer.global_rank]

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step + 1  # the step about to run
        for f in self.faults:
            seen = f.index in self._slow_device
            if f.kind == "slow" and f.factor is not None and (f.active_at(step) or seen):
                here = self._slow_device.setdefault(f.index, f.rank == trainer.global_rank)
                timer = _compute_timer(pl_module)
                timer.watch(tp_groups(trainer))  # the slowdown's sleeps fall before their exchanges
                timer.slowdown(f.factor if here and f.active_at(step) else 1.0)
        for f in self._mine(trainer, ("kill_rank", "hang", "slow", "corrupt_checkpoint")):
            if f.kind == "slow":
                if f.factor is None and f.active_at(step):
                    time.sleep(f.seconds)
                continue
            if f.kind == "corrupt_checkpoint":
                if step > f.step and self._claim(f, step):
                    saver = getattr(trainer.strategy, "saver", None)
                    if saver is not None:  # an asynchronous save of `step` may still be committing
                        saver.wait()
                    hit = corrupt_latest_checkpoint(self.ckpt_dir, f.step)
                    print(
                        f"fault: corrupted {hit if hit else 'nothing (no committed checkpoint yet)'}",
                        flush=True,
                    )
                continue
            if f.kind == "kill_rank" and f.phase == "decided":
                if step >= f.step:
                    self._die_before_join(f, trainer, step)
                continue
            if f.kind == "kill_rank" and f.phase in ("rejoin", "joining", "validation", "integrity"):
                continue  # not in a step
            if f.kind == "kill_rank" and f.phase != "step_start":
                if step >= f.step and not marker_path(self.fault_dir, f).exists():
                    self._arm(f, pl_module, trainer, step)
                continue
            if step >= f.step and self._claim(f, step):
                if f.kind == "kill_rank":
                    os._exit(KILL_EXIT_CODE)
                while True:  # hang: alive, silent, holding its peers in their next collective
                    time.sleep(3600)

    def _die_before_join(self, fault: Fault, trainer: Trainer, step: int) -> None:
        """Phase `decided`, on a survivor: at the start of the step before an announced rejoin's join
        step, wait for the launcher's decision to take the repaired processes in, then die (once per run):
        a loss between a rejoin's decision and its join, while the survivors are still in their
        generation."""
        from ntp_nemo.resilience.live_worker import LiveRecovery
        from ntp_nemo.resilience.rendezvous import read_rejoin

        live = next((c for c in trainer.callbacks if isinstance(c, LiveRecovery)), None)
        if live is None or live.store is None or live.generation is None:
            return
        announced = read_rejoin(live.store, live.generation.index)
        if announced is None or "attempt" not in announced or step != int(announced["step"]) - 1:
            return
        if self._claim(fault, step):
            _die_once_decided(live.store, live.generation.index, live.decision_s)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        step = trainer.global_step  # the steps completed: this validation follows step `step`
        for f in self._mine(trainer, ("kill_rank",)):
            if f.phase == "validation" and step >= f.step and self._claim(f, step):
                os._exit(KILL_EXIT_CODE)

    def integrity_action(self, trainer: Trainer) -> None:
        """The integrity watch enters an action after step `trainer.global_step`: a `kill_rank` fault of
        phase `integrity` on this rank at or before that step kills it now (once per run)."""
        step = trainer.global_step
        for f in self._mine(trainer, ("kill_rank",)):
            if f.phase == "integrity" and step >= f.step and self._claim(f, step):
                os._exit(KILL_EXIT_CODE)

    def _arm(self, fault: Fault, pl_module: LightningModule, trainer: Trainer, step: int) -> None:
        """Kill this rank inside step `step`: in the backward (a one-shot hook on the gradient of its
        first parameter) or right after its optimizer step (a one-shot optimizer post-step hook)."""
        handles: list[Any] = []

        def die(*_: Any) -> None:
            for h in handles:
                h.remove()
            if self._claim(fault, step):
                os._exit(KILL_EXIT_CODE)

        if fault.phase == "backward":
            param = next(p for p in pl_module.model.parameters() if p.requires_grad)
            handles.append(param.register_hook(lambda grad: die()))
        else:
            opt = trainer.strategy.torch_optimizer
            handles.append(opt.register_step_post_hook(lambda *_: die()))
        # Disarmed at the step's end if it never fired (e.g. no backward reached this parameter).
        self._armed = handles

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        for h in self._armed:
            h.remove()
        self._armed = []

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        for f in self._mine(trainer, ("kill_during_save",)):
            if trainer.global_step >= f.step and self._claim(f, trainer.global_step):
                threading.Thread(
                    target=self._die_once_writing, args=(trainer.global_step,), daemon=True
                ).start()

    def _die_once_writing(self, step: int, limit_s: float = 5.0) -> None:
        """Exit as soon as the checkpoint's `.tmp` directory exists (the save is under way, not committed)."""
        from ntp_nemo.checkpoint.manifest import checkpoint_name, tmp_path

        tmp = tmp_path(self.ckpt_dir / checkpoint_name(step))
        deadline = time.monotonic() + limit_s
        while not tmp.exists() and time.monotonic() < deadline:
            time.sleep(0.0005)
        os._exit(KILL_EXIT_CODE)


def tp_groups(trainer: Trainer) -> list[Any]:
    """This rank's TP process groups on the running layout (`ComputeTimer.watch`)."""
    topology = getattr(getattr(trainer, "strategy", None), "topology", None)
    return [] if topology is None else topology.tp_groups_of(trainer.global_rank)


def _compute_timer(pl_module: LightningModule) -> Any:
    """The module's compute timer (made here when no straggler watch made it)."""
    from ntp_nemo.runtime.compute_time import ComputeTimer

    if getattr(pl_module, "compute_timer", None) is None:
        pl_module.compute_timer = ComputeTimer()
    return pl_module.compute_timer


def _die_once_decided(store: Any, generation: int, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for the launcher's decision to take the repaired processes of the rejoin
    after `generation` in, then die as a lost GPU does (`kill_rank`, phase `joining`)."""
    from ntp_nemo.resilience.rendezvous import read_rejoin

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (read_rejoin(store, generation) or {}).get("decision") != "join":
        time.sleep(0.02)
    os._exit(KILL_EXIT_CODE)
