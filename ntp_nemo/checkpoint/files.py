"""The files of a checkpoint directory by name, and the bounded readers of its two JSON documents.

Shared by `storage.py` (which writes and reads the records an index describes) and `manifest.py`
(which commits a directory and judges whether it is a usable checkpoint): neither imports the other's
module for them.
"""

from __future__ import annotations

import os
from pathlib import Path

from ntp_nemo.data.bounded_json import read_json

MANIFEST = "manifest.json"
INDEX_FILE = "index.json"
META_FILE = "meta.pt"
REQUIRED_FILES = (INDEX_FILE, META_FILE)  # listed in every manifest, with their digests
DIGEST = "xxh3_64"
MAX_MANIFEST_BYTES = 16 << 20
MAX_INDEX_BYTES = 256 << 20


def read_manifest(path: str | os.PathLike) -> dict:
    """The parsed manifest of a checkpoint directory (a regular file, read with size and depth bounds;
    no validation beyond JSON: a bad one raises `ValueError`)."""
    return read_json(Path(path) / MANIFEST, MAX_MANIFEST_BYTES, follow_symlinks=False)


def read_index_doc(path: str | os.PathLike) -> dict:
    """The parsed `index.json` of a checkpoint directory, read with bounds (`ValueError` when bad)."""
    return read_json(Path(path) / INDEX_FILE, MAX_INDEX_BYTES, follow_symlinks=False)


__all__ = ["DIGEST", "INDEX_FILE", "MANIFEST", "META_FILE", "REQUIRED_FILES", "read_index_doc",
           "read_manifest"]
