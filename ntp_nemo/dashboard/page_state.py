"""What the page shows, read from the files a run writes: one JSON-ready document per request.

Nothing here writes or locks a file, and nothing waits on the run: each read takes what is on disk
now (a line still being written is left for the next read).  Goodput comes from the goodput
calculator (`ntp_nemo.goodput.calculator.GoodputCalculator`, fed the new events of each poll: the
figures `ntp-goodput` prints, with its time buckets for the curves), never from a second calculation.

Sources, all inside the run directory:
- `metrics.jsonl`: the loss curve, the layout (`layout`, e.g. "(1,2)") and batch share
  (`microbatches`) of each step;
- `goodput.jsonl`: goodput, badput by category, failures, recoveries and every other event (any
  kind, shown generically in the timeline; a `straggler` event marks its `rank` slow until its
  `straggler_recovered` or the next re-layout);
- `.hydra/run_spec.json`: the nominal layout (replicas, nominal TP, per-layer degrees, stages);
- `failover/heartbeats/rank_NNNNN.json`: each worker process's latest beat (step, phase, time);
- `failover/coordinator.json`: on a cluster job, what `ntp-coordinator` knows (each place's state, host,
  last beat and heartbeat age; the generation; waiting spares), rewritten by it at most once a second;
- `failover/faults/fired_*.json`: injected faults; `integrity/incidents.jsonl`: integrity findings;
  `checkpoints/step_NNNNNN/`: saved checkpoints;
- `summary.json`: the run has ended.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ntp_nemo.goodput.events as ev
from ntp_nemo.checkpoint.manifest import checkpoint_problem
from ntp_nemo.data.bounded_json import JSONInputError, read_json
from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.calculator import GoodputCalculator, load_events
from ntp_nemo.goodput.incident_log import load_incidents
from ntp_nemo.resilience.coordinator import STATE_FILE as COORDINATOR_STATE
from ntp_nemo.topology.topology import effective_degree

RUN_FILES = ("metrics.jsonl", ev.GOODPUT_FILENAME, "summary.json", "train.log")
BUCKET_S = 1.0  # the goodput series' time resolution (the calculator's buckets)
SERIES_BUCKETS = 3600  # an hour of buckets kept (older time is still in the cumulative figures)
ROLLING_WINDOW_S = 30.0  # the rolling goodput's window
MAX_POINTS = 300  # points of each goodput curve sent to the page
MAX_LOSS_POINTS = 20_000  # steps of the loss curve sent to the page (every step up to this many)
MAX_INCIDENTS = 500  # the newest incidents sent to the page
STALE_S = 180.0  # a run not finished that wrote nothing (metrics, events, heartbeats) for this long: stalled
QUIET_EVENTS = frozenset({ev.STEP_START, ev.STEP_END, ev.DATA_WAIT})  # not incidents
_LAYOUT = re.compile(r"^\((\d+(?:,\d+)*)\)")


def classify(path: Path) -> str:
    """'run' (a run directory, started or not), 'sweep' (a directory of runs) or 'empty' (an empty
    directory: a run not started yet).  Anything else raises ConfigError naming the fix."""
    fix = ("pass the run directory ntp-train writes (hydra.run.dir, or outputs/<recipe>/<time>/: it holds "
           ".hydra/, metrics.jsonl, goodput.jsonl) or a sweep directory (multirun/<recipe>/<time>/)")
    if not path.exists():
        raise ConfigError("run_dir", f"{path} does not exist; {fix}.")
    if not path.is_dir():
        raise ConfigError("run_dir", f"{path} is not a directory; {fix}.")
    if ((path / ".hydra").is_dir() or any((path / name).is_file() for name in RUN_FILES)
            or (path / COORDINATOR_STATE).is_file()):
        return "run"
    if (path / "multirun.yaml").is_file() or any(p.is_dir() for p in path.glob("*/.hydra")):
        return "sweep"
    if not any(path.iterdir()):
        return "empty"
    raise ConfigError("run_dir", f"{path} is neither a run directory nor a sweep directory (no .hydra/, "
                      "metrics.jsonl, goodput.jsonl or summary.json in it, and no job directories under "
                      f"it); {fix}.")


def replica_sizes(layout: Any) -> list[int] | None:
    """The active TP ranks per replica of a layout name such as "(1,2)" or "(2,2)xPP2"."""
    m = _LAYOUT.match(str(layout))
    return [int(x) for x in m.group(1).split(",")] if m else None


def _read_json_file(path: Path) -> Any:
    try:
        return read_json(path, 1 << 22, follow_symlinks=False)
    except (OSError, JSONInputError, ValueError):
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


@dataclass
class _Metrics:
    """metrics.jsonl read incrementally: only the bytes appended since the last read are parsed."""

    path: Path
    offset: int = 0
    inode: int | None = None
    by_step: dict[int, dict[str, Any]] = field(default_factory=dict)
    bad_lines: int = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:  # a new file: start again
            self.offset, self.inode, self.by_step, self.bad_lines = 0, st.st_ino, {}, 0
        if st.st_size > self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(st.st_size - self.offset)
            end = chunk.rfind(b"\n") + 1  # a last line without its newline is still being written
            self.offset += end
            for line in chunk[:end].splitlines():
                try:
                    row = json.loads(line)
                    self.by_step[int(row["step"])] = row  # a step redone after a restart: its last run
                except (ValueError, KeyError, TypeError):
                    self.bad_lines += 1
        return [self.by_step[s] for s in sorted(self.by_step)]


@dataclass
class _Goodput:
    """goodput.jsonl read incrementally into the goodput calculator (`GoodputCalculator`: constant work
    per event), so a poll costs what was appended since the last one.  Events the file holds out of time
    order (processes append concurrently) are counted by the calculator at the latest time it saw; once
    the run has ended, a stream that had any is fed again in time order, as `ntp-goodput` reads it, so
    the final figures are `ntp-goodput`'s.  The non-step events are kept for the timeline."""

    path: Path
    offset: int = 0
    inode: int | None = None
    calc: GoodputCalculator | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)
    t0: float | None = None
    last_t: float | None = None
    bad_lines: int = 0
    in_order: bool = False  # fed again from the whole file in time order

    def _reset(self, inode: int | None) -> None:
        self.offset, self.inode, self.calc, self.kept = 0, inode, None, []
        self.t0 = self.last_t = None
        self.bad_lines, self.in_order = 0, False

    def _take(self, events: list[dict[str, Any]]) -> None:
        if self.calc is None:
            self.calc = GoodputCalculator(window_s=ROLLING_WINDOW_S, bucket_s=BUCKET_S,
                                          series_buckets=SERIES_BUCKETS)
        for e in sorted(events, key=lambda e: e["t"]):
            self.calc.feed(e)
            self.t0 = e["t"] if self.t0 is None else min(self.t0, e["t"])
            self.last_t = e["t"] if self.last_t is None else max(self.last_t, e["t"])
            if e["event"] not in QUIET_EVENTS:
                self.kept.append(e)

    def read(self, ended: bool) -> dict[str, Any] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        if st.st_ino != self.inode or st.st_size < self.offset:
            self._reset(st.st_ino)
        if st.st_size > self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(st.st_size - self.offset)
            end = chunk.rfind(b"\n") + 1  # a last line without its newline is still being written
            self.offset += end
            fresh = []
            for line in chunk[:end].splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    e = None
                if isinstance(e, dict) and isinstance(e.get("t"), (int, float)) \
                        and isinstance(e.get("event"), str):
                    fresh.append(e)
                elif line.strip():
                    self.bad_lines += 1
            self._take(fresh)
        if ended and not self.in_order and self.calc is not None and self.calc.late_events:
            try:  # the whole file in time order, as ntp-goodput reads it
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    events = load_events(self.path)
            except ConfigError:
                events = None
            if events is not None:
                offset = self.offset
                self._reset(self.inode)
                self._take(events)
                self.offset, self.in_order = offset, True
        return self.view()

    def view(self) -> dict[str, Any] | None:
        if self.calc is None or self.calc.events_fed == 0:
            return {"report": None, "series": None, "error": f"{self.path} holds no goodput events yet"}
        try:
            report = self.calc.report()
        except ValueError as err:
            return {"report": None, "series": None, "error": str(err)}
        return {"report": report.to_dict(),
                "series": _series(self.calc, report, self.t0 or 0.0, self.last_t or 0.0),
                "rolling": 100 * self.calc.window().goodput, "error": None}


