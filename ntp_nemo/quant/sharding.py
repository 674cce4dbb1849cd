"""How a quantizer's amax is sharded: the ShardSpec of every amax buffer of a quantised TP layer.

A quantizer reduces its tensor to amax over every dim not in its `axis` (keepdim).  If the reduced
dims include the tensor's sharded dim (per-tensor scales, per-output-channel scales of a row-parallel
weight, per-tensor input scales of a row-parallel layer), every rank's local amax covers only part of
the logical tensor and the logical amax is a MAX over ranks: the buffer is *full* (replicated).  If the
sharded dim is kept (per-output-channel scales of a column-parallel weight), the amax is split exactly
like the tensor: same dim, same units, same interval.  Checkpoints and `sync_amax` read these specs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ntp_nemo.topology.shard import ShardSpec

QUANTIZER_ROLES = ("input_quantizer", "weight_quantizer", "output_quantizer")


@dataclass(frozen=True)
class TensorSharding:
    """The sharded dim of a quantised tensor (negative: counted from the end) and its slice."""

    dim: int
    size: int  # global extent of `dim`
    unit_size: int
    lo: int
    hi: int


def tensor_sharding(layer: nn.Module, role: str) -> TensorSharding | None:
    """Sharding of the tensor a TP layer's quantizer sees (None: the tensor is whole on every rank).

    Column-parallel (weight rows split): the input is replicated, the weight and the output are split
    along the output features.  Row-parallel (weight columns split): the input's last dim and the
    weight's columns are split, the output is all-reduced (whole).
    """
    # The parameter itself, not the quantised view; an unsharded layer keeps its split spec (all units),
    # so an amax is described alike on every layout.
    spec: ShardSpec = layer._parameters["weight"].ntp_spec
    column = spec.dim == 0
    size = spec.global_shape[spec.dim]
    if role == "weight_quantizer":
        return TensorSharding(spec.dim, size, spec.unit_size, spec.lo, spec.hi)
    if (role == "input_quantizer" and not column) or (role == "output_quantizer" and column):
        return TensorSharding(-1, size, spec.unit_size, spec.lo, spec.hi)
    return None


def _kept_dims(axis: int | Sequence[int] | None, ndim: int) -> set[int]:
    if axis is None:
        return set()
    axes = [axis] if isinstance(axis, int) else list(axis)
    return {a % ndim for a in axes}


def amax_spec(shape: Sequence[int], axis, sharding: TensorSharding | None, *, is_global: bool) -> ShardSpec:
    """ShardSpec of an amax of `shape` (local, or global when `is_global`) under `sharding`."""
    shape = tuple(int(s) for s in shape)
    if sharding is None or not shape:
        return ShardSpec.full(shape)
    d = sharding.dim % len(shape)
    if d not in _kept_dims(axis, len(shape)):
        return ShardSpec.full(shape)
    global_shape = list(shape)
    global_shape[d] = sharding.size
    if is_global and shape[d] != sharding.size:
        raise ValueError(f"amax of global shape {shape} does not match the tensor's global extent "
                         f"{sharding.size}")
    spec = ShardSpec.split(tuple(global_shape), d, sharding.unit_size, sharding.lo, sharding.hi)
    if not is_global and tuple(shape) != spec.local_shape:
        raise ValueError(f"local amax of shape {shape} does not match its shard {spec.local_shape}")
    return spec


def split_block(sharding: TensorSharding | None, block_sizes: dict | None, ndim: int) -> int | None:
    """The block size a shard boundary cuts through (None: every quantisation block lies in one shard).

    Block formats (NVFP4) scale each run of `block` elements along a dim; a boundary inside a run
    gives the sharded model different blocks, hence different scales, than the unsharded one.
    """
    if sharding is None or not block_sizes:
        return None
    d = sharding.dim % ndim
    start, end = sharding.lo * sharding.unit_size, sharding.hi * sharding.unit_size
    for dim, block in block_sizes.items():
        if not isinstance(dim, int) or dim % ndim != d:
            continue  # another dim, or a setting ("type", "scale_bits")
        if start % block or (end % block and end != sharding.size):
            return int(block)
    return None


def _is_quantizer(module: nn.Module) -> bool:
    # No quantizer can exist before modelopt is imported, and the check must not import it (~10 s).
    qnn = sys.modules.get("modelopt.torch.quantization.nn")
    return qnn is not None and isinstance(module, qnn.TensorQuantizer)


def tp_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every layer whose weight carries a ShardSpec (the TP linear and embedding layers)."""
    for name, layer in model.named_modules():
        if hasattr(layer._parameters.get("weight"), "ntp_spec"):
            yield name, layer


def tp_quantizers(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    """(quantizer name, quantizer, its TP layer, role) for every quantizer of a quantised TP layer."""
    for name, layer in tp_layers(model):
        for role in QUANTIZER_ROLES:
            q = layer._modules.get(role)
            if q is not None and _is_quantizer(q):
                yield (f"{name}.{role}" if name else role), q, layer, role


def is_quantized(model: nn.Module) -> bool:
    """Whether the model's TP layers carry quantizers (calibrated, or restored from a checkpoint)."""
    return next(tp_quantizers(model), None) is not None


def quantizer_amax_spec(layer: nn.Module, role: str, quantizer: nn.Module, shape: Sequence[int] | None = None,
                        *, is_global: bool = False) -> ShardSpec:
    """ShardSpec of `quantizer`'s amax (its live `_amax` unless `shape` is given)."""
    if getattr(quantizer, "block_sizes", None) and getattr(quantizer, "_amax", None) is not None \
            and quantizer._amax.numel() > 1:
        raise NotImplementedError("static block-quantisation scales are not supported on sharded layers")
    if shape is None:
        shape = tuple(quantizer._amax.shape)
    return amax_spec(shape, quantizer.axis, tensor_sharding(layer, role), is_global=is_global)


def _copies(layer: nn.Module, spec: ShardSpec) -> int:
    """Identical copies of the buffer in the replica, counted like parameters (`ntp_copies`)."""
    tp = layer.tp
    return tp.copies if not spec.is_full or not tp.sharded else tp.size * tp.copies


def quantizer_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every amax buffer of the quantised TP layers, by its `state_dict` name, annotated for checkpoints.

    Each returned tensor is the live buffer (load it in place with `copy_`) carrying `ntp_spec` (the
    slice it holds of the logical amax) and `ntp_copies`, like the model's parameters.  Call it again
    after anything that replaces buffers (`model.to(...)`): annotations live on tensor objects.
    """
    out: dict[str, torch.Tensor] = {}
    for name, q, layer, role in tp_quantizers(model):
        amax = q._buffers.get("_amax")
        if amax is None:
            continue
        spec = quantizer_amax_spec(layer, role, q)
        amax.ntp_spec = spec  # type: ignore[attr-defined]
        amax.ntp_copies = _copies(layer, spec)  # type: ignore[attr-defined]
        out[f"{name}._amax"] = amax
    return out
