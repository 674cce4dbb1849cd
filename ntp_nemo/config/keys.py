"""Command-line override keys checked against the typed schema, with a "did you mean" suggestion.

Hydra rejects a misspelt key with a bare "Key 'max_step' not in 'TrainerConfig'", and accepts one
added with `+` (`+trainer.max_step=5`) under a typed group, where nothing ever reads it. Both are
caught here, from the arguments alone, before Hydra composes anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence

from ntp_nemo.errors import ConfigError


def _fields(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}


def _dataclass_of(tp: object) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def check_key(key: str, root: type) -> None:
    """Raise ConfigError when `key` (dotted) names no field of a typed group; free-form groups
    (`callbacks`, `logger`, `Any` fields) accept anything."""
    cls: type | None = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        if cls is None:
            return
        fields = _fields(cls)
        if part not in fields:
            where = ".".join(parts[:i])
            close = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            full = ".".join(parts[: i + 1])
            hint = f" Did you mean {'.'.join([*parts[:i], close[0]])}?" if close else ""
            known = ", ".join(sorted(k for k in fields if not k.startswith("_")))
            raise ConfigError(
                full,
                f"no such key in {where or 'the config'} (its keys: {known}).{hint}",
            )
        cls = _dataclass_of(fields[part])


def check_override_keys(args: Sequence[str], root: type | None = None) -> None:
    """Check every `key=value`, `+key=value` and `++key=value` argument of a Hydra command line
    (group choices such as `recipe=NAME` or `model=gpt_tiny` are names of config groups: their key
    is a field too, so they pass)."""
    if root is None:
        from ntp_nemo.config.schema import RootConfig

        root = RootConfig
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if not key or key.startswith("hydra") or "/" in key or "@" in key:
            continue
        check_key(key, root)
