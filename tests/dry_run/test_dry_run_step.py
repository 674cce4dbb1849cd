"""The dry run's shortcuts give the figures of the straightforward path.

- `dry_run` runs each step shape on two short builds of the stages (2 and 3 layers) and extends the
  figures to the stages' length, and `option_savings` measures each other setting's micro-batch the
  same way (`scale_layers=True`, the default); the reference runs every step on the whole stage.
- `MetaKernelCache` skips a repeated in-place meta kernel (and reuses functional outputs); the reference
  runs every kernel (a cache that keeps nothing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import build_sync_plans, param_descriptors
from ntp_nemo.runtime import dry_run as dr
from ntp_nemo.runtime.dry_run import MetaKernelCache, StepShape, dry_run, fake_world, option_savings
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.shapes import small_llama

# Stages longer than the short builds (2 and 3 layers): 6 layers at PP 1, 10 at PP 2.
LLAMA = small_llama(6)
SHAPE = StepShape(seq_len=32, micro_batch_size=1, compute_dtype=torch.bfloat16)


def _plans(layout: ResolvedLayout, cfg: ModelConfig):
    desc = []
    for r in range(layout.world_size):
        with fake_world(r, layout.world_size):
            desc.append(param_descriptors(RankPlace(layout, r, device="meta").build_model(cfg, 0)))
    return build_sync_plans(desc, [c.replica for c in layout.topology().coords])


@pytest.mark.parametrize("replica_tp,pp,layers,sp,recompute,rank", [
    ([4, 3], 1, 6, True, "none", 6),  # uneven TP 3 (sequence 32 over 3: slices 11, 11, 10), SP on
    ([2, 1], 2, 10, True, "none", 1),  # PP 2: stage 0 (embedding + 5 layers) of the TP-2 replica
    ([2, 1], 2, 10, False, "full", 5),  # PP 2: the TP-1 replica's last stage (5 layers + head)
])
def test_short_builds_give_the_whole_stage_figures(replica_tp, pp, layers, sp, recompute, rank, monkeypatch):
    cfg = dataclasses.replace(LLAMA, num_layers=layers, recompute=recompute)
    topology = Topology(max(replica_tp), replica_tp, [max(replica_tp)] * (layers + 2), pp=pp)
    layout = ResolvedLayout.make(topology, num_microbatches=4, sequence_parallel=sp)
    plans = _plans(layout, cfg)
    args = (layout, rank, cfg, SHAPE, plans[rank], 4 * 32, 1000, 2000)
    reference = option_savings(*args, scale_layers=False)

    built: list[int] = []
    build = RankPlace.build_model

    def counted(self, model_cfg, *a, **k):
        built.append(model_cfg.num_layers)
        return build(self, model_cfg, *a, **k)

    monkeypatch.setattr(RankPlace, "build_model", counted)
    fast = option_savings(*args)
    assert fast == reference
    # Both SP settings (no step measurement handed in) and the two other recompute modes each ran on
    # 2 and 3 layers per stage; the distributed optimizer's build is the whole slice.
    assert sorted(built) == [2 * pp] * 4 + [3 * pp] * 4 + [layers]


def test_short_builds_are_not_used_where_layers_differ(monkeypatch):
    """Per-layer degrees, recomputation of every other layer and short stages run the whole stage."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2, 2, 1, 2, 2, 2, 2, 2]), num_microbatches=2)
    assert dr._short_layout(layout, LLAMA, 0, 2) is None  # layer 2 at degree 1
    even = ResolvedLayout.make(Topology(2, [2, 1], [2] * 8), num_microbatches=2)
    assert dr._short_layout(even, LLAMA, 0, 2) is not None
    every2 = dataclasses.replace(LLAMA, recompute="full", recompute_every=2)
    assert dr._short_layout(even, every2, 0, 2) is None
    short = ResolvedLayout.make(Topology(2, [2, 1], [2] * 8, pp=2), num_microbatches=2)  # 3 + 3 layers
    assert dr._short_layout(short, LLAMA, 0, 2) is None
    # Where it does not apply, option_savings still gives the reference figures.
    cfg = dataclasses.replace(LLAMA, recompute="full", recompute_every=2)
    plans = _plans(even, cfg)
    args = (even, 0, cfg, SHAPE, plans[0], 2 * 32, 1000, 2000)
    assert option_savings(*args) == option_savings(*args, scale_layers=False)


