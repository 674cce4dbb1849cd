"""The Lightning cluster environments for jobs started by torchrun or srun, accepting unequal process
counts per node: Lightning gets `devices` = this node's process count and `num_nodes` = the node count
(see ntp_nemo.launch.node_layout), and the global rank stays the launcher's.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.node_layout import ProcessLayout, launcher_layout, parse_tasks_per_node

__all__ = [
    "NTPCoordinatedEnvironment",
    "NTPSLURMEnvironment",
    "NTPTorchElasticEnvironment",
    "ProcessLayout",
    "cluster_environment",
    "launcher_layout",
    "parse_tasks_per_node",
    "port_taken_error",
]


def _validate(env_name: str, layout: ProcessLayout, num_devices: int, num_nodes: int) -> None:
    if (num_devices, num_nodes) != (layout.local_world_size, layout.num_nodes):
        raise ValueError(
            f"{env_name}: Lightning was given devices={num_devices}, num_nodes={num_nodes} but the "
            f"launcher runs {layout.local_world_size} process(es) on this node and "
            f"{layout.num_nodes} node(s)."
        )


class NTPTorchElasticEnvironment(TorchElasticEnvironment):
    """torchrun's environment accepting unequal process counts per node (devices = this node's count)."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        layout = launcher_layout()
        assert layout is not None
        _validate("torchrun", layout, num_devices, num_nodes)


class NTPSLURMEnvironment(SLURMEnvironment):
    """SLURM's environment accepting heterogeneous task lists such as `4,3` (srun --ntasks=7 over two
    nodes, which Lightning's own environment refuses for want of --ntasks-per-node)."""

    @staticmethod
    def _validate_srun_variables() -> None:
        pass  # the per-node counts come from SLURM_(STEP_)TASKS_PER_NODE; checked in validate_settings

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        layout = launcher_layout()
        assert layout is not None
        _validate("SLURM", layout, num_devices, num_nodes)


class NTPCoordinatedEnvironment(ClusterEnvironment):
    """An srun task placed by `ntp-coordinator`: its global rank is its place and the world is the job's
    (not its srun step's: a replacement runs in a step of one task); both move with a live recovery
    (`NTPStrategy.adopt`).  The process groups rendezvous on the coordinator's store, not at
    `main_address:main_port`."""

    def __init__(self, layout: ProcessLayout) -> None:
        self._rank, self._world, self._local = layout.global_rank, layout.world_size, layout.local_rank
        address = os.environ.get("NTP_COORDINATOR", "127.0.0.1:0")
        self._host, _, port = address.rpartition(":")
        self._port = int(port) if port.isdigit() else 0

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._host

    @property
    def main_port(self) -> int:
        return self._port

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world

    def set_world_size(self, size: int) -> None:
        self._world = size

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    def local_rank(self) -> int:
        return self._local

    def node_rank(self) -> int:
        return 0


def cluster_environment(layout: ProcessLayout | None):
    """The Lightning cluster environment plugin for `layout`.  None (no external launcher): ntp-train
    launches the ranks, in Lightning's own environment, never one Lightning would detect from a batch
    script's SLURM_NTASKS (a SLURM launch that nobody started)."""
    if layout is None:
        return LightningEnvironment()
    if layout.launcher == "torchrun":
        return NTPTorchElasticEnvironment()
    if layout.launcher == "coordinator":
        return NTPCoordinatedEnvironment(layout)
    return NTPSLURMEnvironment(auto_requeue=False)  # PreemptionCheckpoint owns SIGTERM/SIGUSR1


def port_taken_error(err: BaseException, env=None) -> ConfigError | None:
    """The ConfigError for a rendezvous store that could not listen on MASTER_PORT because another
    process holds it (torch's `DistNetworkError ... EADDRINUSE`); None for any other error."""
    text = str(err)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return None
    env = os.environ if env is None else env
    port, addr = env.get("MASTER_PORT", "unset"), env.get("MASTER_ADDR", "unset")
    return ConfigError(
        "MASTER_PORT",
        f"{port} on {addr} is taken by another process, so rank 0 of this job cannot host torch's "
        "rendezvous store there. If ntp-coordinator runs for this job (it listens on MASTER_PORT), start "
        "the tasks with NTP_COORDINATOR exported (`export NTP_COORDINATOR=$MASTER_ADDR:$MASTER_PORT` "
        "before srun) so that they use its store; otherwise choose a free MASTER_PORT (e.g. "
        "`export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))`: below Linux's ephemeral ports).",
    )
