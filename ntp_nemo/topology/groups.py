"""Creating process groups: which backend each uses, the run's collective timeout on every one, and
the TCP sockets gloo opens for them.

Timeout: `dist.new_group` without `timeout` takes torch's backend default (30 minutes for gloo and for
the `cpu:gloo,cuda:nccl` string, 10 for NCCL), not the timeout the default group was created with
(`fault.collective_timeout_s`): a hang inside a subgroup would surface long after the configured time.
Every group the runtime creates goes through `new_group`/`new_subgroup` here, which pass the default
group's own timeout on.

Backend: gloo connects every pair of a group's ranks when the group is created (a full mesh: one TCP
socket per peer, per group), and a world of `cpu:gloo,cuda:nccl` gives every group created without a
backend a gloo side too.  At about 1,000 ranks the world's mesh plus the meshes of every TP group,
fragment holder set and pipeline link reach the default open-file limit (1,024).  So gloo groups exist
only where objects travel:

- the world group: `all_gather_object` of the parameter descriptors (`runtime.assemble`), the
  checkpoint records and metadata, the recovery step agreement, the log lines of the callbacks;
- the checkpoint writer's own world-sized group (`checkpoint.async_save`: the background save gathers
  its records there, beside the training thread's collectives).

The subgroups (TP groups, fragment holder sets, pipeline links) carry device tensors only, so on a
mixed world they take the device backend alone (`subgroup_backend`), which opens no socket at creation
(NCCL connects lazily, over its own transport).  On a CPU world (gloo alone) every group is gloo: its
tensors need it, except the TP groups (below).

TP groups of a CPU world of CPU ranks: the `ntpdirect` backend (`topology.direct_group`: tensor
collectives over direct TCP connections on the calling thread; at two ranks 3 to 12 times cheaper per
collective than gloo on CPU: docs/performance.md, ntpdirect), unless `ntp.cpu_tp_backend=gloo`; ranks
on GPUs never take it (it moves CPU tensors only: `tp_backend`).  The strategy passes that key to its
workers as `NTP_NEMO_CPU_TP_BACKEND` (read here, in the worker, when the groups are made: a live
recovery's groups follow it too).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def subgroup_backend(world_backend: str) -> str | None:
    """Backend of a subgroup in a world of `world_backend`: the device parts of a mixed string
    (`"cpu:gloo,cuda:nccl"` -> `"cuda:nccl"`), else None (the world's own backend)."""
    parts = [p.strip() for p in str(world_backend).split(",") if p.strip()]
    if len(parts) < 2 or not all(":" in p for p in parts):
        return None
    device = [p for p in parts if p.split(":", 1)[0] != "cpu"]
    return ",".join(device) if device and len(device) < len(parts) else None


def group_timeout(group: Any = None) -> timedelta | None:
    """The timeout `group` (default: the world) was created with; None where its backend does not say
    (the fake backend of the dry run)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    own = getattr(pg, "timeout", None)  # a process group written in Python (`direct_group`) says it
    if isinstance(own, timedelta):
        return own
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except (RuntimeError, AttributeError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def new_group(ranks: Sequence[int], backend: str | None = None) -> Any:
    """`dist.new_group(ranks)` with the world group's timeout (collective over the world, like it)."""
    return dist.new_group(list(ranks), backend=backend, timeout=group_timeout())


def new_subgroup(ranks: Sequence[int]) -> Any:
    """A group that carries tensors only (collective: every rank calls it): the device backend alone on
    a mixed world, the world group's timeout."""
    return new_group(ranks, backend=subgroup_backend(dist.get_backend()))


CPU_TP_BACKEND_ENV = "NTP_NEMO_CPU_TP_BACKEND"


def tp_backend(world_backend: str, device: torch.device | str = "cpu") -> str | None:
    """Backend of a TP group in a world of `world_backend` whose ranks compute on `device` (the runtime's):
    `ntpdirect` (CPU tensors only) on a CPU world (gloo alone) of CPU ranks unless
    `NTP_NEMO_CPU_TP_BACKEND=gloo`; else that of any subgroup (`subgroup_backend`): a gloo world on GPUs
    (ranks sharing one GPU) keeps gloo, which moves CUDA tensors; a mixed world takes its device part."""
    on_cpu = torch.device(device).type == "cpu"
    if (on_cpu and str(world_backend) == "gloo"
            and os.environ.get(CPU_TP_BACKEND_ENV, "ntpdirect") == "ntpdirect"):
        from ntp_nemo.topology.direct_group import register

        return register()
    return subgroup_backend(world_backend)


def new_tp_group(ranks: Sequence[int], device: torch.device | str = "cpu") -> Any:
    """A TP group (collective: every rank calls it) of ranks computing on `device`: `tp_backend` of the
    world's backend, the world group's timeout."""
    return new_group(ranks, backend=tp_backend(dist.get_backend(), device))


def gloo_sockets(world_size: int, subgroup_peers: int, *, gloo_subgroups: bool,
                 checkpoint_group: bool) -> int:
    """TCP sockets gloo opens on one rank: one per peer of every gloo group it belongs to (the world,
    the checkpoint writer's group, and with `gloo_subgroups` its subgroups, `subgroup_peers` peers over
    all of them)."""
    total = (world_size - 1) * (1 + checkpoint_group) if world_size > 1 else 0
    return total + (subgroup_peers if gloo_subgroups else 0)


# Descriptors a rank needs besides gloo's sockets: the store, NCCL's and the data loaders' sockets and
# pipes, checkpoint and log files.
OPEN_FILES_MARGIN = 256


def open_files_needed(world_size: int, subgroup_peers: int = 0, *, gloo_subgroups: bool = False) -> int:
    """Open files one rank needs at start-up: the sockets of the world group and of the checkpoint
    writer's group (2 x (world - 1)), those of gloo subgroups where they are gloo, plus a margin."""
    return gloo_sockets(world_size, subgroup_peers, gloo_subgroups=gloo_subgroups,
                        checkpoint_group=True) + OPEN_FILES_MARGIN


def raise_open_file_limit(needed: int, world_size: int) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (an unprivileged process may) and
    return (soft before, soft now); a ConfigError when even the hard limit is below `needed`, before
    any group is created (gloo would fail at a later group, or at the first checkpoint)."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to raise
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if now != resource.RLIM_INFINITY and now < needed:
        from ntp_nemo.errors import ConfigError

        raise ConfigError(
            "ulimit -n",
            f"a rank of this {world_size}-rank job needs about {needed} open files (gloo opens one "
            f"socket per peer for the world group and for the checkpoint writer's group: 2 x "
            f"({world_size} - 1), plus {OPEN_FILES_MARGIN} for the rest) but this process may open only "
            f"{now} (soft limit raised to the hard limit {hard}); raise the hard limit for the job "
            "(`ulimit -Hn` in the batch script before srun, or the cluster's limits.conf / "
            "slurm.conf PropagateResourceLimits), or run fewer ranks.",
        )
    return soft, now


@contextmanager
def counting_new_groups() -> Iterator[list[int]]:
    """Count the `torch.distributed.new_group` calls made while active (one entry per call: its group
    size); every one is collective over the world.  The dry run checks its count of communicator
    splits with it."""
    calls: list[int] = []
    original = dist.new_group

    def counted(ranks=None, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(ranks) if ranks is not None else dist.get_world_size())
        return original(ranks, *args, **kwargs)

    dist.new_group = counted
    try:
        yield calls
    finally:
        dist.new_group = original
