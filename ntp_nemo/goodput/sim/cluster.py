"""Cluster layout and the resource manager that forms DP replicas from partially failed domains.

A cluster is `num_gpus` GPUs in scale-up domains of `domain_size`; a DP replica is `pp` TP
groups of `tp` GPUs (one per pipeline stage). A TP group of h working GPUs runs at the largest
allowed degree not above h (`degree_map`), or not at all. A replica runs at the smallest degree
of its groups (all its stages run at the replica's degree).

With `packing` the resource manager rebuilds TP groups from the working GPUs of each domain
(floor(h/tp) full groups plus at most one reduced group) and assigns groups to replicas sorted
by degree, which packs the damaged groups into as few replicas as possible; this maximises the
sum over replicas of any non-decreasing function of their degree. Without packing, groups are
fixed blocks of `tp` consecutive GPUs and replicas fixed blocks of `pp` consecutive groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_nemo.errors import ConfigError


@dataclass(frozen=True)
class ClusterSpec:
    """Cluster shape and the degrees a damaged TP group may run at."""

    num_gpus: int
    domain_size: int
    tp: int
    pp: int = 1
    degraded_tp: tuple[int, ...] | None = None
    min_degraded_fraction: float = 0.5
    spare_domains: int = 0
    packing: bool = True

    def __post_init__(self) -> None:
        for name in ("num_gpus", "domain_size", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster.{name}", f"must be a positive integer, got {value!r}.")
        if self.domain_size % self.tp and self.tp % self.domain_size:
            raise ConfigError(
                "cluster.tp",
                f"tp={self.tp} and domain_size={self.domain_size}: one must divide the other so TP groups "
                "tile the scale-up domains.",
            )
        if self.num_gpus % self.domain_size:
            raise ConfigError(
                "cluster.num_gpus", f"{self.num_gpus} is not a multiple of domain_size={self.domain_size}."
            )
        if self.num_gpus % (self.tp * self.pp):
            raise ConfigError(
                "cluster.num_gpus",
                f"{self.num_gpus} GPUs do not split into whole replicas of tp*pp={self.tp * self.pp} GPUs; "
                "choose num_gpus as a multiple of tp*pp.",
            )
        if self.degraded_tp is not None:
            bad = [t for t in self.degraded_tp if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t < self.tp]
            if bad:
                raise ConfigError(
                    "cluster.degraded_tp",
                    f"entries {bad} are not reduced degrees; each must be an integer in [1, tp-1={self.tp - 1}].",
                )
        if not 0 < self.min_degraded_fraction <= 1:
            raise ConfigError(
                "cluster.min_degraded_fraction", f"must be in (0, 1], got {self.min_degraded_fraction!r}."
            )
        if isinstance(self.spare_domains, bool) or not isinstance(self.spare_domains, int) or self.spare_domains < 0:
            raise ConfigError("cluster.spare_domains", f"must be a non-negative integer, got {self.spare_domains!r}.")
        if self.spare_domains and not self.packing:
            raise ConfigError(
                "cluster.spare_domains", "spare domains need cluster.packing=true (the manager swaps them in)."
            )

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.domain_size

    @property
    def num_replicas(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    @property
    def cell_size(self) -> int:
        """GPUs per failure-counting cell: a domain under packing, a fixed TP group otherwise."""
        return self.domain_size if self.packing else self.tp

    def num_cells(self, spare_domains: int | None = None) -> int:
        spare = self.spare_domains if spare_domains is None else spare_domains
        return (self.num_gpus + spare * self.domain_size) // self.cell_size

    def allowed_degrees(self) -> list[int]:
        """Reduced degrees a damaged TP group may run at, highest first."""
        if self.degraded_tp is not None:
            return sorted(set(self.degraded_tp), reverse=True)
        low = max(1, math.ceil(self.min_degraded_fraction * self.tp))
        return list(range(self.tp - 1, low - 1, -1))

    def degree_map(self) -> np.ndarray:
        """`map[h]`: degree a TP group with h working GPUs runs at (0: it cannot run)."""
        allowed = self.allowed_degrees()
        out = np.zeros(self.tp + 1, dtype=np.int16)
        out[self.tp] = self.tp
        for h in range(1, self.tp):
            out[h] = next((t for t in allowed if t <= h), 0)
        return out


def form_replicas(spec: ClusterSpec, cell_failures: np.ndarray) -> np.ndarray:
    """Degrees of the replicas the manager can form, per sample (0 = replica cannot run).

    `cell_failures` is (samples, cells): failed GPUs per domain (packing) or per TP group.
    Under packing the result is sorted best-first; the job uses the leading replicas.
    """
    f = np.asarray(cell_failures)
    if f.ndim == 1:
        f = f[None, :]
    samples = f.shape[0]
    f = np.minimum(f, spec.cell_size).astype(np.int32)
    dmap = spec.degree_map()
    tp, pp = spec.tp, spec.pp
    if not spec.packing:
        groups = dmap[tp - f]
        n_rep = groups.shape[1] // pp
        return groups[:, : n_rep * pp].reshape(samples, n_rep, pp).min(axis=2)
    if tp <= spec.domain_size:
        k = spec.domain_size // tp
        healthy = spec.domain_size - f
        full, rem = healthy // tp, healthy % tp
        slot = np.arange(k, dtype=np.int32)
        groups = np.where(
            slot < full[..., None], tp, np.where(slot == full[..., None], dmap[rem][..., None], 0)
        ).reshape(samples, -1)
    else:
        per_group = tp // spec.domain_size
        ordered = np.sort(f, axis=1)
        n_groups = ordered.shape[1] // per_group
        healthy = tp - ordered[:, : n_groups * per_group].reshape(samples, n_groups, per_group).sum(axis=2)
        groups = dmap[healthy]
    groups = np.sort(groups.astype(np.int16), axis=1, kind="stable")[:, ::-1]
    n_rep = groups.shape[1] // pp
    return groups[:, : n_rep * pp].reshape(samples, n_rep, pp)[:, :, -1]
