"""The per-node process layout of a job started by torchrun or srun, read from the launcher's variables.

NTP jobs often run unequal process counts per node (a node that lost a GPU keeps its other GPUs):

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (this node's process count), GROUP_RANK
  (this node's index) and GROUP_WORLD_SIZE (the number of nodes);
- srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES and the task list
  SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (`4,3`, `4(x2),3`).

Every rank sees the same `num_nodes` and its own node's process count; the global rank is the
launcher's, never `node_rank * processes_per_node + local_rank`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ntp_nemo.errors import ConfigError

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


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


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits in a launcher-created job."""

    launcher: str  # torchrun | slurm
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
    srun; None when no external launcher started this process."""
    env = os.environ if env is None else env
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
    interactive = env.get("SLURM_JOB_NAME") in ("bash", "interactive")  # Lightning's convention
    slurm_vars = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
    if not interactive and all(k in env for k in slurm_vars):
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
