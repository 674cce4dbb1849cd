"""Layout-independent initialisation.

Each logical parameter is generated whole from a generator seeded by (seed, parameter name), one
parameter at a time, and the rank keeps only its slice; so every layout starts from exactly the
same unsharded model and no rank ever materialises more than one full parameter.
"""

from __future__ import annotations

import hashlib

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


@torch.no_grad()
def initialize_(model: nn.Module, seed: int) -> None:
    """Fill every parameter with its slice of the unsharded initialisation."""
    for name, p in model.named_parameters():
        spec = p.ntp_spec
        if spec.is_full and p.ntp_init[0] in ("zeros", "ones"):
            p.fill_(0.0 if p.ntp_init[0] == "zeros" else 1.0)
            continue
        p.copy_(spec.narrow(full_init(name, spec.global_shape, p.ntp_init, seed, p.dtype)))
