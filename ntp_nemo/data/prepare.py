"""Config → data: one call that resolves the data sources, tokenizes if needed, splits and builds the sampler.

`data.path` may be empty (the built-in corpus), a text / .jsonl / .parquet file or a directory of them
(tokenized once and cached), or a token file written by `ntp-preprocess` (memory-mapped as is).
`data.blend=[[w, path], ...]` draws from several such sources in proportion to the weights. The
validation set is the last `data.val_fraction` of each source's documents, or `data.val_path`.

`data.tokenizer` may be left empty: the run then uses the token files' own tokenizer (the byte
tokenizer for text and the built-in corpus). When it is set, every token file must have been
written with it (same tokenizer hash).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ntp_nemo.data.blend import BlendedDataset
from ntp_nemo.data.corpus import default_corpus_tokens
from ntp_nemo.data.dataset import TokenDataset, num_windows, split_train_val
from ntp_nemo.data.sampler import GlobalBatchSampler
from ntp_nemo.data.text_files import cached_text_tokens
from ntp_nemo.data.tokenizer import (  # noqa: F401  (tokenizer_identity re-exported)
    TOKENIZER_NAMES,
    build_tokenizer,
    looks_like_path,
    tokenizer_identity,
    tokenizer_json_of,
)
from ntp_nemo.data.tokens import TokenFile, max_token_id, open_token_file, sidecar_path
from ntp_nemo.errors import ConfigError

log = logging.getLogger(__name__)

_TOKEN_SUFFIXES = (".bin", ".tokens", ".npy", ".u16", ".u32")


@dataclass
class DataBundle:
    """Everything training needs from the data side."""

    tokenizer_name: str
    vocab_size: int
    train: TokenDataset | BlendedDataset
    val: TokenDataset | BlendedDataset
    sampler: GlobalBatchSampler
    source: str = ""
    num_tokens: int = 0
    eos_id: int | None = None
    sources: list[str] = field(default_factory=list)


def is_token_file(path: str | os.PathLike | None) -> bool:
    return path not in (None, "") and Path(path).expanduser().is_file() and sidecar_path(
        Path(path).expanduser()).is_file()


def resolve_token_file(
    path: str | os.PathLike | None,
    tokenizer: str | None,
    key: str = "data.path",
    eos_token: str | None = None,
) -> Path:
    """The token file behind `data.path` (building and caching it for text input).

    A token file keeps whatever tokenizer its sidecar records; `tokenizer` must name one this
    package can run only when text has to be tokenized (None: the byte tokenizer).
    """
    spec = tokenizer or "byte"
    if path is None or str(path).strip() == "":
        return default_corpus_tokens(spec, eos_token=eos_token)
    p = Path(path).expanduser()
    if is_token_file(p):
        return p
    if p.is_file() and p.suffix in _TOKEN_SUFFIXES:
        raise ConfigError(
            key,
            f"{str(path)!r} looks like a token file but its sidecar {sidecar_path(p).name!r} is missing "
            "(an unfinished ntp-preprocess run leaves none). Write token files with "
            f"`ntp-preprocess TEXT_FILES --out {p}`, or point {key} at text.",
        )
    if not p.exists():
        raise ConfigError(key, f"{str(path)!r} does not exist. Point {key} at a token file written by "
                               "ntp-preprocess, a text/.jsonl file or a directory of them.")
    return cached_text_tokens(p, spec, eos_token)


def check_tokenizer(tf: TokenFile, want: dict | None, key: str = "data.tokenizer") -> None:
    """Raise unless token file `tf` was written with the tokenizer `want` (by hash when both know it)
    and the same end-of-document id (when both record one)."""
    if want is None:
        return
    same = (tf.tokenizer_hash == want["hash"]) if (tf.tokenizer_hash and want.get("hash")) else (
        tf.tokenizer == want["name"])
    file_eos = (tf.meta or {}).get("eos_id")
    want_eos = want.get("eos_id")
    if same and file_eos is not None and want_eos is not None and int(file_eos) != int(want_eos):
        raise ConfigError(
            "data.eos_token",
            f"the token file {str(tf.path)!r} ends its documents with id {file_eos}, but the run's tokenizer "
            f"{want['name']!r} ends them with id {want['eos_id']} (data.eos_token, or the tokenizer's own). "
            "Set data.eos_token to the token the file was written with (ntp-preprocess --eos-token), or "
            "re-tokenize the text with the end-of-document token you want.",
        )
    if not same:
        spec = (tf.meta or {}).get("tokenizer_identity", {}).get("source") or tf.tokenizer
        raise ConfigError(
            key,
            f"{want['name']!r} (hash {want.get('hash')}) does not match the token file {str(tf.path)!r}, "
            "which was "
            f"written with tokenizer {tf.tokenizer!r} (hash {tf.tokenizer_hash}). Set data.tokenizer={spec} "
            f"(or leave it empty to use the file's), or re-tokenize the text with "
            f"`ntp-preprocess INPUTS --out NEW.bin --tokenizer {want.get('source', want['name'])}`.",
        )


def check_vocab(tf: TokenFile, model_vocab_size: int | None) -> None:
    if model_vocab_size is None:
        return
    top = max_token_id(tf)
    if top >= model_vocab_size or tf.vocab_size > model_vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{model_vocab_size} is too small for the data: tokenizer {tf.tokenizer!r} has "
            f"{tf.vocab_size} ids and the largest id in {str(tf.path)!r} is {top}. Leave model.vocab_size "
            f"unset (it follows the tokenizer) or set model.vocab_size={tf.vocab_size} or larger.",
        )


def _split(tf: TokenFile, val_fraction: float, seq_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Train / validation token ranges: the last `val_fraction` of the documents are held out."""
    ends = tf.doc_ends
    if ends is None or len(ends) < 2:
        return split_train_val(tf.num_tokens, val_fraction, seq_len)  # one document: split its tokens
    split_train_val(tf.num_tokens, val_fraction, 1)  # checks val_fraction
    n_val = min(len(ends) - 1, max(1, round(len(ends) * val_fraction)))
    split = int(ends[len(ends) - n_val - 1])
    if num_windows(split, seq_len) < 1 or num_windows(tf.num_tokens - split, seq_len) < 1:
        return split_train_val(tf.num_tokens, val_fraction, seq_len)  # documents too uneven: split tokens
    return (0, split), (split, tf.num_tokens)


