"""The `quant` settings: format, calibration budget and exclusions, mapped onto modelopt configs (the
config layer checks the keys: `config/quant_keys.py`).

Kept free of modelopt at import time (it costs ~10 s per process): only `modelopt_config` imports it,
and only when a format other than `none` is chosen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ntp_nemo.errors import ConfigError
from ntp_nemo.sealed import Sealable

# format -> modelopt preset; `nvfp4` quantises in dynamic blocks of 16 whose kernels need CUDA.
PRESETS = {"int8": "INT8_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
FORMATS = ("none", *PRESETS)
CUDA_ONLY = ("nvfp4",)


@dataclass
class QuantConfig(Sealable):
    """Quantisation-aware training settings (`quant=int8`, `quant.calib_batches=8`, ...)."""

    _target_: str = "ntp_nemo.lightning.qat.QuantizationCallback"
    format: str = "none"  # none | int8 | fp8 | nvfp4
    calib_batches: int = 4  # global batches of the training stream used for max calibration
    start_step: int = 0  # step at which calibration runs and QAT begins (earlier steps: full precision)
    exclude: list[str] = field(default_factory=lambda: ["head"])  # module-name patterns left unquantised


def modelopt_config(fmt: str, exclude: list[str] | tuple[str, ...] = ()) -> dict | None:
    """The modelopt quantize config for `fmt` (None for `none`), with `exclude` patterns disabled.

    Amax synchronisation is left to `ntp_nemo.quant.calibrate.sync_amax`: modelopt's own DP/TP sync
    assumes equal shards on every replica, which NTP layouts break.
    """
    if fmt == "none":
        return None
    if fmt not in PRESETS:
        raise ConfigError("quant.format", f"unknown format {fmt!r}. Use one of {', '.join(FORMATS)}.")
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, PRESETS[fmt]))
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
        {"quantizer_name": f"{pattern}.*", "enable": False} for pattern in exclude
    ]
    cfg["algorithm"] = {"method": "max", "distributed_sync": False}
    return cfg
