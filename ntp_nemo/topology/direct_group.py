"""A CPU process group whose tensor collectives run over direct TCP connections, on the calling thread.

Why: on CPU a gloo collective costs milliseconds whatever its size.  On the 2-core machine of
docs/performance.md ("The TP groups' transport: ntpdirect": two forked processes, one torch thread
each), a bench measured a gloo all-reduce of 8 float32 values at 1.58 ms of wall and 0.90 ms of CPU,
one of 64 Ki values at 1.32 ms and 0.84 ms: gloo hands every message between the calling thread and its
I/O thread.  A TP step of the default recipe makes 115 of them (four per layer per micro-batch, the
embedding's, the head's, the loss's), so half of a TP2 step was collectives (docs/performance.md,
"Profile of a TP2 step").  The same collectives on this group, with non-blocking sockets on the calling
thread: 0.13 ms and 0.18 ms of wall (0.09 and 0.15 ms of CPU), side by side in the same bench.

What: `DirectGroup`, a `torch.distributed.ProcessGroup` written in Python and registered as the
backend `ntpdirect` for CPU tensors, so `dist.all_reduce(x, group=g)` and the other calls of the TP
regions reach it unchanged.  Each pair of ranks holds one TCP connection (a full mesh, made when the group
is created: the higher rank connects, sends a hello with its rank and a token the group's rank 0 put in
the group's store; a connection without that hello is dropped).  The token and the listeners' addresses
sit in clear text in the job's store, which listens on loopback for a one-machine run: they keep out
whatever reaches the port from the network, not a local user who can read that store (docs/security.md
says what the project defends against).  A collective sends this rank's bytes to
every peer and receives theirs in one non-blocking loop (no deadlock whatever the sizes), then reduces
in rank order, so every rank computes the same sum bit for bit (an add of two values commutes exactly:
at two ranks the result equals gloo's).

Supported: all_reduce (SUM, AVG, MAX, MIN, PRODUCT), all_gather (list and into one tensor),
reduce_scatter (list and from one tensor), broadcast, barrier; everything else raises naming the group
backend to use instead.  `async_op=True` returns a completed work (the collective ran when it was
called: `ntp.tp_overlap` overlaps nothing on this backend).  Each rank sends its whole tensor to every
peer (not a ring): one round, what a CPU TP group of 2 to 8 ranks on one host wants for the activations of
a TP region (latency, not bandwidth, bounds it); an all-reduce of `TWO_PHASE_BYTES` or more among 3 or more
ranks runs as a reduce-scatter and an all-gather (two rounds, 2 (size - 1) / size of its bytes sent per
rank instead of size - 1 times them), with the same bits.

Faults: every wait is bounded by the group's timeout (`fault.collective_timeout_s`; each phase of a
two-phase all-reduce has its own, so such a collective may wait twice) and ends in a `DistBackendError`
("timed out"); a peer that is gone ends the collective at once with one ("connection
closed"), which the live recovery treats like gloo's.  `resilience.sockets.sever` shuts these sockets down
with gloo's (they are connected TCP sockets), so a survivor blocked here on a hung peer is released the
same way.  Sockets close when the group is shut down or collected.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "ntpdirect"
_HELLO = struct.Struct("!4sI16s")  # magic, rank in the group, token
_MAGIC = b"NTPD"
_OPS = {"SUM", "AVG", "MAX", "MIN", "PRODUCT"}
# An all-reduce of at least this many bytes in a group of 3 or more ranks runs in two phases (reduce-scatter,
# then all-gather of the reduced chunks): each rank sends 2 (size - 1) / size times its tensor instead of
# (size - 1) times it, for one more round trip (measured: docs/performance.md, ntpdirect).
TWO_PHASE_BYTES = 1 << 19


def register() -> str:
    """Make `ntpdirect` a torch.distributed backend for CPU tensors in this process (idempotent); its
    name."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> DirectGroup:
    return DirectGroup(store, rank, size, timeout)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it (writes land in the tensor)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _op_name(op: Any) -> str:
    for name in (*sorted(_OPS), *(n for n in dir(dist.ReduceOp) if n.isupper() and n not in _OPS)):
        try:
            if op == getattr(dist.ReduceOp, name):
                return name
        except (TypeError, RuntimeError):
            continue
    return str(op)


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


