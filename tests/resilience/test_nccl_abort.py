"""`nccl_abort.abort_generation` on CPU: what it does to a gloo world (nothing), the path it takes for a
world with NCCL (abort, or shrink where torch and NCCL support it), and, from a watcher thread, a
collective blocked on the gloo half of a `cpu:gloo,cuda:nccl` world failing at once.  Real NCCL
communicators need GPUs: tests/gpu/test_live_nccl.py."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ntp_nemo.resilience import nccl_abort
from ntp_nemo.resilience.nccl_abort import abort_generation, can_shrink, nccl_version, prepare_nccl_env
from ntp_nemo.resilience.rendezvous import join, leave, run_elastic

MIXED = "cpu:gloo,cuda:nccl"  # the default backend of a GPU run (lightning/strategy.py)


@pytest.fixture
def gloo_world():
    """A one-rank gloo world in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce_one() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_gloo_world_is_left_alone(gloo_world):
    assert abort_generation() == "none" and abort_generation(lost=[1]) == "none"
    assert dist.is_initialized() and _all_reduce_one() == 1.0


def test_no_world_is_nothing_to_do():
    assert not dist.is_initialized()
    assert abort_generation() == "none"


def test_a_world_with_nccl_is_aborted_and_forgotten(gloo_world, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    extra = dist.new_group([0])  # every group of the generation goes, not only the default one
    assert nccl_version() is None and not can_shrink()  # this CPU build of torch has no NCCL
    assert abort_generation(lost=[1]) == "abort"  # named lost ranks but no shrink: abort
    assert not dist.is_initialized()
    assert extra not in dist.distributed_c10d._world.pg_map


def test_leave_aborts_a_world_with_nccl(gloo_world, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    calls = []
    monkeypatch.setattr("ntp_nemo.resilience.rendezvous.abort_generation",
                        lambda store=None: calls.append(store) or nccl_abort.abort_generation(store))
    leave()
    assert calls == [None] and not dist.is_initialized()


@pytest.mark.parametrize("version,supports,path", [
    ((2, 27, 3), True, "shrink"),
    ((2, 26, 5), True, "abort"),  # ncclCommShrink came with NCCL 2.27
    ((2, 28, 0), False, "abort"),
])
def test_shrink_where_torch_and_nccl_support_it(gloo_world, monkeypatch, version, supports, path):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    monkeypatch.setattr(nccl_abort, "nccl_version", lambda: version)
    backend = SimpleNamespace(supports_shrinking=supports)
    monkeypatch.setattr(nccl_abort, "_nccl_backend", lambda group=None: backend)
    shrunk = []
    monkeypatch.setattr(dist, "shrink_group", lambda ranks, group=None, shrink_flags=0, pg_options=None:
                        shrunk.append((ranks, shrink_flags)))
    assert abort_generation(lost=[3, 1, 3]) == path
    if path == "shrink":
        assert shrunk == [([1, 3], dist.distributed_c10d.SHRINK_ABORT)]
        assert dist.is_initialized()  # the survivors' group is the default one now (here: the stand-in's)
    else:
        assert shrunk == [] and not dist.is_initialized()


def test_without_lost_ranks_there_is_nothing_to_shrink_to(gloo_world, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    monkeypatch.setattr(nccl_abort, "can_shrink", lambda: True)
    monkeypatch.setattr(dist, "shrink_group", lambda *a, **k: pytest.fail("shrink without lost ranks"))
    assert abort_generation() == "abort" and not dist.is_initialized()


def test_nccl_version_codes(monkeypatch):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: 22703, raising=False)
    assert nccl_version() == (2, 27, 3)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2), raising=False)
    assert nccl_version() == (2, 26, 2)


def test_nccl_worlds_keep_survivors_alive(monkeypatch):
    monkeypatch.delenv(nccl_abort.ASYNC_ERROR_HANDLING, raising=False)
    prepare_nccl_env()
    assert nccl_abort.os.environ[nccl_abort.ASYNC_ERROR_HANDLING] == "2"
    monkeypatch.setenv(nccl_abort.ASYNC_ERROR_HANDLING, "1")
    prepare_nccl_env()  # the user's choice stands
    assert nccl_abort.os.environ[nccl_abort.ASYNC_ERROR_HANDLING] == "1"


