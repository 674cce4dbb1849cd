"""Sharding-independent fingerprints of the parameters, compared across data-parallel replicas.

Replicas hold the same logical parameters whatever their TP degrees, so their values must agree bit for
bit; a flipped bit in one replica's weights (silent data corruption) breaks that and nothing else
notices.  Each element contributes `h(global index, value bits)`, a 31-bit hash, and a fingerprint is
the integer sum of those contributions over a set of elements: order independent and exact (a sum of
at most 2**32 such values cannot overflow an int64), so it does not depend on how the elements are
split between ranks.

For every parameter the plan takes the common refinement of all ranks' unit intervals (the same
fragments as the DP gradient sync, `grad_sync.build_sync_plans`): every fragment is held by at least
one rank of every replica, so its fingerprint is directly comparable between any two holders.  A
replica's fingerprint is the sum of its fragments (one holder each: the sum over the TP group without
double-counting copies); a mismatch names the replica that disagrees with the majority, and the
fragments name the rank and the parameter.

A check costs one pass over the rank's parameters (a few integer ops per element, on the device, in
chunks of `chunk_elems` elements) and one all-gather of one int64 per fragment.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.topology.shard import ShardSpec

_K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio multiplier (signed int64)
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 finaliser constants
_K3 = 0x94D049BB133111EB - (1 << 64)
_MASK31 = (1 << 31) - 1
CHUNK_ELEMS = 1 << 20


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def value_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor as non-negative int64 (64-bit types: the signed word)."""
    size = t.element_size()
    if size == 8:
        return t.view(torch.int64)
    view = {4: torch.int32, 2: torch.int16, 1: torch.int8}[size]
    return t.view(view).to(torch.int64) & ((1 << (8 * size)) - 1)


def element_hashes(values: torch.Tensor, global_index: torch.Tensor) -> torch.Tensor:
    """31-bit hash of each (global index, value bits) pair, int64 (the int64 products wrap)."""
    x = global_index * _K1 + value_bits(values)
    x = (x ^ _lsr(x, 30)) * _K2
    x = (x ^ _lsr(x, 27)) * _K3
    x = x ^ _lsr(x, 31)
    return x & _MASK31


def _global_index(spec: ShardSpec, local_shape: Sequence[int], row0: int, device: torch.device
                  ) -> torch.Tensor:
    """Flat global index of every element of rows `row0 ...` (dim 0) of the local shard of `spec`."""
    gshape = spec.global_shape or (1,)
    strides = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * gshape[d + 1]
    offsets = spec.offsets or (0,)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d, n in enumerate(local_shape):
        start = offsets[d] + (row0 if d == 0 else 0)
        ar = (torch.arange(n, dtype=torch.int64, device=device) + start) * strides[d]
        idx = idx + ar.view([n if e == d else 1 for e in range(len(local_shape))])
    return idx


@dataclass(frozen=True)
class Fragment:
    """Units `[lo, hi)` of parameter `name` (a piece of the common refinement of every rank's interval).

    A parameter some rank holds as a block (`ntp.pattern=block`: a 2D `ShardSpec`) is refined on every
    split dim instead: `box` holds the piece's element interval `(dim, start, stop)` of each such dim,
    and `lo, hi` are its elements along the first of them."""

    name: str
    lo: int
    hi: int
    box: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class FingerprintPlan:
    """Every rank's fragments (index = global rank) and the replica of every rank."""

    fragments: tuple[tuple[Fragment, ...], ...]
    replica_of: tuple[int, ...]

    @property
    def width(self) -> int:
        return max((len(f) for f in self.fragments), default=0)


def descriptors(model: nn.Module) -> dict[str, tuple]:
    """(global shape, dim, unit size, lo, hi) of every parameter this rank holds; a block-sharded one's
    adds its second split, (dim2, unit size, lo2, hi2)."""
    out = {}
    for name, p in model.named_parameters():
        s = getattr(p, "ntp_spec", None) or ShardSpec.full(p.shape)
        out[name] = (tuple(s.global_shape), s.dim, s.unit_size, s.lo, s.hi)
        if s.is_block:
            out[name] += ((s.dim2, s.unit_size2, s.lo2, s.hi2),)
    return out


