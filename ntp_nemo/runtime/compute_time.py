"""`ComputeTimer`: how long this rank spends computing its share of a step, not waiting for its peers.

The window is the step's micro-batch phase (`train_step`'s `microbatches`: every forward and backward of
this replica's micro-batches), from its start to the moment the rank is ready for the step's data-parallel
collectives; the waits for slower peers come after it (the gradient sync, the fused scalars).  On a CPU
runtime the host clock measures the work itself; on a GPU the phase only queues kernels, so a pair of
CUDA events brackets it and is read at the next step, when the step's one host read has completed them
(the figure then lags one step; nothing waits for the device in the hot path).

`slowdown` makes the rank behave as a slower device (the `slow` fault's `factor`): after measuring the
phase it sleeps `(1/factor - 1)` times the measured time, inside the window, so the figure it reports is
the slow device's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MEASURED_PHASE = "microbatches"


class ComputeTimer:
    """Times `train_step`'s micro-batch phase (`phase` is the step's `phase=` argument)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        self.factor = 1.0  # the speed this rank computes at (`slow` fault); 1: its own
        self.last_s = 0.0  # the last completed measurement, seconds
        self.own_cpu_s = 0.0  # CPU seconds this timer spent on itself (its bookkeeping, not the phase)
        self._events: tuple | None = None  # CUDA: the events of the last phase, read at the next one

    def slowdown(self, factor: float) -> None:
        """From the next step on, compute at `factor` of this device's speed (1: its own speed)."""
        self.factor = float(factor)

    def _cuda_reading(self) -> float | None:
        if self._events is None:
            return None
        start, end = self._events
        return start.elapsed_time(end) / 1000.0 if end.query() else None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name != MEASURED_PHASE:
            yield
            return
        c0 = time.process_time()
        cuda = self.device.type == "cuda"
        if cuda:
            done = self._cuda_reading()
            if done is not None:
                self.last_s = done
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        c1 = time.process_time()
        yield
        c2 = time.process_time()
        took = time.perf_counter() - t0
        if self.factor < 1.0:
            # CUDA: the host saw only the kernels' launch; stretch by the last device reading instead
            base = self.last_s * self.factor if cuda else took
            extra = base * (1.0 / self.factor - 1.0)
            if cuda:
                torch.cuda._sleep(int(extra * 1.4e9))  # device cycles at roughly 1.4 GHz
            else:
                time.sleep(extra)
            took += extra
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (start, end)
        else:
            self.last_s = took
        self.own_cpu_s += (c1 - c0) + (time.process_time() - c2)

    def reading(self, device: torch.device | str) -> torch.Tensor:
        """The last measurement as a 0-dim float64 tensor on `device` (for the step's fused scalars)."""
        return torch.tensor(self.last_s, dtype=torch.float64).to(device, non_blocking=True)


__all__ = ["MEASURED_PHASE", "ComputeTimer"]
