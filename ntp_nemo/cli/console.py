"""What `ntp-train` prints and reports around a run: the once-per-job console, the end-of-run summary
and the command that resumes a run (kept apart from the entry point's control flow in `train.py`)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_IMPORTED = time.time()  # when /proc does not say when this process started


def launcher_rank() -> int:
    """Global rank given by an external launcher (torchrun: RANK, srun: SLURM_PROCID, or the place
    ntp-coordinator gave an srun task: NTP_PLACE); 0 when we launch."""
    for var in ("NTP_PLACE", "RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def process_start_time() -> float:
    """Wall-clock time this process started (from /proc on Linux: interpreter start-up and imports
    included); elsewhere when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return started if _IMPORTED - 600 < started <= _IMPORTED else _IMPORTED


def say(*args, **kwargs) -> None:
    """Print once per job: under torchrun/SLURM every rank runs this entry point."""
    if launcher_rank() == 0:
        print(*args, **kwargs)


class _StdoutHandler(logging.StreamHandler):
    """Writes to the `sys.stdout` of the moment (a job's console copy to its train.log included)."""

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        self.stream = sys.stdout
        super().emit(record)


def quiet_libraries() -> None:
    """Lightning logs through its own handler; stop Hydra's root handler from printing it twice."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).propagate = False
    # What a callback the user added says when asked to (`EarlyStopping(verbose=True)`: each improvement
    # and why it stopped): on the console, as a plain line (Lightning's own logger has no handler here).
    callbacks = logging.getLogger("lightning.pytorch.callbacks")
    if not callbacks.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        callbacks.addHandler(handler)
        callbacks.setLevel(logging.INFO)
        callbacks.propagate = False
    # "Terminating process N via signal SIGTERM": torch stopping the other workers after one failed;
    # the supervisor reports the failure and what it does about it.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # "Initializing distributed: GLOBAL_RANK: N, ...": Lightning's per-process line as each joins the
    # process group. Under torchrun every rank but 0 runs without Hydra's logging, so Lightning's own
    # handler printed it once per rank; the layout table already says which ranks there are.
    logging.getLogger("lightning.fabric.utilities.distributed").setLevel(logging.WARNING)
    # modelopt checks the installed transformers version on import; ntp_nemo uses none of its HF paths.
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of model")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
    # Batches are a function of (seed, step): the step restored from the checkpoint resumes the data exactly.
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")


def invocation_stats(run_dir: Path, since: float) -> dict:
    """Steps, losses and tokens/s of this command's steps in metrics.jsonl (all its attempts)."""
    recs = [rec for rec in _records(run_dir / "metrics.jsonl") if rec.get("time", 0) >= since]
    if not recs:
        return {}
    steady = recs[1:] or recs  # the first step carries one-time warm-up work
    secs = sum(r["step_time_s"] for r in steady)
    layouts: list[str] = []  # the layouts trained on, in order (consecutive repeats merged)
    for r in recs:
        if r.get("layout") and (not layouts or layouts[-1] != r["layout"]):
            layouts.append(r["layout"])
    return {
        "steps_this_run": len(recs),
        "layouts": layouts,
        "first_step_start": recs[0]["time"] - recs[0]["step_time_s"],
        "last_step_end": recs[-1]["time"],
        "first_loss": recs[0]["loss"],
        "final_loss": recs[-1]["loss"],
        "tokens_per_s": sum(r["tokens"] for r in steady) / secs if secs > 0 else None,
    }


def job_started_at(run_dir: Path) -> float | None:
    """When the run's current job started: its last `job_start` event in goodput.jsonl (a process that
    rejoins a running job records none), or None without one."""
    started = None
    for rec in _records(run_dir / "goodput.jsonl"):
        t = rec.get("t")
        if rec.get("event") == "job_start" and isinstance(t, (int, float)):
            started = float(t)
    return started


