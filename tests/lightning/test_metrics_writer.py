"""metrics.jsonl across a live recovery that loses global rank 0 (the file's writer): the survivor that
becomes rank 0 records every step the survivors completed, including one the lost writer never wrote."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ntp_nemo.lightning.callbacks import MetricsJSONL


def _trainer(zero: bool, step: int = 0):
    return SimpleNamespace(is_global_zero=zero, global_step=step, callbacks=[],
                           strategy=SimpleNamespace(layout_info={"layout": "(2,2)", "capacity": 1.0}))


def _step(cb: MetricsJSONL, trainer, step: int) -> None:
    module = SimpleNamespace(last_step={"step": step, "loss": 5.0 - step / 10, "tokens": 384})
    cb.on_train_batch_start(trainer, module, None, step - 1)
    cb.on_train_batch_end(trainer, module, None, None, step - 1)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_survivor_that_becomes_rank_0_writes_the_step_the_lost_writer_did_not(tmp_path):
    writer, survivor = MetricsJSONL(tmp_path), MetricsJSONL(tmp_path)
    zero, other = _trainer(True), _trainer(False)
    writer.on_train_start(zero, None)
    survivor.on_train_start(other, None)
    for step in (1, 2, 3):
        _step(writer, zero, step)
        _step(survivor, other, step)
    _step(survivor, other, 4)  # the writer died in step 4's optimizer phase, after the survivors' step
    promoted = _trainer(True, step=4)
    _step(survivor, promoted, 5)  # the first step after the live recovery: the survivor is rank 0 now
    _step(survivor, promoted, 6)
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[3] == 5.0 - 4 / 10


def test_the_first_writer_never_rewrites_what_a_relaunch_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                    for s in (1, 2, 3, 4)))
    relaunch = MetricsJSONL(tmp_path)
    zero = _trainer(True, step=3)
    zero.callbacks = [SimpleNamespace(attempt=1)]  # a supervisor's relaunch appends the redone steps
    relaunch.on_train_start(zero, None)
    _step(relaunch, zero, 4)
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 4]


def test_a_survivor_promoted_again_after_a_rejoin_gave_rank_0_back_writes_the_missed_step(tmp_path):
    """Process 1 becomes rank 0 when process 0 is lost, gives rank 0 back to the repaired process 0 at the
    rejoin, and becomes rank 0 again when that one dies after the survivors' optimizer step (the soak met
    it: step 78 of `python bench/soak.py --failures 12 --seed 1` had no record)."""
    first, survivor, repaired = MetricsJSONL(tmp_path), MetricsJSONL(tmp_path), MetricsJSONL(tmp_path)
    zero, other = _trainer(True), _trainer(False)
    first.on_train_start(zero, None)
    survivor.on_train_start(other, None)
    _step(first, zero, 1)
    _step(survivor, other, 1)
    _step(survivor, other, 2)  # process 0 died after step 2's update
    _step(survivor, _trainer(True, step=2), 3)  # rank 0 now
    _step(survivor, other, 4)  # the repaired process 0 rejoined and is rank 0 again
    _step(repaired, zero, 4)
    _step(survivor, other, 5)  # ... and died after step 5's update
    _step(survivor, _trainer(True, step=5), 6)
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]


def test_a_writer_keeps_constant_memory_over_a_long_job(tmp_path):
    writer = MetricsJSONL(tmp_path)
    zero = _trainer(True)
    writer.on_train_start(zero, None)
    for step in range(1, 2 * MetricsJSONL.RECENT + 10):
        _step(writer, zero, step)
    assert len(writer.recent) == MetricsJSONL.RECENT and writer.steps == 2 * MetricsJSONL.RECENT + 9
    assert writer.first["step"] == 1 and writer.last["step"] == 2 * MetricsJSONL.RECENT + 9
