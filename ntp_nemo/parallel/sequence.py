"""Sequence parallelism on uneven TP degrees: the sequence split and its autograd-aware collectives.

In the regions TP replicates (norms, dropout, residual adds) rank `i` of a TP group of `n` holds the
tokens `[floor(i*S/n), floor((i+1)*S/n))` of the sequence (the balanced-interval rule of the shards),
so a degree that does not divide the sequence (8192 over 7: 1171 or 1170 tokens) gives slices uneven
by one token.  The entry of a column-parallel layer all-gathers the slices (backward: reduce-scatter),
the exit of a row-parallel layer reduce-scatters the partial sums (backward: all-gather): the bytes of
the all-reduce they replace.

Why uneven slices and padded collectives: the local tensors hold exactly their tokens (no compute or
activation memory on padding), while the wire uses equal pieces of `ceil(S/n)` tokens because gloo
(and `all_gather_single`/`reduce_scatter_single` everywhere) needs equal sizes; gloo's
`all_gather` rejects uneven lists.  The padding costs `n*ceil(S/n) - S` tokens on the wire: 5 of 8192
at degree 7 (0.06%), none where the degree divides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ntp_nemo.parallel.comm import copy_to_tp, reduce_from_tp, to_compute_dtype
from ntp_nemo.topology.shard import unit_interval
from ntp_nemo.topology.tp_context import TPContext


def seq_split(tp: TPContext) -> int:
    """Number of slices the sequence is split into in this context's replicated regions (1: whole)."""
    return tp.size if tp.sequence_parallel else 1


def seq_interval(tp: TPContext, seq_len: int) -> tuple[int, int]:
    """Tokens `[lo, hi)` of a `seq_len` sequence this rank holds in the context's replicated regions."""
    n = seq_split(tp)
    return unit_interval(tp.rank if n > 1 else 0, n, seq_len)


def seq_lengths(n: int, seq_len: int) -> list[int]:
    return [hi - lo for lo, hi in (unit_interval(i, n, seq_len) for i in range(n))]


class Pending:
    """A collective launched with `async_op=True` and what turns its output buffer into the result:
    `wait()` waits for it (on CUDA: makes the current stream wait for the communication stream, so what
    the caller does with the result afterwards is ordered after it) and returns the result.  `keep` holds
    the buffers the collective reads until then."""

    def __init__(self, work: Any, finish: Any, *keep: torch.Tensor) -> None:
        self.work, self.finish, self.keep = work, finish, keep

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        self.keep = ()
        return self.finish()


def _gather_buffers(x: torch.Tensor, tp: TPContext, seq_len: int):
    """(output buffer, this rank's piece, what turns the filled output into [b, seq_len, ...]) of the
    sequence all-gather."""
    n = tp.size
    lengths = seq_lengths(n, seq_len)
    m = max(lengths)
    out = x.new_empty((n * m, x.shape[0], *x.shape[2:]))
    if seq_len == n * m:  # the degree divides the sequence: no padding, no copies around the wire
        return out, x.transpose(0, 1).contiguous(), lambda: out.transpose(0, 1).contiguous()
    piece = x.new_zeros((m, x.shape[0], *x.shape[2:]))
    piece[: x.shape[1]] = x.transpose(0, 1)

    def finish() -> torch.Tensor:
        parts = [out[i * m : i * m + lengths[i]] for i in range(n)]
        return torch.cat(parts, dim=0).transpose(0, 1).contiguous()

    return out, piece, finish


def _all_gather_seq(x: torch.Tensor, tp: TPContext, seq_len: int) -> torch.Tensor:
    """[b, s_i, ...] slices -> [b, seq_len, ...] on every rank (padded pieces on the wire)."""
    out, piece, finish = _gather_buffers(x, tp, seq_len)
    dist.all_gather_single(out, piece, group=tp.group)
    return finish()


def start_all_gather_seq(x: torch.Tensor, tp: TPContext, seq_len: int) -> Pending:
    """`_all_gather_seq` launched without waiting for it (`Pending.wait()` gives the result)."""
    out, piece, finish = _gather_buffers(x, tp, seq_len)
    return Pending(dist.all_gather_single(out, piece, group=tp.group, async_op=True), finish, piece)


