"""The `quant` config group: format, calibration budget and exclusions, mapped onto modelopt configs.

Kept free of modelopt at import time (it costs ~10 s per process): only `modelopt_config` imports it,
and only when a format other than `none` is chosen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ntp_nemo.errors import ConfigError

# format -> modelopt preset; `nvfp4` quantises in dynamic blocks of 16 whose kernels need CUDA.
PRESETS = {"int8": "INT8_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
FORMATS = ("none", *PRESETS)
CUDA_ONLY = ("nvfp4",)


@dataclass
class QuantConfig:
    """Quantisation-aware training settings (`quant=int8`, `quant.calib_batches=8`, ...)."""

    _target_: str = "ntp_nemo.lightning.qat.QuantizationCallback"
    format: str = "none"  # none | int8 | fp8 | nvfp4
    calib_batches: int = 4  # global batches of the training stream used for max calibration
    start_step: int = 0  # step at which calibration runs and QAT begins (earlier steps: full precision)
    exclude: list[str] = field(default_factory=lambda: ["head"])  # module-name patterns left unquantised


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def validate_quant(cfg: Any) -> None:
    """Reject impossible `quant.*` values before anything is launched (`cfg` is the root config)."""
    q = _get(cfg, "quant")
    if q is None:
        return
    fmt = _get(q, "format", "none")
    if fmt not in FORMATS:
        raise ConfigError("quant.format", f"unknown format {fmt!r}. Use one of {', '.join(FORMATS)} "
                          "(e.g. quant=int8).")
    if fmt == "none":
        return
    if fmt in CUDA_ONLY:
        from ntp_nemo.parallel.devices import cuda_available  # no CUDA context in the launching parent

        accel = str(_get(_get(cfg, "trainer", {}), "accelerator", "cpu"))
        has_cuda = cuda_available()
        if accel == "cpu" or not has_cuda:
            raise ConfigError("quant.format", f"{fmt!r} fake quantisation runs only on CUDA GPUs (modelopt's "
                              f"block-quantisation kernels), but this run uses accelerator={accel!r}"
                              f"{'' if has_cuda else ' and no CUDA device is visible'}. "
                              "Use quant=int8 or quant=fp8 on CPU, or trainer=gpu on a CUDA machine.")
    calib = _get(q, "calib_batches", 1)
    if calib is None or int(calib) < 1:
        raise ConfigError("quant.calib_batches", f"must be a positive integer, got {calib!r}: calibration "
                          "needs at least one global batch. Set quant.calib_batches=<n> with n >= 1.")
    start = _get(q, "start_step", 0)
    if start is None or int(start) < 0:
        raise ConfigError("quant.start_step", f"must be >= 0, got {start!r}. Set quant.start_step=0 to "
                          "quantise from the first step.")
    exclude = _get(q, "exclude", [])
    if isinstance(exclude, str) or any(not isinstance(p, str) or not p for p in (exclude or [])):
        raise ConfigError("quant.exclude", f"must be a list of module-name patterns, got {exclude!r}; "
                          "e.g. quant.exclude='[head,blocks.0.*]'.")
    mesh = _get(cfg, "mesh")
    pp = int(_get(mesh, "pp", 1)) if mesh is not None else 1
    if pp > 1:
        raise ConfigError("quant.format", "quantisation-aware training calibrates through the whole model "
                          f"on every rank and does not support pipeline stages yet (mesh.pp={pp}). "
                          "Use mesh.pp=1 with quant, or quant=none.")


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
