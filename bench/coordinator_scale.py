"""The coordinator at 1,024 tasks, rehearsed on this machine without training.

    python bench/coordinator_scale.py [--tasks 1024] [--heartbeat 5] [--step 1.0] [--steady 10]

The real `Coordinator` serves in its own process with its own `TCPStore` (as `ntp-coordinator` does;
started here directly so that the world size needs no layout).  The tasks are lightweight: one process
holds `--tasks` link connections, each speaking the real protocol (the hello with the job's secret, sealed
heartbeats: one per step of `--step` seconds and a tick at least every quarter of the heartbeat timeout,
as `ClusterLink`'s sender thread does), and reads `failed/gen{g}` from the store as a task does when it is
woken.  Heartbeats travel on the link, so a sweep of the coordinator reads nothing from the store (no
round trip per task; no batch either).

Measured: the time the hellos take; the coordinator's CPU while every task beats (`/proc` of its
process); one task killed (its connection reset, as the kernel does for `kill -9`): time until every
survivor is woken with the published loss and has read it from the store; one task stopped (no beat, no
tick: `SIGSTOP`): time until the coordinator tells it that it was declared lost, which must be within the
heartbeat timeout plus one second.  Last line: `coordinator at N tasks: ... declared lost in X s (limit
Y s)`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from datetime import timedelta

SECRET = b"bench-coordinator-scale-secret-0123"


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def serve(port: int, world: int, heartbeat_s: float) -> int:
    """The coordinator's process."""
    import torch.distributed as dist

    from ntp_nemo.resilience.coordinator import Coordinator
    from ntp_nemo.resilience.store_auth import JobStore

    _raise_open_files()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    coordinator = Coordinator(JobStore(store, SECRET), SECRET, world, heartbeat_s, host="127.0.0.1",
                              say=lambda s: print(s, flush=True))
    print("ready", flush=True)
    return coordinator.serve()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tasks:
    """`n` lightweight tasks in one thread: their links, their beats, what they were told."""

    def __init__(self, n: int, link_port: int, heartbeat_s: float, step_s: float) -> None:
        from ntp_nemo.resilience.cluster_protocol import Line, task_hello

        self.lines: list[Line] = []
        for i in range(n):
            line = Line(socket.create_connection(("127.0.0.1", link_port), timeout=30))
            nonce = self._next(line)["nonce"]
            task_hello(line, SECRET, nonce, want=i, ntasks=n, host="bench", pid=i)
            reply = self._next(line)
            assert reply.get("place") == i, reply
            line.sock.setblocking(False)
            self.lines.append(line)
        self.instance = reply["instance"]
        self.heartbeat_s, self.step_s = heartbeat_s, step_s
        self.t0 = time.monotonic()
        self.ticks = [0] * n
        self.sent_step = [-1] * n
        self.sent_t = [0.0] * n
        self.stopped: set[int] = set()
        self.heard: dict[int, list[tuple[float, dict]]] = {i: [] for i in range(n)}
        self.sel = selectors.DefaultSelector()
        for i, line in enumerate(self.lines):
            self.sel.register(line.sock, selectors.EVENT_READ, i)

    @staticmethod
    def _next(line) -> dict:
        while True:
            msgs = line.receive()
            assert msgs is not None, line.error
            if msgs:
                return msgs[0]

    def run_for(self, seconds: float, until=None) -> None:
        """Beat and listen for `seconds` (or until `until()` holds)."""
        end = time.monotonic() + seconds
        tick_every = self.heartbeat_s / 4
        while time.monotonic() < end and not (until and until()):
            now = time.monotonic()
            step = int((now - self.t0) / self.step_s)
            for i, line in enumerate(self.lines):
                if i in self.stopped or line is None:
                    continue
                if step != self.sent_step[i] or now - self.sent_t[i] >= tick_every:
                    self.ticks[i] += 1
                    line.send({"beat": [step, "step_start"], "tick": self.ticks[i]})
                    self.sent_step[i], self.sent_t[i] = step, now
            for key, _ in self.sel.select(0.02):
                i = key.data
                msgs = self.lines[i].receive()
                for msg in msgs or []:
                    self.heard[i].append((time.monotonic(), msg))
                if msgs is None:
                    self.sel.unregister(key.fileobj)

    def kill(self, i: int) -> None:
        """As `kill -9`: the kernel resets the connection."""
        sock = self.lines[i].sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.sel.unregister(sock)
        sock.close()
        self.lines[i] = None
        self.stopped.add(i)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1024)
    ap.add_argument("--heartbeat", type=float, default=5.0, help="fault.heartbeat_timeout_s")
    ap.add_argument("--step", type=float, default=1.0, help="seconds per training step of the tasks")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(int(args.serve[0]), int(args.serve[1]), float(args.serve[2]))

    import torch.distributed as dist

    from ntp_nemo.resilience.cluster_protocol import LINK_KEY
    from ntp_nemo.resilience.rehearsal import free_port
    from ntp_nemo.resilience.rendezvous import failed_key
    from ntp_nemo.resilience.store_auth import JobStore

    _raise_open_files()
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(args.tasks),
                             str(args.heartbeat)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        job = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)),
                       SECRET)
        link_port = int(job.read(LINK_KEY))
        t = time.monotonic()
        tasks = Tasks(args.tasks, link_port, args.heartbeat, args.step)
        hellos = time.monotonic() - t
        print(f"{args.tasks} tasks took their places in {hellos:.2f} s "
              f"({hellos / args.tasks * 1000:.2f} ms per hello)")
        tasks.run_for(2.0)  # every task reports training
        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        tasks.run_for(args.steady)
        cpu = (_cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0)
        print(f"steady state, every task beating ({args.step:g} s steps, heartbeat timeout "
              f"{args.heartbeat:g} s): coordinator CPU {cpu * 100:.1f}% of one core; "
              "store reads per sweep: 0")
        assert not any(tasks.heard.values()), "a task was told something during the steady state"

        # One task killed.
        victim = args.tasks // 3
        t_kill = time.monotonic()
        tasks.kill(victim)
        survivors = [i for i in range(args.tasks) if i != victim]
        tasks.run_for(args.heartbeat + 5, until=lambda: all(tasks.heard[i] for i in survivors))
        woken = [tasks.heard[i][0][0] - t_kill for i in survivors if tasks.heard[i]]
        assert len(woken) == len(survivors), f"{len(survivors) - len(woken)} survivors not woken"
        assert all(m == {"look": 0} for i in survivors for _, m in tasks.heard[i][:1])
        bound = job.bound(tasks.instance)
        failed = [json.loads(bound.read(failed_key(0))) for _ in survivors]  # each survivor reads it
        read_all = time.monotonic() - t_kill
        assert all(f == [victim] for f in failed), failed[:3]
        print(f"task {victim} killed: every survivor woken in {max(woken):.3f} s (median "
              f"{sorted(woken)[len(woken) // 2]:.3f} s); all {len(survivors)} read failed/gen0 from the "
              f"store by {read_all:.2f} s")

        # One task stopped (its beats and ticks stop; its link stays open).
        hung = 2 * args.tasks // 3
        for i in survivors:
            tasks.heard[i].clear()
        t_stop = time.monotonic()
        tasks.stopped.add(hung)
        limit = args.heartbeat + 1.0
        tasks.run_for(args.heartbeat + 10, until=lambda: any("declared" in m for _, m in tasks.heard[hung]))
        told = [t for t, m in tasks.heard[hung] if "declared" in m]
        took = (told[0] - t_stop) if told else float("inf")
        others = [i for i in survivors if i != hung and any("declared" in m for _, m in tasks.heard[i])]
        assert not others, f"healthy tasks declared lost: {others[:5]}"
        ok = took <= limit
        print(f"coordinator at {args.tasks} tasks: task {hung} stopped, declared lost in {took:.2f} s "
              f"(limit {limit:g} s: heartbeat timeout + 1 s) {'ok' if ok else 'TOO LATE'}")
        return 0 if ok else 1
    finally:
        proc.kill()
        proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
