"""Which attention kernel grouped-query attention reaches (`models.transformer.sdpa_reads_groups`): SDPA's
own grouped K/V where a fused kernel takes it, K/V expanded where only the math kernel would (CUDA in
float32: the whole score matrix held for the backward), with the same result."""

from __future__ import annotations

import torch

from ntp_nemo.models.transformer import Attention, rope_tables, sdpa_reads_groups
from ntp_nemo.topology.tp_context import TPContext
from tests.ntp_cases import LLAMA


class _OnCuda:
    """A stand-in query that says it is a CUDA tensor (no GPU here)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.is_cuda, self.dtype = True, dtype


def test_float32_on_cuda_expands_kv_instead_of_the_math_kernel():
    assert sdpa_reads_groups(torch.zeros(1, dtype=torch.float32))  # CPU: flash takes groups in fp32
    assert sdpa_reads_groups(_OnCuda(torch.bfloat16)) and sdpa_reads_groups(_OnCuda(torch.float16))
    assert not sdpa_reads_groups(_OnCuda(torch.float32))


def test_expanded_kv_gives_the_grouped_result(monkeypatch):
    """The expansion path (forced on the CPU) against SDPA's grouped K/V, float64, forward and backward."""
    from ntp_nemo.models import transformer

    attn = Attention(LLAMA, TPContext(), 0.02).double()
    assert attn.group > 1 and attn.regular_gqa
    d = LLAMA.hidden_size // LLAMA.num_heads
    cos, sin = rope_tables(8, d, LLAMA.rope_theta, "cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, LLAMA.num_heads, 8, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, LLAMA.num_kv_heads, 8, d, generator=g, dtype=torch.float64) for _ in range(2))
    outs = []
    for grouped in (True, False):
        monkeypatch.setattr(transformer, "sdpa_reads_groups", lambda q, _g=grouped: _g)
        qkv = [t.clone().requires_grad_(True) for t in (q, k, v)]
        y = attn.core(*qkv, cos, sin)
        y.pow(2).sum().backward()
        outs.append([y.detach(), *(t.grad for t in qkv)])
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
