"""Nothing of a generation outlives it: ten failure-and-rejoin cycles in one job leave every survivor
with the open descriptors and threads it had after the first.

One job of forked workers on gloo (TP groups on `ntpdirect`, as a CPU run makes them), layout TP 2 x
DP 2, driving the live-recovery code itself: each cycle, process 3 completes a step and dies (exit 137);
the launcher (this process, hosting the store) publishes the loss; the survivors fail in their next
step, `recover` (sever and leave the generation, join the next, rebuild on (2,1), reshard from memory),
redo the step, and at the next step boundary `grow` back to the nominal layout, which a repaired process
3 (forked here, as `LiveLauncher.respawn` does) joins with `arrive`.  After each rejoin every survivor
counts its descriptors and threads at the same point (after a step on the nominal layout).  The repaired
process says it runs on another node (SLURMD_NODENAME): every rejoin reports its TP group across nodes,
no shrink (the survivors share one node) does.

Before the fix, `sockets.sever` duplicated every non-socket descriptor of a survivor on each recovery
and never closed the duplicates: the counts doubled every cycle (about 45, 120, 240, ...).
"""

from __future__ import annotations

import gc
import multiprocessing.connection
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from ntp_nemo.resilience.policies import make_policy
from ntp_nemo.resilience.recovery import Generation, arrive, grow, recover
from ntp_nemo.resilience.rendezvous import (
    connect,
    host_store,
    join,
    leave,
    local_secret,
    prune_generations,
    publish_failed,
    reserve_port,
)
from ntp_nemo.resilience.store_auth import JobStore
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA, OPTIM

pytestmark = pytest.mark.slow

CYCLES = 10
HANDFUL = 4  # descriptors or threads a survivor may hold above its first cycle's count
LOST = 3  # the process lost in every cycle
SPARE_NODE = "spare-node-of-the-test"  # where the repaired process says it runs
SEQ, GLOBAL_BATCH, SEED, TIMEOUT_S = 8, 4, 3, 60.0
NOMINAL = ResolvedLayout.make(Topology(2, [2, 2], [2] * (LLAMA.num_layers + 2)))


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _build(layout: ResolvedLayout, rank: int, keep=None):
    return assemble(layout, rank, LLAMA, OPTIM, None, seed=SEED, param_dtype=torch.float32, keep=keep)


def _step(state, step: int) -> None:
    toks = torch.randint(0, LLAMA.vocab_size, (GLOBAL_BATCH, SEQ + 1),
                         generator=torch.Generator().manual_seed(step))
    micro = [toks[i : i + 1] for i in state.my_microbatches(GLOBAL_BATCH)]
    train_step(state, micro, toks[:, 1:].numel(), max_norm=None)


def _survivor(pid: int, store: JobStore) -> list[tuple[int, int]]:
    gen = Generation.first(NOMINAL)
    join(store, 0, pid, NOMINAL.world_size, timeout_s=TIMEOUT_S)
    state = _build(NOMINAL, pid)
    opt = state.optimizer

    def rebuild(layout, rank):  # the same optimizer object on the new parameters, as a run keeps it
        return _build(layout, rank, keep=(opt, state.model))

    counts, step = [], 0
    cross = []  # each recovery's and rejoin's line on a TP group across nodes (None: none)
    for _ in range(CYCLES):
        _step(state, step)  # with process LOST, which then dies
        step += 1
        counts.append(_counts())
        try:
            _step(state, step)
            raise AssertionError(f"step {step} completed without process {LOST}")
        except RuntimeError:  # its connections closed: the live recovery
            rec = recover(store, gen, pid, step, (state.model, opt), rebuild, make_policy("ntp"),
                          timeout_s=TIMEOUT_S)
        assert rec is not None and rec.generation.layout.describe() == "(2,1)"
        cross.append(rec.cross_node)
        gen, state = rec.generation, rec.state
        _step(state, step)  # redone on the degraded layout
        step += 1
        rec = grow(store, gen, NOMINAL, pid, step, (state.model, opt), rebuild, timeout_s=TIMEOUT_S)
        cross.append(rec.cross_node)
        gen, state = rec.generation, rec.state
    _step(state, step)
    counts.append(_counts())
    return {"counts": counts, "cross_node": cross}


