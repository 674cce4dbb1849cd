"""The run's record of integrity findings: `integrity/incidents.jsonl` in the run directory, one JSON object
per finding, appended by global rank 0 (`resilience.integrity` writes it; `ntp-incidents RUN_DIR`, the
run summary and the benches read it), and `integrity/skipped_samples.json`, the training samples a
finding took out of the stream (a rerun or resume in the same directory skips them too).

A finding: `step`, `kind` (nonfinite | spike | divergence), `rank`, `replica`, `sample`, `parameter`
(whichever apply, else null), `verdict` (data | transient | device | bitflip | reproducible | unknown),
`action` (what was done, in words), `cost_s` (seconds the detection and the action took), `detail`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

INTEGRITY_DIR = "integrity"
INCIDENTS = "incidents.jsonl"
SKIPPED = "skipped_samples.json"
FIELDS = ("step", "kind", "rank", "replica", "sample", "parameter", "verdict", "action", "cost_s", "detail")


def incidents_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / INTEGRITY_DIR / INCIDENTS


def skipped_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / INTEGRITY_DIR / SKIPPED


def append_incident(run_dir: str | Path, finding: dict[str, Any]) -> dict[str, Any]:
    """Append one finding (missing fields as null) and return it as written."""
    record = {k: finding.get(k) for k in FIELDS}
    record.update({k: v for k, v in finding.items() if k not in record})
    path = incidents_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def load_incidents(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every finding of the run (a line cut short by a crash is skipped)."""
    path = incidents_path(run_dir)
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def load_skipped(run_dir: str | Path) -> list[int]:
    """The sample ids recorded as skipped (empty when none)."""
    path = skipped_path(run_dir)
    try:
        return sorted(int(i) for i in json.loads(path.read_text()).get("samples", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def record_skipped(run_dir: str | Path, ids: Iterable[int]) -> list[int]:
    """Add `ids` to the recorded skipped samples (written whole: temporary file and rename)."""
    path = skipped_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = sorted(set(load_skipped(run_dir)) | {int(i) for i in ids})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"samples": samples}) + "\n")
    tmp.replace(path)
    return samples


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The `integrity` entry of summary.json: findings by kind and verdict, samples skipped, seconds."""
    by: dict[str, int] = {}
    for r in records:
        key = f"{r.get('kind')}/{r.get('verdict')}"
        by[key] = by.get(key, 0) + 1
    return {"findings": len(records), "by_kind": by,
            "skipped_samples": sorted({int(r["sample"]) for r in records
                                       if r.get("verdict") == "data" and r.get("sample") is not None}),
            "cost_s": round(sum(float(r.get("cost_s") or 0.0) for r in records), 6)}


def _who(r: dict[str, Any]) -> str:
    if r.get("sample") is not None:
        return f"sample {r['sample']}"
    parts = []
    if r.get("replica") is not None:
        parts.append(f"replica {r['replica']}")
    if r.get("rank") is not None:
        parts.append(f"rank {r['rank']}")
    if r.get("parameter"):
        parts.append(str(r["parameter"]))
    return ", ".join(parts) or "-"


def table(records: list[dict[str, Any]]) -> str:
    """One row per finding: step, kind, rank/replica or sample, verdict, action, cost in seconds."""
    head = ("step", "kind", "where", "verdict", "action", "cost s")
    rows = [(str(r.get("step")), str(r.get("kind")), _who(r), str(r.get("verdict")), str(r.get("action")),
             f"{float(r.get('cost_s') or 0.0):.3f}") for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=False)).rstrip()
                     for row in (head, *rows))


__all__ = ["FIELDS", "append_incident", "incidents_path", "load_incidents", "load_skipped", "record_skipped",
           "skipped_path", "summary", "table"]
