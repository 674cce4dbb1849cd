"""Checks of a composed config that `ntp-train` runs before any worker starts, beyond the value
checks of `validate`: mandatory recipe keys, adjustments that warn (warmup longer than the run),
settings that would silently do nothing (a power boost with no degraded replica, QAT that never
starts), a global batch too small for the layout's split, writable output folders and a resume
checkpoint that matches the model.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.errors import ConfigError
from ntp_nemo.models import families
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.planner.shapes import SIZE_FIELDS
from ntp_nemo.topology.layout import ResolvedLayout

# ModelConfig fields that fix the parameters' shapes: a checkpoint is only loadable into the same ones.
SHAPE_FIELDS = ("arch", *SIZE_FIELDS, "tie_embeddings")


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def require_mandatory(cfg: DictConfig, reads_data: bool = True) -> None:
    """Keys the chosen recipe marks `???` must be given (Hydra's merge keeps the group's default
    under a `???`, so the recipe file itself is the reference); `reads_data` False: not the `data`
    keys (the dry run and the coordinator read no data)."""
    from ntp_nemo.config.register import mandatory_keys

    for key in mandatory_keys(str(cfg.recipe)):
        if not reads_data and key.startswith("data."):
            continue
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or value == "???":
            raise ConfigError(
                key,
                f"recipe={cfg.recipe} needs {key} (it has no default); pass {key}=... on the command line"
                + (" (a Hugging Face model directory)." if key.endswith("init_from") else "."),
            )


def adjust(cfg: DictConfig) -> dict[str, Any]:
    """Values that only make sense up to another one, clamped: {key: value} of those that change (with
    one warning line each); `cfg` is not changed."""
    max_steps = int(cfg.trainer.max_steps)
    if int(cfg.optim.warmup_steps) > max_steps > 0:
        warn(
            f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run "
            f"(trainer.max_steps={max_steps}); using warmup_steps={max_steps}."
        )
        return {"optim.warmup_steps": max_steps}
    return {}


def follow_mesh(cfg: DictConfig, explicit: set[str]) -> dict[str, Any]:
    """A recipe's `ntp.replica_tp` (e.g. gpt_tiny's [2, 1]) that no longer fits a `mesh.tp`/`mesh.dp`
    given on the command line, with no `ntp.replica_tp` given there, follows the mesh: every replica
    at `mesh.tp` (returns {"ntp.replica_tp": None}), with one note. A replica_tp given explicitly is kept
    (and validated): {}. `cfg` is not changed."""
    rtp = cfg.ntp.replica_tp
    if rtp is None or "ntp.replica_tp" in explicit or not {"mesh.tp", "mesh.dp"} & explicit:
        return {}
    tp, dp = int(cfg.mesh.tp), int(cfg.mesh.dp)
    if len(rtp) == dp and all(1 <= int(n) <= tp for n in rtp):
        return {}
    print(f"note: ntp.replica_tp={list(rtp)} (recipe {cfg.recipe}) does not fit mesh.tp={tp} mesh.dp={dp} "
          f"given on the command line: every replica runs at mesh.tp (ntp.replica_tp=null); pass "
          f"ntp.replica_tp=[...] (one entry per replica) to degrade one.", file=sys.stderr, flush=True)
    return {"ntp.replica_tp": None}


def _follows(counts: list[int], caps: list[float]) -> bool:
    """No replica gets as many micro-batches as one of larger capacity (or more than one of smaller)."""
    pairs = [(c, n) for c, n in zip(caps, counts, strict=True)]
    return all(n_a < n_b for c_a, n_a in pairs for c_b, n_b in pairs if c_a < c_b)


def check_batch_split(layout: ResolvedLayout, micro_batch_size: int) -> list[int]:
    """Every replica needs at least one micro-batch of the global batch; returns the split
    (`layout.microbatches`, the trainer's).

    A split too coarse to follow the capacities (2 micro-batches over capacities [1, 0.5] give
    [1, 1]) runs, with a warning naming the global batch that would follow them."""
    from ntp_nemo.data.rebalance import assign_microbatches

    counts = list(layout.microbatches)
    mbs, m = int(micro_batch_size), layout.num_microbatches
    caps = layout.capacities()
    shown = [round(c, 3) for c in caps]
    if min(counts) > 0:
        if not _follows(counts, caps):
            n = m + 1
            while not _follows(assign_microbatches(n, caps), caps):
                n += 1
            warn(
                f"data.global_batch_size={m * mbs} is {m} micro-batches of {mbs}: too few to follow the "
                f"replicas' capacities {shown}: the split is {counts}. "
                f"data.global_batch_size={n * mbs} (or a lower data.micro_batch_size) gives a split that "
                f"follows the capacities ({assign_microbatches(n, caps)})."
            )
        return counts
    n = m
    while min(assign_microbatches(n, caps)) == 0:
        n += 1
    raise ConfigError(
        "data.global_batch_size",
        f"data.global_batch_size={m * mbs} is {m} micro-batches of {mbs}, split over the replicas "
        f"in proportion to their capacities {shown} as {counts}: a replica would get "
        f"none. The smallest global batch that gives every replica one is {n * mbs} "
        f"(data.global_batch_size={n * mbs}), or lower data.micro_batch_size.",
    )


def warn_no_ops(cfg: DictConfig, layout: ResolvedLayout) -> None:
    """Settings accepted by validation that would do nothing in this run."""
    pb = layout.power_boost
    if pb is not None:
        shown = cfg.ntp.power_boost
        if all(n == layout.tp for n in layout.replica_tp):
            warn(
                f"ntp.power_boost={shown} has no effect: it raises the share of degraded replicas and every "
                f"replica runs at the full TP degree (ntp.replica_tp={list(layout.replica_tp)})."
            )
        else:
            boosted = list(layout.microbatches)  # the split that runs, compared with the unboosted one
            if boosted == list(layout.with_changes(power_boost=None).microbatches):
                warn(
                    f"ntp.power_boost={shown} has no effect: the global batch's "
                    f"{layout.num_microbatches} micro-batches "
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


def check_resume_model(model_cfg: ModelConfig, ckpt: Path) -> None:
    """The checkpoint's model must have the resolved model's parameter shapes (any layout is fine)."""
    from ntp_nemo.checkpoint.sharded import read_meta

    try:
        meta = read_meta(ckpt)  # weights_only: a file carrying a pickled object is a ConfigError
    except (OSError, RuntimeError, EOFError):
        return  # validity was checked from the manifest already; nothing more to compare
    saved = (meta.get("extra") or {}).get("model_config") or {}
    model = dataclasses.asdict(model_cfg)
    if model.get("init_from"):
        return  # sizes come from the Hugging Face directory; compared when the weights load
    fields = SHAPE_FIELDS
    if families.family_of(model).learned_positions:
        fields = (*SHAPE_FIELDS, "max_seq_len")  # a table of max_seq_len learned positions
    diff = [f for f in fields if f in saved and f in model and saved[f] != model[f]]
    if diff:
        pairs = ", ".join(f"model.{f}={saved[f]} in the checkpoint vs {model[f]} configured" for f in diff)
        raise ConfigError(
            "resume",
            f"checkpoint {ckpt} holds a different model ({pairs}). Resume with the same model "
            f"(e.g. model.{diff[0]}={saved[diff[0]]}), or start a new run (resume=never or another "
            "hydra.run.dir).",
        )
