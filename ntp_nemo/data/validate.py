"""Before launch: choose the run's tokenizer and size the model's vocabulary from it.

- `data.tokenizer` empty: the tokenizer of `model.init_from` when that directory holds a
  `tokenizer.json`, else the token files' own (the byte tokenizer for text and the built-in corpus).
- The model's vocabulary is the tokenizer's (at least the `init_from` model's), rounded up to a
  multiple of `data.vocab_multiple` and to at least `mesh.tp` rows. Vocabulary rows are the units
  the embedding and the output head are sharded by; shards may be uneven here, so what every TP
  degree of a layout needs is one row per rank, and `mesh.tp` is the largest degree. GPU recipes
  set `data.vocab_multiple=128` (GPT-2's 50257 ids become 50304 rows).
- `model.vocab_size` given on the command line is explicit: it is kept, and is an error when
  smaller than the tokenizer's vocabulary. Values in model config files are the vocabulary the
  architecture was published with (used by tools that have no data, e.g. the planner) and are
  replaced by the tokenizer's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ntp_nemo.data.tokenizer import tokenizer_identity, tokenizer_json_of
from ntp_nemo.data.tokens import read_sidecar
from ntp_nemo.errors import ConfigError

BYTE_VOCAB = 257


def explicit_keys(overrides: Sequence[str]) -> set[str]:
    """Config keys set by command-line overrides (`key=value`, `+key=`, `++key=`)."""
    keys = set()
    for item in overrides:
        if "=" in item:
            keys.add(item.split("=", 1)[0].lstrip("+~"))
    return keys


def padded_vocab(vocab: int, multiple: int, max_tp: int) -> int:
    """`vocab` rounded up to a multiple of `multiple`, and to at least one row per rank of `max_tp`."""
    return max(math.ceil(vocab / multiple) * multiple, max_tp)


def _init_from(cfg: DictConfig) -> str | None:
    if OmegaConf.is_missing(cfg.model, "init_from"):
        return None
    value = cfg.model.get("init_from")
    return None if value in (None, "") else str(value)


def _hf_vocab(init_from: str | None) -> int | None:
    if init_from is None:
        return None
    try:
        return int(json.loads((Path(init_from).expanduser() / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the model.init_from checks explain what is wrong with the directory


def _sources(d: DictConfig) -> list[str]:
    if d.get("blend"):
        try:
            return [str(p) for _, p in d.blend]
        except (TypeError, ValueError) as err:
            raise ConfigError("data.blend", "must be a list of [weight, path] pairs, e.g. data.blend="
                                            f"[[0.7,a.bin],[0.3,b.bin]]; got {d.blend!r}.") from err
    return [str(d.path)] if d.get("path") not in (None, "") else []


def _check_paths(d: DictConfig) -> None:
    for key, paths in (("data.blend", _sources(d) if d.get("blend") else []),
                       ("data.val_path", [str(d.val_path)] if d.get("val_path") not in (None, "") else [])):
        for p in paths:
            if not Path(p).expanduser().exists():
                raise ConfigError(key, f"{p!r} does not exist. Name token files written by ntp-preprocess "
                                       "(or text / .jsonl files or directories of them).")


def resolve_data_config(cfg: DictConfig, explicit: set[str] | None = None) -> dict:
    """Fill in `data.tokenizer` and `model.vocab_size` (see the module doc); returns what was chosen."""
    explicit = explicit or set()
    d = cfg.data
    multiple = int(d.get("vocab_multiple") or 1)
    if multiple < 1:
        raise ConfigError("data.vocab_multiple", f"must be >= 1, got {multiple}. Use 1 (no padding) or 128.")
    _check_paths(d)
    init_from = _init_from(cfg)
    spec = d.get("tokenizer")
    origin = "data.tokenizer"
    if spec in (None, "") and init_from is not None and tokenizer_json_of(init_from) is not None:
        spec, origin = str(Path(init_from).expanduser().resolve()), "model.init_from"
    ident = tokenizer_identity(spec, d.get("eos_token"))
    vocab = None if ident is None else ident.get("vocab_size")
    if vocab is None:  # the token files' own tokenizer (or the byte tokenizer for text)
        metas = [read_sidecar(Path(p).expanduser()) for p in _sources(d)]
        vocab = max((int(m["vocab_size"]) for m in metas if m), default=None)
        if vocab is None:
            spec, vocab = "byte", BYTE_VOCAB  # text or the built-in corpus: tokenized with bytes
    hf_vocab = _hf_vocab(init_from)
    natural = max(vocab, hf_vocab or 0)
    rows = padded_vocab(natural, multiple, int(cfg.mesh.tp))
    with open_dict(cfg):
        cfg.data.tokenizer = spec
        if "model.vocab_size" in explicit:
            given = cfg.model.vocab_size
            if given is None or int(given) < natural:
                what = (f"the tokenizer ({ident['name'] if ident else 'of the data'}) has {vocab} ids"
                        + (f" and the model.init_from model {hf_vocab}" if hf_vocab else ""))
                raise ConfigError(
                    "model.vocab_size",
                    f"{given} does not fit the vocabulary: {what}. Leave model.vocab_size unset (it follows "
                    f"the tokenizer: {rows} rows here) or set at least model.vocab_size={natural}.",
                )
        else:
            cfg.model.vocab_size = rows
    return {"tokenizer": spec, "tokenizer_from": origin, "tokenizer_vocab": vocab,
            "vocab_size": int(cfg.model.vocab_size)}
