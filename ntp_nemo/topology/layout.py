"""ResolvedLayout: the one plain value a run's process layout is resolved into before launch.

The config layer (`ntp_nemo.config.layout.resolve_layout`) turns the mesh, NTP and layout keys into
this value once: per replica its active TP ranks, per layout slot the TP degree, per pipeline stage
its layers, the schedule, the batch shares and (optionally) the device of every global rank.  The
strategy, the runtime, the dry run and failover re-planning all take it; nothing below the config
layer re-reads the config.  It is frozen, hashable and JSON-serialisable (`to_dict`/`from_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from ntp_nemo.data.rebalance import assign_microbatches
from ntp_nemo.topology.topology import Topology
from ntp_nemo.topology.work import WorkShape, modelled_capacities

PowerBoost = float | tuple[float, ...] | None

CAPACITY_RULES = ("ranks", "work")  # ntp.capacity: how a replica's share of the batch is weighed


def _rule_capacities(rule: str, work: WorkShape | None, topo: Topology, boost: PowerBoost) -> list[float]:
    if rule == "work" and work is not None:
        return modelled_capacities(work, topo, boost)
    return topo.capacities(boost)


def _boost(value: Any) -> PowerBoost:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class ResolvedLayout:
    """Who runs what.  Sequences are tuples; derived values are methods or filled by `make`.

    - `tp`: nominal (healthy) TP degree; `replica_tp`: active TP ranks per DP replica.
    - `layer_tp`: requested degree per layout slot (embedding, each transformer layer, head).
    - `pp`, `stage_layers`: pipeline stages per replica and transformer layers per stage.
    - `schedule`: pipeline schedule (gpipe | 1f1b); `power_boost`: NTP-PW capacity multiplier(s).
    - `nominal_replicas`: replicas the job was planned with (capacity is counted against them).
    - `num_microbatches`: micro-batches per global batch; `microbatches`: per-replica share of them.
    - `devices`: device string per global rank ("cuda:3", "cpu"), or None: each worker's default.
    - `sequence_parallel`: the TP-replicated regions hold each rank's slice of the sequence.
    - `shard_align`: elements per block of MLP-column and vocabulary-row splits (`ntp.shard_align`).
    - `work`: the model and sequence shape the per-rank work model reads (`ntp_nemo.topology.work`);
      the dry run reports each rank's modelled work whenever it is set.
    - `capacity`: the capacity rule of the batch split (`ntp.capacity`): `ranks`, active ranks over
      nominal; `work`, a healthy replica's modelled slowest-rank time over this replica's (needs
      `work`; a layout without it falls back to `ranks`).  Both times the power boost.
    """

    tp: int
    replica_tp: tuple[int, ...]
    layer_tp: tuple[int, ...]
    pp: int = 1
    stage_layers: tuple[int, ...] = ()
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline stage (schedule interleaved_1f1b)
    power_boost: PowerBoost = None
    nominal_replicas: int | None = None
    num_microbatches: int = 0
    microbatches: tuple[int, ...] = ()
    devices: tuple[str, ...] | None = field(default=None)
    sequence_parallel: bool = False
    shard_align: int = 1
    work: WorkShape | None = None
    capacity: str = "ranks"

    @classmethod
    def make(
        cls,
        tp: int,
        replica_tp: Sequence[int],
        layer_tp: Sequence[int],
        pp: int = 1,
        stage_layers: Sequence[int] | None = None,
        schedule: str = "1f1b",
        power_boost: Any = None,
        nominal_replicas: int | None = None,
        num_microbatches: int | None = None,
        devices: Sequence[str] | None = None,
        virtual_stages: int = 1,
        sequence_parallel: bool = False,
        shard_align: int = 1,
        work: WorkShape | Mapping | None = None,
        capacity: str = "ranks",
    ) -> ResolvedLayout:
        """Normalise the inputs and fill the derived fields (stage split, batch shares); checks that
        the parts agree (a ValueError names the mismatch)."""
        layer_tp = tuple(int(x) for x in layer_tp)
        replica_tp = tuple(int(x) for x in replica_tp)
        topo = Topology(int(tp), replica_tp, layer_tp, int(pp), list(stage_layers) if stage_layers else None,
                        int(shard_align))
        boost = _boost(power_boost)
        m = len(replica_tp) if num_microbatches is None else int(num_microbatches)
        work = WorkShape.of(work)
        capacity = str(capacity)
        if capacity not in CAPACITY_RULES:
            raise ValueError(f"capacity rule {capacity!r}: expected one of {', '.join(CAPACITY_RULES)}")
        caps = _rule_capacities(capacity, work, topo, boost)
        layout = cls(
            tp=int(tp),
            replica_tp=replica_tp,
            layer_tp=layer_tp,
            pp=int(pp),
            stage_layers=tuple(topo.stage_layers),
            schedule=str(schedule),
            virtual_stages=int(virtual_stages),
            power_boost=boost,
            nominal_replicas=None if nominal_replicas is None else int(nominal_replicas),
            num_microbatches=m,
            microbatches=tuple(assign_microbatches(m, caps)),
            devices=None if devices is None else tuple(str(d) for d in devices),
            sequence_parallel=bool(sequence_parallel),
            shard_align=int(shard_align),
            work=work,
            capacity=capacity,
        )
        if layout.devices is not None and len(layout.devices) != layout.world_size:
            raise ValueError(f"{len(layout.devices)} devices for a layout of {layout.world_size} ranks")
        return layout

    @classmethod
    def of_topology(
        cls,
        topology: Topology,
        schedule: str = "1f1b",
        power_boost: Any = None,
        nominal_replicas: int | None = None,
        num_microbatches: int | None = None,
        virtual_stages: int = 1,
        sequence_parallel: bool = False,
        work: WorkShape | None = None,
        capacity: str = "ranks",
    ) -> ResolvedLayout:
        """The layout of an existing Topology (tests and benchmarks that build one directly; live recovery
        passes the run's `work` and `capacity` so the batch split stays the one every rank computes)."""
        t = topology
        return cls.make(t.tp, t.replica_tp, t.layer_tp, t.pp, t.stage_layers, schedule, power_boost,
                        nominal_replicas, num_microbatches, virtual_stages=virtual_stages,
                        sequence_parallel=sequence_parallel, shard_align=t.shard_align, work=work,
                        capacity=capacity)

    # ---- derived --------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return len(self.replica_tp)

    @property
    def world_size(self) -> int:
        return self.pp * sum(self.replica_tp)

    @property
    def num_layers(self) -> int:
        return len(self.layer_tp) - 2

    def topology(self) -> Topology:
        """A fresh Topology (it owns process groups, so each runtime builds its own)."""
        return Topology(self.tp, self.replica_tp, self.layer_tp, self.pp, self.stage_layers, self.shard_align)

    @cached_property
    def _capacities(self) -> tuple[float, ...]:
        return tuple(_rule_capacities(self.capacity, self.work, self.topology(), self.power_boost))

    def capacities(self) -> list[float]:
        """Per-replica share of work under the layout's `capacity` rule: active ranks / nominal TP
        (`ranks`) or a healthy replica's modelled slowest-rank time over this one's (`work`, with `work`
        set), times the power boost of degraded ones."""
        return list(self._capacities)

    def microbatch_counts(self, num_microbatches: int | None = None) -> list[int]:
        """Per-replica share of `num_microbatches` (default: the global batch's)."""
        if num_microbatches is None or num_microbatches == self.num_microbatches:
            return list(self.microbatches)
        return assign_microbatches(num_microbatches, self.capacities())

    def capacity_fraction(self) -> float:
        return sum(self.replica_tp) / (self.tp * max(self.dp, self.nominal_replicas or 0))

    def device_of(self, rank: int) -> str | None:
        return None if self.devices is None else self.devices[rank]

    def describe(self) -> str:
        return "(" + ",".join(map(str, self.replica_tp)) + ")" + (f"xPP{self.pp}" if self.pp > 1 else "")

    # ---- changes and serialisation -----------------------------------------------------------------
    def with_changes(self, **changes: Any) -> ResolvedLayout:
        """A new layout with some inputs changed and the derived fields recomputed (re-planning)."""
        base = {k: v for k, v in asdict(self).items() if k != "microbatches"}
        if "replica_tp" in changes and "devices" not in changes:
            base["devices"] = None  # the old per-rank devices do not fit the new rank count
        if "pp" in changes and "stage_layers" not in changes:
            base["stage_layers"] = None
        base.update(changes)
        return ResolvedLayout.make(**base)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedLayout:
        fields = {k: v for k, v in data.items() if k != "microbatches"}
        return cls.make(**fields)


__all__ = ["CAPACITY_RULES", "PowerBoost", "ResolvedLayout"]
