"""Interleaved 1F1B: each pipeline stage holds `v` model chunks (virtual stages) of its replica's model.

The layers are split evenly into `p * v` virtual stages; stage `s` holds virtual stages `c * p + s`
(chunk `c = 0..v-1`), so one rank's model is a `DecoderLM` over the union of its chunks' layers
(parameter names stay the global ones; the embedding sits on stage 0, the head on the last stage) and
the engine runs one chunk at a time (`run_blocks(x, layers)`).  Activations leave the last stage's
chunk `c` for the first stage's chunk `c + 1` over extra "wrap" links (one two-rank group per direction,
like every other link), gradients flow back the same way.  Gradient sync, clipping, checkpoints and the
optimizer see an ordinary model; a parameter receives one gradient per micro-batch, as without
interleaving, so the overlapped sync's counting holds.  Works with any TP degree per replica (the links
pair slot j with slot j, as `StageLinks` does) and any micro-batch count (see `schedule.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ntp_nemo.pipeline.engine import PipelineEngine
from ntp_nemo.pipeline.p2p import StageLinks
from ntp_nemo.pipeline.schedule import interleaved_layers, interleaved_order
from ntp_nemo.topology import Topology
from ntp_nemo.topology.groups import new_subgroup


def chunk_layers(num_layers: int, pp: int, v: int, stage: int) -> list[range]:
    """Global layer indices of each chunk of `stage` (virtual stage c * pp + stage, balanced split)."""
    return interleaved_layers(num_layers, pp, v, stage)


def stage_layers(num_layers: int, pp: int, v: int, stage: int) -> list[int]:
    return [i for r in chunk_layers(num_layers, pp, v, stage) for i in r]


class InterleavedLinks(StageLinks):
    """`StageLinks` plus the wrap links between a replica's last and first stage (collective)."""

    def __init__(self, topology: Topology, rank: int, new_group: Callable | None = None) -> None:
        super().__init__(topology, rank, new_group)
        new_group = new_group or new_subgroup  # tensors only: no gloo side on a GPU world
        c = topology.coord(rank)
        self.first, self.last = c.stage == 0, c.stage == topology.pp - 1
        self._wrap_fwd: dict[tuple[int, int], object] = {}
        self._wrap_bwd: dict[tuple[int, int], object] = {}
        for r in range(topology.dp):
            first = topology.stage_ranks(r, 0)
            for slot, a in enumerate(topology.stage_ranks(r, topology.pp - 1)):
                b = first[slot % len(first)]
                self._wrap_fwd[(a, b)] = new_group([a, b])
                self._wrap_bwd[(a, b)] = new_group([a, b])
        self.wrap_next = next((b for (a, b) in self._wrap_fwd if a == rank), None)  # last stage -> first
        self.wrap_prev = next((a for (a, b) in self._wrap_fwd if b == rank), None)  # first stage <- last

    # A stage's chunk that crosses between the last and the first stage always takes a wrap link: the
    # last stage never sends activations to a next stage, the first never receives one from a previous.
    def send_activation(self, x: torch.Tensor) -> None:
        if self.last:
            self._send(x, self.wrap_next, self._wrap_fwd[(self.rank, self.wrap_next)])
        else:
            super().send_activation(x)

    def recv_activation(self, shape, dtype, device) -> torch.Tensor:
        if self.first:
            group = self._wrap_fwd[(self.wrap_prev, self.rank)]
            return self._recv(shape, dtype, device, self.wrap_prev, group)
        return super().recv_activation(shape, dtype, device)

    def send_gradient(self, g: torch.Tensor) -> None:
        if self.first:
            self._send(g, self.wrap_prev, self._wrap_bwd[(self.wrap_prev, self.rank)])
        else:
            super().send_gradient(g)

    def recv_gradient(self, shape, dtype, device) -> torch.Tensor:
        if self.last:
            group = self._wrap_bwd[(self.rank, self.wrap_next)]
            return self._recv(shape, dtype, device, self.wrap_next, group)
        return super().recv_gradient(shape, dtype, device)


class InterleavedPipelineEngine(PipelineEngine):
    """One rank's `v` chunks of its replica's interleaved pipeline; construction is collective."""

    def __init__(self, model: nn.Module, topology: Topology, rank: int, virtual_stages: int,
                 new_group: Callable | None = None, acc_dtype: torch.dtype = torch.float64) -> None:
        stage = topology.coord(rank).stage
        self.v = virtual_stages
        self.chunks = chunk_layers(model.cfg.num_layers, topology.pp, virtual_stages, stage)
        held = sorted(int(k) for k in model.blocks.keys())
        if held != [i for r in self.chunks for i in r]:
            raise ValueError(f"stage {stage} holds layers {held}, interleaving needs {self.chunks}")
        self._orders: dict[int, list] = {}
        super().__init__(model, topology, rank, "interleaved_1f1b", new_group, acc_dtype)

    def _make_links(self, topology: Topology, rank: int, new_group: Callable | None) -> StageLinks:
        return InterleavedLinks(topology, rank, new_group)

    def _order(self, m: int) -> list:
        if m not in self._orders:
            self._orders[m] = interleaved_order(self.stage, self.pp, m, self.v)
        return self._orders[m]

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """(chunk starts the model: embedding, chunk ends it: head)."""
        return self.first and chunk == 0, self.last and chunk == self.v - 1

    def _chunk_layers(self, chunk: int) -> Sequence[int]:
        return self.chunks[chunk]
