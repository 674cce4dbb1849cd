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
import io
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.quant.config import modelopt_config
from ntp_nemo.quant.sharding import quantizer_amax_spec, quantizer_buffers, tp_quantizers


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def sync_amax(model: nn.Module) -> int:
    """Make every amax equal to the unsharded model's (collective over the world); returns the count."""
    local: dict[str, tuple] = {}
    for name, q, layer, role in tp_quantizers(model):
        amax = q._buffers.get("_amax")
        if amax is not None:
            spec = quantizer_amax_spec(layer, role, q)
            local[name] = (spec.global_shape, amax.dtype)
    if _world() > 1:
        gathered: list = [None] * _world()
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    shapes: dict[str, tuple] = {}
    for part in gathered:
        for name, (shape, dtype) in part.items():
            if shapes.setdefault(name, (shape, dtype))[0] != shape:
                raise RuntimeError(f"ranks disagree on the global amax shape of {name}: "
                                   f"{shapes[name][0]} vs {shape}")
    names = sorted(shapes)
    sizes = [int(torch.Size(shapes[n][0]).numel()) for n in names]
    offsets = dict(zip(names, torch.tensor([0, *sizes]).cumsum(0).tolist(), strict=False))
    device = next(model.parameters()).device
    flat = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    mine = {name: (q, layer, role) for name, q, layer, role in tp_quantizers(model)}

    def view(name: str) -> torch.Tensor:
        return flat[offsets[name]: offsets[name] + sizes[names.index(name)]].view(shapes[name][0])

    for name in local:
        q, layer, role = mine[name]
        spec = quantizer_amax_spec(layer, role, q)
        spec.narrow(view(name)).copy_(q._amax)
    if _world() > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    for name in names:
        if name not in mine:
            continue  # another pipeline stage's layer
        q, layer, role = mine[name]
        spec = quantizer_amax_spec(layer, role, q, shapes[name][0], is_global=True)
        value = spec.narrow(view(name)).to(shapes[name][1])
        if getattr(q, "_amax", None) is None:
            q.amax = value.clone()  # this rank saw no calibration data for it
        else:
            q._amax.copy_(value)
    return len(names)


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
    forward = forward or (lambda m, b: m.loss_sum(b))
    batches = list(batches)

    def loop(m: nn.Module) -> None:
        for b in batches:
            forward(m, b)

    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        mtq.quantize(model, modelopt_config(fmt, list(exclude)), loop)
    count = sync_amax(model)
    quantizer_buffers(model)  # annotate for checkpoints
    return count


def is_quantized(model: nn.Module) -> bool:
    return next(tp_quantizers(model), None) is not None
