"""The benchmark suite: the comparisons a user runs to weigh ntp_nemo against the alternatives, behind one
command, one results table, and the current-results section of docs/benchmarks.md.

    python bench/suite.py --list                 # every bench/*.py, those of the suite marked
    python bench/suite.py --quick [--only a,b]   # each comparison in its quick mode; prints the table
    python bench/suite.py --quick --write        # ... and writes it into docs/benchmarks.md
    python bench/suite.py --full --only a        # a comparison's full command (minutes to an hour)
    python -m bench ...                          # the same

Each comparison runs as its own process (`python -m bench.NAME ARGS`, so a crash or a hang of one is its
row's, bounded by `--timeout`), and its figures are read from the lines it prints. The table has a column
for the full command's figure and one for the quick mode's: a run fills the cells of what it measured
(with the commit, the date and how long it took) and keeps every other cell as docs/benchmarks.md has it,
so a figure measured once stays, with its command and commit, until it is measured again. Quick figures
come from short runs on a shared machine: they say the comparison still holds; the full figure is the
result.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench suite: begin (python bench/suite.py --write) -->", "<!-- bench suite: end -->"
if __package__ in (None, ""):  # run as `python bench/suite.py`: the checkout's root on the path
    sys.path.insert(0, str(ROOT))
from tests.shapes import TINY_MODEL  # noqa: E402


@dataclass(frozen=True)
class Figure:
    name: str  # what the figure is, as the table says it
    pattern: str  # a regex over the bench's output; group 1 is the value
    recorded: str  # the full command's figure as first recorded (kept until `--full` measures it)
    command: str  # the full command (`python bench/NAME.py ARGS`), which printed `recorded`
    commit: str  # the commit whose docs/benchmarks.md recorded it


@dataclass(frozen=True)
class Comparison:
    bench: str  # bench/<bench>.py
    what: str
    quick: tuple[str, ...] | None  # the quick mode's arguments (None: only the recorded figure)
    figures: tuple[Figure, ...]


SUITE: tuple[Comparison, ...] = (
    Comparison("throughput", "tokens/s: ntp TP2 vs Lightning DTensor TP2, ntp TP1 vs a plain PyTorch loop",
               ("--rounds", "1", "--steps", "8", "--warmup", "2", "--pairs", "tp,tp1"), (
        Figure("ntp TP2 / DTensor TP2 (goal >= 2.0)", r"ntp TP2 / dtensor TP2: tokens/s ratio ([\d.]+)",
               "2.379", "python bench/throughput.py", "8ad91b7"),
        Figure("ntp TP1 / plain loop (goal >= 1.0)", r"ntp TP1 / plain TP1: tokens/s ratio ([\d.]+)",
               "0.988", "python bench/throughput.py", "8ad91b7"),
        # The same ratio by CPU time per step: what a loaded machine distorts least.
        Figure("ntp TP2 / DTensor TP2, by CPU time",
               r"ntp TP2 / dtensor TP2: tokens/s ratio [\d.]+ .*?by CPU time ([\d.]+)", "2.014",
               "python bench/throughput.py", "8ad91b7"),
    )),
    Comparison("checkpoint", "checkpoint save/load: torch.save/torch.load time over the sharded checkpoint's",
               ("--hidden", "256", "--layers", "2", "--vocab", "4096", "--repeat", "2",
                "--train-repeat", "2"), (
        Figure("save: torch.save s / ntp s (goal >= 1.0)", r"ratio save=([\d.]+)", "1.76",
               "python bench/checkpoint.py", "0c03901"),
        Figure("load: torch.load s / ntp s (goal >= 1.0)", r"ratio save=[\d.]+ load=([\d.]+)", "1.64",
               "python bench/checkpoint.py", "0c03901"),
        Figure("TP 2x2 -> TP 3 load: torch.load s / ntp s (goal >= 0.8)", r"reshard_load=([\d.]+)", "0.94",
               "python bench/checkpoint.py", "0c03901"),
    )),
    Comparison("failover", "recovery time of a lost rank: live reshard over checkpoint restart",
               ("--live", "--steps", "6", "--fail-step", "3", "--every", "2", *TINY_MODEL), (
        Figure("live recovery s / restart recovery s", r"live recovery / restart recovery: ([\d.]+)", "0.16",
               "python bench/failover.py --live --steps 8 --fail-step 4 --every 2 " + " ".join(TINY_MODEL),
               "1ee0c71"),
    )),
    Comparison("spares", "time from a lost process to the full layout again: no hot spare over one",
               ("--steps", "24", "--losses", "6,13", "--repair-after", "3"), (
        Figure("loss -> full layout, without / with fault.spares=1",
               r"spares: loss -> full layout, mean without [\d.]+ s, with [\d.]+ s: ratio ([\d.]+)", "5.71",
               "python bench/spares.py", "bb08263"),
    )),
    Comparison("failure_trace", "one seeded failure trace under every policy; the simulator's prediction",
               None, (
        Figure("simulator's worst error on time to step 200", r"predicted within ([\d.]+%)", "1.4%",
               "python bench/failure_trace.py", "c63ea1a"),
    )),
    Comparison("fault_campaign", "seeded compound-fault scenarios checked against the invariants",
               ("--scenarios", "2", "--seed", "1"), (
        Figure("scenarios held", r"fault campaign: (\d+/\d+) scenarios held", "30/30",
               "python bench/fault_campaign.py --seed 5", "748262d"),
    )),
    Comparison("integrity_campaign", "seeded silent-corruption trials (poisoned sample, parameter, "
               "activation and gradient bit flips, a bad device): classified, attributed, the curve kept",
               ("--trials", "1", "--curves", "1", "--clean", "0"), (
        Figure("trials right", r"integrity campaign: (\d+/\d+) trials right", "120/120",
               "python bench/integrity_campaign.py --trials 20 --clean 0", "11cb710"),
    )),
    Comparison("hostile", "hostile clients against a live cluster coordinator", ("--quick",), (
        Figure("attacks withstood", r"hostile clients: (\d+/\d+) attacks withstood", "23/23",
               "python bench/hostile.py", "dee24dc"),
    )),
    Comparison("memory", "saved activations: full recomputation against none (GPT-2, flash SDPA)",
               ("--sections", "1", "--layers", "2", "--hidden", "128", "--seq-len", "128"), (
        Figure("saved bytes, none / full recompute", r"gpt2\s+default\s+full\s+[\d.]+\s+([\d.]+)", "9.56",
               "python bench/memory.py", "0d8310c"),
    )),
    Comparison("dry_run", "dry run grouped by slice shape against every rank on its own",
               ("--replica-tp", "4,3", "--plans-world", "0", "--cli", ""), (
        Figure("per rank CPU / grouped CPU", r"per rank / short builds: [\d.]+x wall, ([\d.]+x) CPU", "2.4x",
               "python bench/dry_run.py", "9cbdd9d"),
    )),
    Comparison("gpu_check", "the CUDA path (default recipe, NTP layout, checkpoint, Llama MFU), rehearsed on "
               "CPU (no GPU figure is recorded yet)", ("--rehearse", "--only", "default", "--steps", "2"), (
        Figure("parts ok, CPU rehearsal", r"gpu_check rehearsal: (\d+/\d+) parts ok", "4/4",
               "python bench/gpu_check.py --rehearse", "fb2a0ef"),
    )),
    Comparison("block_sharding", "bytes moved and memory kept per rank of each matmul class, block and "
               "row/column at degrees 4 and 9, measured against ntp-plan --patterns' model",
               ("--degrees", "4"), (
        Figure("largest deviation from the model (goal <= 5%)",
               r"largest deviation of measured from predicted: ([\d.]+%)", "0.00%",
               "python bench/block_sharding.py", "25b7212"),
    )),
)


def listing() -> list[tuple[str, bool, str]]:
    """(name, in the suite, the first line of its docstring) of every bench script, new ones included."""
    named = {c.bench for c in SUITE}
    out = []
    for f in sorted(BENCH.glob("*.py")):
        if f.name.startswith("_") or f.stem == "suite":
            continue
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        out.append((f.stem, f.stem in named, doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


def full_args(f: Figure) -> list[str]:
    """The arguments of `f`'s full command (`python bench/NAME.py ARGS`)."""
    return shlex.split(f.command)[2:]


