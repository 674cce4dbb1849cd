"""`recipe=gpt_tiny_qat` through the real `ntp-train` CLI: full precision, then QAT from the checkpoint
taken at `quant.start_step`; a QAT checkpoint resumes on another layout with the same scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, read_metrics, run_cli

QAT = ["recipe=gpt_tiny_qat", *TINY, "quant.start_step=2", "quant.calib_batches=2",
       "checkpoint.every_n_steps=2", "trainer.max_steps=6"]
CALIBRATED = "quant: int8 fake quantisation from step 2"


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run)}


@pytest.mark.slow
def test_qat_recipe_checkpoints_scales_and_resumes_resharded(tmp_path):
    from ntp_nemo.checkpoint import stored_tensors
    from ntp_nemo.checkpoint.sharded import META_FILE

    straight = tmp_path / "straight"  # replicas (2, 1): full precision for 2 steps, QAT for 4
    proc = run_cli([*QAT, f"hydra.run.dir={straight}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(CALIBRATED) == 1, proc.stdout[-3000:]
    ckpt = straight / "checkpoints" / "step_000004"
    amax = [k for k in stored_tensors(ckpt) if k.endswith("_quantizer._amax")]
    assert amax and not any(k.startswith("model/head.") for k in amax)
    assert torch.load(ckpt / META_FILE, weights_only=True)["extra"]["quant"] is not None

    resumed = tmp_path / "resumed"  # replicas (3, 2) from the step-4 QAT checkpoint: restored, not calibrated
    proc = run_cli([*QAT, "mesh.tp=3", "ntp.replica_tp=[3,2]", f"resume={ckpt}", f"hydra.run.dir={resumed}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert CALIBRATED not in proc.stdout
    want, got = losses(straight), losses(resumed)
    assert sorted(got) == [5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_nvfp4_on_cpu_exits_2_without_traceback(tmp_path):
    proc = run_cli(["recipe=gpt_tiny_qat", "quant=nvfp4", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "quant.format" in proc.stderr and "CUDA" in proc.stderr and "Traceback" not in proc.stderr
