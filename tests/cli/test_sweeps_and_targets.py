"""A user's third hour: sweeps (every job checked before the first trains, a summary whatever happens,
a recipe's replica_tp that follows a mesh override) and callbacks whose `_target_` is misspelt."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from ntp_nemo.errors import ConfigError
from tests.conftest import ROOT, SINGLE, TINY, compose, run_cli


def _check(overrides: list[str]):
    from ntp_nemo.config.data_keys import explicit_keys
    from ntp_nemo.train import check_config

    cfg = compose(overrides)
    spec = check_config(cfg, explicit_keys(overrides))
    return spec, spec.layout


def test_recipe_replica_tp_follows_a_mesh_override(capfd):
    """`ntp-train -m mesh.tp=1,2` on the default recipe (ntp.replica_tp=[2,1]): job 0 runs both replicas
    at TP 1 (with a note) instead of failing; job 1 keeps the recipe's degraded replica."""
    spec, layout = _check(["mesh.tp=1"])
    assert spec.ntp.replica_tp is None and list(layout.replica_tp) == [1, 1]
    assert "ntp.replica_tp=null" in capfd.readouterr().err
    _, layout = _check(["mesh.tp=2"])
    assert list(layout.replica_tp) == [2, 1]
    _, layout = _check(["mesh.dp=3"])  # [2,1] has two entries: three replicas at mesh.tp
    assert list(layout.replica_tp) == [2, 2, 2]


def test_coordinator_sizes_the_job_as_its_tasks_do():
    """ntp-coordinator composes the tasks' overrides: the recipe's replica_tp follows mesh.tp=1 there too
    (2 processes), instead of refusing what the tasks accept."""
    from ntp_nemo.cli.coordinator import _settings

    assert _settings(["mesh.tp=1"])[0] == 2
    assert _settings(["mesh.tp=2"])[0] == 3  # the recipe's [2,1]


@pytest.mark.parametrize("mesh", ["mesh.tp=1", "mesh.dp=3"])
def test_explicit_replica_tp_that_does_not_fit_names_the_null_fix(mesh):
    with pytest.raises(ConfigError) as err:
        _check([mesh, "ntp.replica_tp=[2,1]"])
    assert err.value.key == "ntp.replica_tp" and "ntp.replica_tp=null" in str(err.value)


def test_sweep_with_an_invalid_later_job_exits_2_before_any_job_trains(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "trainer.max_steps=1", "mesh.tp=1,5", f"hydra.sweep.dir={sweep}"],
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "sweep job 1 (mesh.tp=5): mesh.tp: mesh.tp=5 exceeds model.num_heads=4" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "step 1" not in proc.stdout and not (sweep / "0").exists()  # job 0 did not train
    assert not sweep.exists()  # a sweep refused before its first job leaves no directory


@pytest.mark.slow
def test_a_sweep_that_continues_past_failures_reports_every_one(tmp_path):
    """Jobs 0 and 2 lose their only rank (unrecoverable), job 1 trains; with sweep.on_failure=continue all
    three run, each failure is said as it happens and again at the end with its run directory, the table
    is printed on the console (failed jobs with their error, not "missing"), and the sweep exits 1."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, *SINGLE, "trainer.max_steps=2", "fault=kill_rank,none,kill_rank",
                    "fault.rank=0", "fault.step=1", "sweep.on_failure=continue", f"hydra.sweep.dir={sweep}"],
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "sweep summary:" in proc.stdout
    for job in ("0", "2"):
        assert f"sweep job {job} failed:" in proc.stderr and f"  job {job}: failed (exit 1)" in proc.stderr
        assert str(sweep / job) in proc.stderr
    assert "2 job(s) failed:" in proc.stderr
    with (sweep / "sweep_summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["job"], r["status"][:6]) for r in rows] == [("0", "failed"), ("1", "ok"), ("2", "failed")]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 1 | ok |")]
    assert len(table) == 1  # the table on the console
    ok = rows[1]
    assert "fault=none" in ok["overrides"] and "fault=kill_rank" in rows[0]["overrides"]
    assert int(ok["processes"]) == 1 and int(ok["steps"]) == 2 and float(ok["wall_s"]) > 0
    assert float(ok["capacity_pct"]) == 100.0 and 1.0 < float(ok["goodput_pct"]) <= 100.0


def test_a_failed_job_stops_the_sweep_by_default(tmp_path, capsys):
    """Under the default sweep.on_failure=stop, the callback ends the sweep (exit 1) at the job Hydra
    reports failed, after naming it; the summary written on the way out lists it as failed with its error,
    and the jobs after it as missing."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from ntp_nemo.sweep import SweepSummaryCallback, collect_rows

    callback = SweepSummaryCallback()
    callback._pending, callback._jobs = tmp_path, [["seed=1"], ["seed=2"], ["seed=3"]]
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text('{"goodput": 0.5, "processes": 1}')
    (tmp_path / "1").mkdir()
    failed = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("worker 0 exited 1\nrank 0 lost"))
    failed.hydra_cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "1")}}})
    with pytest.raises(SystemExit) as stop:
        callback.on_job_end(OmegaConf.create({}), failed)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "sweep job 1 failed: RuntimeError: rank 0 lost" in err and "sweep.on_failure=continue" in err
    callback._write_pending()
    out, err = capsys.readouterr()
    assert "| 1 | failed (exit 1): RuntimeError: rank 0 lost |" in out and "1 job(s) failed:" in err
    rows = collect_rows(tmp_path, callback._jobs)
    assert [r.status.split()[0] for r in rows] == ["ok", "missing", "missing"]  # the file alone
    assert "failed (exit 1)" in (tmp_path / "sweep_summary.csv").read_text()