def run(c: Comparison, args: Sequence[str], timeout_s: float) -> tuple[dict[str, str], str]:
    """{figure name: value} that `python -m bench.NAME ARGS` printed, and how long it took (or why no figure
    came out)."""
    cmd = [sys.executable, "-m", f"bench.{c.bench}", *args]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {}, f"over {timeout_s:.0f} s"
    found = {f.name: m.group(1) for f in c.figures if (m := re.search(f.pattern, proc.stdout))}
    if not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        return {}, f"exit {proc.returncode}, no figure ({tail[0][:80]})"
    return found, f"{time.time() - t0:.0f} s"


def quick_command(c: Comparison) -> str:
    return " ".join(["python -m", f"bench.{c.bench}", *(shlex.quote(a) for a in c.quick or ())])


HEAD = ["bench", "figure", "full run", "its command (commit)", "quick run",
        "its command (commit, date, time)"]


def current_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The rows of the results table now in docs/benchmarks.md, by (bench, figure)."""
    if BEGIN not in text:
        return {}
    rows = {}
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(cells) == len(HEAD) and cells[0] not in ("bench", "---"):
            rows[cells[0].strip("`"), cells[1]] = cells
    return rows


def table(full: dict[tuple[str, str], tuple[str, str]], quick: dict[tuple[str, str], tuple[str, str]],
          commit: str, old: dict) -> list[list[str]]:
    """One row per figure, a full and a quick column: a figure measured now (value, how long), else the
    doc's cells, else the recorded full figure (and no quick one)."""
    rows, today = [], time.strftime("%Y-%m-%d")
    for c in SUITE:
        for f in c.figures:
            key = (c.bench, f.name)
            unmeasured = f"`{quick_command(c)}`" if c.quick is not None else "no quick mode"
            row = old.get(key) or [f"`{c.bench}`", f.name, f.recorded, f"`{f.command}` ({f.commit})", "-",
                                   unmeasured]
            if row[4] == "-":  # no quick figure yet: the quick command as the suite runs it now
                row[5] = unmeasured
            if key in full:
                row[2:4] = [full[key][0], f"`{f.command}` ({commit}, {today}, {full[key][1]})"]
            if key in quick:
                row[4:6] = [quick[key][0], f"`{quick_command(c)}` ({commit}, {today}, {quick[key][1]})"]
            rows.append(row)
    return rows


