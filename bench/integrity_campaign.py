"""Seeded silent-corruption trials through `ntp-train`: each finding classified and attributed, the curve
after recovery against a failure-free run, and clean runs without a false alarm.

    python bench/integrity_campaign.py [--trials 20] [--kinds poison_sample,param,activation,grad,persistent]
                                       [--curves 20] [--clean 3] [--clean-steps 200]

Per kind, one `ntp-train -m` sweep over `seed=1..trials` on the CPU toy (the tests' TINY job), 10 steps,
the fault at step 7 on a rank (and element, or sample) drawn from the seed, `integrity.every_n_steps=4`,
`integrity.spike_window=4`:

- `poison_sample` on (2,1): expected one finding at step 7, `nonfinite`, verdict `data`, naming the
  sample the fault poisoned (`resilience.corruption.poisoned_sample` of the seed's stream);
- `param` (bitflip of a parameter) on (2,1,1), three replicas: `divergence` at step 8 (the check after
  the flip), verdict `bitflip`, naming the rank the fault struck and its replica;
- `activation` and `grad` (bitflip, top exponent bit) on (2,1): one finding at step 7 (`outlier`, the
  per-step check, or `nonfinite`), verdict `transient` (the replay does not repeat it), naming the rank
  the fault struck;
- `persistent` (bitflip of a gradient on every step from 7 on, a bad device) on (2,1) with live recovery:
  one finding at step 7, verdict `device`, naming the struck rank, which is excluded; the survivors redo
  step 7 without it;
- `persistent_activation`: the same with the flip in the output of the rank's first layer on every
  forward from step 7 on (some make a sample's loss not finite on the struck replica only).

After the fault's finding, a later finding of the per-step check with verdict `reproducible` whose cross
replay (another replica computing the same micro-batches) reproduced it is honest data: a false alarm,
classified right and counted apart, with the relative differences of the cross replays (the margin of the
bad-device rule).

`--curves K`: for the first K seeds of each kind, the failure-free run of the same seed on the same layout
(skipping the poisoned sample for `poison_sample`) and the largest relative difference of the losses from
the fault's step on (`param`: from the check that found it, step 8; before it the flipped weight trains).
`--clean N`: N clean runs of `--clean-steps` steps on (2,1) with the default `integrity` settings
(fingerprint every 50 steps, spike detector at 8 standard deviations over 20 steps): findings counted.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import TOY_JOB  # noqa: E402
from ntp_nemo.goodput.incident_log import load_incidents  # noqa: E402

NTP21 = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]"]
NTP211 = ["mesh.dp=3", "mesh.tp=2", "ntp.replica_tp=[2,1,1]"]
STEPS, FAULT_STEP = 10, 7
COMMON = [*TOY_JOB, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=0",
          "checkpoint.save_on_end=false", "integrity.every_n_steps=4", "integrity.spike_window=4",
          "fault.collective_timeout_s=120", "fault.heartbeat_timeout_s=60", "fault.step_timeout_s=300"]
KINDS = {
    "poison_sample": [*NTP21, "fault=poison_sample", f"fault.step={FAULT_STEP}"],
    "param": [*NTP211, "fault=bitflip", "fault.target=param", f"fault.step={FAULT_STEP}"],
    "activation": [*NTP21, "fault=bitflip", "fault.target=activation", f"fault.step={FAULT_STEP}"],
    "grad": [*NTP21, "fault=bitflip", "fault.target=grad", f"fault.step={FAULT_STEP}"],
    "persistent": [*NTP21, "fault=bitflip", "fault.target=grad", "fault.persistent=true",
                   "fault.recovery=live", f"fault.step={FAULT_STEP}"],
    "persistent_activation": [*NTP21, "fault=bitflip", "fault.target=activation", "fault.persistent=true",
                              "fault.recovery=live", f"fault.step={FAULT_STEP}"],
}


def sweep(overrides: list[str], root: Path, name: str, timeout: int = 3600) -> Path:
    out = root / name
    cmd = [sys.executable, "-m", "ntp_nemo.train", "-m", *overrides, f"hydra.sweep.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: ntp-train exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return out


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = float(rec["loss"])
    return out


def expected_sample(run: Path, seed: int) -> int:
    """The sample the seed's poison_sample fault poisons (the injector's rule, on the run's sample count)."""
    from ntp_nemo.config.failover import FailoverSpec
    from ntp_nemo.config.schema import FaultConfig
    from ntp_nemo.data.sampler import GlobalBatchSampler
    from ntp_nemo.resilience.corruption import poisoned_sample
    from ntp_nemo.resilience.fault_config import resolve_faults

    log = (run / "train.log").read_text()
    n = int(re.search(r"(\d+) train / \d+ val samples", log)[1])
    spec = FailoverSpec(FaultConfig(kind="poison_sample", step=FAULT_STEP), 1, seed, STEPS, None, 3, 2,
                        "cpu", False, 0, False, "checkpoints")
    (fault,) = resolve_faults(spec)

    class Data:
        sampler = GlobalBatchSampler(n, 12, seed)
        train = range(n)

    return poisoned_sample(fault, Data)


