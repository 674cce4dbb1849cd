"""Topology-independent sharded checkpoints: save on one NTP layout, load on any other.

`save_checkpoint`/`load_checkpoint` (collective) write and read a checkpoint directory in which
every logical element of the model and optimizer state is stored once, with global offsets;
`manifest.py` makes a checkpoint count only once committed and intact.
"""

from ntp_nemo.checkpoint.async_save import AsyncCheckpointSaver
from ntp_nemo.checkpoint.dcp_io import stored_chunks, stored_tensors
from ntp_nemo.checkpoint.manifest import (
    CheckpointSkippedWarning,
    checkpoint_name,
    checkpoint_problem,
    is_valid_checkpoint,
    keep_last_k,
    latest_valid_checkpoint,
    read_manifest,
    require_valid_checkpoint,
)
from ntp_nemo.checkpoint.sharded import load_checkpoint, save_checkpoint

__all__ = [
    "AsyncCheckpointSaver",
    "CheckpointSkippedWarning",
    "checkpoint_name",
    "checkpoint_problem",
    "is_valid_checkpoint",
    "keep_last_k",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "require_valid_checkpoint",
    "save_checkpoint",
    "stored_chunks",
    "stored_tensors",
]
