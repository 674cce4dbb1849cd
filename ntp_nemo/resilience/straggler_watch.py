"""`StragglerWatch`: the Lightning callback that finds slow ranks while the job runs and acts on them.

It turns on the module's compute timer (every rank's compute time then rides on each step's fused
all-reduce, `NTPRuntime.step_scalars`) and, after every step, feeds the gathered times and the work
model's shares of the layout that ran the step to a `StragglerDetector`.  Every rank holds the same
numbers and runs the same code, so every rank reaches the same verdict at the same step: no collective is
added.  On a verdict (`fault.straggler`):

- every policy reports it: the straggler prints a console line (rank, host, estimated speed) and records
  a `straggler` goodput event; global rank 0 logs the lowest speed to the Lightning loggers, and records
  the time the window's steps lost waiting for slow ranks (`straggler_wait`, its own badput category);
- `rebalance`: the replica holding the straggler gets a batch share proportional to its measured speed
  (`ResolvedLayout.speeds`, on top of the capacity rule: NTP-PW's machinery fed by measured speed), from
  the next step on; a new batch split moves no state, and the global batch and its order stay, so the
  loss curve stays the failure-free one.  When the device recovers, the
  shares go back.  Inside the straggler's TP group (`fault.straggler_shards`: auto, in a one-replica
  job where no other replica can take a share; on; off) each rank's shards follow its measured speed
  (`ResolvedLayout.shard_speeds`): a live re-layout of the same ranks from their own memory
  (`shard_relayout`), no restart and no disk; the replica's batch share then follows its mean speed.
  When the device recovers, the shards go back to balanced the same way.  A straggler below
  `fault.straggler_floor` is excluded as under `exclude`;
- `exclude`: the straggler leaves the job as a lost rank does (exit status 137), and the failover path
  (live where it can work) re-plans the layout without it: its replica goes on at a reduced TP degree.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.config.schema import FaultConfig
from ntp_nemo.goodput.events import REBALANCE, STRAGGLER, STRAGGLER_RECOVERED, STRAGGLER_WAIT
from ntp_nemo.resilience.straggler import (
    Judgement,
    StragglerDetector,
    StragglerSettings,
    decide,
    judged_units,
    peer_groups,
    predicted_compute_s,
)

EXCLUDE_EXIT_CODE = 137  # the failover path's lost rank


def _times_own_work(strategy: Any) -> bool:
    """Whether every rank's compute time leaves out its TP exchanges (`ComputeTimer.watch`): CPU ranks of a
    gloo world, whose TP groups are `ntpdirect` (the same on every rank: `topology.groups.tp_backend`)."""
    from ntp_nemo.topology.groups import tp_backend

    device = getattr(strategy, "root_device", "cpu")
    backend = getattr(strategy, "process_group_backend", None) or "gloo"
    return tp_backend(backend, device) == "ntpdirect"


class StragglerWatch(Callback):
    def __init__(self, settings: StragglerSettings) -> None:
        self.settings = settings
        self.detector = StragglerDetector(settings)
        self.last: Judgement | None = None
        self._layout: Any = None  # the layout whose ranks the detector's history numbers
        self._units: tuple[Any, list[float], list] | None = None  # (layout, `judged_units`, `peer_groups`)
        self.own_cpu_s = 0.0  # CPU seconds the watch spent after the steps (detector, policy), this rank
        self.steps = 0

    @classmethod
    def from_config(cls, fault: FaultConfig) -> StragglerWatch | None:
        settings = StragglerSettings.from_config(fault)
        return cls(settings) if settings.every > 0 else None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from ntp_nemo.runtime.compute_time import ComputeTimer

        if getattr(pl_module, "compute_timer", None) is None:
            pl_module.compute_timer = ComputeTimer()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The timer watches this rank's TP groups of the running layout (a re-layout may change them):
        the time in their exchanges is not compute."""
        from ntp_nemo.resilience.faults import tp_groups

        timer = getattr(pl_module, "compute_timer", None)
        if timer is not None:
            timer.watch(tp_groups(trainer))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        c0 = time.process_time()
        try:
            self._after_step(trainer, pl_module)
        finally:
            self.own_cpu_s += time.process_time() - c0
            self.steps += 1

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Rank 0 says what the watch cost it: CPU per step of the timer's bookkeeping and of the detector
        and policy (the fused all-reduce's extra slots are not counted: one float per rank)."""
        timer = getattr(pl_module, "compute_timer", None)
        if int(trainer.global_rank) != 0 or not self.steps:
            return
        own = self.own_cpu_s + (timer.own_cpu_s if timer is not None else 0.0)
        print(f"straggler | the watch's CPU per step on rank 0: {own / self.steps * 1e6:.1f} us over "
              f"{self.steps} steps (timer {(timer.own_cpu_s if timer else 0.0) / self.steps * 1e6:.1f} us, "
              f"detector and policy {self.own_cpu_s / self.steps * 1e6:.1f} us)", flush=True)

    def _after_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        compute_s = getattr(pl_module, "rank_compute_s", None)
        strategy = trainer.strategy
        layout = getattr(strategy, "layout", None)
        if compute_s is None or layout is None:
            return
        if len(compute_s) != layout.world_size:
            # The step ran on another layout: a live recovery inside this hook (a peer lost during a
            # collective between steps that ran before this callback, such as the integrity watch's
            # check) renumbered the ranks; the step's figures fit none of the new ones.
            self.detector.reset()
            self._layout = layout
            return
        if self._layout is not None and not layout.same_ranks(self._layout):
            self.detector.reset()  # renumbered ranks (a live recovery or rejoin): start over
        self._layout = layout
        step = int(trainer.global_step)
        if self._units is None or self._units[0] != layout:
            units = judged_units(layout, own_work=_times_own_work(strategy))
            self._units = (layout, units, peer_groups(layout))
        judgement = self.detector.observe(step, compute_s, self._units[1], self._units[2])
        if judgement is None:
            return
        self.last = judgement
        rank = int(trainer.global_rank)
        pl_module.log("straggler/min_speed", min(judgement.speeds), rank_zero_only=True, batch_size=1)
        goodput = _goodput(trainer)
        if judgement.wait_s > 0 and goodput is not None:
            goodput.record(STRAGGLER_WAIT, seconds=judgement.wait_s, from_step=step - self.settings.every,
                           step=step)
        if rank in judgement.new:
            self._report(trainer, judgement, rank, step)
        if rank in judgement.recovered:
            print(f"straggler | rank {rank} on {socket.gethostname()} is back to speed "
                  f"{judgement.speed_of(rank):.2f} (step {step})", flush=True)
            _record_own(trainer, STRAGGLER_RECOVERED, rank=rank, speed=judgement.speed_of(rank), step=step)
        decision = decide(self.settings, layout, judgement)
        if rank in decision.exclude:
            print(f"straggler | rank {rank} leaves the job (policy {self.settings.policy}, speed "
                  f"{judgement.speed_of(rank):.2f}): the failover path re-plans without it", flush=True)
            os._exit(EXCLUDE_EXIT_CODE)
        if decision.layout is None:
            return  # no change, or the others meet the excluded rank's loss at their next collective
        new = decision.layout
        speeds = new.speeds
        moved = None if new.same_shards(layout) else self._relayout(strategy, new)
        if moved is None:
            strategy.rebalance(new)
        self._layout = new
        rank_speed = [1.0] * layout.world_size
        for r in judgement.stragglers:
            rank_speed[r] = judgement.speed_of(r)
        predicted = predicted_compute_s(new, judgement.unit_s, rank_speed)
        full = [1.0] * len(rank_speed)
        nominal = predicted_compute_s(new.with_changes(speeds=None), judgement.unit_s, full)
        shards = {} if moved is None else {
            "shard_speeds": list(new.shard_speeds) if new.shard_speeds else None,
            "moved_bytes": moved[0].moved_bytes, "relayout_s": moved[1]}
        if rank == 0:
            print(f"straggler | rebalance at step {step}: replica speeds "
                  f"{list(speeds) if speeds else 'all 1'}, micro-batches per replica "
                  f"{list(layout.microbatch_counts())} -> {list(new.microbatch_counts())}"
                  f"{_shard_words(new, moved)}; modelled compute per step {predicted:.3f} s", flush=True)
        if goodput is not None:
            goodput.record(REBALANCE, step=step, speeds=list(speeds) if speeds else None,
                           microbatches=list(new.microbatch_counts()), predicted_compute_s=predicted,
                           nominal_compute_s=nominal, rank_speeds=rank_speed, unit_s=judgement.unit_s,
                           **shards)

    @staticmethod
    def _relayout(strategy: Any, new: Any) -> tuple[Any, float]:
        """Every rank takes its shards on `new` (other shard weights) from the ranks' memory and adopts
        them (`shard_relayout`); returns (the reshard's result, seconds)."""
        from ntp_nemo.resilience.shard_relayout import relayout, strategy_builder

        t0 = time.perf_counter()
        state, result = relayout(strategy.state, new, strategy_builder(strategy))
        strategy.adopt(state)
        return result, time.perf_counter() - t0

    def _report(self, trainer: Trainer, judgement: Judgement, rank: int, step: int) -> None:
        speed = judgement.speed_of(rank)
        host = socket.gethostname()
        print(f"straggler | rank {rank} on {host} computes at {speed:.2f} of the speed the work model "
              f"expects for its share (steps {step - self.settings.every * self.settings.persist + 1}-{step}"
              f"); policy {self.settings.policy}", flush=True)
        _record_own(trainer, STRAGGLER, rank=rank, host=host, speed=speed, step=step,
                    policy=self.settings.policy)


def _shard_words(new: Any, moved: tuple[Any, float] | None) -> str:
    """The console's words on a shard re-layout (nothing when the shards stayed)."""
    if moved is None:
        return ""
    weights = f"shard weights per rank {list(new.shard_speeds)}" if new.shard_speeds else "balanced shards"
    return (f"; {weights} (live re-layout from the ranks' memory: {moved[0].moved_bytes} bytes moved in "
            f"{moved[1]:.2f} s)")


def _goodput(trainer: Trainer) -> Any:
    from ntp_nemo.lightning.goodput_callback import GoodputCallback

    return GoodputCallback.of(trainer)


def _record_own(trainer: Trainer, event: str, **fields: Any) -> None:
    """Record an event from this rank (any rank: the straggler knows its own host)."""
    goodput = _goodput(trainer)
    if goodput is None:
        return
    from ntp_nemo.goodput.recorder import GoodputRecorder

    with GoodputRecorder(goodput.run_dir) as rec:
        rec.record(event, **fields)


__all__ = ["EXCLUDE_EXIT_CODE", "StragglerWatch"]
