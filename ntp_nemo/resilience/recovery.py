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
5. agrees with the others on where the job stands: the last completed step and, within the steps'
   boundary, how many collectives between steps were entered (`phase`; `IN_STEP` inside a step).  A
   rank that died inside a collective may have let some survivors finish the step and not others (or
   the launcher's word aborted the step on one survivor after another had applied it); those behind
   hold stale state and serve as no source, so the state comes from the ranks that finished (when they
   do not cover it: `NoLiveCopy`), and the caller takes the step as done on them from the summary
   (`note`) of a rank that finished it (`Recovery.behind`);
6. builds the new layout's runtime, model and optimizer (the caller's `build`, e.g. `runtime.assemble`;
   it may keep the old optimizer object, pointed at the new parameters with `rebind_optimizer`, so that
   an LR scheduler holding it goes on) and fills them from the survivors' memory
   (`live.reshard_snapshot`); the caller then redoes the interrupted step with the same global batch,
   split over the new layout's replicas.

`NoLiveCopy` (DP=1, or every holder of some fragment lost) and any error of the protocol itself are for
the caller to turn into the restart path.

Rejoin (`grow` on the survivors, `arrive` on a repaired process): the launcher announces on the store
that repaired processes join before step `T` (`rendezvous.publish_rejoin`); at the start of step `T`
every survivor waits on the store for the others (so no collective of generation `g` is still in
flight), drops generation `g` and joins generation `g + 1` on the original layout with every process
in its original place; the repaired processes have joined it from their start-up.  All build the
layout's runtime, model and optimizer in the same order, agree on the last completed step, and the
repaired processes (holding nothing valid) receive their shards from the survivors, the survivors of a
degraded replica their re-split: the same reshard as a failure's, in the other direction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from ntp_nemo.launch.node_layout import node_name
from ntp_nemo.resilience.live import Captured, ReshardResult, capture, reshard_snapshot
from ntp_nemo.resilience.policies import Policy, Replan, replan
from ntp_nemo.resilience.rendezvous import failed_key, join, leave, store_barrier, wait_failed
from ntp_nemo.topology.layout import ResolvedLayout

# build(layout, rank) -> the rank's state on `layout` (a `runtime.assemble.RankState`, or any object with
# its `runtime`, `model` and `optimizer`), called on the new generation's default group
BuildFn = Callable[[ResolvedLayout, int], Any]

# The phase of a survivor inside a training step: after every collective between the previous step and it.
IN_STEP = 1 << 30


@dataclass(frozen=True)
class Generation:
    index: int
    layout: ResolvedLayout
    members: tuple[int, ...]  # process id of each rank

    @classmethod
    def first(cls, layout: ResolvedLayout) -> Generation:
        return cls(0, layout, tuple(range(layout.world_size)))

    def rank_of(self, pid: int) -> int | None:
        return self.members.index(pid) if pid in self.members else None

    def grown(self, layout: ResolvedLayout) -> Generation:
        """The generation after a rejoin: `layout` (the original one) with every process in its place."""
        return Generation(self.index + 1, layout, tuple(range(layout.world_size)))

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
    state: Any  # what `build` returned: the rank's runtime, model and optimizer on the new layout
    step: int  # the step to run next (the interrupted one): the survivors' most completed steps
    reshard: ReshardResult
    failed: tuple[int, ...]  # process ids lost
    replan: Replan | None  # None for a rejoin
    detect_t: float
    seconds: float  # detection -> state resharded
    phases: dict[str, float]  # seconds: word (the launcher's), join, build, reshard
    # Where the most advanced survivors stood: collectives between steps entered after `step` steps
    # (`IN_STEP`: inside the next step), and what one of them said of its last completed step (`note`)
    phase: int = IN_STEP
    note: Any = None
    behind: bool = False  # this survivor had completed fewer steps: the others' last one is done here too
    # One console line when a TP group of the new layout spans nodes (`tp_across_nodes`), else None
    cross_node: str | None = None

    @property
    def runtime(self) -> Any:
        return self.state.runtime

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer


