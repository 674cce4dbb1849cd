"""What a run leaves and says: the logger's own folder in the summary, the previous record kept when
a run directory is continued with another config, and an unwritable
`hydra.run.dir` refused before anything starts."""

from __future__ import annotations

import pytest

from tests.conftest import SINGLE, TINY, run_cli

BASE = [a for a in TINY if a != "logger=none"]


@pytest.mark.slow
def test_logger_folder_and_previous_record(tmp_path):
    run = tmp_path / "run"
    res = run_cli([*BASE, *SINGLE, "logger=tensorboard", "trainer.max_steps=3", f"hydra.run.dir={run}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    outputs = next(line for line in res.stdout.splitlines() if line.startswith(" outputs"))
    assert "tb/" in outputs and "logs/" not in outputs and (run / "tb").is_dir()
    assert "another config" not in res.stdout
    # The same directory continued with another config (here more steps, no logger): the old record
    # is kept and the console says where.
    old = (run / ".hydra" / "config.yaml").read_text()
    res = run_cli([*TINY, *SINGLE, "trainer.max_steps=4", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "started with another config" in res.stdout and ".hydra/previous/1/" in res.stdout
    assert (run / ".hydra" / "previous" / "1" / "config.yaml").read_text() == old
    assert (run / ".hydra" / "config.yaml").read_text() != old


def test_unwritable_run_dir_exits_2_without_traceback(tmp_path):
    res = run_cli(["hydra.run.dir=/sys/ntp_nemo_run"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "hydra.run.dir: '/sys/ntp_nemo_run' cannot be created" in res.stderr
    assert "Traceback" not in res.stderr
