"""Token files: a flat array of token ids on disk, memory-mapped for training, with a JSON sidecar.

Layout: `PATH` holds the ids as little-endian uint16 (vocabularies below 65536) or uint32;
`PATH.json` records dtype, vocab_size, num_tokens, max_token_id and the tokenizer name. The sidecar
is written last, so its presence marks a complete file; both are renamed into place atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ntp_nemo.data.cache import atomic_write_text, temp_path_beside
from ntp_nemo.errors import ConfigError

FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


@dataclass(frozen=True)
class TokenFile:
    """An opened token file: the memory-mapped ids and what the sidecar says about them."""

    path: Path
    tokens: np.ndarray
    dtype: str
    vocab_size: int
    num_tokens: int
    tokenizer: str
    max_token_id: int | None


class TokenFileWriter:
    """Streams token ids to `path` (use as a context manager); commits atomically on clean exit."""

    def __init__(self, path: str | os.PathLike, tokenizer_name: str, vocab_size: int) -> None:
        if vocab_size < 1 or vocab_size > 2**32:
            raise ValueError(f"vocab_size must lie in [1, 2**32], got {vocab_size}")
        self.path = Path(path)
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.num_tokens = 0
        self.max_token_id = -1
        self._tmp = temp_path_beside(self.path)
        self._fh = open(self._tmp, "xb")  # closed by commit() or abort()

    def append(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{lo}, {hi}]")
        self._fh.write(arr.astype(_DTYPES[self.dtype], copy=False).reshape(-1).tobytes())
        self.num_tokens += arr.size
        self.max_token_id = max(self.max_token_id, hi)

    def commit(self) -> Path:
        self._fh.close()
        os.replace(self._tmp, self.path)
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "num_tokens": self.num_tokens,
            "max_token_id": self.max_token_id if self.num_tokens else None,
            "tokenizer": self.tokenizer_name,
        }
        atomic_write_text(sidecar_path(self.path), json.dumps(meta, indent=2) + "\n")
        return self.path

    def abort(self) -> None:
        self._fh.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_token_file(
    tokens: Iterable[int] | np.ndarray, path: str | os.PathLike, tokenizer_name: str, vocab_size: int
) -> Path:
    """Write `tokens` and the sidecar `PATH.json` atomically; returns `path`."""
    with TokenFileWriter(path, tokenizer_name, vocab_size) as writer:
        writer.append(tokens)
    return Path(path)


def _bad(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        "data.path",
        f"{str(path)!r} is not a usable token file: {problem}. Rewrite it with "
        f"`ntp-preprocess YOUR_TEXT_FILES --out {path}`, or point data.path at the text files directly.",
    )


def open_token_file(path: str | os.PathLike) -> TokenFile:
    """Memory-map a token file after checking it against its sidecar."""
    path = Path(path)
    meta_path = sidecar_path(path)
    if not path.is_file():
        raise _bad(path, "the file does not exist")
    if not meta_path.is_file():
        raise _bad(path, f"its sidecar {meta_path.name!r} (dtype, vocab size, token count) is missing")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype_name = str(meta["dtype"])
        vocab_size = int(meta["vocab_size"])
        num_tokens = int(meta["num_tokens"])
        tokenizer = str(meta.get("tokenizer", "unknown"))
        max_id = meta.get("max_token_id")
        max_id = None if max_id is None else int(max_id)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise _bad(path, f"its sidecar {meta_path.name!r} is unreadable or incomplete ({err!r})") from err
    if dtype_name not in _DTYPES:
        raise _bad(path, f"the sidecar names dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")
    itemsize = _DTYPES[dtype_name].itemsize
    size = path.stat().st_size
    if num_tokens < 0 or size != num_tokens * itemsize:
        raise _bad(
            path,
            f"it holds {size} bytes but the sidecar promises {num_tokens} {dtype_name} tokens "
            f"({num_tokens * itemsize} bytes); the file is truncated or does not match its sidecar",
        )
    if num_tokens == 0:
        raise _bad(path, "it contains no tokens")
    tokens = np.memmap(path, dtype=_DTYPES[dtype_name], mode="r", shape=(num_tokens,))
    return TokenFile(path, tokens, dtype_name, vocab_size, num_tokens, tokenizer, max_id)


def max_token_id(tf: TokenFile, chunk: int = 1 << 24) -> int:
    """Largest id in the file: from the sidecar when recorded, else by a chunked scan."""
    if tf.max_token_id is not None:
        return tf.max_token_id
    return max(int(tf.tokens[i : i + chunk].max()) for i in range(0, tf.num_tokens, chunk))
