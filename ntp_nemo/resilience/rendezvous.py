"""Generations of process groups on one long-lived store, and forked workers that share it.

The launching process hosts a `TCPStore` on loopback; every worker connects to it once and keeps the
connection for the whole run.  Everything the job reads or writes there goes through a `JobStore` (keys
under the job's prefix, notices signed with the job's secret: `store_auth`).  Generation `g` of the job's
process groups is initialised on `PrefixStore(f"gen{g}", job.store)`, so after a failure the survivors
drop the broken groups and join generation `g + 1` with their new ranks, on the same store, without any
key of the old generation getting in the way.  The store also carries the launcher's signed word to the
workers (`failed_key`: the ranks the launcher saw die; `rejoin_key`: repaired processes joining).
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import os
import re
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ntp_nemo.launch.loopback import LOOPBACK, host_loopback_store, loopback_listener
from ntp_nemo.resilience.nccl_abort import abort_generation, drain_device, prepare_nccl_env, uses_nccl
from ntp_nemo.resilience.sockets import sever
from ntp_nemo.resilience.store_auth import (
    JobStore,
    RendezvousAborted,
    SignedStore,
    UnauthenticatedPeerError,
    authenticate_group,
    job_secret,
    new_secret,
)

STORE_HOST = LOOPBACK


def host_store(port: int = 0, timeout_s: float = 300.0,
               listener: socket.socket | None = None) -> dist.TCPStore:
    """The launcher's store (server side, reachable from this machine only), on `port` (0: a free one), or
    on `listener` (`reserve_port`: a port held since before the workers were forked)."""
    return host_loopback_store(port, timeout_s=timeout_s, listener=listener)


def reserve_port() -> tuple[socket.socket, int]:
    """A loopback listening socket and its port, for a store whose server starts after the workers are
    forked (its server thread must not exist in a fork): the port is held from now on, so neither the
    workers' own gloo sockets nor another job can take it in between, as they could a port found free
    and left unbound (`free_port`: "Address already in use" when the launcher then bound it)."""
    sock = loopback_listener(0)
    return sock, sock.getsockname()[1]


def free_port() -> int:
    """A port free now, for a store started after the workers are forked (its server thread must not
    exist at fork time: a child can inherit one of its locks held)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((STORE_HOST, 0))
        return s.getsockname()[1]


