"""Append-only goodput event recorder (`goodput.jsonl`).

Each event is one JSON line written with a single `write` on an `O_APPEND` descriptor and
then fsync'ed, so a crash (even SIGKILL) leaves every earlier line intact and several
processes (a restarted job, a supervisor) can append to the same file without interleaving.
The recorder never reads the file: analysis is the offline calculator's job.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ntp_nemo.goodput.events import EVENTS, GOODPUT_FILENAME, JOB_END, JOB_START

# The last job_start/job_end any recorder of this process wrote, per file. A forked worker
# inherits its parent's entries on purpose: the fork belongs to the same job lifetime.
_LIFECYCLE: dict[str, str] = {}
_LIFECYCLE_LOCK = threading.Lock()


def _jsonable(value: Any) -> Any:
    """Numpy/torch scalars and paths appear in fields; store them as plain JSON values."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return str(value)


def goodput_path(path: str | os.PathLike[str]) -> Path:
    """`path` itself when it names a `.jsonl` file, else `path/goodput.jsonl` (a run directory)."""
    p = Path(path)
    return p if p.suffix == ".jsonl" else p / GOODPUT_FILENAME


class GoodputRecorder:
    """Appends goodput events to a run directory's `goodput.jsonl`.

    `path` is the run directory or the `.jsonl` file itself. `fsync=False` trades crash
    durability of the last events for a cheaper `record` call.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = True) -> None:
        self.path = goodput_path(path)
        self.fsync = fsync
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._key = str(self.path.resolve())

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # the umask decides
        return self._fd

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return the object written; unknown names are a programming error."""
        if event not in EVENTS:
            raise ValueError(f"unknown goodput event {event!r}; known: {sorted(EVENTS)}")
        obj = {"t": time.time(), "event": event, "pid": os.getpid(), **fields}
        line = (json.dumps(obj, default=_jsonable, separators=(",", ":")) + "\n").encode()
        with self._lock:
            fd = self._open()
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        if event in (JOB_START, JOB_END):
            with _LIFECYCLE_LOCK:
                _LIFECYCLE[self._key] = event
        return obj

    def job_open(self) -> bool:
        """Whether this process (or the parent it was forked from) recorded a job_start here not yet ended.

        Lets several components share one lifetime: whoever comes first records job_start.
        """
        with _LIFECYCLE_LOCK:
            return _LIFECYCLE.get(self._key) == JOB_START

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> GoodputRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
