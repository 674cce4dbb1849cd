"""Nothing outside a job reaches or writes its coordination state, and no file it reads runs code.

- A run launched on one machine (the default recipe, on the live path and on the restart path) listens
  on loopback only: every listening socket of the parent and of its workers, sampled while it runs.
- A store other nodes reach (a cluster coordinator's) needs the job's secret; a notice written by a
  process without it, raw or under a guessed prefix, or under the job's prefix (which any client can
  list) without the job's signature, is never what the job reads.
- Files a run writes follow the user's umask.
- A checkpoint whose metadata carries a pickled object is refused (exit 2 through `resume=`), and the
  object's code never runs.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from ntp_nemo.checkpoint.manifest import MANIFEST, file_digest
from ntp_nemo.checkpoint.sharded import META_FILE
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.loopback import host_loopback_store
from ntp_nemo.resilience.rendezvous import publish_failed, wait_failed
from ntp_nemo.resilience.store_auth import (
    SECRET_ENV,
    JobStore,
    connect_cluster_store,
    host_cluster_store,
    key_prefix,
)
from tests.conftest import SINGLE, TINY, run_cli

SECRET = "0123456789abcdef-the-jobs-own-secret"


def _listening(pids: list[int]) -> set[tuple[int, str, int]]:
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        out |= {(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["live", "restart"])
def test_default_run_listens_on_loopback_only(tmp_path, path):
    # The default recipe ((2,1): three workers), one step; fault.recovery=auto picks the live path (the
    # store in the parent), restart leaves the env:// rendezvous store to worker rank 0.
    args = ["trainer.max_steps=1", "checkpoint.every_n_steps=0", "checkpoint.save_on_end=false",
            "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"]
    if path == "restart":
        args.append("fault.recovery=restart")
    proc = subprocess.Popen([sys.executable, "-m", "ntp_nemo.train", *args], cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[int, str, int]] = set()
    workers: set[int] = set()
    try:
        while proc.poll() is None:
            try:
                children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                break
            workers |= set(children)
            seen |= _listening([proc.pid, *children])
            time.sleep(0.05)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    listeners = {pid for pid, _, _ in seen}
    assert len(listeners - {proc.pid}) == 3, (path, seen)  # every worker's gloo listeners were sampled
    parent = {port for pid, _, port in seen if pid == proc.pid}
    served = {port for pid, _, port in seen if pid != proc.pid}
    if path == "live":
        assert parent, seen  # the live path's store is the parent's
    else:
        # The store is worker rank 0's. Its port is held by the parent from before the fork until the
        # workers run (`ForkLauncher._held_rendezvous_port`): the parent may be seen on that socket, on
        # no other.
        assert parent <= served, seen
    exposed = sorted(s for s in seen if not _is_loopback(s[1]))
    assert not exposed, f"listening beyond loopback ({path} path): {exposed}"


def test_loopback_store_listens_on_127_0_0_1_only():
    store = host_loopback_store()
    mine = {(ip, port) for _, ip, port in _listening([os.getpid()]) if port == store.port}
    assert mine == {("127.0.0.1", store.port)}
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


# ---- a store other nodes reach: the job's secret ---------------------------------------------------------
def test_cluster_store_needs_the_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        host_cluster_store(0, required_by="the coordinator's store")
    msg = str(err.value)
    assert msg.startswith(f"{SECRET_ENV}: the coordinator's store can be reached from other machines")
    assert f"export {SECRET_ENV}=" in msg
    monkeypatch.setenv(SECRET_ENV, "short-value")
    with pytest.raises(ConfigError) as err:
        connect_cluster_store("127.0.0.1", 1, required_by="the coordinator's store")
    assert "11 characters long; use at least 16" in str(err.value)
    assert "short-value" not in str(err.value)  # the secret is never echoed


def test_notices_without_the_jobs_secret_are_ignored(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    job = host_cluster_store(0, required_by="the coordinator's store", timeout_s=30)
    port = job.store.underlying_store.port
    reader = connect_cluster_store("127.0.0.1", port, required_by="a rank's store", timeout_s=30)

    # An outsider: a plain client (no secret). It writes the notice raw, under a guessed secret's prefix,
    # and under the job's own prefix, which it can learn by listing the keys, with a made-up signature.
    outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    outsider.set("failed/gen0", json.dumps([0, 1]))
    publish_failed(JobStore(outsider, b"a guess at the job's secret"), 0, [0, 1])
    job.put("hello", "the job wrote something")
    # A store client's `set` does not wait for the server: a read on the writer's own connection does, so
    # the listing below (another connection) finds the job's key (it raced ahead of it before).
    assert job.read("hello") == "the job wrote something"
    prefixes = {k.split("/")[0] for k in outsider.list_keys() if k.startswith("job-")}
    assert key_prefix(SECRET.encode()) in prefixes  # the prefix is no secret: signatures are what count
    for prefix in prefixes:
        outsider.set(f"{prefix}/failed/gen0", "0" * 64 + ":" + json.dumps([0, 1]))
    assert outsider.check([f"{prefix}/failed/gen0" for prefix in prefixes])  # the forgeries are in place
    assert reader.read("failed/gen0") is None
    with pytest.raises(TimeoutError, match="no notice signed with the job's secret"):
        wait_failed(reader, 0, timeout_s=0.5)

    publish_failed(job, 0, [3])  # the job's own notice replaces the forged one
    assert wait_failed(reader, 0, timeout_s=10) == [3]
    assert reader.read("hello") == "the job wrote something"


# ---- files and checkpoints --------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a file: the proof that a load ran code of the checkpoint's choosing."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A two-step single-process run that saves a checkpoint (umask 002: group-writable files)."""
    cwd = tmp_path_factory.mktemp("isolation")
    old = os.umask(0o002)
    try:
        proc = run_cli([*TINY, *SINGLE, "trainer.max_steps=2", "checkpoint.every_n_steps=2",
                        f"hydra.run.dir={cwd / 'run'}"], cwd=cwd)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "run"


