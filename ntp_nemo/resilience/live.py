"""Live resharding: survivors of a failure rebuild their state on the new layout from each other's memory.

Every tensor of a rank's training state (parameters, quantiser scales, per-parameter optimizer state) is
a named slice of a layout-independent logical tensor (`ntp_nemo.checkpoint.state`), so the state of the
new layout is a set of element intervals of those logical tensors, and the survivors' old slices are
another.  The reshard plan is the interval algebra of a checkpoint load with the survivors' memory in
place of the files:

- for every participant (a rank of the transfer group: every survivor, including one the new layout
  leaves idle) and every key it must hold on the new layout, the intervals it needs are split at every
  holder's boundary, and each piece takes its source by preference: the participant itself (a local
  copy), then a survivor of its own old replica, then a healthy replica (the least loaded sender first,
  so the lost rank's fragments are spread over the replicas that hold them);
- the plan is a pure function of everyone's holdings, computed identically on every participant from
  one `all_gather_object`; pieces between the same two ranks travel as one flat buffer per dtype with
  `batch_isend_irecv` over the transfer group.

Because every piece a participant already holds is copied locally, the bytes moved equal the lower
bound: the elements some participant needs and does not hold (the lost rank's fragments plus the
survivors' re-split).  A piece no survivor holds raises `NoLiveCopy` on every participant alike
(before anything is sent), which is the caller's cue to fall back to a restart from a checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.checkpoint.state import (
    NamedSlice,
    group_options,
    install_optimizer_state,
    load_targets,
    sharded_state,
)
from ntp_nemo.topology.shard import ShardSpec

LOCAL, OWN_REPLICA, OTHER_REPLICA = 0, 1, 2


class NoLiveCopy(RuntimeError):
    """Some element of the new layout's state is held by no survivor (DP=1, or every holder lost)."""


@dataclass(frozen=True)
class Holding:
    """What one participant holds (or needs) of one key: an element interval along the key's split dim."""

    spec: ShardSpec
    dtype: str  # torch dtype name, e.g. "float32"
    itemsize: int


@dataclass(frozen=True)
class Piece:
    """Elements `[start, stop)` along dim `dim` of logical tensor `key`, from participant `src` to `dst`."""

    key: str
    src: int
    dst: int
    dim: int
    start: int
    stop: int
    nbytes: int
    # A box of a tensor some participant holds as a 2D block (`ntp.pattern=block`) or split along another
    # dim: its element interval along every dim (`dim`, `start`, `stop` repeat the first).
    box: tuple[tuple[int, int], ...] | None = None


@dataclass
class ReshardPlan:
    pieces: list[Piece]
    needed_bytes: int  # lower bound: bytes some participant needs and does not hold itself

    @property
    def moved_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.src != p.dst)

    @property
    def local_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p.src == p.dst)

    def by_source_class(self, replica_of: Sequence[int]) -> dict[str, int]:
        """Bytes received from oneself, one's own old replica and another replica."""
        out = {"local": 0, "own_replica": 0, "other_replica": 0}
        for p in self.pieces:
            cls = _source_class(p.src, p.dst, replica_of)
            out[("local", "own_replica", "other_replica")[cls]] += p.nbytes
        return out


@dataclass(frozen=True)
class ReshardResult:
    moved_bytes: int  # total over all participants
    needed_bytes: int  # the minimum any plan must move
    sent_bytes: int  # by this participant
    received_bytes: int


def _source_class(src: int, dst: int, replica_of: Sequence[int]) -> int:
    if src == dst:
        return LOCAL
    return OWN_REPLICA if replica_of[src] == replica_of[dst] else OTHER_REPLICA


def _axis(spec: ShardSpec, dim: int) -> tuple[int, int]:
    """Element interval of `spec` along `dim` (a whole tensor covers every dim)."""
    if not spec.global_shape:
        return 0, 1
    if spec.is_full:
        return 0, spec.global_shape[dim]
    if spec.dim != dim:
        raise ValueError(f"slices of one tensor split along dims {spec.dim} and {dim}")
    return spec.start, spec.start + spec.length


