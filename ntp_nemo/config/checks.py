"""Checks of a composed config that `ntp-train` runs before any worker starts, beyond the value
checks of `validate`: mandatory recipe keys, adjustments that warn (warmup longer than the run),
settings that would silently do nothing (a power boost with no degraded replica, QAT that never
starts), a global batch too small for the layout's split, writable output folders and a resume
checkpoint that matches the model.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError

# ModelConfig fields that fix the parameters' shapes: a checkpoint is only loadable into the same ones.
SHAPE_FIELDS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "tie_embeddings",
)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def require_mandatory(cfg: DictConfig) -> None:
    """Keys the chosen recipe marks `???` must be given (Hydra's merge keeps the group's default
    under a `???`, so the recipe file itself is the reference)."""
    from ntp_nemo.config.register import mandatory_keys

    for key in mandatory_keys(str(cfg.recipe)):
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or value == "???":
            raise ConfigError(
                key,
                f"recipe={cfg.recipe} needs {key} (it has no default); pass {key}=... on the command line"
                + (" (a Hugging Face model directory)." if key.endswith("init_from") else "."),
            )


def adjust(cfg: DictConfig) -> None:
    """Clamp values that only make sense up to another one, with one warning line each."""
    max_steps = int(cfg.trainer.max_steps)
    if int(cfg.optim.warmup_steps) > max_steps > 0:
        warn(
            f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run "
            f"(trainer.max_steps={max_steps}); using warmup_steps={max_steps}."
        )
        cfg.optim.warmup_steps = max_steps


def _capacities(cfg: DictConfig, power_boost: object) -> list[float]:
    from ntp_nemo.config.validate import resolved_replica_tp
    from ntp_nemo.topology import Topology

    tp = int(cfg.mesh.tp)
    replica_tp = resolved_replica_tp(cfg)
    topo = Topology(tp, replica_tp, [tp] * (int(cfg.model.num_layers) + 2), pp=int(cfg.mesh.pp))
    return topo.capacities(power_boost)


def _power_boost(cfg: DictConfig) -> object:
    pb = cfg.ntp.power_boost
    return OmegaConf.to_container(pb) if OmegaConf.is_list(pb) else pb


def _split(cfg: DictConfig, power_boost: object) -> tuple[list[int], list[float]]:
    """The micro-batch split the run will use (the trainer's function) and the capacities behind it."""
    from ntp_nemo.data.rebalance import assign_microbatches

    caps = _capacities(cfg, power_boost)
    return assign_microbatches(int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size), caps), caps


def _follows(counts: list[int], caps: list[float]) -> bool:
    """No replica gets as many micro-batches as one of larger capacity (or more than one of smaller)."""
    pairs = [(c, n) for c, n in zip(caps, counts, strict=True)]
    return all(n_a < n_b for c_a, n_a in pairs for c_b, n_b in pairs if c_a < c_b)


def check_batch_split(cfg: DictConfig) -> list[int]:
    """Every replica needs at least one micro-batch of the global batch; returns the split.

    A split too coarse to follow the capacities (2 micro-batches over capacities [1, 0.5] give
    [1, 1]) runs, with a warning naming the global batch that would follow them."""
    from ntp_nemo.data.rebalance import assign_microbatches

    mbs, gbs = int(cfg.data.micro_batch_size), int(cfg.data.global_batch_size)
    counts, caps = _split(cfg, _power_boost(cfg))
    shown = [round(c, 3) for c in caps]
    if min(counts) > 0:
        if not _follows(counts, caps):
            n = gbs // mbs + 1
            while not _follows(assign_microbatches(n, caps), caps):
                n += 1
            warn(
                f"data.global_batch_size={gbs} is {gbs // mbs} micro-batches of {mbs}: too few to follow the "
                f"replicas' capacities {shown}: the split is {counts}. "
                f"data.global_batch_size={n * mbs} (or a lower data.micro_batch_size) gives a split that "
                f"follows the capacities ({assign_microbatches(n, caps)})."
            )
        return counts
    n = gbs // mbs
    while min(assign_microbatches(n, caps)) == 0:
        n += 1
    raise ConfigError(
        "data.global_batch_size",
        f"data.global_batch_size={gbs} is {gbs // mbs} micro-batches of {mbs}, split over the replicas "
        f"in proportion to their capacities {shown} as {counts}: a replica would get "
        f"none. The smallest global batch that gives every replica one is {n * mbs} "
        f"(data.global_batch_size={n * mbs}), or lower data.micro_batch_size.",
    )


def warn_no_ops(cfg: DictConfig) -> None:
    """Settings accepted by validation that would do nothing in this run."""
    pb = _power_boost(cfg)
    if pb is not None:
        from ntp_nemo.config.validate import resolved_replica_tp

        if all(n == int(cfg.mesh.tp) for n in resolved_replica_tp(cfg)):
            warn(
                f"ntp.power_boost={pb} has no effect: it raises the share of degraded replicas and every "
                f"replica runs at the full TP degree (ntp.replica_tp={resolved_replica_tp(cfg)})."
            )
        else:
            boosted, _ = _split(cfg, pb)
            if boosted == _split(cfg, None)[0]:
                warn(
                    f"ntp.power_boost={pb} has no effect: the global batch's "
                    f"{int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size)} micro-batches "
                    f"split as {boosted} with or without it. Raise data.global_batch_size (or lower "
                    "data.micro_batch_size) so the boosted share rounds to more micro-batches, or raise the "
                    "boost."
                )
    if cfg.quant.format != "none":
        start, end = int(cfg.quant.start_step), int(cfg.trainer.max_steps)
        if start >= end:
            raise ConfigError(
                "quant.start_step",
                f"quantisation-aware training starts at step {start} but the run ends at "
                f"trainer.max_steps={end}, so it would never quantise; lower quant.start_step or raise "
                "trainer.max_steps (or use quant=none).",
            )


def check_outputs(cfg: DictConfig, run_dir: Path) -> None:
    from ntp_nemo.config.run_dir import require_writable

    require_writable(run_dir, "hydra.run.dir")
    if cfg.checkpoint.every_n_steps or cfg.checkpoint.save_on_end:
        require_writable(run_dir / str(cfg.checkpoint.dir), "checkpoint.dir")


def check_resume_model(cfg: DictConfig, ckpt: Path) -> None:
    """The checkpoint's model must have the configured parameter shapes (any layout is fine)."""
    from ntp_nemo.checkpoint.sharded import read_meta

    try:
        meta = read_meta(ckpt)  # weights_only: a file carrying a pickled object is a ConfigError
    except (OSError, RuntimeError, EOFError):
        return  # validity was checked from the manifest already; nothing more to compare
    saved = (meta.get("extra") or {}).get("model_config") or {}
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if model.get("init_from"):
        return  # sizes come from the Hugging Face directory; compared when the weights load
    if model.get("arch") == "gpt2":
        fields = (*SHAPE_FIELDS, "max_seq_len")  # learned position embeddings
    else:
        fields = SHAPE_FIELDS
    diff = [f for f in fields if f in saved and f in model and saved[f] != model[f]]
    if diff:
        pairs = ", ".join(f"model.{f}={saved[f]} in the checkpoint vs {model[f]} configured" for f in diff)
        raise ConfigError(
            "resume",
            f"checkpoint {ckpt} holds a different model ({pairs}). Resume with the same model "
            f"(e.g. model.{diff[0]}={saved[diff[0]]}), or start a new run (resume=never or another "
            "hydra.run.dir).",
        )
