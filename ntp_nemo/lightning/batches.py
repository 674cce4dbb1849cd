"""Per-rank views of the fixed global batch: each optimizer step yields this replica's micro-batches."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ntp_nemo.data.dataset import TokenDataset
from ntp_nemo.data.sampler import GlobalBatchSampler


class StepBatches(Dataset):
    """Item `i` is step `start_step + i`: the micro-batches of the global batch assigned to this replica.

    The global batch depends only on (seed, step), so resuming needs the step alone and every
    layout sees the same samples; `my_range(num_micro)` picks this replica's capacity share.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        sampler: GlobalBatchSampler,
        micro_batch_size: int,
        max_steps: int,
        my_range: Callable[[int], range],
    ) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch_size, self.max_steps = micro_batch_size, max_steps
        self.my_range = my_range
        self.start_step = 0
        self.last_fetch_s = 0.0  # time the last item took to build (the goodput callback records it)

    def __len__(self) -> int:
        return self.max_steps

    def __getitem__(self, i: int) -> dict:
        t0 = time.perf_counter()
        step = self.start_step + i
        micro = self.sampler.microbatch_ids(step, self.micro_batch_size)
        mine = self.my_range(len(micro))
        ids = np.concatenate([micro[j] for j in mine]) if len(mine) else np.zeros(0, dtype=np.int64)
        tokens = self.dataset.batch(ids).view(len(mine), self.micro_batch_size, -1)
        seq = self.dataset.seq_len
        item = {
            "step": torch.tensor(step),
            "micro": tokens,
            "global_tokens": torch.tensor(self.sampler.global_batch_size * seq),
            "first": torch.tensor(mine.start),  # the split it was cut for (a rebalance may change it)
        }
        self.last_fetch_s = time.perf_counter() - t0
        return item


class ValBatches(Dataset):
    """One item: this replica's share of a fixed set of validation micro-batches."""

    def __init__(
        self, dataset: TokenDataset, num_micro: int, micro_batch_size: int, my_range: Callable[[int], range]
    ) -> None:
        self.dataset, self.num_micro, self.mbs, self.my_range = dataset, num_micro, micro_batch_size, my_range

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict:
        mine = self.my_range(self.num_micro)
        n = len(self.dataset)
        ids = np.arange(mine.start * self.mbs, mine.stop * self.mbs) % n
        tokens = self.dataset.batch(ids).view(len(mine), self.mbs, -1)
        return {
            "micro": tokens,
            "global_tokens": torch.tensor(self.num_micro * self.mbs * self.dataset.seq_len),
        }
