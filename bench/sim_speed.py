"""Speed of the cluster simulator's two heavy studies (target: each under 30 s on 2 cores).

    python bench/sim_speed.py [--repeat 3] [--json out.json]

Cases: the throughput study (100 placements x 20 failed fractions x 3 policies) on the paper's
32K-GPU cluster, also with TP8 groups rebuilt inside NVL32 domains (4x more groups to sort), and
the 15-day trace study with the spare-domain search at 1x and 7x the Llama 3 failure rate.
Reported: the best and median wall time of `--repeat` runs, each with a fresh generator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
from hydra import compose, initialize_config_dir

from ntp_nemo.cli.sim import CONFIG_DIR
from ntp_nemo.goodput.sim.settings import SimSettings, settings_from_config
from ntp_nemo.goodput.sim.studies import policy_tables, run_throughput, run_trace

CASES = {
    "throughput_32k_tp32_pp8": ("throughput", ["placements.samples=100", "placements.num_fractions=20"]),
    "throughput_32k_tp8_pp32": (
        "throughput",
        [
            "placements.samples=100",
            "placements.num_fractions=20",
            "cluster.tp=8",
            "cluster.pp=32",
            "cluster.degraded_tp=null",
        ],
    ),
    "trace_15d_x1": ("trace", ["failures.rate_multipliers=[1.0]"]),
    "trace_15d_x7": ("trace", ["failures.rate_multipliers=[7.0]", "failures.max_spare_domains=1024"]),
}


def settings(overrides: list[str]) -> SimSettings:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return settings_from_config(compose(config_name="config", overrides=overrides))


def run_case(study: str, s: SimSettings, seed: int) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    tables = policy_tables(s)
    records = run_throughput(s, rng, tables) if study == "throughput" else run_trace(s, rng, tables)[0]
    return time.perf_counter() - start, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "numpy": np.__version__,
        "cases": {},
    }
    print(f"{'case':<26} {'best s':>8} {'median s':>9}  notes")
    for name, (study, overrides) in CASES.items():
        s = settings(overrides)
        times, records = [], []
        for rep in range(args.repeat):
            elapsed, records = run_case(study, s, seed=rep)
            times.append(elapsed)
        if study == "throughput":
            note = f"{len(records)} records, {s.placements.samples} placements x {s.cluster.num_gpus} GPUs"
        else:
            note = ", ".join(f"{r['policy']} spares={r['spares_needed']}" for r in records)
            note += f"; {records[0]['events']} events"
        results["cases"][name] = {"best_s": min(times), "median_s": statistics.median(times), "note": note}
        print(f"{name:<26} {min(times):>8.3f} {statistics.median(times):>9.3f}  {note}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
