"""What failover reads from the config, as one plain value built once at the entry point.

The failure injection, its checks, the recovery mode and the supervisor take this value
(`failover_spec(cfg)`), never the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.config.schema import FaultConfig, FaultSpec, IntegrityConfig


@dataclass(frozen=True)
class FailoverSpec:
    """The `fault` group (typed: `schema.FaultConfig`) and the run keys failover depends on."""

    fault: FaultConfig
    min_replica_tp: int  # ntp.min_replica_tp: the smallest replica the ntp policy keeps
    seed: int  # draws the unset rank/step of an injected fault
    max_steps: int
    stop_at_step: int | None
    world_size: int  # ranks of the starting layout
    dp: int  # replicas of the starting layout
    accelerator: str
    distributed_optimizer: bool  # optim.distributed
    checkpoint_every: int  # checkpoint.every_n_steps
    save_on_end: bool
    checkpoint_dir: str
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)  # the `integrity` group

    @property
    def end_step(self) -> int:
        """The last step of this command (trainer.stop_at_step may end it early)."""
        return min(self.max_steps, self.stop_at_step or self.max_steps)

    @property
    def saves_checkpoints(self) -> bool:
        return bool(self.checkpoint_every or self.save_on_end)


def failover_spec(cfg: DictConfig) -> FailoverSpec:
    """Read the failover keys of a composed (validated) config."""
    from ntp_nemo.config.validate import resolved_replica_tp

    fault = OmegaConf.to_object(cfg.fault)
    if not isinstance(fault, FaultConfig):  # a config composed without the typed schema
        fields = dict(fault)
        fields["more"] = [FaultSpec(**m) for m in fields.get("more") or []]
        fault = FaultConfig(**fields)
    stop = cfg.trainer.get("stop_at_step")
    return FailoverSpec(
        fault=fault,
        min_replica_tp=int(cfg.ntp.min_replica_tp),
        seed=int(cfg.seed),
        max_steps=int(cfg.trainer.max_steps),
        stop_at_step=None if stop is None else int(stop),
        world_size=int(cfg.mesh.pp) * sum(resolved_replica_tp(cfg)),
        dp=int(cfg.mesh.dp),
        accelerator=str(cfg.trainer.accelerator),
        distributed_optimizer=bool(cfg.optim.get("distributed", False)),
        checkpoint_every=int(cfg.checkpoint.every_n_steps or 0),
        save_on_end=bool(cfg.checkpoint.save_on_end),
        checkpoint_dir=str(cfg.checkpoint.dir),
        integrity=_integrity(cfg),
    )


def _integrity(cfg: DictConfig) -> IntegrityConfig:
    node = cfg.get("integrity")
    if node is None:
        return IntegrityConfig()
    got = OmegaConf.to_object(node)
    return got if isinstance(got, IntegrityConfig) else IntegrityConfig(**dict(got))


__all__ = ["FailoverSpec", "failover_spec"]