def _blocked_all_reduce(rank, world_size, store):
    """Rank 0 blocks in an all-reduce rank 1 never enters; its watcher thread aborts the generation."""
    join(store, 0, rank, world_size, timeout_s=60)
    if rank == 1:
        store.wait_for("done", 60)
        return None
    dist.get_backend = lambda group=None: MIXED  # a forked worker: the patch ends with it
    paths = []
    watcher = threading.Thread(target=lambda: (time.sleep(0.5), paths.append(abort_generation(store))))
    watcher.start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        outcome = "completed"
    except Exception as err:  # noqa: BLE001 - what a survivor's training thread sees
        outcome = type(err).__name__
    waited = time.monotonic() - t0
    watcher.join(10)
    store.put("done", "1")
    return {"outcome": outcome, "waited": waited, "paths": paths, "initialized": dist.is_initialized()}


def test_a_watcher_thread_unblocks_a_collective_in_flight():
    results, codes = run_elastic(_blocked_all_reduce, 2, watch=False, timeout_s=120)
    r = results[0]
    assert r["outcome"] != "completed" and r["paths"] == ["abort"], r
    assert r["waited"] < 10, r  # the group's timeout is 60 s: the abort, not a timeout, ended it
    assert r["initialized"] is False and codes == [0, 0]


def test_a_watchdog_abort_counts_as_an_abort_of_the_step(gloo_world, monkeypatch):
    """NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) aborts a communicator that timed out without
    the watcher's `interrupt` counting it: the backend's error makes the step's check refuse the step,
    as an abort the watcher made does (the check let it through before)."""
    from torch._C._distributed_c10d import ErrorType

    from ntp_nemo.resilience.live_worker import GenerationAborted, LiveRecovery

    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    live = LiveRecovery("ntp")
    live.backend = MIXED
    epoch = live.abort_epoch()
    assert nccl_abort.nccl_errors() == []  # no NCCL backend reports an error
    live.check_generation(epoch)
    timed_out = SimpleNamespace(get_error=lambda: ErrorType.TIMEOUT)
    monkeypatch.setattr(nccl_abort, "_nccl_backend", lambda group=None: timed_out)
    assert [e.split(": ")[-1] for e in nccl_abort.nccl_errors()] == ["TIMEOUT"]
    with pytest.raises(GenerationAborted, match="TIMEOUT"):
        live.check_generation(epoch)


def test_generation_0_of_a_live_run_gets_the_nccl_environment(monkeypatch):
    """The first generation of a local live run (the strategy's own process group, not `rendezvous.join`)
    is created with the watchdog told to let a survivor live, as every later generation is."""
    from ntp_nemo.resilience.live_worker import LiveRecovery

    monkeypatch.delenv(nccl_abort.ASYNC_ERROR_HANDLING, raising=False)
    assert LiveRecovery("ntp").init_process_group(SimpleNamespace(process_group_backend="gloo")) is False
    assert nccl_abort.ASYNC_ERROR_HANDLING not in os.environ
    assert LiveRecovery("ntp").init_process_group(SimpleNamespace(process_group_backend=MIXED)) is False
    assert os.environ[nccl_abort.ASYNC_ERROR_HANDLING] == nccl_abort.CLEAN_UP_ONLY


def test_leave_waits_for_the_gpu_to_finish_after_the_abort(gloo_world, monkeypatch):
    """On NCCL, `leave` aborts the communicators and then waits (bounded) until the GPU has no work in
    flight, so nothing of the old generation writes into tensors the recovery reads; a device that does
    not drain ends the live path with an error instead of a recovery from tensors still being written."""
    order = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: MIXED)
    monkeypatch.setattr("ntp_nemo.resilience.rendezvous.abort_generation",
                        lambda store=None: order.append("abort") or nccl_abort.abort_generation(store))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("synchronize"))
    leave()
    assert order == ["abort", "synchronize"] and not dist.is_initialized()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: time.sleep(5))
    assert nccl_abort.drain_device(timeout_s=0.2) is False
