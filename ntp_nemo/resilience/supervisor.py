"""The supervisor: the `ntp-train` parent process playing the cluster scheduler on one machine.

It runs training attempts; while one runs, a `WorkerMonitor` thread watches the workers' exits and
heartbeats.  When an attempt loses ranks it records `failure_detected`, re-plans the layout with the
configured policy (`ntp`, `dp_drop`, `restart`), validates the new config like any other, and
relaunches with the latest valid checkpoint, resharded onto the new layout.  The global batch of a
step depends only on (seed, step), so the relaunched run follows the failure-free loss curve.

The launching process reads no checkpoint data: the workers check it as they load and fall back to an
older checkpoint together, marking each damaged one (`corrupt.json`).  When a relaunch finds no usable
checkpoint left (the launcher's cheap check of every one, or the workers' marks after they found the
last one damaged and raised), the run stops with `NoUsableCheckpointError` (exit 2, each checkpoint
named with what is wrong with it, nothing deleted): a stop on bad data, not a failure to retry.

With `fault.repair_after_steps=N`, an attempt on a degraded layout stops (with a checkpoint) at the
first checkpoint boundary at least N steps after it resumed, and the next attempt runs on the
original layout again: the lost GPU came back.

Under torchrun/SLURM (processes created outside) there is no supervisor: one attempt runs with the
collective timeout, and the cluster's restart uses `ntp_nemo.resilience.replan`.  An srun task of a job
with `ntp-coordinator` (`link`: resilience/cluster_task.py) recovers live instead: its heartbeats go to
the coordinator, which says who is lost, and a replacement task rejoins (`run_task`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ntp_nemo.config.failover import FailoverSpec
from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.beats import read_beats, suspects
from ntp_nemo.resilience.corruption import CORRUPTING, CorruptionInjector
from ntp_nemo.resilience.detection import LostRanks, Timeouts, WorkerMonitor, classify, kill_worker
from ntp_nemo.resilience.fault_config import (  # noqa: F401 - re-exported: the run-time side uses them here
    RECOVERY_MODES,
    LaunchContext,
    nccl_warning,
    recovery_mode,
    validate_fault_config,
)
from ntp_nemo.resilience.faults import FaultInjector, resolve_faults
from ntp_nemo.resilience.heartbeat import Heartbeat
from ntp_nemo.resilience.integrity import IntegrityWatch
from ntp_nemo.resilience.policies import Replan, make_policy, replan
from ntp_nemo.resilience.straggler_watch import StragglerWatch
from ntp_nemo.resilience.worker import SupervisedWorker
from ntp_nemo.topology.layout import ResolvedLayout

FAILOVER_DIR = "failover"
STORE_WIPED = "store wiped"  # LiveMonitor's verdict when the job's keys vanish or change
STORE_FLOODED = "store flooded"  # LiveMonitor's verdict when its process grows past the bound
ATTEMPTS_FILE = "attempts.jsonl"

# build(layout, extra_callbacks, cuda_devices, stop_at_step) -> (trainer, module, strategy); cuda_devices:
# the CUDA ordinal of each rank (None: ranks 0..n-1 on ordinals 0..n-1, and always on CPU); stop_at_step:
# the step an attempt on a degraded layout stops at (None: the run's trainer.stop_at_step)
BuildFn = Callable[[ResolvedLayout, list[Any], list[int] | None, int | None], tuple[Any, Any, Any]]


class FailoverError(RuntimeError):
    """Training could not be recovered (restarts exhausted, no replica left, invalid re-planned layout)."""


@dataclass
class AttemptRecord:
    index: int
    layout: str
    reason: str
    resume: str | None
    stop_at_step: int | None
    start_t: float
    end_t: float | None = None
    outcome: str | None = None  # ok | repair_stop | stopped | failed | no usable checkpoint
    failure: dict[str, Any] | None = None
    replan: str | None = None
    devices: list[int] | None = None  # CUDA ordinal per rank (None: CPU, or ranks 0..n-1 on 0..n-1)


@dataclass
class SupervisorResult:
    attempts: list[AttemptRecord] = field(default_factory=list)
    exit_code: int = 0  # a cluster task that stopped because its coordinator died: COORDINATOR_LOST_EXIT
    stopped: bool = False  # a stop signal ended the last attempt on a degraded layout: no repair relaunch
    abandoned: bool = False  # a second Ctrl-C killed the workers: the run ends without a checkpoint

    @property
    def failures(self) -> int:
        return sum(a.outcome == "failed" for a in self.attempts)

    def summary(self) -> dict[str, Any]:
        return {
            "attempts": len(self.attempts),
            "failures": self.failures,
            "layouts": [a.layout for a in self.attempts],
        }


def _abandoned(trainer: Any) -> bool:
    """Whether a second Ctrl-C killed the workers of `trainer`'s attempt (`ForkLauncher.abandoned`)."""
    return bool(getattr(trainer.strategy.launcher, "abandoned", False))


