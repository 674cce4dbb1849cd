"""The memory/overlap options through the real `ntp-train` CLI: all on (recomputation, distributed
optimizer, overlapped sync, interleaved 1F1B with 2 virtual stages) on PP 2 x replicas (2, 1), the loss
curve follows the single-process run without them; a bad value fails before launch with exit code 2."""

from __future__ import annotations

import pytest

from tests.conftest import SINGLE, TINY, read_metrics, run_cli, sweep_cases

OPTIONS = ["model.recompute=full", "optim.distributed=true", "ntp.overlap_grad_sync=true",
           "ntp.grad_bucket_mb=0.01", "mesh.pp=2", "layout.schedule=interleaved_1f1b",
           "layout.virtual_stages=2"]
LAYERS = ["model.num_layers=4"]
STEPS = 4


@pytest.mark.slow
def test_all_options_on_pp2_replicas_2_1_follow_the_plain_single_process_curve(tmp_path):
    # The plain one-process run and the run with every option: two jobs of one `ntp-train -m` sweep.
    sweep = sweep_cases({"ref": SINGLE, "run": ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", *OPTIONS]},
                        [*TINY, *LAYERS, f"trainer.max_steps={STEPS}"], tmp_path)
    proc = sweep.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = ("memory options: recompute=full, optimizer=DistributedAdamW, gradient sync=overlapped with the "
            "backward")
    assert said in proc.stdout, proc.stdout[-2000:]
    ref, run = sweep.run_dir("ref"), sweep.run_dir("run")
    assert said in (run / "train.log").read_text() and said not in (ref / "train.log").read_text()
    want = [m["loss"] for m in read_metrics(ref)]
    got = [m["loss"] for m in read_metrics(run)]
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"


def test_bad_option_exits_2_before_launch(tmp_path):
    proc = run_cli([*TINY, *SINGLE, "model.recompute=partial", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.recompute" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("overrides,key", [
    (["model.recompute_every=0"], "model.recompute_every"),
    (["mesh.pp=2", "layout.schedule=interleaved_1f1b"], "layout.virtual_stages"),
    (["mesh.pp=2", "layout.schedule=interleaved_1f1b", "layout.virtual_stages=3"], "layout.virtual_stages"),
    (["layout.schedule=interleaved_1f1b", "layout.virtual_stages=2"], "layout.schedule"),
    (["optim.distributed=true", "fault.recovery=live"], "optim.distributed"),
])
def test_bad_option_values_name_the_key(overrides, key):
    from ntp_nemo.config.validate import validate
    from ntp_nemo.errors import ConfigError
    from tests.conftest import compose

    cfg = compose([*TINY, *SINGLE, *overrides])  # TINY: 2 layers
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == key, err.value
