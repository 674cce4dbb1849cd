"""The job's view of a store others can reach: keys under a prefix derived from the job's secret, and
every notice of the recovery protocol signed with it.

A `TCPStore` authenticates nobody: any process that reaches its port can list, read and write every key
(`list_keys` included).  A prefix derived from the secret keeps the keys of jobs sharing one store (a
cluster coordinator) apart, but it can be listed; what makes a forged notice harmless is the signature.
Each value written with `JobStore.put` (failure notices, rejoin announcements) carries an HMAC-SHA256 of
its key and payload under the job's secret and the job's *instance* (a cluster job's coordinator draws
one when it starts: `bound`), and `read`/`wait_for` treat a value without a valid one as
absent, so a process without the secret cannot make the job act on a notice it wrote, and a notice of an
earlier job that used the same secret does not count in the next.  Generation-specific notices carry
their generation in the key (`failed/gen{g}`), which the signature covers.

The secret comes from `NTP_JOB_SECRET` (exported by the batch script or the coordinator: never a command
line argument, never logged or written to the run directory); a run launched on one machine without it
uses one generated in memory by the launching process, which its forked workers inherit.

torch's own rendezvous of a generation's process groups (every rank's gloo address, the groups' keys)
goes through a `SignedStore`: values signed on `set`, and a value without a valid signature read as not
there yet, so a process without the secret cannot point a rank at its own listener by pre-writing an
address.  `authenticate_group` then makes every rank of a freshly formed group prove the secret over the
group itself (tensors only, nothing unpickled) before the job exchanges any Python object on it.

Not covered: counters (`add`, the store barriers) are not signed, and gloo/NCCL traffic is neither
authenticated nor encrypted after the proof.  A process that reaches the store can still stall a run or
make a rendezvous fail; keep jobs on a trusted network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ntp_nemo.errors import ConfigError

SECRET_ENV = "NTP_JOB_SECRET"
MIN_SECRET_CHARS = 16
_SEP = b":"


def job_secret(required_by: str | None = None) -> bytes | None:
    """The job's secret from `NTP_JOB_SECRET`; None when unset, unless `required_by` (what needs it) is
    given: then a missing or short secret is a ConfigError (exit 2).  The value is never echoed."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        if required_by is None:
            return None
        raise ConfigError(
            SECRET_ENV,
            f"{required_by} can be reached from other machines and admits only processes holding the "
            f"job's secret, but {SECRET_ENV} is not set. Export the same random value to every process of "
            f"the job before it starts, e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)` in the batch "
            "script (not as a command-line argument: command lines are visible to every user of a node "
            "and recorded in the run directory).",
        )
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(
            SECRET_ENV,
            f"the job's secret is {len(value)} characters long; use at least {MIN_SECRET_CHARS} random "
            f"ones, e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)`.",
        )
    return value.encode()


def new_secret() -> bytes:
    """A fresh random secret (for a job launched on one machine: held in memory, inherited by forks)."""
    return secrets.token_hex(32).encode()


def key_prefix(secret: bytes) -> str:
    """The key prefix of the job holding `secret` (reveals nothing of the secret)."""
    return "job-" + hmac.new(secret, b"ntp_nemo store prefix", hashlib.sha256).hexdigest()[:32]


