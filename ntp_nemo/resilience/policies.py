"""Re-planning after lost ranks: small composable rules, combined into named policies.

A rule maps the per-replica sizes (active TP ranks; 0 = dropped) and the ranks each replica lost to
new sizes.  Policies are chains of rules, read in the style of nvidia-resiliency-ext's rank
assignment:

- `ntp`:     ShrinkToSurvivors → DropBelow(ntp.min_replica_tp): the replica that lost ranks keeps
             training on its survivors at a reduced TP degree; one left too small is dropped.
- `dp_drop`: DropDamaged: any replica that lost a rank leaves the job (plain DP's answer).
- `restart`: ReplaceLost: a spare takes the lost GPU's place; the layout is unchanged.

`replan` applies a policy to a `ResolvedLayout` and the failed global ranks and returns the new one with
the assignment of surviving ranks to new ranks, which drives both the local supervisor and a
torchrun/SLURM relaunch (`python -m ntp_nemo.resilience.replan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ntp_nemo.errors import ConfigError
from ntp_nemo.topology.layout import ResolvedLayout


class Rule(Protocol):
    def __call__(self, sizes: list[int], lost: Sequence[int]) -> list[int]: ...


@dataclass(frozen=True)
class ShrinkToSurvivors:
    """A replica continues with the ranks it has left (NTP)."""

    def __call__(self, sizes: list[int], lost: Sequence[int]) -> list[int]:
        return [max(0, n - k) for n, k in zip(sizes, lost, strict=True)]


@dataclass(frozen=True)
class DropBelow:
    """A replica left with fewer than `min_tp` ranks is dropped."""

    min_tp: int

    def __call__(self, sizes: list[int], lost: Sequence[int]) -> list[int]:
        return [n if n >= self.min_tp else 0 for n in sizes]


@dataclass(frozen=True)
class DropDamaged:
    """Any replica that lost a rank is dropped whole (DP-DROP)."""

    def __call__(self, sizes: list[int], lost: Sequence[int]) -> list[int]:
        return [0 if k else n for n, k in zip(sizes, lost, strict=True)]


@dataclass(frozen=True)
class ReplaceLost:
    """Spares replace the lost GPUs: every replica keeps its size (restart on the old layout)."""

    def __call__(self, sizes: list[int], lost: Sequence[int]) -> list[int]:
        return list(sizes)


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...]

    def sizes(self, layout: ResolvedLayout, failed: Sequence[int]) -> list[int]:
        lost = layout.lost_per_replica(failed)
        sizes = list(layout.replica_tp)
        for rule in self.rules:
            sizes = rule(sizes, lost)
        return sizes


POLICY_NAMES = ("ntp", "dp_drop", "restart")


def make_policy(name: str, min_replica_tp: int = 1) -> Policy:
    """The named policy; `min_replica_tp` is the smallest replica NTP keeps."""
    if name == "ntp":
        return Policy(name, (ShrinkToSurvivors(), DropBelow(max(1, min_replica_tp))))
    if name == "dp_drop":
        return Policy(name, (DropDamaged(),))
    if name == "restart":
        return Policy(name, (ReplaceLost(),))
    raise ConfigError(
        "fault.policy",
        f"unknown failover policy {name!r}; use one of {', '.join(POLICY_NAMES)} (e.g. fault.policy=ntp).",
    )


@dataclass(frozen=True)
class Replan:
    """The layout after a failure and where its ranks come from.

    `kept` lists the old replica index of each new replica; `assignment[new_rank]` is the old global
    rank whose device the new rank uses (under `restart` a lost rank's place is taken by a spare,
    listed in `replaced`)."""

    policy: str
    old: ResolvedLayout
    new: ResolvedLayout
    failed: tuple[int, ...]
    kept: tuple[int, ...]
    assignment: tuple[int, ...]
    replaced: tuple[int, ...]

    @property
    def dropped(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.old.replica_tp)) if i not in self.kept)

    def overrides(self) -> list[str]:
        """ntp-train overrides selecting the new layout."""
        return [
            f"mesh.dp={len(self.new.replica_tp)}",
            "ntp.replica_tp=[" + ",".join(str(n) for n in self.new.replica_tp) + "]",
        ]

    def describe(self) -> str:
        return f"policy {self.policy}: layout {self.old.describe()} -> {self.new.describe()}"


def replan(layout: ResolvedLayout, failed: Sequence[int], policy: Policy) -> Replan:
    """New layout after losing the global ranks `failed` (`ResolvedLayout.shrunk`: every option of the
    old one carries over); raises RuntimeError when no replica survives."""
    bad = sorted(set(int(r) for r in failed))
    for r in bad:
        if not 0 <= r < layout.world_size:
            raise ConfigError(
                "failed",
                f"rank {r} is not in layout {layout.describe()} (ranks 0.."
                f"{layout.world_size - 1}); give global ranks of the layout that ran.",
            )
    sizes = policy.sizes(layout, bad)
    kept = tuple(i for i, n in enumerate(sizes) if n > 0)
    if not kept:
        raise RuntimeError(
            f"{policy.name}: no replica of {layout.describe()} survives the loss of ranks {bad}"
        )
    assignment: list[int] = []
    replaced: list[int] = []
    for i in kept:
        n = sizes[i]
        for stage in layout.ranks_of(i):
            if policy.name == "restart":
                assignment += stage
                replaced += [r for r in stage if r in bad]
            else:
                assignment += [r for r in stage if r not in bad][:n]
    new = layout.shrunk(sizes)
    return Replan(policy.name, layout, new, tuple(bad), kept, tuple(assignment), tuple(replaced))