def _scatter_buffers(x: torch.Tensor, tp: TPContext):
    """(input buffer of equal pieces, output buffer, what turns the filled output into this rank's
    [b, s_i, ...] slice) of the sequence reduce-scatter of `x` ([b, S, ...] partial sums)."""
    n, seq_len = tp.size, x.shape[1]
    m = max(seq_lengths(n, seq_len))
    if seq_len == n * m:  # the degree divides the sequence: the pieces are the sequence in order
        buf = x.transpose(0, 1).contiguous()
    else:
        buf = x.new_zeros((n * m, x.shape[0], *x.shape[2:]))
        for i in range(n):
            lo, hi = unit_interval(i, n, seq_len)
            buf[i * m : i * m + hi - lo] = x[:, lo:hi].transpose(0, 1)
    out = x.new_empty((m, x.shape[0], *x.shape[2:]))
    lo, hi = unit_interval(tp.rank, n, seq_len)
    return buf, out, lambda: out[: hi - lo].transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[b, S, ...] partial sums -> this rank's [b, s_i, ...] slice of their sum over the group."""
    buf, out, finish = _scatter_buffers(x, tp)
    dist.reduce_scatter_single(out, buf, group=tp.group)
    return finish()


def start_reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> Pending:
    """`_reduce_scatter_seq` launched without waiting for it (`Pending.wait()` gives the result)."""
    buf, out, finish = _scatter_buffers(x, tp)
    return Pending(dist.reduce_scatter_single(out, buf, group=tp.group, async_op=True), finish, buf)


def start_all_reduce(x: torch.Tensor, tp: TPContext) -> Pending:
    """In-place sum of `x` over the TP group launched without waiting for it (`Pending.wait()`: `x`)."""
    x = x.contiguous()
    return Pending(dist.all_reduce(x, group=tp.group, async_op=True), lambda: x)


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, seq_len):  # type: ignore[override]
        ctx.tp = tp
        return _all_gather_seq(x, tp, seq_len)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter_seq(grad, ctx.tp), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):  # type: ignore[override]
        ctx.tp, ctx.seq_len = tp, x.shape[1]
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather_seq(grad, ctx.tp, ctx.seq_len), None


class _Resplit(torch.autograd.Function):
    """A replicated activation moved from one sequence split to another (a change of degree).

    Every holder of a slice holds its true value (forward) and its true gradient (backward), so the
    forward gathers the whole sequence in the source group and keeps the destination slice, and the
    backward gathers the gradient in the destination group and keeps the source slice; each copy of a
    layer replicated inside the replica receives the whole gradient, as without SP."""

    @staticmethod
    def forward(ctx, x, src, dst, seq_len):  # type: ignore[override]
        ctx.src, ctx.dst, ctx.seq_len = src, dst, seq_len
        return _move(x, src, dst, seq_len)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _move(grad.contiguous(), ctx.dst, ctx.src, ctx.seq_len), None, None, None


def _move(x: torch.Tensor, src: TPContext, dst: TPContext, seq_len: int) -> torch.Tensor:
    full = _all_gather_seq(x, src, seq_len) if seq_split(src) > 1 else x
    lo, hi = seq_interval(dst, seq_len)
    return full[:, lo:hi].contiguous()


def gather_from_sequence_region(x: torch.Tensor, tp: TPContext, seq_len: int) -> torch.Tensor:
    """Column-parallel input under SP: this rank's slice -> the whole sequence (backward: reduce-scatter)."""
    return _GatherFromSequence.apply(x, tp, seq_len) if seq_split(tp) > 1 else x


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Row-parallel output under SP: partial sums -> this rank's slice of the sum (backward: all-gather)."""
    return _ReduceScatterToSequence.apply(x, tp) if seq_split(tp) > 1 else x


def enter_tp_region(x: torch.Tensor, tp: TPContext, seq_len: int) -> torch.Tensor:
    """Input of column-parallel layers: all-gather of the `seq_len`-token sequence's slices under SP, else
    identity forward with the gradient all-reduced."""
    if seq_split(tp) > 1:
        return gather_from_sequence_region(x, tp, seq_len)
    return copy_to_tp(x, tp)


