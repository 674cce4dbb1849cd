"""End-to-end training through the real `ntp-train` CLI (Hydra + Lightning + NTPStrategy)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import SINGLE, TINY, read_metrics, run_cli, sweep_cases
from tests.shapes import QUIET_RUN, TINY_DATA, TINY_MODEL


@pytest.fixture(scope="module")
def lr_sweep(tmp_path_factory):
    """`ntp-train -m optim.lr=1e-3,3e-3`, 30 steps each, one process, the CSV logger: the sweep of the test
    below, and (its job 1, TINY's own learning rate) the single-process run the test after it checks."""
    tmp = tmp_path_factory.mktemp("lr_sweep")
    sweep = tmp / "sweep"
    proc = run_cli(["-m", *TINY, *SINGLE, "trainer.max_steps=30", "logger=csv", "optim.lr=1e-3,3e-3",
                    f"hydra.sweep.dir={sweep}"], cwd=tmp)
    return proc, sweep


@pytest.mark.slow
def test_single_process_run_learns_and_writes_run_dir(lr_sweep):
    proc, sweep = lr_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = sweep / "1"
    assert "optim.lr=0.003" in (run / ".hydra" / "overrides.yaml").read_text()
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    for key in ("step", "loss", "tokens", "step_time_s", "layout"):
        assert key in metrics[0]
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < first - 1.0, (first, last)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["final_loss"] == metrics[-1]["loss"]
    assert (run / "goodput.jsonl").exists() and (run / ".hydra" / "config.yaml").exists()
    (csv_file,) = (run / "logs").rglob("metrics.csv")
    with open(csv_file, newline="") as fh:  # the CSV logger's step is metrics.jsonl's (the module logs it)
        rows = [r for r in csv.DictReader(fh) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [m["step"] for m in metrics]
    assert [float(r["train/loss"]) for r in rows] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    log = (run / "train.log").read_text()  # this job's console
    assert "run summary" in log and "tokens/s" in log
    # Launch to the first step, from the job's start.
    assert 0 < summary["startup_s"] < 300 and " s from the command to the first step" in log
    # 30 steps, validation every 1000: validated after the last step all the same.
    assert summary["val_loss"] is not None
    # The data's sizes once, in the header (no log line repeating it).
    assert sum(" train / " in line for line in log.splitlines()) == 1


@pytest.mark.slow
def test_multirun_sweep_makes_one_run_dir_per_job(lr_sweep):
    proc, sweep = lr_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0", "1"]
    overrides = [(p / ".hydra" / "overrides.yaml").read_text() for p in jobs]
    assert "optim.lr=0.001" in overrides[0] and "optim.lr=0.003" in overrides[1]
    losses = [read_metrics(p)[-1]["loss"] for p in jobs]
    assert losses[0] != losses[1]  # the two learning rates really ran
    # Each job's startup is its own: the second job's starts after the first job's last step.
    summaries = [json.loads((p / "summary.json").read_text()) for p in jobs]
    first_steps = [read_metrics(p)[0] for p in jobs]
    second_began = first_steps[1]["time"] - first_steps[1]["step_time_s"] - summaries[1]["startup_s"]
    assert second_began >= read_metrics(jobs[0])[-1]["time"], summaries
    table = (sweep / "sweep_summary.md").read_text()
    assert "optim.lr=0.001" in table and "optim.lr=0.003" in table
    assert (sweep / "sweep_summary.csv").exists()
    assert proc.stdout.count("run summary") == 2  # each job's, on the sweep's console


LAYOUTS = {
    "dp2-tp2": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]"],
    "ntp-2-1": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]"],
    "ntp-3-2": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]"],
    "pp2-ntp-2-1": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "mesh.pp=2", "layout.schedule=1f1b"],
    # Sequence parallelism: data.seq_len=32 splits 10, 11, 11 over degree 3 (and 16, 16 over 2).
    "ntp-3-2-sp": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]", "ntp.sequence_parallel=true"],
    "pp2-ntp-2-1-sp": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "mesh.pp=2", "layout.schedule=1f1b",
                       "ntp.sequence_parallel=true"],
    # ... and with per-layer degrees: the first layer at TP 1 gathers the whole sequence, the next layer
    # re-splits it over 3 (or 2 on the degraded replica).
    "ntp-3-2-per-layer-sp": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]", "layout.layer_tp=[3,1,3,3]",
                             "ntp.sequence_parallel=true"],
    # Shards of whole 32-element blocks (128 MLP columns over 3 ranks: 32, 32, 64) on (3, 2), with
    # per-layer degrees (the embedding and the last layer at TP 3, or 2 on the degraded replica; the first
    # layer at TP 1).
    "ntp-3-2-aligned-per-layer": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]", "ntp.shard_align=32",
                                  "layout.layer_tp=[3,1,3,3]"],
    # Block (SUMMA) sharding on a 2x2 grid: micro-batches of 2 sequences split along the grid rows, 64
    # features along its columns (tests/parallel/test_block_exactness.py proves it exact in float64).
    "block-2x2": ["mesh.dp=1", "mesh.tp=4", "ntp.replica_tp=[4]", "ntp.pattern=block"],
    # Replicas of different patterns: the 2x2 grid beside a row/column TP-2 replica (2 is no square),
    # gradients synced across the patterns and the final checkpoint written by both.
    "block-2x2-beside-tp2": ["mesh.dp=2", "mesh.tp=4", "ntp.replica_tp=[4,2]", "ntp.pattern=block"],
}


