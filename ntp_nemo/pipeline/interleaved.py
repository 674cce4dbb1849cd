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

from ntp_nemo.pipeline.engine import ActivationMeter, Backward, PipelineEngine, StepTrace, _default_backward
from ntp_nemo.pipeline.p2p import StageLinks
from ntp_nemo.pipeline.schedule import FORWARD, interleaved_layers, interleaved_order
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

    def send_activation_to(self, x: torch.Tensor, wrap: bool) -> None:
        if wrap:
            self._send(x, self.wrap_next, self._wrap_fwd[(self.rank, self.wrap_next)])
        else:
            self.send_activation(x)

    def recv_activation_from(self, shape, dtype, device, wrap: bool) -> torch.Tensor:
        if wrap:
            group = self._wrap_fwd[(self.wrap_prev, self.rank)]
            return self._recv(shape, dtype, device, self.wrap_prev, group)
        return self.recv_activation(shape, dtype, device)

    def send_gradient_to(self, g: torch.Tensor, wrap: bool) -> None:
        if wrap:
            self._send(g, self.wrap_prev, self._wrap_bwd[(self.wrap_prev, self.rank)])
        else:
            self.send_gradient(g)

    def recv_gradient_from(self, shape, dtype, device, wrap: bool) -> torch.Tensor:
        if wrap:
            group = self._wrap_bwd[(self.rank, self.wrap_next)]
            return self._recv(shape, dtype, device, self.wrap_next, group)
        return self.recv_gradient(shape, dtype, device)


class InterleavedPipelineEngine(PipelineEngine):
    """One rank's `v` chunks of its replica's interleaved pipeline; construction is collective."""

    def __init__(self, model: nn.Module, topology: Topology, rank: int, virtual_stages: int,
                 new_group: Callable | None = None, acc_dtype: torch.dtype = torch.float64) -> None:
        c = topology.coord(rank)
        self.acc_dtype = acc_dtype
        self.model, self.schedule, self.v = model, "interleaved_1f1b", virtual_stages
        self.stage, self.pp = c.stage, topology.pp
        self.first, self.last = c.stage == 0, c.stage == topology.pp - 1
        self.hidden = model.cfg.hidden_size
        self.chunks = chunk_layers(model.cfg.num_layers, self.pp, self.v, self.stage)
        held = sorted(int(k) for k in model.blocks.keys())
        if held != [i for r in self.chunks for i in r]:
            raise ValueError(f"stage {self.stage} holds layers {held}, interleaving needs {self.chunks}")
        self.links = InterleavedLinks(topology, rank, new_group)
        self.meter = ActivationMeter()
        self.trace = StepTrace()
        self._orders: dict[int, list] = {}

    def _order(self, m: int) -> list:
        if m not in self._orders:
            self._orders[m] = interleaved_order(self.stage, self.pp, m, self.v)
        return self._orders[m]

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """(chunk starts the model: embedding, chunk ends it: head)."""
        return self.first and chunk == 0, self.last and chunk == self.v - 1

    def _chunk_forward(self, chunk: int, tokens: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        starts, ends = self._ends(chunk)
        h = self.model.embed_tokens(tokens[:, :-1]) if starts else x
        h = self.model.run_blocks(h, self.chunks[chunk])
        return self.model.token_losses(h, tokens[:, 1:]).sum() if ends else h

    def train(self, microbatches: Sequence[torch.Tensor], global_tokens: int,
              backward: Backward | None = None) -> torch.Tensor:
        """As `PipelineEngine.train`, chunk by chunk in the interleaved order."""
        import time

        backward = backward or _default_backward
        p = self._param
        wire, device = p.dtype, p.device
        if getattr(self.model, "llama", False):
            self.model._rope(torch.empty(0, dtype=wire, device=device))
        self.meter.exclude(list(self.model.parameters()) + list(self.model.buffers())
                           + [t for pair in getattr(self.model, "_rope_cache", {}).values() for t in pair])
        self.trace = StepTrace()
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=self.acc_dtype, device=device)
        inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        for a in self._order(len(microbatches)):
            tokens = microbatches[a.microbatch]
            key = (a.chunk, a.microbatch)
            starts, ends = self._ends(a.chunk)
            if a.kind == FORWARD:
                x = None
                if not starts:
                    x = self.links.recv_activation_from(self._shape(tokens), wire, device,
                                                        wrap=self.first).requires_grad_()
                start = time.perf_counter()
                with self.meter.recording(key):
                    out = self._chunk_forward(a.chunk, tokens, x)
                if ends:
                    total += out.detach().to(self.acc_dtype)
                else:
                    self.meter.add(key, out)
                    self.links.send_activation_to(out.detach().to(wire), wrap=self.last)
                inputs[key], outputs[key] = x, out
            else:
                out = outputs.pop(key)
                if ends:
                    start = time.perf_counter()
                    backward(out / global_tokens)
                else:
                    grad = self.links.recv_gradient_from(tuple(out.shape), wire, device, wrap=self.last)
                    start = time.perf_counter()
                    backward(out, grad.to(out.dtype))
                x = inputs.pop(key)
                if x is not None:
                    self.links.send_gradient_to(x.grad, wrap=self.first)
                self.meter.release(key)
            self.trace.actions.append((a.kind, a.microbatch, start - t0, time.perf_counter() - t0))
        self.links.flush()
        self.trace.step_s = time.perf_counter() - t0
        return total

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward-only pass in the schedule's forward order: summed token loss on the last stage."""
        p = self._param
        total = torch.zeros((), dtype=self.acc_dtype, device=p.device)
        for a in self._order(len(microbatches)):
            if a.kind != FORWARD:
                continue
            tokens = microbatches[a.microbatch]
            starts, ends = self._ends(a.chunk)
            x = None if starts else self.links.recv_activation_from(self._shape(tokens), p.dtype, p.device,
                                                                    wrap=self.first)
            out = self._chunk_forward(a.chunk, tokens, x)
            if ends:
                total += out.to(self.acc_dtype)
            else:
                self.links.send_activation_to(out.to(p.dtype), wrap=self.last)
        self.links.flush()
        return total
