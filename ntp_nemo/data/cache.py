"""Where derived data (tokenized corpora, trained tokenizers) is cached, and how it is written safely.

Several processes (forked workers, a multirun sweep, parallel test sessions) may build the same cache
entry at once. Every entry is written to a temporary file in its final directory and renamed into
place, so a reader sees either no file or a complete one; duplicated work is harmless because the
content is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ntp_nemo.errors import ConfigError

CACHE_ENV = "NTP_NEMO_CACHE"


def cache_dir(sub: str = "") -> Path:
    """The cache root (`$NTP_NEMO_CACHE`, else `$XDG_CACHE_HOME/ntp_nemo`, else `~/.cache/ntp_nemo`)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "ntp_nemo")
    path = Path(root).expanduser() / sub
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            CACHE_ENV,
            f"cannot create the data cache directory {str(path)!r} ({err.strerror}). Set the environment "
            f"variable {CACHE_ENV} to a writable directory, e.g. `export {CACHE_ENV}=/tmp/ntp_nemo_cache`.",
        ) from err
    return path


def fingerprint(payload: Any) -> str:
    """Short stable hash of a JSON-serialisable value, used in cache file names."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def temp_path_beside(path: Path) -> Path:
    """A unique, not yet existing name in `path`'s directory (same filesystem: `os.replace` is atomic).

    Create it with mode "x" so the file gets the usual umask permissions and no other writer shares it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers never see a partial file."""
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