def _series(calc: GoodputCalculator, report: Any, t0: float, last_t: float) -> dict[str, list]:
    """Cumulative goodput, rolling goodput (the last ROLLING_WINDOW_S) and the cumulative badput per
    category at the end of each of the calculator's time buckets, in seconds since the first event; the
    time before the oldest bucket kept is carried in as a base, and the last point is the report's."""
    buckets = calc.series()
    cats = ev.BADPUT_CATEGORIES
    prod = report.productive_s - sum(b["productive_s"] for b in buckets)
    total = report.total_s - sum(b["total_s"] for b in buckets)
    bad = {c: report.badput_s.get(c, 0.0) - sum(b["badput_s"][c] for b in buckets) for c in cats}
    out: dict[str, list] = {"t": [], "goodput": [], "rolling": [], **{c: [] for c in cats}}
    per = max(1, round(ROLLING_WINDOW_S / BUCKET_S))
    stride = -(-len(buckets) // MAX_POINTS)
    for i, b in enumerate(buckets):
        prod, total = prod + b["productive_s"], total + b["total_s"]
        for c in cats:
            bad[c] += b["badput_s"][c]
        if i % stride and i != len(buckets) - 1:
            continue
        recent = buckets[max(0, i + 1 - per): i + 1]
        r_total = sum(x["total_s"] for x in recent)
        out["t"].append(min(b["end"], last_t) - t0)
        out["goodput"].append(100 * prod / total if total > 0 else None)
        out["rolling"].append(100 * sum(x["productive_s"] for x in recent) / r_total if r_total > 0 else None)
        for c in cats:
            out[c].append(max(0.0, bad[c]))
    if out["t"]:  # the latest point: exactly the report (and the calculator's window)
        out["goodput"][-1] = 100 * report.goodput
        for c in cats:
            out[c][-1] = report.badput_s.get(c, 0.0)
    return out


def _details(e: Mapping[str, Any]) -> str:
    skip = {"t", "event", "pid"}
    parts = []
    for k, v in e.items():
        if k in skip:
            continue
        if isinstance(v, float):
            v = f"{v:.3g}"
        parts.append(f"{k}={v}" if not isinstance(v, (dict, list)) else f"{k}={json.dumps(v)[:80]}")
    return " ".join(parts)


def _cost(e: Mapping[str, Any]) -> float | None:
    for key in ("recovery_s", "blocking_s", "seconds", "cost_s"):
        value = e.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def incidents(events: list[dict[str, Any]], faults: list[dict[str, Any]], t0: float,
              findings: list[dict[str, Any]] = (), step_times: Mapping[int, float] | None = None,
              ) -> list[dict[str, Any]]:
    """The timeline: every event but the per-step ones, any kind, with what it cost where it says; the
    injected faults; the integrity findings (`integrity/incidents.jsonl`, placed at the end of their step);
    the newest MAX_INCIDENTS."""
    out = []
    for f in faults:
        if isinstance(f.get("t"), (int, float)):
            out.append({"t": f["t"] - t0, "event": "fault_injected", "details": _details(f), "cost_s": None})
    for e in events:
        if e["event"] not in QUIET_EVENTS:
            out.append({"t": e["t"] - t0, "event": e["event"], "details": _details(e), "cost_s": _cost(e)})
    last = max((r["t"] for r in out), default=0.0)
    for f in findings:
        if isinstance(f, dict):
            at = (step_times or {}).get(f.get("step")) if isinstance(f.get("step"), int) else None
            details = _details({k: v for k, v in f.items() if v is not None})
            out.append({"t": at - t0 if at is not None else last, "event": "integrity_finding",
                        "details": details, "cost_s": _cost(f)})
    out.sort(key=lambda r: r["t"])
    return out[-MAX_INCIDENTS:]


def checkpoints(directory: Path, checked: dict[str, tuple[tuple, str | None]] | None = None
                ) -> list[dict[str, Any]]:
    """Each `step_NNNNNN` directory: step, bytes, and valid (the manifest's size checks) or what is wrong.
    `checked`: earlier verdicts by name and the directory's stamp (inode, mtime, file sizes), reused while
    the stamp holds (a committed checkpoint does not change; checking one reads its whole index)."""
    out: list[dict[str, Any]] = []
    if not directory.is_dir():
        return out
    checked = {} if checked is None else checked
    for p in sorted(directory.iterdir()):
        m = re.fullmatch(r"step_(\d+)(\..*)?", p.name)
        if not m or not p.is_dir():
            continue
        try:
            st = p.stat()
            sizes = tuple(sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.is_file()))
        except OSError:
            st, sizes = None, ()
        stamp = (st.st_ino, st.st_mtime_ns, sizes) if st is not None else None
        hit = checked.get(p.name)
        if stamp is not None and hit is not None and hit[0] == stamp:
            problem = hit[1]
        else:
            try:
                problem = checkpoint_problem(p)
            except (OSError, ValueError, ConfigError) as err:
                problem = str(err)
            if stamp is not None:
                checked[p.name] = (stamp, problem)
        out.append({"name": p.name, "step": int(m.group(1)), "size_bytes": sum(n for _, n in sizes) or None,
                    "valid": problem is None, "problem": problem})
    return out


