"""modelopt quantised versions of the tensor-parallel linear layers.

The TP layers are not `nn.Linear` subclasses, so modelopt would leave them alone; registering these
classes makes `mtq.quantize` convert them in place (parameters, and so the optimizer's and the
gradient synchroniser's references, are kept).  The conversion quantises the layer's input (before
`copy_to_tp` for a column-parallel layer, the local input slice for a row-parallel one) and its local
weight slice, exactly where an unsharded `nn.Linear` would be quantised.

Importing this module imports modelopt; `register_tp_layers` is the only entry point.
"""

from __future__ import annotations

from modelopt.torch.quantization import tensor_quant
from modelopt.torch.quantization.nn import QuantModuleRegistry
from modelopt.torch.quantization.nn.modules.quant_module import QuantLinearConvBase
from modelopt.torch.utils.distributed import ParallelState

from ntp_nemo.parallel.layers import ColumnParallelLinear, RowParallelLinear


class _QuantTPLinear(QuantLinearConvBase):
    """Input and weight quantisers around the layer's own forward (which reads `self.weight`)."""

    default_quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def _setup(self) -> None:
        super()._setup()
        # No modelopt-side amax sync: NTP's replicas hold unequal shards, so
        # `ntp_nemo.quant.calibrate.sync_amax` reduces amax by global position instead.
        self.parallel_state = ParallelState(data_parallel_group=-1, tensor_parallel_group=-1,
                                            expert_model_parallel_group=-1)


class QuantColumnParallelLinear(_QuantTPLinear):
    pass


class QuantRowParallelLinear(_QuantTPLinear):
    pass


def register_tp_layers() -> None:
    """Register the quantised TP layers with modelopt (idempotent)."""
    for original, quantized in ((ColumnParallelLinear, QuantColumnParallelLinear),
                                (RowParallelLinear, QuantRowParallelLinear)):
        if original not in QuantModuleRegistry:
            QuantModuleRegistry.register({original: original.__name__})(quantized)
