"""Topology-independent sharded checkpoints: save on one NTP layout, load on any other.

`save_checkpoint` and `load_checkpoint` are collective over all ranks (or run in one process
without torch.distributed).  On disk a checkpoint directory holds:

- `data_<rank>_<k>.bin`: raw tensor records (`storage.py`); every logical element of the model and
  of the optimizer state is stored exactly once, by one of the ranks holding it, the bytes spread
  evenly over all holders (`ownership.py`: every replica writes its share);
- `index.json`: every tensor's global shape, dtype and records (file, byte range, xxh3 digest);
- `meta.pt`: small replicated state written by rank 0: the caller's `extra` (step, consumed
  batches, LR-scheduler state, config snapshot, …), the optimizer hyperparameters per parameter
  name, the step, the layout and every rank's RNG states (`rng.py`);
- `manifest.json`: written last (sizes, metadata digests, step, layout, format version); the
  directory is written as `NAME.tmp/` and renamed to `NAME` after the manifest (`manifest.py`).

Loading reads, on each rank, only the byte ranges of the records that intersect its slices, in
parallel, and checks each record's digest exactly once across ranks (by one rank that reads it).
All ranks agree on any bad record before the optimizer state is touched; `load_with_fallback`
then falls back to the previous valid checkpoint of the same directory, or raises naming the file.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_nemo.checkpoint.files import MANIFEST, META_FILE
from ntp_nemo.checkpoint.manifest import (
    CheckpointSkippedWarning,
    checkpoint_problem,
    commit,
    data_files,
    file_digest,
    invalid_checkpoint_error,
    keep_last_k,
    latest_valid_checkpoint,
    mark_corrupt,
    read_index_doc,
    read_manifest,
    tmp_path,
    write_manifest,
)
from ntp_nemo.checkpoint.ownership import write_pieces
from ntp_nemo.checkpoint.rng import rng_state
from ntp_nemo.checkpoint.state import (
    OPTIM_PREFIX,
    group_options,
    install_optimizer_state,
    load_targets,
    model_key,
    sharded_state,
)
from ntp_nemo.checkpoint.storage import (
    INDEX_FILE,
    Chunk,
    Index,
    ReadStats,
    assign_verifiers,
    index_doc,
    read_records,
    reads_needed,
    write_index,
    write_records,
)
from ntp_nemo.errors import ConfigError
from ntp_nemo.quant.quant_state import restore_quant_state
from ntp_nemo.quant.sharding import is_quantized
from ntp_nemo.topology.shard import ShardSpec

SMALL_FILES = (INDEX_FILE, META_FILE)
# How the problems of a committed checkpoint whose files are damaged (or hostile) begin: loading it
# marks it corrupt and falls back to the previous one, where a fallback is allowed.
DAMAGE = ("file ", f"{INDEX_FILE}", f"{META_FILE}", "its metadata", f"{MANIFEST} names", f"{MANIFEST} gives",
          f"{MANIFEST} does not list")  # digested whole in the manifest
THREADS = 4  # files in flight per rank, on save and on load


# ---- collectives that degrade to no-ops in one process --------------------------------------------
def _rank_world(group, expect: int | None = None) -> tuple[int, int]:
    """(rank, world size) of `group`; with `expect` (the world size a collective save or load began
    with), a group that no longer has it (a live recovery destroyed it meanwhile: torch.distributed then
    reports one process) raises instead of degrading to the one-process no-ops below, which would let
    rank 0 commit a checkpoint holding its own records only."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_available() and \
        dist.is_initialized() else (0, 1)
    if expect is not None and world != expect:
        raise RuntimeError(f"the checkpoint's process group of {expect} ranks ended while it was in use "
                           f"(connection closed: {world if world > 0 else 'no'} rank(s) left in it, e.g. a "
                           "live recovery re-formed the ranks); nothing is committed")
    return rank, world


def _all_gather(obj: Any, group, world: int | None = None) -> list[Any]:
    _, world = _rank_world(group, world)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group, world: int | None = None) -> Any:
    if _rank_world(group, world)[1] == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _barrier(group, world: int | None = None) -> None:
    if _rank_world(group, world)[1] > 1:
        dist.barrier(group=group)



