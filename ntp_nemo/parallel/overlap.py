"""Gradient sync overlapped with the backward: each bucket is launched as soon as its gradients are final.

Every parameter gets a post-accumulate-grad hook (`Tensor.register_post_accumulate_grad_hook`), which
autograd calls once per backward pass after the parameter's `.grad` has been accumulated.  A step
announces how many backward passes it runs (`begin_step(m)`: one per micro-batch of this replica);
a parameter's gradient is final when its hook has fired `m` times, and a bucket is ready when all its
parameters are final.  Ready buckets are launched asynchronously (`async_op=True`): an all-reduce
(plain sync) or, with the distributed optimizer, a reduce-scatter into the optimizer's owned chunk.

Buckets become ready in whatever order the hooks fire (it differs between replicas of different TP
degrees, and a hook's order is not promised), but they are launched in one fixed order (`launch_order`),
a pure function of the plan that every rank computes alike: a ready bucket waits until every bucket
before it was launched, as Megatron's DDP does.  NCCL requires the collectives of one communicator in
the same order on all its ranks, and two ranks that share several communicators must not interleave
them differently (kernels of different communicators can wait on each other); the order restricted to
any communicator, or to the communicators two ranks share, is the same on every rank.  `finish()`
launches whatever has not been launched (a replica with no micro-batches this step, a parameter
without gradient) in the same order, waits for everything and writes the result: after it the
gradients are exactly what `GradientSynchronizer.sync()` gives.

Without the distributed optimizer each bucket has a persistent flat buffer (padding included) and a
parameter that is one whole fragment has its `.grad` as a view into it (`begin_step` points it there), as
in the blocking sync: the bucket is all-reduced where the backward accumulated it, with no pack or unpack
copy; fragments that are part of a parameter are copied in at launch and out at `finish`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.parallel.buckets import Bucket, backward_rank, build_buckets, fragment_view
from ntp_nemo.parallel.grad_sync import SyncPlan


def launch_order(plan: SyncPlan, buckets: list[Bucket]) -> list[int]:
    """Indices of `buckets` in launch order: the backward's order (the bucket whose first fragment the
    backward finishes first leads), then the holder set's place in the plan, then the bucket's place in
    its set.  Every holder of a bucket builds it alike, so the key is the same on every rank: one global
    order, of which each rank launches its own buckets."""
    place = {h: i for i, h in enumerate(plan.all_holder_sets)}
    return sorted(range(len(buckets)), key=lambda i: (-backward_rank(buckets[i].frags[0].name),
                                                     place[buckets[i].holders], buckets[i].index))


class OverlappedGradSync:
    """Bucketed, hook-driven DP gradient sync; with `optimizer` (a DistributedAdamW): reduce-scatter."""

    def __init__(self, model: nn.Module, plan: SyncPlan, group_of: Callable, bucket_bytes: int = 25 << 20,
                 optimizer=None) -> None:
        self.named = dict(model.named_parameters())
        self.plan, self.group_of, self.optimizer = plan, group_of, optimizer
        self.buckets: list[Bucket] = (optimizer.buckets if optimizer is not None
                                      else build_buckets(plan, self.named, bucket_bytes))
        self._params_of = [sorted({f.name for f in b.frags}) for b in self.buckets]
        self._buckets_of: dict[str, list[int]] = defaultdict(list)
        for i, names in enumerate(self._params_of):
            for n in names:
                self._buckets_of[n].append(i)
        self.order = launch_order(plan, self.buckets)
        self._buffers: list[tuple[torch.Tensor, list[torch.Tensor], list[bool]]] | None = None
        self._made_for: tuple | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n))
                         for n, p in self.named.items() if n in self._buckets_of]
        self._expected = 0
        self._armed = False
        self._reset()

    def _reset(self) -> None:
        self._seen: dict[str, int] = defaultdict(int)
        self._missing = [len(names) for names in self._params_of]
        self._ready = [False] * len(self.buckets)
        self._next = 0  # position in `self.order` of the next bucket to launch
        self._works: dict[int, tuple] = {}
        self.launched_in_backward = 0
        self.launch_times: list[float] = []  # perf_counter() of each launch this step (for measurements)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin_step(self, backward_passes: int) -> None:
        """Arm the hooks for a step of `backward_passes` backward calls (this replica's micro-batches)."""
        self._reset()
        self._expected = backward_passes
        self._armed = backward_passes > 0
        if self.optimizer is None:
            for i, (_, views, whole) in enumerate(self._bucket_buffers()):
                for f, v, w in zip(self.buckets[i].frags, views, whole, strict=True):
                    if w:
                        self._adopt(f.name, v)

    def _bucket_buffers(self) -> list[tuple[torch.Tensor, list[torch.Tensor], list[bool]]]:
        """Each bucket's (flat buffer padded to `bucket.padded`, one view per fragment, whether the
        fragment is its whole parameter); made again when a parameter's dtype or device changed."""
        made_for = tuple((p.dtype, p.device) for p in self.named.values())
        if self._buffers is not None and made_for == self._made_for:
            return self._buffers
        out = []
        for b in self.buckets:
            params = [self.named[f.name] for f in b.frags]
            buf = torch.zeros(b.padded, dtype=params[0].dtype, device=params[0].device)
            views, whole, offset = [], [], 0
            for f, p, n in zip(b.frags, params, b.sizes, strict=True):
                shape = fragment_view(p, f).shape
                views.append(buf[offset : offset + n].view(shape))
                whole.append(shape == p.shape and p.dtype == buf.dtype and p.device == buf.device)
                offset += n
            out.append((buf, views, whole))
        self._buffers, self._made_for = out, made_for
        return out

    def _adopt(self, name: str, view: torch.Tensor) -> None:
        """`name`'s `.grad` becomes `view` (keeping what it held)."""
        p = self.named[name]
        if p.grad is view:
            return
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad)
        p.grad = view

    def _hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if getattr(p, "ntp_grad_deferred", False):
                return  # summed over the TP group at the end of the pass (ReplicatedGradReducer)
            self.grad_accumulated(name)

        return hook

    def grad_accumulated(self, name: str) -> None:
        """One backward pass has accumulated `name`'s gradient (what its hook reports): once all passes
        have, its buckets may become ready, and the ready ones at the head of the order are launched."""
        if not self._armed:
            return
        self._seen[name] += 1
        if self._seen[name] != self._expected:
            return
        for i in self._buckets_of[name]:
            self._missing[i] -= 1
            if self._missing[i] == 0:
                self._ready[i] = True
        self._launch_in_order(in_backward=True)

    def _launch_in_order(self, *, in_backward: bool = False, force: bool = False) -> None:
        while self._next < len(self.order):
            i = self.order[self._next]
            if not (self._ready[i] or force):
                return
            self._launch(i)
            self._next += 1
            self.launched_in_backward += in_backward

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        self.launch_times.append(time.perf_counter())
        grads = {}
        for n in self._params_of[i]:
            p = self.named[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads[n] = p.grad
        if self.optimizer is not None:
            self._works[i] = (self.optimizer.bucket_launch(i, grads), None)
            return
        flat, views, whole = self._bucket_buffers()[i]
        for f, v, w in zip(self.buckets[i].frags, views, whole, strict=True):
            if w:
                self._adopt(f.name, v)
            else:
                v.copy_(fragment_view(self.named[f.name].grad, f))
            if f.weight != 1.0:
                v.mul_(f.weight)
        work = dist.all_reduce(flat, group=self.group_of(self.buckets[i].holders), async_op=True)
        self._works[i] = (work, flat)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is left (plan order), wait for every bucket and write the synced gradients."""
        self._armed = False
        self._launch_in_order(force=True)
        for i in range(len(self.buckets)):
            work, flat = self._works.pop(i)
            work.wait()
            if flat is not None:
                _, views, whole = self._bucket_buffers()[i]
                for f, v, w in zip(self.buckets[i].frags, views, whole, strict=True):
                    if not w:
                        fragment_view(self.named[f.name].grad, f).copy_(v)
        if self.optimizer is not None:
            self.optimizer.take_local_grads()
            return
        for f in self.plan.local_only:
            if f.weight != 1.0:
                p = self.named[f.name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                fragment_view(p.grad, f).mul_(f.weight)
