"""A cluster job on the page: a real `Coordinator` serving in a thread, two tasks speaking the link
protocol, its state file (`failover/coordinator.json` in the run directory) and the dashboard's state of
that directory (what the server sends the page), then one task's link closes and the page shows it lost;
and the same with `ntp-coordinator` itself started as a cluster rehearsal starts it (its own process,
`hydra.run.dir=` naming the run directory: the file lands where the page looks)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ntp_nemo.dashboard.page_state import classify
from ntp_nemo.dashboard.server import Dashboard
from ntp_nemo.resilience.coordinator import STATE_FILE, Coordinator
from ntp_nemo.resilience.rehearsal import free_port, start_coordinator
from ntp_nemo.resilience.store_auth import JobStore
from tests.conftest import TINY
from tests.resilience.test_coordinator import SECRET, Raw
from tests.waits import wait_until


def Task(job: JobStore, want: int, host: str, secret: bytes = SECRET) -> Raw:
    """One task's link by hand (the hello for place `want` from `host`, then beats as its sender does)."""
    return Raw(job, want, secret=secret, host=host)


def _until(cond, what: str, timeout_s: float = 5.0):
    return wait_until(cond, timeout_s, what, poll_s=0.05)


def _page(dash: Dashboard, run) -> dict:
    """The state the server sends the page for `run` (its own computation, uncached)."""
    return json.loads(dash._compute(run, classify(run)))


def test_the_page_shows_the_coordinators_places_and_a_lost_one(tmp_path):
    run = tmp_path / "run"
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    job = JobStore(store, SECRET)
    said: list[str] = []
    coordinator = Coordinator(job, SECRET, 2, heartbeat_s=30.0, host="127.0.0.1", poll_s=0.01, grace_s=0.05,
                              end_step=100, say=said.append, state_path=run / STATE_FILE)
    thread = threading.Thread(target=coordinator.serve, daemon=True)
    thread.start()
    dash = Dashboard(run, "token")
    try:
        a, b = Task(job, 0, "node-a"), Task(job, 1, "node-b")
        assert (a.reply["place"], b.reply["place"]) == (0, 1)
        a.beat(3), b.beat(3)
        _until(lambda: coordinator.started, "both tasks train")

        def places(state: str | None = None):
            doc = _page(dash, run) if (run / STATE_FILE).is_file() else None
            c = doc and doc["layout"]["cluster"]
            if not c or (state is not None and [p["state"] for p in c["places"]] != ["active", state]):
                return None
            return c

        cluster = _until(lambda: (c := places("active")) and all(p["step"] == 3 for p in c["places"]) and c,
                         "the state file shows both places at step 3")
        assert [(p["place"], p["host"], p["phase"]) for p in cluster["places"]] == [
            (0, "node-a", "step_start"), (1, "node-b", "step_start")]
        assert all(p["age_s"] is not None and 0 <= p["age_s"] < 30 for p in cluster["places"])
        assert cluster["formed"] and cluster["started"] and not cluster["ended"]
        assert cluster["generation"] == 0 and cluster["spares"] == []
        # The file updates: a later beat of place 0 shows, and the file's write time moves on.
        first_t = json.loads((run / STATE_FILE).read_text())["t"]
        a.beat(4, "step_end")
        _until(lambda: (c := places("active")) and c["places"][0]["step"] == 4, "place 0's next beat")
        assert json.loads((run / STATE_FILE).read_text())["t"] > first_t
        assert not list((run / STATE_FILE).parent.glob("*.tmp"))  # written whole, then renamed

        b.line.close()  # its process died: the link closes without a goodbye
        cluster = _until(lambda: places("lost"), "place 1 shown lost")
        assert cluster["places"][1]["host"] == "node-b" and cluster["places"][0]["state"] == "active"
        assert cluster["generation"] == 1  # the loss was published: the survivor trains in generation 1
        assert any("process 1 lost" in s for s in said)
    finally:
        coordinator.stopping = True
        thread.join(timeout=5)
    assert not thread.is_alive()
    final = json.loads((run / STATE_FILE).read_text())
    assert final["ended"] is True  # the last write, as it stopped
    assert _page(dash, run)["layout"]["cluster"]["ended"] is True


def test_a_state_file_that_cannot_be_written_never_stops_the_coordinator(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the run directory should be")
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    job = JobStore(store, SECRET)
    said: list[str] = []
    coordinator = Coordinator(job, SECRET, 2, heartbeat_s=30.0, host="127.0.0.1", poll_s=0.01, grace_s=0.05,
                              end_step=100, say=said.append, state_path=blocker / STATE_FILE)
    thread = threading.Thread(target=coordinator.serve, daemon=True)
    thread.start()
    try:
        a, b = Task(job, 0, "node-a"), Task(job, 1, "node-b")
        assert (a.reply["place"], b.reply["place"]) == (0, 1)
        _until(lambda: any("cannot write its state file" in s for s in said), "the failure said")
        a.beat(1), b.beat(1)
        _until(lambda: coordinator.started, "the coordinator still serves its tasks")
        assert thread.is_alive()
        assert sum("cannot write its state file" in s for s in said) == 1  # said once
    finally:
        coordinator.stopping = True
        thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.slow
def test_the_page_on_a_cluster_rehearsal_of_ntp_coordinator(tmp_path):
    run = tmp_path / "run"
    over = [*TINY, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null", "trainer.max_steps=50",
            "fault.heartbeat_timeout_s=30", f"hydra.run.dir={run}"]
    port, secret = free_port(), "rehearsal-secret-0123456789"
    coordinator = start_coordinator(over, port, secret, tmp_path)
    dash = Dashboard(run, "token")
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        job = JobStore(client, secret.encode())
        a, b = (Task(job, i, f"node-{i}", secret.encode()) for i in range(2))
        a.beat(1), b.beat(1)

        def states():
            c = (run / STATE_FILE).is_file() and _page(dash, run)["layout"]["cluster"]
            return c and [(p["state"], p["host"], p["step"]) for p in c["places"]]

        _until(lambda: states() == [("active", "node-0", 1), ("active", "node-1", 1)],
               "the page shows the coordinator's two places", timeout_s=30)
        b.line.close()
        coordinator.wait_for("process 1 lost", 30)
        _until(lambda: states() == [("active", "node-0", 1), ("lost", "node-1", 1)], "place 1 shown lost",
               timeout_s=30)
        a.line.close()
        assert coordinator.wait(30) == 1  # every task gone, none finished training
    finally:
        coordinator.kill()
    cluster = _page(dash, run)["layout"]["cluster"]
    assert cluster["ended"] and [p["state"] for p in cluster["places"]] == ["lost", "lost"]
