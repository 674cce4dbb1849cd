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
TARGETS = {
    "to-single": SINGLE,
    "to-2-2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]"],
    "to-tp3": ["mesh.dp=1", "mesh.tp=3", "ntp.replica_tp=[3]"],
    "to-pp2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "mesh.pp=2"],
}
# One-process run keeping three checkpoints, whose latest one (step 10) is damaged before it resumes.
CORRUPT = [*SINGLE, "checkpoint.keep_last=3"]


def _in(name: str) -> list[str]:
    """The case runs in the sweep's directory `name`: cases naming the same one continue that run."""
    return [f"hydra.sweep.subdir={name}"]


@pytest.fixture(scope="module")
def resume_sweeps(tmp_path_factory):
    """Every run of this module's resume cases, as two `ntp-train -m` sweeps over the same directories.

    First sweep: each layout of LAYOUTS and CORRUPT, stopped at step 10 (checkpoints every 5 steps).
    Then the data of CORRUPT's step-10 checkpoint is damaged. Second sweep, in this order: the (2,1)
    run's step-10 checkpoint resumed (`resume=PATH`) on every layout of TARGETS, each in its own
    directory; each stopped run resumed (`resume=auto`, its own directory), CORRUPT included; each
    layout's run once more (already complete). Returns (first sweep, whether each run had its step-10
    checkpoint after it, second sweep)."""
    tmp = tmp_path_factory.mktemp("resume")
    stop = ["trainer.stop_at_step=10"]
    first = sweep_cases({**{f"{name}-stop": [*layout, *stop, *_in(name)] for name, layout in LAYOUTS.items()},
                         "corrupt-stop": [*CORRUPT, *stop, *_in("corrupt")]}, [*TINY, *CKPT], tmp)
    saved = {name: (tmp / "sweep" / name / "checkpoints" / "step_000010" / "manifest.json").is_file()
             for name in [*LAYOUTS, "corrupt"]}
    if saved["corrupt"]:
        data = sorted((tmp / "sweep" / "corrupt" / "checkpoints" / "step_000010").glob("data_*.bin"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    src = tmp / "sweep" / "ntp" / "checkpoints" / "step_000010"
    second = sweep_cases({
        **{target: [*layout, f"resume={src}", *_in(target)] for target, layout in TARGETS.items()},
        **{f"{name}-resume": [*layout, *_in(name)] for name, layout in LAYOUTS.items()},
        "corrupt-resume": [*CORRUPT, *_in("corrupt")],
        **{f"{name}-again": [*layout, *_in(name)] for name, layout in LAYOUTS.items()},
    }, [*TINY, *CKPT], tmp)
    return first, saved, second


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stop_and_resume_equals_straight_run(resume_sweeps, straight, name):
    first, saved, second = resume_sweeps
    assert first.proc.returncode == 0, first.proc.stderr[-3000:]
    assert saved[name]
    assert second.proc.returncode == 0, second.proc.stderr[-3000:]
    run = second.run_dir(f"{name}-resume")
    log = (run / "train.log").read_text()  # what each of the three commands printed, in turn
    assert f"resuming from {run / 'checkpoints' / 'step_000010'}" in log
    got = losses(run)
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight[name].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)
    assert "already complete" in log.split("resuming from", 1)[1]  # the third command said so
    assert len(read_metrics(run)) == 20  # nothing trained twice


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_resume_on_another_layout_follows_the_curve(resume_sweeps, straight, target):
    _, saved, second = resume_sweeps
    assert saved["ntp"]
    proc = second.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Another run's checkpoint: no warning from Lightning's checkpoint callback about the directory.
    assert "dirpath has changed" not in proc.stdout + proc.stderr
    got = losses(second.run_dir(target))
    assert sorted(got) == list(range(11, 21))
    for step in range(11, 21):
        ref = straight["ntp"][step]
        assert abs(got[step] - ref) <= 1e-5 * abs(ref), (step, got[step], ref)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_skipped(resume_sweeps, straight):
    _, saved, second = resume_sweeps
    assert saved["corrupt"]
    run = second.run_dir("corrupt-resume")
    latest, previous = run / "checkpoints" / "step_000010", run / "checkpoints" / "step_000005"
    assert f"skipping checkpoint {latest}: " in second.proc.stderr, second.proc.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert f"skipping checkpoint {latest}: " in log  # this run's own warning
    assert f"resuming from {previous}" in log  # resumed from the previous valid one
    got = losses(run)
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight["single"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)


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
