"""Startup: how long `ntp-train` takes before it answers, for the commands a user types first.

    python bench/startup.py [--baseline-root /tmp/startup_base] [--root CHECKOUT] [--repeats 5]
                            [--run-repeats 3] [--cases TEXT]

Each command runs in a fresh Python process, the way the `ntp-train` console script runs it
(`ntp_nemo.cli.train:main` with the command's arguments), several times; the table gives best and median
wall seconds from the process start to

- `--help`: its exit;
- a misspelt key (`model.hiden_size=64`) and a bad value (`model.hidden_size=-3`): the exit with code 2;
- `trainer.dry_run=true` on the tests' tiny model: its exit (it validates and sizes every rank without
  starting a worker);
- a tiny run (the tests' TINY overrides, `trainer.max_steps=2`, the default NTP layout (2,1): three
  forked workers): the first worker's fork (the launching process has composed and validated the
  config, imported what the workers run and prepared the data), the end of the first training step
  (the `time` of step 1 in metrics.jsonl) and the exit.

The column "heavy imports" names which of torch, torch.distributed, lightning, modelopt, matplotlib,
transformers were imported by the command's own process (from `python -X importtime`, one extra run).

With `--baseline-root`, a second checkout of the project (e.g. `git worktree add /tmp/startup_base
<commit>`) runs every command too, interleaved with the timed checkout's runs (baseline, current, baseline,
...), so that load from other processes falls on both alike; its package and its `conf/` and
`recipes/` are the ones imported there. Last, the largest import costs of a tiny run's launching
process, summed by top-level package (self time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __package__ in (None, ""):  # run as `python bench/startup.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import TINY_OVERRIDES as TINY  # noqa: E402  (the tests' TINY: a 2-layer model for 2 cores)

HEAVY = ("torch", "torch.distributed", "lightning", "modelopt", "matplotlib", "transformers")

# Runs `ntp_nemo.cli.train:main` (`ntp_nemo.train:main` in older checkouts) from the checkout ROOT
# (argv[1]) with the rest of argv, as the console script does; `ntp_nemo.conf`/`ntp_nemo.recipes` are that
# checkout's conf/ and recipes/ (an editable install of another checkout would otherwise supply its own).
LAUNCH = """\
import importlib.util, sys
root = sys.argv[1]
sys.path.insert(0, root)
for name, sub in (("ntp_nemo.conf", "conf"), ("ntp_nemo.recipes", "recipes")):
    spec = importlib.util.spec_from_file_location(
        name, f"{root}/{sub}/__init__.py", submodule_search_locations=[f"{root}/{sub}"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
sys.argv = ["ntp-train", *sys.argv[2:]]
try:
    from ntp_nemo.cli.train import main
except ModuleNotFoundError:  # a checkout from before ntp-train's command moved to ntp_nemo/cli/
    from ntp_nemo.train import main
sys.exit(main())
"""


# A line on stderr where a worker is forked, with the time (the first one marks the launch; with
# -X importtime the worker's own imports come after it).
FORK_MARK = "-- forked"
MARK_FORK = (
    "import os, sys, time\n"
    f"os.register_at_fork(after_in_child=lambda: sys.stderr.write(f'{FORK_MARK} {{time.time()}}\\n'))\n"
)


def command(root: Path, args: list[str], importtime: bool = False) -> list[str]:
    flags = ["-X", "importtime"] if importtime else []
    return [sys.executable, *flags, "-c", MARK_FORK + LAUNCH, str(root), *args]


def environment(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONPROFILEIMPORTTIME")}
    return dict(env, PYTHONUNBUFFERED="1", NTP_NEMO_CACHE=str(cache))


def cases(work: Path) -> dict[str, dict]:
    """name -> arguments, expected exit code, whether it is a training run (first step timed)."""
    return {
        "--help": {"args": ["--help"], "rc": 0},
        "typo (model.hiden_size=64)": {"args": ["model.hiden_size=64"], "rc": 2},
        "bad value (model.hidden_size=-3)": {"args": ["model.hidden_size=-3"], "rc": 2},
        "dry run (tiny)": {"args": [*TINY, "trainer.dry_run=true"], "rc": 0, "run_dir": True},
        "tiny run, 2 steps": {"args": [*TINY, "trainer.max_steps=2", "resume=never"], "rc": 0,
                              "run_dir": True, "train": True},
    }


def run_once(root: Path, case: dict, work: Path, env: dict[str, str], importtime: bool = False) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    args = [*case["args"], *([f"hydra.run.dir={run_dir}"] if case.get("run_dir") else [])]
    t0 = time.time()
    proc = subprocess.run(command(root, args, importtime), cwd=work, env=env, capture_output=True, text=True)
    end = time.time() - t0
    if proc.returncode != case["rc"]:
        raise RuntimeError(f"{root}: {args} exited {proc.returncode}, expected {case['rc']}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    out = {"end": end, "stderr": proc.stderr}
    if case.get("train"):
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        out["first_step"] = first["time"] - t0
        forks = [float(line.split()[-1]) for line in proc.stderr.splitlines() if line.startswith(FORK_MARK)]
        out["fork"] = min(forks) - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def imported(stderr: str) -> set[str]:
    """Modules imported by the command's own process (before it forks any worker)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith(FORK_MARK):
            break
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def package_costs(stderr: str, top: int) -> list[tuple[str, float]]:
    """Self import time summed by top-level package, largest first (seconds), up to the first fork."""
    costs: Counter[str] = Counter()
    for line in stderr.splitlines():
        if line.startswith(FORK_MARK):
            break
        if line.startswith("import time:") and "self [us]" not in line:
            self_us, _, name = line[len("import time:"):].split("|")
            costs[name.strip().split(".")[0]] += int(self_us) / 1e6
    return costs.most_common(top)


def stats(xs: list[float]) -> str:
    return f"{min(xs):6.2f} {statistics.median(xs):6.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-root", type=Path, help="another checkout of the project, run beside this one")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to time (default: this one)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per fast command (help, errors)")
    ap.add_argument("--run-repeats", type=int, default=3, help="runs of the dry run and the tiny run")
    ap.add_argument("--top", type=int, default=12, help="packages listed in the import costs")
    ap.add_argument("--cases", default="", help="time only the commands whose name contains this text")
    args = ap.parse_args()
    roots = {"current": args.root.resolve()}
    if args.baseline_root:
        roots = {"baseline": args.baseline_root.resolve(), "current": args.root.resolve()}
    one, five, _ = os.getloadavg()
    print(f"load average at start: {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs")
    for name, root in roots.items():
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        print(f"{name:8s} {root} at {commit}{' with uncommitted changes' if dirty else ''}")

    with tempfile.TemporaryDirectory(prefix="ntp_startup_") as tmp:
        work = Path(tmp)
        env = environment(work / "cache")
        table = {name: case for name, case in cases(work).items() if args.cases in name}
        for root in roots.values():  # fills the corpus cache and the bytecode caches: not timed
            run_once(root, cases(work)["tiny run, 2 steps"], work, env)
        results: dict[tuple[str, str], list[dict]] = {}
        heavy: dict[tuple[str, str], str] = {}
        for case_name, case in table.items():
            n = args.run_repeats if case.get("run_dir") else args.repeats
            for _ in range(n):
                for name, root in roots.items():
                    results.setdefault((case_name, name), []).append(run_once(root, case, work, env))
            for name, root in roots.items():
                got = imported(run_once(root, case, work, env, importtime=True)["stderr"])
                heavy[case_name, name] = ", ".join(h for h in HEAVY if h in got) or "none"

        print("\nwall seconds from process start (best, median)")
        print(f"{'command':34s} {'checkout':8s} {'best':>6s} {'median':>6s}  heavy imports")
        for case_name, case in table.items():
            for name in roots:
                runs = results[case_name, name]
                if case.get("train"):
                    fork = stats([r["fork"] for r in runs])
                    print(f"{case_name + ': first fork':34s} {name:8s} {fork}  {heavy[case_name, name]}")
                    first = stats([r["first_step"] for r in runs])
                    print(f"{case_name + ': first step':34s} {name:8s} {first}")
                    label = case_name + ": exit"
                else:
                    label = case_name
                print(f"{label:34s} {name:8s} {stats([r['end'] for r in runs])}  "
                      f"{'' if case.get('train') else heavy[case_name, name]}")
        if "baseline" in roots:
            print("\nmedian current / median baseline")
            for case_name, case in table.items():
                keys = ["fork", "first_step", "end"] if case.get("train") else ["end"]
                for key in keys:
                    cur = statistics.median(r[key] for r in results[case_name, "current"])
                    base = statistics.median(r[key] for r in results[case_name, "baseline"])
                    print(f"{case_name + ('' if len(keys) == 1 else ': ' + key):34s} {cur / base:5.2f}")

        for name, root in roots.items() if "tiny run, 2 steps" in table else ():
            traced = run_once(root, table["tiny run, 2 steps"], work, env, importtime=True)
            costs = package_costs(traced["stderr"], args.top)
            print(f"\nimport costs of the tiny run's launching process before it forks ({name}; "
                  "self seconds by package):")
            print("  " + ", ".join(f"{pkg} {sec:.2f}" for pkg, sec in costs))
    one, five, _ = os.getloadavg()
    print(f"\nload average at end: {one:.2f} (1 min) {five:.2f} (5 min)")


if __name__ == "__main__":
    main()
