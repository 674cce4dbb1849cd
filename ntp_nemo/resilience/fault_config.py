"""The `fault` config group, checked before anything starts: the faults to inject, the timeout
hierarchy, the recovery mode (`fault.recovery=auto` picks live wherever it can work) and the policy.
Everything here reads the `FailoverSpec` the entry point built (`ntp_nemo.config.failover`).

Nothing here imports torch or Lightning, so a mistake in the group answers (exit 2) in well under a
second; `faults.FaultInjector`, `detection` and `supervisor` use these values at run time.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ntp_nemo.config.failover import FailoverSpec
from ntp_nemo.config.schema import FaultConfig
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.node_layout import launcher_layout
from ntp_nemo.resilience.integrity_config import validate_integrity_config
from ntp_nemo.resilience.policies import make_policy

FAULT_KINDS = ("kill_rank", "hang", "slow", "kill_during_save", "corrupt_checkpoint", "bitflip",
               "poison_sample")
BITFLIP_TARGETS = ("param", "grad", "activation")
KILL_PHASES = ("step_start", "backward", "optimizer", "validation", "rejoin", "joining", "decided",
               "integrity")


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    steps: int | None = None
    phase: str = "step_start"
    factor: float | None = None  # slow: the rank computes at this speed (in place of `seconds` added)
    target: str = "param"  # bitflip: param | grad | activation
    bit: int = 22  # bitflip: the bit of the element's word flipped
    persistent: bool = False  # bitflip: again on every step from `step` on (a bad device)
    sample: int | None = None  # poison_sample: the training sample id (None: one of step `step`'s)
    draw: int = 0  # bitflip, poison_sample: a seeded number picking the element (or the sample)

    @property
    def once(self) -> bool:
        return self.kind != "slow" and not self.persistent

    def active_at(self, step: int) -> bool:
        """A `slow` fault holds at step `step` (from `step` for `steps` steps; after them the device is
        fine again)."""
        return self.step <= step and (self.steps is None or step < self.step + self.steps)


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
        if kind in ("corrupt_checkpoint", "poison_sample"):  # poison_sample: whichever rank sees it
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
        factor = _slow_factor(key, kind, spec, steps)
        if kind == "slow" and factor is None and seconds <= 0:
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
            Fault(len(out), kind, int(rank), int(step), seconds, None if steps is None else int(steps), phase,
                  factor, **_corruption(key, kind, spec, rng))
        )
    return out


def _corruption(key: str, kind: str, spec: Any, rng: random.Random) -> dict[str, Any]:
    """The `bitflip` and `poison_sample` fields of a fault (defaults for other kinds); ConfigError names the
    key on a bad value or one given to another kind."""
    target = str(getattr(spec, "target", "param") or "param")
    bit, persistent, sample = getattr(spec, "bit", None), bool(getattr(spec, "persistent", False)), \
        getattr(spec, "sample", None)
    for name, value, owner in (("bit", bit, "bitflip"), ("persistent", persistent or None, "bitflip"),
                               ("target", None if target == "param" else target, "bitflip"),
                               ("sample", sample, "poison_sample")):
        if value is not None and kind != owner:
            raise ConfigError(f"{key}.{name}", f"{name} applies to kind {owner} only, not {kind}; drop "
                              f"{key}.{name} (or use {key.split('[')[0]}={owner}).")
    if kind not in ("bitflip", "poison_sample"):
        return {}
    draw = rng.randrange(1 << 30)  # drawn for these kinds only: the other kinds' draws stay as they were
    if kind == "poison_sample":
        if sample is not None and int(sample) < 0:
            raise ConfigError(f"{key}.sample", f"a training sample id is >= 0, got {sample}; leave it unset "
                              "to poison one of the samples of step fault.step (drawn from seed).")
        return {"sample": None if sample is None else int(sample), "draw": draw}
    if target not in BITFLIP_TARGETS:
        raise ConfigError(f"{key}.target", f"unknown bitflip target {target!r}; use param (a weight of the "
                          "rank: found by the replica fingerprint), grad (a gradient element before the "
                          "sync) or activation (an output of the rank's first layer).")
    bit = (22 if target == "param" else 30) if bit is None else int(bit)
    if not 0 <= bit <= 31:
        raise ConfigError(f"{key}.bit", f"the bit flipped in a 32-bit word lies in 0..31 (0-22 mantissa, "
                          f"23-30 exponent, 31 sign; a 16-bit value takes it modulo 16), got {bit}.")
    return {"target": target, "bit": bit, "persistent": persistent, "draw": draw}


def _slow_factor(key: str, kind: str, spec: Any, steps: Any) -> float | None:
    """The speed factor of a `slow` fault (None: the additive form, `seconds` per step); ConfigError on a
    factor outside (0, 1), a factor on another kind, or a `steps` below 1."""
    raw = getattr(spec, "factor", None)
    if kind == "slow" and steps is not None and int(steps) < 1:
        raise ConfigError(f"{key}.steps", f"a slow rank lasts steps >= 1 steps (null: to the end), got "
                          f"{steps}; e.g. {key}.steps=20.")
    if raw is None:
        return None
    if kind != "slow":
        raise ConfigError(f"{key}.factor", f"factor is the speed of a slow rank and applies to kind slow "
                          f"only, not {kind}; drop {key}.factor.")
    factor = float(raw)
    if not 0 < factor < 1:
        raise ConfigError(f"{key}.factor", f"the speed factor of a slow rank must lie in (0, 1) (0.5: its "
                          f"forward and backward take twice their time), got {raw}; for a rank slower by a "
                          f"fixed delay use {key}.seconds instead.")
    return factor


STRAGGLER_POLICIES = ("report", "rebalance", "exclude")
STRAGGLER_SHARDS = ("auto", "on", "off")  # fault.straggler_shards


def validate_straggler_config(f: FaultConfig) -> None:
    """The straggler keys of the `fault` group (`ntp_nemo.resilience.straggler`); ConfigError names the
    key."""
    policy = str(f.straggler)
    if policy not in STRAGGLER_POLICIES:
        raise ConfigError("fault.straggler", f"unknown straggler policy {policy!r}; use report (log it), "
                          "rebalance (give the slow rank's replica a smaller share of the batch, live) or "
                          "exclude (take the slow rank out through failover).")
    if int(f.straggler_every) < 0:
        raise ConfigError("fault.straggler_every", f"must be >= 0 steps between judgements of every rank's "
                          f"speed (0: no straggler detection), got {f.straggler_every}; e.g. 5.")
    if not float(f.straggler_margin) > 0:
        raise ConfigError("fault.straggler_margin", f"must be > 0 (0.3: a rank 30% slower than the work "
                          f"model says for its share is a straggler), got {f.straggler_margin}.")
    if int(f.straggler_persist) < 1:
        raise ConfigError("fault.straggler_persist", f"must be >= 1 judgements in a row before a rank is "
                          f"called a straggler, got {f.straggler_persist}; e.g. 2.")
    if str(getattr(f, "straggler_shards", "auto")) not in STRAGGLER_SHARDS:
        raise ConfigError("fault.straggler_shards", f"unknown value {f.straggler_shards!r}; use auto "
                          "(rebalance weighs the shards inside the straggler's TP group by speed in a "
                          "one-replica job), on (in every job) or off (the batch split only).")
    top = 1 / (1 + float(f.straggler_margin))
    if not 0 <= float(f.straggler_floor) < top:
        raise ConfigError("fault.straggler_floor", f"must lie in [0, 1/(1+fault.straggler_margin)) = "
                          f"[0, {top:.3g}): the speed below which a straggler is excluded rather than "
                          f"rebalanced, got {f.straggler_floor}; e.g. 0.2.")



@dataclass(frozen=True)
class Timeouts:
    """The bounds the supervisor and the workers enforce (docs/failover.md, "Timeout hierarchy")."""

    heartbeat_s: float
    collective_s: float
    step_s: float
    startup_s: float = 600.0

    @classmethod
    def from_config(cls, fault: FaultConfig) -> Timeouts:
        t = cls(
            float(fault.heartbeat_timeout_s), float(fault.collective_timeout_s), float(fault.step_timeout_s),
            float(getattr(fault, "startup_timeout_s", 600.0)),
        )
        if not 0 < t.heartbeat_s < t.collective_s < t.step_s:
            raise ConfigError(
                "fault.heartbeat_timeout_s",
                f"the timeouts must grow heartbeat < collective < "
                f"whole step, got fault.heartbeat_timeout_s={t.heartbeat_s}, "
                f"fault.collective_timeout_s={t.collective_s}, fault.step_timeout_s={t.step_s}; "
                "a hang must be seen by heartbeats before collectives give up (see docs/failover.md).",
            )
        if not t.startup_s > 0:
            raise ConfigError(
                "fault.startup_timeout_s",
                f"must be > 0 seconds (how long a worker may take from its start to its first training "
                f"step), got {t.startup_s}; e.g. fault.startup_timeout_s=600.",
            )
        return t

    @property
    def rejoin_s(self) -> float:
        """How long a repaired process waits for the survivors to take it in: they may legitimately take
        a whole step and a rendezvous to reach the step it joins before."""
        return self.step_s + self.collective_s

    @property
    def stop_grace_s(self) -> float:
        """After a stop signal (SIGTERM, Ctrl-C), how long the workers have to checkpoint and exit before
        they are killed: the rest of a step and a save, each shorter than a heartbeat gap."""
        return 2 * self.heartbeat_s


def validate_fault_config(spec: FailoverSpec, context: LaunchContext | None = None) -> None:
    """Checks of the `fault` group run with the rest of validation (before anything starts).
    `context`: the launcher and coordinator (default: this process's, `LaunchContext.from_env()`)."""
    context = LaunchContext.from_env() if context is None else context
    f = spec.fault
    make_policy(str(f.policy), spec.min_replica_tp)
    Timeouts.from_config(f)
    validate_straggler_config(f)
    _validate_recovery(spec, context)
    if int(f.max_restarts) < 0:
        raise ConfigError("fault.max_restarts", f"must be >= 0, got {f.max_restarts}.")
    if f.repair_after_steps is not None:
        if int(f.repair_after_steps) < 1:
            raise ConfigError(
                "fault.repair_after_steps",
                f"must be >= 1 (steps on the degraded layout before the "
                f"repaired GPU rejoins), got {f.repair_after_steps}.",
            )
        if recovery_mode(spec, context.launcher, context.coordinator)[0] == "restart" \
                and not spec.saves_checkpoints:
            raise ConfigError(
                "fault.repair_after_steps",
                "returning to the repaired layout needs checkpoints; "
                "set checkpoint.every_n_steps>0 or checkpoint.save_on_end=true.",
            )
    validate_spares(spec, context)
    resolve_faults(spec)
    validate_integrity_config(spec.integrity)


def validate_spares(spec: FailoverSpec, context: LaunchContext) -> None:
    """`fault.spares`: a whole number >= 0 of hot spares, which only the live recovery of ntp-train's own
    launcher takes (`resilience/spares.py`)."""
    raw = getattr(spec.fault, "spares", 0)
    whole = isinstance(raw, int) or isinstance(raw, float) and raw.is_integer()
    if isinstance(raw, bool) or not whole:
        raise ConfigError("fault.spares", f"is the number of hot spare processes started with the job and "
                          f"kept waiting to replace a lost one, a whole number >= 0, got {raw!r}; e.g. "
                          "fault.spares=1 (0: none, a replacement is started when it is needed).")
    spares = int(raw)
    if spares < 0:
        raise ConfigError("fault.spares", f"must be >= 0 hot spare processes, got {spares}; e.g. "
                          "fault.spares=1 (0: none, a replacement is started when it is needed).")
    if spares == 0:
        return
    mode, why = recovery_mode(spec, context.launcher, context.coordinator)
    if mode != "live":
        raise ConfigError("fault.spares", f"hot spares replace a lost process during a live recovery, but "
                          f"this run recovers by restart ({why}); use fault.recovery=live (or auto where "
                          "live can work), or set fault.spares=0.")
    if context.launcher is not None:
        cluster = (" with an ntp-coordinator: there the spares are tasks the batch script starts as srun "
                   "steps of their own (train_live.sbatch runs one per GPU on its last node and starts each "
                   "again when it exits), which wait warm for a place (docs/failover.md, \"Hot spares\")"
                   if context.coordinator else ", which starts no spare processes")
        raise ConfigError("fault.spares", f"hot spares are started by ntp-train's own launcher, but the "
                          f"processes of this run are started by {context.launcher}{cluster}; set "
                          "fault.spares=0.")


RECOVERY_MODES = ("auto", "live", "restart")
NCCL_UNVERIFIED = "live recovery on NCCL has not run on a GPU yet (unverified)"
TORCHRUN_RESTARTS = "torchrun stops every local worker when one exits"
NO_COORDINATOR = "no ntp-coordinator (NTP_COORDINATOR unset)"
COORDINATOR_ENV = "NTP_COORDINATOR"


@dataclass(frozen=True)
class LaunchContext:
    """What recovery depends on outside the config: the external launcher that started this process
    (`torchrun`, `slurm`, None when `ntp-train` launches its ranks) and whether an ntp-coordinator
    serves the job (`NTP_COORDINATOR=host:port`, set by the batch script); `global_rank`: the
    launcher's rank of this process (0 when `ntp-train` launches: the one process that prints)."""

    launcher: str | None = None
    coordinator: bool = False
    global_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchContext:
        """Read once by the entry points (validation, the supervisor), never deeper down."""
        env = os.environ if env is None else env
        layout = launcher_layout(env)
        if layout is None:
            return cls(None, bool(env.get(COORDINATOR_ENV)))
        return cls(layout.launcher, bool(env.get(COORDINATOR_ENV)), layout.global_rank)


@dataclass(frozen=True)
class _Blocker:
    key: str
    why: str
    refuses_live: bool = True  # an explicit fault.recovery=live is a config error (else it is accepted)


def _live_blockers(spec: FailoverSpec, launcher: str | None, coordinator: bool) -> list[_Blocker]:
    """Every reason the live path cannot (or is not known to) serve this run, the strongest first."""
    out: list[_Blocker] = []
    if spec.distributed_optimizer:
        out.append(_Blocker("optim.distributed", "live recovery needs every AdamW moment held by every "
                            "replica, but optim.distributed=true keeps each on one rank only"))
    if str(spec.fault.policy) == "restart":
        out.append(_Blocker("fault.policy", "fault.policy=restart replaces the lost GPU with a spare, which "
                            "only a relaunch can do"))
    if launcher == "torchrun":
        out.append(_Blocker("fault.recovery", TORCHRUN_RESTARTS))
    if launcher == "slurm" and not coordinator:
        out.append(_Blocker("fault.recovery", NO_COORDINATOR))
    if spec.accelerator in ("gpu", "cuda"):  # an explicit live is accepted, with a warning (nccl_warning)
        out.append(_Blocker("trainer.accelerator", NCCL_UNVERIFIED, refuses_live=False))
    if spec.dp < 2:  # an explicit live is kept: the survivors find no live copy and fall back, saying so
        out.append(_Blocker("mesh.dp", "with one replica no survivor holds a lost rank's shards",
                            refuses_live=False))
    return out


def recovery_mode(spec: FailoverSpec, launcher: str | None = None, coordinator: bool = False
                  ) -> tuple[str, str]:
    """(`live` or `restart`, why) for `fault.recovery` (`auto`: live wherever it can work).

    `launcher`: `launcher_layout()`'s kind (`torchrun`, `slurm`, None when `ntp-train` launched the
    ranks); `coordinator`: an ntp-coordinator serves the job (SLURM: `auto` picks live only then).  The
    callers fill both from `LaunchContext.from_env()`."""
    asked = str(spec.fault.recovery or "auto")
    if asked == "restart":
        return "restart", "fault.recovery=restart"
    blockers = _live_blockers(spec, launcher, coordinator)
    if asked == "live" or not blockers:  # validation refused the blockers an explicit live cannot pass
        return "live", f"fault.recovery={asked}"
    return "restart", f"fault.recovery=auto: {blockers[0].why}"


def nccl_warning(spec: FailoverSpec) -> str | None:
    """The start-up line (one per job) of an explicit `fault.recovery=live` on GPUs (NCCL), else None."""
    if spec.accelerator not in ("gpu", "cuda") or str(spec.fault.recovery or "auto") != "live":
        return None
    return ("warning: fault.recovery=live on GPUs (NCCL) is unverified: the survivors abort the NCCL "
            "communicators and rebuild their groups, which has never run on a GPU (fault.recovery=auto "
            "picks restart there)")


def _validate_recovery(spec: FailoverSpec, context: LaunchContext) -> None:
    recovery = str(spec.fault.recovery or "auto")
    if recovery not in RECOVERY_MODES:
        raise ConfigError("fault.recovery", f"unknown recovery {recovery!r}; use auto (live where it can "
                          "work, else restart), live (the survivors reshard in memory) or restart (relaunch "
                          "from the last checkpoint).")
    if recovery != "live":
        return
    for b in _live_blockers(spec, context.launcher, context.coordinator):
        if not b.refuses_live:
            continue
        if b.why == TORCHRUN_RESTARTS:
            raise ConfigError("fault.recovery", f"{TORCHRUN_RESTARTS}, so a lost GPU stops its whole node "
                              "and live recovery cannot work under torchrun; use fault.recovery=restart (or "
                              "auto, which picks restart here), or start the workers as srun tasks with an "
                              "ntp-coordinator (see docs/failover.md).")
        if b.why == NO_COORDINATOR:
            raise ConfigError("fault.recovery", f"live recovery under SLURM needs an ntp-coordinator, but "
                              f"there is {NO_COORDINATOR}; start one and export {COORDINATOR_ENV}=host:port "
                              "in the batch script (see docs/failover.md), or use fault.recovery=restart.")
        raise ConfigError("fault.recovery", f"{b.why}; change {b.key} or use fault.recovery=restart (or "
                          "auto, which picks restart here).")
