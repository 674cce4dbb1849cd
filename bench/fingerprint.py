"""Cost of the replica fingerprint check against the training step, side by side in the same workers.

    python bench/fingerprint.py [--steps 12] [--reps 5] [--every 50] [--layout 2,1]

Forked gloo workers assemble the default recipe's model (gpt_tiny: 3.3M parameters, hidden 256, 4 layers)
on an NTP layout (default (2,1): replicas of TP 2 and 1) with the recipe's batch (12 sequences of 128
tokens, micro-batches of 2) and time, alternately in the same processes: optimizer steps (`train_step`,
the run's step), fingerprint checks (`local_fingerprints` + the all-gather + `compare`: what
`IntegrityWatch` does every `integrity.every_n_steps` steps), and the verified copy kept at each passed
check (`keep_verified`: parameters and optimizer state cloned), and steps under the per-step check
(`integrity.outlier_ratio`: each rank's largest gradient element per parameter and largest layer input
on the fused scalars, the guard asked before the update).  Prints medians over the ranks' slowest, the
check's share of training time at the interval: (check + copy) / (every * step), and the per-step
check's: (checked step - step) / step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.parallel.fingerprint import (  # noqa: E402
    compare,
    gather_fingerprints,
    gather_plan,
    local_fingerprints,
)
from ntp_nemo.resilience.integrity import LayerInputs, find_suspects, own_row  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.runtime.step import train_step  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from tests.shapes import adamw, gpt_tiny  # noqa: E402

MODEL = gpt_tiny()
OPTIM = adamw(1e-3)
SEQ, BATCH, MICRO = 128, 12, 2


def worker(rank: int, world: int, replica_tp: list[int], steps: int, reps: int) -> dict:
    tp = max(replica_tp)
    topo = Topology(tp, replica_tp, [tp] * (MODEL.num_layers + 2))
    layout = ResolvedLayout.make(topo)
    state = assemble(layout, rank, MODEL, OPTIM, None, seed=1234, param_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=gen)
    mine = state.runtime.my_microbatches(BATCH // MICRO)
    micro = [tokens[i * MICRO:(i + 1) * MICRO] for i in mine]
    plan = gather_plan(state.model, topo.coord(rank).replica)

    def step() -> float:
        t0 = time.perf_counter()
        train_step(state, micro, BATCH * SEQ, max_norm=1.0)
        return time.perf_counter() - t0

    inputs = LayerInputs()
    inputs.attach(state.model)
    stages = [topo.coord(r).stage for r in range(topo.world_size)]

    parts: list[float] = []  # the check's own host work per checked step: the row and the guard

    def timed(fn):
        def run(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            parts[-1] += time.perf_counter() - t0
            return out
        return run

    def checked_step() -> float:
        parts.append(0.0)
        t0 = time.perf_counter()
        inputs.reset()
        result = train_step(state, micro, BATCH * SEQ, max_norm=1.0,
                            own=timed(lambda: own_row(state.model, inputs.value, state.runtime.device)),
                            guard=timed(lambda values: bool(find_suspects(values["own"], stages, 1000.0))))
        assert not result.skipped
        return time.perf_counter() - t0

    def check() -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        got = gather_fingerprints(local_fingerprints(state.model, plan.fragments[rank]), plan)
        assert compare(plan, got) == []
        return time.perf_counter() - t0

    def keep() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            kept = [p.detach().clone() for p in state.model.parameters()]
        kept.append(copy.deepcopy(state.optimizer.state_dict()))
        return time.perf_counter() - t0

    step()  # warm-up
    checked_step()
    step_s, check_s, keep_s, checked_s = [], [], [], []
    for _ in range(reps):  # alternate, so all see the same machine load
        for k in range(max(1, steps // reps)):  # ABBA: neither kind always runs first
            if k % 2:
                checked_s.append(checked_step())
                step_s.append(step())
            else:
                step_s.append(step())
                checked_s.append(checked_step())
        check_s.append(check())
        keep_s.append(keep())
    local_params = sum(p.numel() for p in state.model.parameters())
    return {"step": step_s, "check": check_s, "keep": keep_s, "checked": checked_s, "parts": parts[1:],
            "params": local_params,
            "fragments": len(plan.fragments[rank])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--every", type=int, default=50, help="integrity.every_n_steps (default: the config's)")
    ap.add_argument("--layout", default="2,1", help="ntp.replica_tp, e.g. 2,1 or 2,2")
    args = ap.parse_args()
    replica_tp = [int(x) for x in args.layout.split(",")]
    res = run_workers(worker, sum(replica_tp), replica_tp, args.steps, args.reps)
    # A step or a check takes as long as its slowest rank: per repetition, the max over ranks.
    step = statistics.median(max(r["step"][i] for r in res) for i in range(len(res[0]["step"])))
    check = statistics.median(max(r["check"][i] for r in res) for i in range(len(res[0]["check"])))
    keep = statistics.median(max(r["keep"][i] for r in res) for i in range(len(res[0]["keep"])))
    checked = statistics.median(max(r["checked"][i] for r in res) for i in range(len(res[0]["checked"])))
    parts = statistics.median(max(r["parts"][i] for r in res) for i in range(len(res[0]["parts"])))
    print(f"layout {tuple(replica_tp)}, gpt_tiny 3.3M params, batch {BATCH}x{SEQ} tokens, CPU gloo, "
          f"{len(res)} ranks: params per rank {[r['params'] for r in res]}, "
          f"fragments {[r['fragments'] for r in res]}")
    print(f"  training step (median, slowest rank)      {1e3 * step:9.2f} ms")
    print(f"  fingerprint check (hash + gather + compare) {1e3 * check:7.2f} ms  = {check / step:6.3f} steps")
    print(f"  verified copy (params + optimizer state)  {1e3 * keep:9.2f} ms  = {keep / step:6.3f} steps")
    share = (check + keep) / (args.every * step)
    print(f"  at integrity.every_n_steps={args.every}: check + copy = {100 * share:.3f}% of training time "
          f"({100 * check / (args.every * step):.3f}% for the check alone)")
    print(f"  step under the per-step check (outlier_ratio) {1e3 * checked:5.2f} ms  = "
          f"{100 * (checked - step) / step:+.2f}% of the step; its row and guard alone {1e3 * parts:.2f} ms "
          f"= {100 * parts / step:.2f}% (the activation hooks and the longer all-reduce not included)")


if __name__ == "__main__":
    main()
