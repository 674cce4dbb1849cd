"""Every checkpoint of a run damaged: resume=auto stops (exit 2) naming each one, deletes nothing, and
never starts over silently; resume=never starts over on purpose and still keeps the damaged ones
(checkpoint.keep_last deletes only checkpoints it can read).  The CLI runs start from one
sweep's runs; the rest in-process on checkpoints written by `save_checkpoint`."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

import pytest

from ntp_nemo.checkpoint import (
    CheckpointSkippedWarning,
    CheckpointWriteError,
    NoUsableCheckpointError,
    checkpoint_name,
    keep_last_k,
    latest_valid_checkpoint,
    save_checkpoint,
)
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import SINGLE, TINY, read_metrics, run_cli, sweep_cases
from tests.ntp_cases import GPT, SEED


def _truncate(ckpt):
    victim = max(ckpt.glob("data_*.bin"), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return victim.name


def _listing(directory):
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file()}


FIRST = [*TINY, *SINGLE, "checkpoint.every_n_steps=2", "checkpoint.async_save=false"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory):
    """The 4-step runs (checkpoints at steps 2 and 4) the two CLI tests below damage and resume, each in
    its own directory: two jobs of one `ntp-train -m` sweep."""
    return sweep_cases({"all": ["checkpoint.keep_last=2", "hydra.sweep.subdir=all"],
                        "flipped": ["hydra.sweep.subdir=flipped"]},
                       [*FIRST, "trainer.max_steps=4"], tmp_path_factory.mktemp("first_runs"))


@pytest.mark.slow
def test_cli_every_checkpoint_damaged_stops_naming_them_and_keeps_them(first_runs, tmp_path):
    assert first_runs.proc.returncode == 0, first_runs.proc.stderr[-3000:]
    run = first_runs.run_dir("all")
    args = [*FIRST, "trainer.max_steps=4", "checkpoint.keep_last=2", f"hydra.run.dir={run}"]
    assert len(read_metrics(run)) == 4
    ckpts = run / "checkpoints"
    names = {checkpoint_name(2): _truncate(ckpts / checkpoint_name(2)),
             checkpoint_name(4): _truncate(ckpts / checkpoint_name(4))}
    before = _listing(ckpts)

    again = run_cli([*args, "trainer.max_steps=6"], cwd=tmp_path)
    out = again.stdout + again.stderr
    assert again.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "saved none" not in out and "starting from step 1" not in out
    for ckpt, victim in names.items():
        assert ckpt in again.stderr and victim in again.stderr, again.stderr
    assert "truncated" in again.stderr and "resume=never" in again.stderr
    assert _listing(ckpts) == before  # nothing deleted, nothing written
    assert len(read_metrics(run)) == 4  # nothing trained

    # resume=never starts over on purpose; the damaged checkpoints are set aside, never deleted,
    # even by keep_last=1.
    fresh = run_cli([*args, "resume=never", "checkpoint.keep_last=1"], cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    kept = {p.name for p in ckpts.iterdir()}
    aside = ".unreadable"
    assert kept == {checkpoint_name(4), checkpoint_name(2) + aside, checkpoint_name(4) + aside}
    for ckpt, victim in names.items():
        aside = f"{ckpt}.unreadable/{victim}"
        assert _listing(ckpts)[aside] == before[f"{ckpt}/{victim}"]


def _model():
    return RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 4)), 0).build_model(GPT, SEED)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("three")
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(directory / checkpoint_name(step), model, None, {"n": step}, step=step)
    return directory


@pytest.fixture
def ckpts(pristine, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    return directory


def test_keep_last_never_deletes_an_unreadable_checkpoint(ckpts):
    _truncate(ckpts / checkpoint_name(3))
    removed = keep_last_k(ckpts, 1)
    assert removed == [ckpts / checkpoint_name(1)]  # the newest readable one (2) is kept, and so is 3
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(2), checkpoint_name(3)]


def test_no_usable_checkpoint_is_an_error_naming_each(ckpts):
    victims = {checkpoint_name(s): _truncate(ckpts / checkpoint_name(s)) for s in (1, 2, 3)}
    before = _listing(ckpts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NoUsableCheckpointError) as err:
            latest_valid_checkpoint(ckpts)
    assert not [w for w in caught if issubclass(w.category, CheckpointSkippedWarning)]  # told once, below
    msg = str(err.value)
    assert err.value.key == "resume" and "none is usable" in msg and "resume=never" in msg
    for ckpt, victim in victims.items():
        assert f"{ckpt}: file {victim}" in msg and "truncated" in msg
    assert _listing(ckpts) == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointSkippedWarning)
        # The fallback of a failed load asks only for an earlier one: none is an answer, not an error.
        assert latest_valid_checkpoint(ckpts, before_step=3) is None
        # A directory without checkpoints (or with unrelated folders only) is a fresh start.
        (ckpts.parent / "empty" / "notes").mkdir(parents=True)
        assert latest_valid_checkpoint(ckpts.parent / "empty") is None


def test_a_new_save_sets_an_unreadable_checkpoint_of_the_same_name_aside(ckpts, capsys):
    victim = _truncate(ckpts / checkpoint_name(2))
    damaged = (ckpts / checkpoint_name(2) / victim).read_bytes()
    save_checkpoint(ckpts / checkpoint_name(2), _model(), None, {"n": 22}, step=2, keep_last=1)
    aside = ckpts / (checkpoint_name(2) + ".unreadable")
    told = capsys.readouterr().err
    assert told.count("\n") == 1 and f"kept as {aside}" in told and victim in told
    assert (aside / victim).read_bytes() == damaged
    # keep_last=1 kept the newest readable one (3) and the damaged one; the new step 2 and step 1 went.
    assert sorted(p.name for p in ckpts.iterdir()) == [aside.name, checkpoint_name(3)]


@pytest.mark.slow
def test_cli_resume_is_announced_only_after_the_data_passed_its_check(first_runs, tmp_path):
    """The newest checkpoint's data flipped (the pre-launch check reads no data): one announcement,
    of the checkpoint actually used, never first the damaged one and then another."""
    assert first_runs.proc.returncode == 0, first_runs.proc.stderr[-3000:]
    run = first_runs.run_dir("flipped")
    args = [*FIRST, f"hydra.run.dir={run}"]
    assert len(read_metrics(run)) == 4
    newest = run / "checkpoints" / checkpoint_name(4)
    victim = max(newest.glob("data_*.bin"), key=lambda f: f.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    again = run_cli([*args, "trainer.max_steps=6"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if "resuming from" in line]
    assert len(said) == 1, said
    assert f"resuming from {run / 'checkpoints' / checkpoint_name(2)} (step 2;" in said[0]
    assert f"instead of {newest}" in said[0]
    assert victim.name in again.stderr  # the warning names the damaged file
    assert (run / "checkpoints" / (checkpoint_name(4) + ".unreadable") / victim.name).read_bytes() == raw


def _save_failure(directory, step, keep_last=1):
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(directory / checkpoint_name(step), _model(), None, {"n": step}, step=step,
                        keep_last=keep_last)
    return str(err.value)


def test_a_write_error_during_a_save_is_one_line_naming_what_survives(ckpts, monkeypatch):
    import errno

    import ntp_nemo.checkpoint.storage as storage

    real, written = storage._write_all, []

    def full_disk(fd, mv):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(mv))
        real(fd, mv)

    monkeypatch.setattr(storage, "_write_all", full_disk)
    msg = _save_failure(ckpts, 4)
    assert "\n" not in msg and str(ckpts / checkpoint_name(4)) in msg and "No space left on device" in msg
    assert "kept (step_000003, step_000002, step_000001)" in msg and "resume=auto" in msg
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(s) for s in (1, 2, 3)]  # no .tmp


def test_a_full_file_system_keeps_the_last_complete_checkpoint(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        save_checkpoint(small / checkpoint_name(1), _model(), None, {"n": 1}, step=1, keep_last=1)
        free = shutil.disk_usage(small).free
        (small / "filler").write_bytes(b"\0" * (free - 4096))  # the next save cannot fit
        msg = _save_failure(small, 2)
        assert "No space left on device" in msg and "kept (step_000001)" in msg
        assert sorted(p.name for p in small.iterdir()) == ["filler", checkpoint_name(1)]
        assert latest_valid_checkpoint(small) == small / checkpoint_name(1)
        (small / "filler").unlink()
        save_checkpoint(small / checkpoint_name(2), _model(), None, {"n": 2}, step=2, keep_last=1)
        assert latest_valid_checkpoint(small) == small / checkpoint_name(2)
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.slow
def test_cli_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_survives(tmp_path):
    """Checkpoints on a 1.6 MB file system: the first (1.1 MB) fits, the next cannot."""
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(ckpts)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        proc = run_cli([*TINY, *SINGLE, "checkpoint.every_n_steps=2", "trainer.max_steps=6",
                        "checkpoint.keep_last=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stdout + proc.stderr
        told = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(told) == 1, proc.stderr
        assert f"{ckpts / checkpoint_name(4)} could not be written: No space left on device" in told[0]
        assert "kept (step_000002)" in told[0]
        assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(2)]
        assert latest_valid_checkpoint(ckpts) == ckpts / checkpoint_name(2)
    finally:
        subprocess.run(["umount", str(ckpts)], check=False)


def _one_rank_fails_to_write(rank, world, directory):
    import errno

    import ntp_nemo.checkpoint.storage as storage

    torch_threads_one()
    model = RankPlace(ResolvedLayout.make(Topology(1, [1, 1], [1] * 4)), rank).build_model(GPT, SEED)
    save_checkpoint(f"{directory}/{checkpoint_name(1)}", model, None, {"n": 1}, step=1)
    if rank == 1:
        def full(fd, mv):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        storage._write_all = full
    try:
        save_checkpoint(f"{directory}/{checkpoint_name(2)}", model, None, {"n": 2}, step=2)
    except CheckpointWriteError as err:
        return str(err)
    return None


def torch_threads_one():
    import torch

    torch.set_num_threads(1)


def test_a_write_error_on_one_rank_stops_every_rank_at_once(tmp_path):
    """Rank 1 cannot write; rank 0 could: both raise the same error, neither waits in a collective."""
    from ntp_nemo.launch.workers import run_workers

    msgs = run_workers(_one_rank_fails_to_write, 2, str(tmp_path), timeout_s=60.0)
    assert msgs[0] == msgs[1] and msgs[0] is not None
    assert "No space left on device" in msgs[0] and "kept (step_000001)" in msgs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(1)]