class JobStore:
    """A job's keys on a shared store: `store` (a `PrefixStore` under `key_prefix(secret)`) is what torch
    gets for the job's rendezvous; `put`/`read`/`wait_for` carry signed notices."""

    def __init__(self, store: dist.Store, secret: bytes, instance: str = "") -> None:
        self.store = dist.PrefixStore(key_prefix(secret), store)
        self._secret = secret
        self.instance = str(instance)
        # Sockets of the job's own that severing a generation leaves open (a cluster task's link to its
        # coordinator: `rendezvous.sever`).
        self.keep_fds: set[int] = set()
        # Each generation's `SignedStore`, held for the job's life: torch's process groups keep only the
        # C++ half of a Python store, which cannot call back into Python once the Python object is gone.
        self.rendezvous_stores: dict[str, SignedStore] = {}

    def bound(self, instance: str) -> JobStore:
        """The same keys, with notices signed for (and read only from) the job instance `instance`."""
        other = JobStore.__new__(JobStore)
        other.store, other._secret, other.instance, other.keep_fds = (self.store, self._secret, str(instance),
                                                                      self.keep_fds)
        other.rendezvous_stores = self.rendezvous_stores
        return other

    @property
    def secret(self) -> bytes:
        """The job's secret (never printed: see `__repr__`)."""
        return self._secret

    def __repr__(self) -> str:
        return "JobStore(<secret hidden>)"

    def _tag(self, key: str, payload: bytes) -> bytes:
        msg = self.instance.encode() + b"\0" + key.encode() + b"\0" + payload
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest().encode()

    def _verified(self, key: str, raw: bytes) -> str | None:
        tag, sep, payload = bytes(raw).partition(_SEP)
        if not sep or not hmac.compare_digest(tag, self._tag(key, payload)):
            return None
        return payload.decode()

    def put(self, key: str, payload: str) -> None:
        """Write `payload` under `key`, signed."""
        data = payload.encode()
        self.store.set(key, self._tag(key, data) + _SEP + data)

    def read(self, key: str) -> str | None:
        """The signed payload under `key`, or None (absent, or not signed with the job's secret)."""
        if not self.store.check([key]):
            return None
        return self._verified(key, self.store.get(key))

    def wait_for(self, key: str, timeout_s: float) -> str:
        """Block until `key` holds a payload signed with the job's secret (an unsigned or forged value is
        waited past: the job's own writer overwrites it).  After `timeout_s`: TimeoutError, whether the key
        was never written or holds only unsigned values."""
        deadline = time.monotonic() + timeout_s
        expired = TimeoutError(f"no notice signed with the job's secret under {key!r} in {timeout_s:.0f} s")
        while True:
            left = deadline - time.monotonic()
            if left < 0.001:  # the store counts whole milliseconds: less would be a wait of 0 ms
                raise expired
            try:
                self.store.wait([key], timedelta(seconds=left))
            except dist.DistStoreError as err:
                if "timeout" not in str(err).lower():
                    raise  # the store itself failed: not a timeout
                raise expired from err
            payload = self._verified(key, self.store.get(key))
            if payload is not None:
                return payload
            time.sleep(0.01)

    def add(self, key: str, amount: int) -> int:
        """A counter under the job's prefix (not signed: see the module docstring)."""
        return int(self.store.add(key, amount))


class SignedStore(dist.Store):
    """The store torch's rendezvous of one generation uses: `job`'s keys under `prefix`, every value
    signed with the job's secret on `set` and checked on `get`.  A forged or unsigned value is waited
    past until the job's own writer's value is there, for at most the store's timeout (then the
    rendezvous fails: the failure an outsider can still cause, not a peer it can plant)."""

    SLICE_S = 0.25  # how often a wait looks for the abort notice

    def __init__(self, job: JobStore, prefix: str, timeout_s: float, abort_key: str | None = None) -> None:
        """`abort_key`: a signed notice (the launcher's list of this generation's lost processes) that
        ends every wait of this rendezvous at once with RendezvousAborted: a process of the generation
        died while it formed, and the others need not wait out the timeout for it."""
        super().__init__()
        self._job, self._prefix, self._timeout_s = job, prefix, float(timeout_s)
        self._abort_key = abort_key
        self._inner = dist.PrefixStore(prefix, job.store)
        self._clones: list[SignedStore] = []  # kept alive with this one (see JobStore.rendezvous_stores)

    def _signed(self, key: str, value: bytes) -> bytes:
        return self._job._tag(f"{self._prefix}/{key}", value) + _SEP + value

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._signed(key, data))

    def get(self, key: str) -> bytes:
        if self._inner.check([key]):  # the common case: written already (one round trip, no waiting)
            tag, sep, data = bytes(self._inner.get(key)).partition(_SEP)
            if sep and hmac.compare_digest(tag, self._job._tag(f"{self._prefix}/{key}", data)):
                return data
        deadline = time.monotonic() + self._timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no value signed with the job's secret under the rendezvous key "
                                   f"{self._prefix}/{key!r} in {self._timeout_s:.0f} s (an outsider's value, "
                                   "or a peer that never wrote it)")
            if not self._wait_slice(key, left):
                continue
            tag, sep, data = bytes(self._inner.get(key)).partition(_SEP)
            if sep and hmac.compare_digest(tag, self._job._tag(f"{self._prefix}/{key}", data)):
                return data
            time.sleep(0.01)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def clone(self) -> SignedStore:
        """Another client on the same keys (process groups take their own: gloo's connection setup)."""
        twin = SignedStore(self._job, self._prefix, self._timeout_s, self._abort_key)
        twin._inner = self._inner.clone()
        self._clones.append(twin)
        return twin

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self._abort_key is None:
            if timeout is None:
                self._inner.wait(keys)
            else:
                self._inner.wait(keys, timeout)
            return
        total = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + total
        for key in keys:
            while not self._wait_slice(key, deadline - time.monotonic()):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rendezvous keys {keys} of {self._prefix} not written in "
                                       f"{total:.0f} s")

    def _wait_slice(self, key: str, left: float) -> bool:
        """Wait up to one slice (at most `left` s) for `key`; True once it exists.  Raises
        RendezvousAborted when the abort notice is there."""
        if self._abort_key is not None:
            lost = self._job.read(self._abort_key)
            if lost is not None:
                raise RendezvousAborted(f"{self._prefix} cannot form: the launcher saw process(es) {lost} of "
                                        "it exit while it formed")
        if self._abort_key is None:
            try:
                self._inner.wait([key], timedelta(seconds=left))
            except dist.DistStoreError:  # not written yet
                return False
            return True
        # Sliced by polling, not by `wait` with a short timeout: each such timeout makes the store's
        # client log two c10d warnings (`waitForInput ... likely a timeout`), a dozen per rejoin.
        until = time.monotonic() + min(left, self.SLICE_S)
        while not self._inner.check([key]):
            if time.monotonic() >= until:
                return False
            time.sleep(0.01)
        return True

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._inner.set_timeout(timeout)


