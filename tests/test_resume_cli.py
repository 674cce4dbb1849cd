"""Checkpoint/resume through the real CLI: exact continuation, resharding, crashes, corrupt checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import NTP21, SINGLE, TINY, read_metrics, run_cli, sweep_cases

CKPT = ["checkpoint.every_n_steps=5", "trainer.max_steps=20"]


def losses(run):
    return {m["step"]: m["loss"] for m in read_metrics(run)}


@pytest.fixture(scope="module")
def straight(reference_losses):
    """Uninterrupted 20-step runs (single process and NTP (2,1)), the references (conftest: checkpoints
    do not change the numbers, so the session's runs without them serve)."""
    return {"single": reference_losses("single-20"), "ntp": reference_losses("ntp21-20")}


LAYOUTS = {"single": SINGLE, "ntp": NTP21}


@pytest.fixture(scope="module")
def stopped_then_resumed(tmp_path_factory):
    """Each layout of LAYOUTS stopped at step 10, resumed (`resume=auto`) and run once more: three
    `ntp-train -m` sweeps over the same job directories (one per layout), in that order."""
    tmp = tmp_path_factory.mktemp("stop_resume")
    first = sweep_cases(LAYOUTS, [*TINY, *CKPT, "trainer.stop_at_step=10"], tmp)
    saved = {name: (run / "checkpoints" / "step_000010" / "manifest.json").exists()
             for name, run in first.dirs.items()}
    second = sweep_cases(LAYOUTS, [*TINY, *CKPT], tmp)
    metrics = {name: losses(run) for name, run in second.dirs.items() if (run / "metrics.jsonl").exists()}
    again = sweep_cases(LAYOUTS, [*TINY, *CKPT], tmp)
    return first, saved, second, metrics, again


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stop_and_resume_equals_straight_run(stopped_then_resumed, straight, name):
    first, saved, second, metrics, again = stopped_then_resumed
    assert first.proc.returncode == 0, first.proc.stderr[-3000:]
    assert saved[name]
    assert second.proc.returncode == 0, second.proc.stderr[-3000:]
    run = second.run_dir(name)
    assert "resuming from" in second.proc.stdout and "resuming from" in (run / "train.log").read_text()
    got = metrics[name]
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight[name].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)
    assert again.proc.returncode == 0, again.proc.stderr[-3000:]
    assert "already complete" in again.proc.stdout
    assert "already complete" in (run / "train.log").read_text()  # this job said so
    assert len(read_metrics(run)) == 20  # nothing trained twice


TARGETS = {
    "to-single": SINGLE,
    "to-2-2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]"],
    "to-tp3": ["mesh.dp=1", "mesh.tp=3", "ntp.replica_tp=[3]"],
    "to-pp2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "mesh.pp=2"],
}


@pytest.fixture(scope="module")
def resumed_elsewhere(tmp_path_factory):
    """A (2,1) run stopped at step 10, then its checkpoint resumed on every layout of TARGETS: one
    `ntp-train -m` sweep (`resume=PATH`), each target in its own run directory."""
    tmp = tmp_path_factory.mktemp("resume_elsewhere")
    src = tmp / "src"
    proc = run_cli([*TINY, *NTP21, *CKPT, "trainer.stop_at_step=10", f"hydra.run.dir={src}"], cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_cases(TARGETS, [*TINY, *CKPT, f"resume={src / 'checkpoints' / 'step_000010'}"], tmp)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_on_another_layout_follows_the_curve(resumed_elsewhere, straight, target):
    proc = resumed_elsewhere.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Another run's checkpoint: no warning from Lightning's checkpoint callback about the directory.
    assert "dirpath has changed" not in proc.stdout + proc.stderr
    got = losses(resumed_elsewhere.run_dir(target))
    assert sorted(got) == list(range(11, 21))
    for step in range(11, 21):
        ref = straight["ntp"][step]
        assert abs(got[step] - ref) <= 1e-5 * abs(ref), (step, got[step], ref)


@pytest.mark.slow
def test_sigkill_mid_run_then_auto_resume_matches(tmp_path, straight):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "ntp_nemo.train", *TINY, *NTP21, *CKPT, f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        if (run / "checkpoints" / "step_000010" / "manifest.json").exists() and len(read_metrics(run)) >= 12:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the job, no chance to clean up
    proc.wait()
    done_before = len(read_metrics(run))
    assert 12 <= done_before < 20
    proc = run_cli([*TINY, *NTP21, *CKPT, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(run)  # the redone steps overwrite the dict entries: the last execution of each step
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight["ntp"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_skipped(tmp_path, straight):
    run = tmp_path / "run"
    proc = run_cli(
        [*TINY, *SINGLE, *CKPT, "trainer.stop_at_step=10", "checkpoint.keep_last=3", f"hydra.run.dir={run}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    latest = run / "checkpoints" / "step_000010"
    data = sorted(latest.glob("data_*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = run_cli([*TINY, *SINGLE, *CKPT, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_000010" in proc.stderr and "skipping" in proc.stderr
    assert "step_000005" in proc.stdout  # resumed from the previous valid one
    got = losses(run)
    for step, ref in straight["single"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues(tmp_path, straight):
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "ntp_nemo.train",
        *TINY,
        *NTP21,
        "checkpoint.every_n_steps=0",
        "trainer.max_steps=20",
        "checkpoint.async_save=true",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 4):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # to the parent only: it forwards to the workers
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "preemption signal received" in out
    stopped = len(read_metrics(run))
    assert 4 <= stopped < 20
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == [f"step_{stopped:06d}"]
    proc2 = run_cli(
        [*TINY, *NTP21, "checkpoint.every_n_steps=0", "trainer.max_steps=20", f"hydra.run.dir={run}"],
        cwd=tmp_path,
    )
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    got = losses(run)
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight["ntp"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)
