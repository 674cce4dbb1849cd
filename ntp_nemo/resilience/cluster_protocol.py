"""What `ntp-coordinator` and the tasks of a cluster job say to each other.

The coordinator hosts the job's store (a `TCPStore` at `NTP_COORDINATOR`, normally
`$MASTER_ADDR:$MASTER_PORT`) and a second listening socket, the *link*, whose port it publishes on the
store (`LINK_KEY`, signed).  Every task keeps one link connection open for its whole life:

- the coordinator sees a task die the moment its kernel closes the connection (`kill -9`, a crash, a
  lost node: the peer's FIN or RST), without waiting for a heartbeat to go stale;
- the task sees the coordinator die the same way;
- the task's heartbeats travel on it (progress and a tick), so nothing written to the store, which
  anyone who reaches its port can overwrite, decides whether a task is alive;
- the coordinator wakes the survivors with a line (`look`) right after it publishes a failure, so
  that survivors blocked in a collective with a hung peer sever their connections at once.

What the recovery acts on (`failed/gen{g}`, `rejoin/gen{g}`) stays on the store, signed with the job's
secret and its instance (`store_auth`).  A connection proves it holds the job's secret before it gets a
place (an HMAC of both sides' fresh nonces), so a stray process cannot take a place, and its disconnect
cannot be taken for a lost rank; the coordinator proves the same to the task by sealing its reply.

Messages are JSON objects, one per line.  The first two lines are the hello; every later line, in both
directions, is *sealed*: `{"m": MESSAGE, "n": COUNTER, "mac": HMAC}` under a session key derived from the
job's secret and both nonces, with a counter per direction, so neither side acts on a line the other did
not write on this connection (forged, replayed from another connection, or repeated):

    coordinator -> task   {"nonce": NC}                         on accept (plain)
    task -> coordinator   {"auth": HMAC, "nonce": NT, "want": P, "ntasks": N, "host": H, "pid": OS_PID}
    coordinator -> task   {"place": P, "mode": "start" | "rejoin", "world": W, "generation": G,
                           "instance": I}
                          | {"wait": WHY}                       a spare: its place comes later
                          | {"refused": WHY}                    (plain when the task's proof failed)
    task -> coordinator   {"beat": [STEP, PHASE], "tick": K}    progress; K grows with every beat
    task -> coordinator   {"ready": true}                       a replacement, before it joins
    coordinator -> task   {"rejoin": G, "source": S, "step": T}   the generation it joins
    coordinator -> task   {"look": G}                           failed/gen{G} was just published
    coordinator -> task   {"declared": "lost"}                  you were declared lost (hung): stop
    coordinator -> task   {"end": WHY}                          stop now
    task -> coordinator   {"bye": "done" | "idle" | "fallback" | "lost" | "error"}

`I`, the job's *instance*, is drawn by the coordinator when it starts; the notices it signs on the store
carry it (`JobStore.bound`), so a notice of an earlier job that used the same secret reads as absent.

Parsing is bounded: a line longer than `MAX_LINE` bytes, nested deeper than `MAX_DEPTH`, or not a JSON
object ends that connection (`Line.error` says why); nothing a peer sends raises out of `receive`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from collections.abc import Mapping

from ntp_nemo.errors import ConfigError

COORDINATOR_ENV = "NTP_COORDINATOR"  # HOST:PORT of the coordinator's store (set by the batch script)
LINK_KEY = "coordinator/link"  # the link's port, signed

COORDINATOR_LOST_EXIT = 76  # a task stopped because the coordinator died: resubmit with resume=auto
DECLARED_LOST_EXIT = 77  # a task the coordinator declared lost (hung) that ran again afterwards

MAX_LINE = 16384  # bytes: the longest message of the protocol is a few hundred
MAX_DEPTH = 4  # nesting of a message: an object holding a short list
_READ = 65536


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


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def auth_tag(secret: bytes, nonce: str, task_nonce: str = "") -> str:
    """The task's proof of the job's secret for the coordinator's `nonce` (and its own `task_nonce`)."""
    return _mac(secret, "ntp_nemo link hello", nonce, task_nonce)


def claim_tag(secret: bytes, claim: str) -> str:
    """The task's early proof, sent the moment it connects (before the coordinator's nonce arrives): it
    shows the coordinator that this connection is one of the job's own, so strangers flooding the link
    cannot push it out while its hello is under way. It proves nothing else (the hello still answers a
    fresh nonce)."""
    return _mac(secret, "ntp_nemo link claim", claim)


def claim_ok(secret: bytes, msg: dict) -> bool:
    claim, tag = msg.get("claim"), msg.get("tag")
    if not isinstance(claim, str) or not isinstance(tag, str) or len(claim) > 64:
        return False
    return hmac.compare_digest(tag.encode(), claim_tag(secret, claim).encode())


def task_claim(line: Line, secret: bytes) -> bool:
    """Send the task's claim (`claim_tag`) on a fresh link connection."""
    claim = secrets.token_hex(16)
    return line.send({"claim": claim, "tag": claim_tag(secret, claim)})


