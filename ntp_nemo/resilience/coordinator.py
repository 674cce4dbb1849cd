"""The coordinator of a cluster job: one process that outlives every rank (`ntp-coordinator`).

Started once per job before the tasks (in the batch script, on the first node, in the background), it
hosts the job's store, hands out places, watches the tasks and drives live recovery:

- **places.** A task asks for place `SLURM_PROCID`; while the job forms, it gets it.  Once training has
  started, a new task (a replacement started later by the batch script, whose own `srun` step has one
  task) gets a place whose process is gone, and joins as a rejoin;
- **failures.** A task whose link closes without saying goodbye is lost (its process died); one whose
  heartbeat (sent on its link) has not moved for `fault.heartbeat_timeout_s` while it trains, and which
  is behind the others, is hung and declared lost.  Losses within `grace_s` of each other are one failure:
  the coordinator publishes `failed/gen{g}` on the store (signed) and wakes every survivor (`look`);
  the survivors re-plan with the run's policy and reshard from each other's memory
  (`resilience/recovery.py`), as under `ntp-train`;
- **rejoin.** When every gone place has a replacement ready to join, it announces the rejoin on the
  store (`rejoin/gen{g}`) a few steps ahead of the survivors; the layout returns to the original;
- **fallback.** A survivor that cannot recover live says so (`bye: fallback`): the coordinator tells
  every task to stop and exits with `FALLBACK_EXIT`; a resubmission with `resume=auto` takes the
  restart path;
- **the forming job.** A task lost before every place is taken and trains (the others wait in the
  first rendezvous for it): the coordinator stops every task at once and exits with `FALLBACK_EXIT`;
- **its own store.** A thread times a round trip to the store every quarter second.  While the store does
  not answer, nobody is declared hung (a task blocked on the store is not at fault) and losses are held;
  the coordinator says its store is the problem, and stops the job (`FALLBACK_EXIT`) when the store stays
  silent for `store_timeout_s`;
- **the end.** When no task is left, it exits (0 when the job finished).

It is a network service anyone who reaches the node can talk to: one `selectors` loop (epoll: any number
of descriptors), bounded lines (`cluster_protocol.Line`), at most `max_pending` connections that have not
proved the job's secret (the oldest goes first), each for `hello_timeout_s`, a pause instead of a spin when
`accept` runs out of descriptors, and every error of one connection confined to that connection.

Its own death is seen by every task (their links close): they stop (`COORDINATOR_LOST_EXIT`).

What it knows (each place's state, host, last beat and heartbeat age, the generation, waiting spares) it
writes, given a `state_path` (`ntp-coordinator`: `STATE_FILE` in the run directory), at most once a second
from a thread of its own, atomically (`_StateWriter`): `ntp-dashboard` shows a cluster job's places from it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ntp_nemo.resilience.beats import PHASES, Beat, suspects
from ntp_nemo.resilience.cluster_protocol import LINK_KEY, MAX_LINE, Line, auth_ok, claim_ok, session_key
from ntp_nemo.resilience.rendezvous import (
    prune_generations,
    publish_failed,
    publish_rejoin,
    resident_mb,
    seal_intact,
    seal_store,
)
from ntp_nemo.resilience.store_auth import JobStore

FALLBACK_EXIT = 75  # as a survivor that could not recover live (resilience/live_worker.py)
REJOIN_AHEAD = 4  # steps between the announcement of a rejoin and the step it happens before
PROBE_KEY = "coordinator/probe"  # the coordinator's own round trips to its store
HELLO_LIMIT = 2048  # bytes an unauthenticated connection may send
STORE_GROWTH_MB = 512.0  # growth of the coordinator (which hosts the store) that counts as a flood of it
STATE_FILE = Path("failover") / "coordinator.json"  # what it knows, relative to the run directory
STATE_EVERY_S = 1.0  # the state file is written at most this often


@dataclass
class Place:
    pid: int
    state: str = "free"  # free | active | lost | idle | done | fallback | replacing | error | ended
    line: Line | None = None
    ready: bool = False  # a replacement waiting to join
    beat: tuple[int, str] | None = None  # last (step, phase) it sent
    moved_t: float = 0.0  # coordinator's clock when it last changed
    tick: int = -1  # the sender thread's counter: it moves while the process runs
    alive_t: float = 0.0  # coordinator's clock when the tick last moved
    declared: bool = False  # declared lost while its link stayed open (a hang)
    started: bool = False  # reported a phase past set-up (it left the first rendezvous)
    stale: int = 0  # beats whose tick did not move forward (ignored)
    host: str = ""  # the host its task said it runs on


@dataclass
class _Pending:
    line: Line
    nonce: str
    peer: str
    source: str = ""  # the peer's address without the port: what per-source limits count
    claimed: bool = False  # it proved early that it is one of the job's tasks (`claim_ok`)
    t: float = field(default_factory=time.monotonic)


class _StoreProbe:
    """Times a round trip to the coordinator's own store, in a thread (a silent store blocks the caller
    for the store's whole timeout).  Once a second it also checks that the job's keys are still its own
    (the store's seal, `rendezvous.seal_store`, there and unchanged) and that the store, hosted in this
    process, has not grown it by `STORE_GROWTH_MB`: anyone who reaches the port can delete every key or
    write values until the node runs out of memory.  `interference` then says which, for the job to stop
    naming it."""

    def __init__(self, job: JobStore, every_s: float) -> None:
        self.job, self.every_s = job, every_s
        self.ok_t = time.monotonic()
        self.error: str | None = None
        self.rtt_s = 0.0
        self.interference: str | None = None
        self._seal = seal_store(job)
        self._rss0, self._growth_mb = resident_mb(), STORE_GROWTH_MB
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ntp-store-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._halt.wait(self.every_s):
            n += 1
            t = time.monotonic()
            try:
                self.job.store.set(PROBE_KEY, str(n))
                self.job.store.get(PROBE_KEY)
            except Exception as err:  # noqa: BLE001 - any failure of the store is what this measures
                self.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                continue
            self.ok_t, self.rtt_s, self.error = time.monotonic(), time.monotonic() - t, None
            if n % max(1, round(1.0 / self.every_s)) == 0 and self.interference is None:
                self.interference = self._interference()

    def _interference(self) -> str | None:
        try:
            if not seal_intact(self.job, self._seal):
                return ("its keys were wiped or overwritten (the seal the coordinator wrote on its store "
                        "vanished or changed): something else that reaches the store's port deleted or "
                        "rewrote the job's coordination keys")
        except Exception:  # noqa: BLE001 - a store that does not answer is silent, not wiped
            return None
        now = resident_mb()
        self._rss0 = min(self._rss0, now)  # from the least it held: memory freed since must not hide a flood
        grown = now - self._rss0
        if grown > self._growth_mb:
            return (f"it was flooded: the coordinator, which hosts it, grew by {grown:.0f} MiB over the "
                    f"least it held since it started (bound {self._growth_mb:.0f} MiB; the job's own keys "
                    "take a few KiB): something else that reaches the store's port is writing to it")
        return None

    def silent_s(self, now: float) -> float:
        """Seconds since the store last answered."""
        return max(0.0, now - self.ok_t)

    def stop(self) -> None:
        """Stop probing; waits for a round trip in flight (bounded: a silent store's op is left behind)."""
        self._halt.set()
        self._thread.join(timeout=5.0)


class _StateWriter:
    """Writes the coordinator's state file in a thread (a slow shared filesystem never holds the loop up):
    the newest document handed over, to a temporary file then `os.replace`d.  A failure to write is said
    once and never stops the coordinator."""

    def __init__(self, path: Path, say: Callable[[str], None]) -> None:
        self.path, self.say = Path(path), say
        self._doc: dict | None = None
        self._lock = threading.Lock()
        self._wake, self._halt = threading.Event(), threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="ntp-coordinator-state", daemon=True)
        self._thread.start()

    def put(self, doc: dict) -> None:
        with self._lock:
            self._doc = doc
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            with self._lock:
                doc, self._doc = self._doc, None
            if doc is not None:
                self._write(doc)
            if self._halt.is_set() and self._doc is None:
                return

    def _write(self, doc: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # as the run's failover/
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except Exception as err:  # noqa: BLE001 - the page's file must never stop the job
            if not self._failed:
                self._failed = True
                self.say(f"coordinator: cannot write its state file {self.path} ({type(err).__name__}: "
                         f"{err}); it goes on without (ntp-dashboard does not show the cluster's places)")

    def close(self, doc: dict) -> None:
        """Write `doc` last and stop (bounded: a write stuck on the filesystem is left behind)."""
        self.put(doc)
        self._halt.set()
        self._wake.set()
        self._thread.join(timeout=5.0)


class Coordinator:
    """Serve one job until every task is gone; `serve()` returns the exit code."""

    def __init__(self, job: JobStore, secret: bytes, world_size: int, heartbeat_s: float, *,
                 host: str = "0.0.0.0", poll_s: float = 0.05, grace_s: float = 0.1,
                 end_step: int | None = None, say: Callable[[str], None] = print,
                 store_timeout_s: float = 600.0, max_pending: int = 64, hello_timeout_s: float = 10.0,
                 store_silent_s: float | None = None, rejoin_s: float | None = None,
                 max_pending_per_source: int | None = None, state_path: Path | None = None) -> None:
        self.instance = secrets.token_hex(16)  # this job's: the notices it signs carry it
        self.started_t = time.time()
        self._secret = secret
        self.world = int(world_size)
        self.heartbeat_s, self.poll_s, self.grace_s = float(heartbeat_s), poll_s, grace_s
        self.end_step = end_step
        self.say = say
        self.store_timeout_s = float(store_timeout_s)
        # The store counts as silent once a round trip has not come back for this long.
        self.store_silent_after_s = (float(store_silent_s) if store_silent_s is not None
                                     else max(1.0, min(5.0, self.heartbeat_s / 2)))
        self.max_pending, self.hello_timeout_s = int(max_pending), float(hello_timeout_s)
        # Unproven connections one address may hold (strangers on other hosts cannot crowd it out), and
        # the connections that claimed to be the job's own (`claim_ok`): strangers never evict those.
        self.max_pending_per_source = (int(max_pending_per_source) if max_pending_per_source is not None
                                       else max(4, self.max_pending // 4))
        self.max_claimed = 2 * self.world + 8
        # How long an announced rejoin may take to form (the survivors wait for it at its step; under
        # `ntp-coordinator`, `Timeouts.rejoin_s`): meanwhile only stopped ticks mark a process hung.
        self.rejoin_s = float(rejoin_s) if rejoin_s is not None else 2 * self.store_timeout_s
        self.places = [Place(p) for p in range(self.world)]
        self.generation = 0  # the generation the survivors train in
        self.formed = False  # every place was taken once: later tasks are replacements
        self.started = False  # every place reported training once: the first rendezvous is over
        self.fallback = False
        self.stop_why: str | None = None  # the coordinator stopped the job (told every task why)
        self._losses: list[int] = []
        self._loss_t: float | None = None
        self._pending: list[_Pending] = []
        self._spares: list[tuple[Line, str]] = []  # (line, host) of tasks waiting for a place
        self._beats_t = 0.0
        self._store_quiet_since: float | None = None  # the store went silent (said once)
        self._window_t = float("-inf")  # when the last fresh heartbeat window began (`_fresh_window`)
        self._joining: tuple[int, float, list[int]] | None = None  # (step, deadline, pids) of a rejoin
        self._accept_paused_until = 0.0
        self._said: set[str] = set()
        self.dropped = {"too many unauthenticated": 0, "hello timeout": 0, "protocol": 0, "refused": 0}
        self.stopping = False  # set from another thread: `serve` returns 1 at its next poll
        self.listener = socket.create_server((host, 0), backlog=1024)
        self.listener.setblocking(False)
        self.link_port = self.listener.getsockname()[1]
        job.put(LINK_KEY, str(self.link_port))
        self.job = job.bound(self.instance)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._listening = True
        self.probe = _StoreProbe(self.job, every_s=0.25)
        self._state = _StateWriter(Path(state_path), say) if state_path is not None else None
        self._state_t = float("-inf")

    # ---- the loop ---------------------------------------------------------------------------------
    def serve(self) -> int:
        try:
            while not self.stopping:
                for key, _ in self._sel.select(self.poll_s):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read_confined(key.data)
                now = time.monotonic()
                self._expire_hellos(now)
                self._resume_accepting(now)
                if self._store_check(now):
                    return self._stop_code()
                if now - self._beats_t >= min(0.25, self.heartbeat_s / 4):
                    self._beats_t = now
                    self._watch_beats(now)
                if self._losses and self._loss_t is not None and now - self._loss_t >= self.grace_s:
                    self._publish_losses()
                if self.stop_why is not None:
                    return self._stop_code()
                self._place_spares()
                self._maybe_rejoin()
                self._publish_state(now)
                if self._finished():
                    for line, _ in self._spares:
                        line.send({"end": "the job ended before a place came free"})
                        self._drop(line)
                    return self._exit_code()
            return 1
        finally:
            self.probe.stop()
            if self._state is not None:
                try:
                    self._state.close(self.state_doc(time.monotonic(), ended=True))
                except Exception:  # noqa: BLE001 - the page's file must never change how the job ends
                    pass

    # ---- what it knows, for the dashboard -----------------------------------------------------------
    def state_doc(self, now: float, ended: bool = False) -> dict:
        """Each place's state, host, last (step, phase) and heartbeat age (seconds since its last fresh
        beat, at `t`), the generation, the waiting spares, and how far the job got."""
        places = [{"place": p.pid, "state": p.state, "host": p.host or None,
                   "step": p.beat[0] if p.beat else None, "phase": p.beat[1] if p.beat else None,
                   "beat_age_s": round(max(0.0, now - p.alive_t), 3) if p.tick >= 0 else None,
                   "progress_age_s": round(max(0.0, now - p.moved_t), 3) if p.beat else None,
                   "connected": p.line is not None, "declared": p.declared, "ready": p.ready}
                  for p in self.places]
        return {"version": 1, "t": time.time(), "started_t": self.started_t, "world": self.world,
                "generation": self.generation, "formed": self.formed, "started": self.started,
                "fallback": self.fallback, "stop": self.stop_why, "ended": ended,
                "heartbeat_timeout_s": self.heartbeat_s, "store_silent_s": round(self.probe.silent_s(now), 3),
                "spares": [host for _, host in self._spares], "places": places}

    def _publish_state(self, now: float) -> None:
        if self._state is None or now - self._state_t < STATE_EVERY_S:
            return
        self._state_t = now
        try:
            self._state.put(self.state_doc(now))
        except Exception as err:  # noqa: BLE001 - the page's file must never stop the job
            self._say_once("state", f"coordinator: cannot describe its state ({type(err).__name__}: {err})")

    def _finished(self) -> bool:
        if not self.formed and not self.fallback:
            return False
        return not self._losses and all(p.line is None or p.declared for p in self.places)

    def _exit_code(self) -> int:
        if self.fallback:
            self.say("coordinator: the survivors could not recover live; every task stopped. Resubmit the "
                     "job with resume=auto: it resumes from the latest checkpoint (the restart path)")
            return FALLBACK_EXIT
        done = [p.pid for p in self.places if p.state == "done"]
        if done:
            self.say(f"coordinator: the job ended ({len(done)} task(s) finished training); exiting")
            return 0
        self.say("coordinator: every task is gone and none finished training; exiting")
        return 1

    def _say_once(self, what: str, text: str) -> None:
        if what not in self._said:
            self._said.add(what)
            self.say(text)

    # ---- stopping the job -------------------------------------------------------------------------
    def _stop(self, why: str) -> None:
        """Tell every task, spare and replacement to stop (`end`), once; `serve` then returns
        FALLBACK_EXIT with `why`."""
        if self.stop_why is not None:
            return
        self.stop_why = why
        for p in self.places:
            if p.line is not None:
                p.line.send({"end": why})
        for line, _ in self._spares:
            line.send({"end": why})

    def _stop_code(self) -> int:
        self.say(f"coordinator: {self.stop_why}. Every task was told to stop; exiting with {FALLBACK_EXIT}: "
                 "resubmit the job (resume=auto resumes from the latest checkpoint, if any)")
        for line in [p.line for p in self.places if p.line is not None] + [s[0] for s in self._spares]:
            self._drop(line)
        return FALLBACK_EXIT

    # ---- connections ------------------------------------------------------------------------------
    def _drop(self, line: Line) -> None:
        line.owner = None
        try:
            self._sel.unregister(line.sock)
        except (KeyError, ValueError, OSError):
            pass
        line.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections is taken in one turn, not one per poll
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._out_of_descriptors(err)
                return
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            self._make_room(str(peer[0]))
            line = Line(sock, limit=HELLO_LIMIT)
            nonce = secrets.token_hex(16)
            if not line.send({"nonce": nonce}):
                line.close()
                continue
            line.owner = _Pending(line, nonce, f"{peer[0]}:{peer[1]}", str(peer[0]))
            self._pending.append(line.owner)
            self._sel.register(sock, selectors.EVENT_READ, line)

    def _make_room(self, source: str) -> None:
        """Before a new connection from `source` is taken: past the bound on unproven connections (in all,
        or from `source`), one is closed: the oldest of the address that holds the most. A connection that
        claimed to be the job's (`claim_ok`) is never closed for a stranger; the victim's input is read
        first, so a claim or hello already sent is served rather than cut."""
        for _ in range(8):  # a victim served instead of closed is followed by another
            open_ = [q for q in self._pending if not q.claimed]
            mine = [q for q in open_ if q.source == source]
            if len(mine) >= self.max_pending_per_source:
                victims = mine
            elif len(open_) >= self.max_pending:
                counts: dict[str, int] = {}
                for q in open_:
                    counts[q.source] = counts.get(q.source, 0) + 1
                crowd = max(counts, key=lambda s: counts[s])
                victims = [q for q in open_ if q.source == crowd]
            else:
                return
            victim = victims[0]
            self._read_confined(victim.line)  # a claim (or the hello) already sent is served first
            if victim in self._pending and not victim.claimed:
                self._pending.remove(victim)
                self.dropped["too many unauthenticated"] += 1
                self._say_once("pending", f"coordinator: more than {self.max_pending} connections have not "
                               f"proved the job's secret (or more than {self.max_pending_per_source} from "
                               "one address); the oldest of the busiest address are closed (someone else is "
                               "connecting to the link port)")
                self._drop(victim.line)
                return

    def _claimed(self, pending: _Pending) -> None:
        """`pending` proved early that it is the job's: it leaves the strangers' pool (the oldest claimed
        connection makes room past `max_claimed`, which only the job's own can fill)."""
        claimed = [q for q in self._pending if q.claimed]
        if len(claimed) >= self.max_claimed:
            self.dropped["too many unauthenticated"] += 1
            self._pending.remove(claimed[0])
            self._drop(claimed[0].line)
        pending.claimed = True

    def _out_of_descriptors(self, err: OSError) -> None:
        """`accept` failed for want of descriptors: close the oldest unproven connection and stop
        accepting for a moment (the listener stays readable: accepting again at once would spin)."""
        if self._pending:
            self.dropped["too many unauthenticated"] += 1
            self._drop(self._pending.pop(0).line)
        if self._listening:
            self._sel.unregister(self.listener)
            self._listening = False
        self._accept_paused_until = time.monotonic() + 0.1
        self._say_once("emfile", f"coordinator: out of file descriptors while accepting on the link ({err}); "
                       "it closes unproven connections and pauses accepting (raise `ulimit -n`?)")

    def _resume_accepting(self, now: float) -> None:
        if not self._listening and now >= self._accept_paused_until:
            self._sel.register(self.listener, selectors.EVENT_READ, None)
            self._listening = True

    def _expire_hellos(self, now: float) -> None:
        while self._pending and now - self._pending[0].t >= self.hello_timeout_s:  # oldest first
            self.dropped["hello timeout"] += 1
            self._drop(self._pending.pop(0).line)

    def _read_confined(self, line: Line) -> None:
        """Serve one connection's input; whatever goes wrong with it ends that connection only."""
        try:
            self._read(line)
        except Exception as err:  # noqa: BLE001 - one connection's fault must not end the job
            self.dropped["protocol"] += 1
            self.say(f"coordinator: a link connection broke the protocol ({type(err).__name__}: {err}); "
                     "closed")
            place = line.owner if isinstance(line.owner, Place) and line.owner.line is line else None
            if place is not None:
                self._closed(place)
            else:
                self._pending = [q for q in self._pending if q.line is not line]
                self._spares = [s for s in self._spares if s[0] is not line]
                self._drop(line)

    def _read(self, line: Line) -> None:
        owner = line.owner
        if owner is None or (isinstance(owner, Place) and owner.line is not line):
            self._drop(line)  # dropped earlier in this turn (its readiness was already reported)
            return
        msgs = line.receive()
        if owner == "spare":  # a waiting spare only ever says goodbye
            if msgs is None or any("bye" in m for m in msgs):
                self._spares = [s for s in self._spares if s[0] is not line]
                self._drop(line)
            return
        if isinstance(owner, _Pending):
            pending = owner
            if msgs is None:
                self._pending.remove(pending)
                if line.error is not None:
                    self.dropped["protocol"] += 1
                self._drop(line)
                return
            while msgs and "claim" in msgs[0]:  # the task's early proof, sent before the nonce came
                msg = msgs.pop(0)
                if not pending.claimed and claim_ok(self._secret, msg):
                    self._claimed(pending)
            if not msgs:  # nothing complete yet: a hello is one small line
                return
            if pending not in self._pending:
                self._drop(line)  # made room for a later claim
                return
            self._pending.remove(pending)
            self._hello(line, pending, msgs[0])
            return
        place = owner
        if msgs is None:
            if line.error is not None:
                self.say(f"coordinator: process {place.pid}'s link sent {line.error}; closed")
            self._closed(place)
            return
        if line.rejected:
            self._say_once(f"rejected {place.pid}", f"coordinator: lines on process {place.pid}'s link that "
                           "the task did not seal (forged or replayed) were ignored")
        for msg in msgs:
            if "beat" in msg:
                self._beat(place, msg)
            elif "bye" in msg and place.declared:
                continue  # declared lost (hung) and running again: the others went on without it
            elif "bye" in msg:
                said = str(msg["bye"])
                place.state = said if said in ("done", "idle", "fallback", "lost") else "error"
                if place.state == "fallback":
                    self._fall_back(place.pid)
                elif not self.started and place.state in ("error", "lost", "idle"):
                    self._lose(place.pid, f"it stopped with {place.state!r}")
                if place.state == "idle":
                    self.say(f"coordinator: process {place.pid} left idle by the new layout")
            elif msg.get("ready") and place.state == "replacing":
                place.ready = True

    def _beat(self, place: Place, msg: dict) -> None:
        beat, tick = msg.get("beat"), msg.get("tick")
        if (not isinstance(beat, list) or len(beat) != 2 or not isinstance(beat[0], int)
                or beat[1] not in PHASES or not isinstance(tick, int)):
            return
        if tick <= place.tick:  # not fresh: a replayed or repeated beat is no sign of life
            place.stale += 1
            return
        now = time.monotonic()
        place.tick, place.alive_t = tick, now
        step_phase = (int(beat[0]), str(beat[1]))
        if step_phase != place.beat:
            place.beat, place.moved_t = step_phase, now
        if step_phase[1] != "setup":
            place.started = True
            if not self.started and self.formed and all(p.started for p in self.places):
                self.started = True

    def _hello(self, line: Line, pending: _Pending, msg: dict) -> None:
        task_nonce = msg.get("nonce")
        if not auth_ok(self._secret, pending.nonce, msg.get("auth"), task_nonce):
            self.dropped["refused"] += 1
            line.send({"refused": "the link connection did not prove the job's secret (NTP_JOB_SECRET "
                                  "differs from the coordinator's)"})
            self._drop(line)
            return
        line.limit = MAX_LINE  # proven: the protocol's own bound from now on
        line.seal(session_key(self._secret, pending.nonce, task_nonce), "coordinator")
        want, host = msg.get("want"), str(msg.get("host", "?"))[:200]
        # A task of another srun step than the job's (`--ntasks=1`, a relaunch loop) is a replacement: it
        # never takes a place while the job forms, and waits when none is free.
        spare = msg.get("ntasks") != self.world
        if not self.formed and not spare:
            if not isinstance(want, int) or not 0 <= want < self.world:
                why = (f"place {want} is outside the job's {self.world} places (SLURM_PROCID must be below "
                       f"the world size of the layout, {self.world})")
            elif self.places[want].state != "free":
                why = f"place {want} is taken (two tasks with the same SLURM_PROCID?)"
            else:
                place = self.places[want]
                place.state, place.line, place.moved_t = "active", line, time.monotonic()
                place.host = host
                line.owner = place
                self.formed = all(p.state != "free" for p in self.places)
                if self.formed:
                    self.say(f"coordinator: all {self.world} places taken; training starts")
                line.send({"place": want, "mode": "start", "world": self.world, "generation": 0,
                           "instance": self.instance})
                return
            line.send({"refused": why})
            self._drop(line)
            return
        if self.fallback or self.stop_why is not None:
            line.send({"refused": "the job is not training live any more (it falls back to the restart "
                                  "path)"})
            self._drop(line)
            return
        line.send({"wait": "no place is free: every process of the job is running"})
        self._spares.append((line, host))
        line.owner = "spare"
        self.say(f"coordinator: a replacement task on {host} waits for a free place")
        self._place_spares()

    def _place_spares(self) -> None:
        """Give each waiting replacement a place whose process is gone (its loss already published)."""
        if not self._spares or not self.formed or self.fallback or self.stop_why is not None:
            return
        if not any(p.state == "active" for p in self.places):
            return
        for place in self.places:
            if not self._spares:
                return
            if (place.state not in ("lost", "idle", "error") or place.pid in self._losses
                    or (place.line is not None and not place.declared)):
                continue
            line, host = self._spares.pop(0)
            if place.line is not None:  # a declared-lost (hung) process still connected: replaced now
                self._drop(place.line)
            place.state, place.line, place.ready, place.declared = "replacing", line, False, False
            place.host = host
            line.owner = place
            place.beat, place.tick = None, -1
            line.send({"place": place.pid, "mode": "rejoin", "world": self.world,
                       "generation": self.generation, "instance": self.instance})
            self.say(f"coordinator: the replacement on {host} takes the place of process {place.pid}")

    def _closed(self, place: Place) -> None:
        self._drop(place.line)
        place.line = None
        if place.state == "active":
            place.state = "lost"
            self._lose(place.pid, "its connection closed")
        elif place.state == "replacing":  # a replacement that died before joining: the place is gone again
            place.state, place.ready = "lost", False

    # ---- failures ---------------------------------------------------------------------------------
    def _lose(self, pid: int, why: str) -> None:
        self.say(f"coordinator: process {pid} lost ({why})")
        if not self.started:
            # The job is still forming: the others wait for it in the first rendezvous, which nothing
            # but the collective timeout would end.
            taken = sum(p.state != "free" for p in self.places)
            self._stop(f"process {pid} was lost ({why}) while the job formed ({taken} of {self.world} places "
                       "taken, not every task training yet): the others would wait for it in the first "
                       "rendezvous")
            return
        if self._loss_t is None:
            self._loss_t = time.monotonic()
        self._losses.append(pid)

    def _publish_losses(self) -> None:
        if self._store_quiet_since is not None:
            return  # held until the store answers again (`_store_check`)
        lost, self._losses, self._loss_t = sorted(set(self._losses)), [], None
        self._joining = None  # a rejoin under way fails with the loss; the fresh window covers the rest
        if not any(p.state == "active" for p in self.places):
            return
        publish_failed(self.job, self.generation, lost)
        failed_gen = self.generation
        self.generation += 1
        prune_generations(self.job, self.generation)
        self._fresh_window()
        for p in self.places:
            if p.line is not None and p.state in ("active", "lost"):
                p.line.send({"look": failed_gen})
        self.say(f"coordinator: published the loss of process(es) {lost} (generation {failed_gen}); the "
                 "survivors reshard in place")

    def _fall_back(self, pid: int) -> None:
        if self.fallback:
            return
        self.fallback = True
        self.say(f"coordinator: process {pid} could not recover live; stopping every task")
        for p in self.places:
            if p.line is not None and p.pid != pid:
                p.line.send({"end": "the survivors could not recover live"})

    # ---- its own store ----------------------------------------------------------------------------
    def _store_check(self, now: float) -> bool:
        """Whether the store's silence has lasted `store_timeout_s` (the job is stopped then).  While it
        is silent nobody is declared hung and losses wait; when it answers again every task gets a fresh
        heartbeat window (the silence held them up)."""
        if self.probe.interference is not None:
            self._stop(f"the coordinator's own store {self._store_where()} cannot be trusted any more: "
                       f"{self.probe.interference}")
            return True
        silent = self.probe.silent_s(now)
        if silent < self.store_silent_after_s:
            if self._store_quiet_since is not None:
                quiet = now - self._store_quiet_since
                self.say(f"coordinator: its store answers again (after {quiet:.1f} s)")
                self._store_quiet_since = None
                self._fresh_window()
            return False
        if self._store_quiet_since is None:
            self._store_quiet_since = now - silent
            where, err = self._store_where(), self.probe.error
            self.say(f"coordinator: its own store {where} has not answered a round trip for {silent:.1f} s"
                     f"{' (' + err + ')' if err else ''}: the store is the problem, "
                     "not the tasks (too many connections to its port?); nobody is declared lost while it "
                     f"does not answer, and the job stops if it stays silent for {self.store_timeout_s:g} s")
        if silent >= self.store_timeout_s:
            self._stop(f"the coordinator's own store {self._store_where()} did not answer for "
                       f"{silent:.0f} s (its limit: {self.store_timeout_s:g} s): without it no failure "
                       "can be recovered and no checkpoint saved")
            return True
        return False

    def _store_where(self) -> str:
        store = self.job.store
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        port = getattr(store, "port", None)
        return f"(port {port})" if port is not None else ""

    # ---- heartbeats -------------------------------------------------------------------------------
    def _fresh_window(self) -> None:
        """The survivors recover (or grow) now: their progress was held up by the failure itself, so each
        gets a whole heartbeat timeout from here before it can be called hung."""
        now = time.monotonic()
        self._window_t = now
        for p in self.places:
            if p.state == "active":
                p.moved_t = max(p.moved_t, now)
                p.alive_t = max(p.alive_t, now)

    def _watch_beats(self, now: float) -> None:
        active = [p for p in self.places if p.state == "active" and not p.declared]
        if not active or self._store_quiet_since is not None:
            return
        beats = {i: Beat(i, p.beat[0], p.beat[1], p.moved_t, p.pid)
                 for i, p in enumerate(active) if p.beat is not None}
        if len(beats) < len(active):
            return
        if not any(b.training and now - b.t > self.heartbeat_s for b in beats.values()):
            return
        # A process whose ticks stopped too (stopped, frozen) is the hung one; when every process still
        # runs (a rank stuck in a kernel or a collective), the one behind the others is.  Ranks blocked in
        # a collective with a hung peer report the same progress as it or more.
        frozen = [p for p in active if now - p.alive_t > 0.75 * self.heartbeat_s]
        if not frozen and self._rejoin_forming(now, active):
            return
        if (not frozen and now - self._window_t <= 2 * self.heartbeat_s
                and any(p.moved_t <= self._window_t for p in active)):
            # Someone has not reported since the survivors began to recover (or grow): a recovery on a
            # loaded machine may outlast one heartbeat timeout without a beat, and its slowest survivor
            # is not the hung one.  For two timeouts from the window's start only a process whose ticks
            # stopped is hung; then the one behind is, as always.
            return
        for p in frozen or [active[i] for i in suspects(beats, len(active))]:
            p.declared, p.state = True, "lost"
            p.line.send({"declared": "lost"})  # read when (if) it runs again: it stops then
            self._lose(p.pid, f"hung: no heartbeat progress for {self.heartbeat_s:g} s"
                       + (", and its process has stopped running" if frozen else ""))

    def _rejoin_forming(self, now: float, active: list[Place]) -> bool:
        """Whether an announced rejoin is still forming: not every process has begun its join step yet,
        and the rejoin's bound (`rejoin_s` from its announcement) has not passed.  While it forms the
        survivors wait at the join step for the replacement's rendezvous and state transfer, as long as
        that takes on a loaded machine; the order of their beats says nothing about a hang then."""
        if self._joining is None:
            return False
        step, deadline, pids = self._joining
        if all(p.beat is not None and (p.beat[0], PHASES[p.beat[1]]) >= (step, PHASES["step_start"])
               for p in active):
            self._joining = None  # every process runs the join step: the rejoin formed
            self.say(f"coordinator: process(es) {pids} joined; every process runs step {step}")
            return False
        if now > deadline:
            self._joining = None
            self.say(f"coordinator: the rejoin of process(es) {pids} has not formed {self.rejoin_s:g} s "
                     "after it was announced; a process behind the others is hung again")
            return False
        return True

    # ---- rejoin -----------------------------------------------------------------------------------
    def _max_step(self) -> int:
        return max((p.beat[0] for p in self.places if p.state == "active" and p.beat), default=0)

    def _maybe_rejoin(self) -> None:
        replacing = [p for p in self.places if p.state == "replacing"]
        if not replacing:
            return
        if not self._losses and not any(p.state == "active" for p in self.places):
            for p in replacing:  # nobody trains any more: there is nothing to join (else both wait forever)
                p.line.send({"end": "the job ended before this replacement could join"})
                self._drop(p.line)
                p.line, p.state = None, "ended"
            pids = [p.pid for p in replacing]
            self.say(f"coordinator: the job ended before process(es) {pids} could rejoin")
            return
        if not all(p.ready for p in replacing) or self._losses:
            return
        if self._store_quiet_since is not None:
            return
        if any(p.state in ("lost", "idle", "error") for p in self.places):
            return  # every gone place needs its replacement first
        survivors = [p for p in self.places if p.state == "active"]
        if not survivors:
            return
        join_at = self._max_step() + REJOIN_AHEAD
        if self.end_step is not None and join_at > self.end_step:
            for p in replacing:
                p.line.send({"end": "the job is too close to its last step for a rejoin"})
                p.state = "done"
            return
        source = min(p.pid for p in survivors)
        publish_rejoin(self.job, self.generation, join_at, range(self.world), source)
        self.generation += 1
        prune_generations(self.job, self.generation)
        self._fresh_window()
        self._joining = (join_at, time.monotonic() + self.rejoin_s, [p.pid for p in replacing])
        for p in replacing:
            p.line.send({"rejoin": self.generation, "source": source, "step": join_at})
            p.state, p.ready, p.moved_t, p.beat = "active", False, time.monotonic(), None
        self.say(f"coordinator: process(es) {[p.pid for p in replacing]} rejoin before step {join_at} "
                 f"(generation {self.generation})")
