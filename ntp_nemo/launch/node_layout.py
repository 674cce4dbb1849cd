"""The per-node process layout of a job started by torchrun or srun, read from the launcher's variables.

NTP jobs often run unequal process counts per node (a node that lost a GPU keeps its other GPUs):

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (this node's process count), GROUP_RANK
  (this node's index) and GROUP_WORLD_SIZE (the number of nodes);
- srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES and the task list
  SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (`4,3`, `4(x2),3`).

Every rank sees the same `num_nodes` and its own node's process count; the global rank is the
launcher's, never `node_rank * processes_per_node + local_rank`.

A batch script (`sbatch`) runs once, on the allocation's first node, with the allocation's SLURM_*
variables (SLURM_NTASKS, SLURM_PROCID=0, ...) but none of a task step's (srun sets SLURM_STEP_ID,
SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE): taken for a launch of SLURM_NTASKS ranks, its one
process would wait in `init_process_group` for ranks nobody started.  It is not a launcher here:
`ntp-train` launches its ranks on that node, and refuses an allocation of several nodes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ntp_nemo.errors import ConfigError

# Set in a task of a cluster job once `ntp-coordinator` gave it its place (resilience/cluster_task.py).
PLACE_ENV = "NTP_PLACE"
WORLD_ENV = "NTP_WORLD_SIZE"
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
_SPECIAL_STEP_IDS = 0xFFFFFFF0  # batch, extern, interactive and pending steps sit at the top of the range


def _slurm_interactive(env: Mapping[str, str]) -> bool:
    return env.get("SLURM_JOB_NAME") in ("bash", "interactive")  # Lightning's convention


def in_srun_task_step(env: Mapping[str, str]) -> bool:
    """This process is a task of an `srun` job step (not the batch script, not an `extern` shell)."""
    if "SLURM_STEP_NUM_TASKS" in env or "SLURM_STEP_TASKS_PER_NODE" in env:
        return True
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    return step.isdigit() and int(step) < _SPECIAL_STEP_IDS


def slurm_batch_without_srun(env: Mapping[str, str] | None = None) -> bool:
    """Inside a SLURM allocation (a batch script's variables) but not started by `srun`."""
    env = os.environ if env is None else env
    return (all(k in env for k in _SLURM_TASK_VARS) and not _slurm_interactive(env)
            and not in_srun_task_step(env))


def check_not_batch_of_several_nodes(env: Mapping[str, str] | None = None) -> None:
    """A batch script without `srun` in an allocation of several nodes: stop (the ranks of the other
    nodes would never start); on one node `ntp-train` launches its ranks itself."""
    env = os.environ if env is None else env
    nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1)
    if slurm_batch_without_srun(env) and nodes > 1:
        raise ConfigError(
            "launcher",
            f"this process runs inside a SLURM allocation of {nodes} nodes "
            f"(SLURM_NNODES={nodes}, SLURM_NTASKS={env['SLURM_NTASKS']}) but was not started by srun, so "
            "no rank runs on the other nodes; in the sbatch script start it with "
            "`srun python -m ntp_nemo.train ...` (one task per rank), or allocate one node to launch "
            "every rank here.",
        )


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed per-node task list: `4,3` -> [4, 3]; `4(x2),3` -> [4, 4, 3]."""
    counts: list[int] = []
    for part in text.split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise ConfigError(
                "SLURM_TASKS_PER_NODE",
                f"{text!r} is not a SLURM task list (expected e.g. `4,3` or `4(x2),3`); "
                "launch with srun so that SLURM sets it, or unset the SLURM variables.",
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _step_tasks_here(env: Mapping[str, str]) -> int:
    """How many tasks of this srun step run on this node (1 outside srun)."""
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = int(env.get("SLURM_NODEID", 0))
    if tasks:
        per_node = parse_tasks_per_node(tasks)
        if node < len(per_node):
            return per_node[node]
    return int(env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_NTASKS", 1)))


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits in a launcher-created job."""

    launcher: str  # torchrun | slurm | coordinator (an srun task placed by ntp-coordinator)
    global_rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # processes on this node (Lightning's `devices`)
    node_rank: int
    num_nodes: int
    per_node: tuple[int, ...] | None = None  # every node's process count, when the launcher tells

    def check(self, expected_world: int) -> None:
        """The launcher started the number of processes the layout needs, on a consistent node list."""
        if self.world_size != expected_world:
            raise ConfigError(
                "mesh",
                f"{self.launcher} started {self.world_size} processes but the layout needs "
                f"{expected_world} (pp x sum(ntp.replica_tp)); adjust ntp.replica_tp/mesh.* or the "
                "launcher's process counts (torchrun --nproc-per-node per node, srun --ntasks).",
            )
        if self.per_node is not None and sum(self.per_node) != self.world_size:
            raise ConfigError(
                "SLURM_TASKS_PER_NODE",
                f"per-node task counts {list(self.per_node)} sum to {sum(self.per_node)}, not the "
                f"{self.world_size} tasks of the job.",
            )
        if not (0 <= self.local_rank < self.local_world_size and 0 <= self.node_rank < self.num_nodes):
            raise ConfigError(
                "launcher",
                f"inconsistent {self.launcher} variables: local rank {self.local_rank} of "
                f"{self.local_world_size}, node {self.node_rank} of {self.num_nodes}.",
            )


