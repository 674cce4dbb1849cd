"""The goodput report of a run (`ntp-goodput RUN_DIR`, `ntp_nemo/cli/goodput.py`): the breakdown table
and a PNG timeline.

Reads RUN_DIR/goodput.jsonl (all process lifetimes), prints where the time went and
writes RUN_DIR/goodput_timeline.png: step executions coloured by layout (redone or
interrupted ones hatched), checkpoint saves and restores, failures and layout changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

import ntp_nemo.goodput.events as ev
from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.calculator import (
    LIST_EACH_UP_TO,
    Failure,
    GoodputCalculator,
    GoodputReport,
    Timeline,
    build_timeline,
    failure_kinds,
    load_events,
    longest_failures,
    replay_file,
)
from ntp_nemo.goodput.recorder import goodput_path

TIMELINE_PNG = "goodput_timeline.png"
MAX_KIND_ROWS = 8  # failure kinds listed in the table; the rest are summed in one row
LONGEST = 5  # the longest recoveries listed by name
STEP_TIMELINE_MAX_EVENTS = 50_000  # beyond this the PNG shows badput over time instead of each step
SERIES_BUCKET_S = 60.0  # the time resolution of the badput-over-time figure of a long run


def breakdown_table(report: GoodputReport) -> Table:
    table = Table(title="Goodput breakdown", title_justify="left")
    table.add_column("category")
    table.add_column("seconds", justify="right")
    table.add_column("% of job", justify="right")
    pct = lambda s: f"{100 * s / report.total_s:.1f}" if report.total_s > 0 else "-"
    table.add_row("productive", f"{report.productive_s:.2f}", pct(report.productive_s), style="green")
    for category in ev.BADPUT_CATEGORIES:
        seconds = report.badput_s[category]
        table.add_row(category, f"{seconds:.2f}", pct(seconds), style=None if seconds else "dim")
    table.add_row("total", f"{report.total_s:.2f}", pct(report.total_s), end_section=True)
    table.add_row("goodput", "", f"{100 * report.goodput:.1f}", style="bold")
    table.add_row("NTP capacity fraction", "", f"{100 * report.capacity_fraction:.1f}")
    # Goodput counts capacity (degraded throughput is badput); this is the share at any speed.
    table.add_row("progress at any capacity", "", f"{100 * report.progress_goodput:.1f}", end_section=True)
    table.add_row("steps completed", str(report.steps_completed), "")
    table.add_row("steps redone", str(report.steps_redone), "")
    table.add_row("failures", str(report.failures), "")
    if len(report.failure_recoveries) <= LIST_EACH_UP_TO:
        for i, r in enumerate(report.failure_recoveries):
            table.add_row(f"  failure {i + 1}{_who(r)}: {r['mode']} recovery", f"{r['recovery_s']:.2f}", "")
    else:  # a row per kind and the longest few, however many failures the job had
        kinds = failure_kinds(report)
        for k in kinds[:MAX_KIND_ROWS]:
            table.add_row(f"  {k['count']} x {k['mode']} recovery after {k['reason'] or 'a failure'}",
                          f"{k['total_s']:.2f}", pct(k["total_s"]))
            table.add_row("    mean / longest (s)", f"{k['mean_s']:.2f} / {k['max_s']:.2f}", "", style="dim")
        if len(kinds) > MAX_KIND_ROWS:
            rest = kinds[MAX_KIND_ROWS:]
            seconds = sum(k["total_s"] for k in rest)
            table.add_row(f"  {sum(k['count'] for k in rest)} more in {len(rest)} other kinds",
                          f"{seconds:.2f}", pct(seconds))
        for i, r in longest_failures(report, LONGEST):
            what = f"{r['mode']} after {r.get('reason') or 'a failure'}"
            table.add_row(f"  longest: failure {i}{_who(r)}, {what}", f"{r['recovery_s']:.2f}", "",
                          style="dim")
    table.add_row("process lifetimes", str(report.lifetimes), "")
    if report.idle_s > 0:
        table.add_row("idle between runs (excluded)", f"{report.idle_s:.2f}", "")
    return table


def _who(r: dict[str, Any]) -> str:
    return failure_who(Failure(0.0, r.get("rank"), "", process=r.get("process")))


def failure_who(f: Failure) -> str:
    """' (process P, rank R)': who was lost, as the processes and ranks were at the failure."""
    parts = ([f"process {f.process}"] if f.process is not None else []) + (
        [f"rank {f.rank}"] if f.rank is not None else [])
    return f" ({', '.join(parts)})" if parts else ""


def legend_labels(tl: Timeline) -> list[str]:
    """The timeline's legend entries: a step colour per layout, then only the kinds the run has."""
    labels = [f"step on {name}" for name in dict.fromkeys(s.layout for s in tl.steps if s.completed)]
    present = {
        "wasted step": any(not r.productive for r in tl.steps),
        "ckpt save": bool(tl.saves),
        "ckpt restore": bool(tl.restores),
        "init": bool(tl.initializations),
        "failure -> first step": bool(tl.recoveries),
    }
    return labels + [label for label, yes in present.items() if yes]


