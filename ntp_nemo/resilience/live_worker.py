"""Live recovery inside the workers (`fault.recovery=live`): the Lightning side of `recovery.py`.

- `LiveRecovery`, a worker callback and the strategy's `RecoveryHooks` (`lightning/hooks.py`; the
  factory hands it to the `NTPStrategy` it builds): it runs each training step (and the strategy's
  collectives between steps); when a collective fails it runs the recovery protocol, builds the rank's
  state on the re-planned layout with `runtime.assemble` (as at start-up; the optimizer object is kept,
  pointed at the new parameters, so the LR scheduler goes on) and hands it to `NTPStrategy.adopt` (the
  rank numbering and rank 0's duties move with it; the datasets read the new split from the strategy),
  then redoes the step with the same global batch (a survivor one step behind the others takes the step
  as done: `NTPLanguageModule.take_step_as_done`); at an announced rejoin it runs the survivors' side
  (`recovery.grow`).  Goodput: `failure_detected` at detection, `recovery_done` with `mode: live`,
  `moved_bytes`, `minimum_bytes` and `recovery_s` (detection to resharded state; `rejoin: true` for a
  rejoin).  It also names the launcher of the workers (`live_launcher.LiveLauncher` under `ntp-train`)
  and, in a cluster task, the first rendezvous on the coordinator's store (`use_rendezvous`);
- `Rejoining`, a repaired process's side of a rejoin, handed to its `LiveRecovery` (`prepare_rejoin`)
  in the process the launcher forks, or in a cluster job's replacement task.

The launching process's side (forking, watching, respawning) is `live_launcher.py`.  Limit: CPU/gloo
only (sockets are severed to stop a broken generation).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback

from ntp_nemo.lightning.adapter import lightning_state, reset_validation_loader
from ntp_nemo.lightning.hooks import RecoveryHooks
from ntp_nemo.resilience.cluster_protocol import COORDINATOR_LOST_EXIT
from ntp_nemo.resilience.coordinator import FALLBACK_EXIT
from ntp_nemo.resilience.live import capture
from ntp_nemo.resilience.nccl_abort import uses_nccl
from ntp_nemo.resilience.policies import make_policy
from ntp_nemo.resilience.recovery import IN_STEP, Generation, Recovery, grow, recover
from ntp_nemo.resilience.rendezvous import connect, publish_ready, read_rejoin
from ntp_nemo.resilience.store_auth import JobStore
from ntp_nemo.topology.layout import ResolvedLayout

_COLLECTIVE_ERRORS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")


class GenerationAborted(RuntimeError):
    """The step's collectives ran on a generation whose communicators were aborted meanwhile: what they
    returned may be garbage (an aborted NCCL collective can return without raising), so the step is not
    applied; it is redone on the next generation like any step a lost peer interrupted."""


def is_collective_failure(err: BaseException) -> bool:
    """A collective that failed because a peer is gone (gloo's closed connection) or timed out, or whose
    generation was aborted under it (`GenerationAborted`)."""
    import torch.distributed as dist

    if isinstance(err, (dist.DistError, GenerationAborted)):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in _COLLECTIVE_ERRORS)


def _wait_for_commit(strategy: Any) -> None:
    """Wait for the asynchronous save in flight (if any) to commit; re-raises its error."""
    if strategy.saver is not None:
        strategy.saver.wait()


class LiveRecovery(Callback, RecoveryHooks):
    """Worker side of `fault.recovery=live` (see the module docstring): a callback, and the strategy's
    `RecoveryHooks` (`lightning/factory.py` hands it to the strategy it builds)."""

    def __init__(self, policy: str, min_replica_tp: int = 1, timeout_s: float = 60.0,
                 repair: bool = False, link: Any = None, decision_s: float = 660.0,
                 launcher: Callable[[Any], Any] | None = None) -> None:
        """`timeout_s`: every wait of a recovery or a rejoin (the store, the rendezvous:
        `fault.collective_timeout_s`); `decision_s`: how long the survivors wait at an announced rejoin
        for the launcher's word that the repaired processes are ready, or that the rejoin is cancelled;
        `launcher(strategy)`: the launcher of the workers (ntp-train's `LiveLauncher`), None for the
        strategy's own (a cluster task: nothing is launched)."""
        self.launcher = launcher
        self.joining: Rejoining | None = None  # a repaired process's start-up (`prepare_rejoin`)
        # rendezvous(strategy): generation 0 of a cluster task on the coordinator's store (`use_rendezvous`)
        self.rendezvous: Callable[[Any], None] | None = None
        self.policy = make_policy(policy, min_replica_tp)
        self.timeout_s, self.decision_s = timeout_s, decision_s
        self.repair = repair  # repaired processes may rejoin (fault.repair_after_steps, or a cluster job)
        # A task of a cluster job: its link to ntp-coordinator (resilience/cluster_task.py), which hosts the
        # store and says who is lost; None under ntp-train (the launching process does)
        self.link = link
        self._lock = threading.Lock()
        self._recovering = False
        self._aborts = 0  # generations aborted under this process so far (`interrupt`): the step guard
        self.generation: Generation | None = None
        self.nominal: ResolvedLayout | None = None
        self.pid = 0
        self.store = None
        self.rebuild_through = -1  # batches of steps up to this one were split for an older layout
        # Collectives between steps entered since the last step began, and how many of them to pass
        # over (the survivors ahead had entered them when a peer was lost, and do not redo them)
        self._between = 0
        self._skip_between = 0
        self._final = False  # in the end of training's save: its own lines say what happens to it
        self.backend = "gloo"  # the job's process-group backend (set at setup)
        self.launcher_pid = os.getpid()  # built in the launching process, which hosts the store

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.link is not None:
            self.launcher_pid = None  # no launching process: the coordinator outlives every task
            self.store, self.pid = self.link.job, int(self.link.place)
            self.link.on_look = self.interrupt
        elif trainer.strategy.launcher is None or "MASTER_PORT" not in os.environ:
            return
        else:
            self.pid = trainer.global_rank
            self.store = JobStore(connect(int(os.environ["MASTER_PORT"]), self.timeout_s),
                                  trainer.strategy.launcher.secret)
        self.nominal = trainer.strategy.layout
        self.generation = Generation.first(self.nominal)  # a repaired process's: set by `Rejoining.receive`
        self.backend = trainer.strategy.process_group_backend or "gloo"  # every generation keeps it
        if self.link is None and uses_nccl(self.backend):
            threading.Thread(target=self._watch_failures, name="ntp-live-abort", daemon=True).start()

    def interrupt(self, generation: int, failed: list[int]) -> None:
        """The coordinator published the loss of `failed` in `generation` (called from the link's
        watcher thread): unless this process is already recovering or past that generation, sever the
        generation's connections, so that a collective blocked on a hung peer fails now and the training
        thread recovers."""
        from ntp_nemo.resilience.rendezvous import sever

        with self._lock:
            if self._recovering or self.generation is None or self.generation.index != generation:
                return
            self._aborts += 1  # before the abort: a step that read its scalars after it is not applied
            if dist.is_initialized() and dist.get_backend() != "gloo":
                from ntp_nemo.resilience.nccl_abort import abort_generation

                abort_generation(self.store)
            else:
                sever(self.store)

    def abort_epoch(self) -> int:
        """How many generations were aborted under this process so far; a step takes it at its start and
        hands it to `check_generation` before its optimizer step."""
        return self._aborts

    def aborts_silently(self) -> bool:
        """NCCL: an aborted communicator's collective can return without raising (`check_generation`)."""
        return uses_nccl(self.backend)

    def check_generation(self, epoch: int) -> None:
        """Raise `GenerationAborted` if a generation was aborted since `abort_epoch()` returned `epoch`
        and the step's collectives may have returned garbage (NCCL: an aborted communicator's collective
        can return without raising), so it must not be applied.  On gloo (and the ntpdirect TP groups of a
        CPU world) a collective either completes with every peer's data or raises, so a step that read
        its scalars is sound and is applied: were it skipped by the ranks whose watcher saw the abort
        before their update and applied by the others, the survivors would recover one step apart, and
        the ranks behind serve as no source (they take the step as done from the others' state; a shard
        only they still held would end the live path)."""
        if not uses_nccl(self.backend):
            return
        from ntp_nemo.resilience.nccl_abort import nccl_errors

        # NCCL's own watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) aborts a communicator that timed out or
        # failed without `interrupt` counting it: its error counts as an abort.
        errors = nccl_errors() if self._aborts == epoch else []
        if self._aborts != epoch or errors:
            why = f" ({'; '.join(errors)})" if errors else ""
            raise GenerationAborted(f"generation {self.generation.index if self.generation else '?'} was "
                                    f"aborted during this step{why}; it is not applied and is redone")

    def _watch_failures(self) -> None:
        """NCCL under ntp-train: a collective blocked on a lost peer neither fails nor returns, so a thread
        waits for the launcher's word on the store (`failed/gen{g}`) and aborts the generation
        (`interrupt`), as a cluster task's link does with the coordinator's."""
        from ntp_nemo.resilience.rendezvous import failed_key

        while True:
            gen = self.generation
            try:
                payload = self.store.read(failed_key(gen.index)) if gen is not None else None
            except Exception:  # noqa: BLE001 - the launching process (and its store) is gone
                return
            if payload is not None:
                import json

                self.interrupt(gen.index, json.loads(payload))
            time.sleep(0.2)

    # -- the strategy's hooks (RecoveryHooks) --------------------------------------------------------
    def make_launcher(self, strategy: Any) -> Any | None:
        return self.launcher(strategy) if self.launcher is not None else None

    def init_process_group(self, strategy: Any) -> bool:
        if uses_nccl(strategy.process_group_backend):  # generation 0 too, as `rendezvous.join` does later
            from ntp_nemo.resilience.nccl_abort import prepare_nccl_env

            prepare_nccl_env()  # a lost peer must not make NCCL's watchdog end this survivor
        if self.joining is not None:  # a repaired process: it joins the running job's generation
            self.joining.init_process_group(strategy)
            return True
        if self.rendezvous is not None:  # a cluster task: generation 0 on the coordinator's store
            self.rendezvous(strategy)
            return True
        return False

    @property
    def rejoining(self) -> bool:
        return self.joining is not None

    def collectives_local(self) -> bool:
        return self.joining is not None and self.joining.active

    def restore_state(self, strategy: Any) -> dict | None:
        """A repaired process: its shards, Lightning's state and the RNG states from the survivors; it
        then takes part in the generation it joined."""
        if self.joining is None:
            return None
        state = self.joining.receive(strategy)
        layout = self.joining.layout
        self.generation = Generation(self.joining.index, layout, tuple(range(layout.world_size)))
        self.pid = self.joining.pid
        return state

    def before_step(self, strategy: Any) -> None:
        self._between = self._skip_between = 0
        if self.joining is not None and self.joining.active:
            self.joining.finish(strategy)

    def run_step(self, strategy: Any, step_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one training step (`step_fn(batch, ...)`); on a lost peer recover and redo it, unless the
        survivors ahead had completed it: then this rank, holding their state, takes it as done."""
        args = list(args)
        while True:
            if self.rebuild_through >= 0 and int(args[0]["step"]) <= self.rebuild_through:
                args[0] = strategy.lightning_module.batch_of_step(int(args[0]["step"]), strategy.root_device)
            try:
                return step_fn(*args, **kwargs)
            except Exception as err:
                if self.store is None or not is_collective_failure(err):
                    raise
                rec = self._recover(strategy, int(args[0]["step"]), phase=IN_STEP)
                if rec.behind:
                    # The others go on from the collectives between steps they had entered (none: all).
                    self._skip_between = rec.phase
                    print(f"failover | live: rank {rec.rank} takes step {rec.step} as done: the survivors "
                          "ahead had completed it, and their state is now this rank's", flush=True)
                    return strategy.lightning_module.take_step_as_done(args[0], rec.note)

    def run_validation_step(self, strategy: Any, step_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one validation step (`step_fn(batch, ...)`); on a lost peer recover and redo it on the new
        layout with the same validation micro-batches, split over its replicas (every survivor is in it:
        its loss is summed over every rank)."""
        args = list(args)
        while True:
            try:
                return step_fn(*args, **kwargs)
            except Exception as err:
                if self.store is None or not is_collective_failure(err):
                    raise
                rec = self._recover(strategy, strategy.lightning_module.trainer.global_step)
                args[0] = strategy.lightning_module.validation_batch(strategy.root_device)
                if rec.rank == 0:
                    print(f"failover | live: the validation after step {rec.step} is redone on layout "
                          f"{rec.generation.layout.describe()}", flush=True)

    def run_between_steps(self, strategy: Any, fn: Callable, *args: Any, what: str | None = None) -> Any:
        """Run a collective outside the training step (a barrier, a broadcast, a checkpoint save); on a
        lost peer recover before the next step and return None without redoing it: a peer may have
        passed it before the loss and be recovering inside the next training step.  `what` names an
        interrupted action worth a line on the console (a checkpoint save, which then never commits:
        the previous checkpoint stays the latest valid one)."""
        trainer = strategy.lightning_module.trainer
        self._between += 1
        if self._between <= self._skip_between:
            if what is not None and trainer.is_global_zero and not self._final:
                print(f"failover | live: {what} is not run: the survivors ahead had entered it when the peer "
                      "was lost", flush=True)
            return None
        try:
            return fn(*args)
        except Exception as err:
            if self.store is None or not is_collective_failure(err):
                raise
            rec = self._recover(strategy, trainer.global_step, phase=self._between)  # the next batch index
            self._skip_between = max(self._skip_between, rec.phase)
            if what is not None and trainer.is_global_zero and not self._final:
                print(f"failover | live: {what} was interrupted by the loss and is not redone", flush=True)
            return None

    def run_final_save(self, strategy: Any, save: Callable[[bool], None], committed: Callable[[], bool],
                       tries: int = 3) -> None:
        """The end of training's checkpoint save: a peer lost during it leaves it uncommitted, and no next
        step follows in which the survivors would save again, so they write it again here. The save and
        its commit (an asynchronous save commits in the background, over its own group: its failure
        shows when it is waited for) run under recovery. The ranks a loss caught in them (or before
        them: those pass over the save, `_skip_between`, as the survivors ahead had entered it) agree on
        the new generation whether it committed on every rank, and write it again until it has (`tries`
        writes at most; each agreement and write is under recovery itself). A rank no loss touched during
        the save saves once, as without recovery."""
        self._final = True
        try:
            self._final_save(strategy, save, committed, tries)
        finally:
            self._final = False

    def _final_save(self, strategy: Any, save: Callable[[bool], None], committed: Callable[[], bool],
                    tries: int) -> None:
        trainer = strategy.lightning_module.trainer
        passes_over = self._skip_between > self._between  # the survivors ahead had entered the save
        start = self.generation.index if self.generation is not None else None
        self._save_and_commit(strategy, save, False)
        for attempt in range(tries):
            if not passes_over and (self.generation is None or self.generation.index == start):
                return  # no loss during the save (or its last write): it ran everywhere as it does alone
            passes_over = False
            while True:  # every survivor is here, past the save: the collectives between steps start over
                self._between = self._skip_between = 0
                start = self.generation.index
                done = self.run_between_steps(strategy, self._all_hold, strategy, committed)
                if self.generation.index == start:
                    break  # agreed (a loss during the agreement: agree again on the next generation)
            if done or attempt + 1 == tries:
                break
            if trainer.is_global_zero:
                print(f"failover | live: the checkpoint of step {trainer.global_step} did not commit (a peer "
                      "was lost during it); the survivors write it again", flush=True)
            self._save_and_commit(strategy, save, True)
        if not done and trainer.is_global_zero:
            print(f"failover | live: the checkpoint of step {trainer.global_step} did not commit after "
                  f"{tries} writes; the latest committed one stays the newest", flush=True)

    def _save_and_commit(self, strategy: Any, save: Callable[[bool], None], again: bool) -> None:
        save(again)
        self.run_between_steps(strategy, _wait_for_commit, strategy)

    @staticmethod
    def _all_hold(strategy: Any, check: Callable[[], bool]) -> bool:
        """Whether `check()` holds on every rank (a MIN all-reduce on the strategy's device)."""
        import torch

        flag = torch.tensor([1.0 if check() else 0.0], device=strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)

    @staticmethod
    def _builder(strategy: Any) -> Callable:
        """build(layout, rank) -> RankState on the current default group (`shard_relayout.strategy_builder`:
        `runtime.assemble` as at start-up, the optimizer object kept and pointed at the new parameters)."""
        from ntp_nemo.resilience.shard_relayout import strategy_builder

        return strategy_builder(strategy, share_groups=False)

    def _recover(self, strategy: Any, step: int, phase: int | None = None,
                 failed_rejoin: tuple[BaseException, Any] | None = None) -> Recovery:
        """Recover before (re)running the step of batch index `step` (0-based: step `step + 1`); `phase`:
        `IN_STEP` inside that step, else the collectives between steps entered (default: those counted).
        `failed_rejoin`: (the error, the snapshot `_grow` took) when the rejoin into generation `g + 1`
        failed: the survivors re-form generation `g + 2` from the snapshot (`recover(notice=g + 1)`).
        Returns the recovery (`behind`: the survivors ahead had completed the step of batch `step`)."""
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        module = strategy.lightning_module
        trainer = module.trainer
        opt = strategy.torch_optimizer
        goodput = GoodputCallback.of(trainer)
        with self._lock:
            self._recovering = True
        notice, snapshot = (None, None) if failed_rejoin is None \
            else (self.generation.index + 1, failed_rejoin[1])
        if failed_rejoin is None and self._next_is_rejoins():
            notice = self.generation.index + 1  # the loss is published for the rejoin's generation
        try:
            rec = recover(self.store, self.generation, self.pid, trainer.global_step, (module.model, opt),
                          self._builder(strategy), self.policy, backend=self.backend,
                          timeout_s=self.timeout_s, notice=notice, snapshot=snapshot,
                          phase=self._between if phase is None else phase, note=module.step_note())
        except Exception as err:  # noqa: BLE001 - any failure of the live path means the restart path
            if failed_rejoin is not None:
                err = RuntimeError(f"{failed_rejoin[0]}; re-forming without the repaired processes failed "
                                   f"too: {type(err).__name__}: {err}")
            _give_up(self.pid, err, self.launcher_pid, self.link)
        if rec is None:  # left idle by the new layout
            if self.link is not None:
                self.link.bye("idle")
            os._exit(0)
        lost_ranks = [self.generation.members.index(p) for p in rec.failed if p in self.generation.members]
        self._install(strategy, rec, step)
        if goodput is not None:
            goodput.record("failure_detected", t=rec.detect_t, rank=lost_ranks[0] if lost_ranks else None,
                           ranks=lost_ranks, process=rec.failed[0] if rec.failed else None,
                           processes=list(rec.failed), reason="collective error", step=rec.step + 1,
                           detail="live recovery" if failed_rejoin is None else "a rejoin failed")
            goodput.record("recovery_done", layout=rec.generation.layout.describe(), step=rec.step + 1,
                           mode="live", moved_bytes=rec.reshard.moved_bytes,
                           minimum_bytes=rec.reshard.needed_bytes, recovery_s=rec.seconds,
                           generation=rec.generation.index)
        if rec.rank == 0:
            moved, minimum = rec.reshard.moved_bytes, rec.reshard.needed_bytes
            what = rec.replan.describe() if failed_rejoin is None else (
                f"the rejoin failed ({type(failed_rejoin[0]).__name__}); processes {list(rec.failed)} lost: "
                f"the survivors re-form layout {rec.generation.layout.describe()}")
            ends = trainer.should_stop or rec.step >= trainer.max_steps
            runs = "training ends on it" if ends else f"step {rec.step + 1} runs on it"
            print(f"failover | live: {what}; {runs}; moved {moved} bytes (minimum {minimum}) in "
                  f"{rec.seconds:.2f} s", flush=True)
            if rec.cross_node:
                print(rec.cross_node, flush=True)
        return rec

    def _install(self, strategy: Any, rec: Any, step: int) -> None:
        """Make `rec`'s state (a recovery's or a rejoin's) the strategy's (`NTPStrategy.adopt`); the
        batches of step index `step` and the one fetched ahead are rebuilt for the new split."""
        with self._lock:
            self.generation, self._recovering = rec.generation, False
        strategy.adopt(rec.state)
        self.rebuild_through = step + 2  # the redone step and what the loader fetched ahead

    # -- rejoin (fault.repair_after_steps): the survivors' side ----------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.repair or self.store is None or self.generation is None:
            return
        if self.link is not None and self.link.coordinator_lost.is_set():
            return  # its store went with it: the run stops at the end of this step
        try:
            announced = read_rejoin(self.store, self.generation.index)
        except Exception:  # noqa: BLE001 - a store that stopped answering
            if self.link is not None and self.link.lost_coordinator(2.0):
                return
            raise
        if announced is None or announced.get("decision") == "cancel" \
                or trainer.global_step + 1 < announced["step"]:
            return
        if trainer.global_step + 1 > announced["step"]:
            _give_up(self.pid, RuntimeError(f"the rejoin before step {announced['step']} was announced after "
                                            f"this process started step {trainer.global_step + 1}"),
                     None, self.link)
        if "attempt" in announced and not self._rejoin_decided(trainer):
            return  # cancelled: the repaired processes failed to start; this generation goes on
        self._grow(trainer.strategy, int(announced["source"]))

    def _rejoin_decided(self, trainer: Any) -> bool:
        """Wait for the launcher's decision on the announced rejoin: True to join, False if cancelled."""
        announced = self._decision()
        if announced["decision"] == "cancel" and trainer.is_global_zero:
            print(f"failover | live: the rejoin before step {announced['step']} was cancelled; going on with "
                  f"layout {self.generation.layout.describe()}", flush=True)
        return announced["decision"] == "join"

    def _decision(self) -> dict:
        """The announced rejoin of this process's generation once the launcher decided on it (waits at
        most `decision_s`, then gives up: the restart path)."""
        deadline = time.monotonic() + self.decision_s
        while True:
            announced = read_rejoin(self.store, self.generation.index) or {}
            if announced.get("decision") in ("join", "cancel"):
                return announced
            if time.monotonic() > deadline:
                _give_up(self.pid, TimeoutError(f"no word from the launcher on the rejoin in "
                                                f"{self.decision_s:g} s"), self.launcher_pid, self.link)
            time.sleep(0.02)

    def _next_is_rejoins(self) -> bool:
        """Whether generation `g + 1` belongs to a rejoin announced in this process's generation `g`:
        one the launcher decided to take in (its undecided ones are waited for: a loss makes it cancel
        them), or one a coordinator announced (it decides nothing).  A loss in `g` is then published for
        `g + 1`, as the launcher cannot tell whether the survivors began forming it, and every survivor
        re-forms `g + 2` from `g`'s layout without the lost ones: one still in `g` (the loss came between
        the decision and the join step) exactly as one whose `grow` failed.  (Before, the survivors still
        in `g` waited for a notice under `g`, found none and fell back to the restart path.)"""
        if not self.repair or self.store is None or self.generation is None:
            return False
        try:
            announced = read_rejoin(self.store, self.generation.index)
        except Exception:  # noqa: BLE001 - a store that stopped answering: the recovery's wait says so
            return False
        if announced is None:
            return False
        if "attempt" not in announced:
            return True
        return self._decision()["decision"] == "join"

    def _grow(self, strategy: Any, source: int) -> None:
        """Rejoin at this step boundary; process `source` (a survivor, rank `source` of the original
        layout) sends the repaired processes what a checkpoint would hold besides the tensors."""
        from ntp_nemo.checkpoint.rng import rng_state
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        module = strategy.lightning_module
        trainer = module.trainer
        step = trainer.global_step  # the batch index of the step about to run
        if strategy.saver is not None:  # its collectives run on the generation about to be dropped
            strategy.saver.wait()
        payload = None
        if self.pid == source:  # what a checkpoint would hand Lightning, for the repaired ranks
            payload = {"lightning": lightning_state(trainer), "rng": rng_state()}
        old_layout = self.generation.layout
        with self._lock:
            self._recovering = True
        # What to re-form from if the rejoin fails: the building of the new layout rebinds the optimizer
        snapshot = capture(module.model, strategy.torch_optimizer)
        try:
            rec = grow(self.store, self.generation, self.nominal, self.pid, step,
                       (module.model, strategy.torch_optimizer), self._builder(strategy),
                       backend=self.backend, timeout_s=self.timeout_s, snapshot=snapshot)
            box = [payload]
            dist.broadcast_object_list(box, src=source)
        except Exception as err:  # noqa: BLE001 - re-formed without the repaired processes, or restarted
            self._recover(strategy, step, failed_rejoin=(err, snapshot))
            return
        # Said by the degraded layout's rank 0, before the ranks change (a repaired process 0 takes rank 0).
        goodput = GoodputCallback.of(trainer)
        if goodput is not None:
            goodput.record("recovery_done", layout=self.nominal.describe(), step=step + 1, mode="live",
                           rejoin=True, moved_bytes=rec.reshard.moved_bytes,
                           minimum_bytes=rec.reshard.needed_bytes, recovery_s=rec.seconds,
                           generation=rec.generation.index)
        if trainer.is_global_zero:
            print(f"failover | live: repaired process(es) rejoined: layout {old_layout.describe()} -> "
                  f"{self.nominal.describe()} before step {step + 1}; moved {rec.reshard.moved_bytes} bytes "
                  f"(minimum {rec.reshard.needed_bytes}) in {rec.seconds:.2f} s", flush=True)
            if rec.cross_node:
                print(rec.cross_node, flush=True)
        self._install(strategy, rec, step)
        # The validation loader was checked (a collective) before the repaired ranks existed: every rank
        # sets it up again at the next validation.
        reset_validation_loader(trainer)


class Rejoining:
    """A repaired process's side of a rejoin (handed to its `LiveRecovery` by `prepare_rejoin`): it joins
    generation `index` from start-up, builds the original layout with Lightning as any worker does (the
    strategy's barriers, broadcasts and reductions stay local meanwhile: the survivors are not running
    Lightning's start-up), receives its shards and Lightning's state from the survivors
    where a resume would read a checkpoint, and takes part in every collective from its first step on."""

    CKPT_PATH = "<live rejoin>"  # what Lightning is given as the checkpoint to resume from

    def __init__(self, open_store: Callable[[], JobStore], layout: ResolvedLayout, pid: int, *,
                 index: int | None = None, source: int | None = None,
                 announce: Callable[[], tuple[int, int]] | None = None, timeout_s: float,
                 attempt: int | None = None) -> None:
        """`open_store()`: the job's store; `index`, `source`: the generation to join and the survivor
        that sends Lightning's state, or None until `announce()` returns them (a cluster replacement
        learns them from the coordinator once it is ready to join); `timeout_s`: how long it waits for
        the survivors; `attempt`: the launcher's number of this rejoin (it says it is ready under it)."""
        self.open_store, self.layout, self.pid, self.timeout_s = open_store, layout, pid, timeout_s
        self.attempt = attempt
        self.index, self.source, self.announce = index, source, announce
        self.active = True
        # after_ready(store, generation, timeout_s): run once the process said it is ready (a fault)
        self.after_ready: Callable[[JobStore, int, float], None] | None = None

    def init_process_group(self, strategy: Any) -> None:
        from ntp_nemo.resilience.rendezvous import join

        if self.index is None:
            assert self.announce is not None
            self.index, self.source = self.announce()
        # Kept for the process's life: the generation's rendezvous store (`JobStore.rendezvous_stores`)
        # must outlive every group created on it, or torch's later `new_group` cannot call back into it.
        self.store = store = self.open_store()
        if self.attempt is not None:  # the launcher tells the survivors to take it in once it is ready
            publish_ready(store, self.index - 1, self.attempt, self.pid)
            if self.after_ready is not None:
                self.after_ready(store, self.index - 1, self.timeout_s)
        join(store, self.index, self.pid, self.layout.world_size,
             backend=strategy.process_group_backend or "gloo", timeout_s=self.timeout_s)

    def receive(self, strategy: Any) -> dict:
        """In place of a checkpoint load: the shards from the survivors, Lightning's state and the RNG
        states from the survivor `source`."""
        from ntp_nemo.checkpoint.rng import set_rng_state
        from ntp_nemo.resilience.recovery import arrive

        module = strategy.lightning_module
        replica = strategy.topology.coord(strategy.global_rank).replica
        arrive(module.model, strategy.torch_optimizer, replica)
        box: list = [None]
        dist.broadcast_object_list(box, src=self.source)
        set_rng_state(box[0]["rng"])  # every rank draws the same dropout masks as its replica peers
        return box[0]["lightning"]

    def finish(self, strategy: Any) -> None:
        """At the first training step: the learning rates the restored scheduler gives; collectives on."""
        strategy.follow_scheduler_lr()
        self.active = False
        # Its validation loader was set up while its collectives were local: set up again at the next
        # validation, with the collective the survivors run then (`_grow` resets theirs).
        reset_validation_loader(strategy.lightning_module.trainer)


def live_recovery(trainer: Any) -> LiveRecovery:
    """The trainer's `LiveRecovery` (its strategy's recovery hooks)."""
    hooks = getattr(trainer.strategy, "recovery", None)
    if not isinstance(hooks, LiveRecovery):
        raise RuntimeError(f"the strategy's recovery is {type(hooks).__name__}, not LiveRecovery: build the "
                           "trainer with a LiveRecovery among its callbacks")
    return hooks


def prepare_rejoin(trainer: Any, joining: Rejoining) -> None:
    """Make the trainer of a repaired process rejoin (`joining`) instead of starting afresh (its memory
    report is skipped: the survivors set theirs up long ago and skip it)."""
    live_recovery(trainer).joining = joining


def use_rendezvous(trainer: Any, rendezvous: Callable[[Any], None]) -> None:
    """Make the trainer's workers form their first process group with `rendezvous(strategy)` in place of
    env:// (a cluster task: generation 0 on the coordinator's store)."""
    live_recovery(trainer).rendezvous = rendezvous


def _give_up(pid: int, err: BaseException, launcher_pid: int | None = None, link: Any = None) -> None:
    if link is not None:  # a cluster task
        if link.lost_coordinator(1.0):
            print(f"failover | process {pid}: the coordinator at {link.where} is gone during a recovery; "
                  "stopping. Resubmit with resume=auto (the latest checkpoint is intact)", file=sys.stderr,
                  flush=True)
            os._exit(COORDINATOR_LOST_EXIT)
        link.bye("fallback")
    from ntp_nemo.lightning.callbacks import parent_gone

    if launcher_pid is not None and os.getpid() != launcher_pid and parent_gone(launcher_pid):
        # The launching process (and the store it hosts) died: no restart path exists any more.
        if pid == 0:
            print(f"the launching process (pid {launcher_pid}) is gone: the workers stop without a "
                  "checkpoint (they cannot finish a save without it); a rerun resumes from the latest "
                  "checkpoint written before", flush=True)
        os._exit(0)
    print(f"failover | live recovery failed on process {pid} ({type(err).__name__}: {err}); "
          "falling back to the restart path", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(FALLBACK_EXIT)
