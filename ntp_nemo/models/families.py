"""The architecture families the decoder implements, and what differs between them.

Every question whose answer depends on the architecture (which norm, a gated MLP or not, rotary or
learned positions, which projections carry biases, the Hugging Face names) is asked here, of the
family's `Family` entry: the rest of the code reads traits, never a family's name.  The registry is a
static mapping; adding a family is one entry below plus its Hugging Face tensor names (`hf/`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ntp_nemo.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """One architecture family's traits (the decoder's skeleton is shared: pre-norm blocks of
    attention and MLP; every family trains with grouped-query attention, `gqa` says whether it exports
    with it)."""

    name: str  # the value of `model.arch`
    rms_norm: bool  # RMSNorm (a weight) rather than LayerNorm (a weight and a bias)
    gated_mlp: bool  # SwiGLU (gate, up, down; SiLU) rather than a GELU MLP (up, down)
    rope: bool  # rotary position embeddings (needs an even head dim)
    learned_positions: bool  # a learned table of `max_seq_len` positions (the longest input it takes)
    linear_bias: bool  # every attention and MLP projection has a bias
    qkv_bias: bool  # the q, k and v projections have a bias (implied by `linear_bias`)
    gqa: bool  # the family's Hugging Face form has grouped-query attention (num_kv_heads < num_heads)
    hf_model_type: str  # Hugging Face `model_type`
    hf_architecture: str  # Hugging Face class (`architectures[0]` of its config.json)

    @property
    def attention_bias(self) -> tuple[bool, bool]:
        """Whether (q/k/v, o) projections carry a bias."""
        return self.linear_bias or self.qkv_bias, self.linear_bias

    @property
    def norm_bias(self) -> bool:
        return not self.rms_norm

    def validate(self, m: Any) -> None:
        """Family-specific constraints on a model config (`ModelConfig` or the `model` DictConfig)
        whose sizes are already known to be positive and consistent."""
        head_dim = int(m.hidden_size) // int(m.num_heads)
        if self.rope and head_dim % 2:
            raise ConfigError(
                "model.hidden_size",
                f"rotary embeddings (model.arch={self.name}) need an even head dim, got "
                f"{m.hidden_size}/{m.num_heads}={head_dim}. Choose model.hidden_size and model.num_heads "
                "so that hidden_size / num_heads is even.",
            )


_FAMILIES: Mapping[str, Family] = MappingProxyType({
    f.name: f
    for f in (
        Family("gpt2", rms_norm=False, gated_mlp=False, rope=False, learned_positions=True, linear_bias=True,
               qkv_bias=True, gqa=False, hf_model_type="gpt2", hf_architecture="GPT2LMHeadModel"),
        Family("llama", rms_norm=True, gated_mlp=True, rope=True, learned_positions=False, linear_bias=False,
               qkv_bias=False, gqa=True, hf_model_type="llama", hf_architecture="LlamaForCausalLM"),
        # Llama's traits plus a bias on the q, k and v projections.
        Family("qwen2", rms_norm=True, gated_mlp=True, rope=True, learned_positions=False, linear_bias=False,
               qkv_bias=True, gqa=True, hf_model_type="qwen2", hf_architecture="Qwen2ForCausalLM"),
    )
})


def names() -> tuple[str, ...]:
    """The known values of `model.arch`."""
    return tuple(_FAMILIES)


def choices() -> str:
    """How a user picks a family: `model.arch=gpt2|llama|...`."""
    return "model.arch=" + "|".join(_FAMILIES)


def family(name: str) -> Family:
    """The family called `name`; an unknown name is a ConfigError naming `model.arch`."""
    try:
        return _FAMILIES[str(name)]
    except KeyError:
        known = ", ".join(f"model.arch={n}" for n in _FAMILIES)
        raise ConfigError("model.arch", f"unknown architecture {name!r}. Use one of: {known}.") from None


def family_of(m: Any) -> Family:
    """The family of a model config (`ModelConfig`, the `model` DictConfig or a mapping)."""
    arch = m.get("arch") if isinstance(m, Mapping) else getattr(m, "arch", None)
    return family(arch)


def by_hf_model_type(model_type: Any) -> Family | None:
    """The family a Hugging Face `model_type` maps onto, or None."""
    return next((f for f in _FAMILIES.values() if f.hf_model_type == model_type), None)


def model_shape(m: Any):
    """The planner's `ModelShape` of a model config (`ModelConfig` or the `model` DictConfig)."""
    from ntp_nemo.planner.shapes import ModelShape

    return ModelShape(vocab_size=int(m.vocab_size), hidden_size=int(m.hidden_size),
                      num_layers=int(m.num_layers), num_heads=int(m.num_heads),
                      num_kv_heads=int(m.num_kv_heads or m.num_heads),
                      ffn_hidden_size=int(m.ffn_hidden_size), tie_embeddings=bool(m.tie_embeddings),
                      gated_mlp=family_of(m).gated_mlp)


def work_shape(m: Any, seq_len: int):
    """The per-rank work model's `WorkShape` of a model config and sequence length."""
    from ntp_nemo.topology.work import WorkShape

    return WorkShape(
        hidden_size=int(m.hidden_size), num_layers=int(m.num_layers), num_heads=int(m.num_heads),
        num_kv_heads=int(m.num_kv_heads or m.num_heads), ffn_hidden_size=int(m.ffn_hidden_size),
        vocab_size=int(m.vocab_size), seq_len=int(seq_len), gated_mlp=family_of(m).gated_mlp,
        tie_embeddings=bool(m.tie_embeddings),
    )
