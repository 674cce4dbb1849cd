"""Simulator outputs: results.json (list of records), results.csv, PNG plots and console tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np

from ntp_nemo.goodput.sim.settings import SimSettings
from ntp_nemo.goodput.sim.studies import SimResults, TraceTimeline


def write_records(records: list[dict], out_dir: Path) -> tuple[Path, Path]:
    """results.json (the records as a JSON list) and results.csv (union of their keys)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "results.json", out_dir / "results.csv"
    json_path.write_text(json.dumps(records, indent=1))
    columns: list[str] = []
    for rec in records:
        columns += [k for k in rec if k not in columns]
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for rec in records:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in rec.items()})
    return json_path, csv_path


def _study(records: list[dict], study: str) -> list[dict]:
    return [r for r in records if r["study"] == study]


def write_plots(results: SimResults, settings: SimSettings, out_dir: Path) -> list[Path]:
    """throughput_loss.png, availability.png and trace.png for the studies that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    thr = _study(results.records, "throughput")
    if thr:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in settings.policies:
            rows = [r for r in thr if r["policy"] == policy]
            x = [100 * r["failed_fraction"] for r in rows]
            ax.plot(x, [100 * (1 - r["throughput_rel"]) for r in rows], marker="o", ms=3, label=policy)
        ax.set_xlabel("failed GPUs (%)")
        ax.set_ylabel("throughput loss vs failure-free (%)")
        c = settings.cluster
        ax.set_title(f"{settings.model.name}: {c.num_gpus} GPUs, TP{c.tp} x PP{c.pp}, domain {c.domain_size}")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out_dir / "throughput_loss.png"))
    avail = _study(results.records, "availability")
    if avail:
        fig, ax = plt.subplots(figsize=(6, 4))
        tps = sorted({r["tp"] for r in avail})
        pos = np.arange(len(tps))
        for k, policy in enumerate(("DP-DROP", "NTP")):
            vals = [
                next(r["replicas_available"] for r in avail if r["tp"] == t and r["policy"] == policy)
                for t in tps
            ]
            ax.bar(pos + (k - 0.5) * 0.38, [100 * v for v in vals], width=0.38, label=f"{policy} (simulated)")
        expected = [
            next(r["replicas_available_expected"] for r in avail if r["tp"] == t and r["policy"] == "DP-DROP")
            for t in tps
        ]
        if all(e is not None for e in expected):
            ax.plot(pos - 0.19, [100 * e for e in expected], "k_", ms=20, mew=2, label="DP-DROP expected")
        ax.set_xticks(pos, [f"TP{t}" for t in tps])
        lo = min(100 * r["replicas_available"] for r in avail)
        ax.set_ylim(max(0.0, lo - 5), 100.5)
        ax.set_ylabel("replicas available (%)")
        ax.set_title(f"{avail[0]['num_gpus']} GPUs, {100 * avail[0]['failed_fraction']:.2f}% failed")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False)
        paths.append(_save(fig, out_dir / "availability.png"))
    if results.timelines:
        paths.append(_plot_trace(plt, results.timelines[0], out_dir / "trace.png"))
    return paths


def _plot_trace(plt: Any, tl: TraceTimeline, path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    days = tl.times_h / 24
    top.step(days, tl.failed_gpus, where="post", color="tab:red")
    top.set_ylabel("failed GPUs")
    for policy, series in tl.throughput_rel.items():
        bottom.step(days, 100 * series, where="post", label=policy)
    bottom.set_ylabel("throughput (%)")
    bottom.set_xlabel("day")
    bottom.legend()
    top.set_title(f"failure trace (rate x{tl.rate_multiplier:g}), no spare domains")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def format_tables(results: SimResults, s: SimSettings) -> str:
    """The console report: availability, throughput vs failed fraction, trace and spares."""
    c, out = s.cluster, []
    avail = _study(results.records, "availability")
    if avail:
        a = avail[0]
        out.append(
            f"Replica availability: {a['num_gpus']} GPUs, {100 * a['failed_fraction']:.2f}% failed, "
            f"replica = one TP group, {a['samples']} placements"
        )
        out.append(f"{'TP':>4} {'DP-DROP':>9} {'expected':>9} {'NTP':>9}")
        for t in sorted({r["tp"] for r in avail}):
            drop = next(r for r in avail if r["tp"] == t and r["policy"] == "DP-DROP")
            ntp = next(r for r in avail if r["tp"] == t and r["policy"] == "NTP")
            out.append(
                f"{t:>4} {_pct(drop['replicas_available']):>9} "
                f"{_pct(drop['replicas_available_expected']):>9} {_pct(ntp['replicas_available']):>9}"
            )
        out.append("")
    out.append(
        f"Setting: {s.model.name} ({s.model.num_params / 1e9:.0f}B params), seq {s.seq_len}, "
        f"{s.train.tokens_per_batch} tokens/batch; {c.num_gpus} x {s.device.name}, domain {c.domain_size}, "
        f"TP{c.tp} x PP{c.pp}, {c.num_replicas} replicas, local batch {s.local_batch}, "
        f"spare domains {c.spare_domains}, packing {'on' if c.packing else 'off'}"
    )
    degs = [t for t in c.allowed_degrees() if t < c.tp]
    if degs:
        heads = "  ".join(f"TP{t}" for t in degs[:8])
        out.append(f"local batch kept on time at reduced TP ({heads}):")
        for tab in results.policy_tables:
            cells = "  ".join(
                f"{int(tab.batch[t])}" + (f"@x{tab.boost[t]:.3f}" if tab.boost[t] > 1 else "")
                for t in degs[:8]
            )
            out.append(f"  {tab.name:<8} {cells}")
    thr = _study(results.records, "throughput")
    if thr:
        out.append("")
        out.append(f"Throughput loss vs failure-free (mean of {s.placements.samples} placements)")
        out.append(f"{'failed':>8} " + " ".join(f"{p:>9}" for p in s.policies))
        for p in sorted({r["failed_fraction"] for r in thr}):
            rows = {r["policy"]: r for r in thr if r["failed_fraction"] == p}
            out.append(
                f"{100 * p:>7.3f}% "
                + " ".join(f"{_pct(1 - rows[x]['throughput_rel']):>9}" for x in s.policies)
            )
    trace = _study(results.records, "trace")
    if trace:
        f = s.failures
        out.append("")
        out.append(
            f"{f.days:g}-day failure trace, {f.rate_per_gpu_hour:.3g}/GPU-hour, "
            f"hardware {f.hardware_fraction:.0%} "
            f"repaired in {'/'.join(f'{h:g}' for h in f.hardware_repair_hours)} h, software in "
            f"{f.software_repair_hours:g} h, blast radius {f.blast_radius}"
        )
        out.append(
            f"{'rate':>5} {'policy':<8} {'events':>6} {'failed':>8} {'throughput':>10} {'min':>8} "
            f"{'spares':>7} {'spare GPUs':>10}"
        )
        for r in trace:
            spares = (
                "-"
                if r["spares_needed"] is None and not c.packing
                else (f">{f.max_spare_domains}" if r["spares_needed"] is None else str(r["spares_needed"]))
            )
            out.append(
                f"x{r['rate_multiplier']:<4g} {r['policy']:<8} {r['events']:>6} "
                f"{_pct(r['failed_fraction'], 3):>8} "
                f"{_pct(r['throughput_rel']):>10} {_pct(r['throughput_rel_min']):>8} {spares:>7} "
                f"{_pct(r['spare_gpus_fraction']):>10}"
            )
    strag = _study(results.records, "stragglers")
    if strag:
        g = s.stragglers
        r0 = strag[0]
        out.append("")
        out.append(
            f"{r0['days']:g}-day straggler trace: {r0['episodes']} slow-GPU episodes "
            f"({g.rate_per_gpu_hour:.3g}/GPU-hour, speed {g.speed[0]:g}-{g.speed[1]:g}, mean "
            f"{g.duration_hours:g} h), named after {g.detect_minutes:g} min, floor {g.floor:g}"
            f"{', shards weighed by speed in the TP group' if r0.get('weighs_shards') else ''}; "
            f"{_pct(r0['slow_gpu_fraction'], 4)} of GPUs slow on average"
        )
        out.append(f"{'policy':<10} {'throughput':>10} {'min':>8}")
        for r in strag:
            out.append(f"{r['policy']:<10} {_pct(r['throughput_rel']):>10} "
                       f"{_pct(r['throughput_rel_min']):>8}")
    return "\n".join(out)