def _box(d: tuple) -> dict[int, tuple[int, int]]:
    """The element interval a descriptor holds along each of its split dims."""
    box = {d[1]: (d[3] * d[2], d[4] * d[2])}
    if len(d) > 5:
        dim2, unit2, lo2, hi2 = d[5]
        box[dim2] = (lo2 * unit2, hi2 * unit2)
    return box


def _box_pieces(name: str, entries: list[tuple[int, tuple]], per_rank: list[list[Fragment]]) -> None:
    """The common refinement of the holders' boxes (some block-sharded) on every split dim: each piece
    goes to every rank whose box holds all of it."""
    shape = entries[0][1][0]
    boxes = [(r, _box(d)) for r, d in entries]
    dims = sorted({dim for _, b in boxes for dim in b})

    def span(b: dict[int, tuple[int, int]], dim: int) -> tuple[int, int]:
        return b.get(dim, (0, shape[dim]))

    pieces: list[tuple[tuple[int, int, int], ...]] = [()]
    for dim in dims:
        bounds = sorted({x for _, b in boxes for x in span(b, dim)})
        pieces = [(*p, (dim, a, b)) for p in pieces for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
    for piece in pieces:
        for r, b in boxes:
            if all(span(b, dim)[0] <= a and stop <= span(b, dim)[1] for dim, a, stop in piece):
                per_rank[r].append(Fragment(name, piece[0][1], piece[0][2], piece))


def build_plan(all_descriptors: Sequence[dict[str, tuple]], replica_of: Sequence[int]) -> FingerprintPlan:
    """Pure function of every rank's `descriptors` (index = global rank) and their replicas."""
    holders: dict[str, list[tuple[int, tuple]]] = {}
    for r, desc in enumerate(all_descriptors):
        for name, d in desc.items():
            holders.setdefault(name, []).append((r, d))
    per_rank: list[list[Fragment]] = [[] for _ in all_descriptors]
    for name in sorted(holders):
        entries = holders[name]
        if len({d[0] for _, d in entries}) != 1:
            raise RuntimeError(f"parameter {name} has different global shapes across ranks")
        # blocks, or splits in other units (a grid's norm split along its columns, another replica's whole)
        if any(len(d) > 5 for _, d in entries) or len({(d[1], d[2]) for _, d in entries}) > 1:
            _box_pieces(name, entries, per_rank)
            continue
        bounds = sorted({d[3] for _, d in entries} | {d[4] for _, d in entries})
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            for r, d in entries:
                if d[3] <= a and b <= d[4]:
                    per_rank[r].append(Fragment(name, a, b))
    return FingerprintPlan(tuple(tuple(f) for f in per_rank), tuple(int(x) for x in replica_of))


def local_fingerprints(model: nn.Module, fragments: Sequence[Fragment], chunk_elems: int = CHUNK_ELEMS
                       ) -> torch.Tensor:
    """int64 [len(fragments)]: the fingerprint of each of this rank's fragments, on the parameters' device."""
    params = dict(model.named_parameters())
    by_name: dict[str, list[int]] = {}
    for i, f in enumerate(fragments):
        by_name.setdefault(f.name, []).append(i)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    out = torch.zeros(len(fragments), dtype=torch.int64, device=device)
    with torch.no_grad():
        for name, idxs in by_name.items():
            p = params[name]
            spec = getattr(p, "ntp_spec", None) or ShardSpec.full(p.shape)
            data = p.detach().reshape(spec.local_shape or (1,))
            rows = data.shape[0]
            row_elems = max(1, data.numel() // max(rows, 1))
            step = max(1, chunk_elems // row_elems)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                index = _global_index(spec, (r1 - r0, *data.shape[1:]), r0, data.device)
                h = element_hashes(data[r0:r1], index)
                for i in idxs:
                    part = h
                    for dim, (start, stop) in _local_ranges(spec, fragments[i]).items():
                        if dim == 0:  # the chunk's rows of it
                            start, stop = max(start, r0) - r0, min(stop, r1) - r0
                            if start >= stop:
                                break
                        part = part.narrow(dim, start, stop - start)
                    else:
                        out[i] += part.sum()
    return out


def _local_ranges(spec: ShardSpec, f: Fragment) -> dict[int, tuple[int, int]]:
    """The local element interval of fragment `f` along each dim it bounds, in this rank's shard."""
    if f.box:
        offsets = spec.offsets
        return {dim: (a - offsets[dim], b - offsets[dim]) for dim, a, b in f.box}
    return {spec.dim: ((f.lo - spec.lo) * spec.unit_size, (f.hi - spec.lo) * spec.unit_size)}


@dataclass(frozen=True)
class Mismatch:
    """Where the replicas disagree: the replica against the majority, its rank and parameter."""

    replica: int
    rank: int
    parameter: str
    units: tuple[int, int]  # [lo, hi) of the parameter's split dim (a block's: elements of its first)
    replicas_agreeing: int  # size of the largest group of replicas agreeing on the fragment
    replicas: int
    majority: bool = True  # False: no strict majority (e.g. two replicas), `replica` is one side of it

    def describe(self) -> str:
        where = f"rank {self.rank}, parameter {self.parameter} units [{self.units[0]}, {self.units[1]})"
        if not self.majority:
            return (f"replicas disagree with no majority among {self.replicas} (replica {self.replica}, "
                    f"{where})")
        return (f"replica {self.replica} disagrees with {self.replicas_agreeing} of {self.replicas} "
                f"replicas: {where}")


def replica_fingerprints(plan: FingerprintPlan, gathered: Sequence[Sequence[int]]) -> dict[int, int]:
    """Fingerprint of each replica's full parameters: the sum of its fragments, one holder each."""
    seen: set[tuple[int, Fragment]] = set()
    out: dict[int, int] = {}
    for rank, frags in enumerate(plan.fragments):
        rep = plan.replica_of[rank]
        out.setdefault(rep, 0)
        for f, v in zip(frags, gathered[rank], strict=False):
            if (rep, f) not in seen:
                seen.add((rep, f))
                out[rep] += int(v)
    return out


def compare(plan: FingerprintPlan, gathered: Sequence[Sequence[int]]) -> list[Mismatch]:
    """Every (replica, rank, parameter) whose fragment disagrees with the value most holders report;
    empty when every replica agrees.  `gathered[rank]`: that rank's `local_fingerprints` values."""
    replicas = len(set(plan.replica_of))
    values: dict[Fragment, list[tuple[int, int]]] = {}
    for rank, frags in enumerate(plan.fragments):
        for f, v in zip(frags, gathered[rank], strict=False):
            values.setdefault(f, []).append((rank, int(v)))
    out: list[Mismatch] = []
    named: set[tuple[int, str]] = set()
    for f, held in values.items():
        if len({v for _, v in held}) == 1:
            continue
        # One vote per replica (its first holder's value); the value of strictly most replicas is right.
        votes: dict[int, int] = {}
        for rank, v in held:
            votes.setdefault(plan.replica_of[rank], v)
        ranked = Counter(votes.values()).most_common()
        majority = len(ranked) == 1 or ranked[0][1] > ranked[1][1]
        good = ranked[0][0]
        for rank, v in held:
            if majority and v == good or (rank, f.name) in named:
                continue
            named.add((rank, f.name))
            out.append(Mismatch(plan.replica_of[rank], rank, f.name, (f.lo, f.hi), ranked[0][1], replicas,
                                majority))
    return sorted(out, key=lambda m: (m.replica, m.rank, m.parameter))


def gather_fingerprints(local: torch.Tensor, plan: FingerprintPlan, group=None) -> list[list[int]]:
    """All-gather every rank's fragment fingerprints (one padded int64 tensor per rank) and read them once."""
    width = plan.width
    padded = torch.zeros(width, dtype=torch.int64, device=local.device)
    padded[: local.numel()] = local
    world = len(plan.fragments)
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    rows = torch.stack(bufs).cpu().tolist()  # the check's one host read
    return [row[: len(plan.fragments[r])] for r, row in enumerate(rows)]


def gather_plan(model: nn.Module, replica: int, group=None) -> FingerprintPlan:
    """Every rank's descriptors and replica (one all_gather_object), then `build_plan`."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, (descriptors(model), int(replica)), group=group)
    return build_plan([g[0] for g in got], [g[1] for g in got])


__all__ = ["FingerprintPlan", "Fragment", "Mismatch", "build_plan", "compare", "descriptors",
           "element_hashes", "gather_fingerprints", "gather_plan", "local_fingerprints",
           "replica_fingerprints"]
