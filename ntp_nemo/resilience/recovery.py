"""In-process recovery: the survivors of a lost rank go on training on the new layout, no restart.

Each worker has a stable process id (its rank in generation 0).  Generation `g` of the job is a layout
and the process id of each of its ranks (`Generation.members`).  When a collective fails (a peer died:
gloo reports the closed connection at once; a hang surfaces as the collective timeout), a survivor:

1. severs its connections of generation `g`, so that every peer blocked on it fails at once too, and
   drops the generation's process groups (`rendezvous.leave`, no collective);
2. waits for the launcher's word on the store: which processes of generation `g` died;
3. applies the failover policy to generation `g`'s layout and the lost ranks (`policies.replan`):
   the new layout and which old rank takes each new rank; a survivor the new layout leaves out exits;
4. joins generation `g + 1` (`PrefixStore(f"gen{g+1}", store)`) with its new rank;
5. agrees with the others on the last completed step: a rank that died inside a collective may have
   let some survivors finish the step and not others; those behind hold stale state and serve as no
   source, so the state comes from the ranks that finished (when they do not cover it: `NoLiveCopy`);
6. builds the new layout's runtime, model and optimizer (the caller's `build`; it may keep the old
   optimizer object, pointed at the new parameters with `live.rebind_optimizer`, so that an LR scheduler
   holding it goes on) and fills them from the survivors' memory (`live.reshard_snapshot`); the caller
   then redoes the interrupted step with the same global batch, split over the new layout's replicas.

`NoLiveCopy` (DP=1, or every holder of some fragment lost) and any error of the protocol itself are for
the caller to turn into the restart path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ntp_nemo.resilience.live import ReshardResult, capture, reshard_snapshot
from ntp_nemo.resilience.policies import Layout, Policy, Replan, replan
from ntp_nemo.resilience.rendezvous import join, leave, wait_failed

# build(layout, rank) -> (runtime, model, optimizer), called on the new generation's default group
BuildFn = Callable[[Layout, int], tuple[Any, Any, Any]]


@dataclass(frozen=True)
class Generation:
    index: int
    layout: Layout
    members: tuple[int, ...]  # process id of each rank

    @classmethod
    def first(cls, layout: Layout) -> Generation:
        return cls(0, layout, tuple(range(layout.world_size)))

    def rank_of(self, pid: int) -> int | None:
        return self.members.index(pid) if pid in self.members else None

    def next(self, failed_pids: Sequence[int], policy: Policy) -> tuple[Generation, Replan]:
        """The generation after losing the processes `failed_pids` (those not in this one are ignored)."""
        lost = [self.members.index(p) for p in failed_pids if p in self.members]
        plan = replan(self.layout, lost, policy)
        return Generation(self.index + 1, plan.new, tuple(self.members[o] for o in plan.assignment)), plan


@dataclass
class Recovery:
    """What a survivor continues with after `recover`."""

    generation: Generation
    rank: int
    runtime: Any
    model: Any
    optimizer: Any
    step: int  # the step to run next (the interrupted one)
    reshard: ReshardResult
    failed: tuple[int, ...]  # process ids lost
    replan: Replan
    detect_t: float
    seconds: float  # detection -> state resharded
    phases: dict[str, float]  # seconds: word (the launcher's), join, build, reshard


def recover(
    store: dist.Store,
    generation: Generation,
    pid: int,
    completed_steps: int,
    old: tuple[Any, Any],
    build: BuildFn,
    policy: Policy,
    *,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> Recovery | None:
    """Run the protocol above on one survivor; None for a survivor the new layout leaves idle.

    `completed_steps` is the number of optimizer steps this process has applied, `old` its (model,
    optimizer) on `generation`'s layout.  Collective over the survivors (through the store)."""
    detect_t = time.time()
    marks = [detect_t]
    leave(store)
    failed = wait_failed(store, generation.index, timeout_s)
    marks.append(time.time())
    new_gen, plan = generation.next(failed, policy)
    rank = new_gen.rank_of(pid)
    if rank is None:
        return None
    join(store, new_gen.index, rank, new_gen.layout.world_size, backend=backend, timeout_s=timeout_s)
    steps: list = [None] * new_gen.layout.world_size
    dist.all_gather_object(steps, int(completed_steps))
    step = max(steps)
    marks.append(time.time())
    old_replica = _replica_of(generation.layout, generation.rank_of(pid))
    snapshot = capture(*old)  # references, no copy; `build` may rebind the old optimizer
    runtime, model, optimizer = build(new_gen.layout, rank)
    marks.append(time.time())
    result = reshard_snapshot(snapshot, model, optimizer, old_replica, stale=completed_steps < step)
    marks.append(time.time())
    phases = {k: b - a for k, a, b in zip(("word", "join", "build", "reshard"), marks[:-1], marks[1:],
                                          strict=True)}
    return Recovery(new_gen, rank, runtime, model, optimizer, step, result, tuple(failed), plan, detect_t,
                    marks[-1] - detect_t, phases)


def _replica_of(layout: Layout, rank: int) -> int:
    for i in range(len(layout.replica_tp)):
        if any(rank in stage for stage in layout.ranks_of(i)):
            return i
    raise ValueError(f"rank {rank} is not in layout {layout.describe()}")