def test_run_files_follow_the_umask(tiny_run):
    files = [p for p in tiny_run.rglob("*") if p.is_file()]
    dirs = [p for p in tiny_run.rglob("*") if p.is_dir()]
    assert any(p.name == "goodput.jsonl" for p in files) and any(p.suffix == ".bin" for p in files)
    for p in files:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == 0o664, (p, oct(mode))  # 0o666 & ~0o002: shared with the group, as the umask says
    for p in dirs:
        assert not stat.S_IMODE(p.stat().st_mode) & stat.S_IWOTH, p


def _plant_pickle(ckpt, marker) -> None:
    """Replace the checkpoint's metadata with one carrying a pickled object and fix up the manifest's
    digest, as whoever can write the directory could."""
    meta = torch.load(ckpt / META_FILE, weights_only=True)
    meta["extra"]["payload"] = _Payload(str(marker))
    torch.save(meta, ckpt / META_FILE)
    doc = json.loads((ckpt / MANIFEST).read_text())
    size, digest = file_digest(ckpt / META_FILE)
    doc["files"][META_FILE] = {"size": size, doc["digest"]: digest}
    (ckpt / MANIFEST).write_text(json.dumps(doc))


def test_checkpoint_carrying_a_pickled_object_is_refused(tiny_run, tmp_path):
    import shutil

    from ntp_nemo.checkpoint import checkpoint_problem, load
    from ntp_nemo.runtime.runtime import RankPlace
    from ntp_nemo.topology import ResolvedLayout, Topology
    from tests.ntp_cases import GPT

    ckpt = tmp_path / "step_000002"
    shutil.copytree(tiny_run / "checkpoints" / "step_000002", ckpt)
    marker = tmp_path / "unpickled"
    _plant_pickle(ckpt, marker)
    assert checkpoint_problem(ckpt) is None  # the integrity check alone would let it through

    proc = run_cli([*TINY, *SINGLE, "trainer.max_steps=3", f"resume={ckpt}",
                    f"hydra.run.dir={tmp_path / 'resumed'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resume={ckpt} is not a usable checkpoint: {META_FILE} carries a pickled object" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()

    # The workers' load refuses it the same way, before it compares any shape (one process here).
    layout = ResolvedLayout.make(Topology(1, [1], [1] * (GPT.num_layers + 2)))
    model = RankPlace(layout, 0).build_model(GPT, 0)
    with pytest.raises(ConfigError, match="carries a pickled object"):
        load(ckpt, model)
    assert not marker.exists()
