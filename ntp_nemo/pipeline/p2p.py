"""Point-to-point links between neighbouring pipeline stages of one replica.

Activations leaving a stage are replicated over its TP ranks, so stage `s` slot `j` sends to stage
`s+1` slot `j mod n` (all stages of a replica run at the replica's degree, so with equal `n` that is
slot `j` to slot `j`), and gradients flow back the same way.

Groups: one per stage pair of a replica and direction (the ranks of stages `s` and `s+1`; activations
in one, gradients in the other), not one per link: with `device_id` bound each `new_group` is a
world-wide communicator split (`ncclCommSplit`), and at 1,022 ranks with PP 2 two groups per link made
about 1,000 of them before step 1.  Each rank talks to exactly one peer in each of its groups (its slot
partner), so every group still carries one rank's messages one way, in micro-batch order, and the order
in which the two sides post them always agrees (NCCL serialises a communicator's operations per rank,
and a send queued behind an unmatched send would otherwise deadlock).  Replicas never share a group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ntp_nemo.topology import Topology
from ntp_nemo.topology.groups import new_subgroup


def stage_pair_ranks(topology: Topology, replica: int, stage: int) -> list[int]:
    """The ranks of one link group: stage `stage` and stage `stage + 1` of `replica`."""
    return topology.stage_ranks(replica, stage) + topology.stage_ranks(replica, stage + 1)


def link_groups(topology: Topology) -> list[list[int]]:
    """The rank lists of the link groups, one per stage pair of each replica, in the order all ranks
    create them (each is created twice: activations, gradients)."""
    return [stage_pair_ranks(topology, r, s) for r in range(topology.dp) for s in range(topology.pp - 1)]


def link_pairs(topology: Topology) -> list[tuple[int, int]]:
    """Every (sender, receiver) forward link of the world, in a fixed order all ranks agree on."""
    pairs = []
    for r in range(topology.dp):
        for s in range(topology.pp - 1):
            for rank in topology.stage_ranks(r, s):
                pairs.append((rank, topology.pipeline_peer(rank, +1)))
    return pairs


class StageLinks:
    """This rank's links: activations to/from the neighbouring stages and the matching gradients.

    Construction is collective (every rank creates every link group, in the same order).
    """

    def __init__(self, topology: Topology, rank: int,
                 new_group: Callable[[list[int]], Any] | None = None) -> None:
        new_group = new_group or new_subgroup  # tensors only: no gloo side on a GPU world
        self.rank = rank
        self.prev = topology.pipeline_peer(rank, -1)
        self.next = topology.pipeline_peer(rank, +1)
        self._fwd: dict[tuple[int, int], Any] = {}  # (sender, receiver) -> its stage pair's group
        self._bwd: dict[tuple[int, int], Any] = {}
        groups: dict[tuple[int, int], tuple[Any, Any]] = {}
        for r in range(topology.dp):
            for s in range(topology.pp - 1):
                if len(topology.stage_ranks(r, s)) != len(topology.stage_ranks(r, s + 1)):
                    raise RuntimeError("stages of one replica must have the same number of ranks")
                ranks = stage_pair_ranks(topology, r, s)
                groups[(r, s)] = (new_group(ranks), new_group(ranks))
        for a, b in link_pairs(topology):
            c = topology.coord(a)
            self._fwd[(a, b)], self._bwd[(a, b)] = groups[(c.replica, c.stage)]
        self.pending: list[tuple[Any, torch.Tensor]] = []

    # ---- sends: non-blocking; the buffer is kept alive until the send completes --------------
    def _send(self, tensor: torch.Tensor, dst: int, group: Any) -> None:
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, group=group), tensor))
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def send_activation(self, x: torch.Tensor) -> None:
        self._send(x, self.next, self._fwd[(self.rank, self.next)])

    def send_gradient(self, g: torch.Tensor) -> None:
        self._send(g, self.prev, self._bwd[(self.prev, self.rank)])

    # ---- receives: blocking (the caller needs the data now) -------------------------------------
    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group: Any
              ) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buf, src=src, group=group).wait()
        return buf

    def recv_activation(self, shape, dtype, device) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.prev, self._fwd[(self.prev, self.rank)])

    def recv_gradient(self, shape, dtype, device) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.next, self._bwd[(self.rank, self.next)])

    def flush(self) -> None:
        """Wait for every outstanding send (end of a step)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