def _blend_entries(blend) -> list[tuple[float, str]]:
    try:
        entries = [(float(w), str(p)) for w, p in blend]
    except (TypeError, ValueError) as err:
        raise ConfigError("data.blend", f"must be a list of [weight, path] pairs, e.g. "
                                        f"data.blend=[[0.7,a.bin],[0.3,b.bin]]; got {blend!r}.") from err
    if not entries or any(not w > 0 for w, _ in entries):
        raise ConfigError("data.blend", f"needs at least one entry and every weight > 0; got {blend!r}. "
                                        "Use e.g. data.blend=[[0.7,a.bin],[0.3,b.bin]].")
    return entries


def build_data(
    path: str | None,
    tokenizer: str | None,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    val_fraction: float = 0.05,
    model_vocab_size: int | None = None,
    *,
    blend: Sequence | None = None,
    val_path: str | None = None,
    eos_token: str | None = None,
) -> DataBundle:
    """Build the train/validation datasets and the global sampler from the `data.*` config."""
    if seq_len < 1:
        raise ConfigError("data.seq_len", f"must be >= 1, got {seq_len}. Use e.g. data.seq_len=128.")
    want = tokenizer_identity(tokenizer, eos_token)
    entries = _blend_entries(blend) if blend else [(1.0, path)]
    if blend and path not in (None, ""):
        raise ConfigError("data.blend", f"is set together with data.path={path!r}; use one of them "
                                        "(a blend names all its files).")
    key = "data.blend" if blend else "data.path"
    files = [open_token_file(resolve_token_file(p, tokenizer, key, eos_token)) for _, p in entries]
    if val_path not in (None, ""):
        val_tf = open_token_file(resolve_token_file(val_path, tokenizer, "data.val_path", eos_token))
    else:
        val_tf = None
    every = files + ([val_tf] if val_tf is not None else [])
    if want is None and eos_token:
        raise ConfigError("data.eos_token", f"is {eos_token!r}, but data.tokenizer is not set, so there is "
                                            "no tokenizer to look the token up in. Set data.tokenizer to the "
                                            "tokenizer the token file was written with, or leave "
                                            "data.eos_token out to keep the file's own.")
    if want is None:  # the files' own tokenizer: they must agree with each other
        first = files[0]
        want = {"name": first.tokenizer, "hash": first.tokenizer_hash,
                "source": (first.meta or {}).get("tokenizer_identity", {}).get("source", first.tokenizer)}
    for tf in every:
        check_tokenizer(tf, want)
        check_vocab(tf, model_vocab_size)
    trains, vals = [], []
    for tf in files:
        if val_tf is None:
            (t0, t1), (v0, v1) = _split(tf, val_fraction, seq_len)
            vals.append(TokenDataset(tf.tokens, seq_len, v0, v1))
        else:
            t0, t1 = 0, tf.num_tokens
        trains.append(TokenDataset(tf.tokens, seq_len, t0, t1))
    if val_tf is not None:
        vals = [TokenDataset(val_tf.tokens, seq_len)]
        if len(vals[0]) < 1:
            raise ConfigError("data.val_path", f"{str(val_tf.path)!r} holds {val_tf.num_tokens} tokens, "
                                               "fewer than "
                                               f"one sample of data.seq_len+1={seq_len + 1}. Give more data.")
    names = [str(tf.path) for tf in files]
    if blend:
        train = BlendedDataset(trains, [w for w, _ in entries], seed, names)
        val = vals[0] if val_tf is not None else BlendedDataset(vals, [w for w, _ in entries], seed, names)
    else:
        train, val = trains[0], vals[0]
    if len(train) < global_batch_size:
        raise ConfigError(
            "data.global_batch_size",
            f"the training data holds {len(train)} samples of data.seq_len+1={seq_len + 1} tokens, fewer "
            "than one "
            f"global batch (data.global_batch_size={global_batch_size}): every step would repeat samples. "
            "Use more data, or lower data.global_batch_size or data.seq_len.",
        )
    sampler = GlobalBatchSampler(len(train), global_batch_size, seed, tag_epochs=bool(blend))
    num_tokens = sum(tf.num_tokens for tf in files)
    # The run's header says the same (ntp-train); the token files are named here, at debug level.
    log.debug("data: %s, %d tokens (%s), %d train / %d val samples of %d tokens",
             ", ".join(names), num_tokens, files[0].tokenizer, len(train), len(val), seq_len)
    eos = (files[0].meta or {}).get("eos_id")
    return DataBundle(files[0].tokenizer, max(tf.vocab_size for tf in files), train, val, sampler,
                      " + ".join(names), num_tokens, eos, names)