# bf16 autocast on (2,1), and on the 2x2 grid: two more jobs of the same sweep.
BF16 = [*LAYOUTS["ntp-2-1"], "trainer.precision=bf16-mixed"]
BF16_BLOCK = [*LAYOUTS["block-2x2"], "trainer.precision=bf16-mixed"]
STEPS = 8  # equality of curves shows from the first steps; the schedule is that of an 8-step run


@pytest.fixture(scope="module")
def layout_sweep(tmp_path_factory):
    """Every layout of LAYOUTS (and bf16 on (2,1) and on the 2x2 grid), 8 steps each: one `ntp-train -m`
    sweep."""
    return sweep_cases({**LAYOUTS, "bf16": BF16, "bf16-block": BF16_BLOCK},
                       [*TINY, f"trainer.max_steps={STEPS}"], tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def single_process_curve(reference_losses):
    return list(reference_losses("single-8").values())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ntp_layout_follows_single_process_loss_curve(layout_sweep, single_process_curve, layout):
    metrics = read_metrics(layout_sweep.run_dir(layout))
    curve = [m["loss"] for m in metrics]
    assert len(curve) == STEPS
    for step, (a, b) in enumerate(zip(curve, single_process_curve, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{layout} step {step}: {a} vs {b}"
    expected = "(" + LAYOUTS[layout][2].split("[")[1].rstrip("]") + ")"
    assert metrics[0]["layout"] == expected + ("xPP2" if "mesh.pp=2" in LAYOUTS[layout] else "")


# llama_tiny with 4 KV heads: on 3 ranks its 8 query heads split 2/3/3 and two KV heads are held by two
# ranks each (shared KV heads, gradients summed over their holders). The tiny model's sizes and quiet run,
# with llama_tiny's 8 query heads and its own optimizer.
LLAMA_TINY = [
    "recipe=llama_tiny", "model.num_kv_heads=4",
    *(o for o in TINY_MODEL if not o.startswith("model.num_heads=")), *TINY_DATA, *QUIET_RUN,
    "checkpoint.every_n_steps=0", "trainer.max_steps=6",
]
LLAMA_LAYOUTS = {
    "ntp-3-2": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]"],
    "per-layer-3-2": ["mesh.dp=2", "mesh.tp=3", "ntp.replica_tp=[3,2]", "layout.layer_tp=[3,1,3,3]"],
}


@pytest.fixture(scope="module")
def llama_sweep(tmp_path_factory):
    """The one-process reference and every LLAMA_LAYOUTS case: one `ntp-train -m` sweep."""
    return sweep_cases({"single": SINGLE, **LLAMA_LAYOUTS}, LLAMA_TINY, tmp_path_factory.mktemp("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_tiny_with_shared_kv_heads_follows_single_process_curve(llama_sweep, layout):
    reference = [m["loss"] for m in read_metrics(llama_sweep.run_dir("single"))]
    curve = [m["loss"] for m in read_metrics(llama_sweep.run_dir(layout))]
    assert len(curve) == len(reference) == 6
    for step, (a, b) in enumerate(zip(curve, reference, strict=True), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{layout} step {step}: {a} vs {b}"


@pytest.mark.slow
def test_torchrun_launch_follows_the_same_curve(tmp_path, single_process_curve):
    """Under torchrun the ranks come from the launcher (Lightning's cluster environment): nothing is
    forked, only rank 0 writes the run directory, and the numbers are those of the local launch."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "-m",
        "ntp_nemo.train",
        *TINY,
        *LAYOUTS["ntp-2-1"],
        f"trainer.max_steps={STEPS}",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run summary") == 1
    out = proc.stdout + proc.stderr
    assert "Initializing distributed" not in out  # Lightning's line from every rank
    # The memory report: one block, one line per rank (estimate / measured side by side).
    assert out.count("memory per rank") == 1
    rank_lines = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert [line.split(":")[0] for line in rank_lines] == ["  rank 0", "  rank 1", "  rank 2"]
    assert all(" / " in line and "max RSS" in line for line in rank_lines)
    assert sum(" train / " in line for line in out.splitlines()) == 1  # the header, once
    curve = [m["loss"] for m in read_metrics(run)]
    assert len(curve) == STEPS
    for step, (a, b) in enumerate(zip(curve, single_process_curve, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"torchrun step {step}: {a} vs {b}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bf16", "bf16-block"])
def test_bf16_mixed_precision_tracks_float32(layout_sweep, single_process_curve, case):
    curve = [m["loss"] for m in read_metrics(layout_sweep.run_dir(case))]
    assert len(curve) == STEPS
    # bf16 autocast rounds activations to 8 mantissa bits: close to, but not equal to, the float32 curve
    assert max(abs(a - b) / b for a, b in zip(curve, single_process_curve, strict=True)) < 0.05
    assert curve != single_process_curve
