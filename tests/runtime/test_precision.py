"""Precision and the trainer/model keys that used to be accepted and ignored.

bf16-true (bfloat16 weights, gradients and optimizer state) on a degraded NTP layout follows the
float32 curve of a single process within bf16 tolerance (bf16-mixed on the same layout is covered by
tests/cli/test_train_cli.py); 16-mixed is refused before launch; `trainer.deterministic` reaches torch, and
`trainer.fill_uninitialized_memory` (off by default) with it;
a non-default `model._target_` is refused.
"""

from __future__ import annotations

import pytest

from ntp_nemo.errors import EXIT_CONFIG, ConfigError
from tests.conftest import SINGLE, TINY, compose, read_metrics, run_cli

STEPS = 5
NTP_2_1 = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]"]


def _curve(tmp_path, name: str, args: list[str]) -> list[float]:
    run = tmp_path / name
    proc = run_cli([*TINY, *args, f"trainer.max_steps={STEPS}", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = [m["loss"] for m in read_metrics(run)]
    assert len(curve) == STEPS
    return curve


@pytest.mark.slow
def test_bf16_true_on_an_ntp_layout_tracks_the_float32_curve(tmp_path, reference_losses):
    fp32 = list(reference_losses(f"single-{STEPS}").values())  # the float32 curve of one process (conftest)
    bf16 = _curve(tmp_path, "bf16", [*NTP_2_1, "trainer.precision=bf16-true"])
    rel = [abs(a - b) / b for a, b in zip(bf16, fp32, strict=True)]
    assert max(rel) < 5e-2, rel
    # Really computed in bfloat16: an NTP layout in float32 matches the single process to 1e-5.
    assert max(rel) > 1e-5, rel
    assert bf16[-1] < bf16[0]  # and it learns


def test_16_mixed_is_refused_before_launch(tmp_path):
    proc = run_cli([*TINY, *SINGLE, "trainer.precision=16-mixed", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG
    assert "trainer.precision" in proc.stderr and "bf16-mixed" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_custom_model_target_is_refused():
    from ntp_nemo.config.validate import validate

    cfg = compose([*TINY, *SINGLE, "model._target_=my_package.MyModel"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "model._target_" and "my_package.MyModel" in str(err.value)
    validate(compose([*TINY, *SINGLE, "model._target_=ntp_nemo.models.build_model"]))  # the default is fine


@pytest.mark.parametrize(("deterministic", "fill"), [(True, None), (True, True), (False, None)])
def test_trainer_deterministic_reaches_torch(tmp_path, deterministic, fill):
    import torch

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.config.validate import validate
    from ntp_nemo.lightning.factory import build_trainer

    overrides = [f"trainer.deterministic={str(deterministic).lower()}"]
    if fill is not None:
        overrides.append(f"trainer.fill_uninitialized_memory={str(fill).lower()}")
    cfg = compose([*TINY, *SINGLE, *overrides])
    validate(cfg)
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(not deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = not fill
    try:
        build_trainer(resolve(cfg), tmp_path, None)  # the Trainer sets the flags the workers inherit
        assert torch.are_deterministic_algorithms_enabled() is deterministic
        assert torch.utils.deterministic.fill_uninitialized_memory is bool(fill)  # off unless asked for
        if fill:  # what the flag does: a new tensor of a deterministic run holds NaN
            assert bool(torch.empty(64).isnan().all())
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
