"""`ntp-goodput RUN_DIR`: the goodput breakdown table and a PNG timeline of the run.

Reads RUN_DIR/goodput.jsonl (all process lifetimes), prints where the time went and
writes RUN_DIR/goodput_timeline.png (`ntp_nemo/goodput/report.py`: the report and the figure).
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from ntp_nemo.errors import cli_main
from ntp_nemo.goodput.report import TIMELINE_PNG, analyse, breakdown_table


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
