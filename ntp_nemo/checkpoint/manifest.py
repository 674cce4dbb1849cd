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
import stat
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ntp_nemo.checkpoint.files import (
    DIGEST,
    INDEX_FILE,
    MANIFEST,
    REQUIRED_FILES,
    read_index_doc,
    read_manifest,
)
from ntp_nemo.checkpoint.storage import index_problem, verify_all_records
from ntp_nemo.data.bounded_json import JSONInputError, read_json
from ntp_nemo.errors import ConfigError

FORMAT = "ntp_nemo.sharded_checkpoint"
FORMAT_VERSION = 2
CORRUPT_MARKER = "corrupt.json"
TMP_SUFFIX = ".tmp"
UNREADABLE_SUFFIX = ".unreadable"  # an unreadable checkpoint a new save of the same step moved aside
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


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


def _set_aside(path: Path) -> Path:
    """Move an unreadable checkpoint out of the way of a new save of the same name (never deleted)."""
    n = 0
    while os.path.lexists(aside := path.with_name(f"{path.name}{UNREADABLE_SUFFIX}{f'.{n}' if n else ''}")):
        n += 1
    os.rename(path, aside)
    print(f"warning: checkpoint {path} could not be read ({checkpoint_problem(aside)}); a new save of the "
          f"same name takes its place, so it was kept as {aside}", file=sys.stderr, flush=True)
    return aside


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically publish a fully written checkpoint; an existing valid one of the same name is replaced,
    an unreadable one is kept beside it (`NAME.unreadable`)."""
    old = None
    if os.path.lexists(final_dir) and (final_dir.is_symlink() or checkpoint_problem(final_dir) is not None):
        _set_aside(final_dir)
    if final_dir.exists():
        old = final_dir.with_name(final_dir.name + ".replaced" + TMP_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def mark_corrupt(path: str | os.PathLike, problem: str) -> None:
    """Record that loading `path` found `problem` (a bad data file): later checks skip it cheaply.

    Written only into the checkpoint directory itself: nothing is written when the directory or an
    existing marker is a symbolic link (the write would land wherever the link points)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        fd = os.open(CORRUPT_MARKER, flags, 0o666, dir_fd=dfd)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"problem": problem}))
    except OSError:
        pass
    finally:
        os.close(dfd)


def _file_problem(path: Path, name: Any, want: Any) -> str | None:
    """What is wrong with manifest entry `name` -> `want` of checkpoint `path`, if anything: the name of
    a regular file directly inside the checkpoint (never a link, FIFO, device or another directory)."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (MANIFEST, CORRUPT_MARKER):
        return f"{MANIFEST} names a file outside the checkpoint directory ({str(name)[:80]!r})"
    if not isinstance(want, dict) or type(want.get("size")) is not int or want["size"] < 0:
        return f"{MANIFEST} gives no valid size for file {name}"
    try:
        st = os.lstat(path / name)
    except FileNotFoundError:
        return f"file {name} is missing"
    except OSError as err:
        return f"file {name} cannot be examined ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"file {name} is a symbolic link (a checkpoint holds only regular files)"
    if not stat.S_ISREG(st.st_mode):
        return f"file {name} is not a regular file (a FIFO, device or directory is never read)"
    if st.st_size != want["size"]:
        return f"file {name} has {st.st_size} bytes, the manifest says {want['size']} (truncated?)"
    return None


def _marker_problem(path: Path) -> str | None:
    """The problem recorded in `corrupt.json` by an earlier load, if the checkpoint has one."""
    marker = path / CORRUPT_MARKER
    if not os.path.lexists(marker):
        return None
    try:
        problem = read_json(marker, 1 << 16, follow_symlinks=False).get("problem")
    except (OSError, ValueError, AttributeError):
        problem = None
    return str(problem)[:2000] if isinstance(problem, str) else f"marked corrupt ({CORRUPT_MARKER})"


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
    except (OSError, JSONInputError) as err:
        return f"unreadable {MANIFEST} ({err})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f"{MANIFEST} is not an ntp_nemo sharded-checkpoint manifest"
    if doc.get("version") != FORMAT_VERSION:
        return f"format version {doc.get('version')!r}, this ntp_nemo reads version {FORMAT_VERSION}"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    marker = _marker_problem(path)
    if marker is not None:
        return marker
    for name, want in files.items():
        problem = _file_problem(path, name, want)
        if problem is not None:
            return problem
    for name in REQUIRED_FILES:
        if name not in files or not isinstance(files[name].get(DIGEST), str):
            return f"{MANIFEST} does not list {name} with its {DIGEST} digest"
    for name, want in files.items():
        if DIGEST in want and file_digest(path / name)[1] != want[DIGEST]:
            return f"file {name} fails its {DIGEST} check (corrupted)"
    try:
        problem = index_problem(read_index_doc(path), {name: want["size"] for name, want in files.items()
                                                       if name not in REQUIRED_FILES})
    except (OSError, JSONInputError) as err:
        problem = f"unreadable {INDEX_FILE} ({err})"
    if problem is not None:
        return problem
    if verify_data:
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
            if p.is_dir() and not p.name.endswith((TMP_SUFFIX, UNREADABLE_SUFFIX))
            and not p.name.startswith(".")]
    cands = [_Candidate(p, _step_of(p)) for p in dirs]
    return sorted(cands, key=lambda c: (c.step, c.path.name), reverse=True)


def latest_valid_checkpoint(directory: str | os.PathLike, verify_data: bool = False,
                            before_step: int | None = None, key: str = "resume") -> Path | None:
    """The valid checkpoint of `directory` with the highest step, or None when it holds no checkpoint.

    Newer directories that are partial or corrupt are skipped, each with a
    `CheckpointSkippedWarning` naming it, why, and the checkpoint used instead.  When the directory
    holds checkpoints and none is usable, `NoUsableCheckpointError(key, ...)` names each one and what
    is wrong with it: starting over from step 1 beside them would silently throw the run away (a
    cluster resubmitting with resume=auto would never say so); nothing is deleted.  `before_step`:
    only checkpoints of an earlier step count, and None is returned when none does (the fallback
    when loading one failed).
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
    damaged = [(p, why) for p, why in skipped if _looks_like_checkpoint(p)]
    if chosen is None and before_step is None and damaged:
        raise NoUsableCheckpointError(key, directory, damaged)
    for path, problem in skipped:
        instead = f"using {chosen} instead" if chosen else "no valid checkpoint remains"
        warnings.warn(f"skipping checkpoint {path}: {problem}; {instead}", CheckpointSkippedWarning,
                      stacklevel=2)
    return chosen


