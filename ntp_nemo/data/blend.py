"""A weighted blend of token datasets, drawn in an order fixed by the seed.

A blend of datasets `d` with weights `w_d` has `L = sum(len(d))` samples per epoch; dataset `d`
owns `c_d` of them, the largest-remainder rounding of `w_d * L` (exact, the same everywhere). Blend
id `b` in `[0, L)` belongs to the dataset whose block `[o_d, o_d + c_d)` holds it; the global
sampler permutes the blend ids each epoch, so the datasets are interleaved at random but in exact
proportion. Across epochs dataset `d` keeps drawing new samples: in blend epoch `e` its `j`-th
slot is its draw `k = e * c_d + j`, which is sample `perm_d(k // n_d)[k % n_d]` (a seeded
permutation of its `n_d` samples per pass), so a small dataset is repeated (up-sampled) only after
all its samples were used, and a large one (down-sampled) shows new samples every epoch.

Everything is a pure function of `(seed, id)`: any process and any layout draws the same samples,
and resuming needs only the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ntp_nemo.data.dataset import TokenDataset
from ntp_nemo.data.rebalance import assign_microbatches
from ntp_nemo.errors import ConfigError


class BlendedDataset:
    """Samples of several `TokenDataset`s in proportion to `weights`; ids may carry an epoch tag."""

    def __init__(self, datasets: Sequence[TokenDataset], weights: Sequence[float], seed: int,
                 names: Sequence[str] | None = None) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError("need one weight per dataset")
        seq = {d.seq_len for d in datasets}
        if len(seq) != 1:
            raise ValueError(f"datasets must share seq_len, got {sorted(seq)}")
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.names = list(names or [str(i) for i in range(len(datasets))])
        self.seq_len = seq.pop()
        self.seed = int(seed)
        self.sizes = np.asarray([len(d) for d in datasets], dtype=np.int64)
        for name, n, w in zip(self.names, self.sizes, self.weights, strict=True):
            if n < 1 and w > 0:
                raise ConfigError("data.blend", f"{name!r} holds no sample of data.seq_len+1="
                                                f"{self.seq_len + 1} "
                                                "tokens; give it more data, lower data.seq_len or drop it.")
        self._len = int(self.sizes.sum())
        self.counts = np.asarray(assign_microbatches(self._len, self.weights), dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self._len

    def _perm(self, d: int, rnd: int) -> np.ndarray:
        key = (d, rnd)
        perm = self._perms.get(key)
        if perm is None:
            seq = np.random.SeedSequence([self.seed % 2**64, 1 + d, rnd])
            rng = np.random.Generator(np.random.PCG64(seq))
            perm = rng.permutation(int(self.sizes[d])).astype(np.int64)
            if len(self._perms) >= 4 * len(self.datasets):
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm

    def locate(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset index, sample index inside it) of each blend id (epoch-tagged ids allowed)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and ids.min() < 0:
            raise IndexError(f"blend ids must be >= 0, got {ids.min()}")
        epoch, b = np.divmod(ids, self._len)
        which = np.searchsorted(self.offsets, b, side="right") - 1
        local = np.empty_like(ids)
        for d in np.unique(which):
            mask = which == d
            draws = epoch[mask] * self.counts[d] + (b[mask] - self.offsets[d])
            rounds, pos = np.divmod(draws, self.sizes[d])
            out = np.empty_like(draws)
            for r in np.unique(rounds):
                sel = rounds == r
                out[sel] = self._perm(int(d), int(r))[pos[sel]]
            local[mask] = out
        return which, local

    def batch(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Samples `ids` stacked as a LongTensor [len(ids), seq_len + 1]."""
        which, local = self.locate(ids)
        out = torch.empty((len(which), self.seq_len + 1), dtype=torch.int64)
        for d in np.unique(which):
            mask = which == d
            out[torch.from_numpy(mask)] = self.datasets[int(d)].batch(local[mask])
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batch([int(i)])[0]
