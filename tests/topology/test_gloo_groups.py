"""Gloo groups only where objects travel: on a `cpu:gloo,cuda:nccl` world every subgroup the runtime
creates is device-only, and the dry run counts the sockets gloo opens per rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ntp_nemo.runtime.dry_run import StepShape, dry_run, fake_world
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.groups import gloo_sockets, subgroup_backend
from tests.shapes import small_llama

TINY = small_llama(4)


@pytest.mark.parametrize("world,sub", [
    ("cpu:gloo,cuda:nccl", "cuda:nccl"),
    ("cuda:nccl,cpu:gloo", "cuda:nccl"),
    ("gloo", None),  # CPU: tensors travel on gloo subgroups
    ("nccl", None),
    ("fake", None),
])
def test_subgroup_backend(world, sub):
    assert subgroup_backend(world) == sub


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_every_subgroup_of_a_mixed_world_is_device_only(monkeypatch, schedule):
    """TP groups, fragment holder sets and pipeline links (wrap links too) of replicas (2, 1) x PP 2."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * 6, pp=2), schedule=schedule,
                                 virtual_stages=2 if schedule == "interleaved_1f1b" else 1)
    asked: list[tuple[tuple[int, ...], str | None]] = []
    original = dist.new_group

    def new_group(ranks=None, *args, backend=None, **kwargs):
        asked.append((tuple(ranks), backend))
        return original(ranks, *args, **kwargs)  # the fake backend stands in for both

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    descriptors = []
    for r in range(layout.world_size):
        with fake_world(r, layout.world_size):
            from ntp_nemo.parallel.grad_sync import param_descriptors

            descriptors.append(param_descriptors(RankPlace(layout, r, device="meta").build_model(TINY, 0)))
    with fake_world(0, layout.world_size):
        from ntp_nemo.parallel.grad_sync import build_sync_plan
        from ntp_nemo.runtime.assemble import assemble
        from tests.ntp_cases import OPTIM

        plan = build_sync_plan(0, descriptors, [c.replica for c in layout.topology().coords])
        assemble(layout, 0, TINY, OPTIM, "meta", seed=0, sync_plan=plan)
    kinds = {len(r) for r, _ in asked}
    # pairs (TP, holder pairs, replica 1's stage pair), the replicated vectors' triples, and replica 0's
    # stage pair (0, 1 | 2, 3): one link group per stage pair and direction
    assert kinds == {2, 3, 4}, asked
    assert len(asked) >= 10 and {b for _, b in asked} == {"cuda:nccl"}, asked


def test_dry_run_counts_gloo_sockets_per_rank():
    """Replicas (2, 1) x PP 2: ranks 0, 1 | 2, 3 are replica 0's stages, 4 | 5 replica 1's.  Rank 0 is in
    TP group (0, 1), holder sets (0, 4) (its shards) and (0, 1, 4) (the norms), and the two link groups
    of its stage pair, one per direction, each (0, 1, 2, 3): 1 + 1 + 2 + 3 + 3 = 10 peers; ranks 1-3 the
    same by symmetry; rank 4: (0, 4), (1, 4), (0, 1, 4) and the two link groups (4, 5): 1 + 1 + 2 + 1 + 1
    = 6, and rank 5 the same."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * 6, pp=2), num_microbatches=6)
    result = dry_run(layout, TINY, StepShape(seq_len=32, micro_batch_size=2), measure_options=False)
    assert [r.subgroup_peers for r in result.ranks] == [10, 10, 10, 10, 6, 6]
    # gloo on the world (5 peers) and the checkpoint writer's group (5 peers); on CPU the subgroups too.
    assert gloo_sockets(6, 6, gloo_subgroups=False, checkpoint_group=True) == 10
    assert gloo_sockets(6, 6, gloo_subgroups=True, checkpoint_group=True) == 16
    assert gloo_sockets(6, 6, gloo_subgroups=False, checkpoint_group=False) == 5
