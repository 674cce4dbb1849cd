"""Pipeline x TP x DP layouts reproduce the unsharded model's loss and every gradient (float64, gloo).

Each case runs the real runtime path: `runtime.assemble` (stage-aware model slice, fragment holder-set sync,
which also ties the first and last stage's embedding), the GPipe/1F1B schedule on point-to-point
ops with a different micro-batch count per replica, then the gradient sync.
"""

from __future__ import annotations

import dataclasses

import pytest

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.pipeline.memory import estimate_memory
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import (
    GLOBAL_BATCH,
    GPT,
    LLAMA,
    assembled,
    reference,
    step_against_reference,
    tokens,
)

GPT4 = dataclasses.replace(GPT, num_layers=4)
LLAMA4 = dataclasses.replace(LLAMA, num_layers=4)

# name: (tp, replica_tp, pp, stage_layers, schedule, layer_tp or None); worlds <= 8 ranks.
LAYOUTS = {
    "pp2-dp2-tp2-1f1b": (2, [2, 2], 2, [2, 2], "1f1b", None),
    "pp2-replicas-2-1-gpipe": (2, [2, 1], 2, [1, 3], "gpipe", None),
    "pp2-replicas-3-1-uneven-1f1b": (3, [3, 1], 2, [3, 1], "1f1b", None),
    "pp3-tp2-uneven-1f1b": (2, [2], 3, [1, 2, 1], "1f1b", None),
    "pp3-replicas-1-1-gpipe": (1, [1, 1], 3, [2, 1, 1], "gpipe", None),
    "pp2-per-layer-degrees": (2, [2, 2], 2, [2, 2], "1f1b", [2, 1, 2, 2, 1, 2]),
}


def pipeline_worker(rank: int, world: int, cfg, tp, replica_tp, pp, stage_layers, schedule, layer_tp) -> dict:
    layer_tp = layer_tp or [tp] * (cfg.num_layers + 2)
    topo = Topology(tp, replica_tp, layer_tp, pp=pp, stage_layers=stage_layers)
    rt, model = assembled(ResolvedLayout.make(topo, schedule), rank, cfg)
    mine, errors = step_against_reference(rt, model, cfg)
    est = estimate_memory(model, stage=rt.coord.stage, pp=pp, schedule=schedule, microbatches=len(mine),
                          micro_batch_size=1, seq_len=tokens(cfg).shape[1] - 1)
    return {**errors, "act_estimate": est.activations, "act_peak": rt.pipeline.meter.peak,
            "params": sorted(n for n, _ in model.named_parameters()), "microbatches": len(mine)}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT4, LLAMA4], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_matches_unsharded(cfg, layout):
    tp, replica_tp, pp, stage_layers, schedule, layer_tp = LAYOUTS[layout]
    world = pp * sum(replica_tp)
    results = run_workers(pipeline_worker, world, cfg, tp, replica_tp, pp, stage_layers, schedule, layer_tp)
    for rank, res in enumerate(results):
        for key in ("loss", "grad"):
            assert res[key] < 1e-10, f"{layout} rank {rank}: {key} rel error {res[key]:.2e}"
    # The start-of-run activation estimate matches the saved-tensor peak the schedule produced.
    for rank, res in enumerate(results):
        assert abs(res["act_estimate"] - res["act_peak"]) <= 0.02 * res["act_peak"], (rank, res)
    # Every logical parameter is held by some stage, and only the tied embedding by two stages.
    held = [n for res in results for n in res["params"]]
    reference_names = set(reference(cfg)[1])
    assert set(held) == reference_names
    topo = Topology(tp, replica_tp, [1] * (cfg.num_layers + 2), pp=pp, stage_layers=stage_layers)
    first = {n for r, res in enumerate(results) if topo.coord(r).stage == 0 for n in res["params"]}
    last = {n for r, res in enumerate(results) if topo.coord(r).stage == pp - 1 for n in res["params"]}
    assert first & last == ({"embed.weight"} if cfg.tie_embeddings else set())
    # Degraded replicas ran fewer micro-batches in the same step.
    counts = {topo.coord(r).replica: res["microbatches"] for r, res in enumerate(results)}
    assert sum(counts.values()) == GLOBAL_BATCH
