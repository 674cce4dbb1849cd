"""Asynchronous saves: training goes on while the checkpoint is written, and the checkpoint holds
the state of the step it was taken at, not whatever the model holds when the write happens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntp_nemo.checkpoint import AsyncCheckpointSaver, checkpoint_name, is_valid_checkpoint, load_checkpoint
from ntp_nemo.parallel.launch import run_workers
from tests.ntp_cases import LLAMA
from tests.test_checkpoint_reshard import _one_process, _setup, _slices, _train_step

LAYOUT = (2, [2, 1], [2] * 4)


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(x - y).max()) for name in a for x, y in zip(a[name][1:], b[name][1:], strict=True))


def async_worker(rank, world, layout, directory):
    torch.set_num_threads(1)
    rt, model, opt = _setup(rank, layout, LLAMA, 7, torch.float32)
    saver = AsyncCheckpointSaver()
    at_save = {}
    for step in range(3):
        _train_step(rt, model, opt, LLAMA, step)
        if step < 2:
            at_save[step + 1] = _slices(model, opt)
            saver.save(f"{directory}/{checkpoint_name(step + 1)}", model, opt, {"step": step + 1}, step=step + 1,
                       keep_last=1)
            # Training (and its collectives) goes on at once; the next save waits for this one.
    committed = saver.wait()
    saver.close()
    diffs = {}
    for step in (1, 2):
        path = f"{directory}/{checkpoint_name(step)}"
        if step == 2:
            _, fresh, fresh_opt = _setup(rank, layout, LLAMA, 8, torch.float32)
            extra = load_checkpoint(path, fresh, fresh_opt)
            diffs[step] = (_max_diff(_slices(fresh, fresh_opt), at_save[step]), extra)
    return str(committed), diffs, is_valid_checkpoint(f"{directory}/{checkpoint_name(1)}")


@pytest.mark.slow
def test_async_save_snapshots_the_step_and_overlaps_training(tmp_path):
    results = run_workers(async_worker, 3, LAYOUT, str(tmp_path))
    for committed, diffs, first_kept in results:
        assert committed == str(tmp_path / checkpoint_name(2))
        assert diffs[2] == (0.0, {"step": 2})
        assert not first_kept  # keep_last=1 pruned step 1 after step 2 committed
    assert is_valid_checkpoint(tmp_path / checkpoint_name(2))


def test_async_save_in_one_process(tmp_path):
    committed, diffs, _ = _one_process(async_worker, (1, [1], [1] * 4), str(tmp_path))[0]
    assert committed == str(tmp_path / checkpoint_name(2)) and diffs[2] == (0.0, {"step": 2})
