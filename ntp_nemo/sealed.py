"""Settings that cannot change once a run is resolved: `Sealable` dataclasses and `seal`.

The config groups' dataclasses (`config/schema.py`, `models/model_config.py`, `quant/qat_config.py`) must stay
mutable for Hydra: an override is merged into them while the config is composed.  `resolve` then seals
the values it hands the run (`RunSpec`): every list becomes a tuple, every dict a `FrozenDict`, and an
assignment to a field of a sealed dataclass raises `dataclasses.FrozenInstanceError`.  A changed copy
is made with `dataclasses.replace`, which builds a new, unsealed value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

_SEALED = "_sealed_"


class Sealable:
    """Base of a mutable dataclass that `seal` can freeze in place."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_SEALED):
            _refuse(self, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get(_SEALED):
            _refuse(self, name)
        object.__delattr__(self, name)


def _refuse(obj: object, name: str) -> NoReturn:
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to {type(obj).__name__}.{name}: the settings of a resolved run are frozen (make a "
        "changed copy with dataclasses.replace)")


class FrozenDict(dict):
    """A dict that refuses every change (a mapping inside a sealed value); pickles as a dict of its class."""

    def _frozen(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the settings of a resolved run are frozen: this mapping cannot change")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen  # type: ignore[assignment]
    __ior__ = _frozen  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (type(self), (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict) -> FrozenDict:
        return self


def frozen(value: Any) -> Any:
    """`value` with every list a tuple, every dict a `FrozenDict` and every dataclass sealed, all the way
    down (dataclasses in place; containers as new values)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return seal(value)
    if isinstance(value, dict):
        return value if _is_frozen_dict(value) else FrozenDict({k: frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, set):
        return frozenset(frozen(v) for v in value)
    return value


def _is_frozen_dict(value: dict) -> bool:
    return isinstance(value, FrozenDict) and all(frozen(v) is v for v in value.values())


def seal(obj: Any) -> Any:
    """Freeze the dataclass instance `obj` in place, all the way down, and return it.  A frozen dataclass
    has its fields frozen too; a mutable one must be `Sealable`."""
    frozen_class = obj.__dataclass_params__.frozen
    if not frozen_class and not isinstance(obj, Sealable):
        raise TypeError(f"{type(obj).__name__} can be neither frozen nor sealed: make it Sealable")
    if obj.__dict__.get(_SEALED):
        return obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sealed = frozen(value)
        if sealed is not value:
            object.__setattr__(obj, f.name, sealed)
    if not frozen_class:
        object.__setattr__(obj, _SEALED, True)
    return obj


def is_sealed(obj: Any) -> bool:
    """Whether the dataclass instance `obj` refuses assignment (frozen or sealed)."""
    return bool(obj.__dataclass_params__.frozen or obj.__dict__.get(_SEALED))


__all__ = ["FrozenDict", "Sealable", "frozen", "is_sealed", "seal"]
