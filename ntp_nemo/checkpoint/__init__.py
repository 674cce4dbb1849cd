"""Topology-independent sharded checkpoints: save on one NTP layout, load on any other.

`save_checkpoint`/`load_checkpoint` (collective) write and read a checkpoint directory in which
every logical element of the model and optimizer state is stored once, with global offsets and
an xxh3 digest per record (`storage.py`); `manifest.py` makes a checkpoint count only once
committed and intact; `AsyncCheckpointSaver` writes in the background.
"""

from ntp_nemo.checkpoint.async_save import AsyncCheckpointSaver
from ntp_nemo.checkpoint.manifest import (
    CheckpointSkippedWarning,
    NoUsableCheckpointError,
    checkpoint_name,
    checkpoint_problem,
    is_valid_checkpoint,
    keep_last_k,
    latest_valid_checkpoint,
    read_manifest,
    require_valid_checkpoint,
)
from ntp_nemo.checkpoint.sharded import (
    CheckpointWriteError,
    CorruptCheckpointError,
    Loaded,
    load,
    load_checkpoint,
    load_with_fallback,
    save_checkpoint,
)
from ntp_nemo.checkpoint.storage import stored_chunks, stored_tensors

__all__ = [
    "AsyncCheckpointSaver",
    "CheckpointSkippedWarning",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "Loaded",
    "NoUsableCheckpointError",
    "checkpoint_name",
    "checkpoint_problem",
    "is_valid_checkpoint",
    "keep_last_k",
    "latest_valid_checkpoint",
    "load",
    "load_checkpoint",
    "load_with_fallback",
    "read_manifest",
    "require_valid_checkpoint",
    "save_checkpoint",
    "stored_chunks",
    "stored_tensors",
]
