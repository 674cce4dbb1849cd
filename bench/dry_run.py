"""Dry run: grouping ranks by slice shape against running every rank's step on its own; the
command-line dry run of this tree against the tree before its speed-up.

    python bench/dry_run.py [--replica-tp 8,7] [--pp 1] [--plans-world 526] [--before 6e7767c]
                            [--cli 63,1022]

1. The dry run of a Llama 3 8B layout (default (8,7): 15 ranks), three times in this process: grouped
   on short builds (one step per distinct step shape on 2 and 3 layers per stage, extended to the
   stage's length; every rank's sync plan in one pass: the default), grouped on whole stages
   (`scale_layers=False`) and per rank (every rank runs its own whole step and derives its own plan with
   `build_sync_plan`).  All must give the same per-rank results; the figures are wall and CPU seconds
   and their ratios.
2. The sync plans alone for a large layout (default 526 ranks: 32 x TP 8 + TP 7, PP 2): all ranks in
   one pass (`build_sync_plans`) against `build_sync_plan` for the first 8 ranks (its time per rank, and
   the plans of those ranks compared).
3. The world-wide communicator splits before step 1 of that layout (`--plans-world`): the groups a
   rank's `StageLinks` creates (one per stage pair and direction) against two per link, and the total
   the dry run prints (`communicator_splits`).
4. `ntp-train recipe=llama3_8b trainer.dry_run=true` on 63 ranks (`mesh.dp=8 mesh.tp=8 mesh.pp=1
   ntp.replica_tp=[8,8,8,8,8,8,8,7]`) and on 1,022 (`mesh.dp=64 data.global_batch_size=1024
   ntp.replica_tp=[8 x 63, 7]`, the recipe's PP 2), each a process of its own: "after" runs the
   committed tree (`git archive HEAD`), "before" the same tree with the dry run's files as they were at
   `--before` (default 6e7767c, the commit before the dry-run speed-up: `ntp_nemo/runtime/dry_run.py`,
   `ntp_nemo/topology/topology.py`), so the two differ by the speed-up alone (both byte-compiled before
   the timed runs).  Printed: user + system CPU seconds of each process (interpreter, Hydra and imports
   included) and whether the two `dry_run.json` files hold the same figures (every field but
   `timings_s`).  Both read the config tree of the installed package.  `--cli ''` skips part 4.

Load from other processes changes wall time; CPU time (`time.process_time`) is printed next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import build_sync_plan, build_sync_plans, param_descriptors
from ntp_nemo.runtime.dry_run import StepShape, dry_run, fake_world
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology

LLAMA3_8B = ModelConfig(arch="llama", name="llama3_8b", vocab_size=128256, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, max_seq_len=8192,
                        tie_embeddings=False, rope_theta=500000.0)
SHAPE = StepShape(seq_len=8192, micro_batch_size=1, param_dtype=torch.float32, compute_dtype=torch.bfloat16)


ROOT = Path(__file__).resolve().parents[1]
SPEEDUP_FILES = ("ntp_nemo/runtime/dry_run.py", "ntp_nemo/topology/topology.py")
CLI_LAYOUTS = {
    63: ["mesh.dp=8", "mesh.tp=8", "mesh.pp=1", "ntp.replica_tp=[8,8,8,8,8,8,8,7]"],
    1022: ["mesh.dp=64", "data.global_batch_size=1024",
           "ntp.replica_tp=[" + ",".join(["8"] * 63 + ["7"]) + "]"],
}


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def committed_tree(dest: Path, before: str | None = None) -> Path:
    """The committed tree (HEAD) in `dest`; with `before`, `SPEEDUP_FILES` as they were at that commit."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for f in SPEEDUP_FILES if before else ():
        old = subprocess.run(["git", "show", f"{before}:{f}"], cwd=ROOT, capture_output=True, check=True)
        (dest / f).write_bytes(old.stdout)
    # Byte-compiled once, as an installed tree is: the timed runs do not compile the package.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "ntp_nemo")], check=True)
    return dest


