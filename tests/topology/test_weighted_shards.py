"""Shards weighted by measured speed (`ResolvedLayout.shard_speeds`, issue 48's in-TP-group rebalance): the
weighted interval rule (`shard.shard_interval`), the layers and attention heads it gives, the layout and
work model that carry it, and the float64 exactness of weighted layouts against the unsharded model (the
bar of tests/parallel/test_ntp_exactness.py)."""

from __future__ import annotations

import pytest

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.transformer import attention_head_intervals
from ntp_nemo.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.shard import aligned_interval, aligned_sizes, shard_interval
from ntp_nemo.topology.tp_context import TPContext
from ntp_nemo.topology.work import WorkShape, rank_costs
from tests.ntp_cases import GPT, LLAMA_KV4, assembled, step_against_reference


@pytest.mark.parametrize("n,units,align,weights,sizes", [
    (2, 84, 1, (0.5, 1.0), [28, 56]),  # 84 * 1/3, 84 * 2/3
    (2, 84, 8, (0.5, 1.0), [24, 60]),  # 11 blocks: floor(11/3) = 3 blocks, then 8 (the last one short)
    (3, 70, 1, (1.0, 0.5, 1.0), [28, 14, 28]),
    (3, 67, 8, (1.0, 1.0, 0.25), [32, 32, 3]),  # 9 blocks: floor(9*4/9) = 4, floor(9*8/9) = 8
    (4, 8, 1, (0.05, 1.0, 1.0, 1.0), [1, 2, 2, 3]),  # at least one unit each: 0.39 of one rounds up to 1
    (2, 5, 1, (0.55, 1.0), [1, 4]),  # 5 * 0.55 / 1.55 = 1.77
])
def test_weighted_intervals_are_contiguous_aligned_and_proportional(n, units, align, weights, sizes):
    assert aligned_sizes(n, units, align, weights) == sizes
    bounds = [shard_interval(i, n, units, align, weights) for i in range(n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == units and sum(sizes) == units
    assert all(a[1] == b[0] and a[1] % align == 0 for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(s >= 1 for s in sizes)
    blocks = -(-units // align)
    for (lo, hi), w in zip(bounds, weights, strict=True):  # within one block of the exact proportion
        assert abs((hi - lo) / align - blocks * w / sum(weights)) <= 1 + 1e-9 or lo == hi - 1


@pytest.mark.parametrize("n,units,align", [(3, 84, 8), (2, 67, 8), (7, 14336, 128), (8, 128256, 128),
                                           (3, 5, 1), (4, 8, 1)])
def test_equal_or_no_weights_give_the_balanced_intervals(n, units, align):
    balanced = [aligned_interval(i, n, units, align) for i in range(n)]
    assert [shard_interval(i, n, units, align) for i in range(n)] == balanced
    for w in (1.0, 0.35):
        assert [shard_interval(i, n, units, align, (w,) * n) for i in range(n)] == balanced


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="2 positive weights"):
        shard_interval(0, 2, 10, 1, (1.0,))
    with pytest.raises(ValueError, match="positive"):
        shard_interval(0, 2, 10, 1, (0.0, 1.0))


def test_layers_and_heads_follow_the_weights():
    """GQA: 8 query heads over 4 KV groups, weights (0.5, 1, 1): 1, 3, 4 query heads; each rank keeps the
    KV heads its query heads read (rank 1's heads 1-3 read KV groups 0 and 1)."""
    w = (0.5, 1.0, 1.0)
    heads = [attention_head_intervals(8, 4, TPContext(size=3, rank=i, weights=w)) for i in range(3)]
    assert heads == [((0, 1), (0, 1)), ((1, 4), (0, 2)), ((4, 8), (2, 4))]
    for rank, (rows, vocab) in enumerate(zip([16, 32, 36], [8, 32, 27], strict=True)):
        tp = TPContext(size=3, rank=rank, align=8, weights=w)
        assert ColumnParallelLinear(40, 84, tp).weight.shape == (rows, 40)
        assert VocabParallelEmbedding(67, 40, tp).weight.shape == (vocab, 40)


def test_the_layout_carries_shard_speeds_into_contexts_and_the_work_model():
    topo = Topology(2, [2, 2], [2] * 4, shard_speeds=(0.5, 1.0, 1.0, 1.0))
    layout = ResolvedLayout.make(topo)
    assert layout.shard_speeds == (0.5, 1.0, 1.0, 1.0)
    assert ResolvedLayout.from_dict(layout.to_dict()) == layout
    assert layout.same_ranks(layout.with_changes(shard_speeds=None))
    assert not layout.same_shards(layout.with_changes(shard_speeds=None))
    topo = layout.topology()
    assert topo.group_weights(topo.layer_group_ranks(1, 1)) == (0.5, 1.0)  # a layer context's weights
    assert topo.group_weights(topo.layer_group_ranks(2, 1)) is None  # equal: balanced
    assert layout.topology().units_held(1, 1, 84, 1) == (28, 84)
    assert layout.shrunk([2, 1]).shard_speeds is None  # re-planned ranks start balanced
    shape = WorkShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                      vocab_size=256, seq_len=32, gated_mlp=False)
    costs = rank_costs(shape, layout.topology())
    assert costs[0] < costs[2] == costs[3] < costs[1]  # the slow rank's share shrank, its peer's grew
    with pytest.raises(ValueError, match="shard speeds"):
        ResolvedLayout.make(Topology(2, [2], [2] * 4, shard_speeds=(0.5, 1.5)))
    with pytest.raises(ValueError, match="block pattern"):
        ResolvedLayout.make(Topology(4, [4], [4] * 4, shard_speeds=(0.5, 1, 1, 1)), pattern="block")


def _weighted_worker(rank: int, world: int, cfg, replica_tp: list[int], shard_speeds: tuple,
                     shard_align: int = 1, sequence_parallel: bool = False) -> dict:
    topo = Topology(max(replica_tp), replica_tp, [max(replica_tp)] * 4, shard_align=shard_align,
                    shard_speeds=shard_speeds)
    rt, model = assembled(ResolvedLayout.make(topo, sequence_parallel=sequence_parallel), rank, cfg)
    return step_against_reference(rt, model, cfg)[1]


@pytest.mark.slow
@pytest.mark.parametrize("cfg,replica_tp,speeds,align,sp", [
    (LLAMA_KV4, [3], (1.0, 0.5, 0.75), 8, False),  # GQA heads 3/2/3 (KV shared), MLP and vocab in 8-blocks
    (GPT, [2, 2], (0.35, 1.0, 1.0, 1.0), 1, False),  # replica 0 weighted, replica 1 balanced: the syncs
    (GPT, [3], (0.5, 1.0, 0.75), 1, True),  # sequence parallel: the sequence slices stay balanced
], ids=["llama-gqa-tp3-aligned", "gpt-2x2-one-replica-weighted", "gpt-tp3-sequence-parallel"])
def test_weighted_shards_match_unsharded_float64(cfg, replica_tp, speeds, align, sp):
    results = run_workers(_weighted_worker, sum(replica_tp), cfg, replica_tp, speeds, align, sp)
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"rank {rank}: {key} rel error {err:.2e}"