class _Relaunch(NamedTuple):
    """The next attempt: its layout, why it runs (`failover` | `repair`), what made it a relaunch (said
    when no checkpoint is left to resume from) and the CUDA ordinal of each rank (None: CPU, or 0..n-1)."""

    layout: ResolvedLayout
    reason: str
    why: str
    devices: list[int] | None


class Supervisor:
    def __init__(
        self, spec: FailoverSpec, layout: ResolvedLayout, run_dir: Path, build: BuildFn,
        initial_resume: Path | None = None, context: LaunchContext | None = None, link: Any = None,
    ) -> None:
        """`spec` and `layout`: what the entry point read from the config and the run's layout (both
        built once); re-planning derives every attempt's layout from `layout`.  `context`: the launcher
        and coordinator of this process (default `LaunchContext.from_env()`).  `link`: an srun task's
        link to ntp-coordinator (live recovery on a cluster), else None."""
        self.spec = spec
        self.link = link
        self.run_dir = Path(run_dir)
        self.build = build
        self.initial_resume = initial_resume
        self.dir = self.run_dir / FAILOVER_DIR
        self.heartbeat_dir = self.dir / "heartbeats"
        self.fault_dir = self.dir / "faults"
        self.ckpt_dir = self.run_dir / spec.checkpoint_dir
        self.nominal = layout
        self.policy = make_policy(str(spec.fault.policy), spec.min_replica_tp)
        self.context = LaunchContext.from_env() if context is None else context
        self.recovery, self.recovery_why = recovery_mode(spec, self.context.launcher,
                                                         self.context.coordinator)
        self.live = self.recovery == "live"  # resilience/live_launcher.py, live_worker.py
        self.timeouts = Timeouts.from_config(spec.fault)
        self.faults = resolve_faults(spec, self.nominal.world_size)
        self.end_step = spec.end_step
        self.result = SupervisorResult()
        self._port_was_set = "MASTER_PORT" in os.environ
        self.gpu = spec.accelerator in ("gpu", "cuda")
        self.devices: list[int] | None = None  # CUDA ordinal per rank of the running attempt
        self.lost_devices: set[int] = set()  # GPUs lost since the last repair: never handed out again

    # ---- building attempts ----------------------------------------------------------------------
    def callbacks(self, attempt: int = 0, recovering: bool = False) -> list[Any]:
        """Worker callbacks of an attempt; the fault injector comes first so that a rank it stops never
        reports the step it stopped in."""
        out: list[Any] = []
        if self.faults:
            out.append(FaultInjector(self.faults, self.fault_dir, self.ckpt_dir))
        if any(f.kind in CORRUPTING for f in self.faults):  # bitflip, poison_sample
            out.append(CorruptionInjector(self.faults, self.fault_dir, self.ckpt_dir))
        out.append(IntegrityWatch(self.spec.integrity, self.run_dir))  # fingerprints, non-finite, spikes
        watch = StragglerWatch.from_config(self.spec.fault)  # after the injector: it reads the step's times
        if watch is not None:
            out.append(watch)
        if self.link is not None:  # a cluster task: heartbeats to the coordinator, which replaces the monitor
            from ntp_nemo.resilience.cluster_task import LinkHeartbeat
            from ntp_nemo.resilience.live_worker import LiveRecovery

            return [*out, LinkHeartbeat(self.link),
                    LiveRecovery(self.policy.name, self.spec.min_replica_tp, repair=True, link=self.link)]
        out.append(Heartbeat(self.heartbeat_dir))
        out.append(SupervisedWorker(recovering, attempt))
        if self.live:  # the workers' hooks, and their launcher (the strategy asks for it)
            from ntp_nemo.resilience.live_launcher import LiveLauncher
            from ntp_nemo.resilience.live_worker import LiveRecovery

            spares = int(getattr(self.spec.fault, "spares", 0))
            out.append(LiveRecovery(self.policy.name, self.spec.min_replica_tp,
                                    timeout_s=self.timeouts.collective_s,
                                    repair=self.spec.fault.repair_after_steps is not None or spares > 0,
                                    decision_s=self.timeouts.startup_s + self.timeouts.heartbeat_s,
                                    launcher=functools.partial(
                                        LiveLauncher, spares=spares, spare_timeout_s=self.timeouts.startup_s,
                                        record=functools.partial(self._record, "spare"))))
        return out

    def build_first(self) -> tuple[Any, Any, Any]:
        """Trainer, module and strategy of the first attempt (the run's own config and layout)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)  # heartbeats and fault marks: this user's processes only, whatever the umask
        built = self.build(self.nominal, self.callbacks(), None, None)
        if built[0].strategy.launcher is None and self.link is None:  # torchrun/SLURM created the processes:
            # they are not ours,
            # and no monitor of ours reads their heartbeat files
            built[0].callbacks[:] = [cb for cb in built[0].callbacks
                                     if not isinstance(cb, (SupervisedWorker, Heartbeat))]
        if self.context.global_rank != 0:  # under torchrun/SLURM every rank runs this: one prints
            return built
        warning = nccl_warning(self.spec)
        if warning:
            print(warning, flush=True)
        if self.faults:
            print(
                "fault injection: "
                + "; ".join(
                    f"{f.kind} rank {f.rank} at step {f.step}"
                    + (f" (+{f.seconds}s/step)" if f.kind == "slow" and f.factor is None else "")
                    + (f" (speed {f.factor})" if f.factor is not None else "")
                    + (f" ({f.phase})" if f.phase != "step_start" else "")
                    for f in self.faults
                )
                + f"; policy {self.policy.name}; recovery {self.recovery} ({self.recovery_why})",
                flush=True,
            )
        return built

    def _log(self, rec: AttemptRecord) -> None:
        with (self.dir / ATTEMPTS_FILE).open("a") as f:
            f.write(json.dumps(rec.__dict__) + "\n")

    def _record(self, event: str, **fields: Any) -> None:
        from ntp_nemo.goodput import GoodputRecorder

        with GoodputRecorder(self.run_dir) as rec:
            rec.record(event, **fields)

    def _relaunch_checkpoint(self, why: str) -> Path | None:
        """The checkpoint a relaunch resumes from; `why`: what made the relaunch necessary.  A run whose
        checkpoints are all damaged stops here (`NoUsableCheckpointError`), never starts over."""
        from ntp_nemo.checkpoint.manifest import NoUsableCheckpointError

        try:
            return self._latest_checkpoint()
        except NoUsableCheckpointError as err:
            self._record("job_end", status="failed", reason="no usable checkpoint")  # no worker says it
            raise self._no_usable(err.damaged, why) from None

    def _workers_found_none(self, resume: Path | None, why: str) -> Exception | None:
        """After a relaunch's workers raised: whether they raised because no checkpoint of the run was
        usable.  Loading `resume` (a checkpoint of the run's own directory), they mark every checkpoint
        whose data fails its check (`corrupt.json`) and fall back to the one before; with none left they
        raise.  Their marks then make the cheap check find none usable (markers, sizes and metadata
        only: this process reads no checkpoint data).  Returns the error to stop with, or None."""
        from ntp_nemo.checkpoint.manifest import (
            CORRUPT_MARKER,
            NoUsableCheckpointError,
            latest_valid_checkpoint,
        )

        if resume is None or not (resume / CORRUPT_MARKER).is_file():
            return None
        if resume.parent.resolve() != self.ckpt_dir.resolve():
            return None  # resume=PATH from elsewhere: the entry point names that one (train.py)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                latest_valid_checkpoint(self.ckpt_dir)
        except NoUsableCheckpointError as err:
            return self._no_usable(err.damaged, why)
        return None

    def _no_usable(self, damaged: list[tuple[Path, str]], why: str) -> Exception:
        from ntp_nemo.checkpoint.manifest import NoUsableCheckpointError

        return NoUsableCheckpointError(
            "resume", self.ckpt_dir, damaged,
            stopped=f"The run stopped: it was relaunched after {why}, and no checkpoint was left to resume "
                    "from")

    def _latest_checkpoint(self) -> Path | None:
        from ntp_nemo.checkpoint.manifest import latest_valid_checkpoint

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = latest_valid_checkpoint(self.ckpt_dir)
        for w in caught:
            print(f"warning: {w.message}", flush=True)
        return found if found is not None else self.initial_resume

    @staticmethod
    def _step_of(ckpt: Path | None) -> int:
        if ckpt is None:
            return 0
        from ntp_nemo.checkpoint.manifest import read_manifest

        return int(read_manifest(ckpt).get("step", 0))

    def _repair_stop(self, layout: ResolvedLayout, resume_step: int) -> int | None:
        n = self.spec.fault.repair_after_steps
        if n is None or layout == self.nominal:
            return None
        every = self.spec.checkpoint_every
        target = resume_step + int(n)
        if every > 0:
            target = math.ceil(target / every) * every
        return target if target < self.end_step else None

    # ---- running ----------------------------------------------------------------------------------
    def run(self, first: tuple[Any, Any, Any], resume: Path | None) -> SupervisorResult:
        """Training attempts until one ends without a failure to recover from: each attempt is one fit
        (`_attempt`); what its end means is `_after_end` (done, or the repair stop's relaunch on the
        original layout) or `_after_failure` (record the failure, then stop or re-plan); the next
        attempt is `_next_attempt` (its checkpoint, its repair stop, its trainer).  Under torchrun/SLURM
        the processes are not ours: one fit (`_run_once`)."""
        trainer, module, _ = first
        if trainer.strategy.launcher is None:
            return self._run_once(trainer, module, resume)
        layout, reason, stop_at, why = self.nominal, "start", None, ""  # why: what made it a relaunch
        restarts = 0
        while True:
            rec = AttemptRecord(len(self.result.attempts), layout.describe(), reason,
                                str(resume) if resume else None, stop_at, time.time(), devices=self.devices)
            self.result.attempts.append(rec)
            lost = self._attempt(rec, trainer, module, layout, resume, why)
            if _abandoned(trainer):  # a second Ctrl-C: whatever the workers' exits say, no relaunch
                return self._abandon(rec)
            # Asked to stop (SIGTERM, SIGUSR1, Ctrl-C): the workers checkpoint and stop together.
            stopping = getattr(trainer.strategy.launcher, "stop_requested", None) is not None
            if lost is None:
                relaunch = self._after_end(rec, layout, stopping)
            else:
                restarts += 1
                relaunch = self._after_failure(rec, layout, lost, stopping, restarts)
            if relaunch is None:
                return self.result
            layout, reason, why = relaunch.layout, relaunch.reason, relaunch.why
            trainer, module, resume, stop_at = self._next_attempt(relaunch)

    def _run_once(self, trainer: Any, module: Any, resume: Path | None) -> SupervisorResult:
        """Processes created outside (torchrun/SLURM): this one's fit; an srun task of a job with
        ntp-coordinator runs it under the coordinator's link (`run_task`: live recovery)."""
        if self.link is not None:
            from ntp_nemo.resilience.cluster_task import run_task

            run_task(self.link, trainer, module, resume, self.result)
            return self.result
        trainer.fit(module, ckpt_path=str(resume) if resume else None)
        return self.result

    def _attempt(self, rec: AttemptRecord, trainer: Any, module: Any, layout: ResolvedLayout,
                 resume: Path | None, why: str) -> LostRanks | None:
        """One fit (`_execute`) with its record's end time; a relaunch whose workers found no usable
        checkpoint ends the run (ConfigError: a stop on bad data, not a failure)."""
        try:
            lost = self._execute(trainer, module, layout, resume, why)
        except ConfigError:
            rec.end_t, rec.outcome = time.time(), "no usable checkpoint"
            self._log(rec)
            raise
        except Exception:
            if not _abandoned(trainer):
                raise
            lost = None  # the workers a second Ctrl-C killed: `run` ends the run
        rec.end_t = time.time()
        return lost

    def _abandon(self, rec: AttemptRecord) -> SupervisorResult:
        """A second Ctrl-C killed the attempt's workers mid-step: the run ends here (recorded), and the
        command writes summary.json and exits EXIT_INTERRUPTED."""
        rec.outcome = "abandoned"
        self._log(rec)
        self._record("job_end", status="ok", reason="a second Ctrl-C: the workers were killed, the "
                     "step in progress and its checkpoint abandoned")
        self.result.abandoned = True
        return self.result

    def _after_end(self, rec: AttemptRecord, layout: ResolvedLayout, stopping: bool) -> _Relaunch | None:
        """An attempt that ended without a failure: the run is done (None), unless it was an attempt on a
        degraded layout that reached its repair stop: then the next runs on the original layout. An
        attempt on a degraded layout that a stop signal ended is not its repair stop (no relaunch)."""
        rec.outcome = ("stopped" if stopping and rec.stop_at_step is not None
                       else "repair_stop" if rec.stop_at_step is not None else "ok")
        self._log(rec)
        if rec.outcome != "repair_stop":
            self.result.stopped = rec.outcome == "stopped"
            return None
        self.lost_devices.clear()  # the lost GPUs are back: the original placement again
        print(f"failover | repaired: step {rec.stop_at_step} reached on {layout.describe()}; relaunching "
              f"on the original layout {self.nominal.describe()}", flush=True)
        return _Relaunch(self.nominal, "repair", f"the repair stop at step {rec.stop_at_step}", None)

    def _after_failure(self, rec: AttemptRecord, layout: ResolvedLayout, lost: LostRanks, stopping: bool,
                       restarts: int) -> _Relaunch | None:
        """An attempt that lost ranks: the failure is recorded; then the run stops (a stop signal was
        being answered: `_failed_while_stopping`), ends (more failures than fault.max_restarts:
        FailoverError), or goes on on the re-planned layout."""
        rec.outcome = "failed"
        rec.failure = {"ranks": list(lost.ranks), "reason": lost.reason, "step": lost.step,
                       "detail": lost.detail}
        self._record("failure_detected", rank=lost.ranks[0] if lost.ranks else None, ranks=list(lost.ranks),
                     reason=lost.reason, step=lost.step, detail=lost.detail)
        if stopping:  # asked to stop (SIGTERM, Ctrl-C): whatever failed meanwhile, no relaunch
            self._failed_while_stopping(rec, lost)
            return None
        plan = self._replan(layout, lost)
        rec.replan = plan.describe()
        self._log(rec)
        ranks = list(lost.ranks) or "unknown"
        what = (f"{lost.reason}: {lost.detail}" if not lost.ranks and lost.step is None else
                f"rank(s) {ranks} lost at step {lost.step} ({lost.reason}: {lost.detail})")
        print(f"failover | {what} -> {plan.describe()}", flush=True)
        if restarts > int(self.spec.fault.max_restarts):
            last = (f"the job's coordination keys vanished or changed under it ({lost.detail}); "
                    "find what deletes or writes keys on the job's store (not the machine)"
                    if lost.reason == STORE_WIPED else
                    f"{lost.detail}; find what writes to the job's store (not the machine)"
                    if lost.reason == STORE_FLOODED else
                    f"rank(s) {ranks} lost ({lost.reason}: {lost.detail}). Raise "
                    "fault.max_restarts or check the machine")
            raise FailoverError(
                f"{restarts} failures exceed fault.max_restarts={self.spec.fault.max_restarts}; last: {last}."
            )
        return _Relaunch(plan.new, "failover", what, self.relaunch_devices(layout, plan, lost.ranks))

    def _failed_while_stopping(self, rec: AttemptRecord, lost: LostRanks) -> None:
        """A worker was lost while the workers answered a stop signal: the stop stands when its own
        checkpoint committed (returns); otherwise FailoverError says which checkpoint a rerun takes."""
        saved = self._stop_saved(rec)
        if saved is not None:  # the stop's own checkpoint committed: the stop stands
            rec.outcome = "stopped"
            self._log(rec)
            print(f"failover | {lost.reason} ({lost.detail}) while the workers stopped; the stop's "
                  f"checkpoint {saved.name} is valid: the stop stands", flush=True)
            self._record("job_end", status="ok", reason=f"stopped on a stop signal; a worker was lost "
                         f"after checkpoint {saved.name} ({lost.reason})")
            self.result.stopped = True
            return
        self._log(rec)
        message = self._stop_message(lost)
        # The workers were killed before they could say it: the job's end, after its failure.
        self._record("job_end", status="failed", reason=f"stopped on a stop signal ({lost.reason})")
        raise FailoverError(message)

    def _next_attempt(self, relaunch: _Relaunch) -> tuple[Any, Any, Path | None, int | None]:
        """The relaunch: the checkpoint it resumes from, the step it stops at (an attempt on a degraded
        layout stops for its repair), a fresh rendezvous port, and its trainer on the re-planned layout
        (every option of the run's layout carries over). Returns (trainer, module, resume, stop_at)."""
        resume = self._relaunch_checkpoint(relaunch.why)
        layout = relaunch.layout
        stop_at = self._repair_stop(layout, self._step_of(resume))
        self.devices = relaunch.devices
        if not self._port_was_set:
            os.environ.pop("MASTER_PORT", None)  # a fresh rendezvous port for the new workers
        attempt = len(self.result.attempts)
        trainer, module, _ = self.build(layout, self.callbacks(attempt, relaunch.reason == "failover"),
                                        relaunch.devices, stop_at)
        print(f"failover | attempt {attempt} on layout {layout.describe()}"
              f"{f' until step {stop_at}' if stop_at else ''}; resuming from "
              f"{resume.name if resume else 'the start (no checkpoint)'}", flush=True)
        self._record("job_start", layout=layout.describe(), attempt=attempt, reason=relaunch.reason)
        return trainer, module, resume, stop_at

    def _stop_saved(self, rec: AttemptRecord) -> Path | None:
        """The checkpoint of the step a stop signal ended attempt `rec` at, when it is valid: the step
        is the one summary.json says the workers stopped at (written by their rank 0 at the end of
        training, before the end's save; only a file written during `rec` counts)."""
        from ntp_nemo.checkpoint.manifest import checkpoint_name, checkpoint_problem

        path = self.run_dir / "summary.json"
        try:
            if path.stat().st_mtime < rec.start_t:
                return None
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        step = summary.get("steps") if isinstance(summary, dict) and summary.get("stopped_early") else None
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            return None
        ckpt = self.ckpt_dir / checkpoint_name(step)
        return ckpt if checkpoint_problem(ckpt) is None else None

    def _stop_message(self, lost: LostRanks) -> str:
        """The run was asked to stop and its workers did not all stop cleanly."""
        from ntp_nemo.checkpoint.manifest import NoUsableCheckpointError

        try:
            latest = self._latest_checkpoint()
        except NoUsableCheckpointError as err:
            told = "; ".join(f"{p.name}: {problem}" for p, problem in err.damaged[:8])
            return (f"stopped on a stop signal (SIGTERM/Ctrl-C); the workers did not all checkpoint and exit "
                    f"({lost.reason}: {lost.detail}) and were killed; no checkpoint of {self.ckpt_dir} is "
                    f"usable ({told}) and none was deleted: repair or restore them, then rerun the same "
                    "command with resume=auto.")
        where = (f"the latest valid checkpoint is {latest}; rerun the same command with resume=auto to "
                 "continue from it" if latest is not None else "no checkpoint was written; a rerun starts "
                 "over")
        return (f"stopped on a stop signal (SIGTERM/Ctrl-C); the workers did not all checkpoint and exit "
                f"({lost.reason}: {lost.detail}) and were killed; {where}.")

    def relaunch_devices(
        self, layout: ResolvedLayout, plan: Replan, lost_ranks: Sequence[int]
    ) -> list[int] | None:
        """CUDA ordinal of each rank of the next attempt (None on CPU): the survivors keep their GPUs
        (`plan.assignment`), the lost ranks' GPUs join `lost_devices` and are not handed out again
        until a repair."""
        if not self.gpu:
            return None
        from ntp_nemo.launch.devices import cuda_device_count
        from ntp_nemo.resilience.replan import relaunch_devices

        current = self.devices if self.devices is not None else list(range(layout.world_size))
        self.lost_devices |= {current[r] for r in lost_ranks}
        try:
            devices, notes = relaunch_devices(plan, current, self.lost_devices, cuda_device_count())
        except RuntimeError as err:
            raise FailoverError(str(err)) from None
        for note in notes:
            print(f"failover | {note}", flush=True)
        return devices

    def _replan(self, layout: ResolvedLayout, lost: LostRanks) -> Replan:
        policy = self.policy
        if lost.reason in (STORE_WIPED, STORE_FLOODED):
            what = "lost its keys" if lost.reason == STORE_WIPED else "is being flooded"
            print(f"failover | the job's store {what}: relaunching on the same layout, fresh store",
                  flush=True)
            policy = make_policy("restart")
        elif not lost.ranks and policy.name != "restart":
            print("failover | the lost rank cannot be told; relaunching on the same layout", flush=True)
            policy = make_policy("restart")
        try:
            return replan(layout, lost.ranks, policy)
        except RuntimeError as err:
            raise FailoverError(str(err)) from None
        except ValueError as err:
            raise FailoverError(f"the re-planned layout is not valid: {err}") from None

    def _execute(
        self, trainer: Any, module: Any, layout: ResolvedLayout, resume: Path | None, why: str = ""
    ) -> LostRanks | None:
        """One attempt: None when it ended normally, LostRanks for a recoverable failure; other errors
        propagate.  `why`: what made this attempt a relaunch ("" for the first: a resume the run started
        with is the entry point's to judge)."""
        from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

        shutil.rmtree(self.heartbeat_dir, ignore_errors=True)
        self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
        monitor = self._monitor(trainer, layout)
        monitor.start()
        try:
            trainer.fit(module, ckpt_path=str(resume) if resume else None)
            return None
        except (ProcessExitedException, ProcessRaisedException) as exc:
            monitor.stop()
            stop = self._workers_found_none(resume, why) if why else None
            if stop is not None and isinstance(exc, ProcessRaisedException):
                raise stop from None
            lost = self._lost(exc, trainer, layout, monitor)
            if lost is None:
                raise
            if self.live and isinstance(exc, ProcessRaisedException):  # what the worker raised, kept
                print(f"failover | live: a worker raised:{exc}", file=sys.stderr, flush=True)
            return lost
        finally:
            monitor.stop()
            for p in getattr(trainer.strategy.launcher, "procs", []):
                if p.pid is not None and p.is_alive():
                    kill_worker(p.pid)
            close = getattr(trainer.strategy.launcher, "close", None)
            if close is not None:  # the live path's store goes here, not in the next attempt's workers
                close()

    def _monitor(self, trainer: Any, layout: ResolvedLayout) -> Any:
        """The attempt's failure monitor (not started): `LiveMonitor` when recovery is live (the
        survivors recover in place; it tells them who is gone), else `WorkerMonitor`."""
        if self.live:
            from ntp_nemo.resilience.live_launcher import LiveLauncher, LiveMonitor

            if not isinstance(trainer.strategy.launcher, LiveLauncher):
                raise RuntimeError("a live attempt's trainer must be built with the attempt's callbacks "
                                   "(`Supervisor.callbacks`: its LiveRecovery names the LiveLauncher)")
            repair = self.spec.fault.repair_after_steps
            return LiveMonitor(trainer.strategy.launcher, layout.world_size, self.heartbeat_dir,
                               self.timeouts.heartbeat_s, layout=layout,
                               repair_after_steps=None if repair is None else int(repair),
                               end_step=self.end_step, timeouts=self.timeouts)
        return WorkerMonitor(
            lambda: getattr(trainer.strategy.launcher, "procs", None),
            self.heartbeat_dir,
            layout.world_size,
            self.timeouts,
            stop_requested=lambda: getattr(trainer.strategy.launcher, "stop_requested", None),
        )

    def _lost(self, exc: Exception, trainer: Any, layout: ResolvedLayout, monitor: Any) -> LostRanks | None:
        """Which ranks the attempt lost and why (`classify`: exit codes, the monitor's kills and verdict,
        the error, the heartbeats' suspects and step); None when it was no failure to recover from."""
        procs = trainer.strategy.launcher.procs
        beats = read_beats(self.heartbeat_dir, layout.world_size)
        step = max((b.step for b in beats.values()), default=None)
        return classify([p.exitcode for p in procs], monitor.killed, monitor.verdict, str(exc),
                        suspects(beats, layout.world_size), step)
