"""Quantisation-aware training with nvidia-modelopt on NTP-sharded models.

`config` (the `quant` settings and their modelopt presets), `modules` (quantised TP layers registered with
modelopt), `sharding` (ShardSpecs of amax buffers, `quantizer_buffers`), `calibrate` (TP/DP-aware max
calibration), `state` (layout-independent save/restore), `callback` (the Lightning callback).
Importing this package imports neither torch nor modelopt (~10 s per process): the config schema
imports it; quantising or restoring a model imports modelopt.
"""

from __future__ import annotations

from ntp_nemo.quant.qat_config import FORMATS, QuantConfig, modelopt_config

__all__ = ["FORMATS", "QuantConfig", "modelopt_config"]
