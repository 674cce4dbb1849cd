"""TP- and DP-aware max calibration of a sharded model.

Every rank runs modelopt's max calibration on its own micro-batches and its own slices; then
`sync_amax` makes every amax the unsharded model's: each rank writes its local amax at its global
position in a zero buffer holding every logical amax, one MAX all-reduce over the world combines them
(amax >= 0, so the zeros are neutral), and each rank reads back its slice.  That one rule covers
per-tensor scales of sharded tensors (MAX over the shards), per-channel scales that follow the
channels' sharding (disjoint positions), replicas of unequal TP and replicas that saw different data
(MAX over replicas), in a single collective.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.qat_config import modelopt_config
from ntp_nemo.quant.sharding import (
    QUANTIZER_ROLES,
    quantizer_amax_spec,
    quantizer_buffers,
    split_block,
    tensor_sharding,
    tp_layers,
    tp_quantizers,
)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def sync_amax(model: nn.Module) -> int:
    """Make every amax equal to the unsharded model's (collective over the world); returns the count."""
    mine = {name: (q, layer, role) for name, q, layer, role in tp_quantizers(model)}
    local = {name: (quantizer_amax_spec(layer, role, q).global_shape, q._amax.dtype)
             for name, (q, layer, role) in mine.items() if q._buffers.get("_amax") is not None}
    # Every rank learns every logical amax (a rank without calibration data, or without the layer,
    # still takes part in the one all-reduce below with the same buffer layout).
    gathered: list = [local]
    if _world() > 1:
        gathered = [None] * _world()
        dist.all_gather_object(gathered, local)
    logical: dict[str, tuple] = {}
    for part in gathered:
        for name, (shape, dtype) in part.items():
            if logical.setdefault(name, (shape, dtype))[0] != shape:
                raise RuntimeError(f"ranks disagree on the global amax shape of {name}: "
                                   f"{logical[name][0]} vs {shape}")
    slots: dict[str, slice] = {}
    offset = 0
    for name in sorted(logical):
        size = torch.Size(logical[name][0]).numel()
        slots[name] = slice(offset, offset + size)
        offset += size
    flat = torch.zeros(offset, dtype=torch.float64, device=next(model.parameters()).device)

    def global_view(name: str) -> torch.Tensor:
        return flat[slots[name]].view(logical[name][0])

    for name in local:
        q, layer, role = mine[name]
        quantizer_amax_spec(layer, role, q).narrow(global_view(name)).copy_(q._amax)
    if _world() > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    for name, (shape, dtype) in logical.items():
        if name not in mine:
            continue  # a layer of another pipeline stage
        q, layer, role = mine[name]
        value = quantizer_amax_spec(layer, role, q, shape, is_global=True).narrow(global_view(name)).to(dtype)
        if name in local:
            q._amax.copy_(value)
        else:
            q.amax = value.clone()  # this rank saw no calibration data for it
    return len(logical)


def _block_sizes(config: dict, quantizer_name: str) -> dict | None:
    """Block sizes the (ordered, last match wins) modelopt config gives a quantizer, None if none/disabled."""
    found = None
    for entry in config["quant_cfg"]:
        if not fnmatch.fnmatch(quantizer_name, entry["quantizer_name"]) or entry.get("parent_class"):
            continue
        if entry.get("cfg") is not None:
            found = entry["cfg"].get("block_sizes") if entry.get("enable", True) else None
        elif entry.get("enable") is False:
            found = None
    return found


def check_block_alignment(model: nn.Module, fmt: str, config: dict) -> None:
    """Refuse a block format whose blocks a shard boundary would cut (before anything is quantised)."""
    from ntp_nemo.parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, layer in tp_layers(model):
        if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            continue
        for role in QUANTIZER_ROLES:
            blocks = _block_sizes(config, f"{name}.{role}")
            block = split_block(tensor_sharding(layer, role), blocks, 2 if role == "weight_quantizer" else 3)
            if block is not None:
                raise ConfigError(
                    "quant.format",
                    f"{fmt!r} quantises in blocks of {block} along the sharded dim of {name} "
                    f"({role.split('_')[0]}), and this layout's shard boundary there is not a multiple of "
                    f"{block}: the sharded model would use other scales than the unsharded one. Choose TP "
                    "degrees whose shards hold whole blocks, add the layer to quant.exclude, or use "
                    "quant=int8/fp8.")


def quantize_model(model: nn.Module, fmt: str, exclude: Sequence[str], batches: Iterable[torch.Tensor],
                   forward: Callable[[nn.Module, torch.Tensor], object] | None = None) -> int:
    """Insert fake quantisers into this rank's slice, max-calibrate on `batches`, sync amax.

    Collective: every rank of the world must call it with its own share of the calibration data
    (`batches` of one replica together cover its share; all replicas together, the global batches).
    `forward(model, batch)` runs one calibration forward (default: `model.loss_sum(batch)`).
    Returns the number of calibrated amax tensors.
    """
    import modelopt.torch.quantization as mtq

    from ntp_nemo.quant.modules import register_tp_layers

    register_tp_layers()
    config = modelopt_config(fmt, list(exclude))
    check_block_alignment(model, fmt, config)
    forward = forward or (lambda m, b: m.loss_sum(b))
    batches = list(batches)

    def loop(m: nn.Module) -> None:
        for b in batches:
            forward(m, b)

    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        mtq.quantize(model, config, loop)
    count = sync_amax(model)
    quantizer_buffers(model)  # annotate for checkpoints
    return count

