"""The data keys before launch: `data.tokenizer` and `model.vocab_size` chosen from the tokenizer
(`ntp_nemo.data.vocabulary.choose_vocabulary` decides; this module reads the keys and returns the values,
`config/resolve.py` sets them in the run's config).

`model.vocab_size` given on the command line is explicit: it is kept, and is an error when smaller than
the tokenizer's vocabulary. Values in model config files are the vocabulary the architecture was
published with (used by tools that have no data, e.g. the planner) and are replaced by the tokenizer's.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError


def explicit_keys(overrides: Sequence[str]) -> set[str]:
    """Config keys set by command-line overrides (`key=value`, `+key=`, `++key=`)."""
    keys = set()
    for item in overrides:
        if "=" in item:
            keys.add(item.split("=", 1)[0].lstrip("+~"))
    return keys


def _init_from(cfg: DictConfig) -> str | None:
    if OmegaConf.is_missing(cfg.model, "init_from"):
        return None
    value = cfg.model.get("init_from")
    return None if value in (None, "") else str(value)


def _blend_paths(d: DictConfig) -> list[str]:
    try:
        return [str(p) for _, p in d.blend]
    except (TypeError, ValueError) as err:
        raise ConfigError("data.blend", "must be a list of [weight, path] pairs, e.g. data.blend="
                                        f"[[0.7,a.bin],[0.3,b.bin]]; got {d.blend!r}.") from err


def resolve_data_config(cfg: DictConfig, explicit: set[str] | None = None) -> dict:
    """`data.tokenizer` and `model.vocab_size` chosen (see the module doc): returns them (`tokenizer`,
    `vocab_size`) with where the tokenizer came from and its own size; `cfg` is not changed."""
    from ntp_nemo.data.vocabulary import check_paths, choose_vocabulary

    explicit = explicit or set()
    d = cfg.data
    blend = _blend_paths(d) if d.get("blend") else []
    val_path = str(d.val_path) if d.get("val_path") not in (None, "") else None
    check_paths(blend, val_path)
    sources = blend or ([str(d.path)] if d.get("path") not in (None, "") else [])
    multiple = int(d.get("vocab_multiple") or 1)
    choice = choose_vocabulary(d.get("tokenizer"), sources, _init_from(cfg), multiple, int(cfg.mesh.tp),
                               d.get("eos_token"))
    if "model.vocab_size" in explicit:
        choice.check_given(cfg.model.vocab_size)
    vocab_size = int(cfg.model.vocab_size) if "model.vocab_size" in explicit else int(choice.rows)
    return {"tokenizer": choice.tokenizer, "tokenizer_from": choice.origin,
            "tokenizer_vocab": choice.tokenizer_vocab, "vocab_size": vocab_size}
