"""The deterministic global sampler: which samples make up optimizer step `step`.

The sample stream is the concatenation of seeded permutations of all sample ids, one per epoch;
step `s` takes positions `[s*B, (s+1)*B)` of that stream, crossing into the next epoch where
needed. Everything is a pure function of `(seed, step)`, so resuming needs only the step, and any
number of processes (replicas of any TP degree) derive the same global batch without talking.
"""

from __future__ import annotations

import numpy as np

from ntp_nemo.errors import ConfigError


class GlobalBatchSampler:
    """Maps `(seed, step)` to the `global_batch_size` sample ids of that optimizer step."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, tag_epochs: bool = False) -> None:
        if num_samples < 1:
            raise ConfigError("data.path", f"the data has no training samples (num_samples={num_samples}).")
        if global_batch_size < 1:
            raise ConfigError(
                "data.global_batch_size", f"must be >= 1, got {global_batch_size}. Use e.g. 8."
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        # Blended datasets draw new samples every epoch: they get `epoch * num_samples + id`.
        self.tag_epochs = bool(tag_epochs)
        self._perms: dict[int, np.ndarray] = {}
        self.skipped: frozenset[int] = frozenset()  # sample ids taken out of the stream (bad data)

    def skip(self, ids) -> None:
        """Take sample ids `ids` out of every epoch's order from now on (bad data, found or configured).
        The stream is each epoch's permutation without them, so every step before the first position of
        a skipped id draws what it drew before, and a run given the same ids from its start draws the same
        samples at every step."""
        ids = frozenset(int(i) % self.num_samples for i in ids)
        if not ids <= self.skipped:
            if len(self.skipped | ids) >= self.num_samples:
                raise ValueError(f"skipping {len(self.skipped | ids)} of {self.num_samples} samples leaves "
                                 "none to train on")
            self.skipped = self.skipped | ids
            self._perms.clear()

    @property
    def epoch_samples(self) -> int:
        """Samples in one epoch of the stream (all but the skipped ones)."""
        return self.num_samples - len(self.skipped)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (cached for the two most recent epochs)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed % 2**64, epoch])))
            perm = rng.permutation(self.num_samples).astype(np.int64)
            if self.skipped:
                perm = perm[~np.isin(perm, np.fromiter(self.skipped, dtype=np.int64))]
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def epoch(self, step: int) -> int:
        """Epoch of the first sample of `step`."""
        return step * self.global_batch_size // self.epoch_samples

    def batch_ids(self, step: int) -> np.ndarray:
        """Sample ids (int64, length `global_batch_size`) of optimizer step `step`, in order.

        With `tag_epochs`, each id is offset by `epoch * num_samples` (the dataset takes it modulo)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        positions = step * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        n = self.epoch_samples
        epochs = positions // n
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self.permutation(int(e))[positions[mask] - e * n]
        if self.tag_epochs:
            out += epochs * self.num_samples
        return out

    def microbatch_ids(self, step: int, micro_batch_size: int) -> list[np.ndarray]:
        """The global batch of `step` cut into consecutive micro-batches of `micro_batch_size`."""
        if micro_batch_size < 1 or self.global_batch_size % micro_batch_size:
            raise ConfigError(
                "data.micro_batch_size",
                f"{micro_batch_size} must be >= 1 and divide data.global_batch_size="
                f"{self.global_batch_size}. Pick a divisor, e.g. data.micro_batch_size="
                f"{_largest_divisor_at_most(self.global_batch_size, max(1, micro_batch_size))}.",
            )
        ids = self.batch_ids(step)
        return [ids[i : i + micro_batch_size] for i in range(0, self.global_batch_size, micro_batch_size)]


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
