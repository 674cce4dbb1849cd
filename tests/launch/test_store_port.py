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


def _serves(server: dist.TCPStore, port: int) -> None:
    """The store `server` is on `port`: a client there sets a key the server then holds."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    try:
        assert server.port == port
        client.set("k", "v")
        assert server.get("k") == b"v"
    finally:
        del client


def test_a_reserved_port_cannot_be_taken_and_the_store_serves_on_it():
    listener, port = reserve_port()
    assert _bind_error(port) == errno.EADDRINUSE
    server = host_store(timeout_s=30, listener=listener)
    try:
        _serves(server, port)
    finally:
        # Destroyed here, where the server thread runs, not in a later test's forked child's collection.
        del server
        gc.collect()


def test_a_forked_launch_holds_the_env_rendezvous_port_and_rank_0_serves_on_it(monkeypatch):
    """The plain launch (`ForkLauncher.launch`): Lightning chose the env:// port as one found free and
    closed, bound by rank 0 after the fork ("Address already in use" ended three runs of one full suite).
    Now the port is listening before the fork, rank 0's store serves on that socket, and it is released
    when the launch ends; a MASTER_PORT the user set is used as it is."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from ntp_nemo.lightning.adapter import ForkLauncher
    from ntp_nemo.lightning.strategy import NTPStrategy
    from ntp_nemo.topology import ResolvedLayout, Topology

    monkeypatch.delenv("MASTER_PORT", raising=False)
    strategy = NTPStrategy(ResolvedLayout.make(Topology(2, [2], [2] * 4)))
    strategy.cluster_environment = LightningEnvironment()  # what Lightning gives ranks it forks
    launcher = ForkLauncher(strategy)
    strategy._launcher = launcher
    with launcher._held_rendezvous_port():
        port = strategy.cluster_environment.main_port
        assert launcher.listener is not None and launcher.listener.getsockname()[1] == port
        assert _bind_error(port) == errno.EADDRINUSE  # nothing can take it before rank 0's store serves
        server = strategy._loopback_rendezvous_store()  # rank 0 (forked, it holds a copy of the socket)
        try:
            _serves(server, port)
        finally:
            del server
            gc.collect()
    assert launcher.listener is None and _bind_error(port) is None  # released with the launch

    given = socket.socket()
    given.bind(("127.0.0.1", 0))
    chosen = given.getsockname()[1]
    given.close()
    monkeypatch.setenv("MASTER_PORT", str(chosen))
    strategy.cluster_environment = LightningEnvironment()
    with launcher._held_rendezvous_port():
        assert launcher.listener is None and strategy.cluster_environment.main_port == chosen