def launcher_layout(env: Mapping[str, str] | None = None) -> ProcessLayout | None:
    """The layout given by torchrun (checked first: torchrun may run inside a SLURM allocation) or
    srun; None when no external launcher started this process (a batch script without srun included).
    An srun task under `ntp-coordinator` that got its place (`NTP_PLACE`, `NTP_WORLD_SIZE`) is that
    place of the job's world (launcher `coordinator`): a replacement's own srun step has one task."""
    env = os.environ if env is None else env
    if PLACE_ENV in env and WORLD_ENV in env:
        return ProcessLayout(
            "coordinator",
            global_rank=int(env[PLACE_ENV]),
            world_size=int(env[WORLD_ENV]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=_step_tasks_here(env),
            node_rank=0,
            num_nodes=1,  # Lightning's view of this task: its node's tasks (no node arithmetic)
        )
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return ProcessLayout(
            "torchrun",
            global_rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            node_rank=int(env.get("GROUP_RANK", 0)),
            num_nodes=int(env.get("GROUP_WORLD_SIZE", 1)),
        )
    if all(k in env for k in _SLURM_TASK_VARS) and not _slurm_interactive(env) and in_srun_task_step(env):
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        node = int(env["SLURM_NODEID"])
        if tasks:
            per_node: tuple[int, ...] | None = tuple(parse_tasks_per_node(tasks))
        elif "SLURM_NTASKS_PER_NODE" in env:
            per_node = tuple([int(env["SLURM_NTASKS_PER_NODE"])] * int(env.get("SLURM_NNODES", 1)))
        else:
            per_node = None
        nodes = len(per_node) if per_node else int(env.get("SLURM_NNODES", 1))
        local = per_node[node] if per_node and node < len(per_node) else int(env.get("SLURM_NTASKS", 1))
        return ProcessLayout(
            "slurm",
            global_rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env["SLURM_LOCALID"]),
            local_world_size=local,
            node_rank=node,
            num_nodes=nodes,
            per_node=per_node,
        )
    return None


# ---- where the ranks landed: one exchange of host facts at start-up ----------------------------------
@dataclass(frozen=True)
class NodeFacts:
    """What one rank reports about its node at start-up (`exchange_node_facts`)."""

    host: str
    visible_gpus: int  # CUDA devices this process sees (NVML: no CUDA context)
    gpus_on_node: int | None  # the node's GPUs as SLURM allocated them (SLURM_GPUS_ON_NODE), if told


def gpus_on_node(env: Mapping[str, str] | None = None) -> int | None:
    """The GPUs SLURM allocated on this node to the job: SLURM_GPUS_ON_NODE, else a plain count in
    SLURM_GPUS_PER_NODE (`8`, `h200:8`); None when SLURM does not say."""
    env = os.environ if env is None else env
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        text = env.get(key, "").strip()
        count = text.rsplit(":", 1)[-1].split("(", 1)[0]
        if count.isdigit():
            return int(count)
    return None


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This process's node: SLURM's name for it (SLURMD_NODENAME, set in every task of a job step), else
    the host name."""
    import socket

    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME", "").strip() or socket.gethostname()


def local_node_facts(visible_gpus: int, env: Mapping[str, str] | None = None,
                     host: str | None = None) -> NodeFacts:
    """This process's facts; its node is `host`, else `node_name`."""
    env = os.environ if env is None else env
    return NodeFacts(host or node_name(env), int(visible_gpus), gpus_on_node(env))


