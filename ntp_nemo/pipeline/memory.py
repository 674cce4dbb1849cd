"""Per-rank memory: an estimate at start from the model slice and the layout, and the measured peak.

Estimate (bytes, this rank):
- parameters, gradients: the local shards' sizes; optimizer: `optimizer_states` tensors per parameter
  (AdamW: exp_avg and exp_avg_sq) in the parameter dtype;
- activations: the bytes autograd saves per micro-batch for this stage, counted from the local
  widths of each layer (heads, MLP columns, vocabulary rows this rank holds), times the most
  micro-batches the schedule keeps in flight on this stage (GPipe: all of the replica's `m`;
  1F1B: min(m, pp - stage); no pipeline: 1).  The per-micro-batch count follows what the CPU
  kernels of this code save (flash-attention SDPA, no recomputation); other kernels save other sets.

Measured: parameter, gradient and optimizer-state tensors summed from the live tensors; the
activation peak from `PipelineEngine`'s saved-tensor accounting (each storage counted once,
parameters excluded); the process's peak resident set size (`resource.getrusage`, which includes
the Python interpreter, libraries and allocator caches) and, on GPU, `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ntp_nemo.pipeline.schedule import simulate

MiB = float(1 << 20)


def _fmt(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.2f} MiB"


def in_flight(schedule: str, stage: int, pp: int, microbatches: int) -> int:
    """Most micro-batches whose activations a stage holds at once."""
    if microbatches == 0:
        return 0
    if pp == 1:
        return 1
    return simulate(schedule, pp, microbatches).peak_in_flight[stage]


def activation_bytes_per_microbatch(model: nn.Module, micro_batch_size: int, seq_len: int) -> int:
    """Bytes autograd keeps for one micro-batch through this stage (see the module docstring)."""
    cfg = model.cfg
    t = micro_batch_size * seq_len
    h = cfg.hidden_size
    e = next(model.parameters()).element_size()

    def norm(module: nn.Module) -> int:  # input, stats, output (+ normalised x for RMS)
        return (3 * t * h + t) if module.rms else (2 * t * h + 2 * t)

    total = 0
    for block in model.blocks.values():
        qd = block.attn.q_proj.weight.shape[0]
        heads = qd // block.attn.head_dim
        # K/V as attention reads them: whole KV groups go in unexpanded (SDPA's grouped-query support);
        # query heads split inside a group read K/V gathered per query head.
        kvd = block.attn.k_proj.weight.shape[0] if block.attn.regular_gqa else qd
        f = block.mlp.up_proj.weight.shape[0]
        attention = 2 * t * qd + 2 * t * kvd + t * heads  # q, k, v, output; logsumexp
        mlp = 4 * t * f if block.mlp.gated else 2 * t * f  # SwiGLU keeps gate, up, their product, SiLU
        total += norm(block.attn_norm) + norm(block.mlp_norm) + attention + mlp
    total *= e
    if model.has_embedding:
        total += t * 8 + (t * e if model.embed.tp.sharded else 0)  # token ids (+ the vocabulary mask)
    if model.has_head:
        vocab = model.embed.weight.shape[0] if model.tied else model.head.weight.shape[0]
        # final norm, softmax of the local logits, targets
        total += e * (norm(model.final_norm) + t * vocab) + t * 8
    else:
        total += t * h * e  # the stage output kept for the backward
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    activations_per_microbatch: int
    in_flight: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def format(self) -> str:
        return (f"estimate: params {_fmt(self.params)}, grads {_fmt(self.grads)}, "
                f"optimizer {_fmt(self.optimizer)}, activations {_fmt(self.activations)} "
                f"({self.in_flight} x {_fmt(self.activations_per_microbatch)}), total {_fmt(self.total)}")


def estimate_memory(model: nn.Module, *, stage: int, pp: int, schedule: str, microbatches: int,
                    micro_batch_size: int, seq_len: int, optimizer_states: int = 2) -> MemoryEstimate:
    """Memory of one rank from its model slice and the layout (`microbatches`: this replica's count)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_mb = activation_bytes_per_microbatch(model, micro_batch_size, seq_len)
    n = in_flight(schedule, stage, pp, microbatches)
    return MemoryEstimate(params, params, optimizer_states * params, n * per_mb, per_mb, n)


@dataclass(frozen=True)
class MeasuredMemory:
    params: int
    grads: int
    optimizer: int
    activations_peak: int | None  # saved-tensor accounting of the pipeline engine (None without one)
    max_rss: int  # whole process
    cuda_peak: int | None

    def format(self) -> str:
        return (f"measured: params {_fmt(self.params)}, grads {_fmt(self.grads)}, "
                f"optimizer {_fmt(self.optimizer)}, activation peak {_fmt(self.activations_peak)}, "
                f"process max RSS {_fmt(self.max_rss)}"
                + (f", CUDA peak {_fmt(self.cuda_peak)}" if self.cuda_peak is not None else ""))


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.2f}"


def format_side_by_side(est: MemoryEstimate, got: MeasuredMemory) -> str:
    """One rank's estimate and measurement on one line, estimate / measured per part, in MiB."""
    return (f"params {_mib(est.params)} / {_mib(got.params)}, grads {_mib(est.grads)} / {_mib(got.grads)}, "
            f"optimizer {_mib(est.optimizer)} / {_mib(got.optimizer)}, activations {_mib(est.activations)} "
            f"({est.in_flight} x {_mib(est.activations_per_microbatch)}) "
            f"/ peak {_mib(got.activations_peak)}, "
            f"total {_mib(est.total)} / max RSS {_mib(got.max_rss)}"
            + (f", CUDA peak {_mib(got.cuda_peak)}" if got.cuda_peak is not None else ""))


def max_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   engine=None) -> MeasuredMemory:
    """What this rank holds now, plus the activation and process peaks so far."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    opt = 0
    if hasattr(optimizer, "state_bytes"):  # DistributedAdamW: its sharded moments, not `state`
        opt = optimizer.state_bytes()
    elif optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    cuda = None
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        cuda = torch.cuda.max_memory_allocated()
    activations = engine.meter.peak if engine is not None else None
    return MeasuredMemory(params, grads, opt, activations, max_rss_bytes(), cuda)


def rank_memory_estimate(runtime, model: nn.Module, *, global_microbatches: int, micro_batch_size: int,
                         seq_len: int) -> MemoryEstimate:
    """`estimate_memory` for the rank an `NTPRuntime` drives (its stage, schedule and batch share)."""
    counts = runtime.microbatch_counts(global_microbatches)
    return estimate_memory(model, stage=runtime.coord.stage, pp=runtime.topology.pp,
                           schedule=runtime.schedule, microbatches=counts[runtime.coord.replica],
                           micro_batch_size=micro_batch_size, seq_len=seq_len)
