"""RoPE: the rotate-half rotation of every q and k head, against the textbook formula written here in
float64 (x1 cos - x2 sin, x2 cos + x1 sin with angle p * theta^(-2i/d)), forward and backward, and the
number of kernels it runs (aten operators that are not views, counted under a dispatch mode)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.models.transformer import apply_rope, rope_dtype, rope_tables

SEQ, HEADS, D, THETA = 12, 3, 8, 10000.0


def textbook(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] float64, rotated pair by pair (element i with i + d/2), angles from scratch."""
    out = torch.empty_like(x)
    half = D // 2
    for p in range(x.shape[2]):
        for i in range(half):
            a = p * THETA ** (-2 * i / D)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[:, :, p, i], x[:, :, p, i + half]
            out[:, :, p, i] = x1 * c - x2 * s
            out[:, :, p, i + half] = x2 * c + x1 * s
    return out


def test_matches_the_textbook_rotation_in_float64_forward_and_backward():
    x = torch.randn(2, HEADS, SEQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(SEQ, D, THETA, "cpu", torch.float64)
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    got, want = apply_rope(a, cos, sin), textbook(b)
    assert (got - want).abs().max().item() <= 1e-12
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    assert (a.grad - b.grad).abs().max().item() <= 1e-12


def test_a_transposed_view_and_bfloat16_input():
    """As attention hands it: q viewed [b, s, h, d] -> [b, h, s, d] (not contiguous); bfloat16 computes
    in float32 (`rope_dtype`) and is rounded once."""
    x = torch.randn(2, SEQ, HEADS, D, generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    cos, sin = rope_tables(SEQ, D, THETA, "cpu", rope_dtype(torch.bfloat16))
    want = textbook(x.to(torch.bfloat16).double())
    got = apply_rope(x.to(torch.bfloat16), cos, sin)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all()  # rounded once
    got32 = apply_rope(x, *rope_tables(SEQ, D, THETA, "cpu", torch.float32))
    assert (got32.double() - textbook(x.double())).abs().max() <= 1e-6


class Kernels(TorchDispatchMode):
    """The aten operators that run, views left out (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func._schema.is_mutable and func.is_view or func.__name__.split(".")[0] in (
                "detach", "alias", "view", "_unsafe_view", "slice", "transpose", "expand", "t"):
            return func(*args, **(kwargs or {}))
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("dtype", "most"), [(torch.float32, 3), (torch.bfloat16, 5)])
def test_forward_runs_at_most_three_kernels_plus_the_casts(dtype, most):
    x = torch.randn(2, HEADS, SEQ, D).to(dtype)
    cos, sin = rope_tables(SEQ, D, THETA, "cpu", rope_dtype(dtype))
    with Kernels() as k:
        apply_rope(x, cos, sin)
    assert len(k.ops) <= most, k.ops


@pytest.mark.parametrize(("dtype", "most"), [(torch.float32, 3), (torch.bfloat16, 5)])
def test_backward_runs_at_most_three_kernels_plus_the_casts(dtype, most):
    x = torch.randn(2, HEADS, SEQ, D).to(dtype).requires_grad_(True)
    cos, sin = rope_tables(SEQ, D, THETA, "cpu", rope_dtype(dtype))
    y = apply_rope(x, cos, sin)
    g = torch.ones_like(y)
    with Kernels() as k:
        y.backward(g)
    assert len(k.ops) <= most, k.ops


def test_traced_by_dynamo_in_one_graph():
    """`trainer.compile=true` compiles each block: RoPE must not break its graph."""
    x = torch.randn(2, HEADS, SEQ, D, requires_grad=True)
    cos, sin = rope_tables(SEQ, D, THETA, "cpu", torch.float32)
    explained = torch._dynamo.explain(apply_rope)(x, cos, sin)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
