"""Pipeline parallelism: stage partition, GPipe/1F1B schedules on point-to-point ops, memory report.

`NTPRuntime` builds a `PipelineEngine` when the topology has more than one stage; the rest of the
training step (gradient sync, clipping, optimizer) is unchanged.
"""

from ntp_nemo.pipeline.engine import PipelineEngine
from ntp_nemo.pipeline.memory import MemoryEstimate, estimate_memory, measure_memory, rank_memory_estimate
from ntp_nemo.pipeline.partition import balanced_partition, resolve_stage_layers
from ntp_nemo.pipeline.schedule import SCHEDULES, analytical_bubble, schedule_order, simulate
from ntp_nemo.pipeline.validate import validate_pipeline

__all__ = ["SCHEDULES", "MemoryEstimate", "PipelineEngine", "analytical_bubble", "balanced_partition",
           "estimate_memory", "measure_memory", "rank_memory_estimate", "resolve_stage_layers",
           "schedule_order", "simulate", "validate_pipeline"]
