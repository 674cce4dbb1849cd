"""Hot spares (`fault.spares=K`): K processes started with a live job, initialised and waiting to take a
lost process's place.

Under `ntp-train` the launching process (`live_launcher.LiveLauncher`) holds the `SparePool`.  A spare is
forked from it like a worker (`ForkLauncher.start_process`), so it shares the launcher's imports; before
any loss it then does what does not depend on the rank it will take (`warm_up`): torch set up as a rank
of the layout (its intra-op threads, a forward and backward on its device: the allocator and autograd's
engine), the model built on `meta` (the model code's imports and its shapes), and one training batch read
(the token files and the sampler).  It says it is ready on its pipe and waits there.  What it still does
after it is taken, as a forked repaired process does: Lightning's set-up, the rendezvous into the
generation the survivors form, its own slice of the model built on its device, and its shards and
Lightning's state received from the survivors' memory (`live_worker.Rejoining`).

Lifecycle, every wait bounded:
- `start()`: K spares forked; each must say it is ready within `ready_timeout_s`
  (`fault.startup_timeout_s`), or it is stopped and replaced;
- `take()`: a ready spare (None if none is), and at once a new one forked in its place (the pool
  refills in the background; `poll()` reports it ready).  A spare that died while waiting is replaced,
  never handed out;
- `assign(spare, message)`: the message the spare's body turns into its work (a rejoin);
- `close()`: every spare still waiting is told to exit and reaped (SIGKILL after `grace_s`): at the end
  of every attempt, live or not, a restart, a stop signal or an error alike (`LiveLauncher._launch`).

A spare waits on its pipe in slices of `POLL_S` and exits by itself once the launching process is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

READY = "ready"
RELEASE = "release"
POLL_S = 0.5  # a waiting spare's check that its launching process is still there
GIVE_UP_AFTER = 3  # spares in a row that die or time out before they are ready: the pool stops refilling


@dataclass
class Spare:
    """One spare process: its number in the job, its process and the launcher's end of its pipe."""

    number: int
    proc: Any
    conn: Any
    started: float = field(default_factory=time.monotonic)
    ready_s: float | None = None  # seconds from its start to its word that it is ready
    successor: int | None = None  # once taken: the number of the spare started in its place


