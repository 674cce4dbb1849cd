"""Data-parallel gradient sync across replicas of unequal TP (the fragment holder-set all-reduce).

For every parameter take the common refinement of all ranks' unit intervals.  Each fragment is
held by some set of ranks (one per replica for a sharded layer, several where a layer is
replicated inside a replica or a KV head is shared).  Fragments with the same holder set are
packed into flat buffers (bucketed) and all-reduced in that holder set's process group.  A
rank contributes its gradient weighted by `1 / copies` (identical copies inside its replica
count once), so the sum is exactly the gradient of the whole global batch.  With equal
replicas this is standard DP: one group per TP slot holding that slot's shard.

The plan is built once from the ranks' ShardSpecs (exchanged with one `all_gather_object`),
so any two layouts are handled by the same code: healthy TP T with reduced TP R needs at most
T+R-1 holder sets per sharded parameter, and no gradient moves inside a replica.

Each bucket has a persistent flat buffer, and a parameter that is one whole fragment (every parameter
when the replicas are equal) has its `.grad` as a view into it, as torch DDP's `gradient_as_bucket_view`
and Megatron's grad buffers do: the backward accumulates straight into the buffer and the all-reduce
runs in place, with no per-step flatten and unflatten copies.  Fragments that are part of a parameter
(replicas of unequal TP) are copied in and out of their bucket's buffer as before.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.parallel.comm import all_reduce_on, check_device


@dataclass(frozen=True)
class Fragment:
    name: str
    dim: int
    start: int  # local element offset along dim
    length: int
    weight: float  # 1 / copies of the holder's replica
    norm_weight: float  # 1 / number of holders (each logical element counted once in the norm)
    dim2: int = -1  # a box of a block-sharded weight: its second dim's local offset and length (-1: none)
    start2: int = 0
    length2: int = 0


@dataclass
class SyncPlan:
    """This rank's fragments grouped by holder set, and every holder set of the world."""

    rank: int
    by_holders: dict[tuple[int, ...], list[Fragment]] = field(default_factory=dict)
    local_only: list[Fragment] = field(default_factory=list)
    all_holder_sets: list[tuple[int, ...]] = field(default_factory=list)

    def fragments(self) -> list[Fragment]:
        return [f for fs in self.by_holders.values() for f in fs] + self.local_only


def param_descriptors(model: nn.Module) -> dict[str, tuple]:
    """(global shape, dim, unit size, lo, hi, copies) of every parameter this rank holds; a block-sharded
    weight's adds its second split, (dim2, unit size, lo2, hi2)."""
    out = {}
    for name, p in model.named_parameters():
        s = p.ntp_spec
        out[name] = (s.global_shape, s.dim, s.unit_size, s.lo, s.hi, p.ntp_copies)
        if s.is_block:
            out[name] += ((s.dim2, s.unit_size2, s.lo2, s.hi2),)
    return out


def _box(d: tuple) -> dict[int, tuple[int, int]]:
    """The element intervals a descriptor holds, per split dim."""
    box = {d[1]: (d[3] * d[2], d[4] * d[2])}
    if len(d) > 6:
        dim2, unit2, lo2, hi2 = d[6]
        box[dim2] = (lo2 * unit2, hi2 * unit2)
    return box


def _box_fragments(entries: list[tuple[int, tuple]]) -> list[tuple[dict[int, tuple[int, int]], list]]:
    """The common refinement of the holders' boxes of one parameter (some block-sharded): each piece's
    box (element intervals per split dim) and the entries holding all of it, in ascending order."""
    shape = entries[0][1][0]
    boxes = [(r, d, _box(d)) for r, d in entries]
    dims = sorted({dim for _, _, b in boxes for dim in b})

    def span(b: dict, dim: int) -> tuple[int, int]:
        return b.get(dim, (0, shape[dim] if shape else 1))

    cuts = [sorted({x for _, _, b in boxes for x in span(b, dim)}) for dim in dims]
    pieces: list[dict[int, tuple[int, int]]] = [{}]
    for dim, bounds in zip(dims, cuts, strict=True):
        pieces = [{**p, dim: ab} for p in pieces for ab in zip(bounds[:-1], bounds[1:], strict=False)]
    out = []
    for piece in pieces:
        holding = [(r, d, b) for r, d, b in boxes
                   if all(span(b, dim)[0] <= a and bb <= span(b, dim)[1] for dim, (a, bb) in piece.items())]
        if holding:
            out.append((piece, holding))
    return out