def plot_timeline(tl: Timeline, report: GoodputReport, out: Path) -> Path:
    """Draw the run's timeline with matplotlib's Agg backend (no display needed)."""
    from ntp_nemo.errors import require_extra

    matplotlib = require_extra("matplotlib", "plots", "--no-plot", "the timeline plot",
                               "pass --no-plot for the numbers alone")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = tl.start
    layouts = list(dict.fromkeys(s.layout for s in tl.steps if s.completed))
    palette = plt.get_cmap("Set2")
    colour = {name: palette(i % 8) for i, name in enumerate(layouts)}
    lanes = {"steps": 4.0, "checkpoint": 3.0, "init": 2.0, "recovery": 1.0}
    fig, ax = plt.subplots(figsize=(12, 3.8))

    def bars(spans: list[tuple[float, float]], lane: str, face: Any, **style: Any) -> None:
        if spans:
            ax.broken_barh(
                [(a - t0, b - a) for a, b in spans], (lanes[lane] - 0.35, 0.7), facecolors=face, **style
            )

    # One collection per (layout, kind) keeps long runs cheap to draw; thin edges separate steps.
    edge = {"edgecolor": "white", "linewidth": 0.3} if len(tl.steps) <= 300 else {}
    for name in layouts:
        bars(
            [(r.start, r.end) for r in tl.steps if r.productive and r.layout == name],
            "steps",
            colour[name],
            **edge,
        )
    wasted = [(r.start, r.end) for r in tl.steps if not r.productive]
    bars(wasted, "steps", "lightgrey", edgecolor="black", hatch="///", linewidth=0.3)
    bars([(s.start, s.end) for s in tl.saves], "checkpoint", "tab:blue")
    bars([(s.start, s.end) for s in tl.restores], "checkpoint", "tab:purple")
    bars([(s.start, s.end) for s in tl.initializations], "init", "grey")
    bars([(s.start, s.end) for s in tl.recoveries], "recovery", "salmon")
    for f in tl.failures:
        ax.axvline(f.t - t0, color="red", linestyle="--", linewidth=1)
        label = "failure" + failure_who(f)
        ax.annotate(label + (" ?" if f.implicit else ""), (f.t - t0, 4.45), color="red", fontsize=7)
    previous = None
    for run in (s for s in tl.steps if s.completed):
        if previous is not None and run.layout != previous:
            ax.axvline(run.start - t0, color="black", linestyle=":", linewidth=0.8)
            ax.annotate(f"layout -> {run.layout}", (run.start - t0, 4.6), fontsize=7)
        previous = run.layout

    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_ylim(0.5, 4.85)
    ax.set_xlim(0, max(tl.end - t0, 1e-9))
    ax.set_xlabel("seconds since first event")
    ax.set_title(
        f"goodput {100 * report.goodput:.1f}%, NTP capacity {100 * report.capacity_fraction:.1f}%, "
        f"steps redone: {report.steps_redone}, failures: {report.failures}"
    )
    styles = {
        "wasted step": {"facecolor": "lightgrey", "hatch": "///", "edgecolor": "black"},
        "ckpt save": {"facecolor": "tab:blue"},
        "ckpt restore": {"facecolor": "tab:purple"},
        "init": {"facecolor": "grey"},
        "failure -> first step": {"facecolor": "salmon"},
    }
    handles = [Patch(facecolor=colour[name], label=f"step on {name}") for name in layouts]
    handles += [Patch(label=label, **styles[label]) for label in legend_labels(tl) if label in styles]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # the legend right of the axes and the labels stay whole
    plt.close(fig)
    return out


def plot_series(series: list[dict[str, Any]], report: GoodputReport, out: Path) -> Path:
    """A long run's figure: the share of each minute (or coarser) spent productive and in each badput
    category, from the calculator's series, as stacked areas (a step timeline would be one bar a step)."""
    from ntp_nemo.errors import require_extra

    matplotlib = require_extra("matplotlib", "plots", "--no-plot", "the timeline plot",
                               "pass --no-plot for the numbers alone")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = max(1, len(series) // 400)  # at most ~400 points across
    points = [series[i:i + per] for i in range(0, len(series), per)]
    t0 = series[0]["start"]
    x = [(p[0]["start"] - t0) / 3600.0 for p in points]
    names = ["productive", *ev.BADPUT_CATEGORIES]

    def share(p: list[dict[str, Any]], name: str) -> float:
        total = sum(b["total_s"] for b in p)
        got = sum(b["productive_s"] if name == "productive" else b["badput_s"][name] for b in p)
        return 100.0 * got / total if total > 0 else 0.0

    ys = [[share(p, name) for p in points] for name in names]
    keep = [(name, y) for name, y in zip(names, ys, strict=True) if any(v > 0 for v in y)]
    fig, ax = plt.subplots(figsize=(12, 3.8))
    ax.stackplot(x, *[y for _, y in keep], labels=[name for name, _ in keep], step="post")
    ax.set_xlabel("hours since first event")
    ax.set_ylabel("% of job time")
    ax.set_ylim(0, 100)
    ax.set_title(f"goodput {100 * report.goodput:.1f}%, NTP capacity {100 * report.capacity_fraction:.1f}%, "
                 f"steps redone: {report.steps_redone}, failures: {report.failures}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def analyse(run_dir: str | Path, plot: bool = True) -> tuple[GoodputReport, Path | None]:
    """The report for a run directory (or a goodput .jsonl file); writes the timeline PNG beside the file.
    The numbers come from the incremental calculator reading the file a chunk at a time."""
    file = goodput_path(run_dir)
    calc = GoodputCalculator(bucket_s=SERIES_BUCKET_S, series_buckets=10**9)
    try:
        calc = replay_file(file, calc)
        report = calc.report()
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("run_dir", f"{file} holds inconsistent goodput events: {err}.") from None
    png = None
    if plot and calc.events_fed <= STEP_TIMELINE_MAX_EVENTS:
        png = plot_timeline(build_timeline(load_events(file)), report, file.parent / TIMELINE_PNG)
    elif plot:
        png = plot_series(calc.series(), report, file.parent / TIMELINE_PNG)
    return report, png
