"""Distributed AdamW: master weights and AdamW moments sharded across the holders of each gradient fragment.

The SyncPlan groups every fragment of every parameter by its holder set (the ranks, one or more per
replica, that hold that piece of the logical tensor).  The holder sets' buckets (`buckets.py`) are
split into `len(holders)` equal chunks and holder `i` owns chunk `i`:

1. `reduce_scatter_grads`: each bucket's weighted gradients are reduce-scattered in the holder set's
   group, so every holder receives the summed gradient of its chunk only;
2. `grad_norm_sq_local` / `clip_to_norm_`: the norm of the logical gradient from the owned chunks (each
   logical element is owned exactly once) plus the un-communicated fragments, one all-reduce of a
   scalar (the caller's fused step all-reduce, or `clip_grad_norm_`);
3. `step`: AdamW (torch's own `adamw` function, same arithmetic as `torch.optim.AdamW`) on the owned
   chunks, then each bucket's updated chunks are all-gathered back into every holder's parameters.
   With a commit check (`commit_check`, set for a step by `runtime.step.train_step` when a recovery's
   aborted collectives may return without raising: NCCL) the step is a transaction: the update runs on
   staged moments and masters, every bucket is gathered into a staging buffer, the check runs, and only
   then is anything written; a gather or a check that raises leaves the parameters and the state as
   they were (tests/parallel/test_dist_optimizer_commit.py).  The staging costs two moment copies of
   the owned chunks and one parameter-sized gather buffer per dtype, only on runs that set the check.

Steps 1 and 3 together move the same bytes as the all-reduce of the plain sync.  Fragments the plan
does not communicate (identical copies inside one replica, or held by one rank) are updated whole on
every rank that holds them, as with the plain optimizer.  Unequal replicas need nothing special: a
holder set mixes ranks of a TP-2 and a TP-1 replica exactly as the plain sync does.

Weights: the parameters stay the model's tensors.  For float32/float64 parameters they are the master
weights (the owned chunk is copied to a scratch buffer for the update and gathered back); for
float16/bfloat16 parameters a float32 master of the owned chunk is kept.  Persistent state per rank is
the moments (plus the low-precision master) of its chunks: about 1/len(holders) of the plain
optimizer's.

Buffers: each bucket's gradients are accumulated in a persistent flat buffer (`buckets.BucketBuffers`;
`prepare_grads`, called by `GradientPath.begin_step`, points every whole-fragment parameter's `.grad` at
its view of it, so the reduce-scatter reads where the backward wrote, without a pack copy; fragments that
are part of a parameter are copied in).  The reduce-scatter's output, the update's scratch chunk and one
all-gather buffer per parameter dtype (the size of the largest bucket) are kept between steps, so a step
allocates nothing of the buckets' size.  After the sync a whole-fragment `.grad` holds this rank's
weighted, unreduced gradient (the reduced one lives in the owned chunks only).

Checkpoints stay per parameter (and so topology-independent): `gather_state()` (collective, every rank)
fills `self.state` with each parameter's full local `step`/`exp_avg`/`exp_avg_sq`, exactly what
`torch.optim.AdamW` holds, for the checkpoint writer to read.  Those full moments live in host memory
(`self.host`), staged one bucket at a time: the device holds one gathered bucket at any moment, not the
unsharded moments this optimizer exists to avoid; the writer drops them once it has its snapshot.
State installed into `self.state` by a checkpoint loader (from a run with or without this optimizer, on
any layout) is taken over by the next `step()`, which keeps only this rank's chunks and empties
`self.state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw

from ntp_nemo.parallel.buckets import Bucket, BucketBuffers, build_buckets, fragment_view, unpack
from ntp_nemo.parallel.grad_sync import Fragment, SyncPlan, weighted_norm_sq

_LOW = (torch.float16, torch.bfloat16)


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW else dtype


@dataclass
class _Segment:
    """A piece of one parameter fragment owned by this rank: `length` elements starting at element
    `frag_offset` of the fragment's flattened view, at `offset` of its owner buffer."""

    frag: Fragment
    frag_offset: int
    offset: int
    length: int
    group: int  # index into param_groups
    step: torch.Tensor