# ---- save -------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """What one rank contributes to a checkpoint: the chunks it writes, the shape and dtype of every
    tensor it holds, its optimizer hyperparameters by parameter name, its RNG states.  `live` names
    the chunks (by index, with their staging key) that still view live tensors and that `stage_live`
    has yet to copy (a deferred snapshot of a background save)."""

    chunks: list[Chunk]
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    options: dict[str, dict] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    live: dict[int, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(c.tensor.numel() * c.tensor.element_size() for c in self.chunks)


def _piece_view(held: ShardSpec, piece: ShardSpec, tensor: torch.Tensor) -> torch.Tensor:
    if not held.global_shape:
        return tensor
    if not (held.is_block or piece.is_block) and (held.dim, held.unit_size) == (piece.dim, piece.unit_size):
        return tensor.narrow(held.dim, (piece.lo - held.lo) * held.unit_size, piece.length)
    # a box: of a block-sharded weight (2D), or a piece of one-element units (another replica's pattern
    # splits this tensor where this rank holds it whole, e.g. a grid's norm split along its columns)
    for d, (at, have, size) in enumerate(zip(piece.offsets, held.offsets, piece.local_shape, strict=True)):
        tensor = tensor.narrow(d, at - have, size)
    return tensor


class WritePlan:
    """Which pieces this rank writes; computed with one exchange of every rank's holdings and
    reused while the holdings stay the same (every save of a run on one layout)."""

    def __init__(self) -> None:
        self._holdings: dict[str, ShardSpec] | None = None
        self._pieces: dict[str, list[ShardSpec]] = {}

    def pieces(self, holdings: dict[str, ShardSpec], group) -> dict[str, list[ShardSpec]]:
        """Collective the first time and whenever some rank's holdings changed."""
        changed = holdings != self._holdings
        if any(_all_gather(changed, group)):
            rank, _ = _rank_world(group)
            self._pieces = write_pieces(rank, _all_gather(holdings, group))
            self._holdings = holdings
        return self._pieces


class Staging:
    """Host buffers the snapshot of a background save is copied into, reused from save to save
    (pinned memory when the state lives on a GPU, so the copy is one DMA per tensor)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        return buf


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, group=None,
                  plan: WritePlan | None = None, staging: Staging | None = None,
                  defer: bool = False) -> Snapshot:
    """Collective: this rank's share of the checkpoint.  Without `staging` the chunks are views of
    the live tensors (written straight from their memory); with it, copies into `staging`'s
    buffers that training may not touch (for a background save).  With `defer` too, the chunks of
    parameters and optimizer state held in host memory stay views, listed in `Snapshot.live`, for
    `stage_live` to copy later: until then the caller must not change those tensors (only an
    optimizer step or a load does).  Everything else (GPU tensors, quantizer scales, the RNG
    states, the hyperparameters) is captured now."""
    if hasattr(optimizer, "gather_state"):  # a sharded optimizer fills per-parameter state (collective)
        optimizer.gather_state()
    state = sharded_state(model, optimizer)
    pieces = (plan or WritePlan()).pieces({k: v.spec for k, v in state.items()}, group)
    deferrable = {model_key(name) for name, _ in model.named_parameters()} if defer else set()
    chunks: list[Chunk] = []
    live: dict[int, str] = {}
    for key, key_pieces in pieces.items():
        held = state[key]
        later = key in deferrable or (defer and key.startswith(OPTIM_PREFIX))
        for i, piece in enumerate(key_pieces):
            view = _piece_view(held.spec, piece, held.tensor.detach())
            if staging is not None:
                if later and view.device.type == "cpu":
                    live[len(chunks)] = f"{key}#{i}"
                else:
                    view = staging.stage(f"{key}#{i}", view)
            chunks.append(Chunk(key, piece.global_shape, piece.offsets, view))
    if hasattr(optimizer, "gather_state"):
        optimizer.state.clear()  # the chunks hold the gathered state; the optimizer keeps only its shards
    if staging is not None and any(c.tensor.is_pinned() for c in chunks):
        torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
    tensors = {k: (tuple(v.spec.global_shape), v.tensor.dtype) for k, v in state.items()}
    options = copy.deepcopy(group_options(model, optimizer)) if optimizer is not None else {}
    return Snapshot(chunks, tensors, options, rng_state(), live)


def stage_live(snap: Snapshot, staging: Staging) -> None:
    """Copy the chunks of a deferred snapshot that still view live tensors into `staging`'s buffers."""
    for i, key in snap.live.items():
        c = snap.chunks[i]
        snap.chunks[i] = Chunk(c.key, c.global_shape, c.offsets, staging.stage(key, c.tensor))
    snap.live = {}


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


