"""Tokenizers: a byte-level one that needs nothing, and a byte-level BPE trained locally.

Both follow one small protocol (`name`, `vocab_size`, `eos_id`, `encode`, `decode`) so the rest of
the data pipeline never asks which one it has. The BPE tokenizer is trained once on the built-in
corpus with the `tokenizers` package and cached; training is deterministic, so every process of a
run (and every run on the same installation) gets the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ntp_nemo.data.cache import atomic_write_text, cache_dir, fingerprint
from ntp_nemo.errors import ConfigError

TOKENIZER_NAMES = ("byte", "bpe")
BPE_VOCAB_SIZE = 4096
BPE_EOS = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-document. Lossless for any text."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > self.eos_id):
            raise ValueError(f"byte tokenizer ids must lie in [0, {self.eos_id}]")
        return arr[arr != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) backed by a `tokenizers.Tokenizer`."""

    name = "bpe"

    def __init__(self, backend) -> None:
        self._backend = backend
        self.vocab_size = int(backend.get_vocab_size())
        eos = backend.token_to_id(BPE_EOS)
        if eos is None:
            raise ValueError(f"BPE tokenizer has no {BPE_EOS} token")
        self.eos_id = int(eos)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._backend.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._backend.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ConfigError(
            "data.tokenizer",
            "'bpe' needs the `tokenizers` package, which is not installed. Install it with "
            "`pip install tokenizers`, or use data.tokenizer=byte.",
        ) from err
    return tokenizers


def bpe_tokenizer_path(vocab_size: int = BPE_VOCAB_SIZE) -> Path:
    from ntp_nemo.data.stdlib_text import DEFAULT_MAX_BYTES, corpus_identity

    key = fingerprint({"corpus": corpus_identity(DEFAULT_MAX_BYTES), "vocab_size": vocab_size, "v": 1})
    return cache_dir("tokenizers") / f"bpe-{vocab_size}-{key}.json"


def train_bpe(documents, vocab_size: int = BPE_VOCAB_SIZE):
    """Train a byte-level BPE `tokenizers.Tokenizer` on an iterable of documents."""
    tk = _import_tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    return backend


def load_bpe(vocab_size: int = BPE_VOCAB_SIZE) -> BPETokenizer:
    """The BPE tokenizer trained on the built-in corpus, training and caching it on first use."""
    tk = _import_tokenizers()
    path = bpe_tokenizer_path(vocab_size)
    if not path.exists():
        from ntp_nemo.data.stdlib_text import DEFAULT_MAX_BYTES, stdlib_documents

        backend = train_bpe(stdlib_documents(DEFAULT_MAX_BYTES), vocab_size)
        atomic_write_text(path, backend.to_str())
    return BPETokenizer(tk.Tokenizer.from_file(str(path)))


def build_tokenizer(name: str) -> ByteTokenizer | BPETokenizer:
    """Tokenizer by config name (`data.tokenizer`): `byte` or `bpe`."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return load_bpe()
    raise ConfigError(
        "data.tokenizer",
        f"unknown tokenizer {name!r}. Choose one of {', '.join(TOKENIZER_NAMES)} "
        "(e.g. data.tokenizer=byte).",
    )
