"""Pipeline building blocks without processes: schedules, partition, topology stages, validation, memory."""

from __future__ import annotations

import itertools
import random

import pytest
from omegaconf import OmegaConf

from ntp_nemo.config.pipeline_keys import validate_pipeline
from ntp_nemo.config.resolve_layout import resolve_stage_layers
from ntp_nemo.errors import ConfigError
from ntp_nemo.pipeline.memory import in_flight
from ntp_nemo.pipeline.p2p import link_pairs
from ntp_nemo.pipeline.partition import balanced_partition
from ntp_nemo.pipeline.schedule import BACKWARD, FORWARD, analytical_bubble, schedule_order, simulate
from ntp_nemo.topology import Topology

CASES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]


# ---- schedules --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", CASES)
def test_schedule_runs_each_microbatch_once_in_order(name, pp, m):
    for stage in range(pp):
        order = schedule_order(name, stage, pp, m)
        fwd = [a.microbatch for a in order if a.kind == FORWARD]
        bwd = [a.microbatch for a in order if a.kind == BACKWARD]
        assert fwd == list(range(m)) and bwd == list(range(m))  # FIFO matching across a stage boundary
        position = {(a.kind, a.microbatch): k for k, a in enumerate(order)}
        assert all(position[(FORWARD, i)] < position[(BACKWARD, i)] for i in range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", CASES)
def test_simulated_bubble_is_the_analytical_one(name, pp, m):
    for t_fwd, t_bwd in ((1.0, 2.0), (1.0, 1.0)):
        sim = simulate(name, pp, m, t_fwd, t_bwd)
        assert sim.makespan == pytest.approx((m + pp - 1) * (t_fwd + t_bwd))
        assert sim.bubble == pytest.approx(analytical_bubble(pp, m))


@pytest.mark.parametrize("pp,m", CASES)
def test_activation_memory_gpipe_holds_all_1f1b_holds_depth(pp, m):
    assert simulate("gpipe", pp, m).peak_in_flight == [m] * pp
    assert simulate("1f1b", pp, m).peak_in_flight == [min(m, pp - s) for s in range(pp)]
    assert in_flight("1f1b", 0, pp, m) == min(m, pp)
    assert in_flight("gpipe", 0, 1, m) == 1 and in_flight("1f1b", 0, pp, 0) == 0


def test_one_f_one_b_shape():
    order = "".join(f"{a.kind}{a.microbatch}" for a in schedule_order("1f1b", 0, 3, 4))
    assert order == "F0F1F2B0F3B1B2B3"
    order = "".join(f"{a.kind}{a.microbatch}" for a in schedule_order("1f1b", 2, 3, 4))
    assert order == "F0B0F1B1F2B2F3B3"
    with pytest.raises(ValueError):
        schedule_order("interleaved", 0, 2, 4)


# ---- partition --------------------------------------------------------------------------------
def _brute_force(costs, pp):
    layers = costs[1:-1]
    best = None
    for cuts in itertools.combinations(range(1, len(layers)), pp - 1):
        bounds = (0, *cuts, len(layers))
        stage = [sum(layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
        stage[0] += costs[0]
        stage[-1] += costs[-1]
        best = max(stage) if best is None else min(best, max(stage))
    return best


def _bottleneck(costs, split):
    out, start = [], 0
    for s, n in enumerate(split):
        c = sum(costs[1 + start : 1 + start + n])
        c += (costs[0] if s == 0 else 0) + (costs[-1] if s == len(split) - 1 else 0)
        out.append(c)
        start += n
    return max(out)


def test_balanced_partition_is_optimal_on_random_costs():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n)
        costs = [rng.uniform(0, 3) for _ in range(n + 2)]
        split = balanced_partition(costs, pp)
        assert len(split) == pp and sum(split) == n and min(split) >= 1
        assert _bottleneck(costs, split) == pytest.approx(_brute_force(costs, pp))


def test_partition_counts_embedding_and_head():
    assert balanced_partition([0, 1, 1, 1, 1, 0], 2) == [2, 2]
    assert balanced_partition([0, 1, 1, 1, 1, 2.5], 2) == [3, 1]  # a heavy head takes a stage's worth
    assert balanced_partition([2.5, 1, 1, 1, 1, 0], 2) == [1, 3]
    with pytest.raises(ValueError):
        balanced_partition([0, 1, 1, 0], 3)


def _cfg(**over):
    base = {"model": {"arch": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                      "num_kv_heads": None, "ffn_hidden_size": 128, "tie_embeddings": True},
            "mesh": {"dp": 1, "tp": 1, "pp": 2}, "ntp": {"replica_tp": None},
            "layout": {"layer_tp": None, "stage_layers": None, "schedule": "1f1b"},
            "data": {"seq_len": 32, "micro_batch_size": 2}, "trainer": {"precision": "32-true"}}
    cfg = OmegaConf.create(base)
    for key, value in over.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_resolve_stage_layers_explicit_or_balanced():
    assert resolve_stage_layers(_cfg(**{"layout.stage_layers": [1, 3]})) == [1, 3]
    assert resolve_stage_layers(_cfg(**{"mesh.pp": 1})) == [4]
    assert resolve_stage_layers(_cfg(), layer_tp=[1] * 6) == [2, 2]
    # A vocabulary much larger than the layers moves layers off the last stage.
    big_vocab = _cfg(**{"model.vocab_size": 200_000, "mesh.pp": 2})
    split = resolve_stage_layers(big_vocab, layer_tp=[1] * 6)
    assert split[0] > split[1]


# ---- topology stages --------------------------------------------------------------------------
def test_topology_stage_ranges_and_peers():
    topo = Topology(2, [2, 1], [2] * 6, pp=2, stage_layers=[1, 3])
    assert [list(topo.stage_layer_range(s)) for s in range(2)] == [[0], [1, 2, 3]]
    assert topo.world_size == 6
    assert [topo.pipeline_peer(r, +1) for r in range(6)] == [2, 3, None, None, 5, None]
    assert [topo.pipeline_peer(r, -1) for r in range(6)] == [None, None, 0, 1, None, 4]
    assert link_pairs(topo) == [(0, 2), (1, 3), (4, 5)]
    assert Topology(1, [1], [1] * 7, pp=3).stage_layers == [1, 2, 2]
    assert Topology(1, [1], [1] * 6).stage_layers == [4]
    with pytest.raises(ValueError):
        Topology(1, [1], [1] * 6, pp=2, stage_layers=[1, 2])


# ---- validation -------------------------------------------------------------------------------
INVALID = [
    ({"mesh.pp": 5}, "mesh.pp"),
    ({"layout.schedule": "interleaved"}, "layout.schedule"),
    ({"layout.stage_layers": [1, 1, 2]}, "layout.stage_layers"),
    ({"layout.stage_layers": [1, 2]}, "layout.stage_layers"),
    ({"layout.stage_layers": [0, 4]}, "layout.stage_layers"),
    ({"layout.stage_layers": ["a", 4]}, "layout.stage_layers"),
    ({"layout.stage_layers": [2, 2], "mesh.pp": 1}, "layout.stage_layers"),
    ({"trainer.precision": "16-mixed"}, "trainer.precision"),
]


@pytest.mark.parametrize("over,key", INVALID, ids=[k + ":" + str(o) for o, k in INVALID])
def test_invalid_pipeline_layouts_name_the_key(over, key):
    with pytest.raises(ConfigError) as err:
        validate_pipeline(_cfg(**over))
    assert err.value.key == key
    assert key in str(err.value)


VALID = [{}, {"layout.stage_layers": [3, 1]}, {"mesh.pp": 4, "layout.schedule": "gpipe"},
         {"mesh.pp": 1, "trainer.precision": "16-mixed"}, {"mesh.pp": 1}]


@pytest.mark.parametrize("over", VALID)
def test_valid_pipeline_layouts_pass(over):
    validate_pipeline(_cfg(**over))