def _heartbeats(directory: Path, now: float) -> list[dict[str, Any]]:
    out = []
    for p in sorted(directory.glob("rank_*.json")):
        doc = _read_json_file(p)
        if not isinstance(doc, dict) or not isinstance(doc.get("t"), (int, float)):
            continue
        out.append({"file": p.name, "rank": int(p.stem.split("_")[1]), "pid": doc.get("pid"),
                    "step": doc.get("step"), "phase": doc.get("phase"), "age_s": max(0.0, now - doc["t"]),
                    "t": doc["t"]})
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def cluster_view(path: Path, now: float) -> dict[str, Any] | None:
    """What `ntp-coordinator` knows of a cluster job (its state file), or None without one: each place's
    state, host, last (step, phase) and heartbeat age now (its age when written plus the file's age)."""
    doc = _read_json_file(path)
    if not isinstance(doc, dict) or _number(doc.get("t")) is None or not isinstance(doc.get("places"), list):
        return None
    late = max(0.0, now - doc["t"])
    places = []
    for p in doc["places"][:100_000]:
        if not isinstance(p, dict):
            continue
        age = _number(p.get("beat_age_s"))
        places.append({"place": p.get("place"), "state": str(p.get("state", "?"))[:40],
                       "host": str(p["host"])[:200] if p.get("host") is not None else None,
                       "step": p.get("step") if isinstance(p.get("step"), int) else None,
                       "phase": str(p["phase"])[:40] if p.get("phase") is not None else None,
                       "age_s": age + late if age is not None else None})
    spares = doc.get("spares")
    return {"places": places, "generation": doc.get("generation"), "formed": bool(doc.get("formed")),
            "started": bool(doc.get("started")), "ended": bool(doc.get("ended")),
            "stop": str(doc["stop"])[:500] if doc.get("stop") else None,
            "spares": [str(h)[:200] for h in spares[:1000]] if isinstance(spares, list) else [],
            "started_t": _number(doc.get("started_t")), "written_age_s": late}


