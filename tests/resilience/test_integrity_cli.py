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
                "fault.step=3"],
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
def test_bitflip_named_and_repaired_from_the_verified_state(runs, reference_losses, capsys, monkeypatch):
    run = runs.run_dir("bitflip")
    log = (run / "train.log").read_text()
    fired = next(line for line in log.splitlines() if line.startswith("fault: bitflip"))
    parameter = fired.split(" in param ")[1].split("[")[0]
    (finding,) = _findings(run)
    assert (finding["step"], finding["kind"], finding["verdict"]) == (4, "divergence", "bitflip")
    assert (finding["replica"], finding["rank"], finding["parameter"]) == (0, 1, parameter)
    assert "rolled back to verified step 0 and replayed 4 step(s); replicas agree again" in finding["action"]
    losses = {m["step"]: m["loss"] for m in read_metrics(run)}
    ref = reference_losses("single-8")
    for step in range(5, 9):  # after the repair: the failure-free curve
        assert losses[step] == pytest.approx(ref[step], rel=1e-5), step
    report = compute_goodput(load_events(run))
    assert report.badput_s["integrity"] > 0  # the checks and the repair, a category of their own
    assert json.loads((run / "summary.json").read_text())["integrity"]["by_kind"] == {"divergence/bitflip": 1}
    out = _incidents(run, capsys, monkeypatch)
    assert f"replica 0, rank 1, {parameter}" in out and "bitflip" in out