def test_sweep_summary_lists_jobs_that_left_no_directory(tmp_path):
    from ntp_nemo.sweep import collect_rows

    (tmp_path / "0").mkdir()
    summary = '{"goodput": 0.5, "capacity_fraction": 0.75, "processes": 3}'
    (tmp_path / "0" / "summary.json").write_text(summary)
    rows = collect_rows(tmp_path, [["seed=1"], ["seed=2"]])
    assert [(r.job, r.status.split()[0]) for r in rows] == [("0", "ok"), ("1", "missing")]
    assert rows[0].values["goodput_pct"] == 50.0 and rows[0].values["capacity_pct"] == 75.0
    assert rows[0].values["processes"] == 3 and rows[1].overrides == "seed=2"


@pytest.mark.parametrize(
    "target,reason,match",
    [
        ("lightnin.pytorch.callbacks.LearningRateMonitor", "No module named 'lightnin'",
         "lightning.pytorch.callbacks.LearningRateMonitor"),
        ("lightning.pytorch.calbacks.LearningRateMonitor", "No module named 'lightning.pytorch.calbacks'",
         "lightning.pytorch.callbacks.LearningRateMonitor"),
        ("lightning.pytorch.loggers.CSVLoger", "has no attribute 'CSVLoger'",
         "lightning.pytorch.loggers.CSVLogger"),
    ],
)
def test_misspelt_target_names_key_reason_and_close_match(target, reason, match):
    from ntp_nemo.config.targets import check_targets

    group, name = ("logger", "csv") if "loggers" in target else ("callbacks", "lr_monitor")
    cfg = compose([f"{group}.{name}._target_={target}"])
    with pytest.raises(ConfigError) as err:
        check_targets(cfg)
    assert err.value.key == f"{group}.{name}._target_"
    assert reason in str(err.value) and f"Did you mean {match}?" in str(err.value)
    check_targets(compose([]))  # the default callbacks and loggers load


def test_a_callback_keyword_its_class_does_not_take_names_the_key_and_the_accepted_ones():
    """`+callbacks.es.monitr=val/loss` was Hydra's `unexpected keyword argument` (exit 1) in the workers;
    it is a config error naming `callbacks.es.monitr`, the close match and every accepted keyword."""
    from ntp_nemo.config.targets import check_targets

    cfg = compose(["+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping",
                   "+callbacks.es.monitr=val/loss"])
    with pytest.raises(ConfigError) as err:
        check_targets(cfg)
    msg = str(err.value)
    assert err.value.key == "callbacks.es.monitr" and "Did you mean callbacks.es.monitor?" in msg, msg
    assert "patience" in msg and "min_delta" in msg and "~callbacks.es.monitr" in msg
    cfg = compose(["+logger.csv2._target_=lightning.pytorch.loggers.CSVLogger", "+logger.csv2.save_dri=x"])
    with pytest.raises(ConfigError, match="Did you mean logger.csv2.save_dir") as err:
        check_targets(cfg)
    assert err.value.key == "logger.csv2.save_dri"


def test_a_monitored_metric_the_run_never_logs_is_caught_before_the_first_step():
    """EarlyStopping watching `val_loss` (the run logs `val/loss`) crashed at the first validation with no
    checkpoint; it is a config error with the did-you-mean, and every metric the module logs is one a
    callback may monitor."""
    import ast

    from ntp_nemo.config.targets import MONITORABLE, check_targets

    cfg = compose(["+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping",
                   "+callbacks.es.monitor=val_loss"])
    with pytest.raises(ConfigError) as err:
        check_targets(cfg)
    assert err.value.key == "callbacks.es.monitor"
    assert "Did you mean callbacks.es.monitor=val/loss?" in str(err.value), str(err.value)
    check_targets(compose(["+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping",
                           "+callbacks.es.monitor=val/loss", "+callbacks.es.patience=3"]))
    source = (ROOT / "ntp_nemo" / "lightning" / "lm_module.py").read_text()
    logged = {node.args[0].value for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "log" and node.args and isinstance(node.args[0], ast.Constant)}
    assert logged == set(MONITORABLE)


def test_misspelt_callback_exits_2_before_data_preparation(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    cache.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "ntp_nemo.train", "trainer.max_steps=1", f"hydra.run.dir={run_dir}",
         "callbacks.lr_monitor._target_=lightning.pytorch.callbacks.LearningRateMontor"],
        cwd=tmp_path, env=dict(os.environ, NTP_NEMO_CACHE=str(cache)), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "callbacks.lr_monitor._target_" in err and "has no attribute 'LearningRateMontor'" in err
    assert "Did you mean lightning.pytorch.callbacks.LearningRateMonitor?" in err and "Traceback" not in err
    assert not run_dir.exists() and not any(cache.iterdir())  # no run directory; no data was prepared


# The wall time of a run that lost process 0 (train_wall_s spans every step) is checked on the `rank0` run of
# tests/resilience/test_live_failover_cli.py (test_train_wall_time_after_losing_process_0_is_the_whole_runs).
