"""The `quant` config group: option files, validation (exit-2 errors) and the modelopt mapping."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ntp_nemo.config.paths import conf_dir
from ntp_nemo.config.quant_keys import validate_quant
from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.qat_config import FORMATS, QuantConfig, modelopt_config


def _root(**quant) -> OmegaConf:
    q = OmegaConf.merge(OmegaConf.structured(QuantConfig), quant)
    return OmegaConf.create({"quant": q, "trainer": {"accelerator": "cpu"}, "mesh": {"pp": 1}})


def test_every_format_has_an_option_file_that_fits_the_schema():
    files = sorted(p.stem for p in (conf_dir() / "quant").glob("*.yaml"))
    assert files == sorted(FORMATS)
    for name in files:
        option = OmegaConf.load(conf_dir() / "quant" / f"{name}.yaml")
        merged = OmegaConf.merge(OmegaConf.structured(QuantConfig), option)  # unknown keys would raise
        assert merged.format == name and merged._target_ == QuantConfig._target_
        if name != "nvfp4":
            validate_quant(OmegaConf.create({"quant": merged, "trainer": {"accelerator": "cpu"}}))


@pytest.mark.parametrize(("override", "key"), [
    ({"format": "int4"}, "quant.format"),
    ({"format": "int8", "calib_batches": 0}, "quant.calib_batches"),
    ({"format": "int8", "start_step": -1}, "quant.start_step"),
    ({"format": "int8", "exclude": [""]}, "quant.exclude"),
])
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        validate_quant(_root(**override))
    assert err.value.key == key


def test_nvfp4_on_cpu_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        validate_quant(_root(format="nvfp4"))
    assert err.value.key == "quant.format" and "CUDA" in str(err.value)


def test_pipeline_stages_are_rejected():
    cfg = _root(format="int8")
    cfg.mesh.pp = 2
    with pytest.raises(ConfigError, match="mesh.pp=2"):
        validate_quant(cfg)


def test_none_needs_nothing():
    validate_quant(_root(format="none"))
    validate_quant(OmegaConf.create({}))
    assert modelopt_config("none") is None


@pytest.mark.slow  # imports modelopt (~10 s)
def test_modelopt_mapping_disables_excluded_modules_and_modelopt_sync():
    cfg = modelopt_config("int8", ["head", "blocks.0.*"])
    entries = cfg["quant_cfg"]
    assert {"quantizer_name": "head.*", "enable": False} in entries
    assert {"quantizer_name": "blocks.0.*.*", "enable": False} in entries
    assert cfg["algorithm"] == {"method": "max", "distributed_sync": False}
    weight = next(e for e in entries if e["quantizer_name"] == "*weight_quantizer")
    assert weight["cfg"]["axis"] == 0 and weight["cfg"]["num_bits"] == 8
    assert modelopt_config("fp8")["quant_cfg"][1]["cfg"]["num_bits"] == (4, 3)