class _Owned:
    """This rank's part of one bucket (or one un-communicated fragment): moments, master, segments."""

    def __init__(self, numel: int, dtype: torch.dtype, device, low_precision: bool) -> None:
        self.numel = numel
        self.exp_avg = torch.zeros(numel, dtype=dtype, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=dtype, device=device)
        self.master = torch.zeros(numel, dtype=dtype, device=device) if low_precision else None
        self.segments: list[_Segment] = []
        self.grad: torch.Tensor | None = None  # the reduced gradient of the owned part, this step
        self.reduced: torch.Tensor | None = None  # the reduce-scatter writes here (kept between steps)
        self.work: torch.Tensor | None = None  # the update's copy of the owned parameters (kept)
        # The transactional step's copies of the moments (swapped with them at its commit; kept)
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None


def _flat_piece(t: torch.Tensor, f: Fragment, offset: int, length: int) -> torch.Tensor:
    return fragment_view(t, f).reshape(-1)[offset : offset + length]


def _copy_into_fragment(t: torch.Tensor, f: Fragment, offset: int, values: torch.Tensor) -> None:
    v = fragment_view(t, f)
    if v.is_contiguous():
        v.view(-1)[offset : offset + values.numel()].copy_(values)
    else:
        flat = v.reshape(-1).clone()
        flat[offset : offset + values.numel()].copy_(values)
        v.copy_(flat.view(v.shape))


