"""Run a function on N local worker processes joined in one gloo/NCCL process group.

Used by tests and benchmarks (Lightning runs are launched by the NTPStrategy instead).  Workers
are forked (spawned if this process already initialised CUDA): the parent's imports are shared, and
a FileStore avoids port clashes.
"""

from __future__ import annotations

import gc
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int, fn: Callable, world_size: int, store_path: str, backend: str, queue, args: tuple,
    timeout_s: float = 120.0,
) -> None:
    # What the parent left for its garbage collector (a store whose server thread runs there) is never
    # collected here: its destructor would wait forever for a thread the fork did not copy.
    gc.freeze()
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report any failure to the parent, then re-raise
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                timeout_s: float = 120.0) -> list[Any]:
    """Fork `world_size` workers running `fn(rank, world_size, *args)`; return their results by rank.
    `timeout_s`: the default process group's collective timeout."""
    # Fork shares the parent's imports; a parent that already initialised CUDA cannot fork CUDA users.
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    gc.collect()  # earlier unreachable stores are destroyed here, where their server threads run
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, fn, world_size, store_path, backend, queue, args, timeout_s))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors = []
        for _ in range(world_size):
            rank, status, value = queue.get()
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
        for p in procs:
            p.join(timeout=5 if errors else None)
            if p.is_alive():
                p.kill()
        if errors:
            raise RuntimeError("worker failed:\n" + "\n".join(errors))
        return [results[r] for r in range(world_size)]
