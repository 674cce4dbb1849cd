"""The `fault` config group, checked before anything starts: the faults to inject, the timeout
hierarchy, the recovery mode (`fault.recovery=auto` picks live wherever it can work) and the policy.
Everything here reads the `FailoverSpec` the entry point built (`ntp_nemo.config.failover`).

Nothing here imports torch or Lightning, so a mistake in the group answers (exit 2) in well under a
second; `faults.FaultInjector`, `detection` and `supervisor` use these values at run time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ntp_nemo.config.failover import FailoverSpec
from ntp_nemo.config.schema import FaultConfig
from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.policies import make_policy

FAULT_KINDS = ("kill_rank", "hang", "slow", "kill_during_save", "corrupt_checkpoint")
KILL_PHASES = ("step_start", "backward", "optimizer")


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    steps: int | None = None
    phase: str = "step_start"

    @property
    def once(self) -> bool:
        return self.kind != "slow"


def _spec_list(f: FaultConfig) -> list[tuple[str, Any]]:
    specs: list[tuple[str, Any]] = []
    if str(f.kind) != "none":
        specs.append(("fault", f))
    for i, extra in enumerate(f.more or []):
        specs.append((f"fault.more[{i}]", extra))
    return specs


def resolve_faults(failover: FailoverSpec, world_size: int | None = None) -> list[Fault]:
    """The faults of this run with every unset step/rank drawn from `seed`; ConfigError on bad values.
    `world_size`: ranks of the starting layout (default the spec's)."""
    world_size = failover.world_size if world_size is None else world_size
    max_steps = failover.max_steps
    rng = random.Random(failover.seed * 7919 + 17)
    out: list[Fault] = []
    for key, spec in _spec_list(failover.fault):
        kind = str(spec.kind)
        if kind not in FAULT_KINDS:
            raise ConfigError(
                f"{key}.kind",
                f"unknown fault kind {kind!r}; use none or one of "
                f"{', '.join(FAULT_KINDS)} (e.g. fault=kill_rank fault.rank=1 fault.step=5).",
            )
        step = spec.step if spec.step is not None else rng.randint(min(2, max_steps), max(1, max_steps - 1))
        rank = spec.rank if spec.rank is not None else rng.randrange(world_size)
        if kind == "corrupt_checkpoint":
            rank = 0
        if not 1 <= int(step) <= max_steps:
            raise ConfigError(
                f"{key}.step",
                f"step {step} is outside 1..trainer.max_steps={max_steps}; choose a step the run reaches.",
            )
        if not 0 <= int(rank) < world_size:
            raise ConfigError(
                f"{key}.rank",
                f"rank {rank} is not a global rank of the starting layout "
                f"(0..{world_size - 1}); choose a rank that exists.",
            )
        seconds = float(getattr(spec, "seconds", 0.0) or 0.0)
        steps = getattr(spec, "steps", None)
        if kind == "slow" and seconds <= 0:
            raise ConfigError(
                f"{key}.seconds", f"a slow rank needs seconds > 0 of delay per step, got {seconds}."
            )
        phase = str(getattr(spec, "phase", "step_start") or "step_start")
        if phase not in KILL_PHASES or (phase != "step_start" and kind != "kill_rank"):
            raise ConfigError(
                f"{key}.phase",
                f"phase {phase!r} is not one of {', '.join(KILL_PHASES)}"
                if phase not in KILL_PHASES
                else f"phase {phase!r} applies to kill_rank only, not {kind}; drop {key}.phase.",
            )
        out.append(
            Fault(len(out), kind, int(rank), int(step), seconds, None if steps is None else int(steps), phase)
        )
    return out



@dataclass(frozen=True)
class Timeouts:
    heartbeat_s: float
    collective_s: float
    step_s: float

    @classmethod
    def from_config(cls, fault: FaultConfig) -> Timeouts:
        t = cls(
            float(fault.heartbeat_timeout_s), float(fault.collective_timeout_s), float(fault.step_timeout_s)
        )
        if not 0 < t.heartbeat_s < t.collective_s < t.step_s:
            raise ConfigError(
                "fault.heartbeat_timeout_s",
                f"the timeouts must grow heartbeat < collective < "
                f"whole step, got fault.heartbeat_timeout_s={t.heartbeat_s}, "
                f"fault.collective_timeout_s={t.collective_s}, fault.step_timeout_s={t.step_s}; "
                "a hang must be seen by heartbeats before collectives give up (see docs/failover.md).",
            )
        return t



def validate_fault_config(spec: FailoverSpec) -> None:
    """Checks of the `fault` group run with the rest of validation (before anything starts)."""
    f = spec.fault
    make_policy(str(f.policy), spec.min_replica_tp)
    Timeouts.from_config(f)
    _validate_recovery(spec)
    if int(f.max_restarts) < 0:
        raise ConfigError("fault.max_restarts", f"must be >= 0, got {f.max_restarts}.")
    if f.repair_after_steps is not None:
        if int(f.repair_after_steps) < 1:
            raise ConfigError(
                "fault.repair_after_steps",
                f"must be >= 1 (steps on the degraded layout before the "
                f"repaired GPU rejoins), got {f.repair_after_steps}.",
            )
        if recovery_mode(spec)[0] == "restart" and not spec.saves_checkpoints:
            raise ConfigError(
                "fault.repair_after_steps",
                "returning to the repaired layout needs checkpoints; "
                "set checkpoint.every_n_steps>0 or checkpoint.save_on_end=true.",
            )
    resolve_faults(spec)


RECOVERY_MODES = ("auto", "live", "restart")


def _live_blocker(spec: FailoverSpec) -> tuple[str, str] | None:
    """(key, why) when the live path cannot serve this run, else None."""
    if spec.distributed_optimizer:
        return ("optim.distributed", "live recovery needs every AdamW moment held by every replica, but "
                "optim.distributed=true keeps each on one rank only")
    if str(spec.fault.policy) == "restart":
        return ("fault.policy", "fault.policy=restart replaces the lost GPU with a spare, which only a "
                "relaunch can do")
    if spec.accelerator in ("gpu", "cuda"):
        return ("trainer.accelerator", "the live path stops a broken generation by severing gloo's sockets, "
                "which does not unblock NCCL collectives: it runs on CPU (gloo) only")
    if spec.dp < 2:
        return ("mesh.dp", "with one replica no survivor holds a lost rank's shards")
    return None


def recovery_mode(spec: FailoverSpec) -> tuple[str, str]:
    """(`live` or `restart`, why) for `fault.recovery` (`auto`: live wherever it can work)."""
    asked = str(spec.fault.recovery or "auto")
    blocker = _live_blocker(spec)
    if asked == "restart":
        return "restart", "fault.recovery=restart"
    if blocker is None or asked == "live":  # validation refused the other blockers; one replica falls back
        return "live", f"fault.recovery={asked}"
    return "restart", f"fault.recovery=auto: {blocker[1]}"


def _validate_recovery(spec: FailoverSpec) -> None:
    recovery = str(spec.fault.recovery or "auto")
    if recovery not in RECOVERY_MODES:
        raise ConfigError("fault.recovery", f"unknown recovery {recovery!r}; use auto (live where it can "
                          "work, else restart), live (the survivors reshard in memory) or restart (relaunch "
                          "from the last checkpoint).")
    blocker = _live_blocker(spec)
    if recovery == "live" and blocker is not None and blocker[0] != "mesh.dp":
        key, why = blocker
        raise ConfigError("fault.recovery", f"{why}; change {key} or use fault.recovery=restart (or auto, "
                          "which picks restart here).")
