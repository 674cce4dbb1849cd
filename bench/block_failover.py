"""A block-sharded replica's live failover and repair, run again and again: does the way back to the
grid ever hang?

    python bench/block_failover.py [--runs 10] [--timeout 400]

Each run is `ntp-train` on the tests' tiny model (`tests/shapes.py`) with two replicas on 2x2 grids
(`ntp.pattern=block mesh.tp=4 ntp.replica_tp=[4,4]`), rank 5 killed at step 2 (`fault.recovery=live`,
`fault.repair_after_steps=1`), 8 steps, no checkpoint: the damaged replica goes on as TP 3 (row/column)
from its peers' memory, the repaired process rejoins and the replica returns to its grid.  A run holds
when it exits 0, its console says `(4,3) -> (4,4)` and no process was killed as hung, and every step's
loss is within 1e-5 (relative) of the one-process run of the same 8 steps (run once first).  The test
`tests/resilience/test_block_failover_cli.py` is one such run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.shapes import TINY_OVERRIDES  # noqa: E402

COMMON = [*TINY_OVERRIDES, "trainer.max_steps=8", "checkpoint.every_n_steps=0",
          "checkpoint.save_on_end=false"]
SINGLE = ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null"]
FAILOVER = ["mesh.dp=2", "mesh.tp=4", "ntp.replica_tp=[4,4]", "ntp.pattern=block", "fault=kill_rank",
            "fault.rank=5", "fault.step=2", "fault.recovery=live", "fault.repair_after_steps=1"]


def _train(run: Path, overrides: list[str], timeout: int) -> tuple[int | None, str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "ntp_nemo.train", *COMMON, *overrides,
                               f"hydra.run.dir={run}"], cwd=run.parent, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out, time.monotonic() - t0
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=400, help="seconds one run may take")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="block_failover_") as tmp:
        root = Path(tmp)
        rc, out, _ = _train(root / "single", SINGLE, args.timeout)
        if rc != 0:
            print(f"the one-process reference failed (exit {rc}):\n{out[-3000:]}")
            return 1
        want = _losses(root / "single")
        held = 0
        for i in range(1, args.runs + 1):
            run = root / f"run{i}"
            rc, out, wall = _train(run, FAILOVER, args.timeout)
            why = []
            if rc != 0:
                why.append("timed out" if rc is None else f"exit {rc}")
            if "(4,3) -> (4,4)" not in out:
                why.append("never back on the grid")
            if "hung" in out:
                why.append("a process killed as hung")
            worst = None
            if rc == 0:
                got = _losses(run)
                worst = max((abs(got[s] - want[s]) / abs(want[s]) for s in want), default=None) \
                    if sorted(got) == sorted(want) else None
                if worst is None or worst > 1e-5:
                    why.append(f"off the curve ({worst})")
            held += not why
            rel = "-" if worst is None else f"{worst:.1e}"
            print(f"run {i:2d}: {'held' if not why else 'FAILED: ' + ', '.join(why)}; wall {wall:.1f} s; "
                  f"largest relative loss difference {rel}", flush=True)
            if why:
                print(out[-3000:], flush=True)
        print(f"block failover 2x2 -> TP 3 -> 2x2: {held}/{args.runs} runs back on the grid, on the curve")
        return 0 if held == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