def _records(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, in order (none when it is missing; a line cut short by a crash,
    or one that is not an object, is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _percent(x: float | None) -> float | None:
    return None if x is None else 100 * x


def logger_dirs(loggers: Sequence[Mapping[str, Any]]) -> list[str]:
    """The run-directory folders the configured loggers write (`logs/` for CSV, `tb/` for TensorBoard);
    `loggers`: the run's logger specs (`RunSpec.loggers`)."""
    return [f"{lg['name']}/" for lg in loggers if lg is not None and lg.get("name")]


def stop_checkpoint_note(summary: dict, checkpoint_dir: Path) -> str:
    """What a run that stopped early left to resume from: "checkpoint saved" only when the checkpoint
    of the step it stopped at exists (a stop because the coordinator, the store or the launcher is gone
    saves none)."""
    step = summary.get("steps")
    if step is not None and (Path(checkpoint_dir) / f"step_{int(step):06d}").is_dir():
        return f"checkpoint saved (step_{int(step):06d})"
    # `step_NNNNNN` only: not one being written, nor one a later save set aside (`step_NNNNNN.unreadable`)
    saved = sorted(p.name for p in Path(checkpoint_dir).glob("step_*")
                   if p.is_dir() and re.fullmatch(r"step_\d+", p.name))
    return (f"without a checkpoint (a rerun resumes from the latest, {saved[-1]})" if saved
            else "without a checkpoint (none was saved: a rerun starts over)")


def print_summary(summary: dict, run_dir: Path, log_dirs: list[str] | None = None,
                  checkpoint_dir: Path | None = None) -> None:
    outputs = ", ".join(["metrics.jsonl", "goodput.jsonl", "checkpoints/", *(log_dirs or [])])

    def fmt(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "",
        "──────────────── ntp_nemo run summary ────────────────",
        f" layout        {summary.get('layout')}",
        f" steps         {summary.get('steps')} ({summary.get('steps_this_run')} in this run)",
        f" loss          first {fmt(summary.get('first_loss'))} → final {fmt(summary.get('final_loss'))}",
        f" val loss      {fmt(summary.get('val_loss'))}",
        f" tokens/s      {fmt(summary.get('tokens_per_s'), '.0f')}",
        f" goodput       {fmt(_percent(summary.get('goodput')), '.1f')}%",
        f" wall time     {fmt(summary.get('wall_s'), '.1f')} s",
        *(
            [f" startup       {summary['startup_s']:.1f} s from the command to the first step"]
            if summary.get("startup_s") is not None
            else []
        ),
        *(
            [
                f" failover      {summary['failover']['failures']} failure(s)"
                + "".join(f"; recovered {_mode(r)}in {r['recovery_s']:.2f} s"
                          for r in summary["failover"].get("recoveries", []))
                + "; layouts " + " -> ".join(summary["failover"]["layouts"])
            ]
            if summary.get("failover")
            else []
        ),
        *(
            [f" stopped       at step {summary.get('steps')} of {summary.get('max_steps')} by "
             f"{summary['stop_reason']}"]
            if summary.get("stop_reason")
            else []
        ),
        *(
            [
                f" stopped early at step {summary.get('steps')} of {summary.get('max_steps')} "
                f"({'Ctrl-C' if summary['stopped_early'] == 'SIGINT' else summary['stopped_early']}); "
                + stop_checkpoint_note(summary, run_dir / "checkpoints" if checkpoint_dir is None
                                       else checkpoint_dir),
                f" to resume     {resume_command(run_dir)}",
            ]
            if summary.get("stopped_early")
            else []
        ),
        f" outputs       {run_dir} ({outputs})",
        "──────────────────────────────────────────────────────",
    ]
    say("\n".join(lines), flush=True)


def _mode(recovery: dict) -> str:
    """`live ` or `restart ` (with its space) of a recovery; nothing where the record does not say (a
    relaunch of the whole command after its launcher died: the goodput calculator's `-`)."""
    mode = str(recovery.get("mode") or "-")
    return "" if mode == "-" else f"{mode} "


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its own overrides, in its run directory (resume=auto)."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra job (called from Python)
        overrides = []
    keep = [o for o in overrides if not o.startswith(("hydra.run.dir=", "resume=", "trainer.stop_at_step="))]
    return " ".join(["ntp-train", *map(shlex.quote, keep), shlex.quote(f"hydra.run.dir={run_dir}")])