def build_sync_plan(
    rank: int, descriptors: Sequence[dict[str, tuple]], replica_of: Sequence[int] | None = None
) -> SyncPlan:
    """Pure function of every rank's descriptors (index = global rank).

    With `replica_of` (global rank -> replica), a fragment whose holders all sit in one replica and
    are identical copies of each other (a norm or a replicated layer when there is a single replica)
    already has its full gradient on every holder and is not communicated.
    """
    return build_sync_plans(descriptors, replica_of, ranks=[rank])[0]


def build_sync_plans(
    descriptors: Sequence[dict[str, tuple]],
    replica_of: Sequence[int] | None = None,
    ranks: Sequence[int] | None = None,
) -> list[SyncPlan]:
    """The plans of `ranks` (default: every rank, in rank order) in one pass over the parameters."""
    ranks = list(range(len(descriptors))) if ranks is None else list(ranks)
    plans = {r: SyncPlan(r) for r in ranks}
    holders_of: dict[str, list[tuple[int, tuple]]] = defaultdict(list)
    for r, desc in enumerate(descriptors):
        for name, d in desc.items():
            holders_of[name].append((r, d))
    sets: set[tuple[int, ...]] = set()
    for name in sorted(holders_of):
        entries = holders_of[name]
        shapes = {d[0] for _, d in entries}
        if len(shapes) != 1:
            raise RuntimeError(f"parameter {name} has different global shapes across ranks: {shapes}")
        if any(len(d) > 6 for _, d in entries) or len({d[1:3] for _, d in entries}) > 1:
            # a block-sharded weight, or one split along different dims (or units) by different patterns:
            # boxes of elements, refined on every split dim
            _plan_boxes(name, entries, plans, sets, replica_of)
            continue
        bounds = sorted({d[3] for _, d in entries} | {d[4] for _, d in entries})
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            holding = [(r, d) for r, d in entries if d[3] <= a and b <= d[4]]
            if not holding:
                continue
            holders = tuple(r for r, _ in holding)
            identical = (
                replica_of is not None
                and len({replica_of[r] for r in holders}) == 1
                and all(d[5] == len(holders) for _, d in holding)
            )
            shared = len(holders) > 1 and not identical
            if shared:
                sets.add(holders)
            for r, (_, dim, unit, lo, _, copies) in holding:
                plan = plans.get(r)
                if plan is None:
                    continue
                weight = 1.0 if identical else 1.0 / copies
                frag = Fragment(name, dim, (a - lo) * unit, (b - a) * unit, weight, 1.0 / len(holders))
                if shared:
                    plan.by_holders.setdefault(holders, []).append(frag)
                else:
                    plan.local_only.append(frag)
    ordered = sorted(sets)
    for plan in plans.values():
        plan.all_holder_sets = ordered
    return [plans[r] for r in ranks]


def _plan_boxes(name: str, entries: list[tuple[int, tuple]], plans: dict[int, SyncPlan],
                sets: set[tuple[int, ...]], replica_of: Sequence[int] | None) -> None:
    """`build_sync_plans` for one parameter some rank holds as a block: the same holder-set rule, over
    the refinement of the holders' boxes."""
    for piece, holding in _box_fragments(entries):
        holders = tuple(r for r, _, _ in holding)
        identical = (replica_of is not None and len({replica_of[r] for r in holders}) == 1
                     and all(d[5] == len(holders) for _, d, _ in holding))
        shared = len(holders) > 1 and not identical
        if shared:
            sets.add(holders)
        dims = sorted(piece)
        for r, d, b in holding:
            plan = plans.get(r)
            if plan is None:
                continue
            local = [(dim, piece[dim][0] - b.get(dim, (0, 0))[0], piece[dim][1] - piece[dim][0])
                     for dim in dims]
            second = local[1] if len(local) > 1 else (-1, 0, 0)
            frag = Fragment(name, *local[0], 1.0 if identical else 1.0 / d[5], 1.0 / len(holders), *second)
            (plan.by_holders.setdefault(holders, []) if shared else plan.local_only).append(frag)


def _view(p: torch.Tensor, f: Fragment) -> torch.Tensor:
    if p.dim() == 0:
        return p
    out = p.narrow(f.dim, f.start, f.length)
    return out.narrow(f.dim2, f.start2, f.length2) if f.dim2 >= 0 else out


