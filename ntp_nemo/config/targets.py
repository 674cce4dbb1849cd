"""The `_target_` of every configured callback and logger must name an importable object.

`ntp-train` checks them before it prepares any data: a misspelt class answers with exit 2 naming the
key, why it cannot be loaded (`No module named ...`, `module ... has no attribute ...`) and the closest
name that exists, instead of a Hydra instantiation error inside the workers.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from types import ModuleType

from omegaconf import DictConfig

from ntp_nemo.errors import ConfigError

GROUPS = ("callbacks", "logger")  # config groups whose entries are instantiated from `_target_`
# What the LightningModule logs with `self.log` (`lightning/lm_module.py`): the only names a callback's
# `monitor` (EarlyStopping, ModelCheckpoint, ...) can find in `trainer.callback_metrics`.
MONITORABLE = ("train/loss", "train/grad_norm", "val/loss", "step")


def _names_in(module: ModuleType) -> list[str]:
    """Public attributes of `module` and, for a package, its submodules (which need not be imported)."""
    names = [n for n in dir(module) if not n.startswith("_")]
    if hasattr(module, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(module.__path__)]
    return names


def _top_level_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules()] + list(sys.builtin_module_names)


def _suggest(parts: list[str], i: int, candidates: list[str]) -> str:
    """" Did you mean ...?" with `parts[i]` replaced by its closest candidate (nothing when none is close)."""
    match = difflib.get_close_matches(parts[i], candidates, n=1, cutoff=0.6)
    if not match:
        return ""
    return f" Did you mean {'.'.join([*parts[:i], match[0], *parts[i + 1:]])}?"


def locate_problem(target: str) -> str | None:
    """Why `target` ("package.module.Name") cannot be loaded, with a close match; None when it can."""
    parts = target.split(".")
    if not target or any(not p for p in parts):
        return f"{target!r} is not a dotted path such as lightning.pytorch.callbacks.LearningRateMonitor."
    try:
        obj = importlib.import_module(parts[0])
    except ModuleNotFoundError as err:
        if err.name != parts[0]:  # the module exists but imports something that does not
            return f"importing {parts[0]!r} failed: {err}."
        return f"No module named {parts[0]!r}.{_suggest(parts, 0, _top_level_modules())}"
    except Exception as err:  # noqa: BLE001 - a broken user module: its own error, named
        return f"importing {parts[0]!r} failed: {type(err).__name__}: {err}."
    for i, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[:i])
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
            name = f"{prefix}.{part}"
            try:
                obj = importlib.import_module(name)
                continue
            except ModuleNotFoundError as err:
                if err.name != name:
                    return f"importing {name!r} failed: {err}."
            except Exception as err:  # noqa: BLE001
                return f"importing {name!r} failed: {type(err).__name__}: {err}."
        if isinstance(obj, ModuleType):
            hint = _suggest(parts, i, _names_in(obj))
            if hasattr(obj, "__path__") and i < len(parts) - 1:  # a package's missing subpackage
                return f"No module named {prefix + '.' + part!r}.{hint}"
            return f"module {prefix!r} has no attribute {part!r}.{hint}"
        hint = _suggest(parts, i, [n for n in dir(obj) if not n.startswith("_")])
        return f"{type(obj).__name__} {prefix!r} has no attribute {part!r}.{hint}"
    if not callable(obj):
        return f"{target!r} is a {type(obj).__name__}, not a class or function to instantiate."
    return None


def check_targets(cfg: DictConfig) -> None:
    """Every `callbacks.NAME._target_` and `logger.NAME._target_` loads (imports the modules they name)."""
    for group in GROUPS:
        entries = cfg.get(group) or {}
        for name, spec in entries.items():
            if spec is None:
                continue
            key = f"{group}.{name}._target_"
            target = spec.get("_target_") if isinstance(spec, DictConfig) else None
            if target is None:
                raise ConfigError(key, f"{group}.{name} has no _target_: each entry of `{group}` is built "
                                       "with hydra.utils.instantiate and needs the dotted path of its "
                                       f"class, e.g. +{key}=lightning.pytorch.callbacks.LearningRateMonitor;"
                                       f" or drop it with ~{group}.{name}.")
            problem = locate_problem(str(target))
            if problem:
                raise ConfigError(key, f"cannot load {str(target)!r}: {problem} Fix the path "
                                       f"({key}=package.module.Class) or drop the entry with "
                                       f"~{group}.{name}.")
            check_arguments(f"{group}.{name}", str(target), spec)


def _parameters(obj: object) -> tuple[list[str], bool] | None:
    """The keyword names `obj(...)` accepts and whether it takes any (**kwargs); None when unknown."""
    import inspect

    try:
        sig = inspect.signature(obj)  # a class: its __init__ without self
    except (TypeError, ValueError):
        return None
    names = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def check_arguments(where: str, target: str, spec: DictConfig) -> None:
    """Every key of the entry `where` (callbacks.NAME, logger.NAME) is a keyword its `_target_` takes (a
    misspelt one is named with the accepted ones, not Hydra's `unexpected keyword argument` in the
    workers), and a `monitor` names a metric the run logs (else EarlyStopping fails at the first
    validation, after training steps are spent)."""
    from hydra.utils import get_object

    params = _parameters(get_object(target))
    if params is None:
        return
    names, any_keyword = params
    cls = target.rsplit(".", 1)[-1]
    for arg in spec:
        if str(arg).startswith("_") or any_keyword or arg in names:
            continue
        close = difflib.get_close_matches(str(arg), names, n=1, cutoff=0.6)
        hint = f" Did you mean {where}.{close[0]}?" if close else ""
        takes = ", ".join(names) or "no arguments"
        raise ConfigError(f"{where}.{arg}", f"{cls} ({target}) takes no argument {str(arg)!r}.{hint} It "
                                            f"takes: {takes}. Fix the key or drop it with ~{where}.{arg}.")
    monitor = spec.get("monitor") if "monitor" in names else None
    if isinstance(monitor, str) and monitor not in MONITORABLE:
        close = difflib.get_close_matches(monitor, MONITORABLE, n=1, cutoff=0.5)
        hint = f" Did you mean {where}.monitor={close[0]}?" if close else ""
        raise ConfigError(f"{where}.monitor", f"{monitor!r} is never logged by this run, so {cls} would stop "
                                              f"the run at its first check.{hint} The metrics a callback can "
                                              f"monitor: {', '.join(MONITORABLE)}.")
