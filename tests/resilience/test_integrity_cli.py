"""Silent corruption end to end (one `ntp-train -m` sweep of two jobs): a poisoned sample is attributed
to the data on both replicas, skipped, recorded and its step redone; a bit flipped in one replica's
weights is found by the replica fingerprint, named (replica, rank, parameter) and repaired by rolling back
to the last verified state, the curve after it equal to the failure-free one.  Both findings are a
console line, a row of `ntp-incidents`, an `integrity` goodput event and an entry of summary.json."""

from __future__ import annotations

import json
import sys

import pytest

from ntp_nemo.goodput import compute_goodput, load_events
from tests.conftest import TINY, read_metrics, sweep_cases

CASES = {
    "poison": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "fault=poison_sample", "fault.step=3"],
    # three replicas: a majority names the one that disagrees
    "bitflip": ["mesh.dp=3", "mesh.tp=2", "ntp.replica_tp=[2,1,1]", "fault=bitflip", "fault.rank=1",
                "fault.step=3"],  # bit 22: the top mantissa bit
    "bitflip_low": ["mesh.dp=3", "mesh.tp=2", "ntp.replica_tp=[2,1,1]", "fault=bitflip", "fault.rank=2",
                    "fault.step=3", "fault.bit=0"],  # the lowest mantissa bit, on the TP=1 replica 1
    # the top exponent bit of one gradient element of rank 2 at step 3: once, then on every step (a bad
    # device, excluded through the live path)
    "grad": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "fault=bitflip", "fault.target=grad",
             "fault.rank=2", "fault.step=3"],
    "device": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "fault=bitflip", "fault.target=grad",
               "fault.rank=2", "fault.step=3", "fault.persistent=true", "fault.recovery=live"],
    # the same flip once, and rank 1 lost as the watch starts attributing it (inside its replay)
    "interrupted": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "fault=bitflip", "fault.target=grad",
                    "fault.rank=2", "fault.step=3", "fault.recovery=live",
                    "fault.more=[{kind:kill_rank,rank:1,step:3,phase:integrity}]"],
    # an activation flip on rank 2 on every forward from step 7 (seed 2's element: some samples' loss is
    # not finite on replica 1 only), and the same seed without a fault
    "device_nonfinite": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "fault=bitflip",
                         "fault.target=activation", "fault.rank=2", "fault.step=7", "fault.persistent=true",
                         "fault.recovery=live", "seed=2"],
    "clean_seed2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "seed=2"],
    # a parameter flip on rank 1 at step 3, and rank 3 lost as the check of step 4 starts its repair
    "repair_interrupted": ["mesh.dp=3", "mesh.tp=2", "ntp.replica_tp=[2,1,1]", "fault=bitflip",
                           "fault.rank=1", "fault.step=3", "fault.recovery=live",
                           "fault.more=[{kind:kill_rank,rank:3,step:4,phase:integrity}]"],
}
COMMON = [*TINY, "trainer.max_steps=8", "integrity.every_n_steps=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    sweep = sweep_cases(CASES, COMMON, tmp_path_factory.mktemp("integrity"))
    assert sweep.proc.returncode == 0, sweep.proc.stdout[-2000:] + sweep.proc.stderr[-3000:]
    return sweep


def _findings(run):
    return [json.loads(line) for line in (run / "integrity" / "incidents.jsonl").read_text().splitlines()]


def _incidents(run, capsys, monkeypatch):
    from ntp_nemo.cli.incidents import main

    monkeypatch.setattr(sys, "argv", ["ntp-incidents", str(run)])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_poisoned_sample_skipped_and_recorded(runs, reference_losses, capsys, monkeypatch):
    run = runs.run_dir("poison")
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (3, "nonfinite", "data")
    assert "replica(s) 0, 1" in finding["action"]  # seen on its own replica and on the other
    sample = finding["sample"]
    assert json.loads((run / "integrity" / "skipped_samples.json").read_text()) == {"samples": [sample]}
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = reference_losses("single-8")
    assert [losses[s] for s in (1, 2)] == pytest.approx([ref[1], ref[2]], rel=1e-5)  # before: the same
    assert all(v == v for v in losses.values()) and sorted(losses) == list(range(1, 9))  # no NaN, no gap
    assert abs(losses[3] - ref[3]) > 1e-4 * ref[3]  # step 3 ran without the sample
    log = (run / "train.log").read_text()
    assert f"integrity: step 3: nonfinite (sample {sample}): data" in log
    assert json.loads((run / "summary.json").read_text())["integrity"]["skipped_samples"] == [sample]
    out = _incidents(run, capsys, monkeypatch)
    assert f"sample {sample}" in out and "data" in out and str(sample) in out.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("case, rank, replica", [("bitflip", 1, 0), ("bitflip_low", 2, 1)])
def test_bitflip_named_and_repaired_from_a_good_replica(runs, reference_losses, case, rank, replica):
    """A high and a low mantissa bit flipped in one replica's weights at step 3: found by the check at step
    4, the rank and parameter named, its state taken from the good replicas' memory at the rollback to the
    verified step 0, and the curve from the repaired step on is the failure-free one."""
    run = runs.run_dir(case)
    log = (run / "train.log").read_text()
    fired = next(line for line in log.splitlines() if line.startswith("fault: bitflip"))
    parameter = fired.split(" in param ")[1].split("[")[0]
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (4, "divergence", "bitflip")
    assert (finding["replica"], finding["rank"], finding["parameter"]) == (replica, rank, parameter)
    moved = int(finding["action"].split("good replicas' memory (")[1].split(" bytes")[0])
    assert moved > 0 and f"rolled back to verified step 0 (rank(s) {rank} took their parameters and " \
        "optimizer state from the good replicas' memory" in finding["action"]
    assert finding["action"].endswith("replayed 4 step(s); replicas agree again")
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = reference_losses("single-8")
    for step in range(4, 9):  # from the repaired step on: the failure-free curve
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step


@pytest.mark.slow
def test_bitflip_said_everywhere(runs, capsys, monkeypatch):
    run = runs.run_dir("bitflip")
    (finding,) = _findings(run)
    parameter = finding["parameter"]
    report = compute_goodput(load_events(run))
    assert report.badput_s["integrity"] > 0  # the checks and the repair, a category of their own
    assert json.loads((run / "summary.json").read_text())["integrity"]["by_kind"] == {"divergence/bitflip": 1}
    out = _incidents(run, capsys, monkeypatch)
    assert f"replica 0, rank 1, {parameter}" in out and "bitflip" in out


@pytest.mark.slow
@pytest.mark.parametrize("case, verdict", [("grad", "transient"), ("device", "device")])
def test_gradient_flip_caught_before_the_update(runs, reference_losses, case, verdict):
    """A flipped exponent bit in one rank's gradient stands out of the other ranks' (the per-step check):
    the step applies no update and is replayed on the same ranks.  Once: transient, the replay is the
    step.  On every step: the rank's device is bad, it leaves and the survivors redo the step without it.
    Either way the curve is the failure-free one, the struck step included."""
    run = runs.run_dir(case)
    (finding,) = _findings(run)
    assert (finding["step"], finding["verdict"], finding["rank"], finding["replica"]) == (3, verdict, 2, 1)
    assert finding["kind"] in ("outlier", "nonfinite") and "no update applied" in finding["action"]
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = reference_losses("single-8")
    assert sorted(losses) == list(range(1, 9))
    for step in range(1, 9):
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step
    if case == "device":
        log = (run / "train.log").read_text()
        assert "layout (2,1) -> (2)" in log and "integrity: step 3 redone without rank 2" in log


@pytest.mark.slow
def test_a_rank_lost_during_an_attribution_is_recovered_live(runs, reference_losses):
    """Rank 1 dies as the watch starts attributing step 3 (its replay's collectives): the survivors
    recover live (the attribution runs under the live path's guard) holding the state before the step,
    which applied no update; the step is redone on the new layout and the finding says it was interrupted,
    not classified.  Every step lands on the failure-free curve."""
    run = runs.run_dir("interrupted")
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (3, "outlier", "interrupted")
    assert finding["action"].endswith("the step was redone on layout (1,1): clean, kept")
    log = (run / "train.log").read_text()
    assert "failover | live: policy ntp: layout (2,1) -> (1,1)" in log  # live, not the restart path
    assert "attempt 1" not in log
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = reference_losses("single-8")
    assert sorted(losses) == list(range(1, 9))
    for step in range(1, 9):
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step


@pytest.mark.slow
def test_a_rank_lost_during_a_divergence_repair_leaves_no_half_applied_repair(runs):
    """Rank 3 dies as the check of step 4 starts the rollback and repair of rank 1's flipped weight: every
    survivor goes back to the state after step 4 (none keeps a half-applied rollback), the live path
    re-forms (2,1), and the process the fingerprint named takes its state from the others' memory on the
    new layout; the replicas agree again there and at step 8 (no further finding)."""
    run = runs.run_dir("repair_interrupted")
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (4, "divergence", "interrupted")
    assert "rank(s) 1 (the process(es) named) took their parameters" in finding["action"]
    log = (run / "train.log").read_text()
    assert "failover | live: policy ntp: layout (2,1,1) -> (2,1)" in log and "attempt 1" not in log
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert sorted(losses) == list(range(1, 9)) and all(v == v for v in losses.values())


@pytest.mark.slow
def test_a_sample_not_finite_on_one_replica_only_names_the_device(runs):
    """Seed 2's persistent activation flip makes some samples' loss not finite on rank 2's replica only:
    not the data's, so the step is replayed and the cross replay names rank 2 (the other replica computes
    its micro-batches finite); it is excluded and the survivors redo step 7 without it.  The curve is the
    failure-free run of the same seed."""
    run = runs.run_dir("device_nonfinite")
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (7, "nonfinite", "device")
    assert finding["rank"] == 2 and "not reproduced" in finding["action"]
    assert "integrity: step 7 redone without rank 2" in (run / "train.log").read_text()
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = {m["step"]: m["loss"] for m in read_metrics(runs.run_dir("clean_seed2"))}
    assert sorted(losses) == sorted(ref) == list(range(1, 9))
    for step in range(1, 9):
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step
