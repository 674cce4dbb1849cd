"""GPT-2- and Llama-style decoders built from config."""

from __future__ import annotations

from ntp_nemo.config.schema import ModelConfig
from ntp_nemo.models.init import initialize_
from ntp_nemo.models.plan import SingleDevicePlan, TPPlan
from ntp_nemo.models.stats import flops_per_token, param_count
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


def build_model(cfg: ModelConfig, plan: TPPlan | None = None, seed: int = 0, **stage) -> DecoderLM:
    """Build the model (or one pipeline stage of it) and initialise this rank's slices."""
    model = DecoderLM(cfg, plan, **stage)
    initialize_(model, seed)
    return model
