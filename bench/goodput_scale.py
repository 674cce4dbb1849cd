"""Goodput at any length: `ntp-goodput` on a two-million-event file, against the calculator as it was
before it became incremental, and the running goodput the training callback logs at step 100,000.

    python bench/goodput_scale.py [--events 2000000] [--baseline-events 400000] [--steps 100000]
                                  [--baseline-commit 40ac047] [--work DIR]

1. Two synthetic streams written through `GoodputRecorder` (`ntp_nemo.goodput.synthetic`): the large one
   (`--events`, failures of every kind: live recoveries and rejoins, restarts, silent deaths, one per
   ~2,000 steps) and the issue's smaller one (`--baseline-events`: 200,000 steps, 200 live recoveries).
2. `ntp-goodput FILE --no-plot` (the console script, a fresh process) on both, and the calculator of
   `--baseline-commit` (its `load_events`, `build_timeline` and `breakdown`: what `ntp-goodput` ran then,
   less the table) on the smaller one, each in its own process: wall and CPU seconds side by side, the
   per-event CPU time and its ratio.  The two calculators' figures on the smaller file are compared too.
3. `GoodputCallback` on a stand-in trainer with a logger that keeps what it receives, `--steps` steps
   with a live recovery and a rejoin every 10,000 steps, the running figures asked for every 50 steps:
   the step of the last figure logged and the cost of one figure near the start and near the end.

Timings are of this machine as it is (the load average is printed beside them); compare CPU seconds
when other work shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ntp_nemo.goodput import events as ev  # noqa: E402
from ntp_nemo.goodput.synthetic import LIVE, StreamShape, write_stream  # noqa: E402

BASELINE_DRIVER = """
import importlib.util, json, os, sys, time
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # its events module, baseline_events.py, beside it
spec = importlib.util.spec_from_file_location("baseline_calculator", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["baseline_calculator"] = old
spec.loader.exec_module(old)
r = old.breakdown(old.build_timeline(old.load_events(sys.argv[2])))
print(json.dumps({"goodput": r.goodput, "total_s": r.total_s, "failures": r.failures}))
"""


def _lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(buf.count(b"\n") for buf in iter(lambda: fh.read(1 << 20), b""))


def stream(work: Path, name: str, events: int, failures: int, kinds: tuple[str, ...],
           ckpt_every: int) -> tuple[Path, int]:
    """A synthetic run of about `events` events (about two a step, and the steps a restart redoes),
    written once and kept in `work`."""
    run = work / name
    file = run / ev.GOODPUT_FILENAME
    if not file.exists():
        steps = events // 2
        write_stream(run, StreamShape(steps=steps, failures=failures, seed=1, kinds=kinds,
                                      ckpt_every=ckpt_every, data_wait_every=0))
    return file, _lines(file)


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of a command (its own process), and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"},
                          check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def running_goodput(work: Path, steps: int) -> dict[str, float]:
    """Drive the callback for `steps` steps; the logged steps and the cost of a figure early and late."""
    from ntp_nemo.lightning.goodput_callback import GoodputCallback

    class Sink:
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.last: dict[str, float] = {}

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.steps.append(step)
            self.last = metrics

    run = work / "running"
    if run.exists():
        for f in run.iterdir():
            f.unlink()
    sink = Sink()
    cb = GoodputCallback(str(run), fsync=False)
    cb.set_global_zero(True)
    strategy = SimpleNamespace(layout_info={"layout": "(4,4)", "capacity": 1.0})
    trainer = SimpleNamespace(loggers=[sink], log_every_n_steps=50, global_step=0, strategy=strategy)
    module = SimpleNamespace(last_step={"tokens": 4096})
    cb.setup(SimpleNamespace(is_global_zero=True, **vars(trainer)), module, "fit")
    cb.on_train_start(trainer, module)
    cost: dict[int, float] = {}
    for step in range(1, steps + 1):
        trainer.global_step = step - 1
        cb.on_train_batch_start(trainer, module, None, step - 1)
        if step % 10_000 == 5_000:  # a rank lost and resharded live; its replacement rejoins 1,000 later
            cb.record(ev.FAILURE_DETECTED, rank=3, reason="collective error", step=step)
            cb.record(ev.RECOVERY_DONE, layout="(4,3)", step=step, mode=LIVE, recovery_s=1e-4)
            strategy.layout_info = {"layout": "(4,3)", "capacity": 15 / 16}
        if step % 10_000 == 6_000:
            cb.record(ev.RECOVERY_DONE, layout="(4,4)", step=step, mode=LIVE, rejoin=True, recovery_s=1e-4)
            strategy.layout_info = {"layout": "(4,4)", "capacity": 1.0}
        trainer.global_step = step
        if step in (1_000, steps):
            t0 = time.process_time()
            cb.on_train_batch_end(trainer, module, None, None, step - 1)
            cost[step] = time.process_time() - t0
        else:
            cb.on_train_batch_end(trainer, module, None, None, step - 1)
    cb.teardown(SimpleNamespace(is_global_zero=True, **vars(trainer)), module, "fit")
    return {"last_logged_step": sink.steps[-1], "logged": len(sink.steps),
            "goodput": sink.last["goodput/goodput"], "window_goodput": sink.last["goodput/window/goodput"],
            "failures_s": sink.last["goodput/recovery_downtime_s"] + sink.last["goodput/reshard_s"],
            "cost_early_ms": 1e3 * cost[1_000], "cost_late_ms": 1e3 * cost[steps],
            "events": _lines(run / ev.GOODPUT_FILENAME)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--baseline-events", type=int, default=400_000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--baseline-commit", default="40ac047")
    ap.add_argument("--work", type=Path, default=None, help="keep the streams here (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="goodput_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; streams in {work}", flush=True)

    big, big_n = stream(work, "big", args.events, args.events // 4000, ("live", "restart", "silent"), 100)
    small, small_n = stream(work, "small", args.baseline_events, 200, (LIVE,), 1000)
    baseline = work / "baseline_calculator.py"  # the calculator and its event names as they were then
    for module, name in (("calculator", baseline.name), ("events", "baseline_events.py")):
        source = subprocess.run(["git", "-C", str(ROOT), "show",
                                 f"{args.baseline_commit}:ntp_nemo/goodput/{module}.py"],
                                capture_output=True, text=True, check=True).stdout
        source = source.replace("import ntp_nemo.goodput.events as ev", "import baseline_events as ev")
        (work / name).write_text(source)
    cli = [sys.executable, "-m", "ntp_nemo.cli.goodput"]
    rows = []
    wall, cpu, out = timed([sys.executable, "-c", BASELINE_DRIVER, str(baseline), str(small)])
    old = json.loads(out.strip().splitlines()[-1])
    rows.append((f"calculator of {args.baseline_commit}", small_n, wall, cpu))
    wall, cpu, out = timed([*cli, str(small), "--no-plot", "--json"])
    new = json.loads(out)
    rows.append(("ntp-goodput --no-plot (now)", small_n, wall, cpu))
    wall, cpu, _ = timed([*cli, str(big), "--no-plot"])
    rows.append(("ntp-goodput --no-plot (now)", big_n, wall, cpu))
    wall_plot, cpu_plot, _ = timed([*cli, str(big)])
    rows.append(("ntp-goodput, with its PNG (now)", big_n, wall_plot, cpu_plot))

    print(f"\n{'what':34} {'events':>10} {'wall s':>8} {'cpu s':>8} {'cpu us/event':>13}")
    for what, n, wall, cpu in rows:
        print(f"{what:34} {n:>10,} {wall:>8.2f} {cpu:>8.2f} {1e6 * cpu / n:>13.2f}")
    per_old, per_new = rows[0][3] / rows[0][1], rows[2][3] / rows[2][1]
    print(f"per event: {per_old / per_new:.1f}x less CPU now ({args.events:,}-event file) than the "
          f"{args.baseline_commit} calculator ({args.baseline_events:,}-event file)")
    same = abs(old["goodput"] - new["goodput"]) < 1e-9 and old["failures"] == new["failures"]
    print(f"same figures on the smaller file: {same} (goodput {old['goodput']:.6f} then, "
          f"{new['goodput']:.6f} now; failures {old['failures']} / {new['failures']})")

    print(f"\nrunning goodput: {args.steps:,} steps through GoodputCallback, figures asked for every 50")
    r = running_goodput(work, args.steps)
    print(f"  last figure logged at step {r['last_logged_step']:,} ({r['logged']:,} logged, "
          f"{r['events']:,} events in the file); goodput {r['goodput']:.4f}, "
          f"last hour {r['window_goodput']:.4f}")
    print(f"  one step's end with its figure: {r['cost_early_ms']:.2f} ms CPU at step 1,000, "
          f"{r['cost_late_ms']:.2f} ms at step {args.steps:,}")
    yes = {True: "yes", False: "no"}
    wall, cpu = rows[2][2], rows[2][3]
    print(f"goodput_scale: ntp-goodput on {big_n:,} events in {wall:.1f} s wall, {cpu:.1f} s CPU (under "
          f"10 s: wall {yes[wall < 10.0]}, CPU {yes[cpu < 10.0]}); running goodput logged at step "
          f"{args.steps:,}: {yes[r['last_logged_step'] == args.steps]}")


if __name__ == "__main__":
    main()
