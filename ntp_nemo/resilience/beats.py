"""Progress beats, the data: each rank's latest (step, phase) and who is behind (`suspects`).

Written by `heartbeat.Heartbeat` (files, under `ntp-train`) or sent by a cluster task on its link to
the coordinator (sealed, with a tick); read by the monitors.  No Lightning here: the coordinator imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ntp_nemo.data.bounded_json import read_json

# Order of the phases that carry the same step: `step_start` carries the step being run, the others
# the last completed step, so (step, phase) orders all reports of a run.
PHASES = {
    "setup": -2,
    "train_start": -1,
    "step_start": 0,
    "step_end": 1,
    "validation": 2,
    "save": 2,
    "end": 3,
}


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    phase: str
    t: float
    pid: int
    done_t: float | None = None  # when this rank last completed a step in its current process, if it did

    @property
    def progress(self) -> tuple[int, int]:
        return (self.step, PHASES[self.phase])

    @property
    def training(self) -> bool:
        """Past setup and not yet finished: the phase where a silent rank means a stall."""
        return self.phase not in ("setup", "end")


def beat_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.json"


def read_beats(directory: Path, world_size: int) -> dict[int, Beat]:
    """Latest heartbeat of every rank that wrote one (unreadable files are skipped, as never written: a
    FIFO, a link, a file over 64 KiB, deeply nested JSON or an unknown phase never blocks or breaks the
    monitor that reads them)."""
    out: dict[int, Beat] = {}
    for rank in range(world_size):
        try:
            doc = read_json(beat_path(directory, rank), 1 << 16, follow_symlinks=False)
            done = doc.get("done_t")
            beat = Beat(rank, int(doc["step"]), str(doc["phase"]), float(doc["t"]), int(doc["pid"]),
                        None if done is None else float(done))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if beat.phase in PHASES:
            out[rank] = beat
    return out


def suspects(beats: dict[int, Beat], world_size: int) -> tuple[int, ...]:
    """Ranks strictly behind the others (a rank that never reported is behind everyone); () when all agree."""
    missing = tuple(r for r in range(world_size) if r not in beats)
    if missing:
        return missing if len(missing) < world_size else ()
    least = min(b.progress for b in beats.values())
    behind = tuple(sorted(r for r, b in beats.items() if b.progress == least))
    return behind if len(behind) < world_size else ()
