"""Hugging Face `config.json` <-> `ModelConfig`.

The HF families that map onto the decoder without approximation are those of `models.families`:
GPT-2 (`model_type: gpt2`), Llama (`model_type: llama`, default rotary embeddings) and Qwen2
(`model_type: qwen2`: Llama with q/k/v biases, no sliding window).  Anything else, or an option of
those whose forward differs from ours (cross-attention, scaled rotary embeddings, biases in Llama
projections, sliding-window attention, ...), is refused up front rather than imported into a model
that computes something else.  When a run starts from a HF directory, the architecture fields come
from its `config.json`; the run's model config chooses only the family (`model.arch`) and may pad the
vocabulary (`model.vocab_size` >= the HF vocabulary), since the vocabulary belongs to the data.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ntp_nemo.data.bounded_json import read_json
from ntp_nemo.errors import ConfigError
from ntp_nemo.models.families import by_hf_model_type, family_of
from ntp_nemo.models.model_config import ModelConfig

KEY = "model.init_from"
# Fields of ModelConfig that a HF config.json determines.
ARCH_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "max_seq_len",
               "tie_embeddings", "norm_eps", "rope_theta")


def _unsupported(path: str, what: str) -> ConfigError:
    return ConfigError(KEY, f"{path!r} holds a model this version cannot import: {what}. Supported are "
                            "GPT-2 (model_type gpt2), Llama (model_type llama with default rotary "
                            "embeddings, no projection biases) and Qwen2 (model_type qwen2 with default "
                            "rotary embeddings, no sliding window) checkpoints in safetensors format.")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a HF model directory; a missing or unreadable one is a ConfigError."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(KEY, f"{str(path)!r} is not a directory. Point model.init_from at a local "
                               "Hugging Face model directory (config.json plus model.safetensors or sharded "
                               "*.safetensors with model.safetensors.index.json), e.g. one written by "
                               "save_pretrained().")
    try:
        doc = read_json(p / "config.json", 16 << 20)
    except FileNotFoundError:
        raise ConfigError(KEY, f"{str(path)!r} has no config.json, so it is not a Hugging Face model "
                               "directory. Point model.init_from at the directory save_pretrained() wrote."
                          ) from None
    except (OSError, ValueError) as err:
        raise ConfigError(KEY, f"{str(p / 'config.json')!r} is unreadable ({err}).") from err
    if not isinstance(doc, dict):
        raise ConfigError(KEY, f"{str(p / 'config.json')!r} does not hold a JSON object.")
    return doc


def _rope_theta(hf: dict, path: str) -> float:
    """Rotary base from either the current (`rope_parameters`) or the older (`rope_theta`,
    `rope_scaling`) spelling; scaled variants (llama3, yarn, linear, ...) are refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise _unsupported(path, f"rotary embeddings of type {kind!r} (only the default is implemented)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _gpt2_fields(hf: dict, path: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported(path, f"GPT-2 activation {act!r} (the tanh-approximated GELU is implemented)")
    for flag, want in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                       ("scale_attn_weights", True)):
        if bool(hf.get(flag, want)) != want:
            raise _unsupported(path, f"GPT-2 with {flag}={hf[flag]}")
    h = int(hf["n_embd"])
    return {"hidden_size": h, "num_layers": int(hf["n_layer"]), "num_heads": int(hf["n_head"]),
            "num_kv_heads": None, "ffn_hidden_size": int(hf.get("n_inner") or 4 * h),
            "max_seq_len": int(hf["n_positions"]),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "rope_theta": ModelConfig.rope_theta}


