"""A stop by a callback of the user's (Lightning's EarlyStopping, or any setting `trainer.should_stop`) is
said: `callback_stop` gives the reason RunSummary writes to summary.json (`stop_reason`), the run summary
prints it, and EarlyStopping's own messages (`verbose=true`) reach the console."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import EarlyStopping

from ntp_nemo.cli.console import print_summary, quiet_libraries
from ntp_nemo.lightning.callbacks import PreemptionCheckpoint, StopAtStep, callback_stop


def _trainer(callbacks, step=4, should_stop=True):
    return SimpleNamespace(global_step=step, max_steps=20, callbacks=callbacks, should_stop=should_stop)


def _stopped_early_stopping() -> EarlyStopping:
    es = EarlyStopping(monitor="val/loss", patience=1, min_delta=100.0)
    for value in (5.0, 4.9):  # the second does not improve by min_delta: patience exhausted
        stop, reason = es._evaluate_stopping_criteria(torch.tensor(value))
    assert stop
    es.stopping_reason_message = reason  # what EarlyStopping._run_early_stopping_check records with it
    return es


def test_early_stopping_and_other_callback_stops_have_a_reason():
    es = _stopped_early_stopping()
    reason = callback_stop(_trainer([es]))
    assert reason.startswith("EarlyStopping: Monitored metric val/loss did not improve"), reason
    assert callback_stop(_trainer([object()])) == "a callback set trainer.should_stop"
    assert callback_stop(_trainer([es], step=20)) is None  # trained to trainer.max_steps
    signalled = PreemptionCheckpoint()
    signalled.stopped = True  # a stop signal: `stopped_early` says it, not this
    assert callback_stop(_trainer([signalled, es])) is None
    assert callback_stop(_trainer([StopAtStep(4)])) is None  # a planned stop of this invocation
    assert callback_stop(_trainer([], should_stop=False)) is None


def test_the_summary_and_the_console_say_it(tmp_path, capsys):
    print_summary({"steps": 4, "max_steps": 20, "stop_reason": "EarlyStopping: Monitored metric val/loss "
                   "did not improve in the last 1 records."}, tmp_path)
    out = capsys.readouterr().out
    assert " stopped       at step 4 of 20 by EarlyStopping: Monitored metric val/loss" in out
    assert "to resume" not in out  # an early stop is the end the user asked for
    quiet_libraries()
    logging.getLogger("lightning.pytorch.callbacks.early_stopping").info("Metric val/loss improved.")
    assert "Metric val/loss improved.\n" in capsys.readouterr().out
