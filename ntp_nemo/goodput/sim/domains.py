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
            bad = [
                t
                for t in self.degraded_tp
                if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t < self.tp
            ]
            if bad:
                raise ConfigError(
                    "cluster.degraded_tp",
                    f"entries {bad} are not reduced degrees; each must be an integer in "
                    f"[1, tp-1={self.tp - 1}].",
                )
        if not 0 < self.min_degraded_fraction <= 1:
            raise ConfigError(
                "cluster.min_degraded_fraction", f"must be in (0, 1], got {self.min_degraded_fraction!r}."
            )
        if (
            isinstance(self.spare_domains, bool)
            or not isinstance(self.spare_domains, int)
            or self.spare_domains < 0
        ):
            raise ConfigError(
                "cluster.spare_domains", f"must be a non-negative integer, got {self.spare_domains!r}."
            )
        if self.spare_domains and not self.packing:
            raise ConfigError(
                "cluster.spare_domains",
                "spare domains need cluster.packing=true (the manager swaps them in).",
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


def _rows_bincount(values: np.ndarray, top: int) -> np.ndarray:
    """Per-row histogram of small non-negative ints: (rows, n) -> (rows, top + 1)."""
    rows = values.shape[0]
    flat = (np.arange(rows)[:, None] * (top + 1) + values).ravel()
    return np.bincount(flat, minlength=rows * (top + 1)).reshape(rows, top + 1)


def _static_replicas(spec: ClusterSpec, f: np.ndarray) -> np.ndarray:
    """Fixed groups and replicas: replica degree = smallest group degree in its block."""
    groups = spec.degree_map()[spec.tp - f]
    n_rep = groups.shape[1] // spec.pp
    return groups[:, : n_rep * spec.pp].reshape(f.shape[0], n_rep, spec.pp).min(axis=2)


@dataclass(frozen=True)
class DamagedDomains:
    """Sparse failures of many cluster states: (state, domain, failed GPUs) of each damaged domain.

    Entries are sorted by domain, so the failures of the first n domains (a pool with fewer spare
    domains) are a prefix; a state's cost follows its failures, not the cluster size.
    """

    samples: int
    domain_size: int
    row: np.ndarray
    domain: np.ndarray
    failed: np.ndarray

    @classmethod
    def from_dense(cls, domain_failures: np.ndarray, domain_size: int) -> DamagedDomains:
        f = np.atleast_2d(domain_failures)
        row, domain = np.nonzero(f)
        order = np.argsort(domain, kind="stable")
        row, domain = row[order], domain[order]
        return cls(f.shape[0], domain_size, row, domain, np.minimum(f[row, domain], domain_size))

    def levels(self, num_domains: int) -> np.ndarray:
        """(samples, domain_size + 1): domains among the first `num_domains` with f failed GPUs."""
        end = int(np.searchsorted(self.domain, num_domains))
        width = self.domain_size + 1
        flat = self.row[:end] * width + self.failed[:end]
        out = np.bincount(flat, minlength=self.samples * width).reshape(self.samples, width)
        out[:, 0] = num_domains - out[:, 1:].sum(axis=1)
        return out


def domain_levels(domain_failures: np.ndarray, domain_size: int) -> np.ndarray:
    """(samples, domain_size + 1): how many domains have f failed GPUs, for f = 0..domain_size."""
    return _rows_bincount(np.minimum(domain_failures, domain_size), domain_size)


def group_table(spec: ClusterSpec) -> np.ndarray:
    """`table[f]`: TP groups by degree that one domain with f failed GPUs yields (tp <= domain_size).

    h = domain_size - f working GPUs give floor(h/tp) full groups and one leftover group of degree
    map[h % tp] (0 if it cannot run); the remaining slots are idle (degree 0).
    """
    size, tp, dmap = spec.domain_size, spec.tp, spec.degree_map()
    k = size // tp
    table = np.zeros((size + 1, tp + 1), dtype=np.int64)
    for f in range(size + 1):
        full = (size - f) // tp
        table[f, tp] += full
        if full < k:
            table[f, dmap[(size - f) % tp]] += 1
            table[f, 0] += k - full - 1
    return table


def _spanning_groups(spec: ClusterSpec, f: np.ndarray) -> np.ndarray:
    """tp > domain_size: a group spans several domains; the least damaged domains are paired together."""
    samples, n_dom = f.shape
    per_group = spec.tp // spec.domain_size
    n_groups = n_dom // per_group
    ordered = np.sort(f, axis=1)[:, : n_groups * per_group]
    healthy = spec.tp - ordered.reshape(samples, n_groups, per_group).sum(axis=2)
    return _rows_bincount(spec.degree_map()[healthy], spec.tp)


def cut_replicas(groups: np.ndarray, pp: int) -> np.ndarray:
    """Replicas of `pp` groups from a group histogram, best groups first, counted by degree.

    A replica's degree is its last (smallest) group's, so #replicas of degree >= d is
    floor(#groups of degree >= d / pp).
    """
    at_least = np.cumsum(groups[:, ::-1], axis=1)[:, ::-1] // pp
    return at_least - np.concatenate([at_least[:, 1:], np.zeros((groups.shape[0], 1), np.int64)], axis=1)


def replica_histogram(spec: ClusterSpec, cell_failures: np.ndarray) -> np.ndarray:
    """Replicas the manager can form, counted by degree: (samples, tp + 1); degree 0 cannot run.

    `cell_failures` is (samples, cells): failed GPUs per domain (packing) or per TP group.
    """
    f = np.minimum(np.atleast_2d(cell_failures), spec.cell_size).astype(np.int64)
    if not spec.packing:
        return _rows_bincount(_static_replicas(spec, f), spec.tp)
    if spec.tp > spec.domain_size:
        return cut_replicas(_spanning_groups(spec, f), spec.pp)
    return replica_histogram_from_levels(spec, domain_levels(f, spec.domain_size))


def replica_histogram_from_levels(spec: ClusterSpec, levels: np.ndarray) -> np.ndarray:
    """Packing with tp <= domain_size, from (samples, domain_size + 1) counts of domains by failures."""
    return cut_replicas(levels @ group_table(spec), spec.pp)


def form_replicas(spec: ClusterSpec, cell_failures: np.ndarray) -> np.ndarray:
    """Degree of every formed replica, per sample: best-first under packing, fixed order without."""
    f = np.minimum(np.atleast_2d(cell_failures), spec.cell_size).astype(np.int64)
    if not spec.packing:
        return _static_replicas(spec, f)
    hist = replica_histogram(spec, f)
    degrees = np.arange(spec.tp, -1, -1)
    return np.stack([np.repeat(degrees, row[::-1]) for row in hist])
