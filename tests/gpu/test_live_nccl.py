"""Live failover on NCCL: survivors of a rank killed mid-collective abort the generation and carry on.

THIS TEST HAS NEVER RUN: it was written on a machine without GPUs and needs two or more CUDA GPUs
(skipped otherwise).  Whatever it reports on its first run is the first evidence about
`ntp_nemo.resilience.nccl_abort` on real NCCL communicators; until then `fault.recovery=auto` keeps the
restart path on GPUs.

What it does (up to 4 GPUs, one process each, forked by `rendezvous.run_elastic`, whose parent never
initialises CUDA): every process joins generation 0 on NCCL and checks one all-reduce; the survivors
then start a second all-reduce and the last rank exits with status 137 instead of entering it.  The
launcher publishes the loss on the store; each survivor's watcher thread, on that notice, calls
`abort_generation(store)` while the survivor's main thread waits on the collective.  The wait must end
well inside the group's timeout; the survivors then join generation 1 on its `PrefixStore`, renumbered,
and an all-reduce there gives the right sum.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from ntp_nemo.launch.devices import cuda_device_count

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cuda_device_count() < 2, reason="needs two or more CUDA GPUs"),
]

TIMEOUT_S = 120.0  # the groups' collective timeout: the abort must end the wait long before it


def _worker(rank, world_size, store):
    import torch
    import torch.distributed as dist

    from ntp_nemo.resilience.nccl_abort import abort_generation
    from ntp_nemo.resilience.rendezvous import join, store_barrier, wait_failed

    torch.cuda.set_device(rank)
    join(store, 0, rank, world_size, backend="nccl", timeout_s=TIMEOUT_S)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert float(t) == world_size
    store_barrier(store, "warm", world_size, TIMEOUT_S)
    victim = world_size - 1
    if rank == victim:
        time.sleep(1.0)  # the survivors are inside the all-reduce by now
        os._exit(137)  # a lost GPU, as the fault injector's kill_rank looks

    paths: list[str] = []
    lost: list[int] = []

    def watch() -> None:  # the cluster task's watcher: the launcher's notice, then the abort
        lost.extend(wait_failed(store, 0, TIMEOUT_S))
        paths.append(abort_generation(store))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    outcome = "completed"
    try:
        work = dist.all_reduce(torch.ones(1, device="cuda"), async_op=True)
        work.wait()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - what a survivor's training thread would see
        outcome = f"{type(err).__name__}: {str(err)[:200]}"
    waited = time.monotonic() - t0
    watcher.join(TIMEOUT_S)

    survivors = world_size - 1
    join(store, 1, rank, survivors, backend="nccl", timeout_s=TIMEOUT_S)  # ranks 0..survivors-1 keep theirs
    t = torch.full((1,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    total = float(t)
    dist.destroy_process_group()
    return {"outcome": outcome, "waited": waited, "paths": paths, "lost": lost, "total": total,
            "survivors": survivors}


def test_survivors_abort_the_generation_and_all_reduce_on_the_next():
    from ntp_nemo.resilience.rendezvous import run_elastic

    world_size = min(4, cuda_device_count())
    results, codes = run_elastic(_worker, world_size, watch=True, timeout_s=4 * TIMEOUT_S)
    assert codes[-1] == 137 and all(c == 0 for c in codes[:-1]), codes
    assert sorted(results) == list(range(world_size - 1)), results
    for r in results.values():
        assert r["lost"] == [world_size - 1] and r["paths"] == ["abort"], r
        assert r["waited"] < TIMEOUT_S / 2, r  # the abort ended the wait, not the collective timeout
        n = r["survivors"]
        assert r["total"] == n * (n + 1) / 2, r
