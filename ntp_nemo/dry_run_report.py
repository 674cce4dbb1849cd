"""The report of `ntp-train ... trainer.dry_run=true`: checks the config, dry-runs one training step of
every rank of the configured layout on CPU, writes `dry_run.json` and prints its summary.

No GPU, no peers, no data: every rank's model slice is built on the meta device, the process groups
live on torch's fake backend, and one step's shapes run through the real runtime
(`ntp_nemo.runtime.dry_run`).  Writes `dry_run.json` in the run directory (per global rank: replica,
stage, TP degree, parameters held and their bytes, gradient, optimizer and activation bytes, bytes per
group kind per step; plus the unsharded model's parameter count) and prints the largest and smallest
rank and the totals.  The data and tokenizer files are never opened: the step needs only
`data.seq_len`, `data.micro_batch_size`, `data.global_batch_size` and `model.vocab_size` (the
vocabulary as configured; a real run sizes it from the tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from ntp_nemo.errors import ConfigError

if TYPE_CHECKING:
    from ntp_nemo.config.resolve import RunSpec

# trainer.precision -> (dtype of parameters, gradients and optimizer state; dtype of activations)
PRECISION_DTYPES = {
    "32-true": ("float32", "float32"),
    "64-true": ("float64", "float64"),
    "bf16-true": ("bfloat16", "bfloat16"),
    "bf16-mixed": ("float32", "bfloat16"),  # fp32 parameters are the master weights; autocast to bf16
    "16-mixed": ("float32", "float16"),
}

GiB = float(1 << 30)


def _checked_spec(cfg: DictConfig, explicit: Collection[str]) -> RunSpec:
    """The run as `ntp-train` would resolve it (`resolve`), with nothing that needs data files."""
    from ntp_nemo.config.resolve import resolve

    spec = resolve(cfg, explicit, reads_data=False)
    if spec.model.vocab_size is None:
        raise ConfigError("model.vocab_size", "the dry run reads no tokenizer: give model.vocab_size=N.")
    return spec


def rank_rows(result) -> list[dict[str, Any]]:
    out = []
    for r in result.ranks:
        row = dataclasses.asdict(r)
        row["signature"] = list(r.signature)
        row["memory_bytes"] = r.memory_bytes
        out.append(row)
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("params", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "memory_bytes")
    out: dict[str, Any] = {k: sum(r[k] for r in rows) for k in keys}
    out["comm_bytes"] = {k: sum(r["comm_bytes"][k] for r in rows) for k in rows[0]["comm_bytes"]}
    return out


def shard_sizes(layout, mcfg) -> dict[str, dict[str, list[int]]]:
    """Per TP degree in use: the MLP-column and vocabulary-row shard sizes, rank by rank of the group."""
    from ntp_nemo.topology.shard import aligned_sizes

    topo = layout.topology()
    degrees = sorted({topo.degree(r, s) for r in range(topo.dp) for s in range(len(topo.layer_tp))})
    return {str(d): {"mlp_columns": aligned_sizes(d, int(mcfg.ffn_hidden_size), layout.shard_align),
                     "vocab_rows": aligned_sizes(d, int(mcfg.vocab_size), layout.shard_align)}
            for d in degrees}


def _runs(sizes: list[int]) -> str:
    """1792 x 8 ... in order of first appearance."""
    counts: dict[int, int] = {}
    for s in sizes:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{s} x{n}" for s, n in counts.items())


def shard_lines(report: dict[str, Any]) -> list[str]:
    out = [f"shard sizes (ntp.shard_align={report['shard_align']}):"]
    for d, s in report["shard_sizes"].items():
        out.append(f"  TP {d}: MLP columns {_runs(s['mlp_columns'])}; "
                   f"vocabulary rows {_runs(s['vocab_rows'])}")
    return out


def sockets_per_rank(rows: list[dict[str, Any]], world_size: int, async_save: bool) -> dict[str, int]:
    """The most TCP sockets gloo opens on a rank: on GPUs (gloo beside NCCL, only the world group and
    the checkpoint writer's group are gloo) and on CPU (every group is gloo)."""
    from ntp_nemo.topology.groups import gloo_sockets

    most = max(r["subgroup_peers"] for r in rows)
    return {"gpu": gloo_sockets(world_size, most, gloo_subgroups=False, checkpoint_group=async_save),
            "cpu": gloo_sockets(world_size, most, gloo_subgroups=True, checkpoint_group=async_save)}


def sockets_line(report: dict[str, Any]) -> str:
    s = report["gloo_sockets_per_rank"]
    return (f"gloo sockets per rank (most): {s['gpu']} on GPUs (gloo only for the world group and the "
            f"checkpoint writer's; subgroups NCCL-only), {s['cpu']} on CPU (every group gloo)")


def print_table(report: dict[str, Any]) -> str:
    from rich.console import Console
    from rich.table import Table

    rows = report["ranks"]
    big = max(rows, key=lambda r: r["memory_bytes"])
    small = min(rows, key=lambda r: r["memory_bytes"])
    tbl = Table(title=f"dry run: layout {report['layout']} ({report['world_size']} ranks), "
                      f"model {report['model_params'] / 1e9:.3f}B params, {report['precision']}")
    for col in ("", "rank", "replica/stage", "TP", "params", "params GiB", "grads GiB", "optim GiB",
                "act/mb GiB", "act peak GiB", "memory GiB", "comm GiB/step tp|pp|dp|world"):
        tbl.add_column(col)

    def comm(c: dict[str, int]) -> str:
        return "|".join(f"{c[k] / GiB:.2f}" for k in ("tp", "pp", "dp", "world"))

    for label, r in (("largest", big), ("smallest", small)):
        tbl.add_row(label, str(r["rank"]), f"{r['replica']}/{r['stage']}", str(r["tp_degree"]),
                    f"{r['params'] / 1e6:.1f}M", f"{r['param_bytes'] / GiB:.2f}",
                    f"{r['grad_bytes'] / GiB:.2f}",
                    f"{r['optimizer_bytes'] / GiB:.2f}", f"{r['activation_bytes'] / GiB:.2f}",
                    f"{r['activation_peak_bytes'] / GiB:.2f}", f"{r['memory_bytes'] / GiB:.2f}",
                    comm(r["comm_bytes"]))
    t = report["totals"]
    tbl.add_row("total", "", "", "", f"{t['params'] / 1e6:.1f}M", f"{t['param_bytes'] / GiB:.2f}",
                f"{t['grad_bytes'] / GiB:.2f}", f"{t['optimizer_bytes'] / GiB:.2f}", "",
                f"{t['activation_peak_bytes'] / GiB:.2f}", f"{t['memory_bytes'] / GiB:.2f}",
                comm(t["comm_bytes"]))
    console = Console(width=170, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(tbl)
    return cap.get()


def replica_work_lines(report: dict[str, Any], capacities: list[float], rule: str = "work") -> list[str]:
    """Per replica: its slowest rank's modelled work over a healthy rank's, and the split the layout's
    capacity rule (`ntp.capacity`) gives it."""
    rows = report["ranks"]
    if not rows or rows[0].get("modelled_work") is None:
        return []
    lines = []
    for replica, cap in enumerate(capacities):
        mine = [r for r in rows if r["replica"] == replica]
        slow = max(mine, key=lambda r: r["modelled_work"])
        lines.append(f"replica {replica} (TP {slow['tp_degree']}): slowest rank {slow['rank']} models "
                     f"{slow['modelled_work']:.3f}x a healthy rank's work; capacity ({rule}) {cap:.3f}, "
                     f"{slow['microbatches']} micro-batches per step")
    return lines


def option_lines(options: dict[str, Any]) -> list[str]:
    """One line per memory-saving option measured on the largest rank."""
    lines = []
    rc = options.get("recompute")
    if rc:
        saved = ", ".join(f"{m} {b / GiB:.2f}" for m, b in rc["saved_bytes"].items())
        lines.append(f"model.recompute on rank {rc['rank']}: activations per micro-batch "
                     f"{rc['activation_bytes']['none'] / GiB:.2f} GiB without; saves (GiB) {saved}")
    sp = options.get("sequence_parallel")
    if sp:
        off, on = sp["activation_bytes"]["off"], sp["activation_bytes"]["on"]

        def wire(ops: dict) -> str:
            return ", ".join(f"{op} {v['ring_bytes'] / GiB:.3f}" for op, v in ops.items())

        ops = sp["tp_collectives"]
        lines.append(f"ntp.sequence_parallel on rank {sp['rank']}: activations per micro-batch "
                     f"{off / GiB:.2f} -> {on / GiB:.2f} GiB ({(off - on) / max(off, 1):.0%} less); TP link "
                     f"GiB per micro-batch off: {wire(ops['off'])}; on: {wire(ops['on'])}")
    do = options.get("distributed_optimizer")
    if do:
        before, after = do["optimizer_bytes"]["adamw"], do["optimizer_bytes"]["distributed"]
        lines.append(f"distributed optimizer on rank {do['rank']}: optimizer state {before / GiB:.2f} -> "
                     f"{after / GiB:.2f} GiB (saves {do['saved_bytes'] / GiB:.2f} GiB)")
    return lines


def run_dry(cfg: DictConfig, run_dir: Path, say=print, explicit: Collection[str] = ()) -> dict[str, Any]:
    """Validate and resolve the config (`explicit`: the keys set on the command line), run the dry step
    for every rank, write `dry_run.json`."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    spec = _checked_spec(cfg, explicit)
    layout, mcfg = spec.layout, spec.model
    import torch

    from ntp_nemo.runtime.dry_run import StepShape, dry_run

    precision = str(spec.trainer.precision)
    param_dtype, compute_dtype = (getattr(torch, n) for n in PRECISION_DTYPES[precision])
    shape = StepShape(
        seq_len=int(spec.data.seq_len),
        micro_batch_size=int(spec.data.micro_batch_size),
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        grad_clip=float(spec.optim.grad_clip or 0.0),
        bucket_mb=float(spec.ntp.grad_bucket_mb),
        seed=int(spec.seed),
        tp_chunks=int(spec.ntp.tp_chunks),
    )
    say(f"dry run: {layout.describe()} ({layout.world_size} ranks), model {mcfg.name}, {precision}, "
        f"seq {shape.seq_len} x micro-batch {shape.micro_batch_size}, {layout.num_microbatches} "
        f"micro-batches per step {list(layout.microbatches)}; meta device, fake process group, no data read",
        flush=True)
    async_save = bool(spec.checkpoint.async_save)
    result = dry_run(layout, mcfg, shape, progress=lambda msg: say(f"  {msg}", flush=True),
                     checkpoint_group=async_save)
    rows = rank_rows(result)
    report: dict[str, Any] = {
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "resolved_layout": layout.to_dict(),
        "model": mcfg.name,
        "model_params": result.model_params,
        "precision": precision,
        "param_dtype": str(param_dtype).removeprefix("torch."),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "seq_len": shape.seq_len,
        "micro_batch_size": shape.micro_batch_size,
        "global_batch_size": int(spec.data.global_batch_size),
        "vocab_size": int(mcfg.vocab_size),
        "distinct_model_slices": result.signatures,
        "ranks": rows,
        "totals": totals(rows),
        # Memory each optional saving would bring (activation recomputation, distributed optimizer, ...):
        # one entry per option, filled by `ntp_nemo.runtime.dry_run.option_savings`.
        "options": result.options,
        "shard_align": layout.shard_align,
        "shard_sizes": shard_sizes(layout, mcfg),
        "gloo_sockets_per_rank": sockets_per_rank(rows, layout.world_size, async_save),
        "communicator_splits": result.splits,
        "timings_s": {**result.timings, "wall_s": time.perf_counter() - t0,
                      "cpu_s": time.process_time() - cpu0},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "dry_run.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    say(print_table(report), flush=True)
    for line in replica_work_lines(report, layout.capacities(), layout.capacity):
        say(line, flush=True)
    for line in shard_lines(report):
        say(line, flush=True)
    say(sockets_line(report), flush=True)
    for line in option_lines(report["options"]):
        say(line, flush=True)
    say(f"dry run finished in {report['timings_s']['wall_s']:.1f} s "
        f"({time.process_time() - cpu0:.1f} s of CPU time): {path}", flush=True)
    return report
