"""`ntp-incidents RUN_DIR`: the integrity findings of a run, one row each (step, kind, rank/replica or
sample, verdict, action, cost in seconds), from `RUN_DIR/integrity/incidents.jsonl`; `--json` prints the
records as written.  Exit 0 with "no findings" when there are none; exit 2 when RUN_DIR is not a run
directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.goodput.incident_log import load_incidents, load_skipped, table


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ntp-incidents", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="an ntp-train run directory (holds metrics.jsonl or .hydra/)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON lines")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir() or not any((run_dir / n).exists() for n in ("metrics.jsonl", ".hydra",
                                                                          "goodput.jsonl", "integrity")):
        raise ConfigError("RUN_DIR", f"{str(run_dir)!r} is not an ntp-train run directory (no metrics.jsonl, "
                          ".hydra/ or integrity/ in it); pass the directory a run wrote, e.g. "
                          "ntp-incidents outputs/gpt_tiny/2026-01-01_00-00-00.")
    records = load_incidents(run_dir)
    if args.json:
        for r in records:
            print(json.dumps(r))
        return 0
    if not records:
        print(f"no findings in {run_dir}")
        return 0
    print(table(records))
    skipped = load_skipped(run_dir)
    if skipped:
        print(f"samples skipped as bad data (a rerun here skips them too): {', '.join(map(str, skipped))}")
    return 0


main = cli_main(run)

if __name__ == "__main__":
    main()
