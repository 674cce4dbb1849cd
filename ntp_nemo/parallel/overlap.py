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

Each bucket has a persistent flat buffer (padding included; `buckets.BucketBuffers`: the sync's own, or
with the distributed optimizer the optimizer's) and a parameter that is one whole fragment has its `.grad`
as a view into it (`begin_step` points it there), as in the blocking sync: the bucket is all-reduced (or
reduce-scattered) where the backward accumulated it, with no pack or unpack copy; fragments that are part
of a parameter are copied in at launch (and, after an all-reduce, out at `finish`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.parallel.buckets import Bucket, BucketBuffers, backward_rank, build_buckets, fragment_view
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
        # Without the distributed optimizer the buckets' persistent buffers are the sync's own; with it,
        # the optimizer's (it reduce-scatters from them).
        self.buffers = BucketBuffers(self.buckets, self.named) if optimizer is None else None
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
            self.buffers.adopt_all()
        else:
            self.optimizer.prepare_grads()

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
        if self.optimizer is not None:
            self._works[i] = (self.optimizer.bucket_launch(i), None)
            return
        flat = self.buffers.fill(i)
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
                _, views, whole = self.buffers.all()[i]
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
