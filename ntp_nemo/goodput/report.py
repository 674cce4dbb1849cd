"""`ntp-goodput RUN_DIR`: the goodput breakdown table and a PNG timeline of the run.

Reads RUN_DIR/goodput.jsonl (all process lifetimes), prints where the time went and
writes RUN_DIR/goodput_timeline.png: step executions coloured by layout (redone or
interrupted ones hatched), checkpoint saves and restores, failures and layout changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import ntp_nemo.goodput.events as ev
from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.goodput.calculator import (
    Failure,
    GoodputReport,
    Timeline,
    breakdown,
    build_timeline,
    load_events,
)
from ntp_nemo.goodput.recorder import goodput_path

TIMELINE_PNG = "goodput_timeline.png"


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
    for i, r in enumerate(report.failure_recoveries):
        who = failure_who(Failure(0.0, r.get("rank"), "", process=r.get("process")))
        table.add_row(f"  failure {i + 1}{who}: {r['mode']} recovery", f"{r['recovery_s']:.2f}", "")
    table.add_row("process lifetimes", str(report.lifetimes), "")
    if report.idle_s > 0:
        table.add_row("idle between runs (excluded)", f"{report.idle_s:.2f}", "")
    return table


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


def analyse(run_dir: str | Path, plot: bool = True) -> tuple[GoodputReport, Path | None]:
    """The report for a run directory (or a goodput .jsonl file); writes the timeline PNG beside the file."""
    file = goodput_path(run_dir)
    events = load_events(file)
    try:
        tl = build_timeline(events)
        report = breakdown(tl)
    except (ValueError, KeyError) as err:
        raise ConfigError("run_dir", f"{file} holds inconsistent goodput events: {err}.") from None
    png = plot_timeline(tl, report, file.parent / TIMELINE_PNG) if plot else None
    return report, png


def _main() -> int:
    parser = argparse.ArgumentParser(prog="ntp-goodput", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding goodput.jsonl (or the .jsonl file)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--no-plot", action="store_true", help=f"do not write {TIMELINE_PNG}")
    args = parser.parse_args()
    plot = not args.no_plot and _can_plot()  # the numbers need no matplotlib: a missing one is a note
    report, png = analyse(args.run_dir, plot=plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = Console()
        console.print(breakdown_table(report))
        if png is not None:
            console.print(f"timeline: {png}", soft_wrap=True)
    if not args.no_plot and not plot:
        print(f"note: {TIMELINE_PNG} not written: the timeline plot needs matplotlib, which is not installed "
              "(pip install 'ntp_nemo[plots]'); pass --no-plot to leave it out", file=sys.stderr, flush=True)
    return 0


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


main = cli_main(_main)

if __name__ == "__main__":
    main()
