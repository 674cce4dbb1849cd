"""Commit protocol and validity of checkpoint directories.

A checkpoint is written into `NAME.tmp/`; when every file is on disk, global rank 0 writes
`manifest.json` (size of every file, the xxh3-64 digest of the small metadata files, step, layout,
format version) and renames the directory to `NAME`.  The data files' digests sit per record in
the index and are checked while the data is read (`storage.py`), once per load by the rank that
reads each record, never in a separate pass.

So the cheap check here (`checkpoint_problem`, run in the launching parent before any worker
starts) asks: manifest present, parsed, of this format; every listed file present with the listed
size; metadata digests right; not marked corrupt.  A run killed mid-save leaves a `.tmp` directory
(ignored), a truncated file is caught by its size, and a flipped byte in the data is caught when
the workers load it: the loading ranks agree on it, rank 0 records it in `corrupt.json` (so every
later check skips the checkpoint cheaply), and the load falls back to the previous valid
checkpoint with a warning naming the file, or fails naming it when the user named the checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ntp_nemo.errors import ConfigError

FORMAT = "ntp_nemo.sharded_checkpoint"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CORRUPT_MARKER = "corrupt.json"
DIGEST = "xxh3_64"
TMP_SUFFIX = ".tmp"


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint directory was found unusable (partial or corrupt) and skipped."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after optimizer step `step` (sorts by step)."""
    return f"step_{step:06d}"


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def file_digest(path: Path, block: int = 1 << 20) -> tuple[int, str]:
    """(size in bytes, xxh3-64 hex) of a file, streamed."""
    h = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def data_files(directory: Path) -> list[str]:
    """Every regular file of a checkpoint directory except the manifest, sorted (relative names)."""
    return sorted(p.name for p in directory.iterdir() 
                  if p.is_file() and p.name not in (MANIFEST, CORRUPT_MARKER))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(directory: Path, files: dict[str, tuple[int, str | None]], step: int, layout: Any) -> None:
    """Write the manifest (last file of a checkpoint), flushed to disk; `files` maps name ->
    (size, xxh3-64 hex digest or None for data files, whose digests are per record in the index)."""
    doc = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "layout": layout,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "digest": DIGEST,
        "files": {name: {"size": size, **({DIGEST: digest} if digest else {})}
                  for name, (size, digest) in sorted(files.items())},
    }
    target = directory / MANIFEST
    with open(target, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically publish a fully written checkpoint; an existing one of the same name is replaced."""
    old = None
    if final_dir.exists():
        old = final_dir.with_name(final_dir.name + ".replaced" + TMP_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    """The parsed manifest of a checkpoint directory (no validation beyond JSON)."""
    with open(Path(path) / MANIFEST) as f:
        return json.load(f)


def mark_corrupt(path: str | os.PathLike, problem: str) -> None:
    """Record that loading `path` found `problem` (a bad data file): later checks skip it cheaply."""
    try:
        (Path(path) / CORRUPT_MARKER).write_text(json.dumps({"problem": problem}))
    except OSError:
        pass


def checkpoint_problem(path: str | os.PathLike, verify_data: bool = False) -> str | None:
    """Why `path` is not a usable checkpoint, or None if it is (as far as the check goes).

    Cheap: reads the manifest, the sizes of the files and the small metadata files.  The data
    files' record digests are checked while loading; `verify_data` checks them here too (one
    full read, for offline inspection).
    """
    path = Path(path)
    if not path.is_dir():
        return "not a directory" if path.exists() else "does not exist"
    if path.name.endswith(TMP_SUFFIX):
        return "an uncommitted (.tmp) directory"
    try:
        doc = read_manifest(path)
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not complete)"
    except (OSError, ValueError) as err:
        return f"unreadable {MANIFEST} ({err})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f"{MANIFEST} is not an ntp_nemo sharded-checkpoint manifest"
    if doc.get("version") != FORMAT_VERSION:
        return f"format version {doc.get('version')!r}, this ntp_nemo reads version {FORMAT_VERSION}"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    marker = path / CORRUPT_MARKER
    if marker.is_file():
        try:
            return str(json.loads(marker.read_text()).get("problem"))
        except (OSError, ValueError, AttributeError):
            return f"marked corrupt ({CORRUPT_MARKER})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"file {name} has {size} bytes, the manifest says {want.get('size')} (truncated?)"
        if DIGEST in want and file_digest(f)[1] != want[DIGEST]:
            return f"file {name} fails its {DIGEST} check (corrupted)"
    if verify_data:
        from ntp_nemo.checkpoint.storage import verify_all_records

        return verify_all_records(path)
    return None


def is_valid_checkpoint(path: str | os.PathLike, verify_data: bool = False) -> bool:
    """True if `path` is a committed checkpoint whose files all match the manifest."""
    return checkpoint_problem(path, verify_data) is None


def invalid_checkpoint_error(path: str | os.PathLike, problem: str, key: str = "resume") -> ConfigError:
    return ConfigError(
        key,
        f"{key}={path} is not a usable checkpoint: {problem}. Pass the directory of a committed "
        f"checkpoint (one holding {MANIFEST}, e.g. RUN_DIR/checkpoints/{checkpoint_name(50)}), "
        f"{key}=auto to continue from the latest valid checkpoint of the run directory, or {key}=never.",
    )


def require_valid_checkpoint(path: str | os.PathLike, key: str = "resume", verify_data: bool = False) -> Path:
    """A checkpoint path given by the user, checked; a bad one raises `ConfigError(key, ...)`."""
    problem = checkpoint_problem(path, verify_data)
    if problem is not None:
        raise invalid_checkpoint_error(path, problem, key)
    return Path(path)


@dataclass(frozen=True)
class _Candidate:
    path: Path
    step: int


def _step_of(path: Path) -> int:
    try:
        step = read_manifest(path).get("step")
        if isinstance(step, int):
            return step
    except (OSError, ValueError, AttributeError):
        pass
    digits = re.findall(r"\d+", path.name)
    return int(digits[-1]) if digits else -1


def _candidates(directory: Path) -> list[_Candidate]:
    """Committed-looking checkpoint directories, newest (highest step) first."""
    if not directory.is_dir():
        return []
    dirs = [p for p in directory.iterdir()
            if p.is_dir() and not p.name.endswith(TMP_SUFFIX) and not p.name.startswith(".")]
    cands = [_Candidate(p, _step_of(p)) for p in dirs]
    return sorted(cands, key=lambda c: (c.step, c.path.name), reverse=True)


def latest_valid_checkpoint(directory: str | os.PathLike, verify_data: bool = False,
                            before_step: int | None = None) -> Path | None:
    """The valid checkpoint of `directory` with the highest step, or None.

    Newer directories that are partial or corrupt are skipped, each with a
    `CheckpointSkippedWarning` naming it, why, and the checkpoint used instead.  `before_step`:
    only checkpoints of an earlier step count (the fallback when loading one failed).
    """
    skipped: list[tuple[Path, str]] = []
    chosen = None
    for cand in _candidates(Path(directory)):
        if before_step is not None and cand.step >= before_step:
            continue
        problem = checkpoint_problem(cand.path, verify_data)
        if problem is None:
            chosen = cand.path
            break
        skipped.append((cand.path, problem))
    for path, problem in skipped:
        instead = f"using {chosen} instead" if chosen else "no valid checkpoint remains"
        warnings.warn(f"skipping checkpoint {path}: {problem}; {instead}", CheckpointSkippedWarning,
                      stacklevel=2)
    return chosen


def keep_last_k(directory: str | os.PathLike, k: int | None) -> list[Path]:
    """Delete all but the `k` newest committed checkpoints (k None or < 1 keeps everything).

    Also removes `.tmp` leftovers of saves older than the newest committed checkpoint (a save that
    died); corrupt directories (also those marked corrupt at load) are left alone for inspection and
    do not count among the `k`.  Returns the removed paths.
    """
    directory = Path(directory)
    if k is None or k < 1 or not directory.is_dir():
        return []
    committed = [c for c in _candidates(directory)
                 if (c.path / MANIFEST).is_file() and not (c.path / CORRUPT_MARKER).exists()]
    removed = [c.path for c in committed[k:]]
    if committed:
        newest = committed[0].step
        removed += [p for p in directory.iterdir()
                    if p.is_dir() and p.name.endswith(TMP_SUFFIX) and _step_of(p) < newest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
