"""Checkpoint/resume through the real CLI: exact continuation, resharding, crashes, corrupt checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import NTP21, SINGLE, TINY, read_metrics, sweep_cases
from tests.waits import wait_until

CKPT = ["checkpoint.every_n_steps=5", "trainer.max_steps=20"]
SAVE5, NO_SAVES = CKPT[:1], ["checkpoint.every_n_steps=0"]
# The sweeps' common settings; each case sets its checkpoint interval (the SIGTERM run's resume has none).
COMMON = [*(o for o in TINY if not o.startswith("checkpoint.every_n_steps=")), *CKPT[1:]]


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


def _stopped_from_outside(sweep_dir) -> dict:
    """Two NTP (2,1) runs of 20 steps, each its own `ntp-train` process stopped from outside, in the
    directories `sigkill` and `sigterm` of `sweep_dir` (where the second sweep resumes them): SIGKILL to
    the whole process group once step 10's checkpoint is committed and 12 steps are done (checkpoints
    every 5 steps); SIGTERM to the launcher alone once 4 steps are done (no periodic checkpoints, async
    saves). Returns what each left: steps done, and for SIGTERM its exit code, output and checkpoints."""
    def done(run) -> int:
        return len(read_metrics(run)) if (run / "metrics.jsonl").is_file() else 0

    run = sweep_dir / "sigkill"
    args = [sys.executable, "-m", "ntp_nemo.train", *TINY, *NTP21, *CKPT, f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        args, cwd=sweep_dir.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until(lambda: (run / "checkpoints" / "step_000010" / "manifest.json").exists()
               and len(read_metrics(run)) >= 12, 240, "checkpoint step_000010 and 12 steps", poll_s=0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the job, no chance to clean up
    proc.wait()
    sigkill = {"done": done(run)}

    run = sweep_dir / "sigterm"
    args = [sys.executable, "-m", "ntp_nemo.train", *TINY, *NTP21, *NO_SAVES, "trainer.max_steps=20",
            "checkpoint.async_save=true", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(args, cwd=sweep_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_until(lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 4, 240, "4 steps",
               poll_s=0.1)
    proc.send_signal(signal.SIGTERM)  # to the parent only: it forwards to the workers
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    summary = run / "summary.json"
    sigterm = {"done": done(run), "returncode": proc.returncode, "out": out, "checkpoints": ckpts,
               "summary": json.loads(summary.read_text()) if summary.is_file() else {}}
    return {"sigkill": sigkill, "sigterm": sigterm}


@pytest.fixture(scope="module")
def resume_sweeps(tmp_path_factory):
    """Every run of this module's resume cases, as two `ntp-train -m` sweeps over the same directories.

    First, the two runs stopped from outside (`_stopped_from_outside`, a process each: the signal is the
    point). First sweep: each layout of LAYOUTS and CORRUPT, stopped at step 10 (checkpoints every 5
    steps). Then the data of CORRUPT's step-10 checkpoint is damaged. Second sweep, in this order: the
    (2,1) run's step-10 checkpoint resumed (`resume=PATH`) on every layout of TARGETS, each in its own
    directory; each stopped run resumed (`resume=auto`, its own directory), CORRUPT included; each
    layout's run once more (already complete); the SIGKILL and SIGTERM runs resumed (`resume=auto`,
    with the checkpoint interval each ran with). Returns (first sweep, whether each run had its step-10
    checkpoint after it, second sweep, what the runs stopped from outside left)."""
    tmp = tmp_path_factory.mktemp("resume")
    (tmp / "sweep").mkdir()
    stopped = _stopped_from_outside(tmp / "sweep")
    stop = ["trainer.stop_at_step=10"]
    first = sweep_cases({
        **{f"{name}-stop": [*layout, *SAVE5, *stop, *_in(name)] for name, layout in LAYOUTS.items()},
        "corrupt-stop": [*CORRUPT, *SAVE5, *stop, *_in("corrupt")],
    }, COMMON, tmp)
    saved = {name: (tmp / "sweep" / name / "checkpoints" / "step_000010" / "manifest.json").is_file()
             for name in [*LAYOUTS, "corrupt"]}
    if saved["corrupt"]:
        data = sorted((tmp / "sweep" / "corrupt" / "checkpoints" / "step_000010").glob("data_*.bin"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    src = tmp / "sweep" / "ntp" / "checkpoints" / "step_000010"
    second = sweep_cases({
        **{target: [*layout, *SAVE5, f"resume={src}", *_in(target)] for target, layout in TARGETS.items()},
        **{f"{name}-resume": [*layout, *SAVE5, *_in(name)] for name, layout in LAYOUTS.items()},
        "corrupt-resume": [*CORRUPT, *SAVE5, *_in("corrupt")],
        **{f"{name}-again": [*layout, *SAVE5, *_in(name)] for name, layout in LAYOUTS.items()},
        "sigkill-resume": [*NTP21, *SAVE5, *_in("sigkill")],
        "sigterm-resume": [*NTP21, *NO_SAVES, *_in("sigterm")],
    }, COMMON, tmp)
    return first, saved, second, stopped


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stop_and_resume_equals_straight_run(resume_sweeps, straight, name):
    first, saved, second, _ = resume_sweeps
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
    _, saved, second, _ = resume_sweeps
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
    _, saved, second, _ = resume_sweeps
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
def test_sigkill_mid_run_then_auto_resume_matches(resume_sweeps, straight):
    """SIGKILL of every process of the job after step 12, then the same command (resume=auto, a job of
    the second sweep) resumes from step 10 and ends on the uninterrupted curve."""
    _, _, second, stopped = resume_sweeps
    done_before = stopped["sigkill"]["done"]
    assert 12 <= done_before < 20, done_before
    assert second.proc.returncode == 0, second.proc.stderr[-3000:]
    got = losses(second.run_dir("sigkill-resume"))  # the redone steps overwrite the entries: the last run
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight["ntp"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues(resume_sweeps, straight):
    """SIGTERM to the launcher alone after step 4: it checkpoints the step it reached and exits 78
    (stopped before trainer.max_steps, checkpoint saved: not 0, which says trained), as summary.json and
    the console summary say; the same command (a job of the second sweep) continues to step 20 on the
    uninterrupted curve."""
    _, _, second, stopped = resume_sweeps
    term = stopped["sigterm"]
    out = term["out"]
    assert term["returncode"] == 78, out[-3000:]
    assert "preemption signal received" in out
    stopped_at = term["done"]
    assert 4 <= stopped_at < 20
    assert term["checkpoints"] == [f"step_{stopped_at:06d}"]
    summary = term["summary"]
    assert (summary["stopped_early"], summary["steps"], summary["exit_code"]) == ("SIGTERM", stopped_at, 78)
    assert f"checkpoint saved (step_{stopped_at:06d})" in out and "exit 78" in out, out[-3000:]
    assert second.proc.returncode == 0, second.proc.stderr[-3000:]
    got = losses(second.run_dir("sigterm-resume"))
    assert sorted(got) == list(range(1, 21))
    for step, ref in straight["ntp"].items():
        assert abs(got[step] - ref) <= 1e-6 * abs(ref), (step, got[step], ref)


def test_the_exit_code_of_a_stop(tmp_path):
    """In process, the decision every launch mode exits by: a preemption or time-limit stop (SIGTERM,
    SIGUSR1) before trainer.max_steps exits 78 only with the checkpoint of its step valid on disk, else 1
    with one line saying none was saved and what a rerun resumes from; Ctrl-C and a run that reached
    trainer.max_steps exit 0.  A rank that writes no summary.json reads the same from its trainer, and
    ntp-coordinator from the run's summary.json when it was written by this job."""
    from types import SimpleNamespace

    import torch

    from ntp_nemo.checkpoint import save_checkpoint
    from ntp_nemo.cli.coordinator import _run_dir, tasks_stop_code
    from ntp_nemo.lightning.callbacks import PreemptionCheckpoint
    from ntp_nemo.train import stop_exit, trainer_stop

    ckpts = tmp_path / "checkpoints"
    save_checkpoint(ckpts / "step_000004", torch.nn.Linear(2, 2), None, {}, step=4)

    def code(why, step, end=20):
        summary = {"steps": step, "max_steps": end, **({"stopped_early": why} if why else {})}
        return stop_exit(summary, ckpts)

    assert code("SIGTERM", 4) == (78, "stopped by SIGTERM at step 4 of trainer.max_steps=20 with "
                                      "checkpoint step_000004 saved: exit 78 (not trained yet; the same "
                                      "command continues from it)")
    assert code("SIGUSR1", 4)[0] == 78
    rc, line = code("SIGUSR1", 6)  # stopped after step 6, whose checkpoint is not there
    assert rc == 1 and line == ("error: stopped by SIGUSR1 at step 6 of trainer.max_steps=20, and no "
                                "checkpoint was saved (step_000006: does not exist); a rerun with "
                                "resume=auto continues from step_000004")
    assert code("SIGINT", 6) == (0, None) and code("SIGINT", 4) == (0, None)  # Ctrl-C: as before
    assert code(None, 20) == (0, None) and code("SIGTERM", 20) == (0, None)  # trained to max_steps
    rc, line = stop_exit({"steps": 3, "max_steps": 20, "stopped_early": "SIGTERM"}, tmp_path / "none")
    assert rc == 1 and line.endswith("no checkpoint was saved (step_000003: does not exist); a rerun starts "
                                     "over")
    (ckpts / "step_000004" / "manifest.json").unlink()  # an incomplete save is no checkpoint
    assert code("SIGTERM", 4)[0] == 1

    stop = PreemptionCheckpoint()
    trainer = SimpleNamespace(callbacks=[stop], global_step=6, max_steps=20)
    assert trainer_stop(trainer) == {"steps": 6, "max_steps": 20}
    stop.stopped, stop.signal_name = True, "SIGUSR1"
    assert trainer_stop(trainer) == {"steps": 6, "max_steps": 20, "stopped_early": "SIGUSR1"}
    trainer.global_step = 20  # the stop came with the last step
    assert trainer_stop(trainer) == {"steps": 20, "max_steps": 20}

    run = tmp_path / "run"
    assert _run_dir(["mesh.tp=2", f"hydra.run.dir={run}"]) == run
    assert _run_dir(["mesh.tp=2"]) is None and _run_dir(["hydra.run.dir=out/${now:%H}"]) is None
    save_checkpoint(run / "ckpt" / "step_000005", torch.nn.Linear(2, 2), None, {}, step=5)
    (run / "summary.json").write_text(json.dumps({"steps": 5, "max_steps": 20, "stopped_early": "SIGUSR1"}))
    written = (run / "summary.json").stat().st_mtime
    assert tasks_stop_code(run, "ckpt", written - 60)[0] == 78
    assert tasks_stop_code(run, "checkpoints", written - 60)[0] == 1  # not where this run's checkpoints are
    assert tasks_stop_code(run, "ckpt", written + 60) == (0, None)  # an earlier job's summary
    assert tasks_stop_code(None, "ckpt", written - 60) == (0, None)
