"""A block-sharded replica's live failover and repair through the real CLI (`ntp.pattern=block`).

Two replicas on 2x2 grids; rank 5 (replica 1, grid row 0, column 1) is killed at step 2.  Replica 1
goes on as a row/column replica at TP 3 (3 is no square) from its peers' memory, the repaired process
rejoins `fault.repair_after_steps=1` step later and the replica goes back to its grid.  No checkpoint
is ever written, so only the live reshards can keep every step on the failure-free curve.  12 steps: the
launcher announces the rejoin 3 steps ahead of the furthest survivor once a step has passed since the
loss, and skips it where that lands beyond the last step (a margin for a loaded machine).

The repaired process joins a job whose survivors are mid-run: nothing in its start-up may run a
collective over the world that they do not run (the integrity watch's first fingerprint check did,
and the repaired process waited in it until the 120 s heartbeat bound killed it; the survivors then
went on as (4,3)).  The integrity watch is on here (its defaults), so that check is covered.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, read_metrics, run_cli

BLOCK_FAILOVER = [*TINY, "mesh.dp=2", "mesh.tp=4", "ntp.replica_tp=[4,4]", "ntp.pattern=block",
                  "trainer.max_steps=12", "checkpoint.every_n_steps=0", "checkpoint.save_on_end=false",
                  "fault=kill_rank", "fault.rank=5", "fault.step=2", "fault.recovery=live",
                  "fault.repair_after_steps=1"]


@pytest.mark.slow
def test_grid_fails_over_to_tp3_and_returns_to_its_grid_on_the_curve(tmp_path, reference_losses):
    run = tmp_path / "run"
    proc = run_cli([*BLOCK_FAILOVER, f"hydra.run.dir={run}"], cwd=tmp_path, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "layout (4,4) -> (4,3)" in out and "rejoined: layout (4,3) -> (4,4)" in out, out[-4000:]
    assert "hung" not in out and "re-form without" not in out, out[-4000:]
    assert "divergence" not in out, out[-4000:]  # the grids' fingerprints agree with row/column's
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines() if line.strip()]
    done = [e for e in events if e.get("event") == "recovery_done"]
    assert [(e["layout"], bool(e.get("rejoin"))) for e in done] == [("(4,3)", False), ("(4,4)", True)], done
    got = {m["step"]: m["loss"] for m in read_metrics(run)}
    want = reference_losses("single-12")
    assert sorted(got) == list(range(1, 13))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
