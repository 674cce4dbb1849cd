"""Runs one replica's micro-batches through its pipeline stages (GPipe or 1F1B) on point-to-point ops.

Why not `torch.distributed.pipelining`: its stages would fit the layout (one pipeline group per TP
slot, since all stages of a replica have the same TP degree), but (1) its schedules run the
backward through `torch.autograd` themselves, so Lightning's `manual_backward` (precision-plugin
loss scaling, backward hooks) cannot drive it; (2) a schedule object splits one batch tensor into a
fixed number of micro-batches, while here each replica receives its capacity-proportional list of
micro-batches from the global sampler and the count changes on failover; (3) the bubble and memory
reports need per-action timings and saved-activation accounting inside the schedule loop.  The
schedule itself is a short action list (`schedule.py`), so it is written on point-to-point ops.

Replicas never talk during the schedule (different micro-batch counts per replica are fine); only
the gradient sync after the step joins them.  The loss exists only on the last stage; the other
stages return zero, and `NTPRuntime.global_sum` counts last-stage ranks only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ntp_nemo.parallel.comm import compute_dtype
from ntp_nemo.pipeline.p2p import StageLinks
from ntp_nemo.pipeline.schedule import FORWARD, Action, schedule_order
from ntp_nemo.topology import Topology

Backward = Callable[..., None]  # backward(tensor) for a loss, backward(tensor, grad) for a stage output


def wire_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of the messages between stages: the compute dtype (`parallel.comm.compute_dtype`: under
    autocast its dtype, else the parameters').  Under bf16-mixed the residual stream is float32 (the norms
    and residual adds run in it), and sending it as such would move twice the bytes; as Megatron does,
    activations and their gradients cross in the compute dtype, and the receiving stage takes them back
    into the parameters' dtype (one rounding of the residual stream per stage boundary)."""
    return compute_dtype(param)