def _llama_fields(hf: dict, path: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, f"Llama activation {hf['hidden_act']!r} (SwiGLU with SiLU is implemented)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise _unsupported(path, f"Llama with {flag}=true")
    return _rotary_decoder_fields(hf, path)


def _qwen2_fields(hf: dict, path: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, f"Qwen2 activation {hf['hidden_act']!r} (SwiGLU with SiLU is implemented)")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise _unsupported(path, "Qwen2 with sliding-window attention (full causal attention is implemented)")
    return _rotary_decoder_fields(hf, path)


def _rotary_decoder_fields(hf: dict, path: str) -> dict[str, Any]:
    """The sizes of a Llama-layout config.json (Llama, Qwen2)."""
    h, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * nh != h:
        raise _unsupported(path, f"head_dim={head_dim} with {nh} heads of hidden size {h} (head_dim must be "
                                 "hidden_size / num_attention_heads)")
    nkv = int(hf.get("num_key_value_heads") or nh)
    return {"hidden_size": h, "num_layers": int(hf["num_hidden_layers"]), "num_heads": nh,
            "num_kv_heads": None if nkv == nh else nkv, "ffn_hidden_size": int(hf["intermediate_size"]),
            "max_seq_len": int(hf.get("max_position_embeddings", ModelConfig.max_seq_len)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": _rope_theta(hf, path)}


# Each family's reading of a config.json's sizes.
_FIELDS = MappingProxyType({"gpt2": _gpt2_fields, "llama": _llama_fields, "qwen2": _qwen2_fields})


def arch_of(hf: dict, path: str = "<config>") -> str:
    """`model.arch` of a HF config; unsupported families raise ConfigError."""
    fam = by_hf_model_type(hf.get("model_type"))
    if fam is None or fam.name not in _FIELDS:
        names = ", ".join(hf.get("architectures") or []) or "unknown architecture"
        raise _unsupported(path, f"model_type {hf.get('model_type')!r} ({names})")
    return fam.name


def hf_fields(hf: dict, path: str = "<config>") -> dict[str, Any]:
    """The ModelConfig fields a HF config determines (arch, vocab_size and ARCH_FIELDS)."""
    arch = arch_of(hf, path)
    try:
        fields = _FIELDS[arch](hf, path)
        vocab = int(hf["vocab_size"])
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise ConfigError(KEY, f"{path!r}: config.json lacks or garbles field {err} that a {arch} model "
                               "needs.") from err
    return {"arch": arch, "vocab_size": vocab, **fields}


def model_choices(arch: str) -> list[str]:
    """The shipped model configs (`conf/model/NAME.yaml`, `model=NAME`) whose `arch` is `arch`."""
    from importlib import resources

    folder = Path(str(resources.files("ntp_nemo.conf"))) / "model"
    line = re.compile(rf"^arch:\s*{re.escape(arch)}\s*(#.*)?$", flags=re.M)
    return sorted(p.stem for p in folder.glob("*.yaml") if line.search(p.read_text(encoding="utf-8")))


def resolve_model_config(base: ModelConfig) -> ModelConfig:
    """`base` with its architecture fields taken from `base.init_from`'s config.json (no-op without one).

    Raises ConfigError("model.init_from", ...) when the directory is unusable or names an
    unsupported architecture, when `base.arch` names the other family, or when `base.vocab_size`
    is smaller than the HF vocabulary (a larger one pads the vocabulary).
    """
    if base.init_from is None:
        return base
    path = str(base.init_from)
    if path in ("", "???"):
        raise ConfigError(KEY, "is not set. Give the Hugging Face model directory to start from, e.g. "
                               "model.init_from=/path/to/hf_model (a directory written by "
                               "save_pretrained()).")
    hf = hf_fields(read_hf_config(path), path)
    if hf["arch"] != base.arch:
        choices = " or ".join(f"model={name}" for name in model_choices(hf["arch"]))
        raise ConfigError(KEY, f"{path!r} is a {hf['arch']} model but model.arch={base.arch}. Pick a "
                               f"{hf['arch']} model config ({choices or 'your own'}) or set "
                               f"model.arch={hf['arch']}.")
    if base.vocab_size < hf["vocab_size"]:
        raise ConfigError(KEY, f"{path!r} has a vocabulary of {hf['vocab_size']} tokens but "
                               f"model.vocab_size={base.vocab_size}. Set model.vocab_size={hf['vocab_size']} "
                               "(or larger, to pad it) and train on data tokenised with that model's "
                               "tokenizer (a pre-tokenised data.path token file).")
    updates = {k: hf[k] for k in ARCH_FIELDS}
    # Absolute, so workers, checkpoints and the exporter find it whatever their working directory.
    return dataclasses.replace(base, init_from=str(Path(path).expanduser().resolve()), **updates)


def check_matches(cfg: ModelConfig, hf: dict, path: str) -> None:
    """Refuse to load `path` into a model built from `cfg` unless the architectures agree."""
    want = hf_fields(hf, path)
    got = dataclasses.asdict(cfg)
    got["num_kv_heads"] = None if cfg.num_kv_heads in (None, cfg.num_heads) else cfg.num_kv_heads
    diffs = [f"{k}: model {got[k]!r}, config.json {want[k]!r}" for k in ("arch", *ARCH_FIELDS)
             if got[k] != want[k]]
    if cfg.vocab_size < want["vocab_size"]:
        diffs.append(f"vocab_size: model {cfg.vocab_size} < config.json {want['vocab_size']}")
    if diffs:
        raise ConfigError(KEY, f"the model config contradicts {path!r} ({'; '.join(diffs)}). Build the model "
                               "from resolve_model_config(...) so the architecture comes from config.json.")


def hf_config(cfg: ModelConfig, vocab_size: int | None = None, dtype: str = "float32",
              bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
    """A HF `config.json` document describing `cfg` (dropouts 0: the model has none)."""
    vocab = vocab_size or cfg.vocab_size
    common = {"vocab_size": vocab, "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos_token_id,
              "eos_token_id": eos_token_id, "initializer_range": cfg.init_std, "dtype": dtype,
              "use_cache": True}
    fam = family_of(cfg)
    if fam.name == "gpt2":
        return {"architectures": [fam.hf_architecture], "model_type": fam.hf_model_type,
                "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size,
                "n_positions": cfg.max_seq_len, "activation_function": "gelu_new",
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    nh = cfg.num_heads
    doc = {"architectures": [fam.hf_architecture], "model_type": fam.hf_model_type,
           "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": nh,
           "num_key_value_heads": cfg.num_kv_heads or nh, "head_dim": cfg.hidden_size // nh,
           "intermediate_size": cfg.ffn_hidden_size, "max_position_embeddings": cfg.max_seq_len,
           "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_dropout": 0.0,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           "rope_theta": cfg.rope_theta, **common}
    if fam.qkv_bias:  # Qwen2: the biases are implied by the family; full attention in every layer
        doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                   layer_types=["full_attention"] * cfg.num_layers)
    else:
        doc.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return doc


def generation_config(bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