def pickled_object_problem(err: pickle.UnpicklingError) -> str:
    """Why a `META_FILE` refused by `torch.load(weights_only=True)` is not loaded (names what it held)."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    what = f" ({found.group(1)})" if found else ""
    return (f"{META_FILE} carries a pickled object{what} besides plain data; it is never loaded, since "
            "unpickling it could run code of the file's choosing, and ntp_nemo writes only containers, "
            "numbers, strings and tensors there (was the file replaced?)")


def read_meta(path: str | os.PathLike, key: str = "resume") -> dict[str, Any]:
    """A checkpoint's `META_FILE`, loaded with `weights_only=True`; one carrying a pickled object is a
    `ConfigError(key, ...)`."""
    try:
        return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise invalid_checkpoint_error(path, pickled_object_problem(err), key) from None


def _save_torch(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_snapshot(path: str | os.PathLike, snap: Snapshot, extra: Mapping[str, Any] | None, *, step: int,
                   layout: Any = None, keep_last: int | None = None, group=None,
                   threads: int = THREADS) -> Path:
    """Collective: write `snap` of every rank as checkpoint `path` and commit it (see module doc);
    then rank 0 prunes `path`'s directory to the `keep_last` newest checkpoints."""
    path = Path(path)
    tmp = tmp_path(path)
    rank, world = _rank_world(group)  # every later collective checks the group still has `world` ranks
    json.dumps(layout)  # fail before writing anything if the layout cannot go into the manifest
    extra = _check_extra(extra)
    if rank == 0:
        if tmp.exists():  # leftover of a save that died
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(group, world)
    try:
        records, failed = write_records(tmp, rank, snap.chunks, threads), None
    except OSError as err:  # every rank learns of it below: none waits in a collective for this one
        records, failed = [], _os_problem(err)
    everyone = _all_gather((records, snap.tensors, snap.options, snap.rng, failed), group, world)
    failed = next((f for *_, f in everyone if f is not None), None)
    if rank == 0 and failed is None:
        try:
            _commit_snapshot(path, tmp, everyone, extra, step, layout)
        except OSError as err:
            failed = _os_problem(err)
        else:
            keep_last_k(path.parent, keep_last)
    if rank == 0 and failed is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save: never committed, and it holds space
        failed = save_failure(path, failed)
    failed = _broadcast(failed, group, world)
    if failed is not None:
        raise CheckpointWriteError(failed)
    return path


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a read-only file system): the message
    names the path, the reason and the complete checkpoints that survive."""


def _os_problem(err: OSError) -> str:
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err}{where}"


def save_failure(path: Path, problem: str) -> str:
    """One line: what failed, and which complete checkpoints survive in `path`'s directory."""
    from ntp_nemo.checkpoint.manifest import readable_checkpoints

    kept = readable_checkpoints(path.parent)
    survivors = ", ".join(p.name for p in kept) if kept else "none"
    return (f"checkpoint {path} could not be written: {problem}; the partial save was removed and the "
            f"complete checkpoints in {path.parent} are kept ({survivors}). Free space there (or lower "
            "checkpoint.keep_last), then rerun with resume=auto to continue from the latest of them.")