def _split_dim(specs: Sequence[ShardSpec]) -> int:
    return next((s.dim for s in specs if s.global_shape and not s.is_full), 0)


def _row_bytes(h: Holding, dim: int) -> int:
    shape = h.spec.global_shape
    if not shape:
        return h.itemsize
    return h.itemsize * torch.Size(shape).numel() // shape[dim]


def plan_reshard(
    held: Sequence[Mapping[str, Holding]],
    wanted: Sequence[Mapping[str, Holding]],
    replica_of: Sequence[int],
) -> ReshardPlan:
    """Pure function: who sends which elements of which key to whom (index = participant).

    `held[r]` is participant r's old state, `wanted[r]` what it must hold on the new layout,
    `replica_of[r]` its old DP replica.  Raises `NoLiveCopy` naming what no participant holds.
    """
    holders: dict[str, list[tuple[int, Holding]]] = defaultdict(list)
    for r, hs in enumerate(held):
        for key, h in hs.items():
            holders[key].append((r, h))
    load = [0] * len(held)
    pieces: list[Piece] = []
    needed = 0
    missing: list[str] = []
    for dst, want in enumerate(wanted):
        for key in sorted(want):
            w = want[key]
            have = holders.get(key, [])
            if not have:
                missing.append(f"{key} (all of it)")
                continue
            if _needs_boxes([w.spec] + [h.spec for _, h in have]):
                needed += _plan_boxes(key, dst, w, have, replica_of, load, pieces, missing)
                continue
            dim = _split_dim([w.spec] + [h.spec for _, h in have])
            row = _row_bytes(w, dim)
            spans = [(r, *_axis(h.spec, dim)) for r, h in have]
            lo, hi = _axis(w.spec, dim)
            bounds = sorted({lo, hi} | {b for _, a, z in spans for b in (a, z) if lo < b < hi})
            run: list[int] | None = None  # [src, start, stop] of the piece being extended
            for a, b in zip(bounds[:-1], bounds[1:], strict=False):
                cands = [r for r, s, e in spans if s <= a and b <= e]
                if not cands:
                    missing.append(f"{key} elements [{a},{b}) along dim {dim}")
                    run = None
                    continue
                src = min(cands, key=lambda r: (_source_class(r, dst, replica_of), load[r], r))
                nbytes = (b - a) * row
                if src != dst:
                    load[src] += nbytes
                    needed += nbytes
                if run is not None and run[0] == src and run[2] == a:
                    run[2] = b
                else:
                    if run is not None:
                        pieces.append(Piece(key, run[0], dst, dim, run[1], run[2], (run[2] - run[1]) * row))
                    run = [src, a, b]
            if run is not None:
                pieces.append(Piece(key, run[0], dst, dim, run[1], run[2], (run[2] - run[1]) * row))
    if missing:
        shown = "; ".join(missing[:5]) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise NoLiveCopy(f"no survivor holds {shown}")
    return ReshardPlan(pieces, needed)


def _needs_boxes(specs: Sequence[ShardSpec]) -> bool:
    """Whether the slices of one tensor are not all intervals of one dim: a block (2D) or two split dims."""
    dims = {s.dim for s in specs if s.global_shape and not s.is_full}
    return any(s.is_block for s in specs) or len(dims) > 1


def _span(spec: ShardSpec) -> list[tuple[int, int]]:
    return [(o, o + n) for o, n in zip(spec.offsets, spec.local_shape, strict=True)]