def exit_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Output of row-parallel layers: reduce-scatter to the sequence slices under SP, else all-reduce."""
    if seq_split(tp) > 1:
        return reduce_scatter_to_sequence_region(x, tp)
    return reduce_from_tp(x, tp)


def resplit_sequence(x: torch.Tensor, src: TPContext, dst: TPContext, seq_len: int) -> torch.Tensor:
    """Move a replicated activation from `src`'s sequence split to `dst`'s (identity when they agree)."""
    if seq_split(src) == seq_split(dst):
        return x
    return _Resplit.apply(x, src, dst, seq_len)


def replicated_grad_sum(param: torch.Tensor, tp: TPContext,
                        reducer: ReplicatedGradReducer | None = None) -> torch.Tensor:
    """A replicated parameter used on a sequence slice: its gradient is summed over the TP group (each
    rank saw only its tokens), so every holder ends with the whole-sequence gradient, as without SP.
    With a `reducer` (the model's) the sums of all such parameters travel in one all-reduce per group at
    the end of the backward pass; without one, one all-reduce per parameter inside the backward."""
    if seq_split(tp) <= 1:
        return param
    if reducer is not None:
        return _DeferredGradSum.apply(param, tp, reducer)
    return copy_to_tp(param, tp)


class ReplicatedGradReducer:
    """Sums the gradients of a model's replicated parameters over their TP groups, once per backward.

    Under SP every norm weight and bias, row-parallel bias and position embedding needs its gradient
    summed over the TP group; one all-reduce each costs a collective per parameter per micro-batch (27
    of a 4-layer GPT's 45 per micro-batch).  Their gradients are instead collected during the backward and
    reduced when the autograd engine finishes the pass (`queue_callback`): one flat all-reduce per TP
    group, then accumulated into `.grad` (and the parameters' post-accumulate-grad hooks run, as autograd
    would have run them; a hook skips the call autograd makes before, see `ntp_grad_deferred`), so after
    the backward every gradient is what the per-parameter path gives.

    The sums are taken in at least float32 (a bf16 model's too: it is a gradient reduction, not an
    activation).  The order is the same on every rank: groups by their first parameter name, parameters
    by name (`names`: parameter -> name, from the model that owns the reducer)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._names = {id(p): n for n, p in named_params}
        # group -> (context, parameter id -> (name, parameter, gradient summed over its uses))
        self._pending: dict[int, tuple[TPContext, dict[int, tuple[str, torch.Tensor, torch.Tensor]]]] = {}
        self._task: int | None = None  # the autograd graph task whose gradients are pending

    def add(self, param: torch.Tensor, tp: TPContext, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first of this pass (a pass that raised left its entries: dropped)
            self._task, self._pending = task, {}
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        entries = self._pending.setdefault(id(tp.group), (tp, {}))[1]
        if id(param) in entries:  # a parameter used more than once in the pass (`ntp.tp_chunks`)
            name, _, earlier = entries[id(param)]
            entries[id(param)] = (name, param, earlier + grad)
        else:
            entries[id(param)] = (self._names.get(id(param), ""), param, grad)

    @torch.no_grad()
    def flush(self) -> None:
        pending, self._pending, self._task = self._pending, {}, None
        groups = sorted(((tp, sorted(by_id.values(), key=lambda e: e[0])) for tp, by_id in pending.values()),
                        key=lambda te: te[1][0][0])
        for tp, entries in groups:
            dtype = torch.float32  # summed in at least float32, as the DP sync sums float32 gradients
            for _, _, g in entries:
                dtype = torch.promote_types(dtype, g.dtype)
            flat = torch.cat([g.reshape(-1).to(dtype) for _, _, g in entries])
            dist.all_reduce(flat, group=tp.group)
            offset = 0
            for _, param, g in entries:
                n = g.numel()
                summed = flat[offset : offset + n].view(g.shape).to(param.dtype)
                offset += n
                if param.grad is None:
                    param.grad = summed.clone()
                else:
                    param.grad += summed
                param.ntp_grad_deferred = False
                for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                    hook(param)


class _DeferredGradSum(torch.autograd.Function):
    """Identity forward; the backward hands the parameter's gradient to the reducer (no autograd
    accumulation: the reducer accumulates the TP-summed gradient at the end of the pass)."""

    @staticmethod
    def forward(ctx, param, tp, reducer):  # type: ignore[override]
        ctx.param, ctx.tp, ctx.reducer = param, tp, reducer
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # Autograd still runs the parameter's post-accumulate-grad hooks (with nothing accumulated):
        # the flag tells them the gradient arrives later, when the reducer runs them again.
        ctx.param.ntp_grad_deferred = True
        ctx.reducer.add(ctx.param, ctx.tp, grad.contiguous())
        return None, None, None


class SequenceParallelPlan:
    """A TP plan (`context(slot) -> TPContext`) whose sharded contexts split the sequence; SP holds no
    state, so wrapping the plan of any layout (after a reshard too) is all it takes."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def context(self, slot: int) -> TPContext:
        ctx = self.plan.context(slot)
        return dataclasses.replace(ctx, sequence_parallel=True) if ctx.sharded else ctx


class _GatherProject(torch.autograd.Function):
    """All-gather of the sequence slices followed by several column-parallel projections of the gathered
    input, keeping only the slice for the backward (which gathers it again, once for all projections):
    the gathered input is the size of the whole sequence, so saving it would undo SP's memory saving."""

    @staticmethod
    def forward(ctx, x, tp, seq_len, *weights_and_biases):  # type: ignore[override]
        # `x` arrives in the compute dtype (cast at the region boundary): the GEMMs run in it, with the
        # weights cast as autocast would, so the backward needs no autocast around it.
        full = _all_gather_seq(x, tp, seq_len)
        pairs = list(zip(weights_and_biases[::2], weights_and_biases[1::2], strict=True))
        ctx.tp, ctx.seq_len, ctx.has_bias = tp, seq_len, [b is not None for _, b in pairs]
        ctx.save_for_backward(x, *(w for w, _ in pairs))
        dt = x.dtype
        return tuple(torch.nn.functional.linear(full, w.to(dt), None if b is None else b.to(dt))
                     for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.tp, ctx.seq_len).flatten(0, -2)
        grad_full = None
        out: list[torch.Tensor | None] = []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias, strict=True):
            g2 = g.flatten(0, -2).to(x.dtype)
            part = g2 @ w.to(x.dtype)
            grad_full = part if grad_full is None else grad_full + part
            out += [g2.t() @ full, g2.sum(0) if has_bias else None]
        grad_x = _reduce_scatter_seq(grad_full.view(*grads[0].shape[:-1], -1), ctx.tp)
        return (grad_x, None, None, *out)


class _OverlappedProject(torch.autograd.Function):
    """Column-parallel projections of one input with their region entry in one function, so that the
    backward overlaps the input gradient's collective with the weight gradients (Megatron's asynchronous
    input-gradient all-reduce; `ntp.tp_overlap`).

    Forward: as `_FusedProject` (`fused`: one GEMM over the stacked local rows, the caller splits the
    output) or one GEMM per layer (one output each), after the SP all-gather when `gather`.  Backward:
    the input's gradient first (under SP the input's all-gather, needed by the weight gradients, is
    launched before it and runs beside it), then its all-reduce (without SP) or reduce-scatter (SP) is
    launched without waiting, the weight and bias gradients are computed while it runs, and the function
    waits for it before returning.  The same operations as the serial path in another order, so the same
    values bit for bit (unfused without SP the per-layer input gradients are summed here in the order
    autograd sums them on the serial path).  The GEMMs run in the input's dtype (the compute dtype: cast at
    the region boundary), the weights cast as autocast would, so the backward is the same inside autocast
    or not.  On CUDA `wait()` makes the current stream wait for the communication stream (not run on a
    GPU yet)."""

    @staticmethod
    def forward(ctx, x, tp, seq_len, gather, fused, num_weights, *weights_and_biases):  # type: ignore[override]
        weights, biases = weights_and_biases[:num_weights], weights_and_biases[num_weights:]
        full = _all_gather_seq(x, tp, seq_len) if gather else x
        ctx.tp, ctx.seq_len, ctx.gather, ctx.fused = tp, seq_len, gather, fused
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        dt = x.dtype
        if fused:  # `fused`: the layers' `StackedRows`
            bias = _cat_rows(biases, dt) if ctx.has_bias[0] else None
            return torch.nn.functional.linear(full, fused.get(weights, dt), bias)
        return tuple(torch.nn.functional.linear(full, w.to(dt), None if b is None else b.to(dt))
                     for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        tp, dt = ctx.tp, x.dtype
        gathering = start_all_gather_seq(x, tp, ctx.seq_len) if ctx.gather else None
        g2 = [g.flatten(0, -2).to(dt) for g in grads]
        if ctx.fused:
            grad_in = g2[0] @ ctx.fused.get(weights, dt)
        else:
            # Summed in the serial path's order: under SP `_GatherProject`'s (the layers in order), else
            # autograd's, which adds the projections' input gradients as they arrive (the last layer's
            # first here): the same values bit for bit (tests/parallel/test_tp_overlap.py).
            pairs = list(zip(g2, weights, strict=True))
            grad_in = None
            for g, w in pairs if ctx.gather else pairs[::-1]:
                part = g @ w.to(dt)
                grad_in = part if grad_in is None else grad_in + part
        grad_in = grad_in.view(*grads[0].shape[:-1], -1)
        full = (gathering.wait() if gathering is not None else x).flatten(0, -2)
        reducing = start_reduce_scatter_seq(grad_in, tp) if ctx.gather else start_all_reduce(grad_in, tp)
        # While the input gradient's collective runs: the weight and bias gradients.
        if ctx.fused:
            rows = [w.shape[0] for w in weights]
            grad_w = list((g2[0].t() @ full).split(rows))
            grad_b = list(g2[0].sum(0).split(rows)) if ctx.has_bias[0] else [None] * len(weights)
        else:
            grad_w = [g.t() @ full for g in g2]
            grad_b = [g.sum(0) if has else None for g, has in zip(g2, ctx.has_bias, strict=True)]
        grad_x = reducing.wait()
        return (grad_x, None, None, None, None, None, *grad_w, *grad_b)


def overlapped(layers: Sequence[torch.nn.Module], tp: TPContext) -> bool:
    """Whether `layers`' region entry and projections run as `_OverlappedProject`: the layers were set
    to (`ntp_nemo.parallel.layers.set_tp_overlap`), the group is sharded, and none is quantised (a
    modelopt quantiser wraps the layer's own forward, which the function would bypass)."""
    return tp.sharded and all(getattr(layer, "tp_overlap", False) and not hasattr(layer, "weight_quantizer")
                              for layer in layers)


def fusable(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether `layers` can run as one GEMM over their concatenated weights: more than one, all with a
    bias or none with one, and none quantised (a modelopt quantiser wraps the layer's own forward, which
    the fused GEMM would bypass)."""
    if len(layers) < 2 or any(hasattr(layer, "weight_quantizer") for layer in layers):
        return False
    return len({getattr(layer, "bias", None) is not None for layer in layers}) == 1


def _cat_rows(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`tensors` stacked along dim 0 in `dtype`: each cast as it is copied in (one pass, no cast copy)."""
    out = tensors[0].new_empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=dtype)
    row = 0
    for t in tensors:
        out[row : row + t.shape[0]].copy_(t)
        row += t.shape[0]
    return out


class StackedRows:
    """The stacked local weights of a fused projection in the compute dtype, made once per optimizer step:
    every micro-batch's forward and backward between two updates reads the same copy (the weights'
    version counters and storages key it: an optimizer step, a checkpoint load or a reshard writes them in
    place and bumps their versions).  Held by the first layer of the group (`stacked_rows`); `made`
    counts the copies."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None
        self.made = 0

    def get(self, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled block: Inductor fuses the copy into its graph
            return _cat_rows(weights, dtype)
        key = (dtype, tuple((w.data_ptr(), w._version, w.shape) for w in weights))
        if key != self.key or self.value is None:
            self.value, self.key = None, None  # the old copy goes before the new one is made
            self.value, self.key = _cat_rows(weights, dtype), key
            self.made += 1
        return self.value


def stacked_rows(layers: Sequence[torch.nn.Module]) -> StackedRows:
    """The `StackedRows` of a fused group of layers, kept on its first layer."""
    first = layers[0]
    stack = first.__dict__.get("_ntp_stacked_rows")
    if stack is None:
        stack = first.__dict__["_ntp_stacked_rows"] = StackedRows()
    return stack


class _FusedProject(torch.autograd.Function):
    """Several column-parallel projections of one input as one GEMM over their local weights stacked
    along the output rows (q/k/v: `[q_local; k_local; v_local]`), optionally after the SP all-gather.

    The parameters are the inputs (each keeps its own name, shape and gradient), and only they and the
    input are saved for the backward: the stacked weight in the compute dtype is made once per optimizer
    step (`StackedRows`) and read by every micro-batch's forward and backward, not kept per micro-batch
    in flight.  The GEMMs run
    in the input's dtype (the compute dtype: cast at the region boundary), the weights cast as autocast
    would, so the backward needs no autocast around it.  Backward: one GEMM for the input's gradient and
    one for the stacked weights' (split back into each parameter's rows), instead of one each per layer.
    Under SP (`gather`) the input is this rank's sequence slice: gathered forward and again backward,
    the input gradient reduce-scattered; without it the caller's `copy_to_tp` all-reduces it."""

    @staticmethod
    def forward(ctx, x, tp, seq_len, gather, stack, num_weights, *weights_and_biases):  # type: ignore[override]
        weights, biases = weights_and_biases[:num_weights], weights_and_biases[num_weights:]
        full = _all_gather_seq(x, tp, seq_len) if gather else x
        ctx.tp, ctx.seq_len, ctx.gather, ctx.has_bias = tp, seq_len, gather, bool(biases)
        ctx.stack = stack
        ctx.save_for_backward(x, *weights)
        dt = x.dtype
        bias = _cat_rows(biases, dt) if biases else None
        return torch.nn.functional.linear(full, stack.get(weights, dt), bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.tp, ctx.seq_len) if ctx.gather else x
        full = full.flatten(0, -2)
        g2 = grad.flatten(0, -2).to(x.dtype)
        grad_full = (g2 @ ctx.stack.get(weights, x.dtype)).view(*grad.shape[:-1], -1)
        rows = [w.shape[0] for w in weights]
        grad_w = list((g2.t() @ full).split(rows))
        grad_b = list(g2.sum(0).split(rows)) if ctx.has_bias else []
        grad_x = _reduce_scatter_seq(grad_full, ctx.tp) if ctx.gather else grad_full
        return (grad_x, None, None, None, None, None, *grad_w, *grad_b)


def gather_and_project(x: torch.Tensor, tp: TPContext, seq_len: int,
                       layers: Sequence[torch.nn.Module], *, fuse: bool = True) -> list[torch.Tensor]:
    """Column-parallel projections (`layers`: modules with a `weight`, an optional `bias`, and no region
    entry of their own) of one input entering the TP region.  Under SP: one all-gather forward, one
    all-gather and one reduce-scatter backward, only the slice saved; without SP the usual region entry
    (the gradient all-reduced once for all of them).

    With `fuse` (and `fusable(layers)`: q/k/v, gate/up) the projections are one GEMM over the layers'
    local weights concatenated along the output rows, and its output is split back into one view per
    layer: one GEMM forward and one per gradient backward instead of one per layer, the same values.
    The parameters stay the layers' own (checkpoints, Hugging Face names, initial draws and the gradient
    sync see the same tensors); `_FusedProject` stacks their local rows for each GEMM.

    With `ntp.tp_overlap` (`overlapped(layers, tp)`) the entry and the projections are one
    `_OverlappedProject`: the same values, the input gradient's collective overlapped with the weight
    gradients in the backward."""
    x = to_compute_dtype(x)  # what crosses the wire (forward and backward) is in the compute dtype
    if overlapped(layers, tp):  # the input gradient's collective overlapped with the weight gradients
        fused = fuse and fusable(layers)
        weights = [layer.weight for layer in layers]
        biases = [getattr(layer, "bias", None) for layer in layers]
        gather = seq_split(tp) > 1
        stack = stacked_rows(layers) if fused else False
        y = _OverlappedProject.apply(x, tp, seq_len, gather, stack, len(weights), *weights, *biases)
        return list(y.split([w.shape[0] for w in weights], dim=-1)) if fused else list(y)
    if fuse and fusable(layers):
        gather = seq_split(tp) > 1
        weights = [layer.weight for layer in layers]
        biases = [layer.bias for layer in layers] if getattr(layers[0], "bias", None) is not None else []
        y = _FusedProject.apply(x if gather else copy_to_tp(x, tp), tp, seq_len, gather, stacked_rows(layers),
                                len(weights),
                                *weights, *biases)
        return list(y.split([w.shape[0] for w in weights], dim=-1))
    if seq_split(tp) > 1:
        args = [t for layer in layers for t in (layer.weight, getattr(layer, "bias", None))]
        return list(_GatherProject.apply(x, tp, seq_len, *args))
    x = copy_to_tp(x, tp)
    return [layer(x) for layer in layers]
