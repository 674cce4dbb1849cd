"""A fixed scenario of the fault campaign (bench/fault_campaign.py runs the seeded bulk): two faults on
top of each other, then every checkpoint of the run damaged, each checked against the campaign's
invariants (bounded time, documented exit codes, every step once on the failure-free curve, checkpoints
that verify and are never deleted, every failure followed by its recovery or its stop)."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCES, TINY

pytestmark = pytest.mark.slow


def _campaign(monkeypatch):
    from bench import fault_campaign

    return fault_campaign


def test_a_kill_then_a_kill_during_the_recovery_save_then_every_checkpoint_damaged(tmp_path, monkeypatch,
                                                                                  reference_losses):
    fc = _campaign(monkeypatch)
    steps = 6
    # The failure-free curve of the campaign's job: the session's one-process run of the same model, data,
    # optimizer, seed and length (conftest REFERENCES), which every layout follows to 1e-5 relative (the
    # campaign allows 1e-4); the campaign's `main` launches its own reference run instead.
    job = fc.base_job(steps, [])
    curve = [a for a in job if a.startswith(("model.", "data.", "optim.", "seed=", "trainer.max_steps="))]
    assert set(curve) <= set(TINY + REFERENCES["single-6-seed7"]), sorted(set(curve) - set(TINY))
    reference = reference_losses("single-6-seed7")
    scenario = fc.Scenario(
        0,
        0,
        [{"what": "kill(backward)", "rank": 3, "step": 2}, {"what": "save-kill", "rank": 0, "step": 3}],
        overrides=["++fault.more=[{kind:kill_rank,rank:3,step:2,phase:backward},"
                   "{kind:kill_during_save,rank:0,step:3}]"],
        damage_all=True,
    )
    held, row = fc.check(scenario, tmp_path, reference, steps, bound=600.0)
    assert held, row
    # The row names the exit codes: the faulty run recovered (0), the rerun on damaged checkpoints
    # stopped with exit 2 (bad input), and nothing was deleted (checked inside `check`).
    assert "| 0/2 |" in row, row
