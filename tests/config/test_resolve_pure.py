"""One pure resolve: `resolve(cfg) -> RunSpec` never changes the composed config, every entry point
(train and sweep jobs, the dry run, the coordinator) resolves the same run from the same command line,
the `RunSpec` is frozen all the way down, and the run directory records it (`.hydra/run_spec.json`)
where `ntp-export` reads it.  All in process, on the composed configs `ntp-train` would run."""

from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from tests.conftest import TINY, compose

# Each override makes resolve derive a value: warmup longer than the run (clamped), a mesh the
# recipe's replica_tp=[2,1] no longer fits (every replica at mesh.tp), a vocabulary rounded up to a
# multiple of 64 from the tokenizer's 257 ids.
DERIVING = [*TINY, "mesh.tp=1", "optim.warmup_steps=50", "trainer.max_steps=4", "data.vocab_multiple=64"]
EXPLICIT = {"mesh.tp", "optim.warmup_steps", "trainer.max_steps", "data.vocab_multiple"}


def _walk(value, path="spec"):
    """Every (path, value) inside a RunSpec, depth first."""
    yield path, value
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(value, (tuple, frozenset)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def test_resolve_derives_into_the_spec_and_leaves_the_config_alone():
    from ntp_nemo.config.resolve import resolve

    cfg = compose(DERIVING)
    before = OmegaConf.to_yaml(cfg)
    spec = resolve(cfg, EXPLICIT)
    assert OmegaConf.to_yaml(cfg) == before  # nothing written back into the composed config
    assert cfg.optim.warmup_steps == 50 and list(cfg.ntp.replica_tp) == [2, 1]
    assert cfg.model.vocab_size == 257 and cfg.data.tokenizer is None
    # ... the derived values are the spec's, and its record (.hydra/config.yaml) holds them.
    assert spec.optim.warmup_steps == 4 and spec.ntp.replica_tp is None
    assert spec.layout.replica_tp == (1, 1) and spec.model.vocab_size == 320 and spec.data.tokenizer == "byte"
    record = OmegaConf.create(spec.record)
    assert record.optim.warmup_steps == 4 and record.model.vocab_size == 320
    assert record.ntp.replica_tp is None and record.data.tokenizer == "byte"


def test_the_spec_is_frozen_all_the_way_down():
    from ntp_nemo.config.resolve import resolve

    spec = resolve(compose([*TINY, "fault.more=[{kind:slow,rank:0,step:3}]", "quant.exclude=[head,mlp]"]))
    seen = {type(v).__name__ for _, v in _walk(spec)}
    assert {"ModelConfig", "ResolvedLayout", "FaultConfig", "FaultSpec", "QuantConfig"} <= seen
    for path, value in _walk(spec):
        assert not isinstance(value, (list, set, bytearray)), f"{path} is a mutable {type(value).__name__}"
        if isinstance(value, dict):
            with pytest.raises(TypeError):
                value["x"] = 1
        if dataclasses.is_dataclass(value):
            first = dataclasses.fields(value)[0].name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(value, first, getattr(value, first))
    assert spec.failover.fault.more[0].kind == "slow" and spec.quant.exclude == ("head", "mlp")
    # A changed copy is a new value; the spec itself stays as resolved.
    changed = dataclasses.replace(spec.optim, lr=1.0)
    assert changed.lr == 1.0 and spec.optim.lr != 1.0


def test_every_entry_point_resolves_the_same_run():
    """The same command line gives the same layout to `ntp-train` (and each sweep job), to its dry run
    and to `ntp-coordinator`: the dry run used to skip the mesh rule and refuse this command (the
    recipe's replica_tp=[2, 1] does not fit mesh.tp=1) that `ntp-train` runs."""
    from ntp_nemo.cli.coordinator import _settings
    from ntp_nemo.dry_run_report import _checked_spec
    from ntp_nemo.train import check_config

    args = ["mesh.tp=1", "optim.warmup_steps=50", "trainer.max_steps=4"]
    explicit = {"mesh.tp", "optim.warmup_steps", "trainer.max_steps"}
    trained = check_config(compose(args), explicit)
    dry = _checked_spec(compose(args), explicit)
    world, _, end_step, _ = _settings(args)
    assert trained.layout == dry.layout and trained.layout.replica_tp == (1, 1)
    assert world == trained.layout.world_size == 2 and end_step == trained.trainer.max_steps == 4
    assert dry.optim.warmup_steps == trained.optim.warmup_steps == 4


def test_the_run_directory_records_the_spec_and_export_reads_it(tmp_path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.checkpoint.run_record import read_run_spec
    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs
    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.config.run_dir import save_record
    from ntp_nemo.hf.checkpoint_source import run_record

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        full = hydra_compose(config_name="config", overrides=DERIVING, return_hydra_config=True)
    HydraConfig.instance().set_config(full)
    try:
        cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])  # the task's config
        spec = resolve(cfg, EXPLICIT)
        run = tmp_path / "run"
        assert save_record(spec, run) is None
        doc = json.loads((run / ".hydra" / "run_spec.json").read_text())
        assert doc == json.loads(json.dumps(spec.to_dict())) == read_run_spec(run)
        assert doc["layout"]["replica_tp"] == [1, 1] and doc["model"]["vocab_size"] == 320
        assert OmegaConf.load(run / ".hydra" / "config.yaml").model.vocab_size == 320
        ckpt = run / "checkpoints" / "step_000004"
        ckpt.mkdir(parents=True)
        assert run_record(ckpt, "model")["vocab_size"] == 320  # what ntp-export builds the model from
        assert run_record(ckpt, "data")["tokenizer"] == "byte"
        # A second command with another config keeps the first record beside the new one.
        other = resolve(compose([*DERIVING, "optim.lr=1e-3"]), EXPLICIT)
        assert "another config" in save_record(other, run)
        kept = json.loads((run / ".hydra" / "previous" / "1" / "run_spec.json").read_text())
        assert kept["optim"]["lr"] == spec.optim.lr != other.optim.lr == read_run_spec(run)["optim"]["lr"]
        # A damaged record is refused with the key and the fix, not a traceback.
        (run / ".hydra" / "run_spec.json").write_text("[" * 1000)
        from ntp_nemo.errors import ConfigError

        with pytest.raises(ConfigError, match="not a readable run record"):
            run_record(ckpt, "model")
    finally:
        HydraConfig.instance().cfg = None
