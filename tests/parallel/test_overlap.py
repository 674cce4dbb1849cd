"""Overlapped gradient sync: buckets launch during the backward and give the blocking sync's gradients.

Replicas (2, 1), float64, small buckets (several per holder set).  Also a step in which one replica
runs no micro-batch (its buckets are launched by `finish()`).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.parallel.overlap import OverlappedGradSync
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, GPT, assembled, tokens


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def overlap_worker(rank: int, world: int) -> dict:
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * (GPT.num_layers + 2)))
    rt, model = assembled(layout, rank, GPT, bucket_mb=0.002)
    sync = rt.sync
    ov = OverlappedGradSync(model, sync.plan, sync.group_of, sync.bucket_bytes)
    toks = tokens(GPT)
    out = {"buckets": len(ov.buckets)}
    for case, count in (("full", GLOBAL_BATCH), ("one-microbatch", 1)):
        micro = [toks[i : i + 1] for i in rt.my_microbatches(count)]
        model.zero_grad(set_to_none=False)
        ov.begin_step(len(micro))
        rt.train_microbatches(model, micro, count * (toks.shape[1] - 1))
        backward_end = time.perf_counter()
        launched = ov.launched_in_backward
        first_launch = min(ov.launch_times, default=float("inf"))
        ov.finish()
        overlapped = _grads(model)
        model.zero_grad(set_to_none=False)
        rt.train_microbatches(model, micro, count * (toks.shape[1] - 1))
        sync.sync()
        err = max(float((overlapped[n] - p.grad).abs().max() / max(float(p.grad.abs().max()), 1e-12))
                  for n, p in model.named_parameters())
        out[case] = {"microbatches": len(micro), "launched_in_backward": launched, "err": err,
                     "first_launch_before_end": first_launch < backward_end}
    ov.remove()
    return out


@pytest.mark.slow
def test_overlapped_sync_launches_in_backward_and_matches_blocking_sync():
    results = run_workers(overlap_worker, 3)
    for rank, res in enumerate(results):
        assert res["buckets"] >= 3, res  # several buckets per rank, so the launch order matters
        for case in ("full", "one-microbatch"):
            assert res[case]["err"] <= 1e-12, (rank, case, res[case])
        # A rank with micro-batches launched every bucket from the backward's hooks, the first one before
        # the backward ended; a rank without any launched them all in finish().
        full = res["full"]
        assert full["launched_in_backward"] == res["buckets"] and full["first_launch_before_end"], res
        one = res["one-microbatch"]
        if one["microbatches"] == 0:
            assert one["launched_in_backward"] == 0, res
        else:
            assert one["launched_in_backward"] == res["buckets"], res
    assert sorted(r["one-microbatch"]["microbatches"] for r in results) == [0, 1, 1]


class _Slices(torch.nn.Module):
    """One rank's slices of a few tensors (rows [lo, hi) of 6-row matrices per layer, replicated vectors),
    named as the model's, with the `ntp_spec`/`ntp_copies` the sync plan reads."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__()
        from ntp_nemo.topology.shard import ShardSpec

        def param(shape, spec):
            p = torch.nn.Parameter(torch.zeros(spec.local_shape))
            p.ntp_spec, p.ntp_copies = spec, 1
            return p

        self.embed = param((6, 4), ShardSpec.split((6, 4), 0, 1, lo, hi))
        self.blocks = torch.nn.ModuleList()
        for _ in range(3):
            block = torch.nn.Module()
            block.w = param((6, 4), ShardSpec.split((6, 4), 0, 1, lo, hi))
            block.norm = param((4,), ShardSpec.full((4,)))
            self.blocks.append(block)
        self.head = param((6, 4), ShardSpec.split((6, 4), 0, 1, lo, hi))


def test_hooks_in_any_order_launch_the_same_collectives_per_communicator(monkeypatch):
    """Replicas TP 3 (ranks 0-2) and TP 2 (ranks 3, 4): several holder sets per rank, and ranks that share
    more than one communicator (1 and 3 share (1, 3) and the replicated vectors' (0, ..., 4)).  Each rank's
    hooks fire in its own shuffled order; every rank must still issue, per communicator, the same
    collectives in the same order, and the same interleaving on the communicators it shares with another."""
    from ntp_nemo.parallel import overlap
    from ntp_nemo.parallel.grad_sync import build_sync_plans, param_descriptors

    intervals = [(0, 2), (2, 4), (4, 6), (0, 3), (3, 6)]
    models = [_Slices(lo, hi) for lo, hi in intervals]
    plans = build_sync_plans([param_descriptors(m) for m in models], replica_of=[0, 0, 0, 1, 1])
    issued: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    current: list[int] = [0]

    class Done:
        def wait(self) -> None:
            pass

    def all_reduce(tensor, group=None, async_op=False):
        issued[current[0]].append((group, tensor.numel()))
        return Done()

    monkeypatch.setattr(overlap.dist, "all_reduce", all_reduce)
    waited = 0
    for rank, (model, plan) in enumerate(zip(models, plans, strict=True)):
        current[0] = rank
        issued[rank] = []
        ov = overlap.OverlappedGradSync(model, plan, group_of=lambda holders: holders, bucket_bytes=1)
        assert len({b.holders for b in ov.buckets}) >= 2, rank  # two communicators or more
        names = [n for n, _ in model.named_parameters()] * 2  # two backward passes (micro-batches)
        random.Random(rank).shuffle(names)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ov.begin_step(2)
        for name in names:
            ov.grad_accumulated(name)
            waited += any(ov._ready[i] for i in ov.order[ov._next:])  # ready, held back by the order
        assert ov.launched_in_backward == len(ov.buckets), rank  # all launched from the hooks
        ov.finish()
        ov.remove()
    assert waited > 0  # the shuffles did make buckets ready out of order
    members: dict[tuple[int, ...], list[int]] = {}
    for rank, calls in issued.items():
        for group, _ in calls:
            members.setdefault(group, [])
            if rank not in members[group]:
                members[group].append(rank)
    for group, ranks in members.items():
        assert sorted(ranks) == list(group), group  # only the holders issue on a holder set's group
        seqs = {r: [n for g, n in issued[r] if g == group] for r in ranks}
        assert len({tuple(s) for s in seqs.values()}) == 1, (group, seqs)
    for a in issued:
        for b in issued:
            shared = {g for g in members if a in g and b in g}
            on_shared = [[c for c in issued[r] if c[0] in shared] for r in (a, b)]
            assert on_shared[0] == on_shared[1], (a, b)
