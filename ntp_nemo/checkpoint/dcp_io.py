"""The only module that talks to `torch.distributed.checkpoint` (DCP): chunks in, chunks out.

DCP stores every tensor as chunks with global offsets and, on load, reads the stored chunks that
intersect whatever chunks the caller asks for.  Its usual inputs are DTensor and ShardedTensor;
neither fits NTP: ShardedTensor is deprecated upstream, costs one collective per tensor to build
(`init_from_local_shards`), and refuses overlapping shards, which is what a load target is when
ranks hold the same units (replicas, layers replicated inside a replica, shared KV heads).  So
two small planners describe chunks to DCP directly through its public planner interface
(`WriteItem`/`ReadItem`, `create_read_items_for_chunk_list`): a save planner that writes the
given disjoint chunks, and a load planner that fills each rank's own (possibly overlapping)
slices in place.  DCP still does the plan exchange, the global-metadata file, the overlap and
coverage validation, and the storage layout (one `.distcp` file per writing rank + `.metadata`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass(frozen=True)
class Chunk:
    """A box of the logical tensor `key`: `tensor` sits at `offsets` inside `global_shape`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(frozen=True)
class StoredTensor:
    """What the checkpoint says about one logical tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`torch.save` writes a view's whole storage; copy views so only the chunk's bytes are written."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")  # a fresh, exactly sized CPU tensor
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _ChunkSavePlanner(DefaultSavePlanner):
    def __init__(self, chunks: list[Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}

    def create_local_plan(self) -> SavePlan:
        items = []
        for index, c in self.chunks.items():
            chunk_md = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.size())
            data = TensorWriteData(chunk=chunk_md, properties=TensorProperties.create_from_tensor(c.tensor),
                                   size=torch.Size(c.global_shape))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _own_storage(self.chunks[MetadataIndex(index.fqn, index.offset)].tensor)


class _SliceLoadPlanner(DefaultLoadPlanner):
    def __init__(self, targets: list[Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.targets = {c.key: c for c in targets}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for key, c in self.targets.items():
            stored = self.metadata.state_dict_metadata[key]
            assert isinstance(stored, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.size())
            items.extend(create_read_items_for_chunk_list(key, stored, [chunk]))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn].tensor


# DCP announces every save/load without torch.distributed; that is this module's normal one-process mode.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def write_chunks(directory: Path, chunks: list[Chunk], group=None) -> None:
    """Collective over `group`: write every rank's chunks (disjoint across ranks) into `directory`."""
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True)
    dcp.save({}, storage_writer=writer, planner=_ChunkSavePlanner(chunks), process_group=group,
             no_dist=not _distributed(group))


def read_chunks(directory: Path, targets: list[Chunk], group=None) -> None:
    """Collective over `group`: fill each target tensor (in place) with its box of the stored tensor."""
    reader = dcp.FileSystemReader(str(directory))
    dcp.load({}, storage_reader=reader, planner=_SliceLoadPlanner(targets), process_group=group,
             no_dist=not _distributed(group))


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Global shape and dtype of every tensor in a checkpoint (reads only DCP's metadata file)."""
    md = dcp.FileSystemReader(str(directory)).read_metadata()
    return {key: StoredTensor(tuple(m.size), m.properties.dtype)
            for key, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def stored_chunks(directory: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(offsets, sizes) of every stored chunk per tensor: what the files hold, for inspection and tests."""
    md = dcp.FileSystemReader(str(directory)).read_metadata()
    return {key: [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
            for key, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
