"""A generation's rendezvous on the job's store: torch's keys signed, every rank proving the secret.

An outsider that reaches the store (any local process, for a run on one machine) could write the keys
torch's rendezvous reads and point a rank at a listener of its own; the first exchanges on a rejoin's
group unpickle what arrives.  These tests run torch's real rendezvous (gloo, forked ranks) on a real
`TCPStore`."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_nemo.resilience.rendezvous import free_port, host_store, join, leave
from ntp_nemo.resilience.store_auth import JobStore, SignedStore, authenticate_group, key_prefix

SECRET = b"0123456789abcdef0123456789abcdef"


def test_an_unsigned_value_is_waited_past_until_the_jobs_own_arrives():
    server = host_store(0, timeout_s=10)
    job = JobStore(server, SECRET)
    signed = SignedStore(job, "gen4", timeout_s=0.5)
    signed.set("addr/0", b"\x00binary\xffvalue")
    assert signed.get("addr/0") == b"\x00binary\xffvalue"
    # An outsider writes the key through the same store (it can list and write every key).
    dist.PrefixStore("gen4", job.store).set("addr/1", b"127.0.0.1:9999")
    with pytest.raises(TimeoutError, match="no value signed with the job's secret under the rendezvous key"):
        signed.get("addr/1")
    # A value with a made-up signature, or one replayed from another generation, reads as absent too.
    dist.PrefixStore("gen4", job.store).set("addr/2", b"0" * 64 + b":" + b"127.0.0.1:9999")
    SignedStore(job, "gen3", 1).set("addr/3", b"an earlier generation's value")
    raw = dist.PrefixStore("gen3", job.store).get("addr/3")
    dist.PrefixStore("gen4", job.store).set("addr/3", raw)  # replayed under generation 4's key
    for key in ("addr/2", "addr/3"):
        with pytest.raises(TimeoutError):
            signed.get(key)
    # The job's writer overwrites the outsider's value: a reader already waiting gets the real one.
    slow = SignedStore(job, "gen4", timeout_s=10)
    writer = threading.Timer(0.3, lambda: SignedStore(job, "gen4", 10).set("addr/1", b"the real address"))
    writer.start()
    assert slow.get("addr/1") == b"the real address"
    writer.join()


def _rank(rank: int, port: int, secrets: list[bytes], generations: list[int], delay: list[float],
          out) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        job = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)),
                       SECRET)  # the job's key prefix, which anyone who lists the store learns
        job._secret = secrets[rank]  # what it signs with: the job's secret, or an outsider's guess
        for g in generations:
            time.sleep(delay[rank])
            join(job, g, rank, 2, timeout_s=8)
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            box = [{"from": 0}] if rank == 0 else [None]
            dist.broadcast_object_list(box, src=0)
            out.put((rank, g, "ok", t.item(), box[0]))
            leave(job)
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((rank, None, type(err).__name__, str(err)[:400], None))


def _gated(go, target, *args) -> None:
    if not go.wait(30):
        os._exit(3)
    target(*args)


@contextmanager
def _forked(ctx, target, args_of_rank: list[tuple]):
    """The ranks, all forked before any of them connects to the store this process hosts, then released:
    a fork while the store's server thread accepts a connection copies glibc's resolver lock held (the
    accept looks up the peer's name), and the child's own connect then waits on it forever. Ranks still
    running when the block ends are killed."""
    go = ctx.Event()
    procs = [ctx.Process(target=_gated, args=(go, target, *args)) for args in args_of_rank]
    for p in procs:
        p.start()
    go.set()
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _run(secrets: list[bytes], generations: list[int], delay: list[float], port: int) -> list[tuple]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with _forked(ctx, _rank, [(r, port, secrets, generations, delay, out) for r in range(2)]) as procs:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = []
    while not out.empty():
        results.append(out.get())
    return sorted(results, key=lambda r: (r[0], r[1] or 0))


def test_a_generations_rendezvous_ignores_the_previous_generations_keys_replayed_under_its_prefix():
    """Generation 1 forms; everything torch's rendezvous wrote for it is copied (as an outsider can: list
    and read) under generation 2's prefix before generation 2 starts, rank 0 arriving a second late.
    Signed values name their generation, so the replayed ones read as absent; rank 1 waits for rank 0's
    own, and generation 2 forms and carries objects between the real ranks.  (With two ranks torch's gloo
    rendezvous also formed on the replayed keys before signing: this pins the signed behaviour.)"""
    server = host_store(free_port(), timeout_s=30)
    port = server.port
    first = _run([SECRET, SECRET], [1], [0.0, 0.0], port)
    assert [r[2] for r in first] == ["ok", "ok"], first
    job = JobStore(server, SECRET)
    # torch's keys of generation 1 (under the job prefix), replayed under generation 2's
    keys = [k for k in _job_keys(server) if k.startswith("gen1/")]
    assert keys, "generation 1 wrote no rendezvous key under the job's prefix"
    for k in keys:
        job.store.set("gen2/" + k[len("gen1/"):], job.store.get(k))
    second = _run([SECRET, SECRET], [2], [1.0, 0.0], port)
    assert [(r[1], r[2], r[3], r[4]) for r in second] == [(2, "ok", 3.0, {"from": 0})] * 2, second


def _job_keys(server: dist.TCPStore) -> list[str]:
    """Every key of the job holding SECRET, as an outsider lists them (without its prefix)."""
    head = key_prefix(SECRET) + "/"
    return [k[len(head):] for k in server.list_keys() if k.startswith(head)]


def test_a_rank_without_the_secret_is_refused_before_any_object_is_unpickled():
    """Rank 1 is an outsider: it listed the job's keys (so it writes under the job's prefix) but does not
    hold the secret.  Its rendezvous values read as absent to rank 0 and the group cannot form; the join
    fails on both sides within the timeout, and no object crosses."""
    server = host_store(free_port(), timeout_s=30)
    results = _run([SECRET, b"not the job's secret but 32 char"], [1], [0.0, 0.0], server.port)
    assert [r[2] for r in results] != ["ok", "ok"], results
    assert all(r[4] is None for r in results), results


def _prove(rank: int, port: int, secret: bytes, out) -> None:
    import torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=10))
    try:
        authenticate_group(JobStore(store, secret), "plain")
        out.put((rank, "proved"))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(err).__name__}: {err}"))
    dist.destroy_process_group()


def test_the_group_proof_names_the_rank_that_does_not_hold_the_secret():
    """Over a group formed without signed keys (as an outsider that won a rendezvous would have it), the
    proof of the secret fails on the honest rank, naming the other one; with one secret both pass."""
    server = host_store(free_port(), timeout_s=30)
    ctx = mp.get_context("fork")
    for secrets, expect in (((SECRET, SECRET), ["proved", "proved"]),
                            ((SECRET, b"an outsider's guess, 32 chars!!!"), None)):
        out = ctx.Queue()
        for k in [k for k in server.list_keys() if k.startswith("plain")]:
            server.delete_key(k)
        with _forked(ctx, _prove, [(r, server.port, secrets[r], out) for r in range(2)]) as procs:
            for p in procs:
                p.join(60)
            got = dict(out.get(timeout=5) for _ in range(2))
        if expect is not None:
            assert [got[0], got[1]] == expect, got
        else:
            assert got[0].startswith("UnauthenticatedPeerError: rank(s) [1] of the process group plain"), got
            assert got[1].startswith("UnauthenticatedPeerError: rank(s) [0]"), got


def _join_alone(port: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    job = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=90)), SECRET)
    t = time.monotonic()
    try:
        join(job, 5, 0, 2, timeout_s=60)
        out.put(("formed", time.monotonic() - t, ""))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put((type(err).__name__, time.monotonic() - t, str(err)))


def test_a_generation_whose_member_died_while_forming_stops_waiting_at_the_launchers_notice():
    """Rank 0 forms generation 5 with a 60 s timeout; its peer never comes (it died while the generation
    formed, e.g. a repaired process killed after the rejoin was decided).  The launcher publishes its
    signed notice of the loss (`failed/gen5`), and rank 0's rendezvous ends within a second of it,
    naming the lost process, instead of waiting out the 60 s."""
    from ntp_nemo.resilience.rendezvous import publish_failed

    server = host_store(free_port(), timeout_s=90)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_join_alone, args=(server.port, out))
    proc.start()
    time.sleep(2.0)  # rank 0 waits in torch's rendezvous
    noticed = time.monotonic()
    publish_failed(JobStore(server, SECRET), 5, [1])
    kind, waited, text = out.get(timeout=30)
    took = time.monotonic() - noticed
    proc.join(10)
    assert kind == "RendezvousAborted", (kind, text)
    assert "gen5 cannot form: the launcher saw process(es) [1] of it exit while it formed" in text, text
    assert took < 5.0 and waited < 20.0, (took, waited)
