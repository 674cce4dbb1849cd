"""Hostile clients against a live cluster coordinator, rehearsed on this machine.

    python bench/hostile.py [--heartbeat 2] [--hold 3]

`ntp-coordinator` runs as the README's batch script starts it (its own process, its own store on
MASTER_PORT, `ntp_nemo.resilience.rehearsal.start_coordinator`), layout (2,2).  Its four tasks are
*lightweight*: threads of this process speaking the real link protocol (`cluster_protocol`: the hello,
sealed heartbeats every 0.1 s whose step moves, the goodbye), without training; the attacks come from an
outsider that does not hold the job's secret, on the link port and the store port, and from something
on the path of one task's link.  Two attacks go at a generation's rendezvous on the coordinator's store,
with two real ranks (spawned processes running `rendezvous.join`, as a task's recovery does): an outsider
that learnt the job's key prefix joins as a rank, and the keys torch's rendezvous wrote for one generation
are copied under the next one's prefix before it forms.  A task that dies while the job forms is
rehearsed against a second coordinator.

An attack is withstood when, after it, the coordinator still runs, every task still holds its place and
none was told it was lost, woken for a failure or told to stop, plus the check of the attack itself.
At the end the tasks finish and the coordinator must exit 0.  One row per attack; last line
`hostile clients: N/N attacks withstood`.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ntp_nemo.resilience.cluster_protocol import LINK_KEY, Line, task_hello
from ntp_nemo.resilience.rehearsal import free_port, start_coordinator
from ntp_nemo.resilience.store_auth import JobStore

SECRET = "bench-hostile-secret-0123456789"
LAYOUT = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=100000"]


class Task:
    """A lightweight task: the real hello and heartbeats, a reader that keeps what the coordinator says."""

    def __init__(self, host: str, link_port: int, want: int, ntasks: int, *, via: int | None = None) -> None:
        self.line = Line(socket.create_connection((host, via or link_port), timeout=10))
        nonce = self._next()["nonce"]
        task_hello(self.line, SECRET.encode(), nonce, want=want, ntasks=ntasks, host="bench", pid=0)
        self.reply = self._next()
        self.heard: list[dict] = []
        self.closed = False
        self.step, self.tick = 0, 0
        self._halt = threading.Event()
        self.line.sock.settimeout(None)
        if "place" in self.reply:
            threading.Thread(target=self._beat, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def _next(self) -> dict:
        while True:
            msgs = self.line.receive()
            if msgs is None:
                raise RuntimeError(f"the coordinator closed the link during the hello ({self.line.error})")
            if msgs:
                return msgs[0]

    def _beat(self) -> None:
        while not self._halt.wait(0.1):
            self.step += 1
            self.tick += 1
            if not self.line.send({"beat": [self.step, "step_start"], "tick": self.tick}):
                return

    def _read(self) -> None:
        while True:
            msgs = self.line.receive()
            if msgs is None:
                self.closed = True
                return
            self.heard.extend(msgs)

    def bye(self) -> None:
        self._halt.set()
        self.line.send({"bye": "done"})
        try:
            self.line.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Proxy:
    """Something on the path of one task's link: forwards both ways, and can write to the task's side."""

    def __init__(self, host: str, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = (host, port)
        self.to_task: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        task, _ = self.server.accept()
        up = socket.create_connection(self.target)
        self.to_task = task
        for a, b in ((task, up), (up, task)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _drain(sock: socket.socket) -> None:
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


def _rank(port: int, rank: int, secret: bytes, generation: int, timeout_s: float, out) -> None:
    """A rank forming `generation` on the coordinator's store through the project's rendezvous
    (`rendezvous.join`: signed keys, then the proof of the secret), then one all-reduce and one pickled
    object from rank 0.  An outsider is a rank that signs with a secret it guessed (it learnt the job's
    key prefix by listing the store)."""
    import torch

    from ntp_nemo.resilience.rendezvous import join

    torch.set_num_threads(1)
    job = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)),
                   SECRET.encode())
    job._secret = secret  # the job's secret, or an outsider's guess under the job's listed prefix
    try:
        join(job, generation, rank, 2, timeout_s=timeout_s)
        t = torch.ones(1)
        dist.all_reduce(t)
        box = [{"from": "rank 0"}] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        out.put((rank, "formed", f"sum {t.item():g}, object {box[0]}"))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported as the row's outcome
        out.put((rank, type(err).__name__, str(err).splitlines()[0][:160]))


def _ranks(port: int, secrets: list[bytes], generation: int, timeout_s: float = 30.0
           ) -> dict[int, tuple[str, str]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fork would share the lightweight tasks' link sockets
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, r, secrets[r], generation, timeout_s, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, kind, detail = out.get(timeout=120)
        got[rank] = (kind, detail)
    for p in procs:
        p.join(10)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heartbeat", type=float, default=2.0, help="fault.heartbeat_timeout_s")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds each lasting attack is held")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    over = [*LAYOUT, f"fault.heartbeat_timeout_s={args.heartbeat:g}", "fault.collective_timeout_s=60",
            "fault.step_timeout_s=120"]
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    port = free_port()
    t0 = time.time()
    coordinator = start_coordinator(over, port, SECRET, work)
    print(f"coordinator ready in {time.time() - t0:.1f} s (pid {coordinator.pid}); heartbeat timeout "
          f"{args.heartbeat:g} s; each lasting attack held {args.hold:g} s")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    job = JobStore(store, SECRET.encode())
    link_port = int(job.read(LINK_KEY))
    proxy = Proxy("127.0.0.1", link_port)
    tasks = [Task("127.0.0.1", link_port, i, 4, via=proxy.port if i == 3 else None) for i in range(4)]
    time.sleep(0.5)

    def healthy() -> str | None:
        if coordinator.popen.poll() is not None:
            return f"the coordinator exited ({coordinator.popen.returncode})"
        for i, t in enumerate(tasks):
            if t.closed:
                return f"task {i}'s link closed"
            if t.heard:
                return f"task {i} was told {t.heard}"
        return None

    def hold(fn, *a) -> None:
        stop = time.time() + args.hold
        while time.time() < stop:
            fn(*a)

    def deep_line() -> str:
        s = socket.create_connection(("127.0.0.1", link_port))
        s.sendall(b"[" * 100000 + b"\n")
        _drain(s)
        return "refused: the connection closed"

    def endless_line() -> str:
        s = socket.create_connection(("127.0.0.1", link_port))
        sent = 0
        try:
            for _ in range(200):
                s.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        s.close()
        assert sent < 13_000_000, "the coordinator read 13 MB of one line"
        return f"cut off after {sent // 1024} KiB sent"

    def garbage() -> str:
        for data in (b"\xff\xfe\x00garbage\n", b"[1,2,3]\n", b'{"auth": 5, "nonce": [], "want": "x"}\n',
                     b"{" * 5 + b"\n"):
            s = socket.create_connection(("127.0.0.1", link_port))
            s.sendall(data)
            _drain(s)
        return "4 connections refused"

    def forged_hello() -> str:
        s = Line(socket.create_connection(("127.0.0.1", link_port), timeout=10))
        nonce = s.receive()[0]["nonce"]
        task_hello(s, b"a guess at the job's secret!", nonce, want=0, ntasks=4, host="x", pid=0)
        s.sock.settimeout(10)
        while s.receive() is not None:
            pass
        assert "refused" in (s.last_rejected or {}), s.last_rejected
        return "refused (no place taken)"

    def idle_1200() -> str:
        idle = [socket.create_connection(("127.0.0.1", link_port)) for _ in range(1200)]
        spare = Task("127.0.0.1", link_port, 0, 1)  # a replacement connecting meanwhile is served
        assert "wait" in spare.reply, spare.reply
        time.sleep(args.hold)
        spare.bye()
        for s in idle:
            s.close()
        return "held; a spare connecting meanwhile was answered"

    def churn() -> str:
        n = 0
        stop = time.time() + args.hold
        while time.time() < stop:
            for s in [socket.create_connection(("127.0.0.1", link_port)) for _ in range(50)]:
                s.close()
            n += 50
        t = time.time()
        spare = Task("127.0.0.1", link_port, 0, 1)
        took = time.time() - t
        spare.bye()
        return f"{n} connections opened and dropped; a spare's hello then took {took * 1000:.0f} ms"

    def replayed_beat() -> str:
        outsider = JobStore(store, b"a guess at the job's secret!")
        raw = b"0" * 64 + b":" + json.dumps({"step": 1, "phase": "step_start", "tick": 1}).encode()

        def once() -> None:
            for pid in range(4):
                job.store.set(f"beat/{pid}", raw)
                outsider.put(f"beat/{pid}", json.dumps({"step": 1, "phase": "step_start", "tick": 1}))

        hold(once)
        return "beat/{0..3} overwritten in a loop: nobody evicted"

    def on_path() -> str:
        before = len(tasks[3].heard)
        proxy.to_task.sendall(b'{"declared": "lost"}\n{"end": "forged"}\n{"look": 0}\n'
                              b'{"m": {"declared": "lost"}, "n": 0, "mac": "00"}\n')
        time.sleep(0.5)
        assert tasks[3].line.rejected >= 4 and len(tasks[3].heard) == before
        return f"{tasks[3].line.rejected} unsealed lines dropped by the task"

    def outsider_rank() -> str:
        got = _ranks(port, [SECRET.encode(), b"an outsider's guess at the secret"], 900, timeout_s=10)
        assert got[0][0] != "formed" and got[1][0] != "formed", got
        return f"rank 0 never formed a group with it: {got[0][0]}: {got[0][1][:110]}"

    def prewritten_keys() -> str:
        first = _ranks(port, [SECRET.encode()] * 2, 901)
        assert all(k == "formed" for k, _ in first.values()), first
        from ntp_nemo.resilience.store_auth import key_prefix

        # the outsider copies generation 901's rendezvous keys (stale gloo addresses) to generation 902's

        outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        prefix = key_prefix(SECRET.encode()) + "/gen901/"
        keys = [k for k in outsider.list_keys() if k.startswith(prefix)]
        for k in keys:
            outsider.set(k.replace("/gen901/", "/gen902/"), outsider.get(k))
        second = _ranks(port, [SECRET.encode()] * 2, 902)
        assert all(k == "formed" for k, _ in second.values()), second
        return (f"{len(keys)} gloo address key(s) pre-written for the next generation; it formed between "
                f"the job's ranks ({second[0][1]})")

    def store_flood() -> str:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(args.hold)
        for s in idle:
            s.close()
        return "200 idle connections to the store held: nobody evicted"

    attacks = [("deep JSON line (100,000 '[')", deep_line), ("endless line (no newline)", endless_line),
               ("garbage and malformed hellos", garbage), ("hello with a guessed secret", forged_hello),
               ("1,200 idle link connections", idle_1200), ("connection churn on the link", churn),
               ("replayed heartbeats on the store", replayed_beat),
               ("unsealed lines on a task's link (on path)", on_path),
               ("200 idle store connections", store_flood),
               ("an outsider joins a generation's rendezvous", outsider_rank),
               ("gloo address keys pre-written on the store", prewritten_keys)]
    rows: list[tuple[str, bool, str]] = []
    for name, attack in attacks:
        t = time.time()
        try:
            detail = attack()
            time.sleep(0.3)
            wrong = healthy()
            ok = wrong is None
            detail = detail if ok else wrong
        except Exception as err:  # noqa: BLE001 - a failed check is a row, not a crash of the bench
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((name, ok, f"{detail} ({time.time() - t:.1f} s)"))

    # The job ends: the tasks finish; the coordinator must exit 0.
    for t in tasks:
        t.bye()
    code = coordinator.wait(30)
    checks = [("after the attacks the job ends", code == 0, f"coordinator exit {code}")]

    # A task that dies while the job forms (not an attack: issue of the forming job), second coordinator.
    port2 = free_port()
    second = start_coordinator(over, port2, SECRET, work)
    try:
        job2 = JobStore(dist.TCPStore("127.0.0.1", port2, is_master=False, timeout=timedelta(seconds=30)),
                        SECRET.encode())
        lp2 = int(job2.read(LINK_KEY))
        first, doomed = Task("127.0.0.1", lp2, 0, 4), Task("127.0.0.1", lp2, 1, 4)
        t = time.time()
        doomed.line.sock.shutdown(socket.SHUT_RDWR)  # its process died before the other places were taken
        code2 = second.wait(30)
        took = time.time() - t
        told = first.heard[0].get("end", "") if first.heard else ""
        checks.append(("a task dies while the job forms", code2 == 75 and "while the job formed" in told
                       and took < 5, f"coordinator exit {code2} after {took:.1f} s; the other task was "
                       f"told: {told[:100]}..."))
    finally:
        second.kill()
    coordinator.kill()

    width = max(len(r[0]) for r in rows)
    print(f"\n| {'attack':<{width}} | withstood | what happened |")
    print(f"|{'-' * (width + 2)}|-----------|---------------|")
    for name, ok, detail in rows:
        print(f"| {name:<{width}} | {'yes' if ok else 'NO':<9} | {detail} |")
    print()
    for name, ok, detail in checks:
        print(f"{name}: {'ok' if ok else 'FAILED'} ({detail})")
    print("coordinator said:\n" + "\n".join("  " + line for line in coordinator.output.splitlines()[-12:]))
    held = sum(ok for _, ok, _ in rows)
    print(f"hostile clients: {held}/{len(rows)} attacks withstood")
    return 0 if held == len(rows) and all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
