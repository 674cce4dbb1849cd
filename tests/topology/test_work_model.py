"""The per-rank work model: a reduced replica's capacity follows its slowest rank (counted here by hand),
NTP-PW multiplies it, the batch split and a serialised layout carry it, and the planner's cost model
sees the same head split."""

from __future__ import annotations

import pytest

from ntp_nemo.data.rebalance import assign_microbatches
from ntp_nemo.planner.cost import LAYER, attention_fractions, item_cost
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.work import FLOPS_PER_LINK_BYTE, WorkShape, modelled_capacities, rank_costs

H, L, NH, NKV, F, V, S = 4096, 32, 32, 8, 14336, 128256, 8192
LLAMA3_8B = WorkShape(H, L, NH, NKV, F, V, S)


def _by_hand(nq: int, nkv: int, ffn: int, vocab: int, degree: int) -> float:
    """Per-token FLOP-equivalents of a rank: 6 x matmul parameters, 12 x s x d per query head for the
    scores, ring all-reduce bytes (4 per layer, the head's input gradient, 3 fp32 statistics) x the
    device's FLOPs per link byte."""
    d = H // NH
    matmul = 6 * (L * (H * d * (2 * nq + 2 * nkv) + 3 * H * ffn) + H * vocab)
    scores = L * 12 * nq * d * S
    ring = 2 * (degree - 1) / degree
    comm = ring * ((4 * L + 2) * H * 2 + 12)  # 4 per layer, the embedding's output, the head's input grad
    return matmul + scores + comm * FLOPS_PER_LINK_BYTE


def test_reduced_replica_capacity_follows_its_slowest_rank():
    topo = Topology(8, [8, 7], [8] * (L + 2))
    costs = rank_costs(LLAMA3_8B, topo)
    healthy = _by_hand(4, 1, F // 8, V // 8, 8)
    # Rank 6 of the TP-7 replica: query heads [27, 32) read KV heads 6 and 7, FFN columns and vocabulary
    # rows of the last interval (2048 and 18,323).
    slowest = _by_hand(5, 2, F // 7, V - 6 * V // 7, 7)
    assert costs[0] == pytest.approx(healthy, rel=1e-12)
    assert max(costs[8:]) == pytest.approx(slowest, rel=1e-12) == costs[8 + 6]
    caps = modelled_capacities(LLAMA3_8B, topo)
    assert caps == pytest.approx([1.0, healthy / slowest], rel=1e-12)
    assert slowest / healthy <= 1.25
    # NTP-PW multiplies the modelled capacity of the degraded replica, capped at a healthy one's.
    assert modelled_capacities(LLAMA3_8B, topo, 1.05)[1] == pytest.approx(1.05 * healthy / slowest, rel=1e-12)
    assert modelled_capacities(LLAMA3_8B, topo, 1.3) == [1.0, 1.0]


def test_batch_split_and_serialised_layout_carry_the_work_model():
    layout = ResolvedLayout.make(Topology(8, [8, 7], [8] * (L + 2)), num_microbatches=512, work=LLAMA3_8B,
                                 capacity="work")
    cap = _by_hand(4, 1, F // 8, V // 8, 8) / _by_hand(5, 2, F // 7, V - 6 * V // 7, 7)
    assert list(layout.microbatches) == assign_microbatches(512, [1.0, cap]) == [275, 237]
    # The straggler (5 query heads) gives the TP-7 replica less than 7/8 (active ranks: [273, 239]).
    by_ranks = ResolvedLayout.make(Topology(8, [8, 7], [8] * (L + 2)), num_microbatches=512)
    assert list(by_ranks.microbatches) == [273, 239]
    # The rule is the layout's choice (ntp.capacity): the work shape alone keeps the rank-count rule.
    assert list(ResolvedLayout.make(Topology(8, [8, 7], [8] * (L + 2)), num_microbatches=512,
                                    work=LLAMA3_8B).microbatches) == [273, 239]
    again = ResolvedLayout.from_dict(layout.to_dict())
    assert again == layout and again.work == LLAMA3_8B and again.capacity == "work"
    shrunk = layout.with_changes(replica_tp=(8, 6))
    assert shrunk.work == LLAMA3_8B and shrunk.capacity == "work" and shrunk.microbatches[1] < 237


def test_planner_costs_the_balanced_head_split():
    model = ModelShape(vocab_size=V, hidden_size=H, num_layers=L, num_heads=NH, num_kv_heads=NKV,
                       ffn_hidden_size=F, gated_mlp=True)
    # 32 query heads over 7 ranks: at most 5 (not whole KV groups: 8), reading at most 2 KV heads.
    assert attention_fractions(model, 7) == (5 / 32, 2 / 8)
    dev, links = DeviceModel(), LinkModel()
    flops = [item_cost(model, LAYER, t, S, 1, dev, links).flops for t in (7, 8)]
    ratio = flops[0] / flops[1]
    assert 8 / 7 <= ratio <= 1.25
