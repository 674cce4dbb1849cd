"""Counting CUDA devices in the launching parent without initialising CUDA.

The parent forks its workers, and a process that forked after CUDA was initialised cannot use CUDA
in the child; even `torch.cuda.is_available()` calls `cudaGetDeviceCount`, which initialises the
driver (`cuInit`).  `torch.cuda.device_count()` asks NVML first (it honours CUDA_VISIBLE_DEVICES
and leaves CUDA alone); only when NVML cannot answer does this module count in a short-lived child
process, so the parent stays fork-safe either way.  Each worker then binds its own device
(`torch.cuda.set_device`) after it started.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ntp_nemo.errors import ConfigError

_COUNT_IN_CHILD = "import torch; print(torch.cuda.device_count())"


def cuda_device_count() -> int:
    """Visible CUDA devices; never creates a CUDA context or initialises the driver in this process."""
    if not torch.cuda._is_compiled():
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()  # already initialised here: nothing left to protect
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    count = nvml() if callable(nvml) else -1
    if count >= 0:
        return count
    try:
        out = subprocess.run(
            [sys.executable, "-c", _COUNT_IN_CHILD],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="0"),
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def local_cuda_ordinals(local_processes: int, visible: int | None = None) -> list[int]:
    """The CUDA ordinal each of this node's `local_processes` ranks binds, by local rank.

    Every rank sees the node's GPUs (`torchrun`, `srun --gpus-per-node`, the recommended way: NCCL
    then reaches the node's other GPUs over NVLink and CUDA IPC): local rank i binds cuda:i.  Each rank
    sees one GPU of its own (`srun --gpus-per-task=1`: CUDA_VISIBLE_DEVICES is one id per task): every
    rank binds cuda:0, which is a different GPU in each, and the start-up warns (per-task isolation
    keeps NCCL off NVLink; `ntp_nemo.launch.node_layout.isolated_gpu_warning`).  `visible` defaults to
    this process's count (NVML: no CUDA context).
    """
    visible = cuda_device_count() if visible is None else visible
    if visible >= local_processes:
        return list(range(local_processes))
    if visible == 1:
        return [0] * local_processes
    raise ConfigError(
        "CUDA_VISIBLE_DEVICES",
        f"{local_processes} processes on this node but {visible} GPUs visible to this one "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); make all of the "
        "node's GPUs visible to every process (srun --gpus-per-node=N, torchrun), which keeps NCCL on "
        "NVLink, or give each process one GPU (srun --gpus-per-task=1)."
    )


def visible_gpus(on_cuda: bool) -> int:
    """The GPUs this process sees, as the start-up placement check reports them (`NodeFacts.visible_gpus`).

    A CUDA run counts as CUDA does (`cuda_device_count`: NVML, which honours CUDA_VISIBLE_DEVICES).  Any
    other run makes no CUDA query: it counts the devices CUDA_VISIBLE_DEVICES names, parsed by CUDA's
    rules (torch's parser: entries up to the first invalid one, none when one repeats; `srun
    --gpus-per-task=1` sets one id per task), or 0 when the variable is unset.  Only this report reads
    the variable: the accelerator is chosen by `cuda_available`, so a CPU run with CUDA_VISIBLE_DEVICES
    set still trains on the CPU.
    """
    if on_cuda:
        return cuda_device_count()
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return 0
    return len(torch.cuda._parse_visible_devices())


def cuda_available() -> bool:
    """`torch.cuda.is_available()` for the launching parent (see `cuda_device_count`)."""
    return cuda_device_count() > 0
