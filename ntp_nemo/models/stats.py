"""Parameter count and training FLOPs per token of the logical (unsharded) model."""

from __future__ import annotations

from ntp_nemo.models.families import family_of, model_shape
from ntp_nemo.models.model_config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    h, f, L, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.vocab_size
    nkv = cfg.num_kv_heads or cfg.num_heads
    d = h // cfg.num_heads
    fam = family_of(cfg)
    qkv_bias, o_bias = fam.attention_bias
    norm = h * (2 if fam.norm_bias else 1)
    attn = h * cfg.num_heads * d * 2 + h * nkv * d * 2
    mlp = (3 if fam.gated_mlp else 2) * h * f
    biases = ((cfg.num_heads * d + 2 * nkv * d) if qkv_bias else 0) + (h if o_bias else 0)
    biases += (f + h) if fam.linear_bias else 0
    per_layer = attn + mlp + 2 * norm + biases
    emb = V * h + (cfg.max_seq_len * h if fam.learned_positions else 0)
    head = 0 if cfg.tie_embeddings else V * h
    final_norm = norm
    return L * per_layer + emb + head + final_norm


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward+backward FLOPs per token: 6 x matmul parameters + 12·L·h·s for the attention scores.

    The attention term counts the full s x s products (QK^T and AV, 2·s·h FLOPs each per layer in the
    forward: 4·L·h·s, three times that with the backward), the convention of PaLM's and Megatron's
    MFU, so figures compare with published ones.  A causal kernel skips about half of it (6·L·h·s):
    the attention share of an MFU from this count is twice the work such a kernel does.
    """
    shape = model_shape(cfg)  # the planner's shape: one count of the matmul parameters
    matmul = shape.num_layers * shape.layer_params + shape.embedding_params
    d = shape.head_dim
    # s·h multiply-adds each for QK^T and AV per layer, counted like parameters (x6): full, non-causal
    attention = shape.num_layers * 2 * cfg.num_heads * d * seq_len
    return 6.0 * matmul + 6.0 * attention
