"""A task's side of a cluster job with `ntp-coordinator` (see `coordinator.py`, `cluster_protocol.py`).

`ClusterLink.open()` connects to the coordinator's store and link, proves the job's secret and gets a
place: the process id this task trains as (`SLURM_PROCID` while the job forms; a gone process's for a
replacement, which then rejoins).  From then on a watcher thread reads the link:

- `look` (a failure was published): a survivor blocked in a collective with a hung peer severs this
  generation's connections (`LiveRecovery.interrupt`), so its collective fails at once and the live
  recovery starts; a task that finds itself on the list (it was hung, and runs again) stops with
  `DECLARED_LOST_EXIT`;
- `end`: the coordinator stopped the job (the survivors could not recover live, a task was lost while
  the job formed, its store stopped answering): stop with `FALLBACK_EXIT`;
- the link closing: the coordinator died.  The task asks the run to stop at the end of the step, with
  every rank agreeing, without a checkpoint (a save needs the store for its groups), and exits with
  `COORDINATOR_LOST_EXIT`; if it has not stopped within the heartbeat timeout, it exits anyway.

Heartbeats go on the link (sealed, with a tick that grows by one per beat) from a sender thread: the
training thread only records its (step, phase) in memory (`LinkHeartbeat`), so no I/O sits in the step,
and nothing an outsider writes to the store can make a healthy task look hung.  Every line the task acts
on is sealed by the coordinator for this connection (`cluster_protocol`); any other is ignored.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ntp_nemo.launch.node_layout import PLACE_ENV, WORLD_ENV
from ntp_nemo.resilience.cluster_protocol import (
    COORDINATOR_LOST_EXIT,
    DECLARED_LOST_EXIT,
    LINK_KEY,
    Line,
    task_claim,
    task_hello,
)
from ntp_nemo.resilience.coordinator import FALLBACK_EXIT
from ntp_nemo.resilience.rendezvous import failed_key
from ntp_nemo.resilience.store_auth import JobStore, connect_cluster_store


class LinkRefused(RuntimeError):
    """The coordinator gave this task no place (its reason is the message)."""


class LinkCut(RuntimeError):
    """The link closed during the hello without a word: the coordinator closed it under load (strangers
    crowding its link port) or went away. The task connects again until its join timeout."""


ANSWER_S = 10.0  # what answers on the link sends its nonce at once: past this, it is not the coordinator
NO_LINK_S = 30.0  # a store that answers but holds no signed link record this long is not the coordinator's


class ClusterLink:
    """This task's connection to the coordinator (see the module docstring)."""

    def __init__(self, address: tuple[str, int], want: int, ntasks: int, *, heartbeat_s: float,
                 timeout_s: float = 300.0, say: Callable[[str], None] | None = None,
                 warm: Callable[[], None] | None = None) -> None:
        """`warm()`: what a task told to wait as a spare does meanwhile, besides loading Lightning
        (`spares.warm_torch_and_model`: torch and the model's shapes), so that it builds its trainer at
        once when it gets a place."""
        self.address, self.want, self.ntasks = address, int(want), int(ntasks)
        self.warm = warm
        self.heartbeat_s, self.timeout_s = float(heartbeat_s), float(timeout_s)
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        self.job: JobStore | None = None
        self.line: Line | None = None
        self.place: int | None = None
        self.mode: str | None = None  # start | rejoin
        self.world: int | None = None
        self.on_look: Callable[[int, list[int]], None] | None = None  # set by LiveRecovery
        self.on_coordinator_lost: Callable[[], None] | None = None  # set by the task runner
        self.coordinator_lost = threading.Event()
        self._announced: queue.Queue = queue.Queue()
        self._said_bye = False
        self._inbox: list[dict] = []  # messages read with the hello's last one, for the watcher
        self._joined = False  # a replacement that got its rejoin announcement
        self._ended = False  # a replacement told to stop before it joined (the link then closes)
        self._beat: tuple[int, str] | None = None
        self._sent: tuple[int, str] | None = None
        self._halt = threading.Event()
        self._exit: Callable[[int], Any] = os._exit  # how the watcher ends the process
        self.ignored = 0  # lines on the link the coordinator did not seal (forged, replayed)

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # ---- start-up ---------------------------------------------------------------------------------
    def open(self) -> ClusterLink:
        """Connect, authenticate, get a place; exports NTP_PLACE and NTP_WORLD_SIZE for this process.

        A hello the coordinator cuts (its link port crowded by strangers) is tried again with a growing
        pause until `timeout_s`; something that answers on the address but is not this job's coordinator
        (a silent listener, another job's store, a store without the job's link record) is named within
        seconds."""
        host, port = self.address
        deadline = time.monotonic() + self.timeout_s
        slow = threading.Timer(ANSWER_S, self.say, (
            f"coordinator {self.where}: nothing has answered there as a store for {ANSWER_S:.0f} s; "
            f"waiting up to {self.timeout_s:.0f} s (is NTP_COORDINATOR this job's `ntp-coordinator` "
            "address?)",))
        slow.daemon = True
        slow.start()
        try:
            self.job = connect_cluster_store(host, port, timeout_s=self.timeout_s,
                                             required_by=f"the coordinator's store at {self.where}")
        finally:
            slow.cancel()
        link_port = self._link_port(deadline)
        pause, said = 0.05, False
        while True:
            try:
                reply = self._hello(host, link_port)
                break
            except LinkCut as err:
                if time.monotonic() + pause >= deadline:
                    raise LinkCut(f"{err}, and again on every try for {self.timeout_s:.0f} s (the "
                                  "coordinator's link port is crowded, or the coordinator is gone)") from None
                if not said:
                    self.say(f"coordinator {self.where}: {err}; connecting again (someone else may be "
                             "crowding its link port)")
                    said = True
                time.sleep(pause * (1 + 0.5 * (os.getpid() % 7) / 7))  # spread the tasks' retries
                pause = min(2.0, pause * 2)
        sock = self.line.sock
        if "wait" in reply:
            self.say(f"coordinator {self.where}: {reply['wait']}; this task waits as a spare for a place")
            # A spare builds its trainer the moment it gets a place, while the survivors keep training:
            # load Lightning (~10 s) and warm torch and the model during the wait, not after it.
            threading.Thread(target=self._warm_up, name="ntp-spare-warm-up", daemon=True).start()
            reply = self._next()
            if "end" in reply:
                self.say(f"coordinator {self.where}: {reply['end']}; this spare exits")
                sys.exit(0)
        if "refused" in reply:
            raise LinkRefused(f"the coordinator at {self.where} refused this task: {reply['refused']}")
        self.place, self.mode, self.world = int(reply["place"]), str(reply["mode"]), int(reply["world"])
        self.job = self.job.bound(str(reply["instance"]))  # the notices of this job instance only
        sock.settimeout(None)
        os.environ[PLACE_ENV], os.environ[WORLD_ENV] = str(self.place), str(self.world)
        threading.Thread(target=self._watch, name="ntp-coordinator-link", daemon=True).start()
        threading.Thread(target=self._send_beats, name="ntp-heartbeat", daemon=True).start()
        return self

    def _warm_up(self) -> None:
        """A waiting spare's warm-up (in a thread while the link waits for a place); a failure of it is
        said and changes nothing else: the same work then happens once the task has its place."""
        t0 = time.monotonic()
        try:
            importlib.import_module("lightning.pytorch")
            if self.warm is not None:
                self.warm()
        except Exception as err:  # noqa: BLE001 - a warm-up is an optimisation, never a failure
            self.say(f"coordinator {self.where}: this spare's warm-up failed ({type(err).__name__}: {err}); "
                     "it builds everything once it has a place")
            return
        self.say(f"coordinator {self.where}: this spare is warm (Lightning, torch, the model's shapes) "
                 f"{time.monotonic() - t0:.1f} s into its wait")

    def _link_port(self, deadline: float) -> int:
        """The link's port from the coordinator's signed record on its store; a store that answers but
        holds none for `NO_LINK_S` is not this job's coordinator (LinkRefused)."""
        assert self.job is not None
        wait_s = max(0.0, min(NO_LINK_S, deadline - time.monotonic()))
        try:
            return int(self.job.wait_for(LINK_KEY, wait_s))
        except TimeoutError:
            raise LinkRefused(f"the store at {self.where} answers but holds no link record signed with "
                              f"this job's secret after {wait_s:.0f} s: NTP_COORDINATOR points at something "
                              "that is not this job's `ntp-coordinator` (another job's or someone else's "
                              "store), or NTP_JOB_SECRET differs from the coordinator's") from None

    def _hello(self, host: str, link_port: int) -> dict:
        """One try: connect to the link, claim, answer the nonce; the coordinator's first reply."""
        assert self.job is not None
        if self.line is not None:  # an earlier try's connection, cut
            self.job.keep_fds.discard(self.line.sock.fileno())
            self.line.close()
        try:
            sock = socket.create_connection((host, link_port), timeout=ANSWER_S)
        except OSError as err:
            raise LinkCut(f"the coordinator's link at {host}:{link_port} did not take the connection "
                          f"({err.strerror or err})") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.line = Line(sock)
        self.job.keep_fds.add(sock.fileno())  # severing a generation leaves the link alone
        self._inbox.clear()
        task_claim(self.line, self.job.secret)  # at once: the coordinator keeps a claimed connection
        with selectors.DefaultSelector() as sel:  # the coordinator sends its nonce as it accepts
            sel.register(sock, selectors.EVENT_READ)
            if not sel.select(ANSWER_S):
                raise LinkRefused(f"what answers at {host}:{link_port} sent nothing in {ANSWER_S:.0f} s: it "
                                  "is not ntp-coordinator's link (a silent listener?)")
        nonce = self._next().get("nonce")
        if not isinstance(nonce, str) or self._inbox:  # the coordinator says nothing more before the hello
            raise LinkRefused(f"what answers at {host}:{link_port} is not ntp-coordinator's link (it "
                              "answered the connection with something else than one nonce)")
        task_hello(self.line, self.job.secret, nonce, want=self.want, ntasks=self.ntasks,
                   host=socket.gethostname(), pid=os.getpid())
        sock.settimeout(self.timeout_s)
        return self._next()

    def _next(self) -> dict:
        assert self.line is not None
        while True:
            if self._inbox:
                return self._inbox.pop(0)
            msgs = self.line.receive()
            if msgs is None:
                plain = self.line.last_rejected or {}
                if "refused" in plain:  # not sealed: a wrong secret on either side, or not the coordinator
                    raise LinkRefused(f"the coordinator at {self.where} refused this task: "
                                      f"{str(plain['refused'])[:300]} (an unsealed reply: the job's "
                                      "secret differs, or something else answers on its port)")
                why = f" ({self.line.error})" if self.line.error else ""
                if self.line.rejected or self.line.last_rejected is not None:
                    raise LinkRefused(f"the coordinator at {self.where} closed the link during the hello "
                                      f"after a reply it did not seal{why} (the job's secret differs, or "
                                      "something else answers on its port)")
                raise LinkCut(f"the coordinator at {self.where} closed the link during the hello{why}")
            self._inbox.extend(msgs)  # one read may bring several (`wait`, then the place at once)

    def ready(self) -> tuple[int, int]:
        """A replacement, about to join: tell the coordinator and wait for the generation to join and
        the survivor that sends Lightning's state: (generation, source)."""
        assert self.line is not None
        self.line.send({"ready": True})
        msg = self._announced.get()
        if "end" in msg:
            self.say(f"coordinator: {msg['end']}; this replacement stops")
            self.bye("done")
            os._exit(0)
        return int(msg["rejoin"]), int(msg["source"])

    # ---- heartbeats -------------------------------------------------------------------------------
    def beat(self, step: int, phase: str) -> None:
        """Record this task's progress (the sender thread publishes it): no I/O here."""
        self._beat = (int(step), phase)

    def _send_beats(self) -> None:
        """A beat on the link when the phase changed (checked every 0.1 s at most), and at least every
        quarter of the heartbeat timeout: its tick says the process runs (a stopped or frozen one sends
        none), its phase that it makes progress."""
        every = max(0.02, min(0.1, self.heartbeat_s / 8))
        tick_every = max(every, self.heartbeat_s / 4)
        tick, last = 0, 0.0
        while not self._halt.wait(every):
            beat, now = self._beat, time.monotonic()
            if beat is None or self.place is None or (beat == self._sent and now - last < tick_every):
                continue
            tick += 1
            if not self.line.send({"beat": [beat[0], beat[1]], "tick": tick}):
                return  # the link is gone with the coordinator: the watcher says so
            self._sent, last = beat, now

    # ---- the watcher ------------------------------------------------------------------------------
    def _watch(self) -> None:
        assert self.line is not None
        while True:
            msgs, self._inbox = (self._inbox, []) if self._inbox else (self.line.receive(), [])
            if msgs is None:
                if not self._said_bye and not self._ended:
                    self._lost_coordinator()
                return
            if self.line.rejected > self.ignored:
                if self.ignored == 0 or self.line.rejected // 100 > self.ignored // 100:
                    self.say(f"failover | ignored {self.line.rejected} line(s) on the link that the "
                             "coordinator did not seal (forged or replayed: someone else writes to it)")
                self.ignored = self.line.rejected
            for msg in msgs:
                if "declared" in msg:
                    self._declared_lost()
                elif "look" in msg:
                    try:
                        self._look(int(msg["look"]))
                    except Exception:  # noqa: BLE001 - the store went with the coordinator
                        self._lost_coordinator()
                        return
                elif "rejoin" in msg:
                    self._joined = True  # a later `end` stops it as any task
                    self._announced.put(msg)
                elif "end" in msg:
                    if self.mode == "rejoin" and not self._joined:  # `ready` says it and exits 0
                        self._ended = True
                        self._announced.put(msg)
                        continue
                    self.say(f"failover | coordinator: {msg['end']}; stopping with exit {FALLBACK_EXIT} "
                             "(the coordinator stopped the job: resubmit it with resume=auto)")
                    self.bye("fallback")
                    self._exit(FALLBACK_EXIT)
                    return

    def _look(self, generation: int) -> None:
        raw = self.job.read(failed_key(generation))
        if raw is None:
            return
        failed = [int(p) for p in json.loads(raw)]
        if self.place in failed:
            self._declared_lost()
        if self.on_look is not None:
            self.on_look(generation, failed)

    def _declared_lost(self) -> None:
        self.say(f"failover | process {self.place} was declared lost by the coordinator (no heartbeat "
                 f"progress for {self.heartbeat_s:g} s) and the others went on without it; exiting")
        self.bye("lost")
        self._exit(DECLARED_LOST_EXIT)

    def _lost_coordinator(self) -> None:
        self.coordinator_lost.set()
        self._halt.set()
        self.say(f"failover | the coordinator at {self.where} is gone: stopping at the end of this step "
                 "without a checkpoint (the latest checkpoint stays valid); resubmit with resume=auto")
        if self.on_coordinator_lost is not None:
            self.on_coordinator_lost()

        def last_resort() -> None:
            self.say(f"failover | the coordinator is gone and this process did not stop within "
                     f"{self.heartbeat_s:g} s; exiting")
            self._exit(COORDINATOR_LOST_EXIT)

        timer = threading.Timer(self.heartbeat_s, last_resort)
        timer.daemon = True
        timer.start()

    def lost_coordinator(self, wait_s: float = 1.0) -> bool:
        """The coordinator is gone (waits up to `wait_s` for the watcher to see the link close)."""
        return self.coordinator_lost.wait(wait_s)

    # ---- the end ----------------------------------------------------------------------------------
    def bye(self, kind: str) -> None:
        """Tell the coordinator why this task exits (done, idle, fallback, lost, error)."""
        if self._said_bye or self.line is None:
            return
        self._said_bye = True
        self._halt.set()
        self.line.send({"bye": kind})
        try:
            self.line.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@functools.cache
