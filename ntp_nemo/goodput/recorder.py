"""Append-only goodput event recorder (`goodput.jsonl`).

Each event is one JSON line written with a single `write` on an `O_APPEND` descriptor, so a killed
process (even SIGKILL) leaves every line it wrote intact (the kernel holds them) and several
processes (a restarted job, a supervisor) can append to the same file without interleaving.
Only a machine crash can lose written lines; the recorder bounds that: it fsyncs at the events
the calculator cannot do without (job start and end, failures and recoveries, the ends of
checkpoint saves and restores) and otherwise at most every `sync_every_s` seconds, so per-step
events cost a `write`, not an fsync, and a crash loses at most `sync_every_s` of step events.
The recorder never reads the file: analysis is the offline calculator's job.  For a running figure
(the goodput a training callback logs while the job runs), `remember` makes it keep what it writes in
memory as well, after the earlier events its caller supplies.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ntp_nemo.goodput.events as ev

# Events whose loss would change the figures (a lifetime without its end, a failure not seen, a
# save that never ended): each is on disk before `record` returns.
DURABLE_EVENTS = frozenset({
    ev.JOB_START, ev.JOB_END, ev.FAILURE_DETECTED, ev.RECOVERY_DONE, ev.CKPT_SAVE_END,
    ev.CKPT_SAVE_ABORT, ev.CKPT_COMMIT, ev.CKPT_RESTORE_END,
})
SYNC_EVERY_S = 30.0  # the most step events a machine crash can lose, in seconds of training


def _jsonable(value: Any) -> Any:
    """Numpy/torch scalars and paths appear in fields; store them as plain JSON values."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return str(value)


def goodput_path(path: str | os.PathLike[str]) -> Path:
    """`path` itself when it names a `.jsonl` file, else `path/goodput.jsonl` (a run directory)."""
    p = Path(path)
    return p if p.suffix == ".jsonl" else p / ev.GOODPUT_FILENAME


class GoodputRecorder:
    """Appends goodput events to a run directory's `goodput.jsonl`.

    `path` is the run directory or the `.jsonl` file itself. `fsync=False` never fsyncs (a
    machine crash may then lose any event; a killed process still loses none).
    `clock` gives each event's `t` (default `time.time`).
    """

    def __init__(
        self, path: str | os.PathLike[str], fsync: bool = True, sync_every_s: float = SYNC_EVERY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = goodput_path(path)
        self.clock = clock  # the events' `t` (synthetic streams pass their own)
        self.fsync = fsync
        self.sync_every_s = sync_every_s
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._synced_at = time.monotonic()
        self._kept: list[dict[str, Any]] | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # the umask decides
        return self._fd

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return the object written; unknown names are a programming error."""
        if event not in ev.EVENTS:
            raise ValueError(f"unknown goodput event {event!r}; known: {sorted(ev.EVENTS)}")
        obj = {"t": self.clock(), "event": event, "pid": os.getpid(), **fields}
        line = (json.dumps(obj, default=_jsonable, separators=(",", ":")) + "\n").encode()
        with self._lock:
            fd = self._open()
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            now = time.monotonic()
            if self.fsync and (event in DURABLE_EVENTS or now - self._synced_at >= self.sync_every_s):
                os.fsync(fd)
                self._synced_at = now
            if self._kept is not None:
                self._kept.append(obj)
        return obj

    def remember(self, earlier: Callable[[], list[dict[str, Any]]] = list) -> list[dict[str, Any]]:
        """Keep every event recorded from now on in memory too, after `earlier()` (the events written
        before, e.g. the file's; called under the recorder's lock, so no event of this recorder falls
        between the two).  Returns that list; each `record` appends to it."""
        with self._lock:
            self._kept = list(earlier())
            return self._kept

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
