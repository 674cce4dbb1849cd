"""Before launch: choose the run's tokenizer and size the model's vocabulary from it.

- No tokenizer asked for: the tokenizer of the `init_from` model when its directory holds a
  `tokenizer.json`, else the token files' own (the byte tokenizer for text and the built-in corpus).
- The model's vocabulary is the tokenizer's (at least the `init_from` model's), rounded up to a
  multiple of `vocab_multiple` and to at least the largest TP degree's rows. Vocabulary rows are the
  units the embedding and the output head are sharded by; shards may be uneven here, so what every TP
  degree of a layout needs is one row per rank. GPU recipes set `data.vocab_multiple=128` (GPT-2's
  50257 ids become 50304 rows).

Plain values in, plain values out: the config layer (`ntp_nemo.config.data_keys`) reads the keys and
applies the choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ntp_nemo.data.bounded_json import read_json
from ntp_nemo.data.tokenizer import tokenizer_identity, tokenizer_json_of
from ntp_nemo.data.tokens import read_sidecar
from ntp_nemo.errors import ConfigError

BYTE_VOCAB = 257


def padded_vocab(vocab: int, multiple: int, max_tp: int) -> int:
    """`vocab` rounded up to a multiple of `multiple`, and to at least one row per rank of `max_tp`."""
    return max(math.ceil(vocab / multiple) * multiple, max_tp)


def _hf_vocab(init_from: str | None) -> int | None:
    if init_from is None:
        return None
    try:
        return int(read_json(Path(init_from).expanduser() / "config.json", 16 << 20)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None  # the model.init_from checks explain what is wrong with the directory


def check_paths(blend: Sequence[str], val_path: str | None) -> None:
    """The blend's token files and the validation file exist."""
    for key, paths in (("data.blend", list(blend)), ("data.val_path", [val_path] if val_path else [])):
        for p in paths:
            if not Path(p).expanduser().exists():
                raise ConfigError(key, f"{p!r} does not exist. Name token files written by ntp-preprocess "
                                       "(or text / .jsonl files or directories of them).")


@dataclass(frozen=True)
class Vocabulary:
    """The run's tokenizer and the model's vocabulary rows."""

    tokenizer: str  # what the data module loads (a name, a path, or "byte")
    origin: str  # the key it came from: data.tokenizer or model.init_from
    tokenizer_vocab: int  # ids the tokenizer produces
    hf_vocab: int | None  # the init_from model's vocabulary
    tokenizer_name: str | None
    rows: int  # vocabulary rows: the larger of the two, padded

    @property
    def natural(self) -> int:
        return max(self.tokenizer_vocab, self.hf_vocab or 0)

    def check_given(self, given: int | None) -> None:
        """A `model.vocab_size` given on the command line must hold every id."""
        if given is None or int(given) < self.natural:
            what = (f"the tokenizer ({self.tokenizer_name or 'of the data'}) has {self.tokenizer_vocab} ids"
                    + (f" and the model.init_from model {self.hf_vocab}" if self.hf_vocab else ""))
            raise ConfigError(
                "model.vocab_size",
                f"{given} does not fit the vocabulary: {what}. Leave model.vocab_size unset (it follows "
                f"the tokenizer: {self.rows} rows here) or set at least model.vocab_size={self.natural}.",
            )


def choose_vocabulary(tokenizer: str | None, sources: Sequence[str], init_from: str | None,
                      multiple: int, max_tp: int, eos_token: str | None = None) -> Vocabulary:
    """The tokenizer (`tokenizer`, else `init_from`'s, else the token files' own) and the rows of the
    model's vocabulary (see the module doc).  `sources`: the training token files; `eos_token`: the
    end-of-document token (`data.eos_token`, part of the tokenizer's identity)."""
    if multiple < 1:
        raise ConfigError("data.vocab_multiple", f"must be >= 1, got {multiple}. Use 1 (no padding) or 128.")
    spec, origin = tokenizer, "data.tokenizer"
    if spec in (None, "") and init_from is not None and tokenizer_json_of(init_from) is not None:
        spec, origin = str(Path(init_from).expanduser().resolve()), "model.init_from"
    ident = tokenizer_identity(spec, eos_token)
    vocab = None if ident is None else ident.get("vocab_size")
    if vocab is None:  # the token files' own tokenizer (or the byte tokenizer for text)
        metas = [read_sidecar(Path(p).expanduser()) for p in sources]
        # A sidecar's vocab_size that is not a whole number (`Infinity`, a string) counts as none here:
        # opening the token file then names the file and what is wrong with its sidecar.
        vocab = max((m["vocab_size"] for m in metas if m and type(m.get("vocab_size")) is int), default=None)
        if vocab is None:
            spec, vocab = "byte", BYTE_VOCAB  # text or the built-in corpus: tokenized with bytes
    hf_vocab = _hf_vocab(init_from)
    rows = padded_vocab(max(vocab, hf_vocab or 0), multiple, max_tp)
    return Vocabulary(spec, origin, int(vocab), hf_vocab, ident["name"] if ident else None, rows)
