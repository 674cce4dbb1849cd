"""Kernels of RoPE per q or k tensor, forward and backward: today's `apply_rope` against the form it
replaced (the transformer module of `--baseline-commit`, read from git), side by side.

    python bench/rope_kernels.py [--baseline-commit REV]

Each variant rotates a [2, 3, 12, 8] tensor (batch, heads, sequence, head dim) in float32 and in bfloat16
(computed in float32, `rope_dtype`) with its own module's `rope_tables`; a dispatch mode counts the aten
operators that run (views, which launch nothing, left out), in the forward and in the backward of the
summed output.  Also printed: the largest difference between the two variants' outputs and input
gradients in float64.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BASELINE_COMMIT = "3dc4494"  # the last commit with the former RoPE (neg, cat, two multiplies, add)
VIEWS = ("detach", "alias", "view", "_unsafe_view", "slice", "transpose", "expand", "t", "ones_like")


class Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEWS and not func.is_view:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _baseline(rev: str) -> types.ModuleType:
    """`apply_rope` and `rope_tables` of `ntp_nemo/models/transformer.py` at `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:ntp_nemo/models/transformer.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    start = src.index("def rope_tables(")
    end = src.index("def fused_here(")
    mod = types.ModuleType("former_rope")
    exec("import torch\n" + src[start:end], mod.__dict__)  # noqa: S102 - the project's own source
    return mod


def count(apply_rope, rope_tables, dtype: torch.dtype) -> tuple[list[str], list[str]]:
    from ntp_nemo.models.transformer import rope_dtype

    x = torch.randn(2, 3, 12, 8).to(dtype).requires_grad_(True)
    cos, sin = rope_tables(12, 8, 10000.0, "cpu", rope_dtype(dtype))
    with Kernels() as fwd:
        y = apply_rope(x, cos, sin)
    g = torch.ones_like(y)
    with Kernels() as bwd:
        y.backward(g)
    return fwd.ops, bwd.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    args = ap.parse_args()
    from ntp_nemo.models import transformer as today

    former = _baseline(args.baseline_commit)
    for dtype in (torch.float32, torch.bfloat16):
        for name, mod in (("former", former), ("today", today)):
            fwd, bwd = count(mod.apply_rope, mod.rope_tables, dtype)
            print(f"  {str(dtype):15s} {name:7s} forward {len(fwd)} {fwd}  backward {len(bwd)} {bwd}")
    x = torch.randn(2, 3, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = []
    for mod in (former, today):
        xi = x.clone().requires_grad_(True)
        y = mod.apply_rope(xi, *mod.rope_tables(12, 8, 10000.0, "cpu", torch.float64))
        y.backward(torch.ones_like(y))
        out.append((y.detach(), xi.grad))
    print(f"  float64 today vs former: max |output diff| {(out[0][0] - out[1][0]).abs().max().item():.2e}, "
          f"max |grad diff| {(out[0][1] - out[1][1]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
