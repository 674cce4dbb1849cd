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


EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_CONFIG = 2


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
