"""A one-replica job (`mesh.dp=1 mesh.tp=2`) whose rank 1 runs at half speed (`fault=slow fault.factor=0.5`):
the `rebalance` policy cannot move batch share to another replica, so it re-lays the TP group's shards out
live by measured speed (`fault.straggler_shards=auto`), puts them back when the device recovers, and the
loss curve stays the failure-free one (one `ntp-train` launch)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, read_metrics, run_cli


@pytest.mark.slow
def test_a_one_replica_jobs_shards_follow_the_slow_rank_and_come_back(tmp_path, reference_losses):
    run = tmp_path / "run"
    proc = run_cli([*TINY, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null", "trainer.max_steps=20",
                    "fault=slow", "fault.rank=1", "fault.step=3", "fault.factor=0.5", "fault.steps=8",
                    "fault.straggler_every=2", "fault.straggler_persist=3", "fault.straggler_margin=0.5",
                    f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events if e["event"] == "straggler"} == {1}
    rebalances = [e for e in events if e["event"] == "rebalance"]
    first, last = rebalances[0], rebalances[-1]
    assert first["shard_speeds"][0] == 1.0 and first["shard_speeds"][1] < 0.67 and first["moved_bytes"] > 0
    assert first["microbatches"] == last["microbatches"] == [6]  # one replica: the whole batch, kept
    assert last["shard_speeds"] is None and last["moved_bytes"] > 0  # balanced again
    assert "live re-layout from the ranks' memory" in proc.stdout
    losses = {m["step"]: pytest.approx(m["loss"], rel=1e-5) for m in read_metrics(run)}
    assert losses == reference_losses("single-20")
