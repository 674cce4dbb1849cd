"""The fork helpers of tests and benchmarks (`launch.workers.run_workers`, `rendezvous.run_elastic`)
never let a forked worker destroy a store whose server thread runs in the parent: such a store left in
the parent's unreachable objects (an earlier test's) made a worker's garbage collection wait forever in
the store's destructor (a join on a thread the fork did not copy), and the whole run with it."""

from __future__ import annotations

import gc
import threading

import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.resilience.rendezvous import run_elastic


def _collect(rank, world_size, *store):
    gc.collect()  # what the interpreter does by itself at some allocation
    return rank


def _garbage_store() -> None:
    """A store hosted here (its server thread in this process), left unreachable in a reference cycle."""
    cycle: list = [dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)]
    cycle.append(cycle)


def _bounded(call, timeout_s: float = 60.0):
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(result=call()), daemon=True)
    worker.start()
    worker.join(timeout_s)
    return out.get("result")


def test_forked_workers_never_collect_a_store_the_parent_left_behind():
    enabled = gc.isenabled()
    gc.disable()  # the parent's own collection must not clean up before the fork by chance
    try:
        _garbage_store()
        assert _bounded(lambda: run_workers(_collect, 2)) == [0, 1]
        _garbage_store()
        results = _bounded(lambda: run_elastic(_collect, 2))
        assert results is not None and results[0] == {0: 0, 1: 1}
    finally:
        if enabled:
            gc.enable()
