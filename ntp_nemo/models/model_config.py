"""The model's architecture as a plain dataclass (also the `model` group of the training config)."""

from __future__ import annotations

from dataclasses import dataclass

from ntp_nemo.sealed import Sealable


@dataclass
class ModelConfig(Sealable):
    _target_: str = "ntp_nemo.models.build_model"
    arch: str = "gpt2"  # gpt2 (LayerNorm, learned positions, GELU, biases) | llama (RMSNorm, RoPE, SwiGLU)
    name: str = "gpt_tiny"
    vocab_size: int = 257
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads
    ffn_hidden_size: int = 1024
    max_seq_len: int = 256
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    dropout: float = 0.0  # residual dropout after attention and after the MLP (training only)
    init_from: str | None = None  # a Hugging Face model directory to start from
    # Activation recomputation: none | selective (attention core: RoPE, GQA expansion, softmax(QK^T)V;
    # no communication inside) | full (whole transformer layers, TP collectives re-run in the backward).
    recompute: str = "none"
    recompute_every: int = 1  # with recompute=full: every k-th layer (global layer index % k == 0)
