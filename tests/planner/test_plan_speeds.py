"""`ntp-plan ... speeds=[...]`: what the straggler watch's policy does at measured per-rank speeds on a
training layout (in process: the console function with its argv): the batch split across replicas, the
shard weights inside a one-replica job's TP group, the exclusion below the floor, nothing within the
margin."""

from __future__ import annotations

import sys

import pytest

from ntp_nemo.topology import ResolvedLayout, Topology

LAYOUT = ["model=gpt_tiny", "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "data.global_batch_size=12",
          "data.micro_batch_size=2"]


def _plan(monkeypatch, capsys, args):
    from ntp_nemo.cli.plan import main

    monkeypatch.setattr(sys, "argv", ["ntp-plan", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_the_split_at_measured_speeds_is_the_rebalance(monkeypatch, capsys):
    code, out, err = _plan(monkeypatch, capsys, [*LAYOUT, "speeds=[1,0.5,1,1]"])
    assert code in (0, None), err
    want = ResolvedLayout.make(Topology(2, [2, 2], [2] * 4), num_microbatches=6, speeds=(0.5, 1.0))
    assert f"micro-batches per replica: [3, 3] -> {list(want.microbatches)}" in out
    assert "replica speeds for the batch split [0.5, 1.0]" in out
    assert "stragglers (speed below 1/(1+margin) = 0.714): rank 1 at 0.5" in out
    assert "2.000 -> 1.333" in out  # 3 micro-batches at half speed vs 4 at full: 6 -> 4 of 3 units
    assert "fault.straggler_shards=auto): balanced" in out  # two replicas: the batch moves, not the shards


def test_a_one_replica_jobs_slow_rank_gets_fewer_shards(monkeypatch, capsys):
    one = ["model=gpt_tiny", "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null", "data.global_batch_size=12",
           "data.micro_batch_size=2"]
    code, out, err = _plan(monkeypatch, capsys, [*one, "speeds=[1,0.5]"])
    assert code in (0, None), err
    assert "micro-batches per replica: [6] -> [6]" in out  # no other replica to take a share
    assert "fault.straggler_shards=auto): [1.0, 0.5]" in out
    # Balanced, the half-speed rank takes twice a full step (2.000). Shards in exact proportion 2:1 would
    # take 4/3 of it if the work were all matmuls; the layers' all-reduces do not shrink with the shards,
    # so the work model lands between the two.
    before, after = out.split("relative to full speed): ")[1].split()[0:3:2]
    assert before == "2.000" and 1.333 <= float(after) < 1.95, out
    code, out, err = _plan(monkeypatch, capsys, [*one, "fault.straggler_shards=off", "speeds=[1,0.5]"])
    assert code in (0, None), err
    assert "fault.straggler_shards=off): balanced" in out and "2.000 -> 2.000" in out


@pytest.mark.parametrize("speeds,words", [("[1,0.1,1,1]", "excluded: ranks [1]"),
                                          ("[1,0.8,1,1]", "[3, 3] -> [3, 3]")])
def test_below_the_floor_a_rank_is_excluded_and_within_the_margin_nothing_moves(monkeypatch, capsys,
                                                                                 speeds, words):
    code, out, err = _plan(monkeypatch, capsys, [*LAYOUT, f"speeds={speeds}"])
    assert code in (0, None), err
    assert words in out, out


@pytest.mark.parametrize("speeds,words", [("[1,0.5]", "per global rank"), ("[1,0,1,1]", "(0, 1]"),
                                          ("fast", "list of numbers")])
def test_bad_speeds_exit_2_naming_the_key(monkeypatch, capsys, speeds, words):
    code, _, err = _plan(monkeypatch, capsys, [*LAYOUT, f"speeds={speeds}"])
    assert code == 2 and "speeds" in err and words in err and "Traceback" not in err
    code, _, err = _plan(monkeypatch, capsys, ["model=llama3_8b", "speeds=[1]"])  # a simulator model
    assert code == 2 and "training model or recipe" in err
