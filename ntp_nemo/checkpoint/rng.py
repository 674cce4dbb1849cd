"""Every random number generator a rank draws from, as checkpointable state.

Dropout (and anything else random in the step) draws from the global torch generator (and the
generator of the rank's CUDA device on GPU); data code may use numpy's and Python's.  `rng_state`
captures all four on one rank in a form `torch.load(weights_only=True)` accepts; `set_rng_state`
puts them back.  The checkpoint stores one entry per rank, so a run resumed on the same layout
continues bit-exactly.  The data order needs no generator state: the sampler is a pure function of
(seed, step), and the step is in the checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's generator states (CUDA only when CUDA is already in use here)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device: the generator its step draws from
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"],
        "gauss": n["gauss"],
    })
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        _set_cuda_rng_state(state["cuda"])


def _set_cuda_rng_state(saved: torch.Tensor | list[torch.Tensor]) -> None:
    """The saved generator goes to this rank's current device, whatever the number of visible GPUs
    now (`--gpus-per-task=1` on the resume, all of the node's at the save, or the reverse).  A list
    is an older checkpoint's every visible device: restored only when that count is unchanged (which
    entry was this rank's is unknown otherwise)."""
    if isinstance(saved, torch.Tensor):
        torch.cuda.set_rng_state(saved)
    elif len(saved) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved)