def exchange_node_facts(mine: NodeFacts) -> list[NodeFacts]:
    """Every rank's `NodeFacts`, index = global rank: one `all_gather_object` on the world group
    (collective: every rank calls it once, after the process group is up)."""
    import torch.distributed as dist

    out: list[NodeFacts | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [f if isinstance(f, NodeFacts) else NodeFacts("?", 0, None) for f in out]


def tp_groups_across_nodes(hosts: Sequence[str], groups: Sequence[tuple[int, ...]]
                           ) -> list[tuple[tuple[int, ...], list[str]]]:
    """The TP groups (rank tuples) whose ranks run on more than one host, each with its hosts in
    rank order; `hosts[r]` is global rank r's host."""
    out = []
    for g in groups:
        names = list(dict.fromkeys(hosts[r] for r in g))
        if len(names) > 1:
            out.append((tuple(g), names))
    return out


def cross_node_tp_message(spanning: Sequence[tuple[tuple[int, ...], list[str]]], hosts: Sequence[str],
                          describe=None) -> str:
    """One paragraph: which TP groups span nodes, where their ranks run, and the fix."""
    describe = describe or (lambda g: f"ranks {list(g)}")
    first, names = spanning[0]
    where = ", ".join(f"{n}: ranks {[r for r in first if hosts[r] == n]}" for n in names)
    more = f" (and {len(spanning) - 1} more TP group(s))" if len(spanning) > 1 else ""
    per_node = dict.fromkeys(hosts)
    counts = ", ".join(f"{n} {sum(h == n for h in hosts)}" for n in per_node)
    return (f"the TP group of {describe(first)} spans {len(names)} nodes ({where}){more}: its per-layer "
            "all-reduces would cross the inter-node network every layer. Global ranks run replica by "
            "replica, stage by stage, and the launcher places them in order, node by node "
            f"(processes per node now: {counts}); make every node's process count a multiple of the "
            "stages' TP sizes (ntp.replica_tp, mesh.pp), place ranks in blocks (srun "
            "--distribution=block, torchrun --nproc-per-node per node in rank order), or set "
            "ntp.allow_cross_node_tp=true to run it anyway with a warning.")


def check_tp_within_nodes(hosts: Sequence[str], topology, allow: bool = False) -> str | None:
    """Raise ConfigError (key `ntp.allow_cross_node_tp`) when a TP group or per-layer TP subgroup of
    `topology` spans nodes; with `allow`, return the message as a warning instead (None: all inside)."""
    spanning = tp_groups_across_nodes(hosts, topology.tp_group_tuples())
    if not spanning:
        return None

    def describe(g: tuple[int, ...]) -> str:
        c = topology.coord(g[0])
        return f"replica {c.replica} stage {c.stage} (ranks {g[0]}-{g[-1]})"

    message = cross_node_tp_message(spanning, hosts, describe)
    if allow:
        return message
    raise ConfigError("ntp.allow_cross_node_tp", message)


def isolated_gpu_warning(facts: Sequence[NodeFacts]) -> str | None:
    """One warning for the nodes whose tasks each see one GPU though the node has more (per-task
    device isolation, e.g. `srun --gpus-per-task=1`: NCCL then cannot use NVLink or CUDA IPC between
    the node's tasks); None when no rank is isolated."""
    isolated: dict[str, int] = {}
    for f in facts:
        if f.visible_gpus == 1 and (f.gpus_on_node or 0) > 1:
            isolated.setdefault(f.host, f.gpus_on_node or 0)
    if not isolated:
        return None
    names = list(isolated)
    shown = ", ".join(f"{n} ({isolated[n]} GPUs)" for n in names[:4]) + (
        f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"each task sees one GPU on {len(names)} node(s) with more: {shown}. With per-task device "
            "isolation NCCL cannot use NVLink or CUDA IPC between the tasks of a node (TP all-reduces go "
            "through host memory or the network); start the tasks with every GPU of the node visible "
            "(srun --gpus-per-node=N without --gpus-per-task; each task binds cuda:<SLURM_LOCALID>).")


def check_placement(topology, *, allow_cross_node_tp: bool, visible_gpus: int,
                    env: Mapping[str, str] | None = None, host: str | None = None,
                    warn: Callable[[str], None] | None = None) -> list[str]:
    """Where the ranks of a launcher-started job landed, checked once at start-up (collective: one
    `all_gather_object` of every rank's host, visible GPUs and the node's GPU count).  Raises
    ConfigError when a TP group spans nodes (unless `allow_cross_node_tp`); returns the warnings, the
    same on every rank: a TP group across nodes (allowed), tasks each seeing one GPU of a larger node.
    `warn` receives each warning as it is found, the isolated-GPU one before a refusal too, so that a
    refused job learns of both of its placement problems at once."""
    facts = exchange_node_facts(local_node_facts(visible_gpus, env, host))
    isolated = isolated_gpu_warning(facts)
    try:
        spanning = check_tp_within_nodes([f.host for f in facts], topology, allow_cross_node_tp)
    except ConfigError:
        if isolated and warn is not None:
            warn(isolated)
        raise
    warnings = [w for w in (spanning, isolated) if w]
    for w in warnings:
        if warn is not None:
            warn(w)
    return warnings
