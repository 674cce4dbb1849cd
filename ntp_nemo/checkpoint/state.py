"""Model and optimizer state as named slices of logical tensors, keyed by parameter *name*.

Parameter names are layout-independent (`blocks.<global layer>.…`), so a name identifies the
same logical tensor on every layout.  Optimizer state is keyed by the owning parameter's name,
not by its index in the optimizer (indices change with the layout and the pipeline stage), and
a state tensor shaped like its parameter (Adam's moments, SGD's momentum) is sharded exactly
like it, so it reshards with the weights; any other state tensor (Adam's `step`) is replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ntp_nemo.quant.sharding import quantizer_buffers
from ntp_nemo.topology.shard import ShardSpec

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


@dataclass(frozen=True)
class NamedSlice:
    """This rank's `tensor`, the slice `spec` of the logical tensor of its key."""

    spec: ShardSpec
    tensor: torch.Tensor


def model_key(name: str) -> str:
    return MODEL_PREFIX + name


def optim_key(name: str, state_key: str) -> str:
    return f"{OPTIM_PREFIX}{name}/{state_key}"


def param_spec(p: torch.Tensor) -> ShardSpec:
    """A parameter's slice; one built outside the NTP layers (no `ntp_spec`) is taken as replicated."""
    spec = getattr(p, "ntp_spec", None)
    return spec if spec is not None else ShardSpec.full(p.shape)


def _state_spec(p: torch.Tensor, value: torch.Tensor) -> ShardSpec:
    return param_spec(p) if value.shape == p.shape else ShardSpec.full(value.shape)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, NamedSlice]:
    """Every tensor this rank holds: parameters, then per-parameter optimizer state by name."""
    out = {model_key(name): NamedSlice(param_spec(p), p.detach()) for name, p in model.named_parameters()}
    # Quantizer scales (amax) of a QAT model, sharded like the channels they scale.
    out.update({model_key(name): NamedSlice(buf.ntp_spec, buf.detach())
                for name, buf in quantizer_buffers(model).items()})
    if optimizer is not None:
        names = _param_names(model)
        for p, state in optimizer.state.items():
            name = names.get(id(p))
            if name is None:
                raise ValueError("the optimizer holds state for a tensor that is not a model parameter")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[optim_key(name, key)] = NamedSlice(_state_spec(p, value), value.detach())
    return out


def group_options(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Parameter name -> hyperparameters of its optimizer group (lr, betas, weight decay, …)."""
    names = _param_names(model)
    out = {}
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if id(p) in names:
                out[names[id(p)]] = options
    return out


def load_targets(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> tuple[dict[str, NamedSlice], list[str]]:
    """Tensors to fill from a checkpoint holding `stored` (key -> (global shape, dtype)).

    Parameters are filled in place.  Optimizer state tensors are refilled in place when the
    optimizer already holds them with the right shape, else allocated, for every state key the
    checkpoint has for a parameter (`install_optimizer_state` hands them to the optimizer).
    Returns the targets and a list of mismatches (missing parameters, different shapes).
    """
    targets: dict[str, NamedSlice] = {}
    problems: list[str] = []
    optim_keys: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX):].rpartition("/")
            optim_keys.setdefault(name, []).append(state_key)
    for name, buf in quantizer_buffers(model).items():
        key = model_key(name)
        if key not in stored:
            problems.append(f"quantizer scale {name} is not in the checkpoint")
        else:
            targets[key] = NamedSlice(buf.ntp_spec, buf)
    for name, p in model.named_parameters():
        spec = param_spec(p)
        key = model_key(name)
        if key not in stored:
            problems.append(f"parameter {name} is not in the checkpoint")
            continue
        shape, _ = stored[key]
        if tuple(shape) != tuple(spec.global_shape):
            problems.append(f"parameter {name} has shape {tuple(spec.global_shape)}, "
                            f"the checkpoint {tuple(shape)}")
            continue
        targets[key] = NamedSlice(spec, p.detach())
        if optimizer is None:
            continue
        for state_key in sorted(optim_keys.get(name, ())):
            shape, dtype = stored[optim_key(name, state_key)]
            st_spec = spec if tuple(shape) == tuple(spec.global_shape) else ShardSpec.full(tuple(shape))
            device = state_device(optimizer, p, st_spec.local_shape)
            buf = optimizer.state.get(p, {}).get(state_key)  # refilled in place when it fits
            if not (isinstance(buf, torch.Tensor) and tuple(buf.shape) == tuple(st_spec.local_shape)
                    and buf.dtype == dtype and buf.device == device):
                buf = torch.zeros(st_spec.local_shape, dtype=dtype, device=device)
            targets[optim_key(name, state_key)] = NamedSlice(st_spec, buf)
    return targets, problems


def state_device(optimizer: torch.optim.Optimizer, p: torch.Tensor, shape: tuple[int, ...]) -> torch.device:
    """Where the optimizer keeps a state tensor of `p`, as torch's own `load_state_dict` places it: a
    0-dim one (Adam's `step`) on the CPU unless the parameter's group is `fused` or `capturable`, every
    other on the parameter's device.  A `step` on the device would make the (non-capturable) foreach
    AdamW read it back to the host once per parameter, every step."""
    if len(shape) > 0:
        return p.device
    group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
    return p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def install_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaded: Mapping[str, NamedSlice],
    options: Mapping[str, dict] | None = None,
) -> None:
    """Replace the optimizer's state with the loaded tensors, and its groups' hyperparameters
    with the saved ones (a group takes those of its first parameter found in `options`)."""
    params = dict(model.named_parameters())
    optimizer.state.clear()
    for key, item in loaded.items():
        if not key.startswith(OPTIM_PREFIX):
            continue
        name, _, state_key = key[len(OPTIM_PREFIX):].rpartition("/")
        optimizer.state[params[name]][state_key] = item.tensor
    if not options:
        return
    names = _param_names(model)
    for group in optimizer.param_groups:
        saved = next((options[names[id(p)]] for p in group["params"] if names.get(id(p)) in options), None)
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
