"""Save and restore the quantisation state on any layout.

modelopt's state (`mto.modelopt_state`) records the quantize config and, per quantizer, its
properties and the shapes of its buffers.  Those shapes are a rank's local amax shapes; `quant_state`
rewrites them to the logical (global) shapes so the state is layout-independent, and
`restore_quant_state` rewrites them to the local shapes of the layout being restored before modelopt
re-creates the quantizers.  The amax *values* are tensors of the model (see
`ntp_nemo.quant.sharding.quantizer_buffers`): the sharded checkpoint saves and reshards them like the
weights, after `restore_quant_state` has created them.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

from torch import nn

from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.sharding import (
    amax_spec,
    is_quantized,
    quantizer_amax_spec,
    quantizer_buffers,
    tensor_sharding,
)

FORMAT_VERSION = 1


def _quantizer_states(state: dict) -> list[dict]:
    """The per-quantizer state dicts of every mode recorded in a modelopt state."""
    out = []
    for _mode, entry in state["modelopt_state_dict"]:
        qs = entry.get("metadata", {}).get("quantizer_state")
        if qs is not None:
            out.append(qs)
    return out


def _layer_and_role(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, role = name.rpartition(".")
    return model.get_submodule(parent), role


def _localize_amax_shapes(model: nn.Module, state: dict) -> None:
    """Global amax shapes of a saved state -> this rank's local shapes (before the layers are converted)."""
    for qs in _quantizer_states(state):
        for name, entry in qs.items():
            buffers = entry.get("_pytorch_state_metadata", {}).get("buffers", {})
            if "_amax" in buffers:
                layer, role = _layer_and_role(model, name)
                spec = amax_spec(tuple(buffers["_amax"]["shape"]), entry.get("_axis"),
                                 tensor_sharding(layer, role), is_global=True)
                buffers["_amax"]["shape"] = spec.local_shape


def quant_state(model: nn.Module) -> dict[str, Any] | None:
    """Layout-independent quantisation state of a quantised model (None if it is not quantised).

    Picklable; identical on every rank of a layout without pipeline stages (any rank may write it).
    """
    if not is_quantized(model):
        return None
    import modelopt.torch.opt as mto

    state = copy.deepcopy(mto.modelopt_state(model))
    for qs in _quantizer_states(state):
        for name, entry in qs.items():
            buffers = entry.get("_pytorch_state_metadata", {}).get("buffers", {})
            if "_amax" in buffers:
                layer, role = _layer_and_role(model, name)
                q = layer.get_submodule(role)
                buffers["_amax"]["shape"] = quantizer_amax_spec(layer, role, q).global_shape
    return {"version": FORMAT_VERSION, "modelopt_state": state}


def restore_quant_state(model: nn.Module, state: dict[str, Any]) -> nn.Module:
    """Re-create the quantizers of `state` on this rank's (unquantised) slice, with local amax shapes.

    The amax buffers then exist (uninitialised) and are annotated; load their values from the
    checkpoint into `quantizer_buffers(model)` as for parameters.  Modules absent on this rank (other
    pipeline stages) are dropped from the state.
    """
    import modelopt.torch.opt as mto

    from ntp_nemo.quant.modules import register_tp_layers

    if state.get("version") != FORMAT_VERSION:
        raise ConfigError("resume", "the checkpoint's quantisation state has format version "
                          f"{state.get('version')!r}; this ntp_nemo reads version {FORMAT_VERSION}. Resume "
                          "it with the ntp_nemo version that wrote it, or start without it (resume=never).")
    register_tp_layers()
    ms = copy.deepcopy(state["modelopt_state"])
    present = {n for n, _ in model.named_modules()}
    for qs in _quantizer_states(ms):
        for name in [n for n in qs if n.rpartition(".")[0] not in present]:
            del qs[name]
    _localize_amax_shapes(model, ms)
    with contextlib.redirect_stdout(io.StringIO()):
        mto.restore_from_modelopt_state(model, ms)
    quantizer_buffers(model)
    return model
