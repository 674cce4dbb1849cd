"""Config → data: one call that resolves `data.path`, tokenizes if needed, splits and builds the sampler.

`data.path` may be empty (the built-in corpus), a text file, a directory of text files (tokenized
once and cached), or a token file written by `ntp-preprocess` (memory-mapped as is).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ntp_nemo.data.corpus import default_corpus_tokens
from ntp_nemo.data.dataset import TokenDataset, split_train_val
from ntp_nemo.data.sampler import GlobalBatchSampler
from ntp_nemo.data.text_files import cached_text_tokens
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.tokens import TokenFile, max_token_id, open_token_file, sidecar_path
from ntp_nemo.errors import ConfigError

log = logging.getLogger(__name__)

_TOKEN_SUFFIXES = (".bin", ".tokens", ".npy", ".u16", ".u32")


@dataclass
class DataBundle:
    """Everything training needs from the data side."""

    tokenizer_name: str
    vocab_size: int
    train: TokenDataset
    val: TokenDataset
    sampler: GlobalBatchSampler
    source: str = ""
    num_tokens: int = 0


def resolve_token_file(path: str | os.PathLike | None, tokenizer: str) -> Path:
    """The token file behind `data.path` (building and caching it for text input).

    A token file keeps whatever tokenizer name its sidecar records; `tokenizer` must name one this
    package can run (`byte`, `bpe`) only when text has to be tokenized.
    """
    if path is None or str(path).strip() == "":
        return default_corpus_tokens(tokenizer)
    p = Path(path).expanduser()
    if p.is_file() and sidecar_path(p).is_file():
        return p
    if p.is_file() and p.suffix in _TOKEN_SUFFIXES:
        raise ConfigError(
            "data.path",
            f"{str(path)!r} looks like a token file but its sidecar {sidecar_path(p).name!r} is missing. "
            f"Write token files with `ntp-preprocess TEXT_FILES --out {p}`, or point data.path at text.",
        )
    return cached_text_tokens(p, build_tokenizer(tokenizer))


def _check_vocab(tf: TokenFile, model_vocab_size: int | None) -> None:
    if model_vocab_size is None:
        return
    top = max_token_id(tf)
    if top >= model_vocab_size or tf.vocab_size > model_vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{model_vocab_size} is too small for the data: tokenizer {tf.tokenizer!r} has "
            f"{tf.vocab_size} ids and the largest id in {str(tf.path)!r} is {top}. Set "
            f"model.vocab_size={tf.vocab_size} (or larger) to match the tokenizer.",
        )


def build_data(
    path: str | None,
    tokenizer: str,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    val_fraction: float = 0.05,
    model_vocab_size: int | None = None,
) -> DataBundle:
    """Build the train/validation datasets and the global sampler from the `data.*` config."""
    if seq_len < 1:
        raise ConfigError("data.seq_len", f"must be >= 1, got {seq_len}. Use e.g. data.seq_len=128.")
    tf = open_token_file(resolve_token_file(path, tokenizer))
    if tf.tokenizer != tokenizer:
        raise ConfigError(
            "data.tokenizer",
            f"{tokenizer!r} does not match the token file {str(tf.path)!r}, which was written with "
            f"tokenizer {tf.tokenizer!r}. Set data.tokenizer={tf.tokenizer}, or re-tokenize the text with "
            f"`ntp-preprocess TEXT_FILES --out {tf.path} --tokenizer {tokenizer}`.",
        )
    _check_vocab(tf, model_vocab_size)
    (t0, t1), (v0, v1) = split_train_val(tf.num_tokens, val_fraction, seq_len)
    train = TokenDataset(tf.tokens, seq_len, t0, t1)
    val = TokenDataset(tf.tokens, seq_len, v0, v1)
    sampler = GlobalBatchSampler(len(train), global_batch_size, seed)
    log.info(
        "data: %s, %d tokens (%s), %d train / %d val samples of %d tokens",
        tf.path, tf.num_tokens, tf.tokenizer, len(train), len(val), seq_len,
    )
    return DataBundle(tf.tokenizer, tf.vocab_size, train, val, sampler, str(tf.path), tf.num_tokens)
