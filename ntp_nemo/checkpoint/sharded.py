"""Topology-independent sharded checkpoints: save on one NTP layout, load on any other.

`save_checkpoint` and `load_checkpoint` are collective over all ranks (or run in one process
without torch.distributed).  On disk a checkpoint directory holds:

- `__<rank>_0.distcp`: one file per rank (empty for a rank that owns nothing); every logical
  element of the model and of the optimizer state is stored exactly once (by the lowest global
  rank holding it), as chunks with their global offsets;
- `.metadata`: DCP's index (every tensor's global shape, dtype and chunk list);
- `meta.pt`: small replicated state written by rank 0: the caller's `extra` (step, consumed
  batches, LR-scheduler state, config snapshot, …), the optimizer hyperparameters per parameter
  name, the step and layout;
- `manifest.json`: written last (size and sha256 of every file, step, layout, format version);
  the directory is written as `NAME.tmp/` and renamed to `NAME` after the manifest (see
  `manifest.py`).

Loading reads, on each rank, only the stored chunks that intersect that rank's slices (whole
chunks: each is one serialized tensor) and copies the intersections into place.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.checkpoint.dcp_io import Chunk, read_chunks, stored_tensors, write_chunks
from ntp_nemo.checkpoint.manifest import (
    checkpoint_problem,
    commit,
    data_files,
    file_digest,
    invalid_checkpoint_error,
    keep_last_k,
    tmp_path,
    write_manifest,
)
from ntp_nemo.checkpoint.ownership import write_pieces
from ntp_nemo.checkpoint.state import (
    NamedSlice,
    group_options,
    install_optimizer_state,
    load_targets,
    sharded_state,
)
from ntp_nemo.errors import ConfigError
from ntp_nemo.parallel.shard import ShardSpec
from ntp_nemo.quant.sharding import is_quantized
from ntp_nemo.quant.state import restore_quant_state

META_FILE = "meta.pt"


# ---- collectives that degrade to no-ops in one process --------------------------------------------
def _rank_world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather(obj: Any, group) -> list[Any]:
    _, world = _rank_world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group) -> Any:
    if _rank_world(group)[1] == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _barrier(group) -> None:
    if _rank_world(group)[1] > 1:
        dist.barrier(group=group)


# ---- save -------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """What one rank contributes to a checkpoint (tensors by key, optimizer hyperparameters by name)."""

    state: dict[str, NamedSlice]
    options: dict[str, dict] = field(default_factory=dict)


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                  to_cpu_copy: bool = False) -> Snapshot:
    """This rank's state; `to_cpu_copy` detaches it from training (for a background save)."""
    state = sharded_state(model, optimizer)
    if to_cpu_copy:
        state = {k: NamedSlice(v.spec, v.tensor.to("cpu", copy=True)) for k, v in state.items()}
    options = copy.deepcopy(group_options(model, optimizer)) if optimizer is not None else {}
    return Snapshot(state, options)


def _piece_view(held: ShardSpec, piece: ShardSpec, tensor: torch.Tensor) -> torch.Tensor:
    if not held.global_shape:
        return tensor
    return tensor.narrow(held.dim, (piece.lo - held.lo) * held.unit_size, piece.length)