def accumulator_dtype(device: torch.device) -> torch.dtype:
    """float64 for the step's scalar sums where the device has it, float32 where not (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class _SyncBucket:
    """A run of one holder set's fragments (same composition and order on every holder) and, when its
    fragments share a dtype, its persistent flat buffer with one view per fragment."""

    holders: tuple[int, ...]
    frags: list[Fragment]
    whole: list[bool]  # the fragment is its whole parameter: the parameter's `.grad` is its view
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)


def _is_whole(p: torch.Tensor, f: Fragment) -> bool:
    return p.dim() == 0 or (f.start == 0 and f.length == p.shape[f.dim]
                            and (f.dim2 < 0 or (f.start2 == 0 and f.length2 == p.shape[f.dim2])))


def weighted_norm_sq(tensors: Sequence[torch.Tensor], weights: Sequence[float], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """sum_i weights[i] * ||tensors[i]||^2, summed in `dtype`: one foreach norm per distinct weight (one
    multi-tensor kernel on CUDA) and its sum, instead of a norm, a square, a product and an add per
    tensor.  The weights stay host scalars (no host-to-device copy).

    Each norm is taken in `dtype` inside its reduction on an accelerator.  On CPU, torch's foreach norm
    with an output dtype first copies every tensor to it (1.7-3.6 ms against 0.7 ms for the default
    recipe's 3.3 M gradient values, docs/performance.md), so there each norm is taken in its
    tensor's dtype (float32 at least: pairwise sums, as `torch.nn.utils.clip_grad_norm_` takes them) and
    only the squares are summed in `dtype`."""
    by_weight: dict[float, list[torch.Tensor]] = defaultdict(list)
    for t, w in zip(tensors, weights, strict=True):
        by_weight[w].append(t)
    total = torch.zeros((), dtype=dtype, device=device)
    for w, ts in by_weight.items():
        if device.type == "cpu":
            wide, narrow = [t for t in ts if t.element_size() >= 4], [t for t in ts if t.element_size() < 4]
            norms = [n.to(dtype) for part, out in ((wide, None), (narrow, torch.float32)) if part
                     for n in torch._foreach_norm(part, 2, dtype=out)]
            total += torch.stack(norms).square().sum() * w
        else:
            total += torch.stack(torch._foreach_norm(ts, 2, dtype=dtype)).square().sum() * w
    return total


class GradientSynchronizer:
    """Runs a SyncPlan: bucketed flat all-reduces, one process group per holder set.

    Every buffer lives on `device` (the gradients' device; by default the first parameter's) and each
    collective checks it, so no CPU tensor reaches the group of a GPU (or meta) runtime.  The buckets'
    buffers are made on first use and again whenever a parameter's dtype or device changed (a precision
    plugin casts the model after it was assembled); `prepare_grads()` points the whole-fragment
    parameters' `.grad` at them before a backward.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: SyncPlan,
        group_of: Callable,
        bucket_bytes: int = 25 << 20,
        world_group=None,
        device: torch.device | None = None,
    ) -> None:
        self.params = dict(model.named_parameters())
        self.plan = plan
        self.group_of = group_of
        self.bucket_bytes = bucket_bytes
        self.world_group = world_group
        if device is None:
            first = next(iter(self.params.values()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.acc_dtype = accumulator_dtype(self.device)
        self.counter: Callable[[str, int, tuple[int, ...]], None] | None = None  # comm accounting hook
        self._buckets: list[_SyncBucket] | None = None
        self._made_for: tuple | None = None  # (dtype, device) of every parameter the buffers were made for

    def _grad(self, name: str) -> torch.Tensor:
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def buckets(self) -> list[_SyncBucket]:
        """The sync's buckets: holder sets in the plan's global order, each set's fragments in plan
        order, cut once a bucket reaches `bucket_bytes` (a pure function of the plan and the shapes, so
        every holder cuts alike); made again when a parameter's dtype or device changed."""
        made_for = tuple((p.dtype, p.device) for p in self.params.values())
        if self._buckets is not None and made_for == self._made_for:
            return self._buckets
        out: list[_SyncBucket] = []
        for holders in self.plan.all_holder_sets:
            frags = self.plan.by_holders.get(holders)
            if not frags:
                continue
            run: list[Fragment] = []
            size = 0
            for f in frags:
                p = self.params[f.name]
                run.append(f)
                size += _view(p, f).numel() * p.element_size()
                if size >= self.bucket_bytes:
                    out.append(self._make_bucket(holders, run))
                    run, size = [], 0
            if run:
                out.append(self._make_bucket(holders, run))
        self._buckets, self._made_for = out, made_for
        return out

    def _make_bucket(self, holders: tuple[int, ...], frags: list[Fragment]) -> _SyncBucket:
        params = [self.params[f.name] for f in frags]
        bucket = _SyncBucket(holders, frags, [_is_whole(p, f) for p, f in zip(params, frags, strict=True)])
        if len({p.dtype for p in params}) != 1 or any(p.device != self.device for p in params):
            return bucket  # mixed dtypes (a concatenation promotes them) or devices: packed per step
        shapes = [_view(p, f).shape for p, f in zip(params, frags, strict=True)]
        sizes = [math.prod(shape) for shape in shapes]
        bucket.buffer = torch.zeros(sum(sizes), dtype=params[0].dtype, device=self.device)
        offset = 0
        for shape, n in zip(shapes, sizes, strict=True):
            bucket.views.append(bucket.buffer[offset : offset + n].view(shape))
            offset += n
        return bucket

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Point every whole-fragment parameter's `.grad` at its view of its bucket (keeping what it
        holds), so the coming backward accumulates into the buffer; call before the first backward of a
        step (`GradientPath.begin_step`).  A `.grad` set to None or replaced since is taken back."""
        for b in self.buckets():
            for f, whole, v in zip(b.frags, b.whole, b.views, strict=False):
                if whole:
                    self._adopt(f.name, v)

    def _adopt(self, name: str, view: torch.Tensor) -> None:
        p = self.params[name]
        g = p.grad
        if g is view:
            return
        if g is None:
            view.zero_()
        else:
            view.copy_(g)
        p.grad = view

    @torch.no_grad()
    def sync(self) -> None:
        for b in self.buckets():  # global order: no cross-group deadlock
            group = self.group_of(b.holders)
            if b.buffer is None:
                self._reduce(b.frags, group, b.holders)
            else:
                self._reduce_in_place(b, group)
        for f in self.plan.local_only:
            if f.weight != 1.0:
                _view(self._grad(f.name), f).mul_(f.weight)

    def _reduce_in_place(self, b: _SyncBucket, group) -> None:
        """The bucket's buffer all-reduced where it lies: whole-fragment gradients are views of it (made
        so here if they were not), part-of-a-parameter fragments are copied in and back out."""
        for f, whole, v in zip(b.frags, b.whole, b.views, strict=True):
            if whole:
                self._adopt(f.name, v)
            else:
                v.copy_(_view(self._grad(f.name), f))
            if f.weight != 1.0:
                v.mul_(f.weight)
        if self.counter is not None:
            self.counter("dp_all_reduce", b.buffer.numel() * b.buffer.element_size(), b.holders)
        all_reduce_on(b.buffer, self.device, group, what="gradient bucket")
        for f, whole, v in zip(b.frags, b.whole, b.views, strict=True):
            if not whole:
                _view(self._grad(f.name), f).copy_(v)

    def _reduce(self, frags: list[Fragment], group, holders: tuple[int, ...]) -> None:
        views = [_view(self._grad(f.name), f) for f in frags]
        flat = torch.cat([(v * f.weight).reshape(-1) for v, f in zip(views, frags, strict=True)])
        if self.counter is not None:
            self.counter("dp_all_reduce", flat.numel() * flat.element_size(), holders)
        all_reduce_on(flat, self.device, group, what="gradient bucket")
        offset = 0
        for v in views:
            n = v.numel()
            v.copy_(flat[offset : offset + n].view(v.shape))
            offset += n

    @torch.no_grad()
    def grad_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (sum over ranks = the full norm^2),
        a 0-dim tensor on the gradients' device; non-finite when any local gradient is.  Each fragment's
        norm accumulates in `acc_dtype` inside the reduction (no float64 copy of the gradients)."""
        views, weights = [], []
        for f in self.plan.fragments():
            g = self.params[f.name].grad
            if g is not None:
                check_device(g, self.device, f"gradient of {f.name}")
                views.append(_view(g, f))
                weights.append(f.norm_weight)
        return weighted_norm_sq(views, weights, self.acc_dtype, self.device)

    @torch.no_grad()
    def clip_to_norm_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        """Scale the gradients by min(1, max_norm / (norm + 1e-6)) without a host read (`norm`: the
        reduced global norm, a tensor on the device), as `torch.nn.utils.clip_grad_norm_` does."""
        if not max_norm or max_norm <= 0:
            return
        check_device(norm, self.device, "gradient norm")
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for p in self.params.values():
            if p.grad is not None:
                by_dtype[p.grad.dtype].append(p.grad)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the norm of the logical (unsharded) gradient; returns that norm (one host read:
        the training step uses the fused `NTPRuntime.step_scalars` instead)."""
        sq = self.grad_norm_sq_local()
        if dist.is_available() and dist.is_initialized():
            all_reduce_on(sq, self.device, self.world_group, what="squared gradient norm")
        norm = sq.sqrt()
        self.clip_to_norm_(norm, max_norm)
        return float(norm)
