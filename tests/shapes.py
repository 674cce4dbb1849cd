"""The shapes tests and benches share, written once: the tiny model's `ntp-train` overrides, the AdamW
options of `conf/optim/adamw.yaml`, and the small `ModelConfig`s that in-process tests and benches build.

Tests import it as `tests.shapes` (`tests/conftest.py`'s `TINY` is `TINY_OVERRIDES`); a bench run as
`python bench/NAME.py` puts the checkout's root on its path first. Functions return a new value on every
call (a `ModelConfig` can be sealed, a dict changed), so no caller sees another's changes."""

from __future__ import annotations

from typing import Any

from ntp_nemo.models.model_config import ModelConfig

# The tiny model: small enough for 2 cores, big enough to learn.
TINY_MODEL = (
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.max_seq_len=64",
)
TINY_DATA = ("data.seq_len=32", "data.global_batch_size=12", "data.micro_batch_size=2")
# The tiny model is stable at 3e-3 (gpt_tiny's recipe uses 1e-3).
TINY_OPTIM = ("optim.warmup_steps=2", "optim.lr=3e-3")
# No validation inside a short run, no progress bar, logger or extra callbacks.
QUIET_RUN = ("trainer.val_every_n_steps=1000", "trainer.progress_bar=false", "logger=none", "callbacks=none")
# What a CLI test trains unless it overrides it (`tests/conftest.py: TINY`).
TINY_OVERRIDES = (*TINY_MODEL, *TINY_DATA, *TINY_OPTIM, *QUIET_RUN[:2], "checkpoint.every_n_steps=0",
                  *QUIET_RUN[2:])


def adamw(lr: float = 1e-3, **changes: Any) -> dict[str, Any]:
    """The `optim` keys `assemble` takes, as `conf/optim/adamw.yaml` sets them (betas, eps, weight decay)
    at learning rate `lr`; `changes` replace or add keys (`weight_decay=0.0`, `distributed=True`)."""
    return {"lr": lr, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, **changes}


def gpt_tiny(**changes: Any) -> ModelConfig:
    """The default recipe's model (`conf/model/gpt_tiny.yaml`)."""
    fields = dict(arch="gpt2", vocab_size=257, hidden_size=256, num_layers=4, num_heads=4,
                  ffn_hidden_size=1024, max_seq_len=256, tie_embeddings=True)
    return ModelConfig(**{**fields, **changes})


def llama_tiny(**changes: Any) -> ModelConfig:
    """`conf/model/llama_tiny.yaml`'s widths with 4 KV heads (8 query heads over 4 KV heads: the degrees
    the benches run split whole KV groups)."""
    fields = dict(arch="llama", vocab_size=257, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                  ffn_hidden_size=688, max_seq_len=256, tie_embeddings=False)
    return ModelConfig(**{**fields, **changes})


def small_llama(num_layers: int = 4, **changes: Any) -> ModelConfig:
    """A Llama of hidden 64 (4 query heads over 2 KV heads, MLP 96, 33 positions, untied head): the model
    of the in-process tests that build ranks, dry runs and groups."""
    fields = dict(arch="llama", name="t", vocab_size=101, hidden_size=64, num_layers=num_layers, num_heads=4,
                  num_kv_heads=2, ffn_hidden_size=96, max_seq_len=33, tie_embeddings=False)
    return ModelConfig(**{**fields, **changes})
