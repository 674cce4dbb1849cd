"""Topology: global ranks -> (replica, stage, tp slot), per-layer TP degrees and process groups.

Built once from the mesh and layout config and passed explicitly; there is no global parallel
state.  Unlike a uniform `dp x pp x tp` mesh, replicas may hold different numbers of active TP
ranks (`replica_tp`), so the world size is `pp * sum(replica_tp)` and the groups are a registry of
rank tuples rather than the axes of a grid.

`shard_speeds` (one per global rank, or None) weighs the shards inside every TP group: a rank's
interval of a layer's units is in proportion to its speed among its group's (`shard.shard_interval`);
`group_weights` hands each layer's context its group's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ntp_nemo.topology.tp_context import TPContext


@dataclass(frozen=True)
class RankCoord:
    rank: int
    replica: int
    stage: int
    slot: int


def effective_degree(requested: int, active: int) -> int:
    """Degree a layer takes in a replica of `active` ranks: `requested` if it divides, else the
    largest divisor of `active` not above it."""
    if active % requested == 0:
        return requested
    return max(d for d in range(1, min(requested, active) + 1) if active % d == 0)


def even_stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per stage in balanced contiguous intervals (the fallback when no partition is given)."""
    return [(s + 1) * num_layers // pp - s * num_layers // pp for s in range(pp)]


class Topology:
    def __init__(
        self,
        tp: int,
        replica_tp: Sequence[int],
        layer_tp: Sequence[int],
        pp: int = 1,
        stage_layers: Sequence[int] | None = None,
        shard_align: int = 1,
        shard_speeds: Sequence[float] | None = None,
    ) -> None:
        self.tp = tp
        self.shard_align = int(shard_align)  # elements per block of MLP-column / vocabulary-row splits
        self.replica_tp = list(replica_tp)
        self.layer_tp = list(layer_tp)
        self.num_layers = len(self.layer_tp) - 2
        self.pp = pp
        self.stage_layers = list(stage_layers) if stage_layers else even_stage_layers(self.num_layers, pp)
        if len(self.stage_layers) != pp or sum(self.stage_layers) != self.num_layers:
            raise ValueError(
                f"stage_layers {self.stage_layers} do not split {self.num_layers} layers into {pp} stages"
            )
        self.coords: list[RankCoord] = []
        self._base: list[int] = []
        for r, n in enumerate(self.replica_tp):
            self._base.append(len(self.coords))
            for s in range(pp):
                for j in range(n):
                    self.coords.append(RankCoord(len(self.coords), r, s, j))
        self._groups: dict[tuple[int, ...], Any] = {}
        self.shard_speeds = None if shard_speeds is None else tuple(float(v) for v in shard_speeds)
        if self.shard_speeds is not None and len(self.shard_speeds) != self.world_size:
            raise ValueError(f"{len(self.shard_speeds)} shard speeds for a layout of {self.world_size} ranks")

    # ---- coordinates -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.coords)

    @property
    def dp(self) -> int:
        return len(self.replica_tp)

    def coord(self, rank: int) -> RankCoord:
        return self.coords[rank]

    def stage_ranks(self, replica: int, stage: int = 0) -> list[int]:
        n = self.replica_tp[replica]
        start = self._base[replica] + stage * n
        return list(range(start, start + n))

    def stage_layer_range(self, stage: int) -> range:
        """Global indices of the transformer layers held by pipeline stage `stage`."""
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])

    def pipeline_peer(self, rank: int, step: int) -> int | None:
        """Rank of stage `stage + step` exchanging activations with `rank` (slot j -> j mod n), or None."""
        c = self.coord(rank)
        stage = c.stage + step
        if not 0 <= stage < self.pp:
            return None
        ranks = self.stage_ranks(c.replica, stage)
        return ranks[c.slot % len(ranks)]

    def degree(self, replica: int, slot: int) -> int:
        """Effective TP degree of layout slot `slot` (0 = embedding, L+1 = head) in `replica`."""
        return effective_degree(self.layer_tp[slot], self.replica_tp[replica])

    def layer_group_ranks(self, rank: int, slot: int) -> tuple[int, ...]:
        c = self.coord(rank)
        t = self.degree(c.replica, slot)
        ranks = self.stage_ranks(c.replica, c.stage)
        k = c.slot // t
        return tuple(ranks[k * t : (k + 1) * t])

    def group_weights(self, ranks: Sequence[int]) -> tuple[float, ...] | None:
        """The shard weights of the TP group `ranks` (their `shard_speeds`): None where none are set or
        the group's are all equal (the balanced intervals, which equal weights give anyway)."""
        if self.shard_speeds is None or len(ranks) < 2:
            return None
        w = tuple(self.shard_speeds[r] for r in ranks)
        return None if len(set(w)) == 1 else w

    # ---- process groups ----------------------------------------------------------------------
    def share_groups(self, other: Topology) -> Topology:
        """Use `other`'s process groups (the same ranks: a re-layout of the shards inside the running
        job); `build_groups` then makes only the groups `other` lacks.  Returns self."""
        if (self.replica_tp, self.pp) != (other.replica_tp, other.pp):
            raise ValueError("process groups are shared between topologies of the same ranks only")
        self._groups = other._groups
        return self

    def shares_groups(self, other: Topology) -> bool:
        return self._groups is other._groups

    def tp_group_tuples(self) -> list[tuple[int, ...]]:
        """Every per-layer TP subgroup of size > 1, deterministic order (all ranks create them alike)."""
        seen: set[tuple[int, ...]] = set()
        for replica in range(self.dp):  # a stage's ranks in chunks of each degree its slots take
            degrees = {self.degree(replica, slot) for slot in range(len(self.layer_tp))}
            for stage in range(self.pp):
                ranks = self.stage_ranks(replica, stage)
                for t in degrees:
                    seen.update(tuple(ranks[k * t : (k + 1) * t]) for k in range((len(ranks) - 1) // t + 1))
        return sorted(g for g in seen if len(g) > 1)

    def build_groups(self, extra: Sequence[tuple[int, ...]] = (), new_group: Callable | None = None,
                     device: Any = "cpu") -> None:
        """Create every process group this topology and `extra` (e.g. DP fragment holder sets) need.

        Collective: all ranks call it with the same arguments, in the same order.  They carry tensors
        only: no gloo side on a GPU world; the TP groups of a CPU world whose ranks compute on `device`
        "cpu" take the `ntpdirect` backend (`ntp_nemo.topology.groups.tp_backend`).
        """
        tp = set(self.tp_group_tuples())
        make_tp = new_group
        if new_group is None:
            from functools import partial

            from ntp_nemo.topology.groups import new_subgroup, new_tp_group

            new_group, make_tp = new_subgroup, partial(new_tp_group, device=device)
        for ranks in sorted(tp | {tuple(e) for e in extra if len(e) > 1}):
            if ranks not in self._groups:
                self._groups[ranks] = (make_tp if ranks in tp else new_group)(list(ranks))

    def tp_groups_of(self, rank: int) -> list[Any]:
        """The process groups made for the TP subgroups that hold `rank` (those `build_groups` created)."""
        return [self._groups[g] for g in self.tp_group_tuples() if rank in g and g in self._groups]

    def group(self, ranks: Sequence[int]) -> Any:
        ranks = tuple(ranks)
        if len(ranks) <= 1:
            return None
        if ranks == tuple(range(self.world_size)):
            from ntp_nemo.topology.direct_group import DirectGroup

            made = self._groups.get(ranks)
            if not isinstance(made, DirectGroup):  # a CPU TP group of the whole world keeps ntpdirect's
                import torch.distributed as dist

                return dist.group.WORLD
        return self._groups[ranks]

    def plan_for(self, rank: int) -> RankPlan:
        return RankPlan(self, rank)

    # ---- reporting ---------------------------------------------------------------------------
    def units_held(self, rank: int, slot: int, units: int, align: int = 1) -> tuple[int, int]:
        from ntp_nemo.topology.shard import shard_interval

        g = self.layer_group_ranks(rank, slot)
        return shard_interval(g.index(rank), len(g), units, align, self.group_weights(g))


class RankPlan:
    """One rank's view of the layout: the TPContext of every layout slot (implements TPPlan)."""

    def __init__(self, topology: Topology, rank: int) -> None:
        self.topology = topology
        self.rank = rank

    def context(self, slot: int) -> TPContext:
        topo = self.topology
        ranks = topo.layer_group_ranks(self.rank, slot)
        n = topo.replica_tp[topo.coord(self.rank).replica]
        return TPContext(
            size=len(ranks), rank=ranks.index(self.rank), group=topo.group(ranks), copies=n // len(ranks),
            align=topo.shard_align, weights=topo.group_weights(ranks),
        )
