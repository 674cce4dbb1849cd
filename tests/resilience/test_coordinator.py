"""The coordinator's protocol without training: places, the job's secret, losses published on the store,
spares, hangs and the coordinator's own death, with the real `Coordinator` in a thread and real link
connections (raw sockets, or `ClusterLink` where the task's side is under test)."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_nemo.launch.node_layout import PLACE_ENV, WORLD_ENV
from ntp_nemo.resilience.cluster_protocol import LINK_KEY, Line, task_hello
from ntp_nemo.resilience.coordinator import Coordinator
from ntp_nemo.resilience.rehearsal import free_port
from ntp_nemo.resilience.rendezvous import failed_key, read_rejoin
from ntp_nemo.resilience.store_auth import JobStore
from tests.waits import wait_until

SECRET = b"unit-test-secret-0123456789"


@pytest.fixture
def served():
    """A coordinator of 2 places serving in a thread: (job store, coordinator, its lines, its exit)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    job = JobStore(server, SECRET)
    said: list[str] = []
    coordinator = Coordinator(job, SECRET, 2, heartbeat_s=1.0, host="127.0.0.1", poll_s=0.01, grace_s=0.05,
                              end_step=100, say=said.append)
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(coordinator.serve()), daemon=True)
    thread.start()
    yield job, coordinator, said, code
    coordinator.stopping = True
    thread.join(timeout=5)


class Raw:
    """A task's link done by hand: connect, answer the nonce (with `secret`), ask for `want`; `beat` sends
    a heartbeat as the task's sender thread does."""

    def __init__(self, job: JobStore, want: int, ntasks: int = 2, secret: bytes = SECRET,
                 host: str = "h") -> None:
        port = int(job.read(LINK_KEY))
        self.line = Line(socket.create_connection(("127.0.0.1", port), timeout=10))
        nonce = self.next()["nonce"]
        task_hello(self.line, secret, nonce, want=want, ntasks=ntasks, host=host, pid=0)
        self.reply = self.next() if secret == SECRET else self.line.receive() or self.line.last_rejected
        self.tick = 0

    def beat(self, step: int, phase: str = "step_start") -> None:
        self.tick += 1
        assert self.line.send({"beat": [step, phase], "tick": self.tick})

    def next(self) -> dict:
        while True:
            msgs = self.line.receive()
            assert msgs is not None, "the coordinator closed the link"
            if msgs:
                return msgs[0]


def _until(cond, timeout_s: float = 10.0) -> None:
    wait_until(cond, timeout_s, "the coordinator's state", poll_s=0.01)


def test_places_secret_and_a_loss_published_on_the_store(served):
    job, coordinator, said, _ = served
    forged = Raw(job, 0, secret=b"not-the-job-secret-at-all")
    assert "refused" in forged.reply and "NTP_JOB_SECRET" in forged.reply["refused"]
    forged.line.close()
    a, b = Raw(job, 0), Raw(job, 1)
    assert (a.reply["place"], a.reply["mode"], b.reply["place"]) == (0, "start", 1)
    assert coordinator.formed and not coordinator._losses  # the forged connection's close lost nobody
    a.beat(1), b.beat(1)
    _until(lambda: coordinator.started)
    b.line.close()  # the task's process died: its kernel closed the link
    assert a.next() == {"look": 0}
    assert job.read(failed_key(0)) is None  # signed for this job instance only
    assert json.loads(job.bound(a.reply["instance"]).read(failed_key(0))) == [1]
    assert job.store.check([failed_key(1)]) is False
    assert any("process 1 lost (its connection closed)" in s for s in said)


def test_a_spare_waits_takes_the_lost_place_and_rejoins_ahead_of_the_survivors(served):
    job, coordinator, said, _ = served
    spare = Raw(job, 0, ntasks=1)  # its own srun step: a replacement, never a place of the forming job
    assert "wait" in spare.reply
    a, b = Raw(job, 0), Raw(job, 1)
    a.beat(12), b.beat(12)
    _until(lambda: coordinator.started)
    b.line.close()
    placed = spare.next()
    assert (placed["place"], placed["mode"]) == (1, "rejoin")
    assert a.next() == {"look": 0}
    spare.line.send({"ready": True})
    announced = spare.next()
    assert announced == {"rejoin": 2, "source": 0, "step": 16}  # generation 1 after the loss, then 2
    assert read_rejoin(job.bound(coordinator.instance), 1) == {"step": 16, "members": [0, 1], "source": 0}


def _rejoin_announced(job: JobStore, coordinator) -> tuple[Raw, Raw, int]:
    """Survivor `a` and the spare that took lost process 1's place, the rejoin announced: (a, spare, step)."""
    spare = Raw(job, 0, ntasks=1)
    a, b = Raw(job, 0), Raw(job, 1)
    a.beat(12), b.beat(12)
    _until(lambda: coordinator.started)
    b.line.close()
    assert spare.next()["mode"] == "rejoin" and a.next() == {"look": 0}
    spare.line.send({"ready": True})
    return a, spare, spare.next()["step"]


