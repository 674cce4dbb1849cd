"""Asynchronous saves: training goes on while the checkpoint is written, and the checkpoint holds
the state of the step it was taken at, not whatever the model holds when the write happens."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ntp_nemo.checkpoint import AsyncCheckpointSaver, checkpoint_name, is_valid_checkpoint, load_checkpoint
from ntp_nemo.launch.workers import run_workers
from tests.checkpoint.test_reshard import _one_process, _setup, _slices, _train_step
from tests.ntp_cases import LLAMA
from tests.waits import wait_until

LAYOUT = (2, [2, 1], [2] * 4)


def _max_diff(a: dict, b: dict) -> float:
    pairs = [(x, y) for name in a for x, y in zip(a[name][1:], b[name][1:], strict=True)]
    return max(float(np.abs(x - y).max()) for x, y in pairs)


def async_worker(rank, world, layout, directory):
    torch.set_num_threads(1)
    state = _setup(rank, layout, LLAMA, 7, torch.float32)
    model, opt = state.model, state.optimizer
    saver = AsyncCheckpointSaver()
    at_save = {}
    for step in range(1, 4):
        _train_step(state, LLAMA, step - 1)
        if step < 3:
            at_save[step] = _slices(model, opt)
            path = f"{directory}/{checkpoint_name(step)}"
            saver.save(path, model, opt, {"step": step}, step=step, keep_last=1)
            saver.staged()  # what a caller changing the state other than by an optimizer step must do
            with torch.no_grad():  # change the weights in place while the save runs (undone exactly below)
                for p in model.parameters():
                    p.neg_()
                time.sleep(0.05)
                for p in model.parameters():
                    p.neg_()
            # Training (and its collectives) goes on at once; the next save waits for this one.
    committed = saver.wait()
    saver.close()
    fresh_state = _setup(rank, layout, LLAMA, 8, torch.float32)
    fresh, fresh_opt = fresh_state.model, fresh_state.optimizer
    extra = load_checkpoint(committed, fresh, fresh_opt)
    diff = _max_diff(_slices(fresh, fresh_opt), at_save[2])
    return str(committed), diff, extra, is_valid_checkpoint(f"{directory}/{checkpoint_name(1)}")


@pytest.mark.slow
def test_async_save_snapshots_the_step_and_overlaps_training(tmp_path):
    results = run_workers(async_worker, 3, LAYOUT, str(tmp_path))
    for committed, diff, extra, first_kept in results:
        assert committed == str(tmp_path / checkpoint_name(2))
        assert diff == 0.0 and extra == {"step": 2}
        assert not first_kept  # keep_last=1 pruned step 1 after step 2 committed
    assert is_valid_checkpoint(tmp_path / checkpoint_name(2))


def test_async_save_in_one_process(tmp_path):
    committed, diff, extra, _ = _one_process(async_worker, (1, [1], [1] * 4), str(tmp_path))[0]
    assert committed == str(tmp_path / checkpoint_name(2)) and diff == 0.0 and extra == {"step": 2}


def _killed_while_writing(directory: str) -> None:
    """Commit step 1, start step 2 in the background, and die (SIGKILL) while its files are written."""
    import os
    import signal
    from pathlib import Path

    import ntp_nemo.checkpoint.storage as storage

    torch.set_num_threads(1)
    state = _setup(0, (1, [1], [1] * 4), LLAMA, 7, torch.float32)
    model, opt = state.model, state.optimizer
    saver = AsyncCheckpointSaver()
    _train_step(state, LLAMA, 0)
    saver.save(f"{directory}/{checkpoint_name(1)}", model, opt, {"step": 1}, step=1)
    saver.wait()
    flat = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    np.save(f"{directory}/step1.npy", flat)
    _train_step(state, LLAMA, 1)
    write_file = storage._write_file
    started = Path(directory) / "writing"

    def slow_write(path, chunks, sync):  # the background write is under way, then the process dies
        started.touch()
        time.sleep(30)
        return write_file(path, chunks, sync)

    storage._write_file = slow_write
    saver.save(f"{directory}/{checkpoint_name(2)}", model, opt, {"step": 2}, step=2)  # returns at once
    wait_until(started.exists, 60, "the background write to start", poll_s=0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def test_kill_during_background_write_keeps_the_previous_checkpoint(tmp_path):
    import multiprocessing
    import warnings

    from ntp_nemo.checkpoint import latest_valid_checkpoint

    proc = multiprocessing.get_context("fork").Process(target=_killed_while_writing, args=(str(tmp_path),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9
    assert (tmp_path / (checkpoint_name(2) + ".tmp")).is_dir()  # the partial save is left behind...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_valid_checkpoint(tmp_path) == tmp_path / checkpoint_name(1)  # ...and ignored
    assert caught == []
    model = _setup(0, (1, [1], [1] * 4), LLAMA, 8, torch.float32).model
    assert load_checkpoint(tmp_path / checkpoint_name(1), model) == {"step": 1}
    got = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    assert np.array_equal(got, np.load(tmp_path / "step1.npy"))


def _slow_staging(monkeypatch, seconds: float = 0.3) -> list[float]:
    """Make the background copy start late, so the caller reaches its next step before it is done;
    returns the times the copies finished."""
    import ntp_nemo.checkpoint.async_save as async_save

    stage_live, finished = async_save.stage_live, []

    def late(snap, staging):
        time.sleep(seconds)
        stage_live(snap, staging)
        finished.append(time.perf_counter())

    monkeypatch.setattr(async_save, "stage_live", late)
    return finished


def _flat(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"o/{n}/{k}": v.clone() for k, v in opt.state[p].items()})
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_optimizer_step_right_after_save_waits_for_the_staging(tmp_path, monkeypatch):
    """The step that follows `save` at once changes every parameter; the checkpoint still holds the
    state at `save`, bit for bit (the step waited for the deferred copy)."""
    torch.set_num_threads(1)
    finished = _slow_staging(monkeypatch)
    state = _setup(0, (1, [1], [1] * 4), LLAMA, 7, torch.float32)
    model, opt = state.model, state.optimizer
    _train_step(state, LLAMA, 0)
    saver = AsyncCheckpointSaver()
    at_save = _flat(model, opt)
    saver.save(tmp_path / checkpoint_name(1), model, opt, {"step": 1}, step=1)
    assert saver.in_flight and not finished  # save returned before the copy
    _train_step(state, LLAMA, 1)  # forward, backward, then the step waits for the copy
    stepped = time.perf_counter()
    assert finished and finished[0] <= stepped and saver.guard_wait_s > 0.1
    after_step = _flat(model, opt)
    assert not _equal(after_step, at_save)
    saver.close()
    fresh_state = _setup(0, (1, [1], [1] * 4), LLAMA, 8, torch.float32)
    fresh, fresh_opt = fresh_state.model, fresh_state.optimizer
    assert load_checkpoint(tmp_path / checkpoint_name(1), fresh, fresh_opt) == {"step": 1}
    assert _equal(_flat(fresh, fresh_opt), at_save)


def test_step_guard_is_installed_once_moved_and_removed(tmp_path):
    torch.set_num_threads(1)
    state = _setup(0, (1, [1], [1] * 4), LLAMA, 7, torch.float32)
    model, opt = state.model, state.optimizer
    _train_step(state, LLAMA, 0)
    saver = AsyncCheckpointSaver()
    for step in (1, 2):  # one hook for every save with the same optimizer
        saver.save(tmp_path / checkpoint_name(step), model, opt, {"step": step}, step=step)
        assert len(opt._optimizer_step_pre_hooks) == 1 and saver.guarded_optimizer is opt
    saver.wait()
    _train_step(state, LLAMA, 1)  # staged and committed: the step does not wait
    assert saver.guard_wait_s == 0.0
    other = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saver.save(tmp_path / checkpoint_name(3), model, other, {"step": 3}, step=3)
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(other._optimizer_step_pre_hooks) == 1
    saver.save(tmp_path / checkpoint_name(4), model, None, {"step": 4}, step=4)  # nothing to hook
    assert len(other._optimizer_step_pre_hooks) == 0 and saver.guarded_optimizer is None
    saver.save(tmp_path / checkpoint_name(5), model, opt, {"step": 5}, step=5)
    assert len(opt._optimizer_step_pre_hooks) == 1
    saver.close()
    assert len(opt._optimizer_step_pre_hooks) == 0 and saver.guarded_optimizer is None
    assert not saver.in_flight and load_checkpoint(tmp_path / checkpoint_name(5), model, opt) == {"step": 5}


def test_model_only_save_copies_at_once(tmp_path):
    """Without an optimizer to hold, `save` copies before it returns: the caller may change the weights."""
    torch.set_num_threads(1)
    model = _setup(0, (1, [1], [1] * 4), LLAMA, 7, torch.float32).model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saver = AsyncCheckpointSaver()
    saver.save(tmp_path / checkpoint_name(1), model, None, {"step": 1}, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saver.close()
    fresh = _setup(0, (1, [1], [1] * 4), LLAMA, 8, torch.float32).model
    load_checkpoint(tmp_path / checkpoint_name(1), fresh)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())


def test_load_waits_for_the_staging_of_a_save_in_flight(tmp_path, monkeypatch):
    """A load overwrites parameters and moments in place: it waits until the save in flight copied them."""
    torch.set_num_threads(1)
    state = _setup(0, (1, [1], [1] * 4), LLAMA, 7, torch.float32)
    model, opt = state.model, state.optimizer
    _train_step(state, LLAMA, 0)
    saver = AsyncCheckpointSaver()
    saver.save(tmp_path / checkpoint_name(1), model, opt, {"step": 1}, step=1)
    saver.wait()
    _train_step(state, LLAMA, 1)
    at_save = _flat(model, opt)
    finished = _slow_staging(monkeypatch)
    saver.save(tmp_path / checkpoint_name(2), model, opt, {"step": 2}, step=2)
    load_checkpoint(tmp_path / checkpoint_name(1), model, opt, saver=saver)  # back to step 1, in place
    assert finished
    saver.close()
    fresh_state = _setup(0, (1, [1], [1] * 4), LLAMA, 8, torch.float32)
    fresh, fresh_opt = fresh_state.model, fresh_state.optimizer
    load_checkpoint(tmp_path / checkpoint_name(2), fresh, fresh_opt)
    assert _equal(_flat(fresh, fresh_opt), at_save) and not _equal(_flat(model, opt), at_save)


def ended_group_worker(rank, world, layout, directory):
    """Each rank's background write finds the world's process group gone once its files are written (as
    a live recovery leaves it: torch.distributed reports no process group, i.e. one process), then
    gathers the records."""
    import torch.distributed as dist

    import ntp_nemo.checkpoint.sharded as sharded

    torch.set_num_threads(1)
    state = _setup(rank, layout, LLAMA, 7, torch.float32)
    _train_step(state, LLAMA, 0)
    saver = AsyncCheckpointSaver()
    saver.prepare()
    dist.barrier()
    write_records, is_initialized, ended = sharded.write_records, dist.is_initialized, []

    def write_then_end(*args, **kwargs):
        out = write_records(*args, **kwargs)
        ended.append(True)
        return out

    sharded.write_records = write_then_end
    dist.is_initialized = lambda: not ended and is_initialized()
    try:
        saver.save(f"{directory}/{checkpoint_name(1)}", state.model, state.optimizer, {"step": 1}, step=1)
        try:
            saver.wait()
            error = None
        except RuntimeError as err:
            error = str(err)
    finally:
        sharded.write_records, dist.is_initialized = write_records, is_initialized
    dist.barrier()  # every rank's save has ended before rank 0's directory is looked at
    return error, is_valid_checkpoint(f"{directory}/{checkpoint_name(1)}")


@pytest.mark.slow
def test_a_save_whose_process_group_ends_while_it_writes_is_not_committed(tmp_path):
    """Without the check, every rank's gather degrades to the one-process case and rank 0 commits a
    checkpoint that lists its own records only (seen with a live recovery racing a background save)."""
    results = run_workers(ended_group_worker, 3, LAYOUT, str(tmp_path))
    for error, valid in results:
        assert error is not None and "ended while it was in use" in error and "nothing is committed" in error
        assert not valid
    assert not (tmp_path / checkpoint_name(1)).exists()