class DirectGroup(dist.ProcessGroup):
    """See the module docstring.  Built by `torch.distributed.new_group(..., backend="ntpdirect")`
    after `register()`; `store` is the group's own prefix store."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout_s = max(float(timeout.total_seconds()), 1e-3)
        self.two_phase_bytes = TWO_PHASE_BYTES  # (a bench sets it per group to compare the two paths)
        # watch.before_exchange() / after_exchange(): around each exchange (`runtime.compute_time.
        # ComputeTimer`: the time in it is not the rank's compute; a slowed device sleeps before it)
        self.watch: Any = None
        self._peers: dict[int, socket.socket] = {}
        self._group_name = ""
        self._connect(store)
        socks = list(self._peers.values())
        self._finalizer = weakref.finalize(self, _close_all, socks)

    # ---- set-up -------------------------------------------------------------------------------
    def _connect(self, store: Any) -> None:
        rank, size = self._rank, self._size
        if size == 1:
            return
        host = socket.gethostname()
        store.set(f"host/{rank}", host)
        hosts = {store.get(f"host/{r}").decode() for r in range(size)}
        local = len(hosts) == 1  # every rank on this host: loopback only
        address = "127.0.0.1" if local else socket.gethostbyname(host)
        if rank == 0:
            store.set("token", os.urandom(16).hex())
        token = bytes.fromhex(store.get("token").decode())
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1" if local else "", 0))
            listener.listen(size)
            store.set(f"addr/{rank}", f"{address}:{listener.getsockname()[1]}")
            deadline = time.monotonic() + self._timeout_s
            for peer in range(rank):  # the lower ranks listen; a connect completes before their accept
                peer_host, port = store.get(f"addr/{peer}").decode().rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(port)), timeout=self._remaining(deadline))
                sock.sendall(_HELLO.pack(_MAGIC, rank, token))
                self._peers[peer] = sock
            while len(self._peers) < size - 1:
                listener.settimeout(self._remaining(deadline))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    raise self._error("timed out", "connecting", f"{size - 1 - len(self._peers)} peers "
                                      "never connected") from None
                peer = self._hello(sock, token, deadline)
                if peer is None:
                    sock.close()  # not a rank of this group
                    continue
                self._peers[peer] = sock
        except BaseException:
            _close_all(list(self._peers.values()))
            raise
        finally:
            listener.close()
        for sock in self._peers.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    def _hello(self, sock: socket.socket, token: bytes, deadline: float) -> int | None:
        sock.settimeout(min(self._remaining(deadline), 5.0))
        data = b""
        try:
            while len(data) < _HELLO.size:
                chunk = sock.recv(_HELLO.size - len(data))
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
        magic, peer, got = _HELLO.unpack(data)
        if magic != _MAGIC or got != token or not self._rank < peer < self._size or peer in self._peers:
            return None
        return peer

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._error("timed out", "connecting", f"after {self._timeout_s:g} s")
        return left

    # ---- the exchange -------------------------------------------------------------------------
    def _error(self, kind: str, what: str, detail: str) -> dist.DistBackendError:
        return dist.DistBackendError(f"{BACKEND} group rank {self._rank}/{self._size}: {what}: {kind} "
                                     f"({detail})")

    def _exchange(self, what: str, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
        """Send `sends[p]` to and receive `recvs[p]` from each peer p at once; bounded by the timeout.
        A `watch` is told when it starts and ends (time in it is communication and waiting, not work)."""
        watch = self.watch
        if watch is None:
            self._exchange_now(what, sends, recvs)
            return
        watch.before_exchange()
        try:
            self._exchange_now(what, sends, recvs)
        finally:
            watch.after_exchange()

    def _exchange_now(self, what: str, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
        outgoing = {p: [mv, 0] for p, mv in sends.items() if len(mv)}
        incoming = {p: [mv, 0] for p, mv in recvs.items() if len(mv)}
        deadline = None
        while outgoing or incoming:
            moved = False
            for p in list(outgoing):
                state = outgoing[p]
                try:
                    n = self._peers[p].send(state[0][state[1]:])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as err:
                    raise self._error("connection closed", what, f"sending to rank {p}: {err}") from None
                moved = True
                state[1] += n
                if state[1] == len(state[0]):
                    del outgoing[p]
            for p in list(incoming):
                state = incoming[p]
                try:
                    n = self._peers[p].recv_into(state[0][state[1]:])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as err:
                    raise self._error("connection closed", what, f"receiving from rank {p}: {err}") from None
                if n == 0:
                    raise self._error("connection closed", what, f"rank {p} closed its connection")
                moved = True
                state[1] += n
                if state[1] == len(state[0]):
                    del incoming[p]
            if moved or not (outgoing or incoming):
                continue
            now = time.monotonic()
            deadline = deadline if deadline is not None else now + self._timeout_s
            if now >= deadline:
                raise self._error("timed out", what, f"not done {self._timeout_s:g} s after it first waited; "
                                  f"waiting for ranks {sorted(set(outgoing) | set(incoming))}")
            self._wait(incoming, outgoing, min(deadline - now, 1.0))

    def _wait(self, incoming: dict, outgoing: dict, seconds: float) -> None:
        """Block until a peer in `incoming` can be read or one in `outgoing` written, or `seconds` pass.
        `poll`, not `select`: select() refuses a descriptor numbered 1,024 or more, which a long job's
        process may well hold."""
        poller = select.poll()
        for p in set(incoming) | set(outgoing):
            poller.register(self._peers[p], (select.POLLIN if p in incoming else 0)
                            | (select.POLLOUT if p in outgoing else 0))
        poller.poll(max(1, int(seconds * 1000)))

    def _others(self) -> list[int]:
        return [p for p in range(self._size) if p != self._rank]

    def _gather_bytes(self, what: str, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `mine` (same shape and dtype on each), in rank order; this rank's is `mine`."""
        src = mine.contiguous()
        theirs = {p: torch.empty_like(src) for p in self._others()}
        self._exchange(what, {p: _as_bytes(src) for p in theirs},
                       {p: _as_bytes(t) for p, t in theirs.items()})
        return [src if r == self._rank else theirs[r] for r in range(self._size)]

    @staticmethod
    def _reduce(parts: list[torch.Tensor], op: str, out: torch.Tensor) -> None:
        """`out` = parts reduced in rank order (the same bits on every rank)."""
        if op in ("SUM", "AVG"):
            if len(parts) == 2 and out.is_contiguous():
                torch.add(parts[0], parts[1], out=out)  # elementwise: `out` may be one of the parts
            elif len(parts) == 2:
                out.copy_(parts[0] + parts[1])
            else:
                acc = parts[0] + parts[1]
                for x in parts[2:]:
                    acc.add_(x)
                out.copy_(acc)
            if op == "AVG":
                out.div_(len(parts))
            return
        fn = {"MAX": torch.maximum, "MIN": torch.minimum, "PRODUCT": torch.mul}[op]
        acc = parts[0]
        for x in parts[1:]:
            acc = fn(acc, x)
        out.copy_(acc)

    def _done(self, result: Any) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(result)
        return torch._C._distributed_c10d._create_work_from_future(fut)

    def _check(self, what: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{BACKEND}: {what} of a {t.device.type} tensor; this backend moves CPU "
                                 "tensors only (GPU worlds use NCCL)")

    # ---- collectives --------------------------------------------------------------------------
    def allreduce(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        if op not in _OPS:
            raise ValueError(f"{BACKEND}: all_reduce with {op} is not supported (use SUM, AVG, MAX, MIN or "
                             "PRODUCT, or a gloo group)")
        self._check("all_reduce", tensor_list)
        for t in tensor_list:
            if self._size > 2 and t.numel() * t.element_size() >= self.two_phase_bytes:
                self._allreduce_two_phase(t, op)
            elif self._size > 1 and t.numel():
                self._reduce(self._gather_bytes("all_reduce", t), op, t)
        return self._done(tensor_list)

    def _allreduce_two_phase(self, t: torch.Tensor, op: str) -> None:
        """`t` all-reduced as a reduce-scatter (rank p reduces chunk p in rank order) and an all-gather of
        the reduced chunks: every element is reduced in rank order by one rank, so the bits equal the
        one-phase path's.  A peer's second-phase bytes queue behind its first-phase bytes on the same
        connection, which this rank reads by exact size, so the phases need no framing."""
        flat = t.contiguous().view(-1)
        chunks = list(flat.tensor_split(self._size))
        reduced = torch.empty_like(chunks[self._rank])
        self._scatter_reduce("all_reduce", reduced, chunks, op)
        chunks[self._rank].copy_(reduced)
        self._exchange("all_reduce", {p: _as_bytes(chunks[self._rank]) for p in self._others()},
                       {p: _as_bytes(chunks[p]) for p in self._others()})
        if not t.is_contiguous():  # `flat` is a contiguous copy; otherwise it is `t` itself
            t.copy_(flat.view(t.shape))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: Any = None) -> Any:
        self._check("all_gather", input_tensor)
        for outs, mine in zip(output_tensors, input_tensor, strict=True):
            parts = self._gather_bytes("all_gather", mine)
            for out, part in zip(outs, parts, strict=True):
                out.copy_(part.view_as(out))
        return self._done(output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._check("all_gather_into_tensor", [input])
        parts = self._gather_bytes("all_gather_into_tensor", input)
        torch.cat([p.reshape(-1) for p in parts], out=output.view(-1)) if output.is_contiguous() \
            else output.copy_(torch.cat([p.reshape(-1) for p in parts]).view_as(output))
        return self._done([output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def _scatter_reduce(self, what: str, out: torch.Tensor, chunks: list[torch.Tensor], op: str) -> None:
        """`out` = the reduction over ranks of each rank's `chunks[this rank]`."""
        sends = {p: chunks[p].contiguous() for p in self._others()}
        theirs = {p: torch.empty_like(chunks[self._rank], memory_format=torch.contiguous_format)
                  for p in self._others()}
        self._exchange(what, {p: _as_bytes(t) for p, t in sends.items()},
                       {p: _as_bytes(t) for p, t in theirs.items()})
        parts = [chunks[self._rank] if r == self._rank else theirs[r] for r in range(self._size)]
        self._reduce([p.view_as(out) for p in parts], op, out)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        if op not in _OPS:
            raise ValueError(f"{BACKEND}: reduce_scatter with {op} is not supported")
        for out, chunks in zip(output_tensors, input_tensors, strict=True):
            self._check("reduce_scatter", [out, *chunks])
            self._scatter_reduce("reduce_scatter", out, list(chunks), op)
        return self._done(output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "SUM"
        if op not in _OPS:
            raise ValueError(f"{BACKEND}: reduce_scatter_tensor with {op} is not supported")
        self._check("reduce_scatter_tensor", [output, input])
        chunks = list(input.reshape(-1).chunk(self._size))
        self._scatter_reduce("reduce_scatter_tensor", output, chunks, op)
        return self._done([output])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        self._check("broadcast", tensor_list)
        for t in tensor_list:
            src = t.contiguous()
            if self._rank == root:
                self._exchange("broadcast", {p: _as_bytes(src) for p in self._others()}, {})
            else:
                self._exchange("broadcast", {}, {root: _as_bytes(src)})
                if src.data_ptr() != t.data_ptr():
                    t.copy_(src)
        return self._done(tensor_list)

    def barrier(self, opts: Any = None) -> Any:
        self.allreduce([torch.zeros(1)], None)
        return self._done([])

    @property
    def timeout(self) -> timedelta:
        """Every wait of this group is bounded by it (`fault.collective_timeout_s` where the runtime made
        the group)."""
        return timedelta(seconds=self._timeout_s)

    def getBackendName(self) -> str:
        return BACKEND

    # torch's ProcessGroup keeps its name on its backends, which a process group written in Python has
    # none of: the name torch gives the group is kept here (functional collectives, as a compiled block
    # traces them, find the group by it).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def shutdown(self) -> None:
        self._finalizer()

    def abort(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"DirectGroup(rank={self._rank}, size={self._size})"


__all__ = ["BACKEND", "DirectGroup", "register"]