def layout_view(nominal: Mapping[str, Any] | None, rows: list[dict[str, Any]], events: list[dict[str, Any]],
                beats: list[dict[str, Any]], finished: bool, cluster: dict[str, Any] | None = None,
                ) -> dict[str, Any]:
    """Every nominal replica, its TP slots (ranks) per pipeline stage and their state, the TP degree of
    each layer slot (embedding, layers, head) and the batch share, for the layout of the latest step.
    `state`: 'starting' (no step yet), 'full', 'degraded' (fewer active ranks than nominal) or 'repaired'
    (full again after a failure).  `cluster`: the coordinator's places (`cluster_view`), passed through."""
    failures = [e for e in events if e["event"] == ev.FAILURE_DETECTED]
    current = rows[-1].get("layout") if rows else None
    for e in events:  # a recovery after the latest step: its layout is the one running now
        if e["event"] == ev.RECOVERY_DONE and rows and e["t"] > float(rows[-1].get("time", 0) or 0):
            current = e.get("layout", current)
    sizes = replica_sizes(current) if current else None
    tp = int(nominal["tp"]) if nominal and "tp" in nominal else (max(sizes) if sizes else None)
    nominal_sizes = [int(x) for x in nominal["replica_tp"]] if nominal and "replica_tp" in nominal else None
    dp = len(nominal_sizes) if nominal_sizes else (len(sizes) if sizes else 0)
    pp = int(nominal.get("pp", 1)) if nominal else 1
    layer_tp = [int(x) for x in nominal["layer_tp"]] if nominal and "layer_tp" in nominal else None
    if sizes is None:
        state = "starting"
    elif tp is not None and (len(sizes) < dp or any(n < tp for n in sizes)):
        state = "degraded"
    else:
        state = "repaired" if failures else "full"
    straggling: dict[int, Any] = {}  # rank -> measured speed, while it straggles
    excluded = False  # the newest loss was a straggler taken out of the job (fault.straggler=exclude)
    for e in events:
        if e["event"] == ev.STRAGGLER and isinstance(e.get("rank"), int):
            straggling[e["rank"]] = e.get("speed")
        elif e["event"] == ev.STRAGGLER_RECOVERED and isinstance(e.get("rank"), int):
            straggling.pop(e["rank"], None)
        elif e["event"] == ev.FAILURE_DETECTED:
            excluded = e.get("rank") in straggling
        elif e["event"] == ev.RECOVERY_DONE:  # a new layout numbers the ranks anew
            straggling.clear()
    newest_failure = failures[-1]["t"] if failures else None
    rejoining = any(b["phase"] in ("setup", "train_start") and newest_failure is not None
                    and b["t"] > newest_failure and not finished for b in beats)
    share = rows[-1].get("microbatches") if rows else None
    replicas, rank = [], 0
    for i in range(dp):
        active = sizes[i] if sizes and i < len(sizes) else 0
        nominal_n = nominal_sizes[i] if nominal_sizes else (tp or active)
        stages = []  # ranks are replica-major, then stage, then TP slot (ResolvedLayout.ranks_of)
        for st in range(pp):
            first = rank + st * active
            slots = []
            for s in range(max(nominal_n, active)):
                r = first + s if s < active else None
                if r is not None:
                    slot_state = "slow" if r in straggling else "healthy"
                elif sizes is None:
                    slot_state = "starting"
                elif active == 0:
                    slot_state = "excluded"
                else:
                    slot_state = "rejoining" if rejoining else ("excluded" if excluded else "lost")
                slots.append({"slot": s, "rank": r, "state": slot_state, "speed": straggling.get(r)})
            stages.append(slots)
        if sizes is None:
            replica_state = "starting"
        else:
            replica_state = "dropped" if active == 0 else ("degraded" if active < nominal_n else "full")
        degrees = [effective_degree(t, active) for t in layer_tp] if layer_tp and active else None
        replicas.append({
            "index": i, "active": active, "nominal": nominal_n, "stages": stages, "layer_tp": degrees,
            "share": share[i] if isinstance(share, list) and i < len(share) and active else 0,
            "state": replica_state,
        })
        rank += active * pp
    return {"state": state, "current": current, "nominal_tp": tp, "pp": pp, "replicas": replicas,
            "heartbeats": beats, "failures": len(failures), "cluster": cluster}


