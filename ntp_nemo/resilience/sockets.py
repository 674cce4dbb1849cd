"""Stopping a broken gloo generation: shut down this process's connected TCP sockets.

Below both `rendezvous` (whose `leave` severs a gloo world) and `nccl_abort` (which severs the gloo half
of a mixed world), so neither imports the other for it.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from ntp_nemo.resilience.store_auth import JobStore


def sever(store: JobStore | None) -> int:
    """Shut down this process's connected TCP sockets other than its store connection; returns how many.

    Aborting a gloo process group neither unblocks a collective in flight nor closes its connections
    while Python objects (the old model's layers) still reference the group, so a peer blocked on this
    process would wait for the whole collective timeout.  Shutting the sockets down makes every pending
    and future gloo operation of this generation, here and at the peers, fail at once ("connection
    closed"), which is how a failure spreads to every survivor in milliseconds.  Listening sockets are
    left alone (gloo's listener aborts the process if its socket is shut), and so are the job's own
    sockets it lists in `keep_fds` (a cluster task's link to the coordinator).  NCCL communicators are not
    sockets; their abort (`leave`, `nccl_abort.abort_generation`) is what stops them."""
    skip = _store_address(store)
    keep = getattr(store, "keep_fds", set())
    count = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or not _is_socket(fd):
            continue
        try:
            dup = os.dup(fd)  # closed below: the original stays with its owner (gloo, a DirectGroup)
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket after all: `socket` leaves the descriptor open
            os.close(dup)
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()[:2]
            except OSError:  # listening or unconnected
                continue
            ends = (peer, sock.getsockname()[:2])  # either end: a forked worker inherits the server's side
            if skip is not None and any(p == skip[1] and _same_host(h, skip[0]) for h, p in ends):
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.close()
    return count


def _is_socket(fd: int) -> bool:
    """`fd` is open and a socket.  Checked before duplicating it: a duplicate of a file, pipe or epoll
    descriptor that `socket.socket` then refuses is never closed (each sever doubled every non-socket
    descriptor of the process: 60 after start-up, about 2,000 after five live recoveries)."""
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:  # closed since the listing (the listing's own descriptor, for one)
        return False


def _store_address(job: JobStore | None) -> tuple[str, int] | None:
    store = job.store if job is not None else None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return socket.gethostbyname(store.host), int(store.port)
    return None


def _same_host(a: str, b: str) -> bool:
    return a == b or (a.startswith("127.") and b.startswith("127.")) or a in ("::1", "::ffff:" + b)
