"""A re-planned or rejoined layout whose TP group spans nodes is said in one line naming the group, its
nodes and the policy's choice (kept); a layout whose groups stay inside nodes says nothing.  Node names
are mocked; the exchange of the names in a real rejoin is tests/resilience/test_generation_leaks.py's."""

from __future__ import annotations

from ntp_nemo.launch.node_layout import node_name
from ntp_nemo.resilience.policies import make_policy
from ntp_nemo.resilience.recovery import Generation, tp_across_nodes
from ntp_nemo.topology import ResolvedLayout, Topology

TP2x2 = ResolvedLayout.make(Topology(2, [2, 2], [2] * 4))  # TP groups: ranks [0, 1] and [2, 3]


def test_groups_inside_nodes_say_nothing():
    assert tp_across_nodes(TP2x2, ["a", "a", "b", "b"], rejoin=True) is None
    assert tp_across_nodes(TP2x2, ["a", "a", "a", "a"], rejoin=False) is None


def test_a_replacement_on_another_node_is_named_with_its_group_and_the_choice():
    # process 1 (node a) was lost; its replacement runs on node c and takes its place at the rejoin
    line = tp_across_nodes(TP2x2, ["a", "c", "b", "b"], rejoin=True)
    assert line is not None and "\n" not in line
    assert "TP group of ranks [0, 1] (replica 0, stage 0) spans nodes a (ranks [0]), c (ranks [1])" in line
    assert "kept (a rejoin puts every process back in its place)" in line
    assert "srun --nodelist" in line


def test_two_groups_across_nodes_are_counted():
    line = tp_across_nodes(TP2x2, ["a", "c", "b", "d"], rejoin=True)
    assert "(and 1 more TP group(s))" in line


def test_a_shrink_keeps_groups_inside_their_nodes_and_names_one_that_is_not():
    # TP 4 x DP 2, one replica per node: losing rank 5 re-plans replica 1 over its 3 survivors, all on b
    layout = ResolvedLayout.make(Topology(4, [4, 4], [4] * 4))
    gen, _ = Generation.first(layout).next([5], make_policy("ntp"))
    assert gen.layout.describe() == "(4,3)"
    by_pid = ["a"] * 4 + ["b"] * 4
    assert tp_across_nodes(gen.layout, [by_pid[p] for p in gen.members], rejoin=False) is None
    # the same re-plan from nodes of two processes (a placement only ntp.allow_cross_node_tp admits)
    by_pid = ["a", "a", "b", "b", "c", "c", "d", "d"]
    line = tp_across_nodes(gen.layout, [by_pid[p] for p in gen.members], rejoin=False)
    assert "TP group of ranks [0, 1, 2, 3] (replica 0, stage 0) spans nodes a (ranks [0, 1]), b (ranks " \
           "[2, 3]) (and 1 more TP group(s))" in line
    assert "kept (the failover policy re-plans over the survivors where they run)" in line


def test_node_name_is_slurms_then_the_host_name():
    assert node_name({"SLURMD_NODENAME": "gpu-node-7"}) == "gpu-node-7"
    import socket

    assert node_name({}) == socket.gethostname()
