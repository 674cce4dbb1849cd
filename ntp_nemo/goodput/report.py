"""`ntp-goodput RUN_DIR`: the goodput breakdown table and a PNG timeline of the run.

Reads RUN_DIR/goodput.jsonl (all process lifetimes), prints where the time went and
writes RUN_DIR/goodput_timeline.png: step executions coloured by layout (redone or
interrupted ones hatched), checkpoint saves and restores, failures and layout changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.calculator import GoodputReport, Span, Timeline, breakdown, build_timeline, load_events
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
    table.add_row("capacity-weighted goodput", "", f"{100 * report.effective_goodput:.1f}", end_section=True)
    table.add_row("steps completed", str(report.steps_completed), "")
    table.add_row("steps redone", str(report.steps_redone), "")
    table.add_row("failures", str(report.failures), "")
    table.add_row("process lifetimes", str(report.lifetimes), "")
    if report.idle_s > 0:
        table.add_row("idle between runs (excluded)", f"{report.idle_s:.2f}", "")
    return table


def plot_timeline(tl: Timeline, report: GoodputReport, out: Path) -> Path:
    """Draw the run's timeline with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = tl.start
    layouts = list(dict.fromkeys(s.layout for s in tl.steps if s.completed))
    palette = plt.get_cmap("tab10")
    colour = {name: palette(i % 10) for i, name in enumerate(layouts)}
    fig, ax = plt.subplots(figsize=(12, 3.6))
    lanes = {"steps": 3.0, "checkpoint": 2.0, "init / recovery": 1.0}

    for run in tl.steps:
        face = colour.get(run.layout, "lightgrey") if run.completed else "lightgrey"
        ax.broken_barh(
            [(run.start - t0, run.end - run.start)],
            (lanes["steps"] - 0.35, 0.7),
            facecolors=face,
            edgecolor="black" if not run.productive else "none",
            hatch=None if run.productive else "///",
            linewidth=0.4,
        )

    def lane(spans: list[Span], y: float, height: float, colour: str) -> None:
        ax.broken_barh(
            [(s.start - t0, s.duration) for s in spans], (y - height / 2, height), facecolors=colour
        )

    lane(tl.saves, lanes["checkpoint"], 0.7, "tab:blue")
    lane(tl.restores, lanes["checkpoint"], 0.7, "tab:purple")
    lane(tl.initializations, lanes["init / recovery"], 0.7, "grey")
    lane(tl.recoveries, lanes["init / recovery"], 0.3, "salmon")
    for f in tl.failures:
        ax.axvline(f.t - t0, color="red", linestyle="--", linewidth=1)
        label = "failure (implicit)" if f.implicit else "failure"
        ax.annotate(label, (f.t - t0, 3.55), color="red", fontsize=7)
    previous = None
    for run in (s for s in tl.steps if s.completed):
        if previous is not None and run.layout != previous:
            ax.axvline(run.start - t0, color="black", linestyle=":", linewidth=0.8)
            ax.annotate(f"layout → {run.layout}", (run.start - t0, 2.55), fontsize=7, rotation=20)
        previous = run.layout

    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_ylim(0.4, 3.9)
    ax.set_xlim(0, max(tl.end - t0, 1e-9))
    ax.set_xlabel("seconds since first event")
    ax.set_title(
        f"goodput {100 * report.goodput:.1f}%, NTP capacity {100 * report.capacity_fraction:.1f}%, "
        f"{report.steps_redone} steps redone, {report.failures} failures"
    )
    handles = [Patch(facecolor=colour[name], label=f"step: {name}") for name in layouts]
    handles += [
        Patch(facecolor="lightgrey", hatch="///", edgecolor="black", label="wasted step"),
        Patch(facecolor="tab:blue", label="ckpt save"),
        Patch(facecolor="tab:purple", label="ckpt restore"),
        Patch(facecolor="grey", label="init"),
        Patch(facecolor="salmon", label="recovery"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
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
    report, png = analyse(args.run_dir, plot=not args.no_plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    console = Console()
    console.print(breakdown_table(report))
    if png is not None:
        console.print(f"timeline: {png}")
    return 0


main = cli_main(_main)

if __name__ == "__main__":
    main()