class RendezvousAborted(RuntimeError):
    """A process of a generation that was still forming was seen to exit: the rendezvous ends now."""


class UnauthenticatedPeerError(RuntimeError):
    """A rank of a freshly formed process group could not prove that it holds the job's secret."""


def group_proof(secret: bytes, context: bytes, nonces: bytes, rank: int) -> bytes:
    """Rank `rank`'s proof (32 bytes) over every rank's nonce, for the group named by `context`."""
    msg = context + b"\0" + str(rank).encode() + b"\0" + nonces
    return hmac.new(secret, msg, hashlib.sha256).digest()


def authenticate_group(job: JobStore, context: str, device: Any = "cpu", group: Any = None) -> None:
    """Every rank of `group` (default: the world) proves the job's secret to every other: each draws a
    16-byte nonce, the nonces are all-gathered, each rank all-gathers its HMAC over all of them, and each
    checks every other rank's.  Tensors only: nothing is unpickled before every peer proved itself.
    Raises UnauthenticatedPeerError naming the ranks that did not (the caller drops the group)."""
    import torch

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8).to(device)
    nonces = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(nonces, mine, group=group)
    joined = b"".join(bytes(n.cpu().tolist()) for n in nonces)
    ctx = (job.instance + "\0" + context).encode()
    proof = torch.frombuffer(bytearray(group_proof(job.secret, ctx, joined, rank)), dtype=torch.uint8)
    proofs = [torch.empty_like(proof, device=device) for _ in range(world)]
    dist.all_gather(proofs, proof.to(device), group=group)
    bad = [r for r, p in enumerate(proofs)
           if not hmac.compare_digest(bytes(p.cpu().tolist()), group_proof(job.secret, ctx, joined, r))]
    if bad:
        raise UnauthenticatedPeerError(
            f"rank(s) {bad} of the process group {context} did not prove that they hold the job's secret: "
            "a process outside the job took part in its rendezvous; the group is dropped before anything "
            "is exchanged on it")


def host_cluster_store(port: int, *, required_by: str, timeout_s: float = 300.0) -> JobStore:
    """Server side of a store other nodes reach (a cluster coordinator's): it listens on every interface,
    so the job's secret is required (`required_by` names the store in the error)."""
    secret = job_secret(required_by)
    server = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout_s))
    return JobStore(server, secret)


def connect_cluster_store(host: str, port: int, *, required_by: str, timeout_s: float = 300.0) -> JobStore:
    """A job process's connection to a store on another node (the job's secret is required)."""
    secret = job_secret(required_by)
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return JobStore(client, secret)
