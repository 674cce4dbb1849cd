"""Hugging Face interop: start from GPT-2 / Llama safetensors directories and export trained models."""

from __future__ import annotations

from ntp_nemo.hf.config_map import hf_config, read_hf_config, resolve_model_config
from ntp_nemo.hf.load import LoadReport, load_hf_into

__all__ = ["LoadReport", "hf_config", "load_hf_into", "read_hf_config", "resolve_model_config"]