def render(rows: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(r) + " |" for r in [HEAD, ["---"] * len(HEAD), *rows])


def write_doc(text: str, body: str) -> str:
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text:
        return text.split(BEGIN, 1)[0] + block + text.split(END, 1)[1]
    raise SystemExit(f"{DOC} has no results section ({BEGIN!r})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list every bench script, those of the suite marked")
    ap.add_argument("--quick", action="store_true", help="run each comparison's quick mode")
    ap.add_argument("--full", action="store_true", help="run each figure's full command (minutes to an hour)")
    ap.add_argument("--only", default="", help="comma-separated benches of the suite to run")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on each command (s)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.list:
        for name, in_suite, first in listing():
            print(f"{'suite' if in_suite else '     '}  {name:22s} {first}")
        return 0
    only = {x for x in args.only.split(",") if x}
    unknown = only - {c.bench for c in SUITE}
    if unknown:
        ap.error(f"not in the suite: {sorted(unknown)} (see --list)")
    full: dict[tuple[str, str], tuple[str, str]] = {}
    quick: dict[tuple[str, str], tuple[str, str]] = {}
    for c in SUITE:
        if only and c.bench not in only:
            continue
        runs = []
        if args.quick and c.quick is not None:
            runs.append((quick, list(c.quick), quick_command(c)))
        if args.full:
            for command in dict.fromkeys(f.command for f in c.figures):
                runs.append((full, full_args(next(f for f in c.figures if f.command == command)), command))
        for into, run_args, shown in runs:
            print(f"suite: {shown}", flush=True)
            found, took = run(c, run_args, args.timeout)
            print(f"suite:   {found or 'no figure'} ({took})", flush=True)
            into.update({(c.bench, k): (v, took) for k, v in found.items()})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    text = DOC.read_text()
    body = render(table(full, quick, commit, current_rows(text)))
    print(body)
    if args.write:
        DOC.write_text(write_doc(text, body))
        print(f"suite: wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
