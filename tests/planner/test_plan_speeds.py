"""`ntp-plan ... speeds=[...]`: the batch split the straggler watch's rebalance runs at measured per-rank
speeds, for a training layout (in process: the console function with its argv)."""

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
    assert "replica speeds (slowest rank) [0.5, 1.0]" in out
    assert "2.000 -> 1.333" in out  # 3 micro-batches at half speed vs 4 at full: 6 -> 4 of 3 units


@pytest.mark.parametrize("speeds,words", [("[1,0.5]", "per global rank"), ("[1,0,1,1]", "(0, 1]"),
                                          ("fast", "list of numbers")])
def test_bad_speeds_exit_2_naming_the_key(monkeypatch, capsys, speeds, words):
    code, _, err = _plan(monkeypatch, capsys, [*LAYOUT, f"speeds={speeds}"])
    assert code == 2 and "speeds" in err and words in err and "Traceback" not in err
    code, _, err = _plan(monkeypatch, capsys, ["model=llama3_8b", "speeds=[1]"])  # a simulator model
    assert code == 2 and "training model or recipe" in err
