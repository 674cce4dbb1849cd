"""The dry run of a block-sharded layout (`ntp.pattern=block`, a 2x2 grid): it counts the grids' row and
column groups among the communicator splits the assembly makes, and its short builds (2 and 3 layers per
stage, extended) give every rank the figures of the whole stage."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ntp_nemo.runtime.dry_run import StepShape, dry_run
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import run_cli
from tests.shapes import small_llama


def test_block_layout_dry_run_counts_its_grid_and_scales_its_layers():
    cfg = small_llama(6)
    layout = ResolvedLayout.make(Topology(4, [4], [4] * 8), num_microbatches=2, pattern="block")
    shape = StepShape(seq_len=32, micro_batch_size=2, compute_dtype=torch.bfloat16)
    said: list[str] = []
    fast = dry_run(layout, cfg, shape, progress=said.append)
    reference = dry_run(layout, cfg, shape, scale_layers=False)
    assert fast.splits["grid"] == 4  # two rows and two columns, none of them a TP group
    assert all(m.endswith("(on 2 and 3 layers per stage)") for m in said if m.startswith("step shape"))
    assert [dataclasses.asdict(r) for r in fast.ranks] == [dataclasses.asdict(r) for r in reference.ranks]
    # every rank holds a quarter of every weight: the same parameter count within the uneven blocks
    params = [r.params for r in fast.ranks]
    assert max(params) - min(params) < 0.05 * max(params)


@pytest.mark.slow
def test_ntp_plan_recommendation_for_llama3_8b_at_tp16_dry_runs_on_16_ranks(tmp_path):
    """`ntp-plan model=llama3_8b hardware=h100 mesh.tp=16 --patterns` recommends a pattern per layout slot
    and says why (modelled times per layer and for the head); that recommendation, given to
    `ntp-train trainer.dry_run=true` as it is, runs on 16 ranks (a 4x4 grid) with the fake process group."""
    plan = run_cli(["model=llama3_8b", "hardware=h100", "mesh.tp=16", "--patterns", "format=json"],
                   cwd=tmp_path, timeout=120, module="ntp_nemo.cli.plan")
    assert plan.returncode == 0, plan.stderr[-3000:]
    recommended = json.loads(plan.stdout)["recommended_pattern"]
    assert len(recommended) == 34 and set(recommended) <= {"block", "row_column"}
    table = run_cli(["model=llama3_8b", "hardware=h100", "mesh.tp=16", "--patterns"], cwd=tmp_path,
                    timeout=120, module="ntp_nemo.cli.plan")
    assert "recommended: ntp.pattern=" in table.stdout and "on the grid against" in table.stdout
    run = tmp_path / "dry"
    res = run_cli(["recipe=llama3_8b", "trainer.dry_run=true", "mesh.dp=1", "mesh.pp=1", "mesh.tp=16",
                   "ntp.replica_tp=null", "data.micro_batch_size=4", "ntp.sequence_parallel=false",
                   f"ntp.pattern=[{','.join(recommended)}]", f"hydra.run.dir={run}"],
                  cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads((run / "dry_run.json").read_text())
    assert report["world_size"] == len(report["ranks"]) == 16
    assert {r["tp_degree"] for r in report["ranks"]} == {16}
    if "block" in recommended:  # four grid rows and four columns, every rank in one of each
        assert "grid rows and columns 8" in res.stdout
        # no what-if of the options a block layout refuses (sequence parallelism, distributed optimizer)
        assert set(report["options"]) == {"recompute"}, report["options"]
    if recommended == ["block"] * 34:  # (what the model says at TP 16: docs/sharding_patterns.md)
        # every weight element held once over the grid: the ranks' parameters add up to the model's, plus
        # the norms' copies (split along the 4 grid columns, so held by each of the 4 grid rows)
        hidden, layers = 4096, 32
        norms = (2 * layers + 1) * hidden
        assert sum(r["params"] for r in report["ranks"]) == report["model_params"] + 3 * norms