def _commit_snapshot(path: Path, tmp: Path, everyone: list, extra: dict[str, Any], step: int,
                     layout: Any) -> None:
    """Rank 0: the index, the metadata and the manifest of a written snapshot, then the commit."""
    tensors: dict[str, tuple] = {}
    options: dict[str, dict] = {}
    for _, t, opts, _, _ in everyone:
        tensors.update(t)
        options.update(opts)
    write_index(tmp, index_doc((r for recs, *_ in everyone for r in recs), tensors))
    meta = {"extra": extra, "param_groups": options, "step": int(step), "layout": layout,
            "rng": [r for *_, r, _ in everyone]}
    _save_torch(meta, tmp / META_FILE)
    files = {name: file_digest(tmp / name) if name in SMALL_FILES else ((tmp / name).stat().st_size, None)
             for name in data_files(tmp)}
    write_manifest(tmp, files, step, layout)
    commit(tmp, path)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: Mapping[str, Any] | None = None, *, step: int, layout: Any = None,
                    keep_last: int | None = None, group=None, threads: int = THREADS) -> Path:
    """Collective over `group` (default: the world; no torch.distributed: one process).

    Writes model parameters, per-parameter optimizer state, every rank's RNG states and `extra` as
    the checkpoint directory `path` (committed atomically; an existing one is replaced).  `extra`
    holds small replicated state taken from rank 0 and must load with `torch.load(weights_only=True)`
    (plain containers, numbers, strings, tensors).  `layout` (JSON) is recorded in the manifest.
    After the commit, checkpoints beyond the `keep_last` newest in `path`'s directory are deleted
    (None: keep all).  Returns `path`.
    """
    snap = take_snapshot(model, optimizer, group=group)
    return write_snapshot(path, snap, extra, step=step, layout=layout, keep_last=keep_last, group=group,
                          threads=threads)


# ---- load -------------------------------------------------------------------------------------------
class CorruptCheckpointError(ConfigError):
    """A data file of the checkpoint failed its digest or is shorter than its index says."""

    def __init__(self, key: str, path: Path, problem: str) -> None:
        super().__init__(key, str(invalid_checkpoint_error(path, problem, key)).removeprefix(f"{key}: "))
        self.path, self.problem = path, problem


@dataclass
class Loaded:
    """What a load gave: the caller's `extra`, the checkpoint used, its layout and every saving rank's
    RNG states, and this rank's read statistics."""

    extra: dict[str, Any]
    path: Path
    layout: Any
    rng: list[dict[str, Any]]
    stats: ReadStats