def _link_heartbeat_class() -> type:
    """`LinkHeartbeat`, built on first use: its base is a Lightning callback, and `import lightning` costs
    seconds that the coordinator's tools and tests do not need."""
    from ntp_nemo.resilience.heartbeat import Heartbeat

    class LinkHeartbeat(Heartbeat):
        """The heartbeat of a cluster task: each phase goes to the coordinator on the link (via the link's
        sender thread), not to a file."""

        def __init__(self, link: ClusterLink) -> None:
            super().__init__(".")
            self.link = link

        def beat(self, trainer: Any, phase: str, step: int) -> None:
            self.link.beat(step, phase)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                self.beat(trainer, "setup", trainer.global_step)

    return LinkHeartbeat


def __getattr__(name: str) -> Any:
    if name == "LinkHeartbeat":
        return _link_heartbeat_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_link(want: int, ntasks: int, heartbeat_s: float, timeout_s: float = 300.0,
              warm: Callable[[], None] | None = None) -> ClusterLink | None:
    """The link of a task started under a coordinator (`NTP_COORDINATOR` set), else None; `warm`: a
    waiting spare's warm-up (`ClusterLink`)."""
    from ntp_nemo.resilience.cluster_protocol import coordinator_address

    address = coordinator_address()
    if address is None:
        return None
    # The store client waits up to `timeout_s` for the coordinator's server (the batch script starts both
    # at once).
    return ClusterLink(address, want, ntasks, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                       warm=warm).open()