class DistributedAdamW(torch.optim.Optimizer):
    """AdamW over a model's parameters with the state sharded along the SyncPlan's holder sets.

    `param_groups` are ordinary torch groups of the model's parameters (e.g. decay / no decay); an LR
    scheduler drives their `lr` as usual.  Construction is local (no communication).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: SyncPlan,
        group_of: Callable,
        param_groups,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bucket_bytes: int = 25 << 20,
        world_group=None,
        acc_dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.named = dict(model.named_parameters())
        self.plan, self.group_of, self.world_group = plan, group_of, world_group
        self.acc_dtype = acc_dtype  # dtype of the squared-norm accumulator
        self.rank = plan.rank
        group_idx = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of_name = {n: group_idx[id(p)] for n, p in self.named.items()}
        self.buckets: list[Bucket] = build_buckets(plan, self.named, bucket_bytes)
        some = next(iter(self.named.values()))
        self.device = some.device
        # Step counters live on the host, as torch.optim.AdamW keeps them (no device sync to read them).
        self._step_count = torch.zeros((), dtype=torch.float32)
        self.owned: list[_Owned] = []  # one per bucket, then one per un-communicated fragment
        for b in self.buckets:
            lo, hi = b.owned(self.rank)
            dtype = self.named[b.frags[0].name].dtype
            own = self._new_owned(hi - lo, dtype)
            for f, fo, wo, n in b.pieces(lo, hi):
                own.segments.append(self._segment(f, fo, wo, n))
            self.owned.append(own)
        for f in plan.local_only:
            p = self.named[f.name]
            n = fragment_view(p, f).numel()
            own = self._new_owned(n, p.dtype)
            own.segments.append(self._segment(f, 0, 0, n))
            self.owned.append(own)
        # The buckets' gradient buffers: whole-fragment `.grad`s are views into them (`prepare_grads`).
        self.grad_buffers = BucketBuffers(self.buckets, self.named)
        # one all-gather buffer per (dtype, device); the transactional step's staging per dtype
        self._gather_scratch: dict[tuple, torch.Tensor] = {}
        self._grads_ready = False
        # Called by a transactional step after its all-gathers, before it writes anything (`step`); set
        # for a step by `runtime.step.train_step(commit_check=...)`, None otherwise
        self.commit_check: Callable[[], None] | None = None
        self._load_masters()
        # Where `gather_state` stages the full moments (pageable host memory: a save is not a hot path).
        self.host = torch.device("cpu")

    def _new_owned(self, numel: int, dtype: torch.dtype) -> _Owned:
        return _Owned(numel, _master_dtype(dtype), self.device, dtype in _LOW)

    def _segment(self, f: Fragment, fo: int, wo: int, n: int) -> _Segment:
        step = torch.zeros((), dtype=torch.float32)
        return _Segment(f, fo, wo, n, self._group_of_name[f.name], step)

    @property
    def local_fragments(self) -> list[Fragment]:
        return self.plan.local_only

    # ---- gradients -----------------------------------------------------------------------------
    def _grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out[name] = p.grad
        return out

    def prepare_grads(self) -> None:
        """Before a step's first backward: every whole-fragment parameter's `.grad` becomes its view of
        its bucket's persistent buffer, so the backward accumulates where the reduce-scatter reads."""
        self.grad_buffers.adopt_all()

    def _reduced_chunk(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Bucket `i`'s persistent reduce-scatter output (its owned chunk), made again on a dtype change."""
        own = self.owned[i]
        if own.reduced is None or own.reduced.dtype != flat.dtype or own.reduced.device != flat.device:
            own.reduced = flat.new_empty(self.buckets[i].chunk)
        return own.reduced

    @torch.no_grad()
    def reduce_scatter_grads(self) -> None:
        """Blocking: every bucket reduce-scattered in its holder set's group (in the plan's global order)."""
        for i, (b, own) in enumerate(zip(self.buckets, self.owned, strict=False)):
            flat = self.grad_buffers.fill(i)
            own.grad = self._reduced_chunk(i, flat)
            dist.reduce_scatter_single(own.grad, flat, group=self.group_of(b.holders))
        self.take_local_grads()

    def bucket_launch(self, b_index: int):
        """Asynchronous reduce-scatter of bucket `b_index` (for the overlapped sync); returns the work.  The
        persistent buffer it reads is not written again before the step (its gradients are final)."""
        b, own = self.buckets[b_index], self.owned[b_index]
        flat = self.grad_buffers.fill(b_index)
        own.grad = self._reduced_chunk(b_index, flat)
        return dist.reduce_scatter_single(own.grad, flat, group=self.group_of(b.holders), async_op=True)

    @torch.no_grad()
    def take_local_grads(self) -> None:
        """The un-communicated fragments' gradients (weighted), after the buckets are reduced."""
        grads = self._grads()
        for own in self.owned[len(self.buckets):]:
            f = own.segments[0].frag
            own.grad = (fragment_view(grads[f.name], f) * f.weight).reshape(-1)
        self._grads_ready = True

    @torch.no_grad()
    def grad_norm_sq_local(self) -> torch.Tensor:
        """This rank's share of the logical gradient's squared norm (sum over ranks = the norm^2): the
        owned chunks (each logical element is owned once) and the un-communicated fragments (weighted
        by 1 / their holders).  A 0-dim tensor on the device, no communication; one foreach norm per
        weight, each taken in the accumulator dtype inside its reduction."""
        nb = len(self.buckets)
        weights = [1.0 if i < nb else own.segments[0].frag.norm_weight for i, own in enumerate(self.owned)]
        return weighted_norm_sq([own.grad for own in self.owned], weights, self.acc_dtype, self.device)

    @torch.no_grad()
    def clip_to_norm_(self, norm: torch.Tensor, max_norm: float | None) -> None:
        """Scale the owned gradients by min(1, max_norm / (norm + 1e-6)) (`norm`: the reduced global
        norm, a device tensor), as the plain path does."""
        if not max_norm or max_norm <= 0:
            return
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for own in self.owned:
            own.grad.mul_(coef.to(own.grad.dtype))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """All-reduce the squared norm, clip; returns the logical gradient's norm before clipping."""
        sq = self.grad_norm_sq_local()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sq, group=self.world_group)
        norm = sq.sqrt()
        self.clip_to_norm_(norm, max_norm)
        return norm

    # ---- update --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """AdamW on the owned chunks, then each bucket's updated chunks all-gathered into the parameters.

        With `commit_check` set the step is a transaction: the update runs on staged copies of the
        moments (and masters), every bucket is gathered into a staging buffer, `commit_check()` runs once
        all the gathers returned, and only then are the parameters, moments, masters and step counters
        written.  A gather that raises, or a `commit_check` that raises (a generation aborted under the
        step: an aborted NCCL collective may return without raising, with partial data), leaves all of
        them as they were before the step.  Without it (the default) the update is in place and the
        gathered buckets are unpacked one by one: no staging memory."""
        if closure is not None:  # Lightning's manual optimisation passes a do-nothing closure
            with torch.enable_grad():
                closure()
        if self.state:
            self._take_over_state()
        if not self._grads_ready:
            self.reduce_scatter_grads()
        try:
            if self.commit_check is None:
                self._step_in_place()
            else:
                self._step_staged(self.commit_check)
        finally:
            for own in self.owned:
                own.grad = None
            self._grads_ready = False
        return None

    def _work_buffer(self, own: _Owned) -> torch.Tensor:
        """The update's copy of `own`'s parameters in the master dtype (kept between steps)."""
        if own.work is None or own.work.dtype != own.exp_avg.dtype:
            own.work = torch.zeros(own.numel, dtype=own.exp_avg.dtype, device=self.device)
        return own.work

    def _load_work(self, own: _Owned) -> torch.Tensor:
        buf = self._work_buffer(own)
        for s in own.segments:
            buf[s.offset : s.offset + s.length] = _flat_piece(self.named[s.frag.name], s.frag,
                                                              s.frag_offset, s.length)
        return buf

    def _adamw(self, work: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor],
               steps: list[list[torch.Tensor]]) -> None:
        """torch's AdamW on every owned segment, group by group: `work[i]` holds owned part i's
        parameters, `exp_avg[i]`/`exp_avg_sq[i]` its moments, `steps[i]` its segments' step counters."""
        for gi, group in enumerate(self.param_groups):
            ps, gs, m1, m2, st = [], [], [], [], []
            for own, buf, a, b, counters in zip(self.owned, work, exp_avg, exp_avg_sq, steps, strict=True):
                grad = own.grad.to(buf.dtype)
                for s, counter in zip(own.segments, counters, strict=True):
                    if s.group != gi:
                        continue
                    sl = slice(s.offset, s.offset + s.length)
                    ps.append(buf[sl])
                    gs.append(grad[sl])
                    m1.append(a[sl])
                    m2.append(b[sl])
                    st.append(counter)
            if not ps:
                continue
            beta1, beta2 = group["betas"]
            adamw(ps, gs, m1, m2, [], st, foreach=None, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _copy_local(self, own: _Owned, buf: torch.Tensor) -> None:
        s = own.segments[0]
        p = self.named[s.frag.name]
        fragment_view(p, s.frag).copy_(buf.view(fragment_view(p, s.frag).shape).to(p.dtype))

    def _step_in_place(self) -> None:
        work = [own.master if own.master is not None else self._load_work(own) for own in self.owned]
        self._adamw(work, [o.exp_avg for o in self.owned], [o.exp_avg_sq for o in self.owned],
                    [[s.step for s in o.segments] for o in self.owned])
        self._step_count += 1
        nb = len(self.buckets)
        for b, buf in zip(self.buckets, work[:nb], strict=True):
            p0 = self.named[b.frags[0].name]
            full = self._gather_buffer(p0.dtype)[: b.padded]
            dist.all_gather_single(full, buf.to(p0.dtype), group=self.group_of(b.holders))
            unpack(b, full, self.named)
        for own, buf in zip(self.owned[nb:], work[nb:], strict=True):
            self._copy_local(own, buf)

    def _staged_moments(self, own: _Owned) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of `own`'s moments the staged update writes (buffers kept between steps)."""
        if own.staged is None or own.staged[0].dtype != own.exp_avg.dtype:
            own.staged = (torch.empty_like(own.exp_avg), torch.empty_like(own.exp_avg_sq))
        own.staged[0].copy_(own.exp_avg)
        own.staged[1].copy_(own.exp_avg_sq)
        return own.staged

    def _step_staged(self, commit_check: Callable[[], None]) -> None:
        """The transaction of `step`: nothing this rank keeps is written before every gather returned and
        `commit_check()` passed."""
        work, m1, m2, steps = [], [], [], []
        for own in self.owned:
            buf = self._work_buffer(own)
            if own.master is not None:
                buf.copy_(own.master)
            else:
                self._load_work(own)
            a, b = self._staged_moments(own)
            work.append(buf)
            m1.append(a)
            m2.append(b)
            steps.append([s.step.clone() for s in own.segments])
        self._adamw(work, m1, m2, steps)
        nb = len(self.buckets)
        gathered = []
        offsets: dict[torch.dtype, int] = {}
        for b, buf in zip(self.buckets, work[:nb], strict=True):
            dtype = self.named[b.frags[0].name].dtype
            at = offsets.get(dtype, 0)
            full = self._staging_buffer(dtype)[at : at + b.padded]
            offsets[dtype] = at + b.padded
            dist.all_gather_single(full, buf.to(dtype), group=self.group_of(b.holders))
            gathered.append(full)
        commit_check()  # raises: nothing below runs, the parameters and the state stay as they were
        for b, full in zip(self.buckets, gathered, strict=True):
            unpack(b, full, self.named)
        for own, buf in zip(self.owned[nb:], work[nb:], strict=True):
            self._copy_local(own, buf)
        for own, buf, counters in zip(self.owned, work, steps, strict=True):
            own.exp_avg, own.exp_avg_sq, own.staged = own.staged[0], own.staged[1], (own.exp_avg,
                                                                                     own.exp_avg_sq)
            if own.master is not None:
                own.master.copy_(buf)
            for s, counter in zip(own.segments, counters, strict=True):
                s.step.copy_(counter)
        self._step_count += 1

    def _staging_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The transactional step's gather target for `dtype` parameters: every bucket of that dtype at
        once (kept between steps; allocated only when a step runs with `commit_check`)."""
        key = ("staged", dtype, self.device)
        if key not in self._gather_scratch:
            size = sum(b.padded for b in self.buckets if self.named[b.frags[0].name].dtype == dtype)
            self._gather_scratch[key] = torch.empty(size, dtype=dtype, device=self.device)
        return self._gather_scratch[key]

    def _gather_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The all-gather buffer for `dtype` parameters, as large as their largest bucket (kept between
        steps: one bucket of memory, not the parameters again)."""
        key = (dtype, self.device)
        if key not in self._gather_scratch:
            size = max(b.padded for b in self.buckets if self.named[b.frags[0].name].dtype == dtype)
            self._gather_scratch[key] = torch.empty(size, dtype=dtype, device=self.device)
        return self._gather_scratch[key]

    # ---- checkpoint hooks ------------------------------------------------------------------------
    @torch.no_grad()
    def gather_state(self) -> None:
        """Collective (every rank, same order): fill `self.state` with each parameter's full local AdamW
        state (`step`, `exp_avg`, `exp_avg_sq` shaped like the parameter), as `torch.optim.AdamW` holds it,
        in `self.host` memory.  Bucket by bucket, one moment at a time, through one device buffer the size
        of the largest bucket: that buffer is all the device memory a save adds."""
        self.state.clear()
        for p in self.named.values():
            dtype = _master_dtype(p.dtype)
            self.state[p] = {
                "step": self._step_count.clone(),
                "exp_avg": torch.zeros(p.shape, dtype=dtype, device=self.host),
                "exp_avg_sq": torch.zeros(p.shape, dtype=dtype, device=self.host),
            }
        nb = len(self.buckets)
        by_dtype: dict[torch.dtype, torch.Tensor] = {}  # one gather buffer per moment dtype
        for b, own in zip(self.buckets, self.owned[:nb], strict=True):
            dtype = own.exp_avg.dtype
            if dtype not in by_dtype:
                size = max(c.padded for c, o in zip(self.buckets, self.owned, strict=False)
                           if o.exp_avg.dtype == dtype)
                by_dtype[dtype] = torch.empty(size, dtype=dtype, device=self.device)
            full = by_dtype[dtype][: b.padded]
            group = self.group_of(b.holders)
            for key in ("exp_avg", "exp_avg_sq"):
                dist.all_gather_single(full, getattr(own, key), group=group)
                unpack(b, full, {n: self.state[p][key] for n, p in self.named.items()})
        del by_dtype
        for own in self.owned[nb:]:
            f = own.segments[0].frag
            p = self.named[f.name]
            for key in ("exp_avg", "exp_avg_sq"):
                v = fragment_view(self.state[p][key], f)
                v.copy_(getattr(own, key).view(v.shape))

    @torch.no_grad()
    def _take_over_state(self) -> None:
        """Keep this rank's chunks of per-parameter state found in `self.state` (local, no communication)."""
        step = None
        for own in self.owned:
            for s in own.segments:
                st = self.state.get(self.named[s.frag.name], {})
                sl = slice(s.offset, s.offset + s.length)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        getattr(own, key)[sl] = _flat_piece(st[key], s.frag, s.frag_offset, s.length)
                    else:
                        getattr(own, key)[sl] = 0
                if "step" in st:
                    step = st["step"]
                    s.step.copy_(st["step"])
        self._load_masters()
        if step is not None:
            self._step_count.copy_(step)
        self.state.clear()

    @torch.no_grad()
    def _load_masters(self) -> None:
        """Low-precision parameters: the float32 master of the owned chunk from the current values."""
        for own in self.owned:
            if own.master is not None:
                for s in own.segments:
                    own.master[s.offset : s.offset + s.length] = _flat_piece(
                        self.named[s.frag.name], s.frag, s.frag_offset, s.length)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps between steps (moments and low-precision masters)."""
        total = 0
        for own in self.owned:
            for t in (own.exp_avg, own.exp_avg_sq, own.master):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The decay (matrices) / no-decay (vectors) groups the plain optimizer uses."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
