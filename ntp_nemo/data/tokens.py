"""Token files: a flat array of token ids on disk, memory-mapped for training, with a JSON sidecar.

Layout: `PATH` holds the ids as little-endian uint16 (vocabularies up to 65536) or uint32;
`PATH.idx` (the document index) holds the end offset of every document as little-endian uint64;
`PATH.json` (the sidecar) records dtype, vocab_size, num_tokens, num_documents, max_token_id, the
tokenizer (name and identity: kind, hash, source, eos id) and, from `ntp-preprocess`, the inputs.
Each file is written under a temporary name and renamed into place; the sidecar is removed first and
written last, so its presence marks a complete set and an interrupted write leaves nothing loadable.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ntp_nemo.data.bounded_json import JSONInputError, read_json
from ntp_nemo.data.cache import atomic_write_text, temp_path_beside
from ntp_nemo.errors import ConfigError

FORMAT_VERSION = 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SIDECAR_MAX_BYTES = 16 << 20
SCAN_CHUNK = 1 << 24  # tokens per step of the largest-id scan (32 MiB of uint16)


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def index_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.idx")


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The sidecar of token file `path` as a dict, or None when absent or unreadable."""
    try:
        meta = read_json(sidecar_path(path), SIDECAR_MAX_BYTES)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


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
    tokenizer_hash: str | None = None
    doc_ends: np.ndarray | None = None  # end offset of each document (None: no document index)
    meta: dict | None = None


class TokenFileWriter:
    """Streams token ids to `path` (use as a context manager); commits atomically on clean exit."""

    def __init__(
        self, path: str | os.PathLike, tokenizer_name: str, vocab_size: int, extra: dict | None = None
    ) -> None:
        if vocab_size < 1 or vocab_size > 2**32:
            raise ValueError(f"vocab_size must lie in [1, 2**32], got {vocab_size}")
        self.path = Path(path)
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.extra = dict(extra or {})
        self.num_tokens = 0
        self.max_token_id = -1
        self.doc_ends: list[int] = []
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

    def append_encoded(self, tokens: np.ndarray, doc_lengths: np.ndarray, max_id: int) -> None:
        """Append ids already in this file's dtype, with the lengths of the documents they hold."""
        if tokens.dtype != _DTYPES[self.dtype]:
            raise TypeError(f"expected {self.dtype} ids, got {tokens.dtype}")
        if max_id >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got max {max_id}")
        self._fh.write(tokens.tobytes())
        ends = self.num_tokens + np.cumsum(np.asarray(doc_lengths, dtype=np.int64))
        self.doc_ends.extend(int(e) for e in ends)
        self.num_tokens += int(tokens.size)
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(max_id))

    def end_document(self) -> None:
        """Mark the tokens appended so far as the end of a document (for the document index)."""
        if not self.doc_ends or self.doc_ends[-1] != self.num_tokens:
            self.doc_ends.append(self.num_tokens)

    def commit(self) -> Path:
        self._fh.close()
        if self.num_tokens and (not self.doc_ends or self.doc_ends[-1] != self.num_tokens):
            self.doc_ends.append(self.num_tokens)  # the tail after the last end_document() is a document
        idx_tmp = temp_path_beside(index_path(self.path))
        with open(idx_tmp, "xb") as fh:
            fh.write(np.asarray(self.doc_ends, dtype="<u8").tobytes())
        # The old sidecar goes first: until the new one is written nothing here loads.
        sidecar_path(self.path).unlink(missing_ok=True)
        os.replace(self._tmp, self.path)
        os.replace(idx_tmp, index_path(self.path))
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "num_tokens": self.num_tokens,
            "num_documents": len(self.doc_ends),
            "max_token_id": self.max_token_id if self.num_tokens else None,
            "tokenizer": self.tokenizer_name,
            **self.extra,
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


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def scan_max(tokens: np.ndarray, chunk: int = SCAN_CHUNK) -> int:
    """Largest id in `tokens` (a memory map): one vectorised pass, `chunk` tokens at a time."""
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))


def open_token_file(path: str | os.PathLike) -> TokenFile:
    """Memory-map a token file after checking it against its sidecar.

    The ids themselves are checked too (one vectorised pass over the file): an id outside the
    vocabulary the sidecar names is refused here, naming the file, rather than found by an embedding
    lookup in a worker; the sidecar's own claim of the largest id is not trusted."""
    path = Path(path)
    meta_path = sidecar_path(path)
    if not path.exists():
        raise _bad(path, "the file does not exist")
    if not _regular(path):
        raise _bad(path, "it is not a regular file (a FIFO, device or directory is never read)")
    if not meta_path.exists():
        raise _bad(path, f"its sidecar {meta_path.name!r} (dtype, vocab size, token count) is missing")
    try:
        meta = read_json(meta_path, SIDECAR_MAX_BYTES)
        dtype_name = str(meta["dtype"])
        vocab_size = int(meta["vocab_size"])
        num_tokens = int(meta["num_tokens"])
        tokenizer = str(meta.get("tokenizer", "unknown"))
        max_id = meta.get("max_token_id")
        max_id = None if max_id is None else int(max_id)
        num_docs = meta.get("num_documents")
        num_docs = None if num_docs is None else int(num_docs)
        tok_hash = (meta.get("tokenizer_identity") or {}).get("hash")
    except JSONInputError as err:
        raise _bad(path, f"its sidecar {meta_path.name!r} is unreadable: {err}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
        raise _bad(path, f"its sidecar {meta_path.name!r} is unreadable or incomplete ({err!r})") from None
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
    if vocab_size < 1:
        raise _bad(path, f"its sidecar gives vocab_size {vocab_size}")
    tokens = np.memmap(path, dtype=_DTYPES[dtype_name], mode="r", shape=(num_tokens,))
    top = scan_max(tokens)
    if top >= vocab_size:
        said = "" if max_id is None else f" (its sidecar claims the largest is {max_id})"
        raise _bad(path, f"it holds token id {top}, outside the {vocab_size}-id vocabulary of its tokenizer "
                         f"{tokenizer!r}{said}; the file was damaged or written for another tokenizer")
    doc_ends = None
    idx = index_path(path)
    if num_docs is not None and _regular(idx):
        if idx.stat().st_size != 8 * num_docs:
            raise _bad(path, f"its document index {idx.name!r} does not hold the {num_docs} documents the "
                             "sidecar promises")
        doc_ends = np.fromfile(idx, dtype="<u8").astype(np.int64)
        if num_docs and (doc_ends[-1] != num_tokens or doc_ends[0] < 0 or np.any(np.diff(doc_ends) < 0)):
            raise _bad(path, f"its document index {idx.name!r} does not match the token count")
    return TokenFile(path, tokens, dtype_name, vocab_size, num_tokens, tokenizer, top,
                     None if tok_hash is None else str(tok_hash), doc_ends, meta)


def max_token_id(tf: TokenFile, chunk: int = SCAN_CHUNK) -> int:
    """Largest id in the file: as `open_token_file` measured it (never the sidecar's claim), else by a
    chunked scan."""
    if tf.max_token_id is not None:
        return tf.max_token_id
    return scan_max(tf.tokens, chunk)
