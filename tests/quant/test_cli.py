"""`recipe=gpt_tiny_qat` through the real `ntp-train` CLI: full precision, then QAT from the checkpoint
taken at `quant.start_step`; a QAT checkpoint resumes on another layout with the same scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, read_metrics, run_cli, sweep_cases

QAT = ["recipe=gpt_tiny_qat", *TINY, "quant.start_step=2", "quant.calib_batches=2",
       "checkpoint.every_n_steps=2", "trainer.max_steps=6"]
CALIBRATED = "quant: int8 fake quantisation from step 2"


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run)}


@pytest.mark.slow
def test_qat_recipe_checkpoints_scales_and_resumes_resharded(tmp_path):
    from ntp_nemo.checkpoint import stored_tensors
    from ntp_nemo.checkpoint.sharded import META_FILE

    # Two jobs of one `ntp-train -m` sweep, in order: replicas (2, 1), full precision for 2 steps and QAT
    # for 4; then replicas (3, 2) from the first job's step-4 QAT checkpoint (restored, not calibrated).
    ckpt = tmp_path / "sweep" / "straight" / "checkpoints" / "step_000004"
    sweep = sweep_cases({"straight": ["hydra.sweep.subdir=straight"],
                         "resumed": ["mesh.tp=3", "ntp.replica_tp=[3,2]", f"resume={ckpt}",
                                     "hydra.sweep.subdir=resumed"]}, QAT, tmp_path)
    proc = sweep.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(CALIBRATED) == 1, proc.stdout[-3000:]
    straight, resumed = sweep.run_dir("straight"), sweep.run_dir("resumed")
    assert (straight / "train.log").read_text().count(CALIBRATED) == 1
    amax = [k for k in stored_tensors(ckpt) if k.endswith("_quantizer._amax")]
    assert amax and not any(k.startswith("model/head.") for k in amax)
    assert torch.load(ckpt / META_FILE, weights_only=True)["extra"]["quant"] is not None

    log = (resumed / "train.log").read_text()
    assert f"resuming from {ckpt}" in log and CALIBRATED not in log
    want, got = losses(straight), losses(resumed)
    assert sorted(got) == [5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_nvfp4_on_cpu_exits_2_without_traceback(tmp_path):
    proc = run_cli(["recipe=gpt_tiny_qat", "quant=nvfp4", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "quant.format" in proc.stderr and "CUDA" in proc.stderr and "Traceback" not in proc.stderr
