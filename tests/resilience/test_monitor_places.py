"""The live monitor over a long job: a place is watched afresh once its process is repaired, no rejoin is
announced over an exit not yet handled, and a survivor lost before an announced rejoin is decided is
published for the generation the survivors are in.

Each of these broke a soak (`bench/soak.py`) after a hundred failures or more: `--failures 300 --seed 1`
after 132 (a hang struck process 2, SIGSTOPped and killed as hung 80 failures before) and `--failures 150
--seed 2` after 142 (process 3 hung a second time): the monitor never blamed the repaired process, the
survivors waited out the collective timeout, found no notice of a loss and fell back."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from types import SimpleNamespace

from ntp_nemo.resilience.beats import read_beats
from ntp_nemo.resilience.live_launcher import LiveMonitor
from tests.resilience.test_hang_window import _rank, silent_ranks
from tests.waits import wait_until


def _stop_all(procs) -> None:
    for p in procs:
        p.kill()
        p.join(5)


def test_a_place_killed_as_hung_is_watched_again_once_repaired(tmp_path):
    """Process 1 is behind and silent past the heartbeat timeout: killed.  A repaired process takes its
    place (a new pid, the same heartbeat file), beats once and hangs behind process 0 in turn: it is
    killed too (before, a place killed once was never blamed again)."""
    procs = silent_ranks(tmp_path, [("step_start", 5), ("step_end", 4)])
    try:
        launcher = SimpleNamespace(procs=procs, store=object(), lost=set(), stop_requested=None)
        monitor = LiveMonitor(launcher, 2, tmp_path, 0.5)
        time.sleep(0.7)
        monitor._kill_hung(procs)
        procs[1].join(5)
        assert procs[1].exitcode == -9 and procs[0].exitcode is None
        repaired = mp.get_context("fork").Process(target=_rank, args=(tmp_path, 1, "step_end", 4))
        repaired.start()
        procs[1] = repaired
        wait_until(lambda: read_beats(tmp_path, 2).get(1, SimpleNamespace(pid=None)).pid == repaired.pid, 20,
                   "the repaired process's first beat", poll_s=0.05)
        monitor._kill_hung(procs)
        time.sleep(0.2)
        assert repaired.exitcode is None  # its first beat is fresh: not hung yet
        time.sleep(0.7)
        monitor._kill_hung(procs)
        repaired.join(5)
        assert repaired.exitcode == -9 and procs[0].exitcode is None
    finally:
        _stop_all(procs)


def test_a_lost_process_s_stale_beat_does_not_hide_a_hang_elsewhere(tmp_path):
    """Process 1 is lost (its last beat stays, from step 4); process 2 hangs behind process 0.  Only the
    running processes' beats are compared: process 2 is the one killed (before, the monitor read the
    first `world - lost` files, so with process 1 lost it watched 0, 1 and 2 and blamed the dead 1)."""
    procs = silent_ranks(tmp_path, [("step_start", 7), ("step_end", 4), ("step_end", 6)])
    try:
        procs[1].kill()
        procs[1].join(5)
        launcher = SimpleNamespace(procs=procs, store=object(), lost={1}, stop_requested=None)
        monitor = LiveMonitor(launcher, 3, tmp_path, 0.5)
        time.sleep(0.7)
        monitor._kill_hung(procs)
        procs[2].join(5)
        assert procs[2].exitcode == -9 and procs[0].exitcode is None
    finally:
        _stop_all(procs)


class _Store:
    """What `_maybe_rejoin` writes to the job's store, recorded."""

    def __init__(self) -> None:
        self.put_keys: list[str] = []
        self.store = SimpleNamespace()  # no `list_keys`: pruning keeps every key

    def put(self, key: str, payload: str) -> None:
        self.put_keys.append(key)


def test_no_rejoin_is_announced_over_an_exit_not_yet_handled(tmp_path):
    """Process 1 exited between the poll that looked for exits and the rejoin's turn: it is neither
    respawned nor announced until the next poll has published its loss (before, it was respawned in
    place, the survivors were never told of the loss, and they fell back after the collective timeout)."""
    procs = silent_ranks(tmp_path, [("step_start", 5), ("step_start", 5)])
    try:
        procs[1].kill()
        procs[1].join(5)
        respawned: list[int] = []
        store = _Store()
        launcher = SimpleNamespace(procs=procs, store=store, lost=set(), stop_requested=None,
                                   respawn=lambda i, *a, **k: respawned.append(i))
        monitor = LiveMonitor(launcher, 2, tmp_path, 30.0, repair_after_steps=1,
                              layout=SimpleNamespace(world_size=2))
        monitor._degraded_at = 1
        monitor._maybe_rejoin(procs, seen=set())
        assert respawned == [] and store.put_keys == [] and monitor.generation == 0
        monitor._maybe_rejoin(procs, seen={1})  # the loss handled: now the repair starts
        assert respawned == [1] and store.put_keys == ["rejoin/gen0"] and monitor.generation == 1
    finally:
        _stop_all(procs)


def test_a_survivor_lost_before_the_rejoin_is_decided_is_published_for_the_survivors_generation(tmp_path):
    """Generation 0 runs on processes 0 and 1; process 2, repaired, is announced to join generation 1 and
    has begun its rendezvous there, undecided.  Process 1 dies: the rejoin is withdrawn (process 2
    stopped, the decision `cancel`, generation 1's keys deleted) and the loss is published for
    generation 0, where the survivors wait for it (before: for generation 1, which nobody waits on)."""
    from ntp_nemo.resilience.rendezvous import failed_key, free_port, host_store, local_secret, read_rejoin
    from ntp_nemo.resilience.store_auth import JobStore

    store = JobStore(host_store(free_port()), local_secret())
    procs = [mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True) for _ in range(3)]
    for p in procs:
        p.start()
    store.put("gen1/rank_2", "the repaired process's rendezvous")
    announced = {"step": 9, "members": [0, 1, 2], "source": 0, "attempt": 1}
    store.put("rejoin/gen0", json.dumps(announced))
    launcher = SimpleNamespace(procs=procs, store=store, lost=set(), stop_requested=None)  # 2 respawned
    monitor = LiveMonitor(launcher, 3, None, None)
    monitor._rejoin = {"generation": 0, "attempt": 1, "pids": [2], "announced": announced, "t": time.time()}
    monitor.generation = 1
    monitor.start()
    try:
        procs[1].kill()
        wait_until(lambda: store.read(failed_key(0)) is not None, 20, "the loss published for generation 0",
                   poll_s=0.05, alive=lambda: store.read(failed_key(1)) is None,
                   detail=lambda: "published for generation 1")
        assert json.loads(store.read(failed_key(0))) == [1]
        assert read_rejoin(store, 0)["decision"] == "cancel"
        assert store.read("gen1/rank_2") is None
        procs[2].join(5)
        assert procs[2].exitcode == -9 and procs[0].exitcode is None
        assert launcher.lost == {1, 2} and monitor.generation == 1 and monitor._rejoin is None
    finally:
        monitor.stop()
        _stop_all(procs)
