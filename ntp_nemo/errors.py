"""User-facing errors and the CLI wrapper that turns them into exit code 2.

Every bad input (config value, data path, checkpoint, command-line argument) raises
`ConfigError` with a one-paragraph message naming the key, the value and the fix.
Console scripts wrap their entry function with `cli_main` so the user sees that
paragraph and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration or input; `key` names the offending config key or argument."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def require_extra(module: str, extra: str, key: str, purpose: str, instead: str) -> Any:
    """Import `module`, which only some commands need and the `extra` of the package installs; when it is
    missing, a ConfigError naming `key`, the extra to install and what to do `instead`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(key, f"{purpose} needs `{module}`, which is not installed (the default install "
                               f"leaves it out). Install it with `pip install 'ntp_nemo[{extra}]'`, or "
                               f"{instead}.") from err


EXIT_OK = 0  # trained to trainer.max_steps
EXIT_RUNTIME = 1  # a failure that could not be recovered
EXIT_CONFIG = 2  # bad input: nothing trained
# Stopped by a preemption or time-limit signal (SIGTERM, SIGUSR1) before trainer.max_steps, after saving the
# checkpoint of the step it stopped at: not trained yet, the same command (resume=auto) continues it.
# The live-recovery codes (75, 76, 77) are in resilience/coordinator.py and resilience/cluster_protocol.py.
EXIT_STOPPED = 78
# A second Ctrl-C: the workers were killed mid-step, without a checkpoint of it (summary.json says so); the
# same command continues from the latest checkpoint. 128 + SIGINT, as a shell reports a Ctrl-C'd command.
EXIT_INTERRUPTED = 130


def report_config_error(err: ConfigError) -> None:
    print(f"error: invalid configuration: {err}", file=sys.stderr, flush=True)


def cli_main(fn: Callable[[], Any]) -> Callable[[], None]:
    """Wrap a console-script entry point: ConfigError -> message + exit 2."""

    def wrapper() -> None:
        try:
            rc = fn()
        except ConfigError as err:
            report_config_error(err)
            sys.exit(EXIT_CONFIG)
        sys.exit(rc if isinstance(rc, int) else EXIT_OK)

    wrapper.__name__ = getattr(fn, "__name__", "main")
    wrapper.__doc__ = fn.__doc__
    return wrapper


class JobFailed(RuntimeError):
    """A sweep's training job that ended with a runtime failure (`code`; the message is its error line):
    raised to Hydra so the sweep reports the job failed (`ntp_nemo/sweep.py`) instead of the process
    ending."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
