"""The `fault` config group, checked before anything starts: the faults to inject, the timeout
hierarchy, the recovery mode (`fault.recovery=auto` picks live wherever it can work) and the policy.

Nothing here imports torch or Lightning, so a mistake in the group answers (exit 2) in well under a
second; `faults.FaultInjector`, `detection` and `supervisor` use these values at run time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

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


def _spec_list(f: DictConfig) -> list[tuple[str, Any]]:
    specs: list[tuple[str, Any]] = []
    if str(f.kind) != "none":
        specs.append(("fault", f))
    for i, extra in enumerate(f.get("more") or []):
        specs.append((f"fault.more[{i}]", extra))
    return specs


def resolve_faults(cfg: DictConfig, world_size: int) -> list[Fault]:
    """The faults of this run with every unset step/rank drawn from `seed`; ConfigError on bad values."""
    max_steps = int(cfg.trainer.max_steps)
    rng = random.Random(int(cfg.seed) * 7919 + 17)
    out: list[Fault] = []
    for key, spec in _spec_list(cfg.fault):
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
        seconds = float(spec.get("seconds", 0.0) or 0.0)
        steps = spec.get("steps")
        if kind == "slow" and seconds <= 0:
            raise ConfigError(
                f"{key}.seconds", f"a slow rank needs seconds > 0 of delay per step, got {seconds}."
            )
        phase = str(spec.get("phase", "step_start") or "step_start")
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
    def from_config(cls, fault: DictConfig) -> Timeouts:
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



def validate_fault_config(cfg: DictConfig) -> None:
    """Checks of the `fault` group run with the rest of validation (before anything starts)."""
    f = cfg.fault
    make_policy(str(f.policy), int(cfg.ntp.min_replica_tp))
    Timeouts.from_config(f)
    _validate_recovery(cfg)
    if int(f.max_restarts) < 0:
        raise ConfigError("fault.max_restarts", f"must be >= 0, got {f.max_restarts}.")
    if f.repair_after_steps is not None:
        if int(f.repair_after_steps) < 1:
            raise ConfigError(
                "fault.repair_after_steps",
                f"must be >= 1 (steps on the degraded layout before the "
                f"repaired GPU rejoins), got {f.repair_after_steps}.",
            )
        saves = cfg.checkpoint.every_n_steps or cfg.checkpoint.save_on_end
        if recovery_mode(cfg)[0] == "restart" and not saves:
            raise ConfigError(
                "fault.repair_after_steps",
                "returning to the repaired layout needs checkpoints; "
                "set checkpoint.every_n_steps>0 or checkpoint.save_on_end=true.",
            )
    from ntp_nemo.config.validate import resolved_replica_tp

    resolve_faults(cfg, int(cfg.mesh.pp) * sum(resolved_replica_tp(cfg)))


RECOVERY_MODES = ("auto", "live", "restart")


def _live_blocker(cfg: DictConfig) -> tuple[str, str] | None:
    """(key, why) when the live path cannot serve this run, else None."""
    if bool(cfg.optim.get("distributed", False)):
        return ("optim.distributed", "live recovery needs every AdamW moment held by every replica, but "
                "optim.distributed=true keeps each on one rank only")
    if str(cfg.fault.policy) == "restart":
        return ("fault.policy", "fault.policy=restart replaces the lost GPU with a spare, which only a "
                "relaunch can do")
    if str(cfg.trainer.accelerator) in ("gpu", "cuda"):
        return ("trainer.accelerator", "the live path stops a broken generation by severing gloo's sockets, "
                "which does not unblock NCCL collectives: it runs on CPU (gloo) only")
    if int(cfg.mesh.dp) < 2:
        return ("mesh.dp", "with one replica no survivor holds a lost rank's shards")
    return None


def recovery_mode(cfg: DictConfig) -> tuple[str, str]:
    """(`live` or `restart`, why) for `fault.recovery` (`auto`: live wherever it can work)."""
    asked = str(cfg.fault.get("recovery", "auto"))
    blocker = _live_blocker(cfg)
    if asked == "restart":
        return "restart", "fault.recovery=restart"
    if blocker is None or asked == "live":  # validation refused the other blockers; one replica falls back
        return "live", f"fault.recovery={asked}"
    return "restart", f"fault.recovery=auto: {blocker[1]}"


def _validate_recovery(cfg: DictConfig) -> None:
    recovery = str(cfg.fault.get("recovery", "auto"))
    if recovery not in RECOVERY_MODES:
        raise ConfigError("fault.recovery", f"unknown recovery {recovery!r}; use auto (live where it can "
                          "work, else restart), live (the survivors reshard in memory) or restart (relaunch "
                          "from the last checkpoint).")
    blocker = _live_blocker(cfg)
    if recovery == "live" and blocker is not None and blocker[0] != "mesh.dp":
        key, why = blocker
        raise ConfigError("fault.recovery", f"{why}; change {key} or use fault.recovery=restart (or auto, "
                          "which picks restart here).")


