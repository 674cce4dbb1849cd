"""Every checkpoint of a run damaged: resume=auto stops (exit 2) naming each one, deletes nothing, and
never starts over silently; resume=never starts over on purpose and still keeps the damaged ones
(checkpoint.keep_last deletes only checkpoints it can read).  One real CLI run, the rest in-process
on checkpoints written by `save_checkpoint`."""

from __future__ import annotations

import shutil
import warnings

import pytest

from ntp_nemo.checkpoint import (
    CheckpointSkippedWarning,
    NoUsableCheckpointError,
    checkpoint_name,
    keep_last_k,
    latest_valid_checkpoint,
    save_checkpoint,
)
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import SINGLE, TINY, read_metrics, run_cli
from tests.ntp_cases import GPT, SEED


def _truncate(ckpt):
    victim = max(ckpt.glob("data_*.bin"), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return victim.name


def _listing(directory):
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_cli_every_checkpoint_damaged_stops_naming_them_and_keeps_them(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, *SINGLE, "checkpoint.every_n_steps=2", "trainer.max_steps=4", "checkpoint.keep_last=2",
            "checkpoint.async_save=false", f"hydra.run.dir={run}"]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
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
    return NTPRuntime(ResolvedLayout.make(Topology(1, [1], [1] * 4)), 0).build_model(GPT, SEED)


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


def test_a_new_save_sets_an_unreadable_checkpoint_of_the_same_name_aside(ckpts):
    victim = _truncate(ckpts / checkpoint_name(2))
    damaged = (ckpts / checkpoint_name(2) / victim).read_bytes()
    with pytest.warns(CheckpointSkippedWarning, match="kept as"):
        save_checkpoint(ckpts / checkpoint_name(2), _model(), None, {"n": 22}, step=2, keep_last=1)
    aside = ckpts / (checkpoint_name(2) + ".unreadable")
    assert (aside / victim).read_bytes() == damaged
    # keep_last=1 kept the newest readable one (3) and the damaged one; the new step 2 and step 1 went.
    assert sorted(p.name for p in ckpts.iterdir()) == [aside.name, checkpoint_name(3)]