@pytest.mark.parametrize("replica_tp,pp,layers,sp,recompute", [
    ([3, 2], 1, 6, True, "none"),  # uneven TP 2 and 3 (sequence 32 over 3: slices 11, 11, 10), SP on
    ([2, 1], 2, 10, False, "selective"),  # PP 2 (5 + 5 layers), a degraded replica, recompute configured
])
def test_step_shapes_on_short_builds_give_every_rank_the_whole_stage_figures(replica_tp, pp, layers, sp,
                                                                             recompute):
    cfg = dataclasses.replace(LLAMA, num_layers=layers, recompute=recompute)
    topology = Topology(max(replica_tp), replica_tp, [max(replica_tp)] * (layers + 2), pp=pp)
    layout = ResolvedLayout.make(topology, num_microbatches=6, sequence_parallel=sp)
    said: list[str] = []
    fast = dry_run(layout, cfg, SHAPE, progress=said.append)
    reference = dry_run(layout, cfg, SHAPE, scale_layers=False)
    assert [m for m in said if m.startswith("step shape")] and all(
        m.endswith("(on 2 and 3 layers per stage)") for m in said if m.startswith("step shape"))
    assert [dataclasses.asdict(r) for r in fast.ranks] == [dataclasses.asdict(r) for r in reference.ranks]
    assert fast.options == reference.options and fast.splits == reference.splits
    assert fast.model_params == reference.model_params


class _NoCache(MetaKernelCache):
    """Runs every kernel (the straightforward path)."""

    @classmethod
    def _classify(cls, func) -> int:
        return 0


def test_cached_kernels_give_the_figures_of_every_kernel_run(monkeypatch):
    """A whole dry run (uneven TP with SP, bf16-mixed: forward, backward, sync, AdamW and the options)
    with the kernel cache against one that runs every kernel: every rank's figures and the options."""
    cfg = dataclasses.replace(LLAMA, num_layers=4)
    layout = ResolvedLayout.make(Topology(3, [3, 2], [3] * 6), num_microbatches=3, sequence_parallel=True)
    fast = dry_run(layout, cfg, SHAPE)
    monkeypatch.setattr(dr, "MetaKernelCache", _NoCache)
    slow = dry_run(layout, cfg, SHAPE)
    assert [dataclasses.asdict(r) for r in fast.ranks] == [dataclasses.asdict(r) for r in slow.ranks]
    assert fast.options == slow.options
    # AdamW's state: two moments of each parameter, in the parameters' dtype (float32).
    for r in fast.ranks:
        assert r.optimizer_bytes == 2 * r.param_bytes == 2 * 4 * r.params


def test_inplace_kernels_are_checked_once_per_metadata():
    cache = MetaKernelCache()
    add_ = torch.ops.aten.add_.Tensor
    a, b = torch.empty(4, 3, device="meta"), torch.empty(4, 3, device="meta")
    assert cache.call(add_, (a, b), {}) is a and cache.hits == 0
    c, d = torch.empty(4, 3, device="meta"), torch.empty(4, 3, device="meta")
    assert cache.call(add_, (c, d), {}) is c and cache.hits == 1  # same metadata: not run again
    with pytest.raises(RuntimeError):  # a shape the kernel refuses is still refused (never cached)
        cache.call(add_, (a, torch.empty(5, 3, device="meta")), {})
    with pytest.raises(RuntimeError):
        cache.call(add_, (a, torch.empty(5, 3, device="meta")), {})
    # Ops that change metadata in place are never skipped.
    t = torch.empty(4, 3, device="meta")
    assert cache._classify(torch.ops.aten.transpose_.default) == 0
    assert cache._classify(torch.ops.aten.resize_.default) == 0
    cache.call(torch.ops.aten.transpose_.default, (t, 0, 1), {})
    assert t.shape == (3, 4)


@pytest.mark.parametrize("replica_tp,layer_tp,pp", [
    ([8] * 63 + [7], [8] * 34, 2),  # the 1,022-rank layout
    ([4, 3, 2, 1], [4, 2, 1, 4, 3, 2], 1),  # per-layer degrees, replicas of every size
    ([6, 5, 4], [6, 3, 2, 6, 1, 4, 6, 5], 2),
])
def test_tp_groups_are_every_ranks_group_of_every_slot(replica_tp, layer_tp, pp):
    """`Topology.tp_group_tuples` (enumerated per stage and degree) against each rank's group of each
    layout slot, as `layer_group_ranks` gives it."""
    topo = Topology(max(replica_tp), replica_tp, layer_tp, pp=pp)
    every = {topo.layer_group_ranks(r, slot) for r in range(topo.world_size) for slot in range(len(layer_tp))}
    assert topo.tp_group_tuples() == sorted(g for g in every if len(g) > 1)
