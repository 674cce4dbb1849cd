"""resume=auto says so when the newest checkpoint the run saved (goodput.jsonl) is gone from disk and an
older one (or none) is taken: the steps trained again are named, not passed over without a word."""

from __future__ import annotations

import json

from ntp_nemo.train import vanished_checkpoint


def _events(run, *events):
    (run / "goodput.jsonl").write_text("".join(json.dumps({"t": 1.0, "pid": 1, **e}) + "\n" for e in events))


def test_a_vanished_checkpoint_is_named(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_000004").mkdir(parents=True)
    _events(tmp_path, {"event": "ckpt_save_end", "step": 4}, {"event": "ckpt_save_end", "step": 8})
    said = vanished_checkpoint(tmp_path, ckpts, ckpts / "step_000004")
    assert said is not None and said.startswith("checkpoint step_000008, which this run saved")
    assert "resuming from step_000004, so steps 5 to 8 are trained again" in said
    none_left = vanished_checkpoint(tmp_path, ckpts, None)
    assert "no checkpoint is left: starting over, so steps 1 to 8 are trained again" in none_left
    (ckpts / "step_000008").mkdir()
    assert vanished_checkpoint(tmp_path, ckpts, ckpts / "step_000004") is None  # still there (damaged:
    # latest_valid_checkpoint says why it skipped it)


def test_an_uncommitted_save_is_not_reported(tmp_path):
    ckpts = tmp_path / "checkpoints"
    _events(tmp_path, {"event": "ckpt_save_end", "step": 4}, {"event": "ckpt_commit", "step": 4, "ok": True},
            {"event": "ckpt_save_end", "step": 8}, {"event": "ckpt_commit", "step": 8, "ok": False})
    assert vanished_checkpoint(tmp_path, ckpts, ckpts / "step_000004") is None
    assert vanished_checkpoint(tmp_path / "elsewhere", ckpts, None) is None  # no record: nothing to say
