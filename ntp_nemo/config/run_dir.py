"""The run directory's lifecycle around a command: writable before anything starts, its `.hydra/`
record written only once the config is valid, and nothing left behind by a command that failed.

Hydra would write `.hydra/config.yaml` before the job runs, so a rerun with a bad override would
replace the record of the run already in that directory; `ntp-train` therefore turns Hydra's own
record off (`hydra.output_subdir=null`) and writes the same three files itself, after validation.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import EXIT_CONFIG, ConfigError, report_config_error

if TYPE_CHECKING:
    from ntp_nemo.config.resolve import RunSpec

RECORD_DIR = ".hydra"
LOG_NAMES = ("train.log",)


def writable_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be created or written (None when it can): checks the nearest existing
    ancestor without creating anything."""
    p = Path(path).absolute()
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    if probe == p:
        try:  # access() says yes to root even on a read-only mount: try it
            fd, name = _probe_file(p)
            os.close(fd)
            os.unlink(name)
        except OSError as err:
            return f"{p} is not writable ({err.strerror})"
    return None


def _probe_file(directory: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=".ntp_write_check", dir=directory)


def require_writable(path: Path, key: str) -> None:
    problem = writable_dir_problem(path)
    if problem is not None:
        raise ConfigError(
            key, f"cannot write the run's files to {path}: {problem}. Choose a writable directory."
        )


def check_run_dir_overrides(argv: list[str]) -> list[Path]:
    """Create the directory `hydra.run.dir=` / `hydra.sweep.dir=` names (as Hydra would next) so that one
    that cannot be created is a clear error instead of Hydra's traceback.  Returns the directories it
    created (a command that stops before its job runs removes them again)."""
    created: list[Path] = []
    last: dict[str, str] = {}  # Hydra takes a key's last override: only that directory is created
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and sep:
            last[key] = value
    for key, value in last.items():
        if not value or "${" in value:
            continue
        path = Path(value.strip("'\"")).expanduser()
        if not path.exists():  # the outermost directory that mkdir makes (it may make its parents too)
            top = path
            while not top.parent.exists() and top.parent != top:
                top = top.parent
            created.append(top)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            why = writable_dir_problem(path) or err.strerror or err  # names the blocking path where it can
            raise ConfigError(key, f"{value!r} cannot be created ({why}). Name a directory "
                                   "you can write, e.g. hydra.run.dir=runs/my_run.") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(key, f"{value!r} is not writable. Name a directory you can write, e.g. "
                                   "hydra.run.dir=runs/my_run.")
    return created


def save_record(spec: RunSpec, run_dir: Path) -> str | None:
    """Write `.hydra/{config,hydra,overrides}.yaml` as Hydra does (called once the config is valid), the
    config with its derived values (`spec.record`), and `.hydra/run_spec.json`, the resolved run.

    A record of another config already there (the run directory continued with other settings, e.g.
    a new layout) is kept as `.hydra/previous/N/`; returns a sentence saying so, else None."""
    import json

    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.checkpoint.run_record import RUN_SPEC  # the resolved run's record, as export reads it

    out = Path(run_dir) / RECORD_DIR
    out.mkdir(parents=True, exist_ok=True)
    note = None
    old = out / "config.yaml"
    if old.is_file() and old.read_text() != spec.record:
        n = 1
        while (out / "previous" / str(n)).exists():
            n += 1
        keep = out / "previous" / str(n)
        keep.mkdir(parents=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml", RUN_SPEC):
            if (out / name).is_file():
                shutil.copy2(out / name, keep / name)
        note = (f"this run directory was started with another config; its record is kept in "
                f"{keep.relative_to(run_dir)}/ and .hydra/config.yaml now holds this command's")
    hydra_cfg = HydraConfig.get()
    files = {
        "config.yaml": spec.record,
        "hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
        RUN_SPEC: json.dumps(spec.to_dict(), indent=1) + "\n",
    }
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return note


def remove_if_empty(run_dir: Path, records: bool = False) -> bool:
    """Remove a run directory that holds nothing but this command's log and empty folders (a command
    that failed before doing anything); returns whether it was removed. `records`: the config records
    (`.hydra/`, at any depth: a sweep's jobs) count as nothing too: for a directory this command created
    and then stopped before training (Ctrl-C), whose record describes a run that never ran."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    for p in run_dir.rglob("*"):
        if not p.is_file():
            continue
        log = p.name in LOG_NAMES and (p.parent == run_dir or records)
        record = records and RECORD_DIR in p.relative_to(run_dir).parts[:-1]
        if not (log or record):
            return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


class RunDirCheck(Callback):
    """Hydra callback: the run (or sweep) directory must be writable before Hydra creates it; a bad one
    ends the command with exit code 2 and one line, not a traceback from `mkdir`."""

    def _check(self, config: DictConfig, key: str) -> None:
        try:
            path = OmegaConf.select(config, key)
        except Exception:  # noqa: BLE001 - an interpolation only the job can resolve: Hydra reports it
            return
        if path is None:
            return
        try:
            require_writable(Path(str(path)), key)
        except ConfigError as err:
            report_config_error(err)
            sys.exit(EXIT_CONFIG)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")


class _Tee:
    """A text stream that also appends what it writes to a log file (live terminal updates, which
    carry carriage returns or escape sequences, stay on the terminal)."""

    def __init__(self, stream: Any, log: Any) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        if "\r" not in text and "\x1b[" not in text:
            try:
                self._log.write(text)
            except (OSError, ValueError):
                pass  # the log went away (a removed run directory): the console still works
        return n

    def flush(self) -> None:
        self._stream.flush()
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the console
        return getattr(self._stream, name)


class ConsoleLog:
    """Context manager: while open, stdout and stderr are also appended to `path` (the run's
    train.log, next to the records Hydra's log handler writes there), so the log holds what the
    console showed. Forked workers inherit it."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        self._saved: tuple[Any, Any] | None = None
        self._log: Any = None

    def __enter__(self) -> ConsoleLog:
        if self.enabled and self.path.parent.is_dir():
            self._log = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in __exit__
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = _Tee(sys.stdout, self._log), _Tee(sys.stderr, self._log)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop copying the console to the file (a process that turns out not to be rank 0)."""
        if self._saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = self._saved
            self._log.close()
            self._saved = None


def log_path(run_dir: Path) -> Path:
    """The file Hydra's job logging writes (train.log by default)."""
    import logging

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return Path(run_dir) / "train.log"


def nothing_saved_note(run_dir: Path, ckpt_dir: Path) -> str | None:
    """What `resume=auto` says when it finds no checkpoint in a directory where a run already trained:
    that it starts from step 1, how far the previous run got and why it left nothing to resume from.
    None for a fresh directory."""
    import json

    steps = 0
    try:
        with (run_dir / "metrics.jsonl").open() as f:
            for line in f:
                try:
                    steps = max(steps, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError):
                    continue
    except OSError:
        return None
    if steps == 0:
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if summary is None:
        why = ("it ended without a summary, stopped abruptly (its launching process or the machine was "
               "killed) before any checkpoint")
    elif summary.get("stopped_early") == "launcher lost":
        why = "its launching process was killed; the workers stopped without a checkpoint"
    elif summary.get("stopped_early"):
        why = f"it stopped early ({summary['stopped_early']}) with checkpointing off"
    else:
        why = "it wrote no checkpoint (checkpoint.every_n_steps and checkpoint.save_on_end)"
    return (f"no checkpoint in {ckpt_dir}: starting from step 1. The previous run in this directory reached "
            f"step {steps} and saved none: {why}.")
