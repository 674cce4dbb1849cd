"""`ntp.pattern`: the sharding pattern of every layout slot (`row_column`, today's Megatron TP, or `block`,
SUMMA on a q x q grid: `ntp_nemo.parallel.block`), checked before anything is launched.  Imports nothing
heavy."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ntp_nemo.errors import ConfigError

PATTERNS = ("row_column", "block")


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)


def slot_patterns(cfg: Any) -> tuple[str, ...]:
    """Per-slot patterns (embedding, each layer, head) of `ntp.pattern`: one name for every slot or a list
    of one per slot.  A ConfigError names a value that is neither."""
    value = _get(_get(cfg, "ntp"), "pattern", "row_column")
    slots = int(cfg.model.num_layers) + 2
    names = [value] * slots if isinstance(value, str) else list(value) if value is not None else []
    bad = [p for p in names if p not in PATTERNS]
    if bad or len(names) != slots:
        raise ConfigError("ntp.pattern", f"{value!r} is not a sharding pattern: use row_column (Megatron "
                          "rows and columns, the default), block (SUMMA on a q x q grid: mesh.tp=4 is 2x2, "
                          f"9 is 3x3), or a list of one of them per layout slot ({slots}: the embedding, "
                          f"each of the {slots - 2} layers, the head), e.g. ntp.pattern=block.")
    return tuple(str(p) for p in names)


# Options a block-sharded slot does not run with yet: (key, value it must keep, what to write instead).
_NOT_WITH_BLOCK = (
    ("mesh.pp", 1, "mesh.pp=1 (pipeline sends carry whole activations, not grid blocks)"),
    ("ntp.sequence_parallel", False, "ntp.sequence_parallel=false (the grid already splits the tokens)"),
    ("model.dropout", 0.0, "model.dropout=0"),
    ("optim.distributed", False, "optim.distributed=false"),
    ("model.init_from", None, "no model.init_from (Hugging Face weights load as row/column slices)"),
)


def validate_pattern(cfg: Any, resolve_layer_tp: Callable[[Any], list[int]]) -> tuple[str, ...]:
    """The per-slot patterns, checked against the per-slot degrees (`resolve_layer_tp(cfg)`, asked only
    when some slot is block-sharded): a block slot needs
    a square degree q*q > 1, micro-batches of at least q sequences (split along the grid's rows) and none
    of the options it does not support.  Returns the patterns."""
    patterns = slot_patterns(cfg)
    block = [s for s, p in enumerate(patterns) if p == "block"]
    if not block:
        return patterns
    layer_tp = resolve_layer_tp(cfg)
    for s in block:
        t = int(layer_tp[s])
        q = math.isqrt(t)
        if q < 2 or q * q != t:
            near = ", ".join(str(x * x) for x in range(max(2, q), q + 2))
            raise ConfigError("ntp.pattern", f"block sharding runs on a square q x q grid, but layout slot "
                              f"{s} has degree {t} (mesh.tp={cfg.mesh.tp}, layout.layer_tp): use a square "
                              f"degree such as {near} (mesh.tp=4 is a 2x2 grid, 9 a 3x3 one), or "
                              "ntp.pattern=row_column.")
    q = math.isqrt(max(int(layer_tp[s]) for s in block))
    mb = int(cfg.data.micro_batch_size)
    if mb < q:
        raise ConfigError("data.micro_batch_size", f"data.micro_batch_size={mb} is below the grid side {q}: "
                          "block sharding splits each micro-batch's sequences along the grid's rows, so "
                          f"every row needs one; use data.micro_batch_size>={q} or ntp.pattern=row_column.")
    for key, keep, instead in _NOT_WITH_BLOCK:
        section, name = key.split(".")
        value = _get(_get(cfg, section), name, keep)
        if value != keep and not (keep is None and value in (None, "")):
            raise ConfigError(key, f"{key}={value!r} does not run with ntp.pattern=block yet; use {instead}, "
                              "or ntp.pattern=row_column.")
    quant = _get(_get(cfg, "quant"), "format", "none")
    if quant not in (None, "none"):
        raise ConfigError("quant", f"quantisation-aware training (quant={quant}) does not run with "
                          "ntp.pattern=block yet; use quant=none or ntp.pattern=row_column.")
    return patterns