class SparePool:
    """The job's hot spares (see the module docstring).

    `start_one(number, child_conn, parent_conn)` forks spare `number` and returns its process (the spare's
    body gets `child_conn`; it must close `parent_conn`); `say(line)` prints a console line; `record(**f)`
    writes a goodput `spare` event (None: none)."""

    def __init__(self, size: int, start_one: Callable[[int, Any, Any], Any], *, ready_timeout_s: float,
                 grace_s: float = 5.0, say: Callable[[str], None] = print,
                 record: Callable[..., None] | None = None) -> None:
        self.size, self.start_one = int(size), start_one
        self.ready_timeout_s, self.grace_s = float(ready_timeout_s), float(grace_s)
        self.say, self.record = say, record
        self.waiting: list[Spare] = []
        self.taken = 0  # spares handed out so far
        self._numbers = 0  # spares started so far (each one's number)
        self._failed_in_row = 0
        self.closed = False
        # The monitor thread takes and polls, the launching thread closes: one at a time
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            for _ in range(self.size):
                self._start()

    def _start(self) -> int | None:
        """Fork a spare; returns its number (None: the pool is closed or gave up)."""
        if self.closed or self._failed_in_row >= GIVE_UP_AFTER:
            return None
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        number = self._numbers
        self._numbers += 1
        proc = self.start_one(number, child, parent)
        child.close()
        self.waiting.append(Spare(number, proc, parent))
        return number

    def ready(self) -> list[Spare]:
        """The spares ready to be taken now (after `poll`)."""
        with self._lock:
            self.poll()
            return self._ready_now()

    def poll(self) -> None:
        """Read the spares' words: a spare ready is reported; one that died or did not get ready within
        `ready_timeout_s` is stopped and replaced."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        for s in list(self.waiting):
            if s.ready_s is None:
                try:
                    if s.conn.poll(0):
                        word = s.conn.recv()
                        if word == READY:
                            s.ready_s = time.monotonic() - s.started
                            self._failed_in_row = 0
                            self._note("ready", s, f"spare {s.number} ready {s.ready_s:.2f} s after its "
                                       f"start (pool {len(self._ready_now())}/{self.size})")
                            continue
                except (EOFError, OSError):
                    pass  # its end of the pipe closed: it died (seen below)
            if s.proc.exitcode is not None:
                self._drop(s, f"spare {s.number} died while waiting (exit status {s.proc.exitcode}); "
                           "another one starts")
            elif s.ready_s is None and time.monotonic() - s.started > self.ready_timeout_s:
                self._drop(s, f"spare {s.number} not ready {self.ready_timeout_s:g} s after its start "
                           "(fault.startup_timeout_s); it is stopped and another one starts")

    def _ready_now(self) -> list[Spare]:
        return [s for s in self.waiting if s.ready_s is not None and s.proc.exitcode is None]

    def _drop(self, s: Spare, why: str) -> None:
        self.waiting.remove(s)
        _kill(s.proc)
        s.conn.close()
        self._failed_in_row += s.ready_s is None
        self._note("died", s, why)
        if self._failed_in_row >= GIVE_UP_AFTER:
            self.say(f"failover | spares: {GIVE_UP_AFTER} spares in a row failed before they were ready; no "
                     "more are started (a replacement is started when it is needed, as without spares)")
            return
        self._start()

    def take(self) -> Spare | None:
        """A ready spare, out of the pool (None if none is ready); a new spare starts in its place."""
        with self._lock:
            self._poll()
            ready = self._ready_now()
            if not ready:
                return None
            s = ready[0]
            self.waiting.remove(s)
            self.taken += 1
            s.successor = self._start()
            return s

    def assign(self, spare: Spare, message: Any, idx: int) -> bool:
        """Send the taken `spare` its work (`message`: what its body turns into a rejoin as process
        `idx`); False if it died since it was taken (it is reaped: the caller starts a process instead)."""
        try:
            spare.conn.send(message)
        except OSError:
            spare.conn.close()
            _kill(spare.proc)
            self._note("died", spare, f"spare {spare.number} died as it was taken for process {idx}; a "
                       "process is started instead", process=idx)
            return False
        spare.conn.close()
        then = (f"spare {spare.successor} starts in its place" if spare.successor is not None
                else "no spare starts in its place")
        with self._lock:
            self._note("taken", spare, f"spare {spare.number} takes the place of process {idx} (it waited "
                       f"{time.monotonic() - spare.started:.1f} s); {then} "
                       f"(pool {len(self._ready_now())}/{self.size} ready)", process=idx)
        return True

    def close(self) -> None:
        """Tell every waiting spare to exit and reap it (SIGKILL after `grace_s`); no spare starts after."""
        with self._lock:
            self.closed = True
            waiting, self.waiting = self.waiting, []
        for s in waiting:
            try:
                s.conn.send(RELEASE)
            except (OSError, ValueError):
                pass  # already gone
        deadline = time.monotonic() + self.grace_s
        for s in waiting:
            s.proc.join(max(0.0, deadline - time.monotonic()))
            _kill(s.proc)
            s.conn.close()

    def _note(self, action: str, s: Spare, line: str, **fields: Any) -> None:
        self.say(f"failover | spares: {line}")
        if self.record is not None:
            self.record(action=action, spare=s.number, spare_pid=s.proc.pid, seconds=s.ready_s, **fields)


def _kill(proc: Any) -> None:
    if proc.exitcode is None and proc.pid is not None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.join(5)


def spare_body(conn: Any, parent_conn: Any, warm: Callable[[], None], work: Callable[[Any], None],
               launcher_pid: int) -> None:
    """A spare's life, in the forked process: warm up, say it is ready, wait for its work (`work(message)`:
    it becomes a worker and returns when that worker is done) or for its release.  Ctrl-C at the terminal
    reaches it too: it is ignored while it waits (the launching process releases it)."""
    parent_conn.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warm()
    conn.send(READY)
    while True:
        try:
            has = conn.poll(POLL_S)
            message = conn.recv() if has else None
        except (EOFError, OSError):
            return  # the launching process closed its end: released
        if message == RELEASE:
            return
        if message is not None:
            conn.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            work(message)
            return
        if os.getppid() != launcher_pid:  # the launching process is gone
            return


def warm_up(trainer: Any) -> None:
    """What a spare does before any loss (see the module docstring): nothing here depends on the rank it
    will take."""
    strategy, module = trainer.strategy, trainer.strategy.lightning_module
    warm_torch_and_model(module.model_cfg, strategy.root_device, strategy.layout.world_size)
    data = module.data
    micro = data.sampler.microbatch_ids(0, module.micro_batch_size)
    data.train.batch(micro[0])


def warm_torch_and_model(model_cfg: Any, device: Any, world_size: int) -> None:
    """The rank-independent part of a spare's warm-up: torch set up as a rank of a `world_size` layout on
    `device` (its intra-op threads, a forward and backward: the allocator and autograd's engine) and the
    model built on `meta` (the model code's imports and its shapes).  Also what a cluster job's spare task
    does while it waits for a place (`cluster_task.ClusterLink`): there `device` is the CPU, as no CUDA
    call is made before the task has its place and its GPU."""
    import torch

    from ntp_nemo.models import build_model

    device = torch.device(device)
    if world_size > 1 and device.type == "cpu":
        torch.set_num_threads(1)  # as the strategy sets it in a CPU rank
    x = torch.randn(64, 64, device=device, requires_grad=True)
    (x @ x).sum().backward()
    with torch.device("meta"):
        build_model(model_cfg)
