"""Failure injection, detection and failover (docs/failover.md).

- `policies`: re-planning a layout after lost ranks (`ntp`, `dp_drop`, `restart`) from small rules;
- `faults`: the `fault` config group and the callback that injects the faults in the workers;
- `heartbeat`: per-rank progress files written by the workers;
- `detection`: the timeout hierarchy, the worker monitor and the failure classification;
- `supervisor`: the `ntp-train` parent running attempts until `trainer.max_steps`;
- `worker`: what a supervised worker does differently;
- `replan`: `python -m ntp_nemo.resilience.replan`, the plan for a torchrun/SLURM restart;
- `store_auth`: the job's secret, key prefix and signed notices on a store others can reach.
"""

from ntp_nemo.resilience.policies import (
    POLICY_NAMES,
    DropBelow,
    DropDamaged,
    Layout,
    Policy,
    ReplaceLost,
    Replan,
    ShrinkToSurvivors,
    make_policy,
)

__all__ = [
    "POLICY_NAMES",
    "DropBelow",
    "DropDamaged",
    "Layout",
    "Policy",
    "Replan",
    "ReplaceLost",
    "ShrinkToSurvivors",
    "make_policy",
]
