"""Which Hugging Face tensor holds which ntp_nemo parameter, and in what layout.

One table serves both directions.  A HF tensor is the concatenation of one or more of our logical
tensors along *our* dim 0 (GPT-2's fused `c_attn` is q, k and v stacked), stored transposed when
HF keeps it as a Conv1D weight (`[in, out]`, GPT-2).  Vocabulary tensors may have more rows on our
side than in HF (vocabulary padding).  Llama's q/k projections need no permutation: our rotary
embedding uses the rotate-half layout that HF Llama weights are stored for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ntp_nemo.errors import ConfigError
from ntp_nemo.models.families import family_of
from ntp_nemo.models.model_config import ModelConfig


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a HF checkpoint, assembled from our logical tensors `parts`."""

    name: str
    parts: tuple[str, ...]
    part_rows: tuple[int, ...]  # rows (our dim 0) each part contributes
    transposed: bool = False  # Conv1D: HF stores our [out, in] weight as [in, out]
    vocab: bool = False  # rows are vocabulary entries (padding applies)

    def offset(self, part: str) -> int:
        i = self.parts.index(part)
        return sum(self.part_rows[:i])


@dataclass(frozen=True)
class WeightMap:
    """The HF tensors of a model config, in writing order, and each parameter's place in them."""

    tensors: tuple[HFTensor, ...]
    base_prefix: str  # prefix of the bare model's tensors ("transformer." or "model.")

    def source_of(self) -> dict[str, HFTensor]:
        return {part: t for t in self.tensors for part in t.parts}


def _gpt2(cfg: ModelConfig) -> list[HFTensor]:
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    out = [HFTensor("transformer.wte.weight", ("embed.weight",), (v,), vocab=True),
           HFTensor("transformer.wpe.weight", ("pos_embed",), (cfg.max_seq_len,))]
    for i in range(cfg.num_layers):
        hp, b = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = tuple(f"{b}attn.{p}_proj" for p in "qkv")
        out += [
            HFTensor(hp + "ln_1.weight", (b + "attn_norm.weight",), (h,)),
            HFTensor(hp + "ln_1.bias", (b + "attn_norm.bias",), (h,)),
            HFTensor(hp + "attn.c_attn.weight", tuple(n + ".weight" for n in qkv), (h, h, h),
                     transposed=True),
            HFTensor(hp + "attn.c_attn.bias", tuple(n + ".bias" for n in qkv), (h, h, h)),
            HFTensor(hp + "attn.c_proj.weight", (b + "attn.o_proj.weight",), (h,), transposed=True),
            HFTensor(hp + "attn.c_proj.bias", (b + "attn.o_proj.bias",), (h,)),
            HFTensor(hp + "ln_2.weight", (b + "mlp_norm.weight",), (h,)),
            HFTensor(hp + "ln_2.bias", (b + "mlp_norm.bias",), (h,)),
            HFTensor(hp + "mlp.c_fc.weight", (b + "mlp.up_proj.weight",), (f,), transposed=True),
            HFTensor(hp + "mlp.c_fc.bias", (b + "mlp.up_proj.bias",), (f,)),
            HFTensor(hp + "mlp.c_proj.weight", (b + "mlp.down_proj.weight",), (h,), transposed=True),
            HFTensor(hp + "mlp.c_proj.bias", (b + "mlp.down_proj.bias",), (h,)),
        ]
    out += [HFTensor("transformer.ln_f.weight", ("final_norm.weight",), (h,)),
            HFTensor("transformer.ln_f.bias", ("final_norm.bias",), (h,))]
    return out


def _llama(cfg: ModelConfig) -> list[HFTensor]:
    """Llama's names; also Qwen2's, whose q, k and v projections add a bias each."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    kv = (cfg.num_kv_heads or cfg.num_heads) * (h // cfg.num_heads)
    qkv_bias, _ = family_of(cfg).attention_bias
    out = [HFTensor("model.embed_tokens.weight", ("embed.weight",), (v,), vocab=True)]
    for i in range(cfg.num_layers):
        hp, b = f"model.layers.{i}.", f"blocks.{i}."
        out.append(HFTensor(hp + "input_layernorm.weight", (b + "attn_norm.weight",), (h,)))
        for p, rows in (("q", h), ("k", kv), ("v", kv)):
            out.append(HFTensor(f"{hp}self_attn.{p}_proj.weight", (f"{b}attn.{p}_proj.weight",), (rows,)))
            if qkv_bias:
                out.append(HFTensor(f"{hp}self_attn.{p}_proj.bias", (f"{b}attn.{p}_proj.bias",), (rows,)))
        out += [
            HFTensor(hp + "self_attn.o_proj.weight", (b + "attn.o_proj.weight",), (h,)),
            HFTensor(hp + "post_attention_layernorm.weight", (b + "mlp_norm.weight",), (h,)),
            HFTensor(hp + "mlp.gate_proj.weight", (b + "mlp.gate_proj.weight",), (f,)),
            HFTensor(hp + "mlp.up_proj.weight", (b + "mlp.up_proj.weight",), (f,)),
            HFTensor(hp + "mlp.down_proj.weight", (b + "mlp.down_proj.weight",), (h,)),
        ]
    out.append(HFTensor("model.norm.weight", ("final_norm.weight",), (h,)))
    return out


# Each family's HF tensor names and the prefix of its bare model's tensors.
TABLES: Mapping[str, tuple[Callable[[ModelConfig], list[HFTensor]], str]] = MappingProxyType({
    "gpt2": (_gpt2, "transformer."),
    "llama": (_llama, "model."),
    "qwen2": (_llama, "model."),
})


def weight_map(cfg: ModelConfig) -> WeightMap:
    """The HF tensors of `cfg` (the output head only when untied, as HF stores tied models)."""
    fam = family_of(cfg)
    if not fam.gqa and cfg.num_kv_heads not in (None, cfg.num_heads):
        raise ConfigError("model.num_kv_heads", f"a {fam.name} model with {cfg.num_kv_heads} KV heads for "
                                                f"{cfg.num_heads} query heads has no Hugging Face "
                                                f"{fam.hf_architecture} form (no grouped-query attention).")
    table, prefix = TABLES[fam.name]
    tensors = table(cfg)
    if not cfg.tie_embeddings:
        tensors.append(HFTensor("lm_head.weight", ("head.weight",), (cfg.vocab_size,), vocab=True))
    return WeightMap(tuple(tensors), prefix)
