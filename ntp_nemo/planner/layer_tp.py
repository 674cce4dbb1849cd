"""Per-layer TP degrees (`layout.layer_tp`): the pattern syntax, the validity rules, effective degrees.

A layout has one degree per item: embedding, each transformer layer, output head
(length num_layers + 2). Rules:
- every degree t satisfies 1 <= t <= tp and t divides tp;
- t may not exceed the units it shards (attention heads and FFN columns for a layer, vocabulary
  rows for embedding and head);
- with tied embeddings, embedding and head share one weight and so one degree;
- in a replica shrunk to n ranks an item runs at its *effective* degree: t if t divides n,
  else the largest divisor of n not above t.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ntp_nemo.errors import ConfigError
from ntp_nemo.planner.cost import item_kinds, item_names, units_of
from ntp_nemo.planner.shapes import ModelShape
from ntp_nemo.topology.topology import effective_degree  # noqa: F401  (re-exported)

KEY = "layout.layer_tp"
_RUN = re.compile(r"^\s*(\d+)\s*(?:\*\s*(\d+))?\s*$")
_NAMED = {"emb": "emb", "embedding": "emb", "layers": "layers", "layer": "layers", "head": "head"}


@lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def parse_layer_tp(spec: str | int | Sequence[int] | None, num_layers: int, tp: int) -> list[int]:
    """Expand a layer_tp spec into one degree per item (num_layers + 2 entries).

    Accepted: None (all `tp`), an int or "4" (all 4), "emb=2,layers=4,head=2" (omitted parts
    take `tp`), run-length "2,4*6,2", a list of ints (also "[2,4,2]").
    """
    n_items = num_layers + 2
    if spec is None:
        return [tp] * n_items
    if isinstance(spec, bool):
        raise ConfigError(KEY, f"expected degrees, got {spec!r}; write e.g. layout.layer_tp={tp}.")
    if isinstance(spec, int):
        degrees = [spec] * n_items
    elif isinstance(spec, str):
        degrees = _parse_string(spec.strip(), num_layers, tp)
    else:
        degrees = [_as_int(v) for v in spec]
    if len(degrees) != n_items:
        raise ConfigError(
            KEY,
            f"{spec!r} gives {len(degrees)} degrees but the model needs {n_items} "
            f"(embedding, {num_layers} layers, head); e.g. '{tp},{tp}*{num_layers},{tp}'.",
        )
    for i, t in enumerate(degrees):
        _check_degree(t, tp, f"item {i}")
    return degrees


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        raise ConfigError(KEY, f"degree {value!r} is not an integer; use positive integers dividing mesh.tp.")
    return value


def _parse_string(spec: str, num_layers: int, tp: int) -> list[int]:
    if spec == "auto":
        raise ConfigError(
            KEY, "'auto' is resolved by the planner (ntp_nemo.planner.plan_layout), not parsed."
        )
    body = spec[1:-1] if spec.startswith("[") and spec.endswith("]") else spec
    parts = [p for p in body.split(",") if p.strip()]
    if not parts:
        raise ConfigError(KEY, f"empty spec {spec!r}; write e.g. '{tp}' or 'emb=2,layers={tp},head=2'.")
    if any("=" in p for p in parts):
        named = {"emb": tp, "layers": tp, "head": tp}
        for part in parts:
            name, _, value = part.partition("=")
            canon = _NAMED.get(name.strip())
            if canon is None or not value.strip():
                raise ConfigError(KEY, f"bad part {part!r} in {spec!r}; use emb=T, layers=T and head=T.")
            named[canon] = _as_int(value.strip())
        return [named["emb"]] + [named["layers"]] * num_layers + [named["head"]]
    if len(parts) == 1 and "*" not in parts[0]:
        return [_as_int(parts[0].strip())] * (num_layers + 2)
    degrees: list[int] = []
    for part in parts:
        match = _RUN.match(part)
        if match is None:
            raise ConfigError(
                KEY, f"bad part {part!r} in {spec!r}; use DEGREE or DEGREE*COUNT, e.g. '2,4*6,2'."
            )
        degrees += [int(match.group(1))] * int(match.group(2) or 1)
    return degrees


def _check_degree(t: int, tp: int, where: str) -> None:
    if t < 1 or t > tp or tp % t:
        raise ConfigError(
            KEY,
            f"{where} has degree {t}, but degrees must be divisors of mesh.tp={tp} ({list(divisors(tp))}).",
        )


def validate_layer_tp(model: ModelShape, tp: int, replica_tp: Sequence[int], layer_tp: Sequence[int]) -> None:
    """Raise ConfigError unless `layer_tp` is a runnable layout for `model` on these replicas."""
    n_items = model.num_layers + 2
    if len(layer_tp) != n_items:
        raise ConfigError(
            KEY, f"has {len(layer_tp)} entries; the model needs {n_items} (embedding, layers, head)."
        )
    for n in replica_tp:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= tp:
            raise ConfigError(
                "ntp.replica_tp",
                f"entry {n!r} must be an integer in [1, mesh.tp={tp}] (active ranks of a replica).",
            )
    for name, kind, raw in zip(item_names(model), item_kinds(model), layer_tp, strict=True):
        t = _as_int(raw)
        _check_degree(t, tp, name)
        units = units_of(model, kind)
        if t > units:
            what = "attention heads/FFN columns" if kind == "layer" else "vocabulary rows"
            raise ConfigError(
                KEY, f"{name} has degree {t} but only {units} {what} to shard; use at most {units}."
            )
    if model.tie_embeddings and layer_tp[0] != layer_tp[-1]:
        raise ConfigError(
            KEY,
            f"the embedding (degree {layer_tp[0]}) and the output head (degree {layer_tp[-1]}) share their "
            "weights (model.tie_embeddings=true), so they need the same degree; make the first and last "
            "entries equal or set model.tie_embeddings=false.",
        )
