"""Runs launched on one machine listen on loopback only.

torch's `TCPStore` server binds every interface whatever host name it is given, so the store of a local
run would be reachable from the network.  `host_loopback_store` hands torch a socket already bound to
127.0.0.1 (`master_listen_fd`) instead.  gloo and NCCL pick the address they listen on from the host
name unless told an interface: `loopback_children_env` names the loopback interface for the workers a
launching process forks (and points them at the loopback store).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def loopback_listener(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` (0: a free port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def host_loopback_store(port: int = 0, *, timeout_s: float = 300.0, multi_tenant: bool = False,
                        listener: socket.socket | None = None) -> dist.TCPStore:
    """A `TCPStore` server reachable from this machine only, on `port` (0: a free one; read `.port`).

    `listener`: a socket from `loopback_listener` to serve on instead (a port held since before the
    workers were forked: nothing else can take it meanwhile; the server thread starts only here).
    With `multi_tenant`, a later `TCPStore(..., port, is_master=True, multi_tenant=True)` in this process
    (torch's own env:// rendezvous) serves from this server instead of binding every interface itself."""
    sock = listener if listener is not None else loopback_listener(port)
    bound = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, bound, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=multi_tenant,
                         master_listen_fd=sock.detach())


def loopback_interface() -> str | None:
    """The name of the loopback interface (`lo` on Linux, `lo0` on macOS), None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    exact = [n for n in names if n in ("lo", "lo0")]
    return (exact or [n for n in names if n.startswith("lo")] or [None])[0]


@contextmanager
def loopback_children_env() -> Iterator[None]:
    """While it is open, processes forked or started here rendezvous on 127.0.0.1 and gloo/NCCL listen on
    the loopback interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`); the environment is restored after."""
    values = {"MASTER_ADDR": LOOPBACK}
    iface = loopback_interface()
    if iface is not None:
        values.update(GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface)
    with environment(values):
        yield


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in os.environ while it is open; every variable is restored (or removed) after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
