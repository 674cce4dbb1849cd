"""Hydra callback that ends a multirun with one comparison table of its jobs.

`ntp-train -m ...` jobs leave `summary.json` (final_loss, val_loss, tokens_per_s, goodput,
layout, steps); `ntp-sim -m ...` jobs leave `results.json` (a list of records, summarised per
policy). Each job's overrides come from `.hydra/overrides.yaml`. The table is written as
`sweep_summary.md` and `sweep_summary.csv` in the sweep directory; a job without either file
(crashed, still running, or not a job of ours) is listed as missing instead of failing the sweep.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TRAIN_COLUMNS = ("layout", "steps", "final_loss", "val_loss", "tokens_per_s", "goodput")
SIM_COLUMNS = (
    "policy",
    "throughput_rel_mean",
    "throughput_rel_min",
    "replicas_available_mean",
    "spares_needed",
)


@dataclass
class JobRow:
    """One line of the summary: a training job, one policy of a simulator job, or a missing job."""

    job: str
    overrides: str
    status: str
    kind: str = ""
    values: dict[str, Any] = field(default_factory=dict)


def _job_sort_key(path: Path, root: Path) -> tuple:
    parts = path.relative_to(root).parts
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Job directories: every folder holding a `.hydra/` record, plus top-level folders without one."""
    jobs = {p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir() and p.parent != sweep_dir}
    for child in sweep_dir.iterdir():
        if (
            child.is_dir()
            and not child.name.startswith(".")
            and not any(child in j.parents or j == child for j in jobs)
        ):
            jobs.add(child)
    return sorted(jobs, key=lambda p: _job_sort_key(p, sweep_dir))


def _read_overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    try:
        return " ".join(str(o) for o in OmegaConf.to_container(OmegaConf.load(path)) or [])
    except Exception:  # an unreadable record must not break the summary
        return "?"


def _compact(value: Any) -> Any:
    return (
        value
        if isinstance(value, (int, float, str)) or value is None
        else json.dumps(value, separators=(",", ":"))
    )


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _sim_rows(job: str, overrides: str, records: list[dict]) -> list[JobRow]:
    rows = []
    policies = list(dict.fromkeys(r.get("policy") for r in records if r.get("policy")))
    for policy in policies:
        mine = [r for r in records if r.get("policy") == policy]
        main = [r for r in mine if r.get("study") == "throughput"] or mine
        trace = [r for r in mine if r.get("study") == "trace"]
        spares: Any = None
        if len(trace) == 1:
            spares = trace[0].get("spares_needed")
        elif trace:
            spares = ", ".join(f"{r.get('spares_needed')} (x{r.get('rate_multiplier')})" for r in trace)
        thr = [r.get("throughput_rel") for r in main]
        rows.append(
            JobRow(
                job,
                overrides,
                "ok",
                "sim",
                {
                    "policy": policy,
                    "throughput_rel_mean": _mean(thr),
                    "throughput_rel_min": min((v for v in thr if isinstance(v, (int, float))), default=None),
                    "replicas_available_mean": _mean([r.get("replicas_available") for r in main]),
                    "spares_needed": spares,
                },
            )
        )
    return rows or [JobRow(job, overrides, "empty results.json", "sim")]


def collect_rows(sweep_dir: Path) -> list[JobRow]:
    """One row per training job, one per (simulator job, policy), one per missing job."""
    rows: list[JobRow] = []
    for job_dir in find_job_dirs(sweep_dir):
        job = str(job_dir.relative_to(sweep_dir))
        overrides = _read_overrides(job_dir)
        summary, results = job_dir / "summary.json", job_dir / "results.json"
        try:
            if summary.is_file():
                data = json.loads(summary.read_text())
                rows.append(
                    JobRow(job, overrides, "ok", "train", {k: _compact(data.get(k)) for k in TRAIN_COLUMNS})
                )
            elif results.is_file():
                data = json.loads(results.read_text())
                if not isinstance(data, list):
                    raise ValueError("results.json is not a list of records")
                rows += _sim_rows(job, overrides, data)
            else:
                rows.append(JobRow(job, overrides, "missing (no summary.json or results.json)"))
        except (OSError, ValueError) as err:
            rows.append(JobRow(job, overrides, f"unreadable: {err}"))
    return rows


def _columns(rows: list[JobRow]) -> list[str]:
    cols = ["job", "status", "overrides"]
    kinds = {r.kind for r in rows}
    if "train" in kinds:
        cols += TRAIN_COLUMNS
    if "sim" in kinds:
        cols += [c for c in SIM_COLUMNS if c not in cols]
    return cols


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def write_summary(sweep_dir: Path, rows: list[JobRow]) -> tuple[Path, Path]:
    """sweep_summary.md (a Markdown table) and sweep_summary.csv with the same columns."""
    cols = _columns(rows)
    table = [
        [_cell({"job": r.job, "status": r.status, "overrides": r.overrides, **r.values}.get(c)) for c in cols]
        for r in rows
    ]
    md = [
        f"# Sweep summary: {sweep_dir}",
        "",
        f"{len(rows)} row(s)",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    md += ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in table]
    md_path, csv_path = sweep_dir / "sweep_summary.md", sweep_dir / "sweep_summary.csv"
    md_path.write_text("\n".join(md) + "\n")
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(cols)
        writer.writerows(table)
    return md_path, csv_path


class SweepSummaryCallback(Callback):
    """Writes sweep_summary.md / .csv into the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            log.warning("sweep summary skipped: %s does not exist", sweep_dir)
            return
        md_path, _ = write_summary(sweep_dir, collect_rows(sweep_dir))
        print(f"sweep summary: {md_path}", flush=True)  # once (not also through Hydra's log handler)
