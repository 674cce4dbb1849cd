"""QuantizationCallback: fake quantisation (QAT) of the sharded model, calibrated TP/DP-aware.

Calibration runs at the start of the first optimizer step at or after `start_step` (steps before it
train in full precision): by then the strategy has built and sharded the model, and any checkpoint
(weights, global step) has been restored, so the scales are those of the weights being trained.  A
model that is already quantised (restored with `ntp_nemo.quant.quant_state.restore_quant_state`) is left
as it is.  Each replica calibrates on its share of the global batches of the next `calib_batches`
steps, the batches the unsharded model would see, and `sync_amax` makes every scale the unsharded
model's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.qat_config import FORMATS


class QuantizationCallback(Callback):
    """Quantise the LightningModule's `model` for QAT at step `start_step` (see the module docstring).

    `format`: none | int8 | fp8 | nvfp4; `calib_batches`: global batches used for max calibration;
    `exclude`: module-name patterns (fnmatch, relative to the model) left unquantised.
    """

    def __init__(self, format: str = "int8", calib_batches: int = 4, start_step: int = 0,
                 exclude: Sequence[str] = ("head",)) -> None:
        if format not in FORMATS:
            raise ConfigError("quant.format", f"unknown format {format!r}; use one of {', '.join(FORMATS)}.")
        self.format, self.calib_batches, self.start_step = format, int(calib_batches), int(start_step)
        self.exclude = list(exclude)

    def calibration_batches(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                            step: int) -> list[torch.Tensor]:
        """This replica's micro-batches of the global batches of steps `[step, step + calib_batches)`."""
        from ntp_nemo.lightning.batches import StepBatches

        runtime = getattr(trainer.strategy, "runtime", None)
        my_range = runtime.my_microbatches if runtime is not None else range
        stream = StepBatches(pl_module.data.train, pl_module.data.sampler, pl_module.micro_batch_size,
                             self.calib_batches, my_range)
        stream.start_step = step
        device = next(pl_module.model.parameters()).device
        return [mb.to(device) for i in range(self.calib_batches) for mb in stream[i]["micro"]]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        from ntp_nemo.quant.sharding import is_quantized

        if self.format == "none" or trainer.global_step < self.start_step:
            return
        if is_quantized(pl_module.model):
            return  # quantised already (calibrated earlier or restored from a checkpoint)
        self.calibrate(trainer, pl_module)

    def calibrate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Quantise and calibrate now (collective: every rank calls it at the same step)."""
        from ntp_nemo.quant.calibrate import quantize_model

        t0 = time.perf_counter()
        step = trainer.global_step
        count = quantize_model(pl_module.model, self.format, self.exclude,
                               self.calibration_batches(trainer, pl_module, step))
        if trainer.is_global_zero:
            print(f"quant: {self.format} fake quantisation from step {step}: {count} amax tensors "
                  f"calibrated on {self.calib_batches} global batches in {time.perf_counter() - t0:.1f} s"
                  f"{'; unquantised: ' + ', '.join(self.exclude) if self.exclude else ''}", flush=True)
