"""`ntp-train`: the command (also `python -m ntp_nemo.train`): `--help`, the early key checks, the Hydra
job, Ctrl-C before training and the exit codes; the training pipeline itself is `ntp_nemo/train.py: train`.

Composition errors (unknown key, bad override) and validation errors exit with code 2 and a
one-paragraph message before any worker starts; runtime failures exit 1.  A run stopped by a preemption
or time-limit signal (SIGTERM, SIGUSR1) before `trainer.max_steps` exits 78 once the checkpoint of the
step it stopped at is saved (1, saying so, when none was); a run that trained to `trainer.max_steps`, or
that a Ctrl-C stopped, exits 0 (`ntp_nemo/train.py: stop_exit`). A second Ctrl-C while the workers run
kills them (the step in progress and its checkpoint are abandoned); summary.json still says where the
run stopped (`stopped_early`: "second Ctrl-C") and the command exits 130 (`EXIT_INTERRUPTED`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ntp_nemo.cli.console import launcher_rank, process_start_time
from ntp_nemo.errors import EXIT_CONFIG, EXIT_RUNTIME, ConfigError, report_config_error
from ntp_nemo.train import in_sweep, train

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Module level imports stay light: `--help` and a misspelt key answer before Hydra is imported, a bad
# value before torch; Lightning is imported once the config is valid, before the workers are forked
# (they inherit it).


@dataclass
class _Job:
    """Whether Hydra started a job (an exit 1 before it is a composition error, exit 2) and when the
    current one began: the first job of the process counts from the process's start (interpreter and
    imports included); a later job of a sweep (`-m`: the jobs run one after another in this process)
    from its own start, so its startup does not include the jobs before it."""

    started: bool = False
    start_t: float = 0.0


def _hydra_entry(cfg: DictConfig, job: _Job) -> float | None:
    """The Hydra job (`main` wraps it in `hydra.main`)."""
    job.start_t = time.time() if job.started else process_start_time()
    job.started = True
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.config.run_dir import ConsoleLog, log_path

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # train.log = what the console shows
    with ConsoleLog(log_path(run_dir), enabled=launcher_rank() == 0) as console:
        try:
            from ntp_nemo.dashboard.launch import dashboard_beside  # dashboard.port: its own process

            with dashboard_beside(cfg.get("dashboard"), run_dir, enabled=launcher_rank() == 0):
                summary = train(cfg, job.start_t, console)
        except SystemExit as exc:
            if exc.code != EXIT_RUNTIME or not in_sweep():
                raise
            from ntp_nemo.errors import JobFailed

            # A sweep's job that could not be recovered: a failed job to Hydra (the sweep's callback
            # records it, says it, and stops or goes on as sweep.on_failure says), not the end of the
            # process.
            raise JobFailed(EXIT_RUNTIME, _last_error(log_path(run_dir))) from None
        except ConfigError as err:
            report_config_error(err)
            _drop_empty_run_dir()
            sys.exit(EXIT_CONFIG)
        except BaseException:
            _drop_empty_run_dir()
            raise
    return summary.get("final_loss")


def _last_error(log: Path) -> str:
    """The last `error: ...` line a job printed (its train.log), for the sweep's report."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return "the job exited 1"
    found = [s.strip() for s in lines if s.strip().startswith("error:")]
    return found[-1].removeprefix("error:").strip() if found else "the job exited 1"


def _drop_empty_run_dir() -> None:
    """A command that failed before writing anything leaves no run directory behind."""
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.config.run_dir import remove_if_empty

    if launcher_rank() == 0:
        remove_if_empty(Path(HydraConfig.get().runtime.output_dir))


def _interrupted(created: list[Path], signum, frame) -> None:  # noqa: ANN001 - signal handler signature
    """Ctrl-C in this process while no worker trains (imports, composition, data, checks, the summary):
    nothing to save, so stop at once. Exiting from the handler (rather than raising KeyboardInterrupt
    inside Hydra's or OmegaConf's code, which turns it into a bogus config error) keeps it clean.
    `created`: the directories this command made (`check_run_dir_overrides`); those holding nothing but
    its log and config record go (no training ran in them), as the job's run directory does when
    nothing was written to it."""
    print("interrupted (Ctrl-C) while no training step runs: nothing to save; stopped", file=sys.stderr,
          flush=True)
    for then in (_drop_empty_run_dir, _say_resume):
        try:
            then()
        except Exception:  # noqa: BLE001 - no Hydra job yet: no run directory to tidy or resume
            pass
    _drop_created(created, records=True)
    os._exit(0)


def _drop_created(created: list[Path], records: bool = False) -> None:
    """Remove the directories in `created` (made by this command) that hold nothing of a run: only its
    log, and with `records` its config records too (a Ctrl-C before training)."""
    from ntp_nemo.config.run_dir import remove_if_empty

    for path in created:  # made for a job that never ran
        remove_if_empty(path, records=records)


def _say_resume() -> None:
    """A Ctrl-C between two attempts of a run that has checkpoints: the command that continues it."""
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.cli.console import resume_command

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if any(p.is_dir() for p in (run_dir / "checkpoints").glob("step_*")):
        print(f"to resume: {resume_command(run_dir)}", file=sys.stderr, flush=True)


def main() -> None:
    import signal

    # The launcher replaces this handler while workers run (they checkpoint); forked workers hold the
    # signal until training starts (`hold_stop_signals`).
    created: list[Path] = []  # the directories the command made before its job began
    signal.signal(signal.SIGINT, functools.partial(_interrupted, created))
    try:
        _main(created)
    except KeyboardInterrupt:  # a Ctrl-C that reached Python code before the handler above
        print("interrupted (Ctrl-C) before training started: nothing to save; stopped", file=sys.stderr,
              flush=True)
        sys.exit(0)


def _main(created: list[Path]) -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from ntp_nemo.config.help import help_text

        print(help_text())
        return
    from ntp_nemo.config.keys import check_override_keys

    try:
        check_override_keys(sys.argv[1:])  # a misspelt or `+`-added typed key: "did you mean" (no Hydra yet)
        from ntp_nemo.config.run_dir import check_run_dir_overrides  # imports Hydra

        # e.g. a read-only place: said here, not in Hydra's traceback
        created += check_run_dir_overrides(sys.argv[1:])
    except ConfigError as err:
        report_config_error(err)
        sys.exit(EXIT_CONFIG)
    import hydra

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    # The .hydra/ record is written by the job once the config is valid (ntp_nemo.config.run_dir).
    if not any(a.startswith("hydra.output_subdir=") for a in sys.argv):
        sys.argv += ["hydra.output_subdir=null"]
    if launcher_rank() != 0:
        # Only global rank 0 keeps the run's .hydra/ record and log file.
        sys.argv += ["hydra/job_logging=disabled"]
    job = _Job()

    def run_job(cfg: DictConfig) -> float | None:
        return _hydra_entry(cfg, job)

    try:
        hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")(run_job)()
    except SystemExit as exc:
        # Hydra exits 1 on composition errors (unknown key, bad override) before the job starts.
        if exc.code == 1 and not job.started:
            _drop_created(created)
            sys.exit(EXIT_CONFIG)
        if exc.code == EXIT_CONFIG and not job.started:  # a sweep refused before its first job
            _drop_created(created)
        raise
    except Exception as exc:  # noqa: BLE001 - last resort: a runtime failure
        print(f"error: training failed: {exc}", file=sys.stderr)
        sys.exit(EXIT_RUNTIME)


if __name__ == "__main__":
    main()