def connect(port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """A worker's client connection to the launcher's store."""
    return dist.TCPStore(STORE_HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def local_secret() -> bytes:
    """The secret of one launch of a job on one machine, fresh every time (the launching process draws it
    before forking; the workers inherit it in memory): with `NTP_JOB_SECRET` set, an HMAC of a fresh
    nonce under it, so that a notice an earlier launch signed (`failed/gen0` of a run that used the same
    `NTP_JOB_SECRET`, read off its store by anyone on the machine) does not verify in the next one."""
    fixed = job_secret()
    if fixed is None:
        return new_secret()
    return hmac.new(fixed, b"ntp_nemo local launch\0" + new_secret(), hashlib.sha256).hexdigest().encode()


def join(store: JobStore, generation: int, rank: int, world_size: int, *, backend: str = "gloo",
         timeout_s: float = 60.0) -> None:
    """Initialise the default process group of `generation` (collective over its `world_size` ranks) on
    the job's store with torch's rendezvous keys signed (`SignedStore`), then make every rank prove the
    job's secret over the new group (`authenticate_group`) before anything else runs on it; a group that
    fails the proof is dropped and UnauthenticatedPeerError raised."""
    bound: dict = {}
    if uses_nccl(backend):
        prepare_nccl_env()  # a lost peer must not make NCCL's watchdog end this survivor
        # Communicators made eagerly on this process's GPU (the one `setup_environment` set current), for
        # the world and every group split from it: a lazy one is created by its first collective, which
        # a point-to-point exchange (the reshard's batch_isend_irecv) needs every rank of it to make.
        bound["device_id"] = torch.device("cuda", torch.cuda.current_device())
    signed = SignedStore(store, f"gen{generation}", timeout_s, abort_key=failed_key(generation))
    store.rendezvous_stores[f"gen{generation}"] = signed
    dist.init_process_group(backend, store=signed, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **bound)
    # On a world with NCCL the proof runs on the GPU: its all-gather is every rank's first call on the
    # NCCL communicator (a mixed world's gloo side would leave the communicator untouched until the reshard).
    device = bound.get("device_id", "cpu")
    try:
        authenticate_group(store, f"gen{generation}", device)
    except UnauthenticatedPeerError:
        leave(store)
        raise


def leave(store: JobStore | None = None) -> None:
    """Drop every process group of the current generation, broken or not (no collective: a peer is gone).

    With `store` (the job's store) the generation's gloo connections are severed first (see `sever`); a
    world with NCCL (`nccl`, `cpu:gloo,cuda:nccl`) has its communicators aborted
    (`nccl_abort.abort_generation`, which severs the gloo half of a mixed world too)."""
    if not dist.is_initialized():
        return
    if uses_nccl(dist.get_backend()):
        abort_generation(store)
        if not drain_device():  # nothing of the old generation may still write into this process's tensors
            raise RuntimeError("the GPU did not finish its work within 60 s of the generation's abort")
        return
    if store is not None and dist.get_backend() == "gloo":
        sever(store)
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - an already broken group may refuse to abort; destroy it anyway
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


SEAL_KEY = "job/seal"  # set by the launcher when it hosts the store: a wiped or overwritten store loses it


def seal_store(store: JobStore) -> str:
    """Mark a freshly hosted store as this job's (a fresh value, signed); returns the value."""
    seal = new_secret().hex()
    store.put(SEAL_KEY, seal)
    return seal


def seal_intact(store: JobStore, seal: str) -> bool:
    """The job's keys are still its own: the seal is there, unchanged (one store round trip)."""
    return store.read(SEAL_KEY) == seal


def resident_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; 0 where it cannot be read): what a flood of
    values on a store this process hosts grows."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def failed_key(generation: int) -> str:
    """Store key under which the launcher lists the ranks of `generation` it saw die."""
    return f"failed/gen{generation}"


def publish_failed(store: JobStore, generation: int, ranks: Sequence[int]) -> None:
    store.put(failed_key(generation), json.dumps(sorted(int(r) for r in ranks)))


def wait_failed(store: JobStore, generation: int, timeout_s: float = 60.0) -> list[int]:
    """The ranks of `generation` the launcher saw die (blocks until it says so; a notice not signed with
    the job's secret is not its word)."""
    return json.loads(store.wait_for(failed_key(generation), timeout_s))


def rejoin_key(generation: int) -> str:
    """Store key under which the launcher announces that repaired processes join after `generation`."""
    return f"rejoin/gen{generation}"


def publish_rejoin(store: JobStore, generation: int, step: int, members: Sequence[int],
                   source: int, *, attempt: int | None = None) -> None:
    """Announce a rejoin: before (1-based) step `step`, generation `generation + 1` has `members`;
    `source` (a survivor's process id) hands the repaired processes the state a checkpoint would.
    With `attempt` (a number of the launcher's), the survivors wait at step `step` for the launcher's
    decision (`decide_rejoin`): join once every repaired process is ready, or cancel and go on."""
    doc = {"step": int(step), "members": [int(m) for m in members], "source": int(source)}
    if attempt is not None:
        doc["attempt"] = int(attempt)
    store.put(rejoin_key(generation), json.dumps(doc))


def ready_key(generation: int, attempt: int, pid: int) -> str:
    """Store key a repaired process sets when it is about to join (rejoin `attempt` after `generation`)."""
    return f"rejoin/gen{generation}/{attempt}/ready/{pid}"


def publish_ready(store: JobStore, generation: int, attempt: int, pid: int) -> None:
    store.put(ready_key(generation, attempt, pid), "1")


def is_ready(store: JobStore, generation: int, attempt: int, pid: int) -> bool:
    return store.read(ready_key(generation, attempt, pid)) is not None


def decide_rejoin(store: JobStore, generation: int, announced: dict, join: bool) -> None:
    """The launcher's word on an announced rejoin: `join` (every repaired process is ready) or cancel
    (one failed: the survivors go on in their generation, which stays the current one)."""
    store.put(rejoin_key(generation), json.dumps({**announced, "decision": "join" if join else "cancel"}))


def read_rejoin(store: JobStore, generation: int) -> dict | None:
    """The rejoin announced for `generation`, or None (one store round trip when none is)."""
    payload = store.read(rejoin_key(generation))
    return None if payload is None else json.loads(payload)


# The job's keys that belong to one generation: its rendezvous and groups (`gen{g}/...`), the launcher's
# word on it (`failed/gen{g}`) and a rejoin announced after it (`rejoin/gen{g}`, `rejoin/gen{g}/...`).
_GENERATION_KEY = re.compile(r"^(?:failed/|rejoin/)?gen(\d+)(?:/|$)")
KEPT_GENERATIONS = 3  # generations whose keys outlive a change of generation (see `prune_generations`)


def prune_generations(store: JobStore, current: int, keep: int = KEPT_GENERATIONS) -> int:
    """Delete the keys of generations before `current - keep + 1` from the job's store (the process
    hosting it calls this when the generation changes); returns how many.  Each generation adds about 40
    keys (its rendezvous, the keys of every group created in it, the launcher's notices): without this a
    job's store grows with every failure.  No process reads a generation's keys once two later ones
    have formed (a failed rejoin re-forms from the one before it: `recovery.recover(notice=...)`)."""
    below = current - keep + 1
    if below <= 0:
        return 0
    return _delete_generations(store, lambda g: g < below)


def drop_generation(store: JobStore, generation: int) -> int:
    """Delete the keys of `generation` alone from the job's store (a withdrawn rejoin's: its repaired
    processes began that generation's rendezvous, and the survivors form a generation of that number
    next, with other ranks); returns how many."""
    return _delete_generations(store, lambda g: g == generation)


def _delete_generations(store: JobStore, chosen) -> int:  # noqa: ANN001 - a predicate on a generation
    """Delete the store's keys of every generation `chosen(g)` accepts; returns how many."""
    try:
        keys = store.store.list_keys()
    except Exception:  # noqa: BLE001 - a store that cannot list its keys keeps them
        return 0
    removed = 0
    for key in keys:
        m = _GENERATION_KEY.match(key)
        if m is not None and chosen(int(m.group(1))):
            try:
                removed += bool(store.store.delete_key(key))
            except Exception:  # noqa: BLE001 - gone already
                pass
    return removed


def store_barrier(store: JobStore, key: str, count: int, timeout_s: float = 60.0,
                  abort_key: str | None = None) -> None:
    """Block until `count` processes have reached `key` (no process group needed).  `abort_key`: a signed
    notice (the launcher's list of lost processes) that ends the wait at once with RendezvousAborted: one
    of the `count` died and will never arrive."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    looked = time.monotonic()
    while store.add(key, 0) < count:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{key}: fewer than {count} processes arrived in {timeout_s:.0f} s")
        if abort_key is not None and now - looked >= SignedStore.SLICE_S:
            looked = now
            lost = store.read(abort_key)
            if lost is not None:
                raise RendezvousAborted(f"{key}: the launcher saw process(es) {lost} exit before every "
                                        f"process arrived")
        time.sleep(0.002)


# ---- forked workers sharing one store (tests, benchmarks) --------------------------------------------
def _worker(rank: int, fn: Callable, world_size: int, port: int, secret: bytes, queue, args: tuple) -> None:
    # What the parent left for its garbage collector (a store whose server thread runs there) is never
    # collected here: its destructor would wait forever for a thread the fork did not copy.
    gc.freeze()
    torch.set_num_threads(1)
    store = JobStore(connect(port), secret)
    try:
        result = fn(rank, world_size, store, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        leave()


def run_elastic(fn: Callable[..., Any], world_size: int, *args: Any, watch: bool = True,
                timeout_s: float = 300.0, grace_s: float = 0.1) -> tuple[dict[int, Any], list[int | None]]:
    """Fork `world_size` workers running `fn(rank, world_size, store, *args)`; `fn` joins generations itself.

    With `watch`, a worker that dies without reporting (a lost rank) is published on the store as failed
    in generation `len(failures so far)`, which is how survivors learn who is gone (deaths within
    `grace_s` of each other count as one failure).  Returns the results of
    the workers that finished, by first-generation rank, and every worker's exit code.  A worker that
    raised makes this raise with its traceback.
    """
    import multiprocessing.connection

    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    gc.collect()  # earlier unreachable stores are destroyed here, where their server threads run
    queue = ctx.SimpleQueue()
    (listener, port), store, secret = reserve_port(), None, local_secret()
    procs = [ctx.Process(target=_worker, args=(r, fn, world_size, port, secret, queue, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    store = JobStore(host_store(timeout_s=timeout_s, listener=listener), secret)  # connections wait for it
    results: dict[int, Any] = {}
    errors: list[str] = []
    finished: set[int] = set()
    dead: set[int] = set()
    generation = 0

    def drain() -> None:
        while not queue.empty():
            rank, status, value = queue.get()
            finished.add(rank)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")

    try:
        while len(finished | dead) < world_size and not errors:
            drain()
            alive = {r: p for r, p in enumerate(procs) if r not in finished | dead}
            ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()], timeout=0.05)
            gone = [r for r, p in alive.items() if p.sentinel in ready]
            if not gone:
                continue
            if watch:  # a failure taking several ranks: collect them all before publishing
                time.sleep(grace_s)
                ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()], timeout=0)
                gone = [r for r, p in alive.items() if p.sentinel in ready]
            drain()  # a worker may have reported just before exiting
            lost = [r for r in gone if r not in finished]
            if lost and watch:
                dead.update(lost)
                publish_failed(store, generation, lost)
                generation += 1
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 2)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # stops the server thread before anything else forks
    if errors:
        raise RuntimeError("worker failed:\n" + "\n".join(errors))
    return results, [p.exitcode for p in procs]