def _check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extra` must reload with `weights_only=True`; find out before any rank writes anything."""
    extra = dict(extra or {})
    buf = io.BytesIO()
    torch.save(extra, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as err:  # the unpickler names the offending type
        raise TypeError(f"checkpoint `extra` must hold only plain containers, numbers, strings and tensors "
                        f"(it is loaded with weights_only=True): {err}") from err
    return extra


def _save_torch(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_snapshot(path: str | os.PathLike, snap: Snapshot, extra: Mapping[str, Any] | None, *, step: int,
                   layout: Any = None, keep_last: int | None = None, group=None) -> Path:
    """Collective: write `snap` of every rank as checkpoint `path` and commit it (see module doc);
    then rank 0 prunes `path`'s directory to the `keep_last` newest checkpoints."""
    path = Path(path)
    tmp = tmp_path(path)
    rank, world = _rank_world(group)
    json.dumps(layout)  # fail before writing anything if the layout cannot go into the manifest
    extra = _check_extra(extra)
    if rank == 0:
        if tmp.exists():  # leftover of a save that died
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    holdings = {k: v.spec for k, v in snap.state.items()}
    everyone = _all_gather((holdings, snap.options), group)  # also orders rank 0's mkdir before any write
    pieces = write_pieces(rank, [h for h, _ in everyone])
    chunks = [Chunk(key, piece.global_shape, piece.offsets, _piece_view(snap.state[key].spec, piece,
                                                                         snap.state[key].tensor))
              for key, key_pieces in pieces.items() for piece in key_pieces]
    write_chunks(tmp, chunks, group)
    if rank == 0:
        options: dict[str, dict] = {}
        for _, opts in everyone:
            options.update(opts)
        meta = {"extra": extra, "param_groups": options, "step": int(step), "layout": layout}
        _save_torch(meta, tmp / META_FILE)
    files = _broadcast(data_files(tmp) if rank == 0 else None, group)
    digests = {name: file_digest(tmp / name) for i, name in enumerate(files) if i % world == rank}
    all_digests: dict[str, tuple[int, str]] = {}
    for d in _all_gather(digests, group):
        all_digests.update(d)
    if rank == 0:
        write_manifest(tmp, all_digests, step, layout)
        commit(tmp, path)
        keep_last_k(path.parent, keep_last)
    _barrier(group)
    return path


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None, *, step: int, layout: Any = None,
                    keep_last: int | None = None, group=None) -> Path:
    """Collective over `group` (default: the world; no torch.distributed: one process).

    Writes model parameters, per-parameter optimizer state and `extra` as the checkpoint
    directory `path` (committed atomically; an existing one is replaced).  `extra` holds small
    replicated state taken from rank 0 and must load with `torch.load(weights_only=True)`
    (plain containers, numbers, strings, tensors).  `layout` (JSON) is recorded in the manifest.
    After the commit, checkpoints beyond the `keep_last` newest in `path`'s directory are deleted
    (None: keep all).  Returns `path`.
    """
    return write_snapshot(path, take_snapshot(model, optimizer), extra, step=step, layout=layout,
                          keep_last=keep_last, group=group)


# ---- load -------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, group=None, key: str = "resume", verify_checksums: bool = True) -> dict[str, Any]:
    """Collective: load checkpoint `path` into this rank's slices of `model` (and `optimizer`).

    Works on any layout: each rank reads the stored chunks that intersect its slices.  The
    optimizer's state is replaced by the saved one (resharded like the parameters) and its groups
    take the saved hyperparameters.  Returns the `extra` dict given to `save_checkpoint`.
    A missing, partial or corrupt checkpoint, or one of another model, raises `ConfigError(key, …)`
    on every rank.
    """
    rank, _ = _rank_world(group)
    problem = _broadcast(checkpoint_problem(path, verify_checksums) if rank == 0 else None, group)
    if problem is not None:
        raise invalid_checkpoint_error(path, problem, key)
    path = Path(path)
    meta = torch.load(path / META_FILE, weights_only=True)
    quant = meta["extra"].get("quant")
    if quant is not None and not is_quantized(model):
        restore_quant_state(model, quant)  # creates the quantizers and their (sharded) amax buffers
    stored = {k: (v.shape, v.dtype) for k, v in stored_tensors(path).items()}
    targets, mismatches = load_targets(model, optimizer, stored)
    mismatches = sorted({m for ms in _all_gather(mismatches, group) for m in ms})
    if mismatches:
        extra_count = f"; and {len(mismatches) - 5} more" if len(mismatches) > 5 else ""
        shown = "; ".join(mismatches[:5]) + extra_count
        raise ConfigError(key, f"{key}={path} was saved from a different model ({shown}). Resume it with the "
                               f"model config it was trained with, or start without it ({key}=never).")
    read_chunks(path, [Chunk(k, t.spec.global_shape, t.spec.offsets, t.tensor) for k, t in targets.items()],
                group)
    if optimizer is not None:
        install_optimizer_state(model, optimizer, targets, meta.get("param_groups"))
    return meta["extra"]
