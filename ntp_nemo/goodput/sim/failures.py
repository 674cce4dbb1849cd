"""Failure models: uniformly random placements for a failed fraction, and Poisson failure traces.

Placements are returned as failed-GPU counts per *cell* (a domain, or a TP group without
packing), which is all the resource manager needs. Failures come in blocks of `blast_radius`
aligned GPUs (1 = a single GPU).

Traces: failure events arrive as a Poisson process at `rate_per_gpu_hour x multiplier x GPUs`
(the rate counts events, so a larger blast radius means more GPUs down, not more events); each
takes down one uniformly chosen block; a fraction `hardware_fraction` are hardware faults
repaired after `hardware_repair_hours` (one value drawn uniformly from the list), the rest
software faults repaired after `software_repair_hours`. With `steady_state` the trace starts
one longest repair time before t=0, so the cluster is already in its failure steady state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_nemo.errors import ConfigError

EXACT, BERNOULLI = "exact", "bernoulli"


@dataclass(frozen=True)
class FailureSpec:
    """Failure-rate and repair assumptions (defaults: Llama 3 on 16K H100, 5-day hardware repair)."""

    rate_per_gpu_hour: float = 419 / (54 * 24 * 16384)
    rate_multipliers: tuple[float, ...] = (1.0,)
    hardware_fraction: float = 0.78
    hardware_repair_hours: tuple[float, ...] = (120.0,)
    software_repair_hours: float = 3.0
    blast_radius: int = 1
    days: float = 15.0
    steady_state: bool = True
    max_spare_domains: int = 256

    def __post_init__(self) -> None:
        if not self.rate_per_gpu_hour > 0:
            raise ConfigError(
                "failures.rate_per_gpu_hour", f"must be positive, got {self.rate_per_gpu_hour!r}."
            )
        if not self.rate_multipliers or any(not m > 0 for m in self.rate_multipliers):
            raise ConfigError(
                "failures.rate_multipliers", f"must be positive numbers, got {self.rate_multipliers!r}."
            )
        if not 0 <= self.hardware_fraction <= 1:
            raise ConfigError(
                "failures.hardware_fraction", f"must be in [0, 1], got {self.hardware_fraction!r}."
            )
        if not self.hardware_repair_hours or any(not h > 0 for h in self.hardware_repair_hours):
            raise ConfigError(
                "failures.hardware_repair_hours",
                f"must be positive hours, got {self.hardware_repair_hours!r}.",
            )
        if not self.software_repair_hours > 0:
            raise ConfigError(
                "failures.software_repair_hours",
                f"must be positive hours, got {self.software_repair_hours!r}.",
            )
        if (
            isinstance(self.blast_radius, bool)
            or not isinstance(self.blast_radius, int)
            or self.blast_radius < 1
        ):
            raise ConfigError(
                "failures.blast_radius", f"must be a positive integer, got {self.blast_radius!r}."
            )
        if not self.days > 0:
            raise ConfigError("failures.days", f"must be positive, got {self.days!r}.")
        if (
            isinstance(self.max_spare_domains, bool)
            or not isinstance(self.max_spare_domains, int)
            or (self.max_spare_domains < 0)
        ):
            raise ConfigError(
                "failures.max_spare_domains",
                f"must be a non-negative integer, got {self.max_spare_domains!r}.",
            )

    @property
    def horizon_hours(self) -> float:
        return self.days * 24.0

    @property
    def burn_in_hours(self) -> float:
        return max(max(self.hardware_repair_hours), self.software_repair_hours) if self.steady_state else 0.0


def check_blast_radius(blast_radius: int, cell_size: int) -> None:
    if cell_size % blast_radius:
        raise ConfigError(
            "failures.blast_radius",
            f"{blast_radius} does not divide the {cell_size}-GPU cells (domains or TP groups); "
            "choose a divisor so a failure block never straddles two cells.",
        )


def sample_placements(
    n_cells: int,
    cell_size: int,
    failed_fraction: float,
    samples: int,
    rng: np.random.Generator,
    sampling: str = EXACT,
    blast_radius: int = 1,
) -> np.ndarray:
    """Failed GPUs per cell for `samples` random placements, shape (samples, n_cells).

    `exact`: round(p * GPUs / blast_radius) distinct blocks fail (without replacement);
    `bernoulli`: every block fails independently with probability p.
    """
    check_blast_radius(blast_radius, cell_size)
    blocks_per_cell = cell_size // blast_radius
    n_blocks = n_cells * blocks_per_cell
    if sampling == BERNOULLI:
        return rng.binomial(blocks_per_cell, failed_fraction, size=(samples, n_cells)) * blast_radius
    if sampling != EXACT:
        raise ConfigError(
            "placements.sampling", f"unknown mode {sampling!r}; use {EXACT!r} or {BERNOULLI!r}."
        )
    k = int(round(failed_fraction * n_blocks))
    out = np.zeros((samples, n_cells), dtype=np.int64)
    if k == 0:
        return out
    picks = np.stack([rng.choice(n_blocks, size=k, replace=False) for _ in range(samples)])
    flat = (np.arange(samples)[:, None] * n_cells + picks // blocks_per_cell).ravel()
    return np.bincount(flat, minlength=samples * n_cells).reshape(samples, n_cells) * blast_radius


@dataclass(frozen=True)
class Trace:
    """Down intervals of individual GPUs (merged where one GPU failed again while down), in hours."""

    gpu: np.ndarray
    start: np.ndarray
    end: np.ndarray
    num_events: int
    num_hardware: int
    horizon_hours: float
    pool_gpus: int

    def extended_by(self, other: Trace) -> Trace:
        """This trace followed by `other` on the next `other.pool_gpus` GPUs (a larger pool)."""
        return Trace(
            np.concatenate([self.gpu, other.gpu + self.pool_gpus]),
            np.concatenate([self.start, other.start]),
            np.concatenate([self.end, other.end]),
            self.num_events + other.num_events,
            self.num_hardware + other.num_hardware,
            self.horizon_hours,
            self.pool_gpus + other.pool_gpus,
        )


def generate_trace(
    pool_gpus: int, spec: FailureSpec, rate_multiplier: float, rng: np.random.Generator
) -> Trace:
    """Sample one failure trace over [-burn_in, days*24) hours for a pool of `pool_gpus` GPUs."""
    check_blast_radius(spec.blast_radius, pool_gpus)
    t0, horizon = -spec.burn_in_hours, spec.horizon_hours
    rate = spec.rate_per_gpu_hour * rate_multiplier * pool_gpus  # failure events per hour
    n = int(rng.poisson(rate * (horizon - t0)))
    times = np.sort(rng.uniform(t0, horizon, size=n))
    block = rng.integers(0, pool_gpus // spec.blast_radius, size=n)
    hardware = rng.random(n) < spec.hardware_fraction
    hw_repair = np.asarray(spec.hardware_repair_hours)[
        rng.integers(0, len(spec.hardware_repair_hours), size=n)
    ]
    repair = np.where(hardware, hw_repair, spec.software_repair_hours)
    offsets = np.arange(spec.blast_radius)
    gpu = (block[:, None] * spec.blast_radius + offsets).ravel()
    start = np.repeat(times, spec.blast_radius)
    end = np.repeat(times + repair, spec.blast_radius)
    gpu, start, end = _merge_intervals(gpu, start, end)
    keep = end > 0
    return Trace(gpu[keep], start[keep], end[keep], n, int(hardware.sum()), horizon, pool_gpus)


def _merge_intervals(gpu: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Union of down intervals per GPU, so a GPU that fails while down is counted once."""
    order = np.lexsort((start, gpu))
    gpu, start, end = gpu[order], start[order], end[order]
    out_g: list[int] = []
    out_s: list[float] = []
    out_e: list[float] = []
    for g, s, e in zip(gpu.tolist(), start.tolist(), end.tolist(), strict=True):
        if out_g and out_g[-1] == g and s <= out_e[-1]:
            out_e[-1] = max(out_e[-1], e)
        else:
            out_g.append(g)
            out_s.append(s)
            out_e.append(e)
    return np.array(out_g, dtype=np.int64), np.array(out_s), np.array(out_e)


def trace_states(trace: Trace, cell_size: int, n_cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Piecewise-constant cluster states over [0, horizon): (start times, durations, failures per cell).

    Only GPUs in the first `n_cells` cells count, so one trace drawn for the largest pool serves
    every smaller pool with the same failures (coupled samples).
    """
    inside = trace.gpu < n_cells * cell_size
    gpu, start, end = trace.gpu[inside], trace.start[inside], trace.end[inside]
    edges = np.concatenate(
        [
            [0.0],
            start[(start > 0) & (start < trace.horizon_hours)],
            end[(end > 0) & (end < trace.horizon_hours)],
        ]
    )
    times = np.unique(edges)
    durations = np.diff(np.append(times, trace.horizon_hours))
    delta = np.zeros((len(times) + 1, n_cells), dtype=np.int32)
    cell = gpu // cell_size
    np.add.at(delta, (np.searchsorted(times, np.maximum(start, 0.0)), cell), 1)
    np.add.at(delta, (np.searchsorted(times, np.minimum(end, trace.horizon_hours)), cell), -1)
    return times, durations, np.cumsum(delta, axis=0)[:-1]