def run_task(link: ClusterLink, trainer: Any, module: Any, resume: Any, result: Any) -> None:
    """Train this task of a cluster job under its coordinator: generation 0 on the coordinator's store
    (or, for a replacement, the rejoin the coordinator announces), live recovery on a lost peer, and a
    goodbye at the end.  `result.exit_code` becomes `COORDINATOR_LOST_EXIT` when the coordinator died."""
    from ntp_nemo.lightning.callbacks import PreemptionCheckpoint
    from ntp_nemo.resilience.live_worker import Rejoining, prepare_rejoin, use_rendezvous
    from ntp_nemo.resilience.rendezvous import join

    strategy = trainer.strategy
    timeout_s = strategy.collective_timeout_s
    stop = next((cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)), None)
    if stop is not None:
        link.on_coordinator_lost = lambda: stop.store_lost(f"the coordinator at {link.where}")
    if link.mode == "rejoin":
        prepare_rejoin(trainer, Rejoining(lambda: link.job, strategy.layout, int(link.place),
                                          announce=link.ready, timeout_s=timeout_s))
        ckpt_path: str | None = Rejoining.CKPT_PATH
    else:
        use_rendezvous(trainer, lambda s: join(link.job, 0, s.global_rank, s.topology.world_size,
                                               backend=s.process_group_backend or "gloo",
                                               timeout_s=timeout_s))
        ckpt_path = str(resume) if resume else None
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except BaseException:
        if link.lost_coordinator(0.5):
            result.exit_code = COORDINATOR_LOST_EXIT
            return
        link.bye("error")
        raise
    if link.coordinator_lost.is_set():
        result.exit_code = COORDINATOR_LOST_EXIT
        return
    link.bye("done")