def _lost(store: JobStore, generation: int) -> None:
    """Process LOST: from start-up (generation 0) or as the repaired process of a rejoin (`generation`
    the one it joins), one step on the nominal layout, then it dies, unless it is the last."""
    join(store, generation, LOST, NOMINAL.world_size, timeout_s=TIMEOUT_S)
    state = _build(NOMINAL, LOST)
    step = 0
    if generation:
        os.environ["SLURMD_NODENAME"] = SPARE_NODE  # a replacement started on another node
        step, _ = arrive(state.model, state.optimizer, NOMINAL.replica_of(LOST))
    _step(state, step)
    if generation < 2 * CYCLES:
        os._exit(137)


def _process(pid: int, port: int, secret: bytes, generation: int, queue) -> None:
    gc.freeze()  # the launcher's store (its server thread is not in this fork) is never collected here
    torch.set_num_threads(1)
    try:
        store = JobStore(connect(port, TIMEOUT_S), secret)
        if pid == LOST:
            _lost(store, generation)
            queue.put((pid, "ok", None))
        else:
            queue.put((pid, "ok", _survivor(pid, store)))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((pid, "error", traceback.format_exc()))
    finally:
        leave()
    os._exit(0)


def _job() -> tuple[dict[int, list[tuple[int, int]]], list[int]]:
    """The job above: the survivors' counts by process id, and the number of keys on the job's store
    after each loss (pruned as the launcher prunes them)."""
    ctx = mp.get_context("fork")
    gc.collect()
    queue = ctx.SimpleQueue()
    (listener, port), secret = reserve_port(), local_secret()
    procs = [ctx.Process(target=_process, args=(p, port, secret, 0, queue))
             for p in range(NOMINAL.world_size)]
    for p in procs:
        p.start()
    store = JobStore(host_store(timeout_s=TIMEOUT_S, listener=listener), secret)
    results: dict[int, list] = {}
    errors: list[str] = []
    losses = 0
    keys: list[int] = []  # the job's store keys after each change of generation
    deadline = time.monotonic() + 300
    try:
        while len(results) < NOMINAL.world_size - 1 and not errors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not end in 300 s ({losses} losses so far)")
            lost = procs[LOST]
            gone = multiprocessing.connection.wait([lost.sentinel], timeout=0.05) and losses < CYCLES
            while not queue.empty():
                pid, status, value = queue.get()
                if status == "error":
                    errors.append(f"process {pid}:\n{value}")
                elif pid != LOST:
                    results[pid] = value
            if gone and not errors:
                lost.join()
                assert lost.exitcode == 137, f"process {LOST} ended with exit status {lost.exitcode}"
                publish_failed(store, 2 * losses, [LOST])
                prune_generations(store, 2 * losses + 1)  # as `LiveMonitor` does at each change
                losses += 1  # generation 2k - 1: the degraded layout; 2k: the rejoin
                prune_generations(store, 2 * losses)
                keys.append(len(store.store.list_keys()))
                procs[LOST] = ctx.Process(target=_process, args=(LOST, port, secret, 2 * losses, queue))
                procs[LOST].start()
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    assert not errors, "\n".join(errors)
    return results, keys


def test_ten_failure_and_rejoin_cycles_leave_every_survivor_its_first_cycles_descriptors_and_threads():
    results, keys = _job()
    assert sorted(results) == [0, 1, 2]
    # about 20 more a cycle when no generation's keys are deleted; the count at a loss varies with where
    # the survivors are in their recovery (25 to 40 here)
    assert len(keys) == CYCLES and max(keys) <= 2 * max(keys[:3]), f"the job's store keys per cycle: {keys}"
    for pid, res in results.items():
        counts = res["counts"]
        assert len(counts) == CYCLES + 1, counts
        shrinks, rejoins = res["cross_node"][0::2], res["cross_node"][1::2]
        assert shrinks == [None] * CYCLES, shrinks  # survivors of one node
        for line in rejoins:  # the repaired process 3 on another node: the group of ranks 2 and 3
            assert line is not None and "TP group of ranks [2, 3] (replica 1, stage 0)" in line, line
            assert f"{SPARE_NODE} (ranks [3])" in line and "kept" in line, line
        fds = [c[0] for c in counts]
        threads = [c[1] for c in counts]
        # counts[0]: generation 0; counts[1]: after the first failure-and-rejoin cycle
        assert max(fds[1:]) - fds[1] <= HANDFUL, f"process {pid}: open descriptors per cycle {fds}"
        assert max(threads[1:]) - threads[1] <= HANDFUL, f"process {pid}: threads per cycle {threads}"
