"""Stragglers: a rank slowed to half speed, found while the job runs and given less work, against the same
job that only reports it, the failure-free job, and the detector's own cost.

    python bench/stragglers.py [--steps 200] [--fault-step 20] [--factor 0.5] [--clean-runs 3] [overrides ...]
    python bench/stragglers.py --components    # only the CPU cost per step of each piece, timed alone
    python bench/stragglers.py --in-group [--steps 60] [--fault-step 3]   # shards by speed, one replica

`--in-group`: one replica of TP 2 (`mesh.dp=1`: no other replica to take batch share), a wider tiny GPT
(hidden 256, FFN 1024, 64 tokens: compute, not collectives, fills the step), rank 1 at `--factor` from
`--fault-step`: `rebalance` (its shards weighted by measured speed, `fault.straggler_shards=auto`, a live
re-layout) beside `report` and the failure-free job, step by step; printed: the re-layout's step and
weights, the median step time after it on each side, rebalance / report, and the loss against the
failure-free job.

The job: 2 DP replicas of TP 2 (4 processes, `ntp.replica_tp=[2,2]`), the tests' tiny GPT at a batch of
6 micro-batches, through the real `ntp-train` CLI; global rank 1 computes at `--factor` of its speed from
step `--fault-step` to the end (`fault=slow fault.factor=...`).  Runs take turns step by step
(`bench._common.run_side_by_side`: one side computes while the others wait, so the load of a shared
machine falls on all of them alike):

1. `rebalance` (the default policy: the straggler watch names the rank and its replica gets a batch share
   proportional to its measured speed) beside `report` (`fault.straggler=report`: the same job, the
   straggler only reported) and the failure-free job (`clean_ref`, also the loss curve's reference).
   Printed: the step its `straggler` event names rank 1 at; the median step time after the last
   rebalance, next to what the work model predicts for the measured speeds: the failure-free side's
   median step over the same steps (the step's fixed costs, gradient sync and optimizer, at the load of
   those moments) plus the modelled compute of the new split at those speeds minus that of the nominal
   split at full speed (both from the `rebalance` event, measured at its judgement window), scaled by
   the failure-free side's step time after over its time at that window (the load's drift); the former
   check's figure (the fixed costs taken from steps 5-19, at another load) beside it; the report run's
   median over the same steps and the paired per-step ratio;
2. `--clean-runs` failure-free runs with the watch on beside one with it off (`fault.straggler_every=0`:
   no timer, nothing added to the fused all-reduce): every `straggler` event of a watched run is a false
   alarm; the detector's cost is the median of the paired per-step ratios watched / unwatched (wall and
   rank 0's CPU time), next to the noise floor: the watched runs against each other (the same job); and
   what the watch itself spends, timed inside each watched run (its console line at the end: the compute
   timer's bookkeeping and the detector and policy, CPU per step on rank 0) against rank 0's CPU per step.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import TOY_JOB, load_average, ntp_side, paired_ratio, run_side_by_side  # noqa: E402

LAYOUT = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "checkpoint.every_n_steps=0",
          "checkpoint.save_on_end=false", "resume=never"]


def component_costs(n: int = 2000) -> str:
    """CPU microseconds per step of what the watch adds, each piece timed alone in this process: the
    compute timer's phase and reading, the fused scalars' per-rank slots (a 4-rank world), the detector
    (its judgement every 5 steps amortised) and its layout check."""
    import time

    import torch

    from ntp_nemo.resilience.straggler import StragglerDetector, StragglerSettings, peer_groups, share_units
    from ntp_nemo.runtime.compute_time import ComputeTimer
    from ntp_nemo.topology import ResolvedLayout, Topology

    def per_call(fn) -> float:
        c0 = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - c0) / n * 1e6

    timer, cpu = ComputeTimer(), torch.device("cpu")
    scalars, mine = torch.zeros(4, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)

    def phase() -> None:
        with timer.phase("microbatches"):
            pass

    def slots() -> torch.Tensor:
        out = torch.zeros(4, dtype=torch.float64)
        out[1] = mine
        return torch.cat([scalars, out])

    layout = ResolvedLayout.make(Topology(2, [2, 2], [2] * 4), num_microbatches=6)
    units, peers, step = share_units(layout), peer_groups(layout), [0]
    det = StragglerDetector(StragglerSettings())

    def observe() -> None:
        step[0] += 1
        det.observe(step[0], [0.1, 0.2, 0.1, 0.1], units, peers)

    same = ResolvedLayout.from_dict(layout.to_dict())
    parts = {"timer phase": per_call(phase), "timer reading": per_call(lambda: timer.reading(cpu)),
             "fused slots": per_call(slots), "detector": per_call(observe),
             "layout check": per_call(lambda: same != layout)}
    return ", ".join(f"{k} {v:.1f} us" for k, v in parts.items()) + f"; total {sum(parts.values()):.1f} us"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


WIDE = ["model.hidden_size=256", "model.ffn_hidden_size=1024", "data.seq_len=64", "model.max_seq_len=64"]


def in_group(a: argparse.Namespace) -> None:
    """One TP-2 replica with a slow rank: its shards weighted by speed (live) against only reported."""
    job = [*TOY_JOB, *WIDE, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null", "checkpoint.every_n_steps=0",
           "checkpoint.save_on_end=false", "resume=never", f"trainer.max_steps={a.steps}", *a.overrides]
    fault = ["fault=slow", "fault.rank=1", f"fault.step={a.fault_step}", f"fault.factor={a.factor}"]
    print(f"load before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="stragglers-in-group-") as tmp:
        root = Path(tmp)
        sides = [ntp_side("rebalance", [*job, *fault], root, 2, 1),
                 ntp_side("report", [*job, *fault, "fault.straggler=report"], root, 2, 1),
                 ntp_side("clean_ref", job, root, 2, 1)]
        runs = run_side_by_side(sides, a.steps, root, timeout=3600)
        rebal = [e for e in jsonl(root / "rebalance" / "goodput.jsonl")
                 if e["event"] == "rebalance" and e.get("shard_speeds")]
        if not rebal:
            raise SystemExit("no re-layout of the shards by speed happened")
        first = rebal[0]
        since = first["step"] + 3
        m = {k: {r["step"]: r for r in runs[k]["records"]} for k in ("rebalance", "report", "clean_ref")}
        med = {k: statistics.median(r["step_time_s"] for st, r in m[k].items() if st >= since) for k in m}
        ref = {st: r["loss"] for st, r in m["clean_ref"].items()}
        worst = max(abs(r["loss"] - ref[st]) / abs(ref[st]) for st, r in m["rebalance"].items())
        paired = paired_ratio([runs["rebalance"]], [runs["report"]], "step_time_s", since)
        print(f"re-layout: shard weights {first['shard_speeds']} from step {first['step'] + 1} "
              f"({first.get('moved_bytes')} bytes moved in {first.get('relayout_s', 0):.3f} s)")
        print(f"median step time steps {since}-{a.steps}: rebalance {med['rebalance']:.4f} s, report "
              f"{med['report']:.4f} s, failure-free {med['clean_ref']:.4f} s")
        print(f"loss: max relative difference rebalance vs failure-free over {len(ref)} steps: {worst:.2e}")
        print(f"in-group stragglers: rebalance / report {med['rebalance'] / med['report']:.3f} "
              f"(paired per step {paired:.3f})")
    print(f"load after: {load_average()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fault-step", type=int, default=20)
    ap.add_argument("--factor", type=float, default=0.5)
    ap.add_argument("--clean-runs", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--components", action="store_true", help="only the per-step costs of the pieces")
    ap.add_argument("--in-group", action="store_true", help="shards by speed inside one TP-2 replica")
    a = ap.parse_args()
    if a.in_group:
        in_group(a)
        return
    print(f"detector pieces, CPU per step: {component_costs()}")
    if a.components:
        return
    job = [*TOY_JOB, *LAYOUT, f"trainer.max_steps={a.steps}", *a.overrides]
    fault = ["fault=slow", "fault.rank=1", f"fault.step={a.fault_step}", f"fault.factor={a.factor}"]
    print(f"load before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="stragglers-") as tmp:
        root = Path(tmp)
        # 1. the straggler under rebalance and under report, and the failure-free job, taking turns step by
        # step (the failure-free side gives the step's fixed costs at the same moments: the load moves)
        sides = [ntp_side("rebalance", [*job, *fault], root, 4, 1),
                 ntp_side("report", [*job, *fault, "fault.straggler=report"], root, 4, 1),
                 ntp_side("clean_ref", job, root, 4, 1)]
        runs = run_side_by_side(sides, a.steps, root, timeout=3600)
        ev = jsonl(root / "rebalance" / "goodput.jsonl")
        named = [e for e in ev if e["event"] == "straggler"]
        rebal = [e for e in ev if e["event"] == "rebalance"]
        if not named or not rebal:
            raise SystemExit(f"no straggler found or no rebalance: {named} {rebal}")
        first = named[0]
        print(f"detection: rank {first['rank']} on {first['host']} named at step {first['step']} "
              f"({first['step'] - a.fault_step} steps after the slowdown began at step {a.fault_step}), "
              f"estimated speed {first['speed']:.2f} (injected {a.factor})")
        last = rebal[-1]
        since = last["step"] + 3  # the new split's steps, past the one the change fell on
        m = {k: {r["step"]: r for r in runs[k]["records"]} for k in ("rebalance", "report", "clean_ref")}
        clean_steps = [r["step_time_s"] for s, r in m["rebalance"].items() if 5 <= s < a.fault_step]
        before = statistics.median(clean_steps)
        after = [r["step_time_s"] for s, r in m["rebalance"].items() if s >= since]
        reported = [r["step_time_s"] for s, r in m["report"].items() if s >= since]
        pred_c, nom_c = last["predicted_compute_s"], last["nominal_compute_s"]
        # The step = fixed costs (gradient sync, optimizer, the loop) + compute; the work model gives the
        # compute.  Measured at the judgement window (the watch's unit_s), scaled to each later moment's
        # load by the failure-free side's step time then over its time at the window.
        window = range(last["step"] - 5 + 1, last["step"] + 1)  # the judgement's steps (every 5)
        cr = m["clean_ref"]
        ref_window = statistics.median(cr[s]["step_time_s"] for s in window if s in cr)
        ref_after = statistics.median(r["step_time_s"] for s, r in m["clean_ref"].items() if s >= since)
        load = ref_after / ref_window
        predicted = ref_after + (pred_c - nom_c) * load
        stale = before + pred_c - nom_c  # the former check: the fixed costs of steps 5-19, another load
        unmitigated = ref_after + nom_c * (1 / a.factor - 1) * load
        med_after, med_report = statistics.median(after), statistics.median(reported)
        paired = paired_ratio([runs["rebalance"]], [runs["report"]], "step_time_s", since)
        paired_ref = paired_ratio([runs["rebalance"]], [runs["clean_ref"]], "step_time_s", since)
        pred_ratio = 1 + (pred_c - nom_c) / ref_window
        print(f"rebalance: split {last['microbatches']} from step {last['step'] + 1} (rank speeds "
              f"{[round(v, 2) for v in last['rank_speeds']]}); median step time steps {since}-{a.steps}: "
              f"{med_after:.4f} s; the work model predicts {predicted:.4f} s for the measured speeds (the "
              f"failure-free side's steps then, {ref_after:.4f} s, + (modelled compute {pred_c:.4f} s - "
              f"nominal {nom_c:.4f} s, at the judgement window) x load {load:.3f}): measured / predicted = "
              f"{med_after / predicted:.3f} (goal <= 1.15); paired per step against the failure-free side "
              f"{paired_ref:.3f}, the model's {pred_ratio:.3f}; with the fixed costs of steps 5-"
              f"{a.fault_step - 1} instead (the former check) {stale:.4f} s: {med_after / stale:.3f}")
        print(f"report: median step time steps {since}-{a.steps}: {med_report:.4f} s (the work model's "
              f"unmitigated {unmitigated:.4f} s); rebalance / report = {med_after / med_report:.3f} "
              f"(paired per step: {paired:.3f}); failure-free side {ref_after:.4f} s")

        # 2. failure-free runs with the watch on, and one with it off, taking turns step by step
        clean = [f"clean{i}" for i in range(a.clean_runs)]
        sides = [*(ntp_side(n, job, root, 4, 1) for n in clean),
                 ntp_side("watch_off", [*job, "fault.straggler_every=0"], root, 4, 1)]
        runs.update(run_side_by_side(sides, a.steps, root, timeout=3600))
        ref = {r["step"]: r["loss"] for r in runs["clean_ref"]["records"]}
        worst = max(abs(r["loss"] - ref[s]) / abs(ref[s]) for s, r in m["rebalance"].items())
        print(f"loss: max relative difference rebalance vs failure-free over {len(ref)} steps: {worst:.2e} "
              f"(goal <= 1e-5)")
        alarms = [(n, e["rank"], e["step"], round(e["speed"], 2)) for n in clean
                  for e in jsonl(root / n / "goodput.jsonl") if e["event"] == "straggler"]
        print(f"false alarms: {len(alarms)} straggler events over {a.clean_runs} failure-free runs of "
              f"{a.steps} steps {alarms if alarms else ''}")
        off = [runs["watch_off"]]
        wall = statistics.median(paired_ratio([runs[n]], off, "step_time_s", 5) for n in clean)
        cpu = statistics.median(paired_ratio([runs[n]], off, "cpu_s", 5) for n in clean)
        print(f"detector cost: watch on / off, {a.steps} steps side by side, median over the {a.clean_runs} "
              f"watched runs of the paired per-step ratios: step time {wall:.4f}, rank 0 CPU time {cpu:.4f} "
              f"(goal < 1.01)")
        own = []  # what the watch says it cost rank 0 (its console line at the end of each watched run)
        for n in clean:
            log = (root / f"{n}.log").read_text() if (root / f"{n}.log").exists() else ""
            hit = re.search(r"the watch's CPU per step on rank 0: ([0-9.]+) us", log)
            if hit:
                recs = runs[n]["records"][5:]
                own.append((float(hit.group(1)) * 1e-6, statistics.median(r["cpu_s"] for r in recs),
                            statistics.median(r["step_time_s"] for r in recs)))
        if own:
            print("detector's own CPU, measured inside the watched runs: "
                  + "; ".join(f"{c * 1e6:.1f} us per step = {c / cpu:.3%} of rank 0's CPU per step, "
                              f"{c / wall:.3%} of the step" for c, cpu, wall in own) + " (goal < 1%)")
        if len(clean) > 1:  # the noise floor: two watched runs, the same job, against each other
            aa = [paired_ratio([runs[x]], [runs[y]], "step_time_s", 5) for x in clean for y in clean if x < y]
            aa_cpu = [paired_ratio([runs[x]], [runs[y]], "cpu_s", 5) for x in clean for y in clean if x < y]
            print(f"noise floor: watched / watched, the same job, paired per step: step time "
                  f"{', '.join(f'{v:.4f}' for v in aa)}; rank 0 CPU time "
                  f"{', '.join(f'{v:.4f}' for v in aa_cpu)}")
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