def _looks_like_checkpoint(path: Path) -> bool:
    return os.path.lexists(path / MANIFEST) or re.fullmatch(r"step_\d+", path.name) is not None


class NoUsableCheckpointError(ConfigError):
    """A checkpoint directory holds checkpoints and none of them can be read."""

    def __init__(self, key: str, directory: str | os.PathLike, damaged: list[tuple[Path, str]],
                 stopped: str | None = None) -> None:
        """`stopped`: what a running job was doing when it found them (a relaunch after a failure), None
        when nothing has started yet."""
        told = "; ".join(f"{p.name}: {why}" for p, why in damaged[:8])
        more = f"; and {len(damaged) - 8} more" if len(damaged) > 8 else ""
        if stopped is not None:
            fix = (f"{stopped}; nothing was deleted. Repair or restore them and rerun the same command with "
                   f"{key}=auto, pass {key}=PATH to resume from a good copy elsewhere, or start over on "
                   f"purpose with {key}=never (or after moving them out of {directory}); "
                   "checkpoint.keep_last never deletes a checkpoint it cannot read.")
        elif key == "resume":
            fix = (f"Nothing was started and nothing was deleted. Repair or restore them, pass {key}=PATH to "
                   f"resume from a good copy elsewhere, or start over on purpose with {key}=never (or after "
                   f"moving them out of {directory}); checkpoint.keep_last never deletes a checkpoint it "
                   "cannot read.")
        else:
            fix = "Nothing was deleted. Repair or restore them, or pass a readable checkpoint."
        super().__init__(key, f"{directory} holds {len(damaged)} checkpoint(s) and none is usable "
                              f"({told}{more}). {fix}")
        self.damaged = damaged


def readable_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoints of `directory` that pass the cheap check, newest first."""
    return [c.path for c in _candidates(Path(directory)) if checkpoint_problem(c.path) is None]


def keep_last_k(directory: str | os.PathLike, k: int | None) -> list[Path]:
    """Delete all but the `k` newest valid checkpoints (k None or < 1 keeps everything).

    Also removes `.tmp` leftovers of saves older than the newest valid checkpoint (a save that
    died).  A checkpoint that cannot be read (truncated, damaged, marked corrupt at load, foreign) is
    never deleted: it is left alone for inspection or repair and does not count among the `k`.
    Returns the removed paths.
    """
    directory = Path(directory)
    if k is None or k < 1 or not directory.is_dir():
        return []
    committed = [c for c in _candidates(directory) if checkpoint_problem(c.path) is None]
    removed = [c.path for c in committed[k:]]
    if committed:
        newest = committed[0].step
        removed += [p for p in directory.iterdir()
                    if p.is_dir() and p.name.endswith(TMP_SUFFIX) and _step_of(p) < newest]
    for path in removed:
        _remove(path)
    for left in directory.iterdir():  # what a rotation killed halfway left
        if left.is_dir() and left.name.startswith(DELETING_PREFIX):
            shutil.rmtree(left, ignore_errors=True)
    return removed


DELETING_PREFIX = ".deleting-"


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that a process killed halfway leaves nothing that looks committed:
    renamed first (atomic) to a hidden name no reader lists, then removed; the next rotation removes what
    a kill left.  (Deleted in place, a rotation killed halfway -- its process lost in a live job -- left a
    `step_NNNNNN` directory with some data files gone, which every resume then reported as damaged and
    no rotation ever deleted.)"""
    doomed = path.with_name(DELETING_PREFIX + path.name)
    try:
        path.rename(doomed)
    except OSError:  # gone already, or another process renamed it first
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)
