"""What a run leaves and says: the logger's own folder in the summary, the previous record kept when
a run directory is continued with another config, and an unwritable
`hydra.run.dir` refused before anything starts."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SINGLE, TINY, run_cli, sweep_cases

BASE = [a for a in TINY if a != "logger=none"]


@pytest.mark.slow
def test_logger_folder_and_previous_record(tmp_path):
    # Two jobs of one `ntp-train -m` sweep in one run directory, in order: a run with the TensorBoard
    # logger, then the same directory continued with another config (more steps, no logger).
    sweep = sweep_cases({"tb": ["logger=tensorboard", "trainer.max_steps=3", "hydra.sweep.subdir=run"],
                         "more": ["logger=none", "trainer.max_steps=4", "hydra.sweep.subdir=run"]},
                        [*BASE, *SINGLE], tmp_path)
    res = sweep.proc
    assert res.returncode == 0, res.stderr[-3000:]
    run = sweep.run_dir("more")
    # train.log: the first job's console, its summary, then the second job's console and summary.
    before, first_summary = (run / "train.log").read_text().split("ntp_nemo run summary")[:2]
    outputs = next(line for line in first_summary.splitlines() if line.startswith(" outputs"))
    assert "tb/" in outputs and "logs/" not in outputs and (run / "tb").is_dir()
    assert "another config" not in before
    # The continued run: the old record is kept and the console says where.
    assert "started with another config" in res.stdout and ".hydra/previous/1/" in res.stdout
    old = (run / ".hydra" / "previous" / "1" / "config.yaml").read_text()
    assert "tensorboard" in old.lower() and "max_steps: 3" in old
    new = (run / ".hydra" / "config.yaml").read_text()
    assert new != old and "max_steps: 4" in new
    # The resolved run is recorded beside Hydra's files (the previous one kept with its record).
    assert json.loads((run / ".hydra" / "run_spec.json").read_text())["trainer"]["max_steps"] == 4
    kept = json.loads((run / ".hydra" / "previous" / "1" / "run_spec.json").read_text())
    assert kept["trainer"]["max_steps"] == 3
    # The failover folder (heartbeat files, fault marks) is the user's alone, whatever the umask.
    assert (run / "failover").stat().st_mode & 0o777 == 0o700


def test_unwritable_run_dir_exits_2_without_traceback(tmp_path):
    res = run_cli(["hydra.run.dir=/sys/ntp_nemo_run"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "hydra.run.dir: '/sys/ntp_nemo_run' cannot be created" in res.stderr
    assert "Traceback" not in res.stderr
