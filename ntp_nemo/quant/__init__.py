"""Quantisation-aware training with nvidia-modelopt on NTP-sharded models.

`config` (the `quant` config group, `validate_quant`), `modules` (quantised TP layers registered with
modelopt), `sharding` (ShardSpecs of amax buffers), `calibrate` (TP/DP-aware max calibration),
`state` (layout-independent save/restore), `callback` (the Lightning callback).  Importing this
package does not import modelopt (~10 s per process); quantising or restoring a model does.
"""

from __future__ import annotations

from ntp_nemo.quant.config import FORMATS, QuantConfig, modelopt_config, validate_quant
from ntp_nemo.quant.sharding import is_quantized, quantizer_buffers
from ntp_nemo.quant.state import quant_state, restore_quant_state

__all__ = ["FORMATS", "QuantConfig", "is_quantized", "modelopt_config", "quant_state", "quantizer_buffers",
           "restore_quant_state", "validate_quant"]
