"""JSON from files a user hands over (sidecars, tokenizer configs, checkpoint indexes), read with bounds.

`json.loads` recurses once per nesting level, so a file of `[[[[...` ends in a `RecursionError`
(not a `ValueError`), and a FIFO or device named as a file blocks or never ends.  `read_json` opens
only regular files (without blocking on a FIFO), reads at most `max_bytes`, and checks the nesting
depth before parsing; every problem is a `JSONInputError` (a `ValueError`) with a one-line reason
that the caller puts into its own message naming the config key.
"""

from __future__ import annotations

import gc
import os
import stat
from pathlib import Path
from typing import Any

MAX_DEPTH = 64  # far deeper than any file ntp_nemo or Hugging Face writes
MAX_BYTES = 64 << 20

class JSONInputError(ValueError):
    """A JSON input that is not a regular file, too large, too deeply nested or malformed."""


class JSONBoundError(JSONInputError):
    """A JSON input beyond a bound (nesting depth, size) or not a regular file: never an ordinary typo."""


def nesting_depth(text: str | bytes) -> int:
    """Deepest nesting of arrays and objects in `text` (strings skipped), in time linear in its length
    whatever it holds (an unterminated string, runs of escapes, millions of brackets).

    Escapes go first (`\\\\` pairs, then `\\"`: bytes.replace scans left to right, as a JSON reader
    pairs them), so every quote left opens or closes a string; a bracket lies outside the strings when an
    even number of quotes precede it; the running sum of opening minus closing brackets outside strings
    is the depth. Quotes, backslashes and brackets are ASCII, so no UTF-8 sequence hides one. The figure
    is exact for valid JSON (`parse_json` parses first and refuses anything else).
    """
    import numpy as np

    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    kind = np.zeros(256, dtype=np.int8)  # +1 opens, -1 closes, 2 quote
    kind[[ord("["), ord("{")]] = 1
    kind[[ord("]"), ord("}")]] = -1
    kind[ord('"')] = 2
    k = kind[np.frombuffer(data, dtype=np.uint8)]
    marks = np.flatnonzero(k)  # the bytes that matter, in order
    k = k[marks]
    is_quote = k == 2
    if is_quote.any():
        quotes = marks[is_quote]
        brackets = ~is_quote
        outside = np.searchsorted(quotes, marks[brackets]) % 2 == 0  # an even number of quotes before
        k = k[brackets][outside]
    if not k.size:
        return 0
    return max(int(np.cumsum(k, dtype=np.int64).max()), 0)


def parse_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` that refuses nesting deeper than `max_depth` (a `JSONInputError`, never a
    `RecursionError`), in time linear in the input whatever it holds: the C parser runs first (it
    refuses malformed text in one pass and raises `RecursionError` past the interpreter's recursion
    limit), then the depth of what parsed is checked with `nesting_depth`."""
    import json

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise JSONInputError(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    collecting = gc.isenabled()
    gc.disable()  # millions of small containers would each trigger a collection of all before them
    try:
        value = json.loads(text, parse_float=_finite_float)
    except RecursionError:
        raise JSONBoundError(f"nested more levels deep than the {max_depth} allowed") from None
    except ValueError as err:
        raise JSONInputError(f"not valid JSON ({_short(err)})") from None
    finally:
        if collecting:
            gc.enable()
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONBoundError(f"nested {depth} levels deep, more than the {max_depth} allowed")
    return value


def _finite_float(literal: str) -> float:
    """A JSON number as a float, refusing one beyond a float's range (`1e999` would become infinity and
    break every count read from it with an `OverflowError`; `Infinity`, what Python writes for one, is
    still read)."""
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {literal[:40]} is beyond a float's range")
    return value


def _short(err: ValueError) -> str:
    """The parser's reason, cut to one short line (a `ValueError` for a 10 MB number quotes no input,
    but keep any that would)."""
    reason = " ".join(str(err).split())
    return reason if len(reason) <= 200 else reason[:197] + "..."


def read_regular(path: str | os.PathLike, max_bytes: int = MAX_BYTES, *,
                 follow_symlinks: bool = True) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `max_bytes` (a FIFO, a device or a
    directory is refused without blocking; with `follow_symlinks=False` a symbolic link too)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as err:
        if not follow_symlinks and os.path.islink(path):
            raise JSONBoundError("a symbolic link (only regular files are read)") from None
        raise JSONInputError(f"cannot be opened ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JSONBoundError("not a regular file (a FIFO, device or directory is never read)")
        if st.st_size > max_bytes:
            raise JSONBoundError(f"larger than the {max_bytes} bytes allowed")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise JSONBoundError(f"larger than the {max_bytes} bytes allowed")
    return data


def read_json(path: str | os.PathLike, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, *,
              follow_symlinks: bool = True) -> Any:
    """The JSON value in file `path`, read with `read_regular`'s checks and parsed with `parse_json`'s.
    A missing file raises `FileNotFoundError`; anything else wrong, `JSONInputError`."""
    return parse_json(read_regular(Path(path), max_bytes, follow_symlinks=follow_symlinks), max_depth)