def _ticking(task: Raw, beat: list, stop: threading.Event) -> threading.Thread:
    """A running process's sender thread: its latest beat (`beat[0]`, changeable) with a fresh tick."""
    def run() -> None:
        while not stop.wait(0.1):
            task.beat(*beat[0])
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_rejoin_slower_than_the_heartbeat_timeout_declares_nobody_hung(served):
    """The survivors wait at the join step while the replacement's rendezvous and state transfer take
    longer than a heartbeat timeout (a loaded machine): the replacement, still in setup, is behind
    everyone but not hung; once every process runs the join step the usual rule is back."""
    job, coordinator, said, _ = served
    a, spare, step = _rejoin_announced(job, coordinator)
    stop = threading.Event()
    a_beat, spare_beat = [(step - 1, "step_end")], [(0, "setup")]
    threads = [_ticking(a, a_beat, stop), _ticking(spare, spare_beat, stop)]
    try:
        time.sleep(4 * coordinator.heartbeat_s)  # twice the fresh window's two timeouts
        assert not any("hung" in s for s in said), said
        assert all(p.state == "active" for p in coordinator.places)
        spare_beat[0], a_beat[0] = (step, "step_start"), (step, "step_start")  # the rejoin formed
        _until(lambda: any("joined" in s for s in said))
        spare_beat[0] = (step - 1, "step_end")  # from here the one behind is hung again (its ticks run)
        _until(lambda: any("process 1 lost (hung" in s for s in said))
        assert not any("process 0 lost" in s for s in said), said
    finally:
        stop.set()
        [t.join() for t in threads]


def test_a_rejoin_that_never_forms_is_bounded(served):
    """A replacement that never gets past setup is hung once the rejoin's bound (`rejoin_s`) has passed."""
    job, coordinator, said, _ = served
    coordinator.rejoin_s = 2.5
    a, spare, step = _rejoin_announced(job, coordinator)
    stop = threading.Event()
    threads = [_ticking(a, [(step, "step_start")], stop), _ticking(spare, [(0, "setup")], stop)]
    try:
        start = time.monotonic()
        _until(lambda: any("process 1 lost (hung" in s for s in said), timeout_s=15)
        assert time.monotonic() - start >= 2.0  # not before the bound
        assert any("has not formed 2.5 s after" in s for s in said), said
        assert not any("process 0 lost" in s for s in said), said
    finally:
        stop.set()
        [t.join() for t in threads]


def test_a_hung_task_is_told_from_a_blocked_one_by_its_ticks(served):
    job, coordinator, said, _ = served
    a, b = Raw(job, 0), Raw(job, 1)
    stop = threading.Event()

    def runs(task: Raw) -> None:  # a process that runs, blocked in a collective: ticks, no progress
        while not stop.wait(0.1):
            task.beat(5)

    b.beat(5)  # then stopped
    ticker = threading.Thread(target=runs, args=(a,), daemon=True)
    ticker.start()
    try:
        assert b.next() == {"declared": "lost"}
        assert a.next() == {"look": 0}
    finally:
        stop.set()
    assert json.loads(job.bound(coordinator.instance).read(failed_key(0))) == [1]
    assert any("process 1 lost (hung" in s and "stopped running" in s for s in said), said


def test_a_task_sees_the_coordinator_die(served, monkeypatch):
    from ntp_nemo.resilience.cluster_task import ClusterLink

    job, coordinator, _, _ = served
    monkeypatch.setenv("NTP_JOB_SECRET", SECRET.decode())
    monkeypatch.setenv(PLACE_ENV, "unset")  # restored at the end: the link exports this process's place
    monkeypatch.setenv(WORLD_ENV, "unset")
    host, port = coordinator.job.store.underlying_store.host, coordinator.job.store.underlying_store.port
    told: list[bool] = []
    link = ClusterLink((host, port), want=0, ntasks=2, heartbeat_s=3600.0, say=lambda s: None).open()
    link.on_coordinator_lost = lambda: told.append(True)
    assert (link.place, link.mode, link.world) == (0, "start", 2)
    coordinator.places[0].line.sock.shutdown(socket.SHUT_RDWR)  # its end of the link goes, as when it dies
    _until(link.coordinator_lost.is_set)
    assert told == [True]


def test_bad_input_stops_the_coordinator_before_it_listens(tmp_path):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "NTP_"))}
    cases = [
        ({"MASTER_PORT": str(free_port()), "NTP_JOB_SECRET": SECRET.decode()}, ["mesh.dpp=2"],
         "mesh.dpp: no such key in mesh"),
        ({"MASTER_PORT": str(free_port()), "NTP_JOB_SECRET": SECRET.decode()}, ["ntp.replica_tp=[2,5]",
         "mesh.tp=2", "mesh.dp=2"], "ntp.replica_tp: replica 1 has 5 active ranks"),
        ({"MASTER_PORT": str(free_port())}, [], "NTP_JOB_SECRET is not set"),
        ({"NTP_JOB_SECRET": SECRET.decode()}, [], "MASTER_PORT: unset"),
    ]
    for env, args, said in cases:
        res = subprocess.run([sys.executable, "-m", "ntp_nemo.cli.coordinator", *args], env={**base, **env},
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and said in res.stderr, (args, res.stderr[-2000:])
        assert "Traceback" not in res.stderr and "coordinator ready" not in res.stdout
