"""RecoveryHooks: everything NTPStrategy asks of recovery, in one object.

The strategy takes one at construction (`NTPStrategy(..., recovery=...)`); this base class is a run
without recovery, every method doing what the strategy does alone.  `resilience/` implements it for
live recovery (`resilience/live_worker.py: LiveRecovery`): the launcher of its workers, the rendezvous
of a cluster task, a repaired process's start-up (join a running generation, receive the state from
the survivors in place of a checkpoint, keep its collectives local until its first step), and every
training step and collective between steps run under recovery.

Which hook runs when:
- in the launching process, while the Trainer is built: `make_launcher` (forked workers only);
- in a worker, as it starts: `init_process_group`, then `restore_state` in place of a checkpoint load;
  `rejoining` and `collectives_local` are read throughout;
- every training step: `before_step`, then `run_step` around the step; the module brackets its
  optimizer update with `abort_epoch` and `check_generation`;
- every validation step: `run_validation_step` around it;
- every collective between steps (barrier, broadcast, checkpoint save): `run_between_steps`;
- the end of training's checkpoint save: `run_final_save` (under live recovery a loss during it is
  recovered from and the save written again: no next step follows whose save would replace it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RecoveryHooks:
    """No recovery: the strategy's own behaviour."""

    def make_launcher(self, strategy: Any) -> Any | None:
        """The launcher of the workers the strategy forks; None for the strategy's own (`ForkLauncher`)."""
        return None

    def init_process_group(self, strategy: Any) -> bool:
        """Initialise the default process group in place of the strategy's env:// rendezvous; False if
        this object leaves it to the strategy."""
        return False

    @property
    def rejoining(self) -> bool:
        """This process was started to join a running job (its start-up is not the others')."""
        return False

    def collectives_local(self) -> bool:
        """The strategy's barriers, broadcasts and reductions stay in this process for now."""
        return False

    def restore_state(self, strategy: Any) -> dict[str, Any] | None:
        """The state to resume from in place of reading the checkpoint (Lightning's part; the tensors are
        installed by this call), or None to read the checkpoint."""
        return None

    def before_step(self, strategy: Any) -> None:
        """At the start of every training step, before `run_step`."""

    def run_step(self, strategy: Any, step_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one training step (`step_fn(*args, **kwargs)`)."""
        return step_fn(*args, **kwargs)

    def run_validation_step(self, strategy: Any, step_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run one validation step (`step_fn(*args, **kwargs)`)."""
        return step_fn(*args, **kwargs)

    def run_between_steps(self, strategy: Any, fn: Callable, *args: Any, what: str | None = None) -> Any:
        """Run a collective outside the training step (`fn(*args)`); `what` names it for a message."""
        return fn(*args)

    def run_final_save(self, strategy: Any, save: Callable[[bool], None],
                       committed: Callable[[], bool]) -> None:
        """The end of training's checkpoint save: `save(again)` (`again`: it was tried before and did not
        commit); `committed()` says whether it did."""
        save(False)

    def abort_epoch(self) -> int:
        """A counter the step reads at its start and hands to `check_generation` before its update."""
        return 0

    def aborts_silently(self) -> bool:
        """Whether a collective of an aborted generation may return without raising (NCCL), so that the
        optimizer's own collectives are checked (`check_generation`) before their results are written."""
        return False

    def check_generation(self, epoch: int) -> None:
        """Raise if the step's collectives may have returned garbage since `abort_epoch()` gave `epoch`."""
