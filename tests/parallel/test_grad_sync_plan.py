"""The fragment holder-set plan is a pure function of the ranks' shard descriptors."""

from __future__ import annotations

from ntp_nemo.parallel.grad_sync import build_sync_plan


def desc(lo, hi, copies=1, units=6):
    return {"w": ((units, 4), 0, 1, lo, hi, copies), "norm": ((4,), 0, 4, 0, 1, copies if copies > 1 else 2)}


def test_uniform_dp_is_one_group_per_tp_slot_plus_replicated():
    # two replicas of TP 2: rank r of replica 0 pairs with rank r of replica 1
    everyone = [desc(0, 3), desc(3, 6), desc(0, 3), desc(3, 6)]
    plan = build_sync_plan(0, everyone, replica_of=[0, 0, 1, 1])
    assert plan.all_holder_sets == [(0, 1, 2, 3), (0, 2), (1, 3)]
    assert [f.name for f in plan.by_holders[(0, 2)]] == ["w"]
    assert plan.by_holders[(0, 1, 2, 3)][0].weight == 0.5  # two identical copies per replica


def test_unequal_replicas_split_into_fragments():
    # replica 0: TP 2 holds [0,3) and [3,6); replica 1: TP 1 holds [0,6)
    everyone = [desc(0, 3), desc(3, 6), {"w": ((6, 4), 0, 1, 0, 6, 1), "norm": ((4,), 0, 4, 0, 1, 1)}]
    plan = build_sync_plan(2, everyone, replica_of=[0, 0, 1])
    w_sets = {h: [f for f in fs if f.name == "w"] for h, fs in plan.by_holders.items()}
    assert {h for h, fs in w_sets.items() if fs} == {(0, 2), (1, 2)}
    lengths = sorted(f.length for fs in w_sets.values() for f in fs)
    assert lengths == [3, 3]


def test_identical_copies_inside_one_replica_are_not_communicated():
    everyone = [desc(0, 3), desc(3, 6)]
    plan = build_sync_plan(0, everyone, replica_of=[0, 0])
    assert plan.all_holder_sets == []
    norm = [f for f in plan.local_only if f.name == "norm"]
    assert norm[0].weight == 1.0 and norm[0].norm_weight == 0.5


def test_partial_copies_inside_one_replica_are_summed():
    # a shared KV head: both ranks hold unit [0,1) with *partial* gradients (copies=1)
    everyone = [{"k": ((2, 4), 0, 1, 0, 1, 1)}, {"k": ((2, 4), 0, 1, 0, 2, 1)}]
    plan = build_sync_plan(0, everyone, replica_of=[0, 0])
    assert plan.all_holder_sets == [(0, 1)]
    assert plan.by_holders[(0, 1)][0].weight == 1.0
