"""Hydra callback that ends a multirun with one comparison table of its jobs.

`ntp-train -m ...` jobs leave `summary.json` (final_loss, val_loss, tokens_per_s, goodput,
layout, steps); `ntp-sim -m ...` jobs leave `results.json` (a list of records, summarised per
policy). Each job's overrides come from `.hydra/overrides.yaml`. The table is written as
`sweep_summary.md` and `sweep_summary.csv` in the sweep directory; a job without either file
(crashed, still running, or not a job of ours) is listed as missing instead of failing the sweep.

A job that fails at run time is recorded as it ends (`on_job_end`: its status, exit code, the error's
last line, its run directory) and said on the console at once; `sweep.on_failure` decides what follows:
`stop` (the default) ends the sweep there (exit 1), `continue` runs every other job and the sweep exits 1
at the end. Either way the table is printed on the console as well as written, followed by every
failure.

Before the first training job starts, every job of a `ntp-train -m` sweep is composed and checked
in-process (`ntp_nemo.train.check_config`): an invalid job ends the sweep with exit 2 naming the job and
its overrides before anything trains. The summary is written when the sweep ends, also when a job
fails and ends it early (the jobs that did not finish are listed as missing).
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import io
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TRAIN_COLUMNS = ("layout", "processes", "steps", "final_loss", "val_loss", "tokens_per_s", "goodput_pct",
                 "capacity_pct", "wall_s")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
ON_FAILURE = ("stop", "continue")
JOB_NUM_SUBDIRS = ("${hydra.job.num}", "${hydra:job.num}")  # job i's directory is `i`


def _percent(value: Any) -> Any:
    return 100 * value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _train_values(data: dict) -> dict[str, Any]:
    """The training columns of one job's summary.json (goodput and capacity as percentages)."""
    values = {k: _compact(data.get(k)) for k in ("layout", "processes", "steps", "final_loss", "val_loss",
                                                 "tokens_per_s", "wall_s")}
    values["goodput_pct"] = _percent(data.get("goodput"))
    values["capacity_pct"] = _percent(data.get("capacity_fraction"))
    return values
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


