"""The coordinator of a cluster job: one process that outlives every rank (`ntp-coordinator`).

Started once per job before the tasks (in the batch script, on the first node, in the background), it
hosts the job's store, hands out places, watches the tasks and drives live recovery:

- **places.** A task asks for place `SLURM_PROCID`; while the job forms, it gets it.  Once training has
  started, a new task (a replacement started later by the batch script, whose own `srun` step has one
  task) gets a place whose process is gone, and joins as a rejoin;
- **failures.** A task whose link closes without saying goodbye is lost (its process died); one whose
  heartbeat on the store has not moved for `fault.heartbeat_timeout_s` while it trains, and which is
  behind the others, is hung and declared lost.  Losses within `grace_s` of each other are one failure:
  the coordinator publishes `failed/gen{g}` on the store (signed) and wakes every survivor (`look`);
  the survivors re-plan with the run's policy and reshard from each other's memory
  (`resilience/recovery.py`), as under `ntp-train`;
- **rejoin.** When every gone place has a replacement ready to join, it announces the rejoin on the
  store (`rejoin/gen{g}`) a few steps ahead of the survivors; the layout returns to the original;
- **fallback.** A survivor that cannot recover live says so (`bye: fallback`): the coordinator tells
  every task to stop and exits with `FALLBACK_EXIT`; a resubmission with `resume=auto` takes the
  restart path;
- **the end.** When no task is left, it exits (0 when the job finished).

Its own death is seen by every task (their links close): they stop (`COORDINATOR_LOST_EXIT`).
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ntp_nemo.resilience.beats import PHASES, Beat, suspects
from ntp_nemo.resilience.cluster_protocol import LINK_KEY, Line, auth_ok
from ntp_nemo.resilience.rendezvous import publish_failed, publish_rejoin
from ntp_nemo.resilience.store_auth import JobStore

FALLBACK_EXIT = 75  # as a survivor that could not recover live (resilience/live_training.py)
REJOIN_AHEAD = 4  # steps between the announcement of a rejoin and the step it happens before
BEAT_KEY = "beat/{pid}"


def beat_key(pid: int) -> str:
    return BEAT_KEY.format(pid=int(pid))


@dataclass
class Place:
    pid: int
    state: str = "free"  # free | active | lost | idle | done | fallback | replacing | error
    line: Line | None = None
    ready: bool = False  # a replacement waiting to join
    beat: tuple[int, str] | None = None  # last (step, phase) seen on the store
    moved_t: float = 0.0  # coordinator's clock when it last changed
    tick: int = -1  # the sender thread's counter: it moves while the process runs
    alive_t: float = 0.0  # coordinator's clock when the tick last moved
    declared: bool = False  # declared lost while its link stayed open (a hang)


@dataclass
class _Pending:
    line: Line
    nonce: str
    t: float = field(default_factory=time.monotonic)


class Coordinator:
    """Serve one job until every task is gone; `serve()` returns the exit code."""

    def __init__(self, job: JobStore, secret: bytes, world_size: int, heartbeat_s: float, *,
                 host: str = "0.0.0.0", poll_s: float = 0.05, grace_s: float = 0.1,
                 end_step: int | None = None, say: Callable[[str], None] = print) -> None:
        self.job, self._secret = job, secret
        self.world = int(world_size)
        self.heartbeat_s, self.poll_s, self.grace_s = float(heartbeat_s), poll_s, grace_s
        self.end_step = end_step
        self.say = say
        self.places = [Place(p) for p in range(self.world)]
        self.generation = 0  # the generation the survivors train in
        self.formed = False  # every place was taken once: later tasks are replacements
        self.fallback = False
        self._losses: list[int] = []
        self._loss_t: float | None = None
        self._pending: list[_Pending] = []
        self._spares: list[tuple[Line, str]] = []  # (line, host) of tasks waiting for a place
        self._beats_t = 0.0
        self.stopping = False  # set from another thread: `serve` returns 1 at its next poll
        self.listener = socket.create_server((host, 0), backlog=1024)
        self.listener.setblocking(False)
        self.link_port = self.listener.getsockname()[1]
        job.put(LINK_KEY, str(self.link_port))

    # ---- the loop ---------------------------------------------------------------------------------
    def serve(self) -> int:
        while not self.stopping:
            lines = ([p.line for p in self.places if p.line is not None] + [q.line for q in self._pending]
                     + [line for line, _ in self._spares])
            ready, _, _ = select.select([self.listener, *lines], [], [], self.poll_s)
            for obj in ready:
                if obj is self.listener:
                    self._accept()
                else:
                    self._read(obj)
            now = time.monotonic()
            for q in [q for q in self._pending if now - q.t >= 30]:  # connected, never said hello
                self._pending.remove(q)
                q.line.close()
            if now - self._beats_t >= min(0.25, self.heartbeat_s / 4):
                self._beats_t = now
                self._watch_beats(now)
            if self._losses and self._loss_t is not None and now - self._loss_t >= self.grace_s:
                self._publish_losses()
            self._place_spares()
            self._maybe_rejoin()
            if self._finished():
                for line, _ in self._spares:
                    line.send({"end": "the job ended before a place came free"})
                    line.close()
                return self._exit_code()
        return 1

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

    # ---- connections ------------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        line = Line(sock)
        nonce = secrets.token_hex(16)
        if line.send({"nonce": nonce}):
            self._pending.append(_Pending(line, nonce))
        else:
            line.close()

    def _read(self, line: Line) -> None:
        msgs = line.receive()
        spare = next((s for s in self._spares if s[0] is line), None)
        if spare is not None:  # a waiting spare only ever says goodbye
            if msgs is None or any("bye" in m for m in msgs):
                self._spares.remove(spare)
                line.close()
            return
        pending = next((q for q in self._pending if q.line is line), None)
        if pending is not None:
            self._pending.remove(pending)
            if not msgs:  # gone (or nothing complete yet: a hello is one small line)
                if msgs is None:
                    line.close()
                else:
                    self._pending.append(pending)
                return
            self._hello(line, pending.nonce, msgs[0])
            return
        place = next(p for p in self.places if p.line is line)
        if msgs is None:
            self._closed(place)
            return
        for msg in msgs:
            if "bye" in msg and place.declared:
                continue  # declared lost (hung) and running again: the others went on without it
            if "bye" in msg:
                said = str(msg["bye"])
                place.state = said if said in ("done", "idle", "fallback", "lost") else "error"
                if place.state == "fallback":
                    self._fall_back(place.pid)
                if place.state == "idle":
                    self.say(f"coordinator: process {place.pid} left idle by the new layout")
            elif msg.get("ready") and place.state == "replacing":
                place.ready = True

    def _hello(self, line: Line, nonce: str, msg: dict) -> None:
        if not auth_ok(self._secret, nonce, msg.get("auth")):
            line.send({"refused": "the link connection did not prove the job's secret (NTP_JOB_SECRET "
                                  "differs from the coordinator's)"})
            line.close()
            return
        want, host = msg.get("want"), msg.get("host", "?")
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
                line.send({"place": want, "mode": "start", "world": self.world, "generation": 0})
                self.formed = all(p.state != "free" for p in self.places)
                if self.formed:
                    self.say(f"coordinator: all {self.world} places taken; training starts")
                return
            line.send({"refused": why})
            line.close()
            return
        if self.fallback:
            line.send({"refused": "the job is not training live any more (it falls back to the restart "
                                  "path)"})
            line.close()
            return
        line.send({"wait": "no place is free: every process of the job is running"})
        self._spares.append((line, host))
        self.say(f"coordinator: a replacement task on {host} waits for a free place")
        self._place_spares()

    def _place_spares(self) -> None:
        """Give each waiting replacement a place whose process is gone (its loss already published)."""
        if not self._spares or not self.formed or self.fallback:
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
                place.line.close()
            place.state, place.line, place.ready, place.declared = "replacing", line, False, False
            place.beat = None
            line.send({"place": place.pid, "mode": "rejoin", "world": self.world,
                       "generation": self.generation})
            self.say(f"coordinator: the replacement on {host} takes the place of process {place.pid}")

    def _closed(self, place: Place) -> None:
        place.line.close()
        place.line = None
        if place.state == "active":
            place.state = "lost"
            self._lose(place.pid, "its connection closed")
        elif place.state == "replacing":  # a replacement that died before joining: the place is gone again
            place.state, place.ready = "lost", False

    # ---- failures ---------------------------------------------------------------------------------
    def _lose(self, pid: int, why: str) -> None:
        self.say(f"coordinator: process {pid} lost ({why})")
        if not self.formed:
            return  # the job never started training: the others time out in their rendezvous
        if self._loss_t is None:
            self._loss_t = time.monotonic()
        self._losses.append(pid)

    def _publish_losses(self) -> None:
        lost, self._losses, self._loss_t = sorted(set(self._losses)), [], None
        if not any(p.state == "active" for p in self.places):
            return
        publish_failed(self.job, self.generation, lost)
        failed_gen = self.generation
        self.generation += 1
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

    # ---- heartbeats -------------------------------------------------------------------------------
    def _fresh_window(self) -> None:
        """The survivors recover (or grow) now: their progress was held up by the failure itself, so each
        gets a whole heartbeat timeout from here before it can be called hung."""
        now = time.monotonic()
        for p in self.places:
            if p.state == "active":
                p.moved_t = now

    def _watch_beats(self, now: float) -> None:
        active = [p for p in self.places if p.state == "active" and not p.declared]
        if not active:
            return
        for p in active:
            raw = self.job.read(beat_key(p.pid))
            if raw is None:
                continue
            doc = json.loads(raw)
            beat = (int(doc["step"]), str(doc["phase"]))
            if beat != p.beat:
                p.beat, p.moved_t = beat, now
            if int(doc.get("tick", 0)) != p.tick:
                p.tick, p.alive_t = int(doc.get("tick", 0)), now
        beats = {i: Beat(i, p.beat[0], p.beat[1], p.moved_t, p.pid)
                 for i, p in enumerate(active) if p.beat is not None and p.beat[1] in PHASES}
        if len(beats) < len(active):
            return
        if not any(b.training and now - b.t > self.heartbeat_s for b in beats.values()):
            return
        # A process whose ticks stopped too (stopped, frozen) is the hung one; when every process still
        # runs (a rank stuck in a kernel or a collective), the one behind the others is.  Ranks blocked in
        # a collective with a hung peer report the same progress as it or more.
        frozen = [p for p in active if now - p.alive_t > 0.75 * self.heartbeat_s]
        for p in frozen or [active[i] for i in suspects(beats, len(active))]:
            p.declared, p.state = True, "lost"
            p.line.send({"declared": "lost"})  # read when (if) it runs again: it stops then
            self._lose(p.pid, f"hung: no heartbeat progress for {self.heartbeat_s:g} s"
                       + (", and its process has stopped running" if frozen else ""))

    # ---- rejoin -----------------------------------------------------------------------------------
    def _max_step(self) -> int:
        self._watch_beats(time.monotonic())  # fresh: the announced step must lie ahead of every survivor
        return max((p.beat[0] for p in self.places if p.state == "active" and p.beat), default=0)

    def _maybe_rejoin(self) -> None:
        replacing = [p for p in self.places if p.state == "replacing"]
        if not replacing or not all(p.ready for p in replacing) or self._losses:
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
        self._fresh_window()
        for p in replacing:
            p.line.send({"rejoin": self.generation, "source": source, "step": join_at})
            p.state, p.ready, p.moved_t, p.beat = "active", False, time.monotonic(), None
        self.say(f"coordinator: process(es) {[p.pid for p in replacing]} rejoin before step {join_at} "
                 f"(generation {self.generation})")
