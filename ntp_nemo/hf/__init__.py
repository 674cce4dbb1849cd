"""Hugging Face interop: start from GPT-2 / Llama safetensors directories and export trained models.

`hf_config`, `read_hf_config` and `resolve_model_config` read JSON only; `load_hf_into` (torch,
safetensors) loads on first use, so validating `model.init_from` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ntp_nemo.hf.config_map import hf_config, read_hf_config, resolve_model_config

if TYPE_CHECKING:
    from ntp_nemo.hf.load import LoadReport, load_hf_into

__all__ = ["LoadReport", "hf_config", "load_hf_into", "read_hf_config", "resolve_model_config"]


def __getattr__(name: str) -> Any:
    if name in ("LoadReport", "load_hf_into"):
        from ntp_nemo.hf import load

        return getattr(load, name)
    raise AttributeError(f"module 'ntp_nemo.hf' has no attribute {name!r}")
