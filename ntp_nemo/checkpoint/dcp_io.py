"""The only module that talks to `torch.distributed.checkpoint` (DCP): export to DCP, and DCP
reads/writes of the same chunks for the benchmark's side-by-side comparison.

ntp_nemo's own format (`storage.py`) writes raw records and checks digests while reading; DCP
serialises every chunk with `torch.save` and has no integrity check.  `export_dcp` converts a
checkpoint to a DCP directory (`.metadata` + `.distcp`) with the same chunks and keys, which DCP's
stock `dcp.load` reads into plain tensors (or any DCP-aware tool reshards):

    python -m ntp_nemo.checkpoint.dcp_io CHECKPOINT_DIR OUT_DIR

DCP's usual inputs are DTensor and ShardedTensor; neither fits NTP (ShardedTensor is deprecated
and refuses overlapping shards, which is what a load target is when ranks hold the same units),
so two small planners describe chunks to DCP directly through its public planner interface
(`WriteItem`/`ReadItem`, `create_read_items_for_chunk_list`).
"""

from __future__ import annotations

import argparse
import warnings
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

from ntp_nemo.checkpoint.storage import Chunk, Index, read_chunks


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


def save_dcp(directory: Path, chunks: list[Chunk], group=None, thread_count: int = 1) -> None:
    """Collective over `group`: write every rank's chunks (disjoint across ranks) as a DCP checkpoint."""
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True,
                                  thread_count=thread_count)
    dcp.save({}, storage_writer=writer, planner=_ChunkSavePlanner(chunks), process_group=group,
             no_dist=not _distributed(group))


def load_dcp(directory: Path, targets: list[Chunk], group=None, thread_count: int = 1) -> None:
    """Collective over `group`: fill each target tensor (in place) with its box of the stored tensor.

    For directories this process's job wrote (the benchmark): DCP unpickles `.metadata` without
    `weights_only`, so a DCP directory from elsewhere is trusted code; ntp_nemo never resumes from one."""
    reader = dcp.FileSystemReader(str(directory))
    dcp.load({}, storage_reader=reader, planner=_SliceLoadPlanner(targets), process_group=group,
             no_dist=not _distributed(group))


def export_dcp(checkpoint: str | Path, out: str | Path) -> Path:
    """Write checkpoint `checkpoint`'s tensors (same keys and chunks) as a DCP checkpoint in `out`
    (one process; every record is read once, digest checked, and written once)."""
    index = Index.read(Path(checkpoint))
    chunks = [Chunk(r.key, index.tensors[r.key].shape, r.offsets,
                    torch.empty(r.sizes, dtype=index.tensors[r.key].dtype))
              for recs in index.records.values() for r in recs]
    read_chunks(Path(checkpoint), chunks)
    Path(out).mkdir(parents=True, exist_ok=True)
    save_dcp(Path(out), chunks)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert an ntp_nemo sharded checkpoint to a DCP checkpoint.")
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    print(f"wrote {export_dcp(args.checkpoint, args.out)}")


if __name__ == "__main__":
    main()
