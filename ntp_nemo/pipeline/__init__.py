"""Pipeline parallelism: stage partition, GPipe/1F1B schedules on point-to-point ops, memory report.

`NTPRuntime` builds a `PipelineEngine` when the topology has more than one stage; the rest of the
training step (gradient sync, clipping, optimizer) is unchanged. The names load on first use: the
config checks (`validate_pipeline`, `resolve_stage_layers`) run in the launching process before
anything imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ntp_nemo.pipeline.engine import PipelineEngine
    from ntp_nemo.pipeline.memory import MemoryEstimate, estimate_memory, measure_memory, rank_memory_estimate
    from ntp_nemo.pipeline.partition import balanced_partition, resolve_stage_layers
    from ntp_nemo.pipeline.schedule import SCHEDULES, analytical_bubble, schedule_order, simulate
    from ntp_nemo.pipeline.validate import validate_pipeline

_LAZY = {
    "PipelineEngine": "ntp_nemo.pipeline.engine",
    "MemoryEstimate": "ntp_nemo.pipeline.memory",
    "estimate_memory": "ntp_nemo.pipeline.memory",
    "measure_memory": "ntp_nemo.pipeline.memory",
    "rank_memory_estimate": "ntp_nemo.pipeline.memory",
    "balanced_partition": "ntp_nemo.pipeline.partition",
    "resolve_stage_layers": "ntp_nemo.pipeline.partition",
    "SCHEDULES": "ntp_nemo.pipeline.schedule",
    "analytical_bubble": "ntp_nemo.pipeline.schedule",
    "schedule_order": "ntp_nemo.pipeline.schedule",
    "simulate": "ntp_nemo.pipeline.schedule",
    "validate_pipeline": "ntp_nemo.pipeline.validate",
}

__all__ = ["SCHEDULES", "MemoryEstimate", "PipelineEngine", "analytical_bubble", "balanced_partition",
           "estimate_memory", "measure_memory", "rank_memory_estimate", "resolve_stage_layers",
           "schedule_order", "simulate", "validate_pipeline"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ntp_nemo.pipeline' has no attribute {name!r}")
