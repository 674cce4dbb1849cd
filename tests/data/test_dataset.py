"""Token windows: stride seq_len, seq_len+1 tokens each, every target predicted once; the train/val split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntp_nemo.data.dataset import TokenDataset, split_train_val
from ntp_nemo.errors import ConfigError


def test_windows_and_batch_gather():
    tokens = np.arange(50, dtype=np.uint16)
    ds = TokenDataset(tokens, seq_len=8)
    assert len(ds) == 6  # (50 - 1) // 8
    for i in range(len(ds)):
        item = ds[i]
        assert item.dtype == torch.int64 and item.shape == (9,)
        assert item.tolist() == list(range(8 * i, 8 * i + 9))
    ids = [3, 0, 5, 3]
    batch = ds.batch(ids)
    assert batch.dtype == torch.int64 and batch.shape == (4, 9)
    assert torch.equal(batch, torch.stack([ds[i] for i in ids]))
    assert torch.equal(ds[-1], ds[5])
    with pytest.raises(IndexError):
        ds.batch([6])
    with pytest.raises(IndexError):
        ds[6]


def test_range_restricted_windows_cover_targets_once():
    tokens = np.arange(1000, 1100, dtype=np.int64)
    ds = TokenDataset(tokens, seq_len=7, start=10, end=60)
    assert len(ds) == (50 - 1) // 7
    rows = ds.batch(range(len(ds)))
    assert int(rows.min()) >= 1010 and int(rows.max()) < 1060
    targets = rows[:, 1:].reshape(-1).tolist()
    assert targets == list(range(1011, 1011 + 7 * len(ds)))  # each target exactly once, in order


def test_works_on_a_memmap(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(200, dtype=np.uint16).tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    ds = TokenDataset(mm, seq_len=16, start=100)
    assert ds.batch([0, 1])[1, 0].item() == 116


def test_bad_ranges():
    with pytest.raises(ValueError):
        TokenDataset(np.arange(10), seq_len=0)
    with pytest.raises(ValueError):
        TokenDataset(np.arange(10), seq_len=2, start=5, end=11)


def test_split_tail_is_validation():
    (t0, t1), (v0, v1) = split_train_val(1000, 0.1, seq_len=16)
    assert (t0, t1, v0, v1) == (0, 900, 900, 1000)
    with pytest.raises(ConfigError) as err:
        split_train_val(1000, 0.05, seq_len=64)  # 50 validation tokens < 65
    assert err.value.key == "data.seq_len"
    assert "65" in str(err.value)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError) as err:
            split_train_val(1000, bad)
        assert err.value.key == "data.val_fraction"
