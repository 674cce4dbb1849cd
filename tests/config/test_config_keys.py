"""Every recipe composes and validates; invalid configs are rejected naming the key (exit 2 via the CLI)."""

from __future__ import annotations

import pytest

from ntp_nemo.config.register import available_recipes
from ntp_nemo.config.validate import check_environment, resolve_layer_tp, validate
from ntp_nemo.errors import ConfigError
from tests.conftest import compose, run_cli


def test_recipes_exist():
    assert {"gpt_tiny", "llama_tiny", "gpt2_124m", "llama3_8b"} <= set(available_recipes())


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes_and_validates(recipe):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.recipe == recipe
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(
        cfg.model, "init_from"
    ):  # needs a Hugging Face directory (tests/house/test_readme_commands.py runs it)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert err.value.key == "model.init_from"
        return
    validate(cfg)
    layer_tp = resolve_layer_tp(cfg)
    assert len(layer_tp) == cfg.model.num_layers + 2
    if cfg.trainer.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            with pytest.raises(ConfigError) as err:
                check_environment(cfg)
            assert err.value.key == "trainer.accelerator"


def test_qat_recipe_trains_at_the_default_recipes_learning_rate():
    """gpt_tiny's lr (1e-3): the optim group's 3e-3 spikes the full-precision phase of gpt_tiny_qat."""
    default, qat = compose(["recipe=gpt_tiny"]), compose(["recipe=gpt_tiny_qat"])
    assert qat.optim.lr == default.optim.lr == 1e-3 != compose(["recipe=llama_tiny"]).optim.lr


def test_recipe_selects_its_model_and_overrides_apply():
    cfg = compose(["recipe=llama_tiny", "model.num_layers=3", "mesh.tp=1", "ntp.replica_tp=[1,1]"])
    assert cfg.model.arch == "llama" and cfg.model.num_kv_heads == 2
    assert cfg.model.num_layers == 3 and list(cfg.ntp.replica_tp) == [1, 1]


INVALID = [
    (["mesh.tp=0"], "mesh.tp"),
    (["ntp.replica_tp=[2]"], "ntp.replica_tp"),
    (["ntp.replica_tp=[2,3]"], "ntp.replica_tp"),
    (["data.global_batch_size=10", "data.micro_batch_size=4"], "data.global_batch_size"),
    (["data.seq_len=1000"], "data.seq_len"),
    (["model.num_heads=3"], "model.num_heads"),
    (["mesh.tp=8", "ntp.replica_tp=[8,8]"], "mesh.tp"),
    (["layout.layer_tp=[2,3,2,2,2,2]"], "layout.layer_tp"),
    (["layout.layer_tp=[1,2,2,2,2,2]"], "layout.layer_tp"),  # tied embedding/head degrees differ
    (["trainer.precision=fp8"], "trainer.precision"),
    (["optim.lr=-1"], "optim.lr"),
    (["model.arch=bert"], "model.arch"),
    (["ntp.power_boost=5.0"], "ntp.power_boost"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["logger=none"], "callbacks.lr_monitor"),
    (["ntp.cpu_tp_backend=shm"], "ntp.cpu_tp_backend"),
]


@pytest.mark.parametrize("overrides,key", INVALID, ids=[k + ":" + o[0] for o, k in INVALID])
def test_invalid_config_names_the_key(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
        resolve_layer_tp(cfg)
    assert err.value.key == key
    assert key in str(err.value)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["ntp.replica_tp=[2,3]"], "ntp.replica_tp"),
        (["data.path=/nonexistent/corpus.txt"], "data.path"),
        (["resume=/nonexistent/ckpt"], "resume"),
        (["data.global_batch_size=10", "data.micro_batch_size=4"], "data.global_batch_size"),
        (["trainer=gpu"], "trainer.accelerator"),
    ],
)
def test_cli_rejects_bad_config_with_exit_2(tmp_path, overrides, key):
    import torch

    if key == "trainer.accelerator" and torch.cuda.is_available():
        pytest.skip("CUDA present")
    proc = run_cli([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_unknown_key_exits_2(tmp_path):
    proc = run_cli(["no_such_group.value=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "no_such_group" in proc.stderr
