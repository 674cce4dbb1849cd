"""Failover policies on the same run and the same failure: NTP vs DP-DROP vs restart-with-a-spare.

    python bench/failover.py [--steps 30] [--fail-step 15] [--every 10] [overrides ...]
    python bench/failover.py --live [--steps 30] [--fail-step 15] [--every 10] [overrides ...]

`--live` compares, instead, the two ways of recovering under policy `ntp` side by side in one harness of
forked gloo workers sharing one store (`ntp_nemo.resilience.rendezvous.run_elastic`, no Lightning, see
`live_main`): live (the survivors reshard from each other's memory, no checkpoint) against restart
(every worker stops, new workers on the new layout load the last checkpoint).

Each policy (and `ntp` again with `fault.recovery=live`) trains the same job through the real `ntp-train`
CLI: 2 DP replicas of TP 2 (4 processes),
global rank 1 killed hard (exit 137) when step `--fail-step` starts, checkpoints every `--every` steps.
A failure-free run of the same job is the reference for the loss curve and the goodput. Figures, from each
run's goodput.jsonl, metrics.jsonl and the fault marker:

- detection: fault fired -> `failure_detected` (the supervisor saw the exit status);
- recovery: fault fired -> first step completed after it (detection, relaunch, restore, redone step);
- caught up: fault fired -> the failed step completed (a restart also redoes the steps since its
  checkpoint before it gets there; live redoes only the interrupted step);
- lost steps: completed steps executed again after the restore, plus the step the failure cut short;
- goodput: productive time / job time (ntp_nemo.goodput.compute_goodput), and the badput it paid;
- capacity after: active ranks after the failure / nominal ranks of the job (DP-DROP's dropped replica
  counts as lost capacity); throughput after: tokens/s after recovery relative to before the failure
  (on a shared 2-core CPU box fewer processes are not slower: read this column with that in mind);
- max |loss - reference| / reference over the last execution of every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import ROOT, load_average, thread_env  # noqa: E402
from ntp_nemo.goodput import compute_goodput, load_events

POLICIES = ("ntp", "dp_drop", "restart")
# Rows of the table: name -> overrides.  `ntp-live` is policy ntp with fault.recovery=live (the survivors
# reshard from each other's memory in the same processes; no relaunch, no checkpoint read).
RUNS = {**{p: [f"fault.policy={p}", "fault.recovery=restart"] for p in POLICIES},
        "ntp-live": ["fault.policy=ntp", "fault.recovery=live"]}


def run(overrides: list[str], run_dir: Path) -> None:
    args = [sys.executable, "-m", "ntp_nemo.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        args, cwd=run_dir.parent, env=thread_env(1), capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def figures(run_dir: Path, reference: dict[int, float], nominal_ranks: int) -> dict:
    events = load_events(run_dir)
    rep = compute_goodput(events)
    fired = json.loads(next((run_dir / "failover" / "faults").glob("fired_*.json")).read_text())
    t_fail = fired["t"]
    detected = min(e["t"] for e in events if e["event"] == "failure_detected")
    next_end = min(e["t"] for e in events if e["event"] == "step_end" and e["t"] > t_fail)
    # Caught up: the failed step completed again (a restart first redoes the steps since its checkpoint).
    caught_up = min(e["t"] for e in events
                    if e["event"] == "step_end" and e["t"] > t_fail and int(e["step"]) >= int(fired["step"]))
    recs = metrics(run_dir)
    before = [r["tokens_per_s"] for r in recs if r["time"] < t_fail][2:]
    after_recs = [r for r in recs if r["time"] > next_end]
    after = [r["tokens_per_s"] for r in after_recs]
    layout_after = after_recs[-1]["layout"]
    active = sum(int(x) for x in layout_after.strip("()").split(","))
    last = {r["step"]: r["loss"] for r in recs}
    done = [e for e in events if e["event"] == "recovery_done"]
    return {
        "mode": done[0].get("mode", "restart") if done else "-",
        "moved_bytes": done[0].get("moved_bytes") if done else None,
        "minimum_bytes": done[0].get("minimum_bytes") if done else None,
        "layout_after": layout_after,
        "detection_s": detected - t_fail,
        "recovery_s": next_end - t_fail,
        "caught_up_s": caught_up - t_fail,
        "lost_steps": rep.steps_redone + 1,
        "goodput": rep.goodput,
        "wasted_s": rep.badput_s["wasted_progress"],
        "downtime_s": rep.badput_s["recovery_downtime"],
        "restore_s": rep.badput_s["checkpoint_restore"],
        "capacity_after": active / nominal_ranks,
        "throughput_after": statistics.median(after) / statistics.median(before),
        "max_rel_loss_diff": max(abs(last[s] - ref) / abs(ref) for s, ref in reference.items()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fail-step", type=int, default=15)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides for every run")
    args = ap.parse_args()
    job = [
        "mesh.dp=2",
        "mesh.tp=2",
        "ntp.replica_tp=[2,2]",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.every}",
        "data.seq_len=64",
        "trainer.val_every_n_steps=1000000",
        "trainer.progress_bar=false",
        "logger=none",
        "callbacks=none",
        *args.overrides,
    ]
    fault = ["fault=kill_rank", "fault.rank=1", f"fault.step={args.fail_step}"]
    print(
        f"failover: ntp-train {' '.join(job)} {' '.join(fault)} fault.policy=POLICY; "
        f"load average {load_average()}",
        flush=True,
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(job, work / "reference")
        reference = {r["step"]: r["loss"] for r in metrics(work / "reference")}
        base = compute_goodput(load_events(work / "reference"))
        print(f"  failure-free: goodput {base.goodput:.3f}", flush=True)
        for policy, extra in RUNS.items():
            run([*job, *fault, *extra], work / policy)
            rows[policy] = figures(work / policy, reference, nominal_ranks=4)
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[policy].items()}
            print(f"  {policy}: {json.dumps(shown)}", flush=True)
    header = (
        "policy",
        "recovery",
        "layout after",
        "detect s",
        "recovery s",
        "caught up s",
        "lost steps",
        "goodput",
        "wasted s",
        "downtime s",
        "capacity after",
        "throughput after",
        "max rel loss diff",
        "moved bytes (minimum)",
    )
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for policy, r in rows.items():
        moved = "-" if r["moved_bytes"] is None else f"{r['moved_bytes']} ({r['minimum_bytes']})"
        print(
            f"| {policy.removesuffix('-live')} | {r['mode']} | {r['layout_after']} | "
            f"{r['detection_s']:.2f} | {r['recovery_s']:.2f} | {r['caught_up_s']:.2f} | {r['lost_steps']} | "
            f"{r['goodput']:.3f} | "
            f"{r['wasted_s']:.2f} | "
            f"{r['downtime_s']:.2f} | {r['capacity_after']:.2f} | {r['throughput_after']:.2f} | "
            f"{r['max_rel_loss_diff']:.1e} | {moved} |"
        )
    live, restart = rows["ntp-live"]["recovery_s"], rows["ntp"]["recovery_s"]
    caught = rows["ntp-live"]["caught_up_s"] / rows["ntp"]["caught_up_s"]
    print(f"\nntp: live recovery / restart recovery = {live / restart:.2f}; caught up: {caught:.2f}")
    print(f"\nreference goodput (no failure): {base.goodput:.3f}; repository: {ROOT}")


# ---- live vs restart in one harness ------------------------------------------------------------------
def _harness_worker(pid, world, store, mode, model_cfg, layout, first_step, steps, fail_step, every, seq,
                    batch, lr, out_dir, resume):
    """One worker of the harness: trains steps [first_step, steps) on `layout`; rank 1 of generation 0
    dies when `fail_step` starts (mid-backward).  `mode`: live | restart | none (failure-free)."""
    import os
    import time

    import torch

    from ntp_nemo.checkpoint import load_checkpoint, save_checkpoint
    from ntp_nemo.checkpoint.state import sharded_state
    from ntp_nemo.resilience.policies import make_policy
    from ntp_nemo.resilience.recovery import Generation, recover
    from ntp_nemo.resilience.rendezvous import join
    from ntp_nemo.runtime.assemble import assemble
    from ntp_nemo.runtime.step import train_step
    from tests.shapes import adamw

    optim = adamw(lr, beta2=0.999)

    def build(lay, rank, init=True):
        """The rank as a run builds it (`runtime.assemble`: model slice, sync, optimizer); a rank whose
        every value comes from the survivors is built without drawing initial weights."""
        return assemble(lay, rank, model_cfg, optim, None, seed=1234, param_dtype=torch.float32,
                        make_model=None if init else (
                            lambda rt: rt.build_model(model_cfg, 1234, torch.float32, initialize=False)))

    def dying_backward(state, n):
        """`loss.backward()` for each of the step's `n` micro-batches; after the last one (before the
        gradient sync) record what the process held and die."""
        done = [0]

        def backward(loss):
            loss.backward()
            done[0] += 1
            if done[0] == n:
                held = sum(t.tensor.numel() * t.tensor.element_size()
                           for t in sharded_state(state.model, state.optimizer).values())
                Path(out_dir, "held_1.json").write_text(json.dumps(held))
                Path(out_dir, "fault_t.json").write_text(json.dumps(time.time()))
                os._exit(137)

        return backward

    gen = Generation.first(layout)
    join(store, 0, pid, world)
    state = build(layout, pid)
    if resume:
        load_checkpoint(resume, state.model, state.optimizer)
    records, recoveries, step = [], [], first_step
    dies = mode != "none" and pid == 1 and not resume
    while step < steps:
        t0 = time.time()
        try:
            gen_tok = torch.Generator().manual_seed(1000 + step)
            toks = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1), generator=gen_tok)
            micro = [toks[i : i + 1] for i in state.my_microbatches(batch)]
            backward = dying_backward(state, len(micro)) if dies and step == fail_step else None
            loss = train_step(state, micro, toks[:, 1:].numel(), max_norm=None, backward=backward).loss
        except RuntimeError:
            if mode == "restart":  # the supervisor's answer: every worker stops
                return {"records": records, "stopped_at": step}
            rec = recover(store, gen, pid, step, (state.model, state.optimizer),
                          lambda lay, r: build(lay, r, init=False), make_policy("ntp"))
            if rec is None:
                return None
            gen, state, step = rec.generation, rec.state, rec.step
            recoveries.append({"detect_t": rec.detect_t, "reshard_s": rec.seconds, "step": step,
                               "phases": rec.phases,
                               "moved": rec.reshard.moved_bytes, "needed": rec.reshard.needed_bytes,
                               "layout": gen.layout.describe()})
            continue
        records.append({"step": step, "t0": t0, "t1": time.time(), "loss": loss})
        step += 1
        if mode == "restart" and every and step % every == 0:
            t_save = time.time()
            save_checkpoint(Path(out_dir, f"step_{step:06d}"), state.model, state.optimizer, {"step": step},
                            step=step)
            records[-1]["save_s"] = time.time() - t_save
    return {"records": records, "recoveries": recoveries}


def _harness(mode, model_cfg, args, out_dir: Path) -> dict:
    from ntp_nemo.resilience.policies import make_policy, replan
    from ntp_nemo.resilience.rendezvous import run_elastic
    from ntp_nemo.topology import ResolvedLayout, Topology

    layout = ResolvedLayout.make(Topology(2, (2, 2), [2] * (model_cfg.num_layers + 2)))
    common = (args.steps, args.fail_step, args.every, args.seq_len, args.batch, args.lr, str(out_dir))
    t_start = time.time()
    results, _ = run_elastic(_harness_worker, layout.world_size, mode, model_cfg, layout, 0, *common, None)
    runs = [[r for r in results.values() if r is not None]]
    if mode == "restart":
        new = replan(layout, [1], make_policy("ntp")).new
        ckpts = sorted(out_dir.glob("step_*"))
        resume = str(ckpts[-1]) if ckpts else None
        first = int(ckpts[-1].name.split("_")[1]) if ckpts else 0
        results, _ = run_elastic(_harness_worker, new.world_size, mode, model_cfg, new, first, *common,
                                 resume)
        runs.append(list(results.values()))
    t_end = time.time()
    execs = [r for rs in runs for r in rs[0]["records"]]
    last = {}
    for r in execs:
        last[r["step"]] = r
    out = {"wall_s": t_end - t_start, "executions": len(execs),
           "productive_s": sum(r["t1"] - r["t0"] for r in last.values()),
           "first_t0": min(r["t0"] for r in execs), "last_t1": max(r["t1"] for r in execs),
           "losses": {s: r["loss"] for s, r in last.items()}}
    out["goodput"] = out["productive_s"] / (out["last_t1"] - out["first_t0"])
    if mode != "none":
        t_fail = json.loads((out_dir / "fault_t.json").read_text())
        out["recovery_s"] = min(r["t1"] for r in execs if r["t1"] > t_fail) - t_fail
        out["lost_steps"] = len(execs) - args.steps + 1  # redone executions + the one cut short
        out["lost_rank_bytes"] = json.loads((out_dir / "held_1.json").read_text())
        recs = runs[0][0].get("recoveries") or []
        out["moved_bytes"] = recs[0]["moved"] if recs else None
        out["needed_bytes"] = recs[0]["needed"] if recs else None
        out["reshard_s"] = recs[0]["reshard_s"] if recs else None
        out["layout_after"] = replan(layout, [1], make_policy("ntp")).new.describe()
        out["phases"] = recs[0]["phases"] if recs else None
    return out


def live_main(args) -> None:
    import tempfile as _tempfile

    from bench._common import compose, model_config

    model_cfg = model_config(compose(args.overrides))
    print(f"failover --live: {model_cfg.name} ({model_cfg.arch}, hidden {model_cfg.hidden_size}, "
          f"{model_cfg.num_layers} layers), layout (2,2) float32, global batch {args.batch} x seq "
          f"{args.seq_len}, "
          f"{args.steps} steps, rank 1 killed during backward of step {args.fail_step}, policy ntp; restart "
          f"checkpoints every {args.every}; load average {load_average()}", flush=True)
    rows = {}
    for mode in ("none", "live", "restart"):
        with _tempfile.TemporaryDirectory() as tmp:
            rows[mode] = _harness(mode, model_cfg, args, Path(tmp))
    ref = rows["none"]["losses"]
    print(f"  failure-free: goodput {rows['none']['goodput']:.3f}, wall {rows['none']['wall_s']:.2f} s")
    header = ("recovery", "layout after", "recovery s", "reshard s", "lost steps", "goodput", "moved bytes",
              "minimum bytes", "lost rank's bytes", "moved / minimum", "max rel loss diff")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for mode in ("live", "restart"):
        r = rows[mode]
        diff = max(abs(r["losses"][s] - v) / abs(v) for s, v in ref.items())
        moved = r["moved_bytes"]
        print(f"| {mode} | {r['layout_after']} | {r['recovery_s']:.2f} | "
              f"{'-' if r['reshard_s'] is None else format(r['reshard_s'], '.2f')} | {r['lost_steps']} | "
              f"{r['goodput']:.3f} | {'-' if moved is None else moved} | "
              f"{'-' if moved is None else r['needed_bytes']} | {r['lost_rank_bytes']} | "
              f"{'-' if moved is None else format(moved / r['needed_bytes'], '.2f')} | {diff:.1e} |")
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in rows["live"]["phases"].items())
    print(f"\nlive recovery on the first survivor, detection to resharded: {phases}")
    ratio = rows["live"]["recovery_s"] / rows["restart"]["recovery_s"]
    print(f"\nlive recovery / restart recovery: {ratio:.2f}")


if __name__ == "__main__":
    if "--live" in sys.argv:
        ap = argparse.ArgumentParser(description="live vs restart recovery in one harness")
        ap.add_argument("--live", action="store_true")
        ap.add_argument("--steps", type=int, default=30)
        ap.add_argument("--fail-step", type=int, default=15)
        ap.add_argument("--every", type=int, default=10, help="checkpoint interval of the restart path")
        ap.add_argument("--seq-len", type=int, default=64)
        ap.add_argument("--batch", type=int, default=12, help="global batch (sequences)")
        ap.add_argument("--lr", type=float, default=3e-3)
        ap.add_argument("overrides", nargs="*", help="ntp-train overrides selecting the model")
        live_main(ap.parse_args())
    else:
        main()
