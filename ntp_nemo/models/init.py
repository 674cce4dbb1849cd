"""Layout-independent initialisation.

Each logical parameter is generated whole from a generator seeded by (seed, parameter name), one
parameter at a time, and the rank keeps only its slice; so every layout starts from exactly the
same unsharded model and no rank ever materialises more than one full parameter.  A slice of leading
rows draws only the stream's prefix that reaches it (`slice_init`), the same numbers.  `build_slice`
allocates a rank's parameters (already slice-shaped) directly on its device and draws only when the
values are not coming from elsewhere (Hugging Face weights, a checkpoint about to be loaded).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init(name: str, shape: tuple[int, ...], rule: tuple, seed: int, dtype: torch.dtype) -> torch.Tensor:
    kind = rule[0]
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "normal":
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(rule[1]).to(dtype)
    raise ValueError(f"unknown init rule {rule!r} for {name}")


# CPU `normal_` fills a contiguous tensor of at least 16 elements in blocks of 16 (each block from its own
# 16 uniforms, in stream order) and, when the size is not a multiple of 16, redraws the last 16 elements.
_BLOCK = 16


def normal_prefix_length(total: int, needed: int) -> int:
    """How many elements of a `total`-element normal draw to generate so that its first `needed` are the
    full draw's own: `needed` rounded up to a block, unless that reaches the full draw's redrawn tail
    (then all of it)."""
    if total < _BLOCK:
        return total
    k = max(_BLOCK, -(-needed // _BLOCK) * _BLOCK)
    if k >= total or (total % _BLOCK and needed > total - _BLOCK):
        return total
    return k


def slice_init(name: str, spec, rule: tuple, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of `full_init(name, spec.global_shape, ...)`, the same numbers, drawing only the
    prefix of the generator's stream that reaches the slice's end when the slice is a run of leading-dim
    rows (column-parallel weights, vocabulary rows): a rank of a `t`-way split draws `(i + 1) / t` of the
    tensor instead of all of it, rank 0 a `t`-th."""
    shape = spec.global_shape
    if rule[0] != "normal" or spec.is_full or spec.dim != 0 or spec.is_block:
        return spec.narrow(full_init(name, shape, rule, seed, dtype))
    row = 1
    for d in shape[1:]:
        row *= d
    total = shape[0] * row
    n = normal_prefix_length(total, (spec.start + spec.length) * row)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    flat = torch.randn(n, generator=gen, dtype=torch.float32)
    rows = flat[spec.start * row : (spec.start + spec.length) * row].view(spec.local_shape)
    return rows.mul_(rule[1]).to(dtype)


@torch.no_grad()
def initialize_(model: nn.Module, seed: int) -> None:
    """Fill every parameter with its slice of the unsharded initialisation."""
    for name, p in model.named_parameters():
        spec = p.ntp_spec
        if spec.is_full and p.ntp_init[0] in ("zeros", "ones"):
            p.fill_(0.0 if p.ntp_init[0] == "zeros" else 1.0)
            continue
        p.copy_(slice_init(name, spec, p.ntp_init, seed, p.dtype))


def build_slice(
    make: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype | None, seed: int | None
) -> nn.Module:
    """`make()` (a rank's model slice: its parameters have their local shapes) allocated directly on
    `device` in `dtype`, filled with `initialize_(model, seed)`, or left unset (`torch.empty`) when
    `seed` is None: the caller overwrites every value (`model.init_from`, a checkpoint being resumed), so
    nothing is drawn.  Building under the device context puts the parameters and the buffers the
    constructors compute (`kv_of_q`) on the device at once: no host copy of the slice is made and moved.
    (Not the meta device: the constructors' buffers would have to be computed a second time, and the
    parameters hold only the rank's slice already.)"""
    device = torch.device(device)
    with torch.device(device):
        model = make()
    if dtype is not None:
        model.to(dtype)
    if seed is not None:
        initialize_(model, seed)  # draws on the host generator (layout-invariant), copies each slice in
    return model