def _plan_boxes(key: str, dst: int, w: Holding, have: Sequence[tuple[int, Holding]],
                replica_of: Sequence[int], load: list[int], pieces: list[Piece], missing: list[str]) -> int:
    """`plan_reshard` for one key some participant holds as a block: the wanted box split at every holder's
    boundary on every dim, each piece from the preferred holder (same rule).  Returns the bytes moved."""
    import itertools

    want = _span(w.spec)
    spans = [(r, _span(h.spec)) for r, h in have]
    cuts = [sorted({lo, hi} | {b for _, sp in spans for b in sp[d] if lo < b < hi})
            for d, (lo, hi) in enumerate(want)]
    moved = 0
    for box in itertools.product(*(list(zip(c[:-1], c[1:], strict=False)) for c in cuts)):
        cands = [r for r, sp in spans
                 if all(s[0] <= a and b <= s[1] for s, (a, b) in zip(sp, box, strict=True))]
        if not cands:
            missing.append(f"{key} elements {list(box)}")
            continue
        src = min(cands, key=lambda r: (_source_class(r, dst, replica_of), load[r], r))
        nbytes = w.itemsize
        for a, b in box:
            nbytes *= b - a
        if src != dst:
            load[src] += nbytes
            moved += nbytes
        first = box[0] if box else (0, 1)
        pieces.append(Piece(key, src, dst, 0, first[0], first[1], nbytes, box=tuple(box)))
    return moved


def _piece_view(item: NamedSlice, p: Piece) -> torch.Tensor:
    """The part of a held tensor that piece `p` covers."""
    if p.box is None:
        return _view(item, p.dim, p.start, p.stop)
    t = item.tensor
    for d, ((a, b), at) in enumerate(zip(p.box, item.spec.offsets, strict=True)):
        t = t.narrow(d, a - at, b - a)
    return t


def _view(item: NamedSlice, dim: int, start: int, stop: int) -> torch.Tensor:
    """The part of a held tensor covering elements `[start, stop)` of its logical tensor along `dim`."""
    t = item.tensor
    if t.dim() == 0:
        return t
    offset = 0 if item.spec.is_full else item.spec.start
    return t.narrow(dim, start - offset, stop - start)


def holdings(state: Mapping[str, NamedSlice]) -> dict[str, Holding]:
    return {
        k: Holding(v.spec, str(v.tensor.dtype).removeprefix("torch."), v.tensor.element_size())
        for k, v in state.items()
    }


def _gather(obj, group) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def execute_plan(
    plan: ReshardPlan,
    me: int,
    held: Mapping[str, NamedSlice],
    wanted: Mapping[str, NamedSlice],
    group=None,
) -> tuple[int, int]:
    """Run this participant's part of `plan`: local copies, then one send and one receive per peer, dtype
    and device (`batch_isend_irecv`, one batch per device: on a GPU run AdamW's 0-dim `step` stays on the
    CPU, gloo's half of the group, while the moments travel on NCCL).  Returns (bytes sent, bytes
    received)."""
    sends: Buckets = defaultdict(list)
    recvs: Buckets = defaultdict(list)
    sent = received = 0
    with torch.no_grad():
        for p in plan.pieces:
            if p.dst == me and p.src == me:
                _piece_view(wanted[p.key], p).copy_(_piece_view(held[p.key], p))
            elif p.src == me:
                v = _piece_view(held[p.key], p)
                sends[(p.dst, v.dtype, v.device)].append(v)
                sent += p.nbytes
            elif p.dst == me:
                v = _piece_view(wanted[p.key], p)
                recvs[(p.src, v.dtype, v.device)].append(v)
                received += p.nbytes
        ops: dict[torch.device, list] = defaultdict(list)
        landing = []
        for (peer, dtype, device), views in _ordered(sends):
            flat = torch.cat([v.reshape(-1) for v in views])
            dst = dist.get_global_rank(group, peer) if group else peer
            ops[device].append(dist.P2POp(dist.isend, flat, dst, group=group, tag=_tag(dtype, device)))
        for (peer, dtype, device), views in _ordered(recvs):
            flat = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=device)
            src = dist.get_global_rank(group, peer) if group else peer
            ops[device].append(dist.P2POp(dist.irecv, flat, src, group=group, tag=_tag(dtype, device)))
            landing.append((flat, views))
        for device in sorted(ops, key=str):  # the same order on every rank
            for work in dist.batch_isend_irecv(ops[device]):
                work.wait()
        for flat, views in landing:
            offset = 0
            for v in views:
                n = v.numel()
                v.copy_(flat[offset : offset + n].view(v.shape))
                offset += n
    return sent, received


