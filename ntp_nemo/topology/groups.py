"""Creating process groups that carry the run's collective timeout.

`dist.new_group` without `timeout` takes torch's backend default (30 minutes for gloo and for the
`cpu:gloo,cuda:nccl` string, 10 for NCCL), not the timeout the default group was created with
(`fault.collective_timeout_s`): a hang inside a subgroup would surface long after the configured time.
Every group the runtime creates goes through `new_group` here, which passes the default group's own
timeout on.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def group_timeout(group: Any = None) -> timedelta | None:
    """The timeout `group` (default: the world) was created with; None where its backend does not say
    (the fake backend of the dry run)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
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
