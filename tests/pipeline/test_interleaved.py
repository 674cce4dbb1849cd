"""Interleaved 1F1B: schedule properties, and exactness of a PP2 x v2 layout against the unsharded model.

The exactness case runs the real runtime path with the interleaved engine on replicas (2, 1) (TP 2 and
TP 1 stages, 4 and 2 micro-batches per replica), float64, then the fragment gradient sync.
"""

from __future__ import annotations

import dataclasses

import pytest

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.pipeline.interleaved import InterleavedPipelineEngine, chunk_layers, stage_layers
from ntp_nemo.pipeline.schedule import BACKWARD, FORWARD, analytical_bubble, schedule_order, simulate
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA, assembled, step_against_reference

GPT4 = dataclasses.replace(GPT, num_layers=4)
LLAMA4 = dataclasses.replace(LLAMA, num_layers=4)


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 2), (4, 3)])
def test_interleaved_schedule_runs_every_chunk_once_and_bubble_matches_formula(pp, v):
    for m in range(1, 3 * pp + 1):
        for stage in range(pp):
            order = schedule_order("interleaved_1f1b", stage, pp, m, v)
            want = {(k, mb, c) for k in (FORWARD, BACKWARD) for mb in range(m) for c in range(v)}
            assert {(a.kind, a.microbatch, a.chunk) for a in order} == want and len(order) == len(want)
        sim = simulate("interleaved_1f1b", pp, m, v=v)  # raises on a deadlock
        if m % pp == 0:
            # (p - 1) / (v m + p - 1) of the step, against 1F1B's (p - 1) / (m + p - 1).
            assert sim.bubble == pytest.approx(analytical_bubble(pp, m, v), abs=1e-9)
            assert sim.bubble < simulate("1f1b", pp, m).bubble


def test_chunks_split_the_layers():
    assert [chunk_layers(8, 2, 2, s) for s in range(2)] == [[range(0, 2), range(4, 6)],
                                                             [range(2, 4), range(6, 8)]]
    assert sorted(i for s in range(3) for i in stage_layers(7, 3, 2, s)) == list(range(7))


def interleaved_worker(rank: int, world: int, cfg, tp: int, replica_tp: list[int], pp: int, v: int) -> dict:
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2), pp=pp)
    rt, model = assembled(ResolvedLayout.make(topo, "interleaved_1f1b", virtual_stages=v), rank, cfg)
    assert isinstance(rt.pipeline, InterleavedPipelineEngine)
    _, errors = step_against_reference(rt, model, cfg)
    return {**errors, "params": sorted(n for n, _ in model.named_parameters())}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT4, LLAMA4], ids=["gpt", "llama"])
def test_interleaved_pp2_v2_replicas_2_1_matches_unsharded(cfg):
    results = run_workers(interleaved_worker, 6, cfg, 2, [2, 1], 2, 2)
    for rank, res in enumerate(results):
        for key in ("loss", "grad"):
            assert res[key] < 1e-10, (rank, key, res[key])
    # Stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (virtual stages 0..3).
    layers = {rank: sorted({n.split(".")[1] for n in res["params"] if n.startswith("blocks.")})
              for rank, res in enumerate(results)}
    assert layers[0] == ["0", "2"] and layers[2] == ["1", "3"]
