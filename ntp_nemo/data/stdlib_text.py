"""Text of the built-in corpus: the installed Python standard library's own sources.

Every Python installation ships a few megabytes of well-written English docstrings and comments
mixed with code, so a corpus assembled from it needs no download and no data shipped in the
package. The selection is deterministic for a given installation: `.py` files in sorted relative
path order, skipping the test suites, the bundled third-party packages and the machine-generated
codec tables, until a byte cap is reached (the last file is cut at a character boundary).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BYTES = 4 * 1024 * 1024

# Directories whose content is tests, vendored packages or generated tables rather than library text.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3",
     "turtledemo", "encodings", "ensurepip"}
)


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    path: Path
    size: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """The candidate `.py` files under the standard library, in sorted relative-path order."""
    root = root or stdlib_root()
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath) / name
            found.append(SourceFile(path.relative_to(root).as_posix(), path, path.stat().st_size))
    found.sort(key=lambda f: f.relpath)
    return found


def corpus_identity(max_bytes: int, root: Path | None = None) -> dict:
    """What the corpus text depends on; its hash names the cache entry."""
    root = root or stdlib_root()
    files = stdlib_files(root)
    return {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "max_bytes": max_bytes,
        "files": [[f.relpath, f.size] for f in _within_cap(files, max_bytes)],
    }


def _within_cap(files: list[SourceFile], max_bytes: int) -> list[SourceFile]:
    total, kept = 0, []
    for f in files:
        if total >= max_bytes:
            break
        kept.append(f)
        total += f.size
    return kept


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> Iterator[str]:
    """Yield one document (a file's text) at a time until `max_bytes` of UTF-8 have been produced."""
    budget = max_bytes
    for f in stdlib_files(root):
        if budget <= 0:
            return
        text = f.path.read_text(encoding="utf-8", errors="replace")
        data = text.encode("utf-8")
        if len(data) > budget:
            text = data[:budget].decode("utf-8", errors="ignore")
            data = text.encode("utf-8")
        budget -= len(data)
        yield text
