"""Exact resume with randomness: a TP-2 model with dropout resumed from a checkpoint draws the same
dropout masks as the run that never stopped (every rank's generator states are in the checkpoint)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from ntp_nemo.checkpoint import load, save_checkpoint
from ntp_nemo.checkpoint.rng import rng_state, set_rng_state
from ntp_nemo.launch.workers import run_workers
from tests.checkpoint.test_reshard import _setup, _train_step
from tests.ntp_cases import GPT

LAYOUT = (2, [2], [2] * 4)
DROPOUT = dataclasses.replace(GPT, dropout=0.2)


def _straight(rank, world, path):
    torch.set_num_threads(1)
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(5)
    state = _setup(rank, LAYOUT, DROPOUT, 7, torch.float32)
    model, opt = state.model, state.optimizer
    for step in range(2):
        _train_step(state, DROPOUT, step)
    save_checkpoint(path, model, opt, {"step": 2}, step=2, layout={"replica_tp": [2]})
    rng = rng_state()
    draws = (float(torch.rand(())), float(np.random.rand()), random.random())
    set_rng_state(rng)
    return [_train_step(state, DROPOUT, s) for s in (2, 3)], draws


def _resumed(rank, world, path, restore):
    torch.set_num_threads(1)
    torch.manual_seed(999)  # another state: only the checkpoint can give the right masks
    state = _setup(rank, LAYOUT, DROPOUT, 8, torch.float32)
    model, opt = state.model, state.optimizer
    loaded = load(path, model, opt)
    if restore:
        set_rng_state(loaded.rng[rank])
        draws = (float(torch.rand(())), float(np.random.rand()), random.random())
        set_rng_state(loaded.rng[rank])
    else:
        draws = None
    return [_train_step(state, DROPOUT, s) for s in (2, 3)], draws


def test_dropout_run_resumes_bit_exactly(tmp_path):
    path = str(tmp_path / "step_000002")
    straight = run_workers(_straight, 2, path)
    resumed = run_workers(_resumed, 2, path, True)
    for (losses, draws), (got, got_draws) in zip(straight, resumed, strict=True):
        assert got == losses  # bit-exact, both ranks
        assert got_draws == draws  # torch, numpy and Python generators all continue
    fresh = run_workers(_resumed, 2, path, False)
    assert fresh[0][0][0] != straight[0][0][0]  # without the saved states the masks differ