def skipped(run: Path) -> list[int]:
    return [f["sample"] for f in load_incidents(run) if f.get("verdict") == "data"]


def drawn(run: Path, seed: int) -> set[int]:
    """The sample ids seed `seed`'s first STEPS steps draw with nothing skipped."""
    from ntp_nemo.data.sampler import GlobalBatchSampler

    n = int(re.search(r"(\d+) train / \d+ val samples", (run / "train.log").read_text())[1])
    s = GlobalBatchSampler(n, 12, seed)
    return {int(i) for step in range(STEPS) for i in s.batch_ids(step)}


def reference(root: Path, kind: str, seed: int, run: Path, seeds: int) -> dict[int, float]:
    """The losses of the failure-free run of `seed` on the kind's layout: one sweep of seeds 1..`seeds`
    per layout, shared by the kinds.  `poison_sample`: one sweep skipping every trial's skipped sample
    (skipping an id the seed's first steps never draw leaves them as they were: checked, and a seed whose
    steps draw another trial's sample gets a run of its own)."""
    if kind == "poison_sample":
        trials = run.parent
        union = sorted({i for j in range(seeds) for i in skipped(trials / str(j))})
        mine = skipped(run)
        if (set(union) - set(mine)) & drawn(run, seed):
            own = f"integrity.skip_samples=[{','.join(map(str, mine))}]"
            ref = sweep([*COMMON, *NTP21, f"seed={seed}", own], root, f"{kind}-clean-{seed}")
            return losses(ref / "0")
        out = root / f"{kind}-clean"
        if not (out / str(seeds - 1) / "metrics.jsonl").exists():
            sweep([*COMMON, *NTP21, f"seed={','.join(str(s) for s in range(1, seeds + 1))}",
                   f"integrity.skip_samples=[{','.join(map(str, union))}]"], root, f"{kind}-clean")
        return losses(out / str(seed - 1))
    layout, name = (NTP211, "clean-211") if kind == "param" else (NTP21, "clean-21")
    out = root / name
    if not (out / str(seeds - 1) / "metrics.jsonl").exists():
        sweep([*COMMON, *layout, f"seed={','.join(str(s) for s in range(1, seeds + 1))}"], root, name)
    return losses(out / str(seed - 1))


def judge(kind: str, run: Path, seed: int) -> tuple[bool, bool, str]:
    """(classified right: one finding, at the step and of the kind and verdict expected; attributed right:
    it names the poisoned sample, or the rank the fault struck (and its replica), and a note)."""
    found = load_incidents(run)
    log = (run / "train.log").read_text()
    if kind == "poison_sample":
        want = expected_sample(run, seed)
        expected = [(FAULT_STEP, "nonfinite", "data")]
        classified = [(f["step"], f["kind"], f["verdict"]) for f in found] == expected
        return classified, classified and found[0]["sample"] == want, \
            f"sample {want}: {[(f['kind'], f['verdict'], f['sample']) for f in found]}"
    fired = re.search(r"fault: bitflip .* on rank (\d+) at step (\d+)", log)
    if fired is None:
        return False, False, "the fault did not fire"
    rank = int(fired[1])
    if kind == "param":
        replica = 0 if rank < 2 else rank - 1  # (2,1,1): ranks 0-1 are replica 0, rank 2 replica 1, ...
        classified = [(f["step"], f["kind"], f["verdict"]) for f in found] == [(8, "divergence", "bitflip")]
        return classified, classified and (found[0]["rank"], found[0]["replica"]) == (rank, replica), \
            f"rank {rank}: {[(f['kind'], f['verdict'], f['rank'], f['replica']) for f in found]}"
    verdict = "device" if kind.startswith("persistent") else "transient"
    # After the fault's finding, an honest outlier of the per-step check (the data's: another replica
    # computing the same micro-batches reproduced it, `cross`) is a false alarm classified right: kept
    classified = [(f["step"], f["verdict"]) for f in found[:1]] == [(FAULT_STEP, verdict)] \
        and all(f["verdict"] == "reproducible" and "cross" in f for f in found[1:])
    return classified, classified and found[0]["rank"] == rank, \
        f"rank {rank}: {[(f['step'], f['kind'], f['verdict'], f['rank']) for f in found]}"


