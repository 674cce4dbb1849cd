"""`ntp-sim` as a user runs it: real subprocesses, outputs on disk, exit code 2 on bad config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = {"policy", "failed_fraction", "throughput_rel", "replicas_available"}


def ntp_sim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("ntp-sim")
    cmd = [exe] if exe else [sys.executable, "-m", "ntp_nemo.cli.sim"]
    return subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_no_arguments_prints_paper_table_and_writes_outputs(tmp_path):
    proc = ntp_sim(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Replica availability: 32768 GPUs, 0.10% failed" in out
    assert "TP32 x PP8, 128 replicas, local batch 8" in out
    assert "Throughput loss vs failure-free" in out and "15-day failure trace" in out
    assert "15-day straggler trace" in out and "rebalance" in out
    run_dirs = list((tmp_path / "outputs" / "sim").glob("*/*"))
    assert len(run_dirs) == 1
    run = run_dirs[0]
    for name in ("results.json", "results.csv", "throughput_loss.png", "availability.png", "trace.png"):
        assert (run / name).stat().st_size > 0, name
    records = json.loads((run / "results.json").read_text())
    assert all(REQUIRED <= set(r) for r in records if r["study"] != "stragglers")
    strag = [r for r in records if r["study"] == "stragglers"]
    assert [r["policy"] for r in strag] == ["report", "rebalance", "exclude"]
    assert all(0 < r["throughput_rel"] < 1 and r["episodes"] > 0 for r in strag)
    thr = [r for r in records if r["study"] == "throughput"]
    assert len(thr) == 20 * 3 and {r["samples"] for r in thr} == {100}


def test_small_cluster_run_honours_overrides(tmp_path):
    proc = ntp_sim(
        "cluster=small",
        "placements.samples=10",
        "placements.num_fractions=4",
        "studies=[throughput]",
        "policies=[DP-DROP,NTP]",
        "plots=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {r["policy"] for r in records} == {"DP-DROP", "NTP"}
    assert {r["num_gpus"] for r in records} == {512} and len(records) == 8
    assert not list((tmp_path / "run").glob("*.png"))
    header = (tmp_path / "run" / "results.csv").read_text().splitlines()[0].split(",")
    assert REQUIRED <= set(header)


@pytest.mark.parametrize(
    "override,key",
    [
        ("cluster.tp=7", "cluster.tp"),
        ("cluster=nonexistent", "overrides"),
        ("foo=1", "overrides"),
        ("train.tokens_per_batch=1000", "train.tokens_per_batch"),
        ("policies=[DP-DROP,FAST]", "policies"),
        ("stragglers.speed=[0,0.5]", "stragglers.speed"),
    ],
)
def test_bad_config_exits_2_without_running(tmp_path, override, key):
    proc = ntp_sim(override, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"error: invalid configuration: {key}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_multirun_writes_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = ntp_sim(
        "-m",
        "cluster=small",
        "cluster.pp=1,2",
        "placements.samples=5",
        "placements.num_fractions=3",
        "studies=[throughput]",
        "plots=false",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    md = (sweep / "sweep_summary.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "status" not in line]
    assert len(rows) == 2 * 3  # two jobs x three policies
    assert "cluster.pp=1" in md and "cluster.pp=2" in md
    csv_lines = (sweep / "sweep_summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("job,status,overrides") and len(csv_lines) == 7