# (peer, dtype, device) -> the views travelling in one flat buffer
Buckets = dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]]


def _ordered(buckets: Buckets) -> list:
    """Buckets in an order every rank agrees on."""
    return sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2])))


def _tag(dtype: torch.dtype, device: torch.device | None = None) -> int:
    """A message tag per dtype and device type, the same on every rank (pieces of two dtypes, or on two
    devices, between one pair)."""
    name = str(dtype) + ("" if device is None else device.type)
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % (1 << 20)


def reshard_state(
    held: Mapping[str, NamedSlice],
    wanted: Mapping[str, NamedSlice],
    replica: int,
    group=None,
    problems: Sequence[str] = (),
) -> ReshardResult:
    """Collective over `group` (default: the world): fill every participant's `wanted` slices from the
    participants' `held` slices.  `replica` is this participant's old DP replica (source preference).
    `problems` (e.g. a model mismatch found by one participant) stop every participant alike."""
    me = dist.get_rank(group)
    everyone = _gather((holdings(held), holdings(wanted), replica, list(problems)), group)
    found = sorted({p for e in everyone for p in e[3]})
    if found:
        raise RuntimeError("the new layout's model does not match the old one: " + "; ".join(found[:5]))
    plan = plan_reshard([e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone])
    sent, received = execute_plan(plan, me, held, wanted, group)
    return ReshardResult(plan.moved_bytes, plan.needed_bytes, sent, received)


def stored_shapes(group=None, state: Mapping[str, NamedSlice] | None = None) -> dict[str, tuple]:
    """key -> (global shape, dtype) of every key any participant holds (collective)."""
    mine = {k: (tuple(v.spec.global_shape), v.tensor.dtype) for k, v in (state or {}).items()}
    out: dict[str, tuple] = {}
    for d in _gather(mine, group):
        out.update(d)
    return out


def live_reshard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    new_model: nn.Module | None,
    new_optimizer: torch.optim.Optimizer | None,
    replica: int,
    group=None,
    *,
    stale: bool = False,
) -> ReshardResult:
    """Collective over the transfer group: move `model`/`optimizer`'s state (old layout) into
    `new_model`/`new_optimizer` (new layout; None on a survivor the new layout leaves idle).

    A `stale` participant (one step behind the others) serves as no source: it receives everything.

    Parameters are filled in place; the new optimizer's state is replaced (AdamW's moments and step,
    any per-parameter tensor state) and its groups take the old groups' hyperparameters, as a
    checkpoint load would.  A quantised old model needs `new_model` quantised alike beforehand.
    """
    return reshard_snapshot(capture(model, optimizer), new_model, new_optimizer, replica, group, stale=stale)


@dataclass(frozen=True)
class Captured:
    """A rank's state by key (references to the live tensors, no copy) and its optimizer groups'
    hyperparameters by parameter name."""

    state: dict[str, NamedSlice]
    options: dict[str, dict]


def capture(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Captured:
    """No collective: usable on a broken process group (a sharded optimizer's state is not gathered)."""
    return Captured(sharded_state(model, optimizer),
                    group_options(model, optimizer) if optimizer is not None else {})


def reshard_snapshot(
    old: Captured,
    new_model: nn.Module | None,
    new_optimizer: torch.optim.Optimizer | None,
    replica: int,
    group=None,
    *,
    stale: bool = False,
) -> ReshardResult:
    """`live_reshard` from state captured beforehand (`capture`): the old optimizer may meanwhile have
    been pointed at the new parameters (`rebind_optimizer`)."""
    stored = stored_shapes(group, old.state)
    targets: dict[str, NamedSlice] = {}
    problems: list[str] = []
    if new_model is not None:
        targets, problems = load_targets(new_model, new_optimizer, stored)
    result = reshard_state({} if stale else old.state, targets, replica, group, problems)
    if new_model is not None and new_optimizer is not None:
        install_optimizer_state(new_model, new_optimizer, targets, old.options or None)
    return result