def read_threads(local_ranks: int) -> int:
    """Reader threads per rank: up to THREADS, and no more than this rank's share of the CPUs it may
    run on (`local_ranks` processes share them): on a small host, more readers than CPUs only queue."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(THREADS, cpus // max(1, local_ranks)))


def _read_head(path: Path) -> tuple[str | None, dict | None, dict | None]:
    """(problem, index document, meta) of a checkpoint, read by one rank: never raises, so that a
    damaged or hostile checkpoint is one problem every rank learns from the broadcast (not one rank's
    exception that leaves the others waiting in a collective)."""
    problem = checkpoint_problem(path)  # files confined, sizes and offsets checked, digests of metadata
    if problem is not None:
        return problem, None, None
    try:
        doc = read_index_doc(path)
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        return pickled_object_problem(err), None, None
    except Exception as err:  # noqa: BLE001 - whatever the files hold, the ranks agree on the answer
        return f"its metadata cannot be read ({type(err).__name__}: {str(err)[:200]})", None, None
    if not isinstance(meta, dict) or not isinstance(meta.get("extra"), dict):
        return f"{META_FILE} does not hold ntp_nemo checkpoint metadata", None, None
    return None, doc, meta


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         group=None, key: str = "resume", threads: int | None = None, saver: Any = None) -> Loaded:
    """Collective: load checkpoint `path` into this rank's slices of `model` (and `optimizer`).

    Works on any layout: each rank reads the byte ranges of the stored records that intersect its
    slices.  The optimizer's state is replaced by the saved one (resharded like the parameters) and
    its groups take the saved hyperparameters.  A missing, partial or foreign checkpoint raises
    `ConfigError(key, …)` on every rank; a corrupt or truncated data file raises
    `CorruptCheckpointError` on every rank, before the optimizer is touched.  `threads`: reader
    threads per rank (default: `read_threads` of the ranks on this host).  `saver`: this process's
    `AsyncCheckpointSaver`, whose background copy may still read the tensors this load overwrites.
    """
    path = Path(path)
    if saver is not None:
        saver.staged()  # the save in flight has copied what it writes
    rank, world = _rank_world(group)
    if threads is None:
        threads = read_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    head = None
    if rank == 0:  # the metadata is read (and its digests checked) once, then broadcast
        head = _read_head(path)
    problem, doc, meta = _broadcast(head, group)
    if problem is not None and problem.startswith(DAMAGE):  # a committed checkpoint with a bad file
        raise CorruptCheckpointError(key, path, problem)
    if problem is not None:
        raise invalid_checkpoint_error(path, problem, key)
    index = Index.from_doc(doc)
    quant = meta["extra"].get("quant")
    if quant is not None and not is_quantized(model):
        restore_quant_state(model, quant)  # creates the quantizers and their (sharded) amax buffers
    stored = {k: (v.shape, v.dtype) for k, v in index.tensors.items()}
    targets, mismatches = load_targets(model, optimizer, stored)
    chunks = [Chunk(k, t.spec.global_shape, t.spec.offsets, t.tensor) for k, t in targets.items()]
    gathered = _all_gather((mismatches, reads_needed(index, chunks)), group)
    mismatches = sorted({m for ms, _ in gathered for m in ms})
    if mismatches:
        extra_count = f"; and {len(mismatches) - 5} more" if len(mismatches) > 5 else ""
        shown = "; ".join(mismatches[:5]) + extra_count
        raise ConfigError(key, f"{key}={path} was saved from a different model ({shown}). Resume it with the "
                               f"model config it was trained with, or start without it ({key}=never).")
    verify = assign_verifiers(index, [needs for _, needs in gathered])[rank]
    stats = read_records(path, index, chunks, verify, threads)
    problems = sorted({p for ps in _all_gather(stats.problems, group) for p in ps})
    if problems:
        raise CorruptCheckpointError(key, path, problems[0])
    if optimizer is not None:
        install_optimizer_state(model, optimizer, targets, meta.get("param_groups"))
    return Loaded(meta["extra"], path, meta.get("layout"), list(meta.get("rng") or []), stats)


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, group=None, key: str = "resume", threads: int | None = None,
                    saver: Any = None) -> dict[str, Any]:
    """`load` returning only the `extra` dict given to `save_checkpoint`."""
    return load(path, model, optimizer, group=group, key=key, threads=threads, saver=saver).extra


def load_with_fallback(path: str | os.PathLike, model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None, *, fallback: bool, group=None,
                       key: str = "resume", threads: int | None = None, saver: Any = None) -> Loaded:
    """Collective `load`; when a data file of `path` turns out corrupt, rank 0 marks the checkpoint
    corrupt (`corrupt.json`) and, with `fallback`, the previous valid checkpoint of the same
    directory is loaded instead (a `CheckpointSkippedWarning` names the file and the one used);
    without `fallback`, or with no earlier checkpoint, `CorruptCheckpointError` names the file."""
    path = Path(path)
    rank, _ = _rank_world(group)
    while True:
        try:
            return load(path, model, optimizer, group=group, key=key, threads=threads, saver=saver)
        except CorruptCheckpointError as err:
            if rank == 0:
                mark_corrupt(path, err.problem)
            _barrier(group)
            if not fallback:
                raise
            step = int(read_manifest(path).get("step", 0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointSkippedWarning)  # the newer ones are told below
                older = latest_valid_checkpoint(path.parent, before_step=step)
            instead = f"using {older} instead" if older else "no earlier valid checkpoint remains"
            warnings.warn(f"skipping checkpoint {path}: {err.problem}; {instead}", CheckpointSkippedWarning,
                          stacklevel=2)
            if older is None:
                raise
            path = older