def collect_rows(sweep_dir: Path, expected: list[list[str]] | None = None) -> list[JobRow]:
    """One row per training job, one per (simulator job, policy), one per missing job; `expected`: the
    overrides of every job of the sweep (job i's directory is `i`), so that a job that left no
    directory (it did not run, or failed before writing anything) is listed too."""
    rows: list[JobRow] = []
    dirs = find_job_dirs(sweep_dir) if sweep_dir.is_dir() else []
    present = {str(d.relative_to(sweep_dir)) for d in dirs}
    for i in range(len(expected or [])):
        if str(i) not in present:
            dirs.append(sweep_dir / str(i))
    dirs.sort(key=lambda p: _job_sort_key(p, sweep_dir))
    for job_dir in dirs:
        if not job_dir.exists():
            i = int(job_dir.name)
            rows.append(JobRow(job_dir.name, " ".join(expected[i]), "missing (did not run, or failed before "
                                                                    "writing anything)"))
            continue
        job = str(job_dir.relative_to(sweep_dir))
        overrides = _read_overrides(job_dir)
        summary, results = job_dir / "summary.json", job_dir / "results.json"
        try:
            if summary.is_file():
                data = json.loads(summary.read_text())
                rows.append(JobRow(job, overrides, "ok", "train", _train_values(data)))
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


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """The overrides of each job of a multirun, in Hydra's order (job i runs the i-th list); None under
    a sweeper other than Hydra's basic one (it chooses its jobs as it goes)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.get("sweeper") or {}
    if sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    arguments = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    arguments += list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def check_jobs(config_name: str | None, jobs: list[list[str]]) -> None:
    """Compose and check every training job (`check_config`, the checks `ntp-train` runs before it
    launches) before the first starts: the first invalid one ends the sweep with exit 2, naming the job
    and its overrides. Their warnings and notes are printed when each job runs, not here."""
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ntp_nemo.config.data_keys import explicit_keys
    from ntp_nemo.errors import EXIT_CONFIG, ConfigError, report_config_error
    from ntp_nemo.train import check_config

    common = set.intersection(*(set(job) for job in jobs)) if len(jobs) > 1 else set()
    for i, job in enumerate(jobs):
        where = f"sweep job {i} ({' '.join(o for o in job if o not in common) or ' '.join(job)})"
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                cfg = compose(config_name=config_name or "config", overrides=job)
                check_config(cfg, explicit_keys(job))
        except ConfigError as err:
            report_config_error(ConfigError(f"{where}: {err.key}", str(err).split(": ", 1)[-1]))
        except (HydraException, OmegaConfBaseException) as err:
            report_config_error(ConfigError(where, f"{err}".strip()))
        else:
            continue
        print("nothing was trained: fix that job's override, or leave it out of the sweep", file=sys.stderr,
              flush=True)
        sys.exit(EXIT_CONFIG)


def _is_training(config: DictConfig) -> bool:
    return all(k in config for k in ("trainer", "mesh", "model"))


class SweepSummaryCallback(Callback):
    """Checks every job of a training sweep before the first starts, and writes sweep_summary.md /
    .csv into the sweep directory when the multirun ends, or when a failed job ends it early."""

    def __init__(self) -> None:
        self._pending: Path | None = None  # the sweep directory while its summary is not written
        self._jobs: list[list[str]] | None = None
        self._failed: dict[str, tuple[str, str]] = {}  # job (its directory) -> (status, run directory)
        self._on_failure = "stop"

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        self._on_failure = str((config.get("sweep") or {}).get("on_failure", "stop"))
        if self._on_failure not in ON_FAILURE:
            from ntp_nemo.errors import EXIT_CONFIG, ConfigError, report_config_error

            report_config_error(ConfigError("sweep.on_failure", f"must be stop or continue, got "
                                            f"{self._on_failure!r}: stop ends the sweep at the first job "
                                            "that fails, continue runs every job."))
            sys.exit(EXIT_CONFIG)
        self._jobs = sweep_jobs(config)
        if self._jobs is not None and _is_training(config):
            check_jobs(config_name, self._jobs)
        subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
        if subdir not in JOB_NUM_SUBDIRS:
            self._jobs = None  # the directories are not named by job number: list only those found
        self._pending = Path(str(config.hydra.sweep.dir))
        atexit.register(self._write_pending)  # a job that exits (code 1 or 2) skips on_multirun_end

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """A job that failed at run time: recorded and said now; under `sweep.on_failure=stop` the sweep
        ends here (exit 1; the summary is written on the way out)."""
        from hydra.core.utils import JobStatus

        if self._pending is None or getattr(job_return, "status", None) != JobStatus.FAILED:
            return
        err = getattr(job_return, "_return_value", None)
        lines = [s for s in str(err).strip().splitlines() if s.strip()] or [type(err).__name__]
        reason = lines[-1].strip()[:300]
        from ntp_nemo.errors import JobFailed

        if not isinstance(err, JobFailed):
            reason = f"{type(err).__name__}: {reason}"
        run_dir = Path(str(job_return.hydra_cfg.hydra.runtime.output_dir))
        try:
            job = str(run_dir.relative_to(self._pending))
        except ValueError:
            job = run_dir.name
        self._failed[job] = (f"failed (exit {getattr(err, 'code', 1)}): {reason}", str(run_dir))
        print(f"sweep job {job} failed: {reason} (its run directory: {run_dir})", file=sys.stderr, flush=True)
        if self._on_failure == "stop":
            print("the sweep stops here (sweep.on_failure=stop; sweep.on_failure=continue runs the other "
                  "jobs)", file=sys.stderr, flush=True)
            sys.exit(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._pending = Path(str(config.hydra.sweep.dir))
        self._write_pending()

    def _write_pending(self) -> None:
        sweep_dir, self._pending = self._pending, None
        if sweep_dir is None:
            return
        if not sweep_dir.is_dir():
            log.warning("sweep summary skipped: %s does not exist", sweep_dir)
            return
        rows = collect_rows(sweep_dir, self._jobs)
        for row in rows:
            if row.job in self._failed:
                row.status = self._failed[row.job][0]
        md_path, _ = write_summary(sweep_dir, rows)
        table = [line for line in md_path.read_text().splitlines()[4:] if line.startswith("|")]
        print("\n".join(table), flush=True)
        print(f"sweep summary: {md_path}", flush=True)  # once (not also through Hydra's log handler)
        if self._failed:
            print(f"{len(self._failed)} job(s) failed:", file=sys.stderr, flush=True)
            for job, (status, run_dir) in self._failed.items():
                print(f"  job {job}: {status} (run directory {run_dir})", file=sys.stderr, flush=True)
