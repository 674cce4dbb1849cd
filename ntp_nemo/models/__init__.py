"""GPT-2-, Llama- and Qwen2-style decoders built from config; `families` says what differs between them.

`ModelConfig` imports nothing heavy; the torch-backed names load on first use, so the config layer can
use the model's schema before any worker (or `import torch`) starts.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ntp_nemo.models.model_config import ModelConfig

if TYPE_CHECKING:
    from ntp_nemo.models.tp_contexts import TPPlan
    from ntp_nemo.models.transformer import DecoderLM

__all__ = [
    "DecoderLM",
    "ModelConfig",
    "SingleDevicePlan",
    "TPPlan",
    "build_model",
    "flops_per_token",
    "initialize_",
    "param_count",
]

_LAZY = {
    "DecoderLM": "ntp_nemo.models.transformer",
    "SingleDevicePlan": "ntp_nemo.models.tp_contexts",
    "TPPlan": "ntp_nemo.models.tp_contexts",
    "flops_per_token": "ntp_nemo.models.stats",
    "param_count": "ntp_nemo.models.stats",
    "initialize_": "ntp_nemo.models.init",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ntp_nemo.models' has no attribute {name!r}")


def build_model(cfg: ModelConfig, plan: TPPlan | None = None, seed: int = 0, **stage) -> DecoderLM:
    """Build the model (or one pipeline stage of it) and initialise this rank's slices."""
    from ntp_nemo.models.init import initialize_
    from ntp_nemo.models.transformer import DecoderLM

    model = DecoderLM(cfg, plan, **stage)
    initialize_(model, seed)
    return model