def auth_ok(secret: bytes, nonce: str, tag: object, task_nonce: object = "") -> bool:
    if not isinstance(tag, str) or not isinstance(task_nonce, str):
        return False
    return hmac.compare_digest(tag.encode(), auth_tag(secret, nonce, task_nonce).encode())


def session_key(secret: bytes, nonce: str, task_nonce: str) -> bytes:
    """The key that seals every later line of one connection (fresh on both sides: no replay across
    connections or jobs)."""
    return hmac.new(secret, f"ntp_nemo link session\0{nonce}\0{task_nonce}".encode(), hashlib.sha256).digest()


def _depth(text: bytes) -> int:
    """Deepest nesting of `[`/`{` in a JSON text (outside strings), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse(line: bytes) -> dict | str:
    """One line of the protocol: the message, or why it is refused (a string)."""
    if len(line) > MAX_LINE:
        return f"a line of more than {MAX_LINE} bytes"
    if _depth(line) > MAX_DEPTH:
        return f"JSON nested deeper than {MAX_DEPTH} levels"
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON"
    return msg if isinstance(msg, dict) else "not a JSON object"


class Line:
    """One end of a link connection: JSON objects, one per line, sealed once `seal` is called.

    `receive` never raises: a connection that breaks the protocol (too long a line, too deep, not JSON)
    reads as closed and `error` says why; a sealed line that fails its check (forged, replayed, out of
    order) is dropped and counted in `rejected`."""

    def __init__(self, sock: socket.socket, *, limit: int = MAX_LINE) -> None:
        self.sock = sock
        self.limit = int(limit)
        self._buf = bytearray()
        self._scanned = 0  # bytes of `_buf` known to hold no newline
        self.error: str | None = None
        self.received = 0  # bytes read so far
        self.rejected = 0  # sealed lines that failed their check
        self.last_rejected: dict | None = None  # the latest of them (a plain refusal, to report)
        self._key: bytes | None = None
        self._me = self._peer = ""
        self._sent = self._expected = 0
        self._send_lock = threading.Lock()
        self.owner: object = None  # what this connection is to its server (the coordinator's bookkeeping)

    def fileno(self) -> int:
        return self.sock.fileno()

    def seal(self, key: bytes, me: str) -> None:
        """From now on, seal what this end sends as `me` ("coordinator" or "task") and accept only lines
        the other end sealed under `key`, in order."""
        self._key, self._me = key, me
        self._peer = "task" if me == "coordinator" else "coordinator"

    @property
    def sealed(self) -> bool:
        return self._key is not None

    def send(self, msg: dict) -> bool:
        """False when the other end is gone (or would block: a peer that does not read is not waited
        for)."""
        with self._send_lock:
            if self._key is not None:
                body = json.dumps(msg, sort_keys=True, separators=(",", ":"))
                n = self._sent
                self._sent += 1
                data = {"m": msg, "n": n, "mac": _mac(self._key, self._me, str(n), body)}
            else:
                data = msg
            try:
                self.sock.sendall(json.dumps(data).encode() + b"\n")
                return True
            except OSError:
                return False

    def _unseal(self, env: dict) -> dict | None:
        msg, n, tag = env.get("m"), env.get("n"), env.get("mac")
        if not isinstance(msg, dict) or not isinstance(n, int) or not isinstance(tag, str):
            return None
        body = json.dumps(msg, sort_keys=True, separators=(",", ":"))
        if n != self._expected or not hmac.compare_digest(tag.encode(),
                                                          _mac(self._key, self._peer, str(n), body).encode()):
            return None
        self._expected += 1
        return msg

    def receive(self) -> list[dict] | None:
        """The complete messages readable now (one read, which blocks on a blocking socket); None at end of
        stream or when the peer broke the protocol (`error`)."""
        if self.error is not None:
            return None
        try:
            chunk = self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not chunk:
            return None
        self.received += len(chunk)
        self._buf += chunk
        out = []
        while True:
            end = self._buf.find(b"\n", self._scanned)
            if end < 0:
                self._scanned = len(self._buf)
                if len(self._buf) > self.limit:
                    self.error = f"a line of more than {self.limit} bytes"
                    return None
                return out
            raw = bytes(self._buf[:end])
            del self._buf[:end + 1]
            self._scanned = 0
            msg = parse(raw) if len(raw) <= self.limit else f"a line of more than {self.limit} bytes"
            if isinstance(msg, str):
                self.error = msg
                return None
            if self._key is not None:
                opened = self._unseal(msg)
                if opened is None:
                    self.rejected += 1
                    self.last_rejected = msg
                    continue
                msg = opened
            out.append(msg)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def task_hello(line: Line, secret: bytes, nonce: str, *, want: int, ntasks: int, host: str, pid: int) -> None:
    """The task's side of the hello: prove the job's secret for the coordinator's `nonce` with a fresh nonce
    of its own, then seal the connection (the coordinator's reply is the first sealed line)."""
    mine = secrets.token_hex(16)
    line.send({"auth": auth_tag(secret, nonce, mine), "nonce": mine, "want": want, "ntasks": ntasks,
               "host": host, "pid": pid})
    line.seal(session_key(secret, nonce, mine), "task")
