"""A launcher's store port is held from before its workers are forked until its store serves on it.

The store's server thread must start after the fork (a fork copies no thread), so the port used to be
found free, left unbound while the workers started, then bound: in between, a worker's own gloo socket
or another job's could take it ("Address already in use" ended a relaunch once in a full suite run).
"""

from __future__ import annotations

import errno
import gc
import socket
from datetime import timedelta

import torch.distributed as dist

from ntp_nemo.resilience.rendezvous import host_store, reserve_port


def _bind_error(port: int) -> int | None:
    """The errno of binding 127.0.0.1:`port` (what a worker's socket or another job would meet)."""
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        other.bind(("127.0.0.1", port))
    except OSError as err:
        return err.errno
    finally:
        other.close()
    return None


def test_a_reserved_port_cannot_be_taken_and_the_store_serves_on_it():
    listener, port = reserve_port()
    assert _bind_error(port) == errno.EADDRINUSE
    server = host_store(timeout_s=30, listener=listener)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    try:
        assert server.port == port
        client.set("k", "v")
        assert server.get("k") == b"v"
    finally:
        # Destroyed here, where the server thread runs, not in a later test's forked child's collection.
        del client, server
        gc.collect()
