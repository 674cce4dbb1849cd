"""Every use of Lightning's private state, in one file.

ntp_nemo drives Lightning through a few of its private classes, functions and attributes: the
multiprocessing launcher and its worker wrapper, the strategy's launcher hook, the process-group
set-up of `lightning.fabric`, the per-step SIGTERM broadcast, the validation loader cache, the
checkpoint connector, `ModelCheckpoint`'s last saved step and `LightningOptimizer`'s step counters.
They live here, behind functions named for what they do, so that the rest of the project (the
strategy, the module, the callbacks, `resilience/`) uses public names only, and a Lightning upgrade
that moves one of them breaks this file, where `SUPPORTED_LIGHTNING` says which releases it was
checked against (tests/lightning/test_adapter.py fails, naming the installed release, on any other).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning
import lightning.pytorch as pl
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

from ntp_nemo.launch.loopback import loopback_children_env, loopback_listener
from ntp_nemo.lightning.signals import FORWARDED_INTERRUPT, hold_stop_signals

# Lightning releases (major.minor) whose private names below were checked: the launcher's
# `_wrapping_function(process_idx, trainer, function, args, kwargs, return_queue)`,
# `_collect_rank_zero_results`, `_recover_results_in_main_process`, `_WorkerOutput`; the strategy's
# `_configure_launcher`/`_launcher`; fabric's `_init_dist_connection`, `_destroy_dist_connection`,
# `_distributed_is_initialized`, `_get_default_process_group_backend_for_device`,
# `_sync_ddp_if_available`; the epoch loop's `_broadcast_sigterm_tensor`; the validation loop's
# `_combined_loader`; the trainer's `_checkpoint_connector.dump_checkpoint`; LightningOptimizer's
# `_optimizer`, `_on_before_step`, `_on_after_step`; ModelCheckpoint's `_save_checkpoint`,
# `_last_global_step_saved`.  Checked on 2.6.6.
SUPPORTED_LIGHTNING = ("2.6",)


def lightning_version_problem(version: str | None = None) -> str | None:
    """Why the Lightning release `version` (default the installed one) is not one this adapter supports,
    or None if it is."""
    version = lightning.__version__ if version is None else version
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor in SUPPORTED_LIGHTNING:
        return None
    return (f"Lightning {version} is installed, but ntp_nemo/lightning/adapter.py was checked against "
            f"Lightning {', '.join(SUPPORTED_LIGHTNING)} only (SUPPORTED_LIGHTNING): it uses private "
            "Lightning names that may have moved. Install a supported release "
            f"(pip install 'lightning~={SUPPORTED_LIGHTNING[-1]}.0'), or check every name listed above "
            "SUPPORTED_LIGHTNING against the new release and add it there.")


def warn_if_unsupported_lightning() -> None:
    """A warning (not an error: a newer release may still work) when the installed Lightning is not
    one `SUPPORTED_LIGHTNING` names."""
    problem = lightning_version_problem()
    if problem is not None:
        warnings.warn(problem, stacklevel=2)


# ---- process groups (lightning.fabric) -------------------------------------------------------------
def init_process_group(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """The default process group from the cluster environment's address, rank and world size (env://)."""
    _init_dist_connection(cluster_environment, backend, **kwargs)


def destroy_process_group() -> None:
    """Lightning's own teardown of the default process group (a no-op when there is none)."""
    _destroy_dist_connection()


def distributed_is_initialized() -> bool:
    return _distributed_is_initialized()


def default_process_group_backend(device: Any) -> str:
    return _get_default_process_group_backend_for_device(device)