def tp_across_nodes(layout: ResolvedLayout, hosts: Sequence[str], *, rejoin: bool) -> str | None:
    """One console line when a TP group of `layout` (rank r runs on node `hosts[r]`) spans nodes, None when
    every group is inside one node.  NTP keeps TP inside a node (the start-up refuses a placement that
    does not, `launch/node_layout.check_tp_within_nodes`); after a recovery the processes are where they
    are: a replacement started on another node than the process it replaces (a rejoin puts it in that
    process's place), or survivors of several nodes re-planned into one replica.  The policy keeps the
    group (the run goes on, its all-reduces crossing the network every layer) and the line says so."""
    from ntp_nemo.launch.node_layout import tp_groups_across_nodes

    topology = layout.topology()  # no process group is made: the rank arithmetic only
    spanning = tp_groups_across_nodes(hosts, topology.tp_group_tuples())
    if not spanning:
        return None
    group, names = spanning[0]
    where = ", ".join(f"{n} (ranks {[r for r in group if hosts[r] == n]})" for n in names)
    c = topology.coord(group[0])
    more = f" (and {len(spanning) - 1} more TP group(s))" if len(spanning) > 1 else ""
    why = ("a rejoin puts every process back in its place" if rejoin
           else "the failover policy re-plans over the survivors where they run")
    fix = ("start replacements on the node of the process they replace (srun --nodelist)" if rejoin
           else "make each node's process count a multiple of the replicas' TP sizes")
    return (f"failover | live: warning: the TP group of ranks {list(group)} (replica {c.replica}, stage "
            f"{c.stage}) spans nodes {where}{more}; kept ({why}): its all-reduces now cross the network "
            f"every layer; to keep TP inside a node, {fix}")


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
    notice: int | None = None,
    snapshot: Captured | None = None,
    phase: int = IN_STEP,
    note: Any = None,
) -> Recovery | None:
    """Run the protocol above on one survivor; None for a survivor the new layout leaves idle.

    `completed_steps` is the number of optimizer steps this process has applied, `old` its (model,
    optimizer) on `generation`'s layout; `phase` where it failed after them (`IN_STEP`: inside the next
    step; k: inside the k-th collective between steps) and `note` its summary of its last completed step
    (any picklable value), handed to the survivors behind.  Collective over the survivors (through the
    store).

    A rejoin that failed (`grow` raised: a process died while generation `g + 1` formed or resharded)
    is re-formed with `notice=g + 1` and `snapshot` (what `grow` captured of `old` before building): the
    launcher's list of generation `g + 1`'s lost processes is read, and the survivors form generation
    `g + 2` from `generation`'s layout without those of its members on the list (the same layout when
    only repaired processes died), filled from the snapshot."""
    detect_t = time.time()
    marks = [detect_t]
    leave(store)
    failed = wait_failed(store, generation.index if notice is None else notice, timeout_s)
    marks.append(time.time())
    new_gen, plan = generation.next(failed, policy)
    if notice is not None:
        new_gen = replace(new_gen, index=notice + 1)
    rank = new_gen.rank_of(pid)
    if rank is None:
        return None
    join(store, new_gen.index, rank, new_gen.layout.world_size, backend=backend, timeout_s=timeout_s)
    stands: list = [None] * new_gen.layout.world_size
    dist.all_gather_object(stands, (int(completed_steps), int(phase), note, node_name()))
    step, front, front_note, _ = max(stands, key=lambda s: (s[0], s[1]))
    cross_node = tp_across_nodes(new_gen.layout, [s[3] for s in stands], rejoin=False)
    if min(s[0] for s in stands) < step - 1:  # every step's collectives span every survivor: impossible
        raise RuntimeError(f"the survivors stand more than one step apart ({sorted(s[0] for s in stands)} "
                           "steps completed): the live state cannot be agreed on")
    marks.append(time.time())
    old_replica = generation.layout.replica_of(generation.rank_of(pid))
    if snapshot is None:
        snapshot = capture(*old)  # references, no copy; `build` may rebind the old optimizer
    state = build(new_gen.layout, rank)
    marks.append(time.time())
    result = reshard_snapshot(snapshot, state.model, state.optimizer, old_replica,
                              stale=completed_steps < step)
    marks.append(time.time())
    phases = {k: b - a for k, a, b in zip(("word", "join", "build", "reshard"), marks[:-1], marks[1:],
                                          strict=True)}
    return Recovery(new_gen, rank, state, step, result, tuple(failed), plan, detect_t,
                    marks[-1] - detect_t, phases, phase=front, note=front_note,
                    behind=completed_steps < step, cross_node=cross_node)


def grow(store: dist.Store, generation: Generation, layout: ResolvedLayout, pid: int, completed_steps: int,
         old: tuple[Any, Any], build: BuildFn, *, backend: str = "gloo", timeout_s: float = 60.0,
         snapshot: Captured | None = None) -> Recovery:
    """A survivor's side of a rejoin (see the module docstring); collective with `arrive`.  `snapshot`:
    `capture(*old)`, taken by the caller to re-form from if the rejoin fails (`recover(notice=...)`)."""
    start = time.time()
    marks = [start]
    # A survivor lost before it came here is published for the generation being formed (`g + 1`)
    store_barrier(store, f"rejoin/gen{generation.index}/left", len(generation.members), timeout_s,
                  abort_key=failed_key(generation.index + 1))
    leave()  # generation `g` is healthy and idle: nothing to sever
    new_gen = generation.grown(layout)
    rank = new_gen.rank_of(pid)
    join(store, new_gen.index, rank, layout.world_size, backend=backend, timeout_s=timeout_s)
    marks.append(time.time())
    old_replica = generation.layout.replica_of(generation.rank_of(pid))
    if snapshot is None:
        snapshot = capture(*old)
    state = build(layout, rank)
    marks.append(time.time())
    stands: list = [None] * layout.world_size  # (completed steps, node) of every rank; `arrive` sends its own
    dist.all_gather_object(stands, (int(completed_steps), node_name()))
    steps = [s[0] for s in stands]
    result = reshard_snapshot(snapshot, state.model, state.optimizer, old_replica,
                              stale=completed_steps < max(steps))
    marks.append(time.time())
    phases = {k: b - a for k, a, b in zip(("join", "build", "reshard"), marks[:-1], marks[1:], strict=True)}
    return Recovery(new_gen, rank, state, max(steps), result, (), None, start,
                    marks[-1] - start, phases,
                    cross_node=tp_across_nodes(layout, [s[1] for s in stands], rejoin=True))


def arrive(model: Any, optimizer: Any, replica: int) -> tuple[int, ReshardResult]:
    """A repaired process's side of a rejoin, on generation `g + 1`'s default group, after building
    its runtime, model and optimizer (in the survivors' order): returns (last completed step, result).
    Its model holds nothing valid: every element comes from the survivors."""
    stands: list = [None] * dist.get_world_size()
    dist.all_gather_object(stands, (-1, node_name()))  # as `grow` sends: (completed steps, node)
    return max(s[0] for s in stands), reshard_snapshot(capture(model, optimizer), model, optimizer, replica,
                                                       stale=True)