@dataclass
class RunReader:
    """One run directory's state, with the caches that keep a poll cheap (metrics read incrementally,
    goodput recomputed only when its file changed)."""

    run_dir: Path
    _metrics: _Metrics = field(init=False)
    _goodput: _Goodput = field(init=False)
    _checked: dict[str, tuple[tuple, str | None]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._metrics = _Metrics(self.run_dir / "metrics.jsonl")
        self._goodput = _Goodput(self.run_dir / ev.GOODPUT_FILENAME)

    def state(self) -> dict[str, Any]:
        now = time.time()
        d = self.run_dir
        rows = self._metrics.read()
        beats = _heartbeats(d / "failover" / "heartbeats", now)
        summary = _read_json_file(d / "summary.json")
        gp = self._goodput.read(ended=isinstance(summary, dict))
        events = self._goodput.kept
        spec = _read_json_file(d / ".hydra" / "run_spec.json")
        nominal = spec.get("layout") if isinstance(spec, dict) else None
        job_ends = [e for e in events if e["event"] == ev.JOB_END]
        last_t = self._goodput.last_t
        finished = isinstance(summary, dict) or bool(job_ends and last_t is not None
                                                     and job_ends[-1]["t"] >= last_t - 5)
        if not rows and not events:
            status = "finished" if finished else "not_started"
        elif finished:
            code = summary.get("exit_code") if isinstance(summary, dict) else None
            failed = code not in (None, 0) or (job_ends and job_ends[-1].get("status") == ev.STATUS_FAILED)
            status = "failed" if failed else "finished"
        else:
            status = "running"
        updated = max((m for m in (_mtime(d / "metrics.jsonl"), _mtime(d / ev.GOODPUT_FILENAME),
                                   *(b["t"] for b in beats)) if m is not None), default=None)
        if status == "running" and updated is not None and now - updated > STALE_S:
            status = "stalled"  # killed, or hung: nothing written for a while
        fired = sorted((d / "failover" / "faults").glob("fired_*.json"))
        faults = [f for f in (_read_json_file(p) for p in fired) if isinstance(f, dict)]
        t0 = self._goodput.t0 if self._goodput.t0 is not None else (rows[0].get("time", now) if rows else now)
        failure_steps = [{"step": e.get("step"), "label": f"failure (rank {e.get('rank')})"}
                         for e in events if e["event"] == ev.FAILURE_DETECTED]
        relayouts = [{"step": b["step"], "label": f"layout {a.get('layout')} -> {b.get('layout')}"}
                     for a, b in zip(rows, rows[1:], strict=False) if a.get("layout") != b.get("layout")]
        stride = -(-len(rows) // MAX_LOSS_POINTS) or 1  # every step up to MAX_LOSS_POINTS, else every k-th
        shown = rows if stride == 1 else [r for i, r in enumerate(rows)
                                          if i % stride == 0 or i == len(rows) - 1]
        return {
            "kind": "run",
            "run_dir": str(d),
            "name": d.name,
            "status": status,
            "updated": updated,
            "now": now,
            "recipe": spec.get("recipe") if isinstance(spec, dict) else None,
            "max_steps": (spec.get("trainer") or {}).get("max_steps") if isinstance(spec, dict) else None,
            "loss": {"step": [r["step"] for r in shown], "loss": [r.get("loss") for r in shown],
                     "step_time_s": [r.get("step_time_s") for r in shown],
                     "layout": [r.get("layout") for r in shown], "every": stride},
            "markers": {"failures": failure_steps, "relayouts": relayouts},
            "layout": layout_view(nominal, rows, events, beats, status != "running",
                                  cluster_view(d / COORDINATOR_STATE, now)),
            "goodput": gp,
            "timeline": incidents(events, faults, t0, load_incidents(d), {
                r["step"]: r["time"] for r in rows if isinstance(r.get("time"), (int, float))}),
            "checkpoints": checkpoints(d / "checkpoints", self._checked),
            "summary": summary if isinstance(summary, dict) else None,
            "bad_lines": {"metrics.jsonl": self._metrics.bad_lines,
                          ev.GOODPUT_FILENAME: self._goodput.bad_lines},
        }


def sweep_state(sweep_dir: Path) -> dict[str, Any]:
    """The table across a sweep's jobs (what `sweep_summary.md` holds, read now), each a link."""
    from ntp_nemo.sweep import collect_rows

    rows = []
    for job in collect_rows(sweep_dir):
        status = job.status
        if status.startswith("missing") and (sweep_dir / job.job / "metrics.jsonl").is_file():
            status = "running"
        rows.append({"job": job.job, "overrides": job.overrides, "status": status, "values": job.values})
    return {"kind": "sweep", "run_dir": str(sweep_dir), "name": sweep_dir.name, "now": time.time(),
            "jobs": rows}


def job_dir(sweep_dir: Path, job: str) -> Path | None:
    """The job directory `job` (a path relative to the sweep) if it is one of the sweep's, else None."""
    from ntp_nemo.sweep import find_job_dirs

    for p in find_job_dirs(sweep_dir):
        if p.relative_to(sweep_dir).as_posix() == job:
            return p
    return None