def cli_dry_run(tree: Path, overrides: list[str], run_dir: Path) -> tuple[float, float, dict]:
    """One `ntp-train ... trainer.dry_run=true` process on `tree`: (wall s, user + system CPU s, report)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    args = [sys.executable, "-m", "ntp_nemo.train", "recipe=llama3_8b", "trainer.dry_run=true", *overrides,
            f"hydra.run.dir={run_dir}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w = time.perf_counter()
    res = subprocess.run(args, env=env, cwd=run_dir.parent, capture_output=True, text=True)
    wall = time.perf_counter() - w
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args[2:])} on {tree} exited {res.returncode}:\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads((run_dir / "dry_run.json").read_text())


def figures(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "timings_s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-tp", default="8,7", help="active TP ranks per replica (nominal TP = max)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--plans-world", type=int, default=526, help="0 skips part 2")
    ap.add_argument("--before", default="6e7767c", help="part 4: the commit of the dry run's files before")
    ap.add_argument("--cli", default="63,1022",
                    help="part 4: rank counts of the command-line runs ('' skips)")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")

    replica_tp = [int(x) for x in args.replica_tp.split(",")]
    topology = Topology(max(replica_tp), replica_tp, [max(replica_tp)] * 34, pp=args.pp)
    layout = ResolvedLayout.make(topology, num_microbatches=8 * len(replica_tp))
    import torch._dynamo  # noqa: F401  (imported by the first optimizer step: kept out of the first side)

    short, hw, hc = timed(lambda: dry_run(layout, LLAMA3_8B, SHAPE, measure_options=False))
    grouped, gw, gc = timed(lambda: dry_run(layout, LLAMA3_8B, SHAPE, measure_options=False,
                                            scale_layers=False))
    single, sw, sc = timed(lambda: dry_run(layout, LLAMA3_8B, SHAPE, measure_options=False,
                                           group_ranks=False))
    rows = [[dataclasses.asdict(r) for r in res.ranks] for res in (short, grouped, single)]
    same = rows[0] == rows[1] == rows[2]
    print(f"\n1. dry run of {layout.describe()} ({layout.world_size} ranks, Llama 3 8B)")
    slices = len({r.signature for r in grouped.ranks})
    print(f"   grouped, short builds: {hw:7.1f} s wall {hc:7.1f} s CPU  ({slices} slices)")
    print(f"   grouped, whole stages: {gw:7.1f} s wall {gc:7.1f} s CPU")
    print(f"   per rank             : {sw:7.1f} s wall {sc:7.1f} s CPU")
    print(f"   whole stages / short builds: {gw / hw:.1f}x wall, {gc / hc:.1f}x CPU; per rank / short "
          f"builds: {sw / hw:.1f}x wall, {sc / hc:.1f}x CPU; identical per-rank results: {same}")

    if args.plans_world:
        dp = (args.plans_world // 2 + 7) // 8
        sizes = [8] * (dp - 1) + [args.plans_world // 2 - 8 * (dp - 1)]
        big = ResolvedLayout.make(Topology(8, sizes, [8] * 34, pp=2))
        topo = big.topology()
        desc: dict = {}
        for r in range(big.world_size):  # one slice per signature, as the dry run builds them
            c = topo.coord(r)
            sig = (topo.replica_tp[c.replica], c.stage, c.slot)
            if sig not in desc:
                with fake_world(r, big.world_size):
                    desc[sig] = param_descriptors(RankPlace(big, r, device="meta").build_model(LLAMA3_8B, 0))
        everyone = [desc[(topo.replica_tp[c.replica], c.stage, c.slot)] for c in topo.coords]
        replica_of = [c.replica for c in topo.coords]
        plans, aw, ac = timed(lambda: build_sync_plans(everyone, replica_of))
        k = 8
        per, pw, pc = timed(lambda: [build_sync_plan(r, everyone, replica_of) for r in range(k)])
        same = all(per[r] == plans[r] for r in range(k))
        print(f"\n2. sync plans of {big.describe()[:24]}... ({big.world_size} ranks)")
        print(f"   all ranks in one pass     : {aw:7.2f} s wall {ac:7.2f} s CPU")
        print(f"   build_sync_plan, {k} ranks  : {pw:7.2f} s wall {pc:7.2f} s CPU "
              f"({pc / k:.3f} s CPU per rank; x {big.world_size} ranks = "
              f"{pc / k * big.world_size:.0f} s CPU, extrapolated)")
        print(f"   same plans for those ranks: {same}")

        from ntp_nemo.pipeline.p2p import StageLinks, link_pairs
        from ntp_nemo.runtime.dry_run import communicator_splits, splits_line

        made: list[list[int]] = []
        StageLinks(topo, 0, lambda ranks: made.append(list(ranks)))
        splits = communicator_splits(topo, plans, big.schedule, checkpoint_group=True)
        print(f"\n3. communicator splits before step 1 ({big.world_size} ranks, PP {topo.pp})")
        print(f"   pipeline link groups: {len(made)} (one per stage pair and direction); two per link "
              f"would be {2 * len(link_pairs(topo))}")
        print(f"   {splits_line(splits)}")

    if args.cli:
        print(f"\n4. ntp-train recipe=llama3_8b trainer.dry_run=true, one process each; before: "
              f"{', '.join(SPEEDUP_FILES)} at {args.before}; load average {os.getloadavg()[0]:.1f}")
        with tempfile.TemporaryDirectory(prefix="ntp_dry_run_bench_") as tmp:
            trees = {"before": committed_tree(Path(tmp) / "before", args.before),
                     "after": committed_tree(Path(tmp) / "after")}
            for n in (int(x) for x in args.cli.split(",")):
                out = {side: cli_dry_run(tree, CLI_LAYOUTS[n], Path(tmp) / f"{side}_{n}")
                       for side, tree in trees.items()}
                (bw, bc, brep), (aw, ac, arep) = out["before"], out["after"]
                same = figures(brep) == figures(arep)
                keys = set(figures(brep)) | set(figures(arep))
                differ = sorted(k for k in keys if brep.get(k) != arep.get(k))
                print(f"   {n:5d} ranks: before {bc:6.1f} s CPU ({bw:6.1f} s wall), after {ac:6.1f} s CPU "
                      f"({aw:6.1f} s wall): {bc / ac:.1f}x CPU; same dry_run.json figures: {same}"
                      + (f" (differ: {', '.join(differ)})" if differ else ""))


if __name__ == "__main__":
    main()
