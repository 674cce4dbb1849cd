"""Live recovery in the launching process of `ntp-train` (`fault.recovery=live`).

- `LiveLauncher` forks the workers like NTPStrategy's launcher, but makes them rendezvous on a store the
  launching process hosts (`TORCHELASTIC_USE_AGENT_STORE`: every rank is a client of `MASTER_PORT`), so
  the store outlives any worker, and waits for them without stopping the others when one exits; it
  also starts repaired processes in place of lost ones (`respawn`).  The strategy gets it from the
  workers' `LiveRecovery` (`RecoveryHooks.make_launcher`);
- `LiveMonitor` (in place of the restart path's `WorkerMonitor`) publishes a lost worker on the store
  (`failed/gen{g}`, the survivors' cue) instead of killing the attempt, and with
  `fault.repair_after_steps` starts the repaired processes and announces their rejoin; when the
  survivors give up (they exit with `FALLBACK_EXIT`) it stops every worker and the supervisor takes the
  restart path.

A hung rank (heartbeat older than `fault.heartbeat_timeout_s`, behind the others) is killed by the monitor
and then handled as a lost one.  The workers' side is `live_worker.py`.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from ntp_nemo.launch.loopback import environment, loopback_children_env
from ntp_nemo.lightning.adapter import ForkLauncher
from ntp_nemo.resilience.beats import read_beats
from ntp_nemo.resilience.coordinator import FALLBACK_EXIT
from ntp_nemo.resilience.detection import (
    STOPPED_STATES,
    Verdict,
    blame,
    is_lost_status,
    kill_worker,
    process_state,
    start_verdict,
    step_verdict,
    stop_overdue,
)
from ntp_nemo.resilience.fault_config import Timeouts
from ntp_nemo.resilience.live_worker import Rejoining, prepare_rejoin
from ntp_nemo.resilience.rendezvous import (
    SEAL_KEY,
    connect,
    decide_rejoin,
    drop_generation,
    host_store,
    is_ready,
    local_secret,
    prune_generations,
    publish_failed,
    publish_rejoin,
    reserve_port,
    resident_mb,
    seal_intact,
    seal_store,
)
from ntp_nemo.resilience.spares import SparePool, spare_body, warm_up
from ntp_nemo.resilience.store_auth import JobStore
from ntp_nemo.topology.layout import ResolvedLayout


class LiveLauncher(ForkLauncher):
    """Fork launcher whose workers rendezvous on a store hosted here and may lose a peer."""

    def __init__(self, strategy: Any, spares: int = 0, spare_timeout_s: float = 600.0,
                 record: Callable[..., None] | None = None) -> None:
        """`spares`: hot spares kept waiting (`fault.spares`), each ready within `spare_timeout_s`
        (`fault.startup_timeout_s`); `record(**fields)`: a goodput `spare` event (None: none)."""
        super().__init__(strategy, start_method="fork")
        self.spares, self.spare_timeout_s, self.record_spare = int(spares), float(spare_timeout_s), record
        self.spare_pool: SparePool | None = None  # while the workers run, with `spares` > 0
        self.store: JobStore | None = None
        self.seal: str | None = None  # `rendezvous.seal_store`'s value on the store hosted here
        self.secret: bytes | None = None  # the job's store secret, drawn before the fork (workers inherit it)
        self.lost: set[int] = set()  # process indices the monitor handed to the survivors
        self.port: int | None = None  # the store's, while the workers run (repaired processes connect)

    def respawn(self, idx: int, generation: int, layout: ResolvedLayout, source: int, *,
                timeout_s: float, attempt: int | None = None) -> None:
        """Start a repaired process in place of process `idx`: it joins `generation` (a rejoin), waiting
        up to `timeout_s` for the survivors (`Timeouts.rejoin_s`); `attempt`: the rejoin's number, under
        which it says it is ready (`rendezvous.publish_ready`)."""
        assert self.port is not None
        message = (idx, generation, layout, source, timeout_s, attempt)
        spare = self.spare_pool.take() if self.spare_pool is not None else None
        if spare is not None and self.spare_pool.assign(spare, message, idx):  # a hot spare takes the place
            self.procs[idx] = spare.proc
        else:
            self.procs[idx] = self.start_replacement(idx, self._repaired(message)[1], Rejoining.CKPT_PATH,
                                                     name=f"ntp-rejoin-{idx}")
        self.lost.discard(idx)

    def _repaired(self, message: tuple) -> tuple[int, Callable[[Any], None]]:
        """What `respawn`'s `message` makes of a process: its index and its first code (`prepare`)."""
        idx, generation, layout, source, timeout_s, attempt = message
        port, secret = self.port, self.secret
        joining = Rejoining(lambda: JobStore(connect(port, timeout_s), secret), layout, idx,
                            index=generation, source=source, timeout_s=timeout_s, attempt=attempt)
        return idx, lambda trainer: _prepare_repaired(trainer, idx, joining)

    def _start_spare(self, number: int, conn: Any, parent_conn: Any) -> Any:
        """Fork hot spare `number` (`spares.SparePool`): it warms up, then waits for a `respawn` message."""
        launcher_pid = os.getpid()

        def body(trainer: Any, replace: Callable) -> None:
            def work(message: tuple) -> None:
                idx, prepare = self._repaired(message)
                replace(idx, prepare, Rejoining.CKPT_PATH)

            spare_body(conn, parent_conn, lambda: warm_up(trainer), work, launcher_pid)

        return self.start_process(body, name=f"ntp-spare-{number}")

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # SIGTERM/Ctrl-C: the workers checkpoint and stop, as without live; they listen on loopback only
        with self.forwarding_signals(), loopback_children_env():
            return self._launch(function, *args, trainer=trainer, **kwargs)

    def close(self) -> None:
        """Stop hosting the job's store, here in the launching process (the attempt is over).  A store
        whose server thread runs here must never be destroyed in a forked child, where that thread does
        not exist and the destructor's join never returns."""
        self._release_spares()
        self.store, self.port = None, None
        self.forget_workers()

    def _release_spares(self) -> None:
        pool, self.spare_pool = self.spare_pool, None
        if pool is not None:
            pool.close()

    def _launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        (listener, port), self.secret = reserve_port(), local_secret()  # the port is the job's from here
        # An earlier attempt's store may still sit in unreachable objects (a trainer's reference cycles):
        # collect it here, where its server thread lives, not in a worker's garbage collection after the
        # fork (its destructor would wait forever there for a thread the fork did not copy).
        gc.collect()
        # every rank a client of the store below
        with environment({"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}):
            process_context = self.start_workers(function, args, kwargs, trainer)
            self.port = port
            if self.spares > 0 and self.num_processes > 1:  # forked before the store's server thread exists,
                # as the workers are (one process has no survivor to take a spare in)
                self.spare_pool = SparePool(self.spares, self._start_spare,
                                            ready_timeout_s=self.spare_timeout_s,
                                            say=lambda line: print(line, flush=True),
                                            record=self.record_spare)
                self.spare_pool.start()
            # after the fork: no server thread is copied into a worker
            store = JobStore(host_store(listener=listener), self.secret)
            self.seal = seal_store(store)  # the monitor checks that the job's keys stay its own
            self.store = store
            # Until every process has exited, including repaired ones started meanwhile in place of a
            # lost one.  (The monitor thread polls the same children: a join that loses the race to reap
            # one returns before its exit status is recorded, so the status is what is waited for.)
            try:
                while any(p.exitcode is None for p in list(self.procs)):
                    for p in list(self.procs):
                        p.join(0.05)
            finally:  # every path (the end, a fallback to restart, Ctrl-C): no spare outlives the attempt
                self._release_spares()
        bad = [(i, p) for i, p in enumerate(self.procs) if p.exitcode != 0 and i not in self.lost]
        raised = [(i, p) for i, p in bad if p.exitcode == 1]
        if raised:  # a Python exception in a worker: its traceback, as torch's own join reports it (the
            # supervisor prints it, or stops quietly when the workers found no usable checkpoint)
            i, p = raised[0]
            trace = _traceback(process_context.error_files[i])
            raise mp.ProcessRaisedException(f"\n\n-- Process {i} terminated with this error:\n{trace}",
                                            error_index=i, error_pid=p.pid)
        if bad:
            codes = ", ".join(f"{i}: {p.exitcode}" for i, p in enumerate(self.procs))
            if not self.abandoned:  # a second Ctrl-C's kills are said by its own line
                print(f"failover | live: workers ended with exit status {codes}", file=sys.stderr, flush=True)
            i, p = bad[0]
            raise mp.ProcessExitedException(f"process {i} terminated with exit code {p.exitcode}",
                                            error_index=i, error_pid=p.pid, exit_code=p.exitcode)
        return self.worker_results(trainer)


STORE_GROWTH_MB = 512.0  # growth of the store-hosting process that counts as a flood of its store


class LiveMonitor(threading.Thread):
    """Watches the workers of a live attempt: a lost one is published on the store for the survivors;
    survivors falling back, a lost process 0 or a Python error in a worker stop the attempt."""

    def __init__(self, launcher: LiveLauncher, world_size: int, heartbeat_dir: Path | None = None,
                 heartbeat_s: float | None = None, poll_s: float = 0.05, grace_s: float = 0.1,
                 repair_after_steps: int | None = None, layout: ResolvedLayout | None = None,
                 end_step: int | None = None, timeouts: Timeouts | None = None,
                 store_growth_mb: float = STORE_GROWTH_MB,
                 state: Callable[[int], str | None] = process_state) -> None:
        """`timeouts`: the bounds this monitor enforces besides the heartbeats (a rendezvous, the start-up,
        a step, a stop; `detection`), None for none; `store_growth_mb`: how much this process (which hosts
        the job's store when it sealed it) may grow before the store counts as flooded; `state`: the
        process-state reader a hang's blame consults (`detection.blame`)."""
        super().__init__(name="ntp-live-monitor", daemon=True)
        self.launcher = launcher
        self.world_size = world_size
        self.heartbeat_dir, self.heartbeat_s = heartbeat_dir, heartbeat_s
        self._hung: dict[int, int] = {}  # process index -> the pid killed as hung there (a repaired
        # process in the same place is watched afresh: before, a place killed once was never blamed again)
        self.state = state
        self.poll_s, self.grace_s = poll_s, grace_s
        self.verdict: Verdict | None = None
        self.killed: set[int] = set()
        self.generation = 0
        self._halt = threading.Event()
        self.repair_after_steps, self.layout, self.end_step = repair_after_steps, layout, end_step
        self._degraded_at: int | None = None  # the step the survivors had reached at the last failure
        self.timeouts = timeouts
        self._rejoin: dict | None = None  # the announced rejoin awaiting the launcher's decision
        self._sealed_t = 0.0  # when the store's seal was last checked
        self.store_growth_mb = float(store_growth_mb)
        self._rss0: float | None = None  # the least resident memory of this process since the monitor started
        self._attempts = 0  # rejoins announced so far (each one's number keys its ready marks)
        # When the last change of generation began (a loss published, a rejoin announced): a beat written
        # before it is aged from it, so that no survivor is judged hung by a beat of the step the failure
        # interrupted while it recovers (a recovery's own waits are bounded by the collective timeout).
        self._window_t = 0.0
        self._launched = time.time()
        self._all_trained = False  # every process has reached training once (the start-up bound is over)

    def stop(self) -> None:
        """Stop watching; survivors that fell back are never blamed, even if they exited after the last
        poll (the launcher returns as soon as every worker has exited)."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        procs = getattr(self.launcher, "procs", None) or []
        fallback = {i for i, p in enumerate(procs) if p.exitcode == FALLBACK_EXIT}
        self.killed |= fallback
        if fallback and self.verdict is None:
            print("failover | live: the survivors could not recover live; falling back to the restart path",
                  flush=True)
            self.verdict = Verdict("worker exit", tuple(sorted(self.launcher.lost)), None, time.time(),
                                   "the survivors could not recover live")

    def _stop_all(self, procs, reason: str, ranks: tuple[int, ...]) -> None:
        self.verdict = Verdict("worker exit", ranks, None, time.time(), reason)
        for i, p in enumerate(procs):
            if p.pid is not None and p.is_alive():
                kill_worker(p.pid)
                self.killed.add(i)

    def run(self) -> None:
        while not self._halt.is_set():
            procs = getattr(self.launcher, "procs", None) or []
            if len(procs) == self.world_size and self.launcher.store is not None:
                break
            time.sleep(self.poll_s)
        self._launched = time.time()
        self._rss0 = resident_mb()
        seen: set[int] = set()
        while not self._halt.wait(self.poll_s):
            if getattr(self.launcher, "abandoned", False):  # a second Ctrl-C killed them: nothing to recover
                return
            exited = [i for i, p in enumerate(procs) if i not in seen and p.exitcode is not None]
            if not exited:
                verdict = self._overdue()
                if verdict is not None:
                    print(f"failover | live: {verdict.reason}: {verdict.detail}; stopping the workers",
                          flush=True)
                    self._stop_all(procs, verdict.detail, verdict.ranks)
                    self.verdict = verdict
                    return
                self._kill_hung(procs)
                self._watch_rejoin(procs, seen)
                self._maybe_rejoin(procs, seen)
                continue
            time.sleep(self.grace_s)  # a failure taking several ranks: collect them all
            exited = [i for i, p in enumerate(procs) if i not in seen and p.exitcode is not None]
            r = self._rejoin
            joining = [i for i in exited if r is not None and not r.get("decided") and i in r["pids"]]
            if joining:  # a repaired process failed before it joined: the rejoin is cancelled, not the job
                code = ", ".join(str(procs[i].exitcode) for i in joining)
                self._cancel_rejoin(procs, seen, f"process(es) {joining} exited with status {code}")
                continue
            seen.update(exited)
            lost = [i for i in exited
                    if is_lost_status(procs[i].exitcode) and procs[i].exitcode != FALLBACK_EXIT]
            fallback = [i for i in exited if procs[i].exitcode == FALLBACK_EXIT]
            errors = [i for i in exited if procs[i].exitcode == 1]
            if lost and not fallback and not errors:
                if r is not None and r.get("decided"):  # the rejoin into this generation failed
                    lost = self._abandon_rejoin(procs, seen, lost)
                elif r is not None:  # a survivor lost while the announced rejoin awaits its decision
                    self._withdraw_rejoin(procs, seen, lost)
                self.launcher.lost.update(lost)
                publish_failed(self.launcher.store, self.generation, lost)
                self.fresh_window()
                self.generation += 1
                prune_generations(self.launcher.store, self.generation)
                self._degraded_at = self._max_step()
                print(f"failover | live: process(es) {lost} lost (exit status "
                      f"{', '.join(str(procs[i].exitcode) for i in lost)}); the survivors reshard in place",
                      flush=True)
                continue
            if fallback:
                self.killed.update(fallback)
                why = "the survivors could not recover live"
                print(f"failover | live: {why}; falling back to the restart path", flush=True)
                self._stop_all(procs, why, tuple(sorted(self.launcher.lost | set(lost))))
                return
            if errors:  # a Python exception: a bug or bad input, reported by the supervisor
                self._stop_all(procs, "a worker raised", ())
                self.verdict = None
                return


    def _overdue(self) -> Verdict | None:
        """A bound of `detection` passed: the stop after a stop signal, the rendezvous or the start-up
        (until every process has trained once), a step."""
        seal = getattr(self.launcher, "seal", None)
        now = time.time()
        # After a stop signal the workers are checkpointing and stopping, bounded by the stop grace: the
        # store is not checked then, since stopping them for a wiped or flooded store would kill a save
        # that needs no store key (and an exit that follows it) and end with exit 1 instead of a stop.
        stopping = getattr(self.launcher, "stop_requested", None) is not None
        if seal is not None and not stopping and now - self._sealed_t >= 1.0:
            self._sealed_t = now
            if not self._seal_holds(seal):
                return Verdict("store wiped", (), None, now,  # supervisor.STORE_WIPED
                               f"the job's coordination keys vanished or changed under it (its seal "
                               f"{SEAL_KEY!r} on the job's store, hosted by this process, is gone or "
                               "different): something else deleted or overwrote them")
            rss = resident_mb()
            self._rss0 = rss if self._rss0 is None else min(self._rss0, rss)  # freed memory hides no flood
            grown = rss - self._rss0
            if grown > self.store_growth_mb:
                return Verdict("store flooded", (), None, now,  # supervisor.STORE_FLOODED
                               f"the process hosting the job's store grew by {grown:.0f} MiB over the least "
                               f"it held since the launch (bound {self.store_growth_mb:.0f} MiB; the job's "
                               "own keys take a few KiB): something else is writing to the store")
        if self.timeouts is None or self.heartbeat_dir is None:
            return None
        beats = read_beats(self.heartbeat_dir, self.world_size)
        verdict = stop_overdue(getattr(self.launcher, "stop_requested", None), now, self.timeouts)
        if verdict is None and not self._all_trained:
            verdict = start_verdict(beats, range(self.world_size), self._launched, now, self.timeouts)
            self._all_trained = verdict is None and all(r in beats and beats[r].phase != "setup"
                                                    for r in range(self.world_size))
        return verdict or step_verdict(beats, self.world_size, self._launched, now, self.timeouts, self.state)

    def _watch_rejoin(self, procs, seen: set[int]) -> None:
        """The announced rejoin: join once every repaired process is ready; cancel it when they are not
        within `fault.startup_timeout_s` of their start."""
        r = self._rejoin
        if r is None:
            return
        if r.get("decided"):  # told to join: watched until the repaired processes train
            beats = read_beats(self.heartbeat_dir, self.world_size) if self.heartbeat_dir is not None else {}
            if all(i in beats and beats[i].pid == procs[i].pid and beats[i].phase != "setup"
                   for i in r["pids"]):
                self._rejoin = None
            elif all(p.exitcode is not None for i, p in enumerate(procs) if i not in r["pids"]):
                # the survivors stopped (a stop signal) before taking them in: nobody is left to join
                self._cancel_rejoin(procs, seen, "the survivors stopped before it joined", retry=False)
            return
        if getattr(self.launcher, "stop_requested", None) is not None:  # SIGTERM/Ctrl-C: the survivors
            # checkpoint and stop at the end of their step; a repaired process waiting to join stops now
            self._cancel_rejoin(procs, seen, "the run is stopping", retry=False)
            return
        store = self.launcher.store
        if all(is_ready(store, r["generation"], r["attempt"], i) for i in r["pids"]):
            decide_rejoin(store, r["generation"], r["announced"], join=True)
            r["decided"] = True
            print(f"failover | live: process(es) {r['pids']} ready to join {time.time() - r['t']:.2f} s "
                  "after the rejoin was announced", flush=True)
            return
        bound = self.timeouts.startup_s if self.timeouts is not None else None
        if bound is not None and time.time() - r["t"] > bound:
            self._cancel_rejoin(procs, seen, f"not ready to join {time.time() - r['t']:.0f} s after their "
                                f"start (fault.startup_timeout_s={bound:g})")

    def _cancel_rejoin(self, procs, seen: set[int], why: str, retry: bool = True) -> None:
        """A failed rejoin stops the repaired processes only (SIGKILL: no traceback, nothing of theirs to
        save): the survivors are told to go on in their generation, and with `retry` the repair is tried
        again `fault.repair_after_steps` steps later."""
        r, self._rejoin = self._rejoin, None
        assert r is not None
        seen.update(r["pids"])
        self.launcher.lost.update(r["pids"])  # before the kill: the launcher then never counts them as lost
        _stop(procs, r["pids"])
        if r.get("decided"):  # too late to cancel: the survivors are gone
            print(f"failover | live: {why}: stopping the repaired process(es) {r['pids']}", flush=True)
            return
        decide_rejoin(self.launcher.store, r["generation"], r["announced"], join=False)
        self.generation = r["generation"]  # the survivors stay in it
        self._degraded_at = self._max_step() if retry else None
        if not retry:
            print(f"failover | live: {why}: the rejoin of process(es) {r['pids']} is cancelled", flush=True)
            return
        print(f"failover | live: the rejoin of process(es) {r['pids']} failed ({why}); the survivors go on "
              "without them", flush=True)

    def _withdraw_rejoin(self, procs, seen: set[int], lost: list[int]) -> None:
        """A survivor died while the announced rejoin awaited its decision: the survivors are still in
        generation `g` (none has joined `g + 1`), so the loss is theirs to recover from in `g`.  The
        repaired processes are stopped, the rejoin cancelled (a survivor waiting at its step goes on in
        `g`, and fails there), the keys the repaired processes wrote for `g + 1` deleted (the survivors
        form `g + 1` next, with other ranks) and the monitor's generation set back to `g`; the repair is
        tried again later.  (Before, the loss was published for `g + 1`, which no survivor waits on: they
        waited out the collective timeout and fell back to the restart path.)"""
        r, self._rejoin = self._rejoin, None
        assert r is not None
        self.launcher.lost.update(r["pids"])  # before the kill: the launcher then never counts them as lost
        _stop(procs, r["pids"])
        seen.update(r["pids"])
        store = self.launcher.store
        decide_rejoin(store, r["generation"], r["announced"], join=False)
        drop_generation(store, r["generation"] + 1)
        self.generation = r["generation"]
        print(f"failover | live: the rejoin of process(es) {r['pids']} is withdrawn: process(es) {lost} died "
              "before it was decided; it is tried again later", flush=True)

    def _abandon_rejoin(self, procs, seen: set[int], lost: list[int]) -> list[int]:
        """A process died while the decided rejoin formed its generation (`g + 1`): the repaired
        processes still alive are stopped too, and all of them are listed lost with `lost`, so that the
        survivors re-form generation `g + 2` without them (`LiveRecovery._grow`) and the repair is tried
        again later.  Returns the processes to list as lost."""
        r, self._rejoin = self._rejoin, None
        _stop(procs, r["pids"])
        seen.update(r["pids"])
        print(f"failover | live: the rejoin of process(es) {r['pids']} failed after it was decided "
              f"(process(es) {lost} died): the survivors re-form without them", flush=True)
        return sorted(set(lost) | set(r["pids"]))

    def _seal_holds(self, seal: str) -> bool:
        try:
            return seal_intact(self.launcher.store, seal)
        except Exception:  # noqa: BLE001 - a store that does not answer is no wiped store
            return True

    def _max_step(self) -> int:
        beats = read_beats(self.heartbeat_dir, self.world_size) if self.heartbeat_dir is not None else {}
        return max((b.step for b in beats.values()), default=0)

    def _maybe_rejoin(self, procs, seen: set[int]) -> None:
        """`fault.repair_after_steps` steps after a live recovery, start a repaired process for every
        process that is gone (lost, or left idle by the new layout) and announce that they join before a
        step no survivor has started yet; the survivors return to the original layout there.  With a hot
        spare ready (`fault.spares`) there is nothing to repair: it takes the place one step after the
        loss, once the survivors train again."""
        delay = self._repair_delay()
        if delay is None or self._degraded_at is None or self.layout is None \
                or getattr(self.launcher, "stop_requested", None) is not None:
            return
        step = self._max_step()
        if step < self._degraded_at + delay:
            return
        gone = [i for i, p in enumerate(procs) if p.exitcode is not None]
        if any(i not in seen for i in gone):
            return  # an exit since this poll began, not yet published: the next poll handles it first
        if not gone or len(gone) == len(procs):
            self._degraded_at = None
            return
        join_at = step + 3  # beats are written at each step's start: no survivor is past `step + 1` yet
        if self.end_step is not None and join_at > self.end_step:
            self._degraded_at = None  # too close to the end: the run finishes on the degraded layout
            return
        source = min(i for i in range(len(procs)) if i not in gone)
        self._attempts += 1
        wait_s = self.timeouts.rejoin_s if self.timeouts is not None else 600.0
        announced = {"step": join_at, "members": list(range(self.layout.world_size)), "source": source,
                     "attempt": self._attempts}
        self.fresh_window()
        publish_rejoin(self.launcher.store, self.generation, join_at, range(self.layout.world_size), source,
                       attempt=self._attempts)
        started = time.time()
        for i in gone:
            self.launcher.respawn(i, self.generation + 1, self.layout, source, timeout_s=wait_s,
                                  attempt=self._attempts)
            seen.discard(i)
        self._rejoin = {"generation": self.generation, "attempt": self._attempts, "pids": list(gone),
                        "announced": announced, "t": started}
        self.generation += 1
        prune_generations(self.launcher.store, self.generation)
        self._degraded_at = None
        print(f"failover | live: repaired process(es) {gone} start and rejoin before step {join_at}",
              flush=True)

    def _repair_delay(self) -> int | None:
        """Steps from a loss to its replacement's start: one while a hot spare is ready (the pool's news,
        a spare ready or dead, is read here), else `fault.repair_after_steps` (None: no repair).  One, not
        none: a survivor's beat past the lost step says the survivors recovered and train again; a rejoin
        announced before that would take a spare into a generation the survivors may yet give up (a
        fallback to the restart path)."""
        pool = getattr(self.launcher, "spare_pool", None)
        if pool is not None and pool.ready():
            return 1
        return self.repair_after_steps

    def fresh_window(self) -> None:
        """A change of generation begins now: every rank gets a full heartbeat timeout from here."""
        self._window_t = time.time()

    def _kill_hung(self, procs) -> None:
        """A rank whose heartbeat is older than the heartbeat timeout while it trains, and whose process is
        stopped or (none being stopped) is behind the others (`detection.blame`), is hung: kill it, so
        that it is handled as a lost rank (its peers' collectives fail).  The ranks left get a fresh
        heartbeat window from the kill: their beats still carry the time of the step the hang held up.

        Each process writes the heartbeat file of its place (`rank_<index>`); only the beats of running
        processes count (a lost process's last beat is stale, not behind; a repaired one counts from its
        first beat), and every running process must have beaten."""
        if self.heartbeat_dir is None or self.heartbeat_s is None:
            return
        running = {i: p.pid for i, p in enumerate(procs) if p.exitcode is None and p.pid is not None}
        beats = {i: b for i, b in read_beats(self.heartbeat_dir, len(procs)).items()
                 if running.get(i) == b.pid}
        now = time.time()
        if not beats or len(beats) < len(running) or not any(
                b.training and now - max(b.t, self._window_t) > self.heartbeat_s for b in beats.values()):
            return
        ordered = dict(enumerate(beats.values()))  # `blame` numbers the ranks it compares 0..n-1
        pids = {ordered[r].pid for r in blame(ordered, len(ordered), self.state)}
        for i, p in enumerate(procs):
            if p.pid in pids and p.exitcode is None and self._hung.get(i) != p.pid:
                self._hung[i] = p.pid
                stopped = " and its process is stopped" if self.state(p.pid) in STOPPED_STATES else ""
                print(f"failover | live: process {i} hung (no heartbeat for {self.heartbeat_s:.0f} s"
                      f"{stopped}); killing it to recover without it", flush=True)
                kill_worker(p.pid)
                self.fresh_window()


def _stop(procs, indices) -> None:
    """SIGKILL the processes `indices` of `procs` still running (repaired processes of a failed rejoin:
    nothing of theirs to save), and reap them."""
    for i in indices:
        p = procs[i]
        if p.exitcode is None and p.pid is not None:
            kill_worker(p.pid)
            p.join(5)


def _prepare_repaired(trainer: Any, idx: int, joining: Rejoining) -> None:
    """First code of a repaired process (forked by the launching process in place of process `idx`)."""
    from ntp_nemo.resilience.faults import FaultInjector

    for cb in trainer.callbacks:  # a fault injected into the rejoin itself (kill_rank, phase rejoin/joining)
        if isinstance(cb, FaultInjector):
            cb.strike_rejoin(idx)
            joining.after_ready = joining.after_ready or cb.strike_joining(idx)
    prepare_rejoin(trainer, joining)


def _traceback(path: str | None) -> str:
    import pickle

    try:
        with open(path, "rb") as fh:  # written by torch.multiprocessing's worker wrapper
            return str(pickle.load(fh))
    except (OSError, TypeError, pickle.UnpicklingError, EOFError):
        return "(no traceback recorded)"
