"""Checks of the `quant` config group before anything is launched: the config layer's, so that
`quant/` never reads a config.  Imports neither torch nor modelopt."""

from __future__ import annotations

from typing import Any

from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.qat_config import CUDA_ONLY, FORMATS


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
        from ntp_nemo.launch.devices import cuda_available  # no CUDA context in the launching parent

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