def _default_backward(tensor: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    tensor.backward(grad)


class ActivationMeter:
    """Bytes of tensors autograd saves for backward, live per micro-batch (a storage counts once).

    Parameters, buffers and other long-lived tensors registered with `exclude` are not counted.
    The stage output kept for the backward is added explicitly by the engine.  `peak` is the
    largest total since construction.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0
        self._seen: dict[int, set[int]] = {}
        self._exclude: set[int] = set()
        self._current: int | None = None

    def exclude(self, tensors) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in tensors}

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def add(self, mb: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        seen = self._seen.setdefault(mb, set())
        if ptr in self._exclude or ptr in seen:
            return
        seen.add(ptr)
        self.live[mb] = self.live.get(mb, 0) + storage.nbytes()
        self.peak = max(self.peak, self.total)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None:
            self.add(self._current, t)
        return t

    def recording(self, mb: int):
        self._current = mb
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def release(self, mb: int) -> None:
        self.live.pop(mb, None)
        self._seen.pop(mb, None)


@dataclass
class StepTrace:
    """Timings of one pipeline step on this rank (seconds from the step start)."""

    actions: list[tuple[str, int, float, float]] = field(default_factory=list)  # (kind, mb, start, end)
    step_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.actions)

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.step_s if self.step_s > 0 else 0.0


class PipelineEngine:
    """One rank's stage of its replica's pipeline; construction is collective (link groups)."""

    def __init__(self, model: nn.Module, topology: Topology, rank: int, schedule: str = "1f1b",
                 new_group: Callable | None = None, acc_dtype: torch.dtype = torch.float64) -> None:
        c = topology.coord(rank)
        self.acc_dtype = acc_dtype  # loss accumulator (float32 on devices without float64)
        self.model, self.schedule = model, schedule
        self.stage, self.pp = c.stage, topology.pp
        self.first, self.last = c.stage == 0, c.stage == topology.pp - 1
        self.hidden = model.cfg.hidden_size
        self.links = self._make_links(topology, rank, new_group)
        self.meter = ActivationMeter()
        self.trace = StepTrace()

    def _make_links(self, topology: Topology, rank: int, new_group: Callable | None) -> StageLinks:
        return StageLinks(topology, rank, new_group)

    @property
    def _param(self) -> torch.Tensor:
        return next(self.model.parameters())

    def _shape(self, tokens: torch.Tensor, first_layer: int | None = None) -> tuple[int, int, int]:
        """Shape of the activation entering global layer `first_layer` (default: this stage's first):
        under sequence parallelism the send carries only this rank's slice of the sequence."""
        if first_layer is None:
            first_layer = min((int(k) for k in self.model.blocks.keys()), default=self.model.cfg.num_layers)
        lo, hi = self.model.hidden_interval(first_layer, tokens.shape[1] - 1)
        return (tokens.shape[0], hi - lo, self.hidden)

    # ---- what an engine defines: its action order and its model chunks (one here) ------------------
    def _order(self, m: int) -> list[Action]:
        return schedule_order(self.schedule, self.stage, self.pp, m)

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """(chunk starts the model: embedding, chunk ends it: head)."""
        return self.first, self.last

    def _chunk_forward(self, chunk: int, tokens: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        starts, ends = self._ends(chunk)
        h = self.model.embed_tokens(tokens[:, :-1]) if starts else x
        h = self.model.run_blocks(h, self._chunk_layers(chunk), seq_len=tokens.shape[1] - 1)
        return self.model.token_losses(h, tokens[:, 1:]).sum() if ends else h

    def _chunk_layers(self, chunk: int) -> Sequence[int] | None:
        return None  # every layer this stage holds

    def _in_shape(self, chunk: int, tokens: torch.Tensor) -> tuple[int, int, int]:
        """Shape of the activation `chunk` receives (its first layer's sequence slice under SP)."""
        layers = self._chunk_layers(chunk)
        return self._shape(tokens, layers[0] if layers else None)

    # ---- the schedule loop, shared by every engine ------------------------------------------------
    def train(self, microbatches: Sequence[torch.Tensor], global_tokens: int,
              backward: Backward | None = None) -> torch.Tensor:
        """Forward and backward of this replica's micro-batches in the engine's order; gradients of the
        loss summed over tokens and divided by `global_tokens`.  Returns the summed token loss on the
        last stage, 0 elsewhere."""
        backward = backward or _default_backward
        p = self._param
        wire, device = wire_dtype(p), p.device
        if getattr(self.model, "uses_rope", False):  # build the rotary tables now: they are not activations
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
                    shape = self._in_shape(a.chunk, tokens)
                    # back in the parameters' dtype: the residual stream of an autocast model is float32
                    x = self.links.recv_activation(shape, wire, device).to(p.dtype).requires_grad_()
                start = time.perf_counter()
                with self.meter.recording(key):
                    out = self._chunk_forward(a.chunk, tokens, x)
                if ends:
                    total += out.detach().to(self.acc_dtype)
                else:
                    self.meter.add(key, out)
                    self.links.send_activation(out.detach().to(wire))
                inputs[key], outputs[key] = x, out
            else:
                out = outputs.pop(key)
                if ends:
                    start = time.perf_counter()
                    backward(out / global_tokens)
                else:
                    grad = self.links.recv_gradient(tuple(out.shape), wire, device)
                    start = time.perf_counter()
                    backward(out, grad.to(out.dtype))
                x = inputs.pop(key)
                if x is not None:
                    self.links.send_gradient(x.grad.to(wire))
                self.meter.release(key)
            self.trace.actions.append((a.kind, a.microbatch, start - t0, time.perf_counter() - t0))
        self.links.flush()
        self.trace.step_s = time.perf_counter() - t0
        return total

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward-only pass (validation) in the order's forwards: summed token loss on the last stage,
        0 elsewhere."""
        p = self._param
        wire = wire_dtype(p)
        total = torch.zeros((), dtype=self.acc_dtype, device=p.device)
        for a in self._order(len(microbatches)):
            if a.kind != FORWARD:
                continue
            tokens = microbatches[a.microbatch]
            starts, ends = self._ends(a.chunk)
            shape = None if starts else self._in_shape(a.chunk, tokens)
            x = None if starts else self.links.recv_activation(shape, wire, p.device).to(p.dtype)
            out = self._chunk_forward(a.chunk, tokens, x)
            if ends:
                total += out.to(self.acc_dtype)
            else:
                self.links.send_activation(out.to(wire))
        self.links.flush()
        return total
