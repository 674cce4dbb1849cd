"""SweepSummaryCallback on a synthetic multirun directory: training, simulator and broken jobs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from omegaconf import OmegaConf

from ntp_nemo.sweep import SweepSummaryCallback, collect_rows


def make_job(root: Path, name: str, overrides: list[str] | None, files: dict[str, object]) -> None:
    job = root / name
    job.mkdir(parents=True)
    if overrides is not None:
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    for fname, content in files.items():
        (job / fname).write_text(content if isinstance(content, str) else json.dumps(content))


def build_sweep(root: Path) -> None:
    make_job(
        root,
        "0",
        ["mesh.tp=2", "layout.layer_tp=2"],
        {
            "summary.json": {
                "final_loss": 2.5,
                "val_loss": 2.75,
                "tokens_per_s": 1234.5,
                "goodput": 0.91,
                "layout": {"replica_tp": [2, 2], "layer_tp": [2, 2, 2]},
                "steps": 20,
            }
        },
    )
    make_job(
        root, "1", ["mesh.tp=4"], {"summary.json": {"final_loss": 2.4, "tokens_per_s": 999.0, "steps": 20}}
    )
    make_job(
        root,
        "2",
        ["cluster.tp=8"],
        {
            "results.json": [
                {
                    "study": "throughput",
                    "policy": "DP-DROP",
                    "failed_fraction": 0.0,
                    "throughput_rel": 1.0,
                    "replicas_available": 1.0,
                },
                {
                    "study": "throughput",
                    "policy": "DP-DROP",
                    "failed_fraction": 0.01,
                    "throughput_rel": 0.8,
                    "replicas_available": 0.8,
                },
                {
                    "study": "throughput",
                    "policy": "NTP",
                    "failed_fraction": 0.0,
                    "throughput_rel": 1.0,
                    "replicas_available": 1.0,
                },
                {
                    "study": "throughput",
                    "policy": "NTP",
                    "failed_fraction": 0.01,
                    "throughput_rel": 0.9,
                    "replicas_available": 1.0,
                },
                {
                    "study": "trace",
                    "policy": "DP-DROP",
                    "throughput_rel": 0.5,
                    "replicas_available": 0.5,
                    "spares_needed": 7,
                },
            ]
        },
    )
    make_job(root, "3", ["mesh.tp=3"], {})  # crashed before writing anything
    make_job(root, "4", ["mesh.tp=5"], {"summary.json": "{not json"})
    make_job(root, "10", None, {})  # a folder without a Hydra record


def test_callback_writes_markdown_and_csv(tmp_path):
    build_sweep(tmp_path)
    SweepSummaryCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    with (tmp_path / "sweep_summary.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["job"] for r in rows] == ["0", "1", "2", "2", "3", "4", "10"]  # numeric job order
    train = rows[0]
    assert train["status"] == "ok" and train["overrides"] == "mesh.tp=2 layout.layer_tp=2"
    assert float(train["final_loss"]) == 2.5 and float(train["goodput_pct"]) == 91.0
    assert json.loads(train["layout"]) == {"replica_tp": [2, 2], "layer_tp": [2, 2, 2]}
    assert rows[1]["val_loss"] == "" and float(rows[1]["tokens_per_s"]) == 999.0
    drop, ntp = rows[2], rows[3]
    assert drop["policy"] == "DP-DROP" and float(drop["throughput_rel_mean"]) == 0.9
    assert float(drop["throughput_rel_min"]) == 0.8 and drop["spares_needed"] == "7"
    assert ntp["policy"] == "NTP" and float(ntp["throughput_rel_mean"]) == 0.95 and ntp["spares_needed"] == ""
    assert rows[4]["status"].startswith("missing") and rows[4]["overrides"] == "mesh.tp=3"
    assert rows[5]["status"].startswith("unreadable")
    assert rows[6]["status"].startswith("missing") and rows[6]["overrides"] == ""
    md = (tmp_path / "sweep_summary.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert len(table) == 2 + len(rows)
    assert table[0].count("|") == len(table[2].split(" | ")) + 1


def test_nested_job_dirs_are_found_and_empty_sweeps_do_not_crash(tmp_path):
    make_job(tmp_path, "a/seed=1", ["seed=1"], {"summary.json": {"final_loss": 1.0}})
    rows = collect_rows(tmp_path)
    assert [(r.job, r.status) for r in rows] == [("a/seed=1", "ok")]
    empty = tmp_path / "empty"
    empty.mkdir()
    SweepSummaryCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(empty)}}}))
    assert "0 row(s)" in (empty / "sweep_summary.md").read_text()
    SweepSummaryCallback().on_multirun_end(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "no")}}})
    )
