"""What `ntp-coordinator` and the tasks of a cluster job say to each other.

The coordinator hosts the job's store (a `TCPStore` at `NTP_COORDINATOR`, normally
`$MASTER_ADDR:$MASTER_PORT`) and a second listening socket, the *link*, whose port it publishes on the
store (`LINK_KEY`, signed).  Every task keeps one link connection open for its whole life:

- the coordinator sees a task die the moment its kernel closes the connection (`kill -9`, a crash, a
  lost node: the peer's FIN or RST), without waiting for a heartbeat to go stale;
- the task sees the coordinator die the same way;
- the coordinator wakes the survivors with a line (`look`) right after it publishes a failure, so
  that survivors blocked in a collective with a hung peer sever their connections at once.

Everything the recovery acts on (`failed/gen{g}`, `rejoin/gen{g}`, heartbeats) stays on the store,
signed with the job's secret (`store_auth`); the link only carries liveness, places and wake-ups.  A
connection proves it holds the job's secret before it gets a place (an HMAC of a fresh nonce), so a
stray process cannot take a place, and its disconnect cannot be taken for a lost rank.

Messages are JSON objects, one per line:

    coordinator -> task   {"nonce": HEX}                      on accept
    task -> coordinator   {"auth": HMAC, "want": P, "ntasks": N, "host": H, "pid": OS_PID}
    coordinator -> task   {"place": P, "mode": "start" | "rejoin", "world": W, "generation": G}
                          | {"refused": WHY}
    task -> coordinator   {"ready": true}                     a replacement, before it joins
    coordinator -> task   {"rejoin": G, "source": S, "step": T}   the generation it joins
    coordinator -> task   {"look": G}                         failed/gen{G} was just published
    coordinator -> task   {"declared": "lost"}                you were declared lost (hung): stop
    coordinator -> task   {"end": WHY}                        stop now (the job falls back to restart)
    task -> coordinator   {"bye": "done" | "idle" | "fallback" | "lost" | "error"}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from collections.abc import Mapping

from ntp_nemo.errors import ConfigError

COORDINATOR_ENV = "NTP_COORDINATOR"  # HOST:PORT of the coordinator's store (set by the batch script)
LINK_KEY = "coordinator/link"  # the link's port, signed

COORDINATOR_LOST_EXIT = 76  # a task stopped because the coordinator died: resubmit with resume=auto
DECLARED_LOST_EXIT = 77  # a task the coordinator declared lost (hung) that ran again afterwards


def coordinator_address(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(host, port) from `NTP_COORDINATOR`, or None when unset; a malformed value is a ConfigError."""
    env = os.environ if env is None else env
    value = env.get(COORDINATOR_ENV, "").strip()
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            COORDINATOR_ENV,
            f"{value!r} is not HOST:PORT; the batch script exports "
            f"`{COORDINATOR_ENV}=$MASTER_ADDR:$MASTER_PORT`, the address `ntp-coordinator` listens on "
            "(it prints `coordinator ready on HOST:PORT`).",
        )
    return host.strip("[]"), int(port)


def auth_tag(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, b"ntp_nemo link " + nonce.encode(), hashlib.sha256).hexdigest()


def auth_ok(secret: bytes, nonce: str, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(tag.encode(), auth_tag(secret, nonce).encode())


class Line:
    """One end of a link connection: JSON objects, one per line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict) -> bool:
        """False when the other end is gone."""
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
            return True
        except OSError:
            return False

    def receive(self) -> list[dict] | None:
        """The complete messages readable now (blocks for one read); None at end of stream."""
        try:
            chunk = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not chunk:
            return None
        self._buf += chunk
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                return None  # not our protocol: treat as a broken connection
            if isinstance(msg, dict):
                out.append(msg)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