def sync_ddp_if_available(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def destroy_groups_at_exit(backend: str) -> bool:
    """Destroy the process groups when the process exits, whatever the backend string: Lightning
    registers it only for exactly "nccl", so `cpu:gloo,cuda:nccl` (the GPU default) and gloo runs
    under torchrun or srun would exit with live communicators.  Returns whether it registered here."""
    if backend == "nccl":
        return False  # Lightning's `_init_dist_connection` did
    import atexit

    atexit.register(_destroy_dist_connection)
    return True


# ---- the trainer's loops and state -------------------------------------------------------------------
def quiet_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning's per-step SIGTERM broadcast (Lightning >= 2.5 broadcasts a flag from rank 0 and
    reads it on the host before every training step: a collective and a host sync outside the step's
    one fused all-reduce).  Here a stop request (SIGTERM, SIGUSR1, Ctrl-C) already rides in that fused
    all-reduce (`PreemptionCheckpoint`), so the broadcast only costs a sync per step."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def reset_validation_loader(trainer: pl.Trainer) -> None:
    """Make the next validation set its loader up again (a collective in a distributed run): the ranks
    that took part in the last set-up are not the ranks of now (a rejoin)."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def lightning_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What a checkpoint would hand Lightning besides the model and optimizer tensors (loops, callbacks,
    schedulers, global step): the state a repaired process resumes from."""
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    state.pop("state_dict", None)
    state.pop("optimizer_states", None)
    # Dumped at the start of a step (a rejoin happens there), when the epoch loop has already counted
    # the step's batch as ready and started; a checkpoint written between steps has not.  Restored as it
    # is, a repaired process counted that batch twice: its validation came one step before the
    # survivors', which it waited for in a collective until the heartbeat timeout ended it.
    progress = state.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    for part in ("total", "current"):
        counts = progress.get(part) if isinstance(progress, dict) else None
        if isinstance(counts, dict) and "completed" in counts:
            done = counts["completed"]
            counts.update(ready=done, started=done, processed=done)
    return state


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a `LightningOptimizer` (itself if it is one already)."""
    return getattr(optimizer, "_optimizer", optimizer)


def count_skipped_step(optimizer: Any) -> None:
    """A step whose update this rank's optimizer does not apply (a non-finite gradient skips it; a step
    the survivors ahead of it completed, whose state it received) still counts as one for Lightning (its
    global step follows the batch): what `LightningOptimizer.step` records around an update."""
    optimizer._on_before_step()
    optimizer._on_after_step()


def save_step_checkpoint(callback: Any, trainer: pl.Trainer, again: bool = False) -> None:
    """Save the checkpoint of `trainer.global_step` through the `ModelCheckpoint` `callback`, unless it
    has saved that step already (`again`: save it even so, its first save having not committed)."""
    if again or callback._last_global_step_saved != trainer.global_step:
        callback._save_checkpoint(trainer, callback.format_checkpoint_name({"step": trainer.global_step}))
        callback._last_global_step_saved = trainer.global_step


# ---- launching workers -----------------------------------------------------------------------------
class StrategyAdapter(ParallelStrategy):
    """The strategy's side of Lightning's launcher hook: `make_launcher()` names the launcher of
    processes this strategy forks (nothing when a cluster environment creates them)."""

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.make_launcher()

    def make_launcher(self) -> Any:
        raise NotImplementedError


@dataclass
class _Spawned:
    """What the workers were started with: a replacement starts with the same."""

    trainer: Any
    function: Callable
    args: tuple
    kwargs: dict
    queue: Any
    context: Any


class ForkLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher without shipping rank 0's weights back to the parent
    (the model is sharded; checkpoints and run-directory files carry the results).

    Besides Lightning's `launch` (fork, join, collect), the steps one by one for a launcher whose workers
    may be lost and replaced (`resilience/live_launcher.py`): `start_workers`, `start_replacement`,
    `start_process`, `worker_results`, `forget_workers`."""

    _procs: Any = None
    _pending_signal: int | None = None
    stop_requested: float | None = None  # when (time.time()) the first stop signal was forwarded
    abandoned: bool = False  # a second Ctrl-C killed the workers: the run ends without a checkpoint
    _spawned: _Spawned | None = None
    listener: socket.socket | None = None  # the rendezvous port while `launch` runs (see `launch`)

    @property
    def procs(self) -> Any:
        return self._procs

    @procs.setter
    def procs(self, value: Any) -> None:
        """The workers, once forked; a stop signal that reached the parent while it forked them follows.
        The rendezvous port's socket is theirs from now on: the parent closes its copy."""
        self._procs = value
        if value and self.listener is not None:
            self.listener.close()
        pending, self._pending_signal = self._pending_signal, None
        for proc in (value or []) if pending is not None else []:
            if proc.is_alive():
                os.kill(proc.pid, pending)

    @property
    def num_processes(self) -> int:
        return self._strategy.num_processes

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Forward SIGTERM/SIGUSR1 sent to the parent to every worker (they checkpoint and stop together);
        the workers rendezvous and listen on loopback only, on a port held from before the fork."""
        with self.forwarding_signals(), loopback_children_env(), self._held_rendezvous_port():
            return super().launch(function, *args, trainer=trainer, **kwargs)

    @contextmanager
    def _held_rendezvous_port(self) -> Iterator[None]:
        """The env:// rendezvous port, bound and listening on loopback before the workers are forked
        (`listener`; rank 0's store serves on it, the other workers and, once they are forked, this
        process close their copies): no other process can take the port between its choice and the
        store's bind, as it could take Lightning's own choice (a port found free, then closed, then bound
        after the fork; "Address already in use" was seen on a busy machine).  A MASTER_PORT the user set
        is used as it is."""
        env = self._strategy.cluster_environment
        if not isinstance(env, LightningEnvironment) or "MASTER_PORT" in os.environ:
            yield
            return
        try:
            sock = loopback_listener(max(0, env._main_port))  # -1: not chosen yet
        except OSError:  # the port chosen earlier is taken: the store's bind says so as before
            yield
            return
        env._main_port = sock.getsockname()[1]
        self.listener = sock
        try:
            yield
        finally:
            self.listener = None
            sock.close()

    def start_workers(self, function: Callable, args: tuple, kwargs: dict, trainer: Any) -> Any:
        """Fork one worker per process (Lightning's worker wrapper around `function`) without waiting for
        them; returns torch's process context (`error_files` holds each one's traceback)."""
        queue = mp.get_context("fork").SimpleQueue()
        context = mp.start_processes(self._wrapping_function, args=[trainer, function, args, kwargs, queue],
                                     nprocs=self._strategy.num_processes, start_method="fork", join=False)
        self.procs = context.processes
        self._spawned = _Spawned(trainer, function, args, kwargs, queue, context)
        return context

    def start_replacement(self, idx: int, prepare: Callable[[Any], None], ckpt_path: str,
                          name: str) -> Any:
        """Fork a process in place of worker `idx` (after `start_workers`): it calls `prepare(trainer)`,
        then runs the workers' function with `ckpt_path`; returns the process (started)."""
        spawned = self._spawned
        assert spawned is not None, "start_workers first"
        proc = mp.get_context("fork").Process(target=self._replacement_main,
                                              args=(idx, prepare, ckpt_path, spawned), name=name)
        proc.start()
        return proc

    def start_process(self, body: Callable[[Any, Callable[[int, Callable[[Any], None], str], None]], None],
                      name: str) -> Any:
        """Fork a process (after `start_workers`) that runs `body(trainer, replace)` and exits when it
        returns; `replace(idx, prepare, ckpt_path)` makes it, from then on, what `start_replacement` starts
        (a hot spare: `resilience/spares.py`).  Returns the process (started)."""
        spawned = self._spawned
        assert spawned is not None, "start_workers first"

        def main() -> None:
            body(spawned.trainer, lambda idx, prepare, ckpt_path: self._replacement_main(
                idx, prepare, ckpt_path, spawned))

        proc = mp.get_context("fork").Process(target=main, name=name)
        proc.start()
        return proc

    def _replacement_main(self, idx: int, prepare: Callable[[Any], None], ckpt_path: str,
                          spawned: _Spawned) -> None:
        prepare(spawned.trainer)
        args, kwargs = list(spawned.args), dict(spawned.kwargs)
        names = list(inspect.signature(spawned.function).parameters)
        if "ckpt_path" in names:
            args[names.index("ckpt_path")] = ckpt_path
        else:
            kwargs["ckpt_path"] = ckpt_path
        self._wrapping_function(idx, spawned.trainer, spawned.function, args, kwargs, spawned.queue)

    def worker_results(self, trainer: Any) -> Any:
        """After every worker has exited: rank 0's results, recovered into `trainer` as Lightning's own
        launch does (None if rank 0 sent none)."""
        spawned = self._spawned
        if spawned is None or spawned.queue.empty():
            return None
        worker_output = spawned.queue.get()
        if trainer is None:
            return worker_output
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    def forget_workers(self) -> None:
        """Drop what the workers were started with (no replacement can start after this)."""
        self._spawned = None

    @contextmanager
    def forwarding_signals(self):
        """While the workers run: SIGTERM/SIGUSR1 to the parent reach every worker; a first Ctrl-C makes
        them checkpoint and stop (as SIGTERM does), a second one kills them (`abandoned`)."""
        import signal

        interrupts, parent = [], os.getpid()

        def forward(signum, frame):  # noqa: ANN001 - signal handler signature
            if os.getpid() != parent:
                return
            if self.stop_requested is None:  # the supervisor bounds the stop from here
                self.stop_requested = time.time()
            if not self.procs:  # still forking: the workers get it as soon as they exist
                self._pending_signal = signum
            for proc in self.procs or []:
                if proc.is_alive():
                    os.kill(proc.pid, signum)

        def interrupt(signum, frame):  # noqa: ANN001 - Ctrl-C: the workers checkpoint; a second one kills
            if os.getpid() != parent:  # a worker between the fork and `hold_stop_signals`: held there
                return
            interrupts.append(signum)
            if len(interrupts) == 1:
                # Every worker gets it as FORWARDED_INTERRUPT: a Ctrl-C to them too, never a second one
                # for those that got the terminal's SIGINT themselves, and the only one for those that
                # did not (`kill -INT` of this process; workers still being forked).
                forward(getattr(signal, FORWARDED_INTERRUPT), frame)
                return
            # The second: the workers are killed now; the supervisor ends the run (no relaunch) and the
            # command writes summary.json and exits EXIT_INTERRUPTED (a third Ctrl-C ends it at once).
            self.abandoned = True
            for proc in self.procs or []:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
            print("second Ctrl-C: the workers are stopped now; the step in progress and its checkpoint are "
                  "abandoned (summary.json is still written)", file=sys.stderr, flush=True)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        forwarded = (signal.SIGTERM, signal.SIGUSR1, getattr(signal, FORWARDED_INTERRUPT))
        previous = {sig: signal.signal(sig, forward) for sig in forwarded}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        """A worker's first code: hold stop signals until training starts (see `hold_stop_signals`).
        A forked worker exits through `os._exit` (no atexit handlers): it destroys its process groups
        here once its work is done (a worker that failed leaves them to the process's end, as a peer
        may be gone)."""
        hold_stop_signals()
        super()._wrapping_function(process_idx, *args, **kwargs)
        _destroy_dist_connection()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))
