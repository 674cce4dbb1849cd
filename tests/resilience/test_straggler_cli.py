"""A rank slowed to half speed in a 2x2 job (`fault=slow fault.factor=0.5`) is named while the job runs, its
replica gets a smaller share of the batch, the split goes back when the device recovers, and the loss
curve stays the failure-free one (one `ntp-train` launch)."""

from __future__ import annotations

import json

import pytest

from ntp_nemo.goodput import compute_goodput, load_events
from tests.conftest import TINY, read_metrics, run_cli


@pytest.mark.slow
def test_half_speed_rank_is_found_rebalanced_and_restored(tmp_path, reference_losses):
    run = tmp_path / "run"
    proc = run_cli([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=20",
                    "fault=slow", "fault.rank=1", "fault.step=3", "fault.factor=0.5", "fault.steps=8",
                    "fault.straggler_every=2", "fault.straggler_persist=3", "fault.straggler_margin=0.5",
                    f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    named = [e for e in events if e["event"] == "straggler"]
    assert named and {e["rank"] for e in named} == {1}, named
    assert named[0]["step"] <= 3 + 20 and named[0]["speed"] < 0.67 and named[0]["host"]
    assert "straggler | rank 1 on " in proc.stdout
    assert any(e["event"] == "straggler_recovered" and e["rank"] == 1 for e in events)
    rebalances = [e for e in events if e["event"] == "rebalance"]
    assert rebalances[0]["speeds"][0] < 1 and rebalances[0]["microbatches"][0] < 3  # rank 1's replica
    assert rebalances[-1]["speeds"] is None and rebalances[-1]["microbatches"] == [3, 3]  # put back
    metrics = read_metrics(run)
    splits = {m["step"]: m["microbatches"] for m in metrics}
    assert splits[1] == splits[20] == [3, 3]
    assert any(split[0] < 3 and sum(split) == 6 for split in splits.values())  # the global batch kept
    waits = sum(e["seconds"] for e in events if e["event"] == "straggler_wait")
    report = compute_goodput(load_events(run / "goodput.jsonl"))
    # Its own badput category, charged from the waits: each instant once, so where a wait shares instants
    # with a category above it (data loading, a checkpoint save) that one takes them (0.0890 s charged of
    # 0.0910 s waited in one full suite run; equal in the others). Timestamps of about 1.8e9 s resolve to
    # 2.4e-7 s in float64: the bound holds within a microsecond.
    charged = report.badput_s["stragglers"]
    assert waits > 0 and 0.5 * waits < charged <= waits + 1e-6, (charged, waits)
    reference = reference_losses("single-20")
    assert {m["step"]: pytest.approx(m["loss"], rel=1e-5) for m in metrics} == reference


@pytest.mark.slow
def test_an_excluded_straggler_leaves_and_its_replica_goes_on_at_a_reduced_degree(tmp_path, reference_losses):
    """`fault.straggler=exclude`: rank 1 at 0.15 of its speed (below the floor, 0.2, where rebalance
    excludes too) is named, leaves the job as a lost rank does, and the survivors re-plan live: replica 0
    goes on at TP 1, the global batch kept, on the failure-free loss curve (the live failover tests' bar)."""
    run = tmp_path / "run"
    proc = run_cli([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=20",
                    "fault=slow", "fault.rank=1", "fault.step=3", "fault.factor=0.15",
                    "fault.straggler=exclude", "fault.straggler_every=2", "fault.straggler_persist=2",
                    "fault.straggler_margin=0.5",
                    "fault.recovery=live", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "straggler | rank 1 leaves the job (policy exclude" in proc.stdout
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    named = [e for e in events if e["event"] == "straggler"]
    assert [e["rank"] for e in named] == [1] and named[0]["speed"] < 0.3 and named[0]["step"] <= 3 + 8
    assert any(e["event"] == "failure_detected" for e in events)
    assert any(e["event"] == "recovery_done" and e.get("mode") == "live" for e in events)
    metrics = read_metrics(run)
    last = {m["step"]: m for m in metrics}  # the last execution of every step
    assert sorted(last) == list(range(1, 21))
    assert last[1]["layout"] == "(2,2)" and last[20]["layout"] == "(1,2)"
    assert {m["tokens"] for m in metrics} == {last[1]["tokens"]}  # the global batch kept
    reference = reference_losses("single-20")
    for step, ref in reference.items():
        assert abs(last[step]["loss"] - ref) <= 1e-4 * abs(ref), (step, last[step]["loss"], ref)
