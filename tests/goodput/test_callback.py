"""GoodputCallback inside a tiny real lightning.Trainer (single process, CPU). The events of a real
`ntp-train` run (NTPStrategy, NTPLanguageModule) are checked in tests/cli/test_stop_resume_and_mistakes.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from ntp_nemo.goodput import compute_goodput, load_events
from ntp_nemo.goodput import events as ev
from ntp_nemo.lightning.goodput_callback import GoodputCallback

LAYOUT = {"layout": "tp4+tp3", "capacity": 0.875}  # the keys NTPStrategy.layout_info has


class LayoutStrategy(SingleDeviceStrategy):
    """Stands in for NTPStrategy: exposes the layout the step ran on."""

    layout_info = LAYOUT


class Tiny(LightningModule):
    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.fail_at_step:
            raise RuntimeError("injected failure")
        x, y = batch
        self.last_step = {"step": self.global_step + 1, "tokens": x.numel()}  # as NTPLanguageModule sets it
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(run_dir: Path, max_steps: int, fail_at_step: int | None = None, job_started: bool = False,
        strategy: SingleDeviceStrategy | None = None) -> Trainer:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        strategy=strategy or LayoutStrategy(device=torch.device("cpu")),
        callbacks=[
            GoodputCallback(str(run_dir), job_started=job_started),
            ModelCheckpoint(dirpath=run_dir / "checkpoints", every_n_train_steps=2, save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(fail_at_step), data)
    return trainer


def test_callback_records_a_run_and_a_failed_restart(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    trainer = fit(tmp_path, max_steps=5)
    assert GoodputCallback.of(trainer) is trainer.callbacks[0]
    first = load_events(tmp_path)
    names = [e["event"] for e in first]
    assert names[:2] == [ev.JOB_START, ev.INIT_DONE]
    assert names[-1] == ev.JOB_END and first[-1]["status"] == ev.STATUS_OK
    ends = [e for e in first if e["event"] == ev.STEP_END]
    assert [e["step"] for e in ends] == [1, 2, 3, 4, 5]
    assert [e["step"] for e in first if e["event"] == ev.STEP_START] == [1, 2, 3, 4, 5]
    assert all((e["layout"], e["capacity"], e["tokens"]) == ("tp4+tp3", 0.875, 8 * 4) for e in ends)
    saves = [(e["event"], e["step"]) for e in first if e["event"].startswith("ckpt_save")]
    assert saves == [
        (ev.CKPT_SAVE_START, 2),
        (ev.CKPT_SAVE_END, 2),
        (ev.CKPT_SAVE_START, 4),
        (ev.CKPT_SAVE_END, 4),
    ]
    assert len(list((tmp_path / "checkpoints").glob("*.ckpt"))) == 2

    # A second lifetime in the same run directory (here: the same process) that fails mid-step.
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(tmp_path, max_steps=5, fail_at_step=3)
    events = load_events(tmp_path)
    assert events[: len(first)] == first  # append-only
    assert [e["event"] for e in events].count(ev.JOB_START) == 2
    assert events[-1]["event"] == ev.JOB_END and events[-1]["status"] == ev.STATUS_FAILED
    assert "injected failure" in events[-1]["reason"]

    report = compute_goodput(events)
    assert report.lifetimes == 2
    assert report.failures == 1  # the failed job_end, with nothing else recorded about it
    assert report.steps_completed == 5
    assert report.steps_redone == 2  # steps 1 and 2 ran again
    assert report.capacity_fraction == pytest.approx(0.875)
    assert report.productive_s > 0 and report.badput_s[ev.CHECKPOINT_SAVE] > 0
    assert report.productive_s + sum(report.badput_s.values()) == pytest.approx(report.total_s)


def test_external_save_events_are_not_duplicated(tmp_path: Path) -> None:
    """A strategy that records its own (asynchronous) save end takes over from the callback."""
    cb = GoodputCallback(str(tmp_path))
    trainer = SimpleNamespace(global_step=4)
    cb.on_save_checkpoint(trainer, None, {})  # Lightning's hook: opens the save
    cb.record(ev.CKPT_SAVE_START, step=4)  # the strategy's own start: already open
    cb.on_train_batch_start(trainer, None, None, 0)  # the loop resumes; the save is still in flight
    cb.record(ev.CKPT_SAVE_END, step=4, blocking_s=0.01)
    events = [e["event"] for e in load_events(tmp_path)]
    assert events == [ev.CKPT_SAVE_START, ev.STEP_START, ev.CKPT_SAVE_END]


class SelfRecordingStrategy(LayoutStrategy):
    """Stands in for NTPStrategy's own save events (it records start and end around each save)."""

    records_checkpoint_events = True


def test_job_start_comes_from_whoever_opened_the_lifetime(tmp_path: Path) -> None:
    """An entry point that recorded job_start hands the callback `job_started=True`: one job_start per
    lifetime either way."""
    fit(tmp_path / "own", 2)
    assert [e["event"] for e in load_events(tmp_path / "own")].count(ev.JOB_START) == 1
    (tmp_path / "entry").mkdir()
    from ntp_nemo.goodput import GoodputRecorder

    GoodputRecorder(tmp_path / "entry").record(ev.JOB_START, layout="single")  # as ntp-train's parent does
    fit(tmp_path / "entry", 2, job_started=True)
    names = [e["event"] for e in load_events(tmp_path / "entry")]
    assert names.count(ev.JOB_START) == 1 and names[-1] == ev.JOB_END


def test_a_state_dict_dump_opens_no_save(tmp_path: Path) -> None:
    """Lightning calls on_save_checkpoint when it only builds the state (a live rejoin hands it to the
    repaired process): with a strategy that records its own saves, no save is left without an end."""
    trainer = fit(tmp_path, 2, strategy=SelfRecordingStrategy(device=torch.device("cpu")))
    trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    names = [e["event"] for e in load_events(tmp_path)]
    starts = names.count(ev.CKPT_SAVE_START)
    assert starts == names.count(ev.CKPT_SAVE_END) + names.count(ev.CKPT_SAVE_ABORT)
    report = compute_goodput(load_events(tmp_path))
    assert report.badput_s[ev.CHECKPOINT_SAVE] == 0.0
