"""Fixed-length training samples cut from a flat token array (usually a memory-mapped token file).

Sample `i` is the window of `seq_len + 1` tokens starting at `start + i * seq_len`: inputs are its
first `seq_len` tokens, targets its last `seq_len`. Consecutive windows share one boundary token,
so every token in the range is predicted exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ntp_nemo.errors import ConfigError


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many samples of `seq_len + 1` tokens (stride `seq_len`) fit in `num_tokens`."""
    return max(0, (num_tokens - 1) // seq_len)


class TokenDataset(Dataset):
    """Non-overlapping windows of `seq_len + 1` tokens inside `tokens[start:end]`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, end: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        end = len(tokens) if end is None else end
        if not 0 <= start <= end <= len(tokens):
            raise ValueError(f"need 0 <= start <= end <= {len(tokens)}, got start={start}, end={end}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start
        self.end = end
        self._len = num_windows(end - start, seq_len)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self._len

    def _starts(self, ids: np.ndarray) -> np.ndarray:
        ids = np.where(ids < 0, ids + self._len, ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self._len):
            raise IndexError(f"sample ids must lie in [0, {self._len}), got {ids.min()}..{ids.max()}")
        return self.start + ids * self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        begin = int(self._starts(np.asarray([int(i)], dtype=np.int64))[0])
        window = np.asarray(self.tokens[begin : begin + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)

    def batch(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Samples `ids` stacked as a LongTensor [len(ids), seq_len + 1], in one gather."""
        starts = self._starts(np.asarray(ids, dtype=np.int64).reshape(-1))
        gathered = self.tokens[starts[:, None] + self._offsets[None, :]]
        return torch.from_numpy(np.asarray(gathered, dtype=np.int64))


def split_train_val(num_tokens: int, val_fraction: float, seq_len: int = 1) -> tuple[tuple[int, int], ...]:
    """Token ranges `((0, s), (s, num_tokens))`: training first, the held-out tail for validation.

    Raises ConfigError when either part holds fewer than one sample of `seq_len + 1` tokens.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(
            "data.val_fraction",
            f"must lie strictly between 0 and 1 (the held-out tail of the data), got {val_fraction}. "
            "Use e.g. data.val_fraction=0.05.",
        )
    val_tokens = int(round(num_tokens * val_fraction))
    split = num_tokens - val_tokens
    train_n, val_n = num_windows(split, seq_len), num_windows(val_tokens, seq_len)
    if train_n < 1 or val_n < 1:
        need = seq_len + 1
        raise ConfigError(
            "data.seq_len",
            f"the data holds {num_tokens} tokens; with data.val_fraction={val_fraction} the training part "
            f"gets {split} and the validation part {val_tokens} tokens, but each part needs at least "
            f"data.seq_len+1={need} tokens for one sample ({train_n} training / {val_n} validation samples). "
            "Lower data.seq_len, adjust data.val_fraction, or use more data (data.path).",
        )
    return (0, split), (split, num_tokens)