def cross_margins(run: Path) -> list[tuple[str, float, float]]:
    """(verdict, relative difference of the suspect values, of the suspect replica's other slots) of each
    cross replay."""
    return [(f["verdict"], f["cross"]["suspect_diff"], f["cross"]["honest_diff"])
            for f in load_incidents(run) if "cross" in f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--curves", type=int, default=20)
    ap.add_argument("--clean", type=int, default=3)
    ap.add_argument("--clean-steps", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true", help="take a kind's trials already complete in --dir")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="integrity_campaign_"))
    root.mkdir(parents=True, exist_ok=True)
    seeds = ",".join(str(s) for s in range(1, args.trials + 1))
    right = total = 0
    for kind in [k for k in args.kinds.split(",") if k]:
        t0 = time.perf_counter()
        out = root / kind
        if not (args.reuse and all((out / str(j) / "summary.json").exists() for j in range(args.trials))):
            out = sweep([*COMMON, *KINDS[kind], f"seed={seeds}"], root, kind)
        classified = attributed = equal = 0
        worst, notes, cross, ok = 0.0, [], [], {}
        for job, seed in enumerate(range(1, args.trials + 1)):
            c, a, why = judge(kind, out / str(job), seed)
            classified, attributed = classified + c, attributed + a
            ok[seed] = c and a
            if not (c and a):
                notes.append(f"seed {seed}: {why}")
            cross += [(seed, *m) for m in cross_margins(out / str(job))]
        if cross:
            device = [m for m in cross if m[1] == "device"]
            kept = [m for m in cross if m[1] == "reproducible"]
            notes.append(f"cross replays: {len(device)} device (suspect values differ from the other "
                         f"replica's computation by at least "
                         f"{min((m[2] for m in device), default=float('nan')):.3g} "
                         f"relative), {len(kept)} reproducible (false alarms of the per-step check, seeds "
                         f"{sorted({m[0] for m in kept})}: at most "
                         f"{max((m[2] for m in kept), default=float('nan')):.3g}); the suspect replicas' "
                         f"other slots at most {max(m[3] for m in cross):.3g} (honest agreement where the "
                         f"fault struck one gradient element; an activation's flip moves every gradient "
                         f"after it)")
        n = min(args.curves, args.trials)
        for job, seed in enumerate(range(1, n + 1)):
            run = out / str(job)
            want = reference(root, kind, seed, run, n)
            got = losses(run)
            after = 8 if kind == "param" else FAULT_STEP  # the step the recovery ended in
            diff = max(abs(got[s] - want[s]) / abs(want[s]) for s in want if s >= after)
            equal += diff <= 1e-5
            ok[seed] = ok[seed] and diff <= 1e-5
            worst = max(worst, diff)
            if diff > 1e-5:
                notes.append(f"seed {seed}: curve after recovery differs by {diff:.2e} (relative)")
        curve = f"; curve after recovery equal to the failure-free run (1e-5) {equal}/{n}, max rel diff " \
                f"{worst:.2e}" if n else ""
        what = "sample" if kind == "poison_sample" else "rank"
        print(f"{kind:14s} trials {args.trials}: classified right {classified}/{args.trials}, attributed to "
              f"the right {what} {attributed}/{args.trials}{curve} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for note in notes:
            print(f"    {note}")
        right, total = right + sum(ok.values()), total + len(ok)
    if total:
        print(f"integrity campaign: {right}/{total} trials right (classified, attributed, and the curve "
              f"after recovery equal to the failure-free run where compared)", flush=True)
    if args.clean:
        t0 = time.perf_counter()
        seeds = ",".join(str(s) for s in range(1, args.clean + 1))
        out = sweep([*TOY_JOB, *NTP21, f"trainer.max_steps={args.clean_steps}", "checkpoint.every_n_steps=0",
                     "checkpoint.save_on_end=false", f"seed={seeds}"], root, "clean")
        found = [len(load_incidents(out / str(j))) for j in range(args.clean)]
        margin = max((float(json.loads(line).get("outlier_ratio", 0.0)) for j in range(args.clean)
                      for line in (out / str(j) / "metrics.jsonl").read_text().splitlines()), default=0.0)
        print(f"clean runs     {args.clean} x {args.clean_steps} steps on (2,1), default integrity settings: "
              f"findings {found}; the per-step check's largest ratio of a rank to every other "
              f"{margin:.3g} (threshold 1000) ({time.perf_counter() - t0:.0f} s)")
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
