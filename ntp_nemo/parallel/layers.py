"""Tensor-parallel layers with uneven shards (Megatron names and semantics).

A layer holds only its rank's slice of the logical parameter; the slice is described by a
`ShardSpec` stored on the parameter (`param.ntp_spec`), together with the number of identical
copies of it inside this rank's DP replica (`param.ntp_copies`) and how the unsharded tensor is
initialised (`param.ntp_init`).  Gradient sync, checkpoints and initialisation read those
attributes; nothing else about parallelism leaks into the model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ntp_nemo.parallel.chunks import Launched, finish_exit, finished, launch_exit
from ntp_nemo.parallel.comm import to_compute_dtype
from ntp_nemo.parallel.sequence import (
    enter_tp_region,
    exit_tp_region,
    gather_and_project,
    overlapped,
    replicated_grad_sum,
)
from ntp_nemo.topology.shard import ShardSpec
from ntp_nemo.topology.tp_context import TPContext


def annotate(param: nn.Parameter, spec: ShardSpec, copies: int, init: tuple) -> nn.Parameter:
    """Attach sharding metadata: the slice held, identical copies in the replica, the init rule."""
    param.ntp_spec = spec  # type: ignore[attr-defined]
    param.ntp_copies = copies  # type: ignore[attr-defined]
    param.ntp_init = init  # type: ignore[attr-defined]
    return param


def sharded_param(spec: ShardSpec, copies: int, init: tuple) -> nn.Parameter:
    return annotate(nn.Parameter(torch.empty(spec.local_shape)), spec, copies, init)


def replicated_param(shape: tuple[int, ...], tp: TPContext, init: tuple) -> nn.Parameter:
    """A parameter every rank of the replica holds whole (norms, row-parallel biases)."""
    return sharded_param(ShardSpec.full(shape), tp.size * tp.copies, init)


def _interval(tp: TPContext, units: int, interval: tuple[int, int] | None, unit_size: int) -> tuple[int, int]:
    """The caller's interval, else this rank's share (balanced, or by the group's `tp.weights`); one-element
    units are aligned to `tp.align` (larger units, e.g. attention heads, are whole already)."""
    if interval is not None:
        return interval
    return tp.interval(units, tp.align if unit_size == 1 else 1)


def set_tp_overlap(model: nn.Module, on: bool) -> nn.Module:
    """`ntp.tp_overlap`: the column-parallel projections of `model` (and the embedding table where it is
    the tied output head) overlap their input gradient's TP collective (all-reduce, or reduce-scatter
    under SP) with their weight gradients in the backward (`sequence._OverlappedProject`); the same
    values either way.  Not covered: a tied head without SP, which enters its region in the model."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            module.tp_overlap = bool(on)
    return model


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split into units across the TP group (output stays local)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPContext,
        *,
        unit_size: int = 1,
        interval: tuple[int, int] | None = None,
        bias: bool = True,
        std: float = 0.02,
        copy_input: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        # False when the caller already entered the TP region once for several projections of the same
        # input (q/k/v, gate/up): one input-gradient all-reduce instead of one per projection.
        self.copy_input = copy_input
        self.tp_overlap = False  # `set_tp_overlap`: the input gradient's collective beside the weight's
        units = out_features // unit_size
        lo, hi = _interval(tp, units, interval, unit_size)
        self.weight = sharded_param(
            ShardSpec.split((out_features, in_features), 0, unit_size, lo, hi), tp.copies, ("normal", std)
        )
        self.bias = (
            sharded_param(ShardSpec.split((out_features,), 0, unit_size, lo, hi), tp.copies, ("zeros",))
            if bias
            else None
        )

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """`seq_len`: the whole sequence's length, needed to gather `x`'s slices under SP."""
        if self.copy_input and overlapped((self,), self.tp):
            return gather_and_project(x, self.tp, x.shape[1] if seq_len is None else seq_len, (self,))[0]
        if self.copy_input:
            x = enter_tp_region(to_compute_dtype(x), self.tp, x.shape[1] if seq_len is None else seq_len)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across the TP group; partial sums all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPContext,
        *,
        unit_size: int = 1,
        interval: tuple[int, int] | None = None,
        bias: bool = True,
        std: float = 0.02,
    ) -> None:
        super().__init__()
        self.tp = tp
        units = in_features // unit_size
        lo, hi = _interval(tp, units, interval, unit_size)
        self.weight = sharded_param(
            ShardSpec.split((out_features, in_features), 1, unit_size, lo, hi), tp.copies, ("normal", std)
        )
        self.bias = replicated_param((out_features,), tp, ("zeros",)) if bias else None
        self.grad_reducer = None  # the model's ReplicatedGradReducer under SP (set by the model)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        return self._add_bias(exit_tp_region(F.linear(x_local, self.weight), self.tp))

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return y
        return y + replicated_grad_sum(self.bias, self.tp, self.grad_reducer)

    def launch(self, x_local: torch.Tensor) -> Launched:
        """`forward` with the exit's collective launched and not waited for (`ntp.tp_chunks`): `finish`
        gives `forward`'s result.  A quantised layer (whose quantisers wrap its own forward) runs that
        forward here, and `finish` returns its result."""
        if hasattr(self, "weight_quantizer"):
            return finished(self(x_local), self.tp)
        return launch_exit(F.linear(x_local, self.weight), self.tp)

    def finish(self, launched: Launched) -> torch.Tensor:
        """Wait for `launch`'s collective; what `forward` returns."""
        if launched.done:
            return launched.link
        return self._add_bias(finish_exit(launched))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-range ids contribute zeros before the all-reduce."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPContext, *, std: float = 0.02) -> None:
        super().__init__()
        self.tp = tp
        lo, hi = tp.interval(num_embeddings, tp.align)
        self.vocab_start, self.vocab_end = lo, hi
        self.tp_overlap = False  # as the tied output head's projection (`set_tp_overlap`)
        self.weight = sharded_param(
            ShardSpec.split((num_embeddings, dim), 0, 1, lo, hi), tp.copies, ("normal", std)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.sharded:
            out = F.embedding(ids, self.weight)
            return to_compute_dtype(out).to(out.dtype)  # rounded as the sharded rows are (identity in fp32)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(inside, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        # Under autocast the partial rows cross the wire in the compute dtype: each token's row comes from
        # one rank (the others send zeros), so the sum is that row rounded once, as at TP 1 (below).
        return exit_tp_region(to_compute_dtype(out), self.tp).to(out.dtype)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are upcast for the softmax; float32/float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# Tokens per chunk of the cross entropy: a chunk's float32 temporaries (its upcast logits, their exp) hold
# about this many bytes whatever the vocabulary (128K columns: 128 tokens a chunk).
CE_CHUNK_BYTES = 1 << 26


def _token_chunks(n_tokens: int, local_vocab: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    step = chunk_tokens or max(1, CE_CHUNK_BYTES // max(1, 4 * local_vocab))
    return [(a, min(a + step, n_tokens)) for a in range(0, n_tokens, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy of vocabulary-sharded logits with one collective: every rank all-gathers each token's
    (local max, local sum of exp(logit - local max), target logit or 0), then combines them as a
    log-sum-exp, `M = max_r m_r`, `S = sum_r s_r exp(m_r - M)`, `loss = log S + M - target`: the value of
    the unsharded softmax (a max all-reduce then a sum all-reduce would be two collectives).  With no
    group (an unsharded head) the same function runs on the whole vocabulary.

    Memory: the logits are read in chunks of tokens (`CE_CHUNK_BYTES`), each upcast to float32 only for
    its own statistics; the backward recomputes each chunk's softmax from the saved logits (their own
    dtype: bf16 under autocast) and the per-token log-sum-exp.  So neither pass holds float32 logits of
    the whole batch: at 8 x 2048 tokens and 128K columns those are 8.4 GB a copy, and the whole-batch
    version held three of them at its forward's peak and saved one for the backward
    (docs/performance.md, ce_memory)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, chunk_tokens=None):  # type: ignore[override]
        import torch.distributed as dist

        n_tokens, local_vocab = logits.shape
        inside = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = torch.where(inside, target - vocab_start, torch.zeros_like(target))
        chunks = _token_chunks(n_tokens, local_vocab, chunk_tokens)
        mine = torch.empty((3, n_tokens), dtype=_upcast(logits[:0]).dtype, device=logits.device)
        for a, b in chunks:
            x = _upcast(logits[a:b])
            m = x.max(dim=-1).values
            mine[0, a:b] = m
            mine[1, a:b] = (x - m.unsqueeze(-1)).exp_().sum(dim=-1)
            mine[2, a:b] = x.gather(-1, local_target[a:b].unsqueeze(-1)).squeeze(-1) * inside[a:b]
        if group is not None:
            n = dist.get_world_size(group)
            every = mine.new_empty((n * mine.shape[0], *mine.shape[1:]))
            dist.all_gather_single(every, mine, group=group)
            every = every.view(n, *mine.shape)
            maxes = every[:, 0]
            global_max = maxes.max(dim=0).values
            sum_exp = (every[:, 1] * (maxes - global_max).exp()).sum(dim=0)
            target_logit = every[:, 2].sum(dim=0)
        else:
            global_max, sum_exp, target_logit = mine[0], mine[1], mine[2]
        lse = sum_exp.log() + global_max
        ctx.save_for_backward(logits, lse, inside, local_target)
        ctx.chunks = chunks
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        logits, lse, inside, local_target = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a, b in ctx.chunks:
            p = (_upcast(logits[a:b]) - lse[a:b].unsqueeze(-1)).exp_()  # this chunk's softmax
            p.scatter_add_(-1, local_target[a:b].unsqueeze(-1), -inside[a:b].to(p.dtype).unsqueeze(-1))
            grad[a:b] = p.mul_(grad_loss[a:b].unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, target: torch.Tensor, vocab_start: int, tp: TPContext,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-sharded logits, identical to the unsharded value; the logits
    are read `chunk_tokens` tokens at a time (default: `CE_CHUNK_BYTES` of float32 a chunk)."""
    flat = _VocabParallelCrossEntropy.apply(
        logits_local.flatten(0, -2), target.flatten(), vocab_start if tp.sharded else 0,
        tp.group if tp.sharded else None, chunk_tokens,
    )
    return flat.view(target.shape)
