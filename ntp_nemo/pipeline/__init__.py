"""Pipeline parallelism: stage partition, GPipe/1F1B schedules on point-to-point ops, memory report.

`NTPRuntime` builds a `PipelineEngine` when the topology has more than one stage; the rest of the
training step (gradient sync, clipping, optimizer) is unchanged. The names load on first use: the
partition (`balanced_partition`) runs in the launching process before anything imports torch; the
config keys are checked and resolved by the config layer (`config/pipeline_keys.py`,
`config/resolve_layout.py`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ntp_nemo.pipeline.engine import PipelineEngine
    from ntp_nemo.pipeline.memory import MemoryEstimate, estimate_memory, measure_memory, rank_memory_estimate
    from ntp_nemo.pipeline.partition import balanced_partition
    from ntp_nemo.pipeline.schedule import SCHEDULES, analytical_bubble, schedule_order, simulate

_LAZY = {
    "PipelineEngine": "ntp_nemo.pipeline.engine",
    "MemoryEstimate": "ntp_nemo.pipeline.memory",
    "estimate_memory": "ntp_nemo.pipeline.memory",
    "measure_memory": "ntp_nemo.pipeline.memory",
    "rank_memory_estimate": "ntp_nemo.pipeline.memory",
    "balanced_partition": "ntp_nemo.pipeline.partition",
    "SCHEDULES": "ntp_nemo.pipeline.schedule",
    "analytical_bubble": "ntp_nemo.pipeline.schedule",
    "schedule_order": "ntp_nemo.pipeline.schedule",
    "simulate": "ntp_nemo.pipeline.schedule",
}

__all__ = ["SCHEDULES", "MemoryEstimate", "PipelineEngine", "analytical_bubble", "balanced_partition",
           "estimate_memory", "measure_memory", "rank_memory_estimate", "schedule_order", "simulate"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ntp_nemo.pipeline' has no attribute {name!r}")
