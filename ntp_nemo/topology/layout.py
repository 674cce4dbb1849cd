"""ResolvedLayout: the one plain value a run's process layout is resolved into before launch.

The config layer (`ntp_nemo.config.resolve_layout.resolve_layout`) turns the mesh, NTP and layout keys into
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
from ntp_nemo.topology.grid import ROW_COLUMN, slot_patterns
from ntp_nemo.topology.topology import Topology
from ntp_nemo.topology.work import WorkShape, modelled_capacities

PowerBoost = float | tuple[float, ...] | None
# Topology's own arguments
_TOPOLOGY_FIELDS = ("tp", "replica_tp", "layer_tp", "pp", "stage_layers", "shard_align", "shard_speeds")


def replica_capacities(tp: int, replica_tp: Sequence[int], power_boost: PowerBoost) -> list[float]:
    """Per-replica share of work: active ranks / nominal TP, times the power boost of degraded ones."""
    caps = []
    for r, n in enumerate(replica_tp):
        boost = 1.0
        if power_boost is not None and n < tp:
            boost = power_boost[r] if isinstance(power_boost, Sequence) else float(power_boost)
        caps.append(min(1.0, n / tp * boost))
    return caps


CAPACITY_RULES = ("ranks", "work")  # ntp.capacity: how a replica's share of the batch is weighed
CPU_TP_BACKENDS = ("ntpdirect", "gloo")  # ntp.cpu_tp_backend: the TP groups of a CPU world (topology.groups)


def _rule_capacities(rule: str, work: WorkShape | None, topo: Topology, boost: PowerBoost) -> list[float]:
    """The capacities of balanced shards (weighted shards are the measured speeds' business: `speeds`)."""
    if rule == "work" and work is not None:
        if topo.shard_speeds is not None:
            topo = Topology(topo.tp, topo.replica_tp, topo.layer_tp, topo.pp, topo.stage_layers,
                            topo.shard_align)
        return modelled_capacities(work, topo, boost)
    return replica_capacities(topo.tp, topo.replica_tp, boost)


def _patterns(pattern: Sequence[str] | str, slots: int) -> tuple[str, ...]:
    """Per-slot patterns, stored empty where every slot is row/column (the layouts before patterns)."""
    out = slot_patterns(pattern, slots)
    return () if all(p == ROW_COLUMN for p in out) else out


def _with_speeds(caps: list[float], speeds: Sequence[float] | None) -> list[float]:
    return caps if speeds is None else [c * v for c, v in zip(caps, speeds, strict=True)]


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
    - `pattern`: per layout slot, its sharding pattern (`ntp.pattern`: `row_column`, or `block` on a
      q x q grid where the slot's degree is a square, `ntp_nemo.topology.grid`); empty: row/column.
    - `speeds`: per replica, the measured speed of its slowest rank (1: as fast as the work model says;
      `ntp_nemo.resilience.straggler`), multiplying its capacity; None: every replica at full speed.
    - `shard_speeds`: per global rank, its measured speed, weighing its shards inside each of its TP groups
      (`Topology.shard_speeds`, `shard.shard_interval`: contiguous intervals in proportion); None: balanced.
      Not with a block pattern (its grid splits stay balanced).
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
    speeds: tuple[float, ...] | None = None
    pattern: tuple[str, ...] = ()
    shard_speeds: tuple[float, ...] | None = None

    @classmethod
    def make(
        cls,
        topology: Topology,
        schedule: str = "1f1b",
        power_boost: Any = None,
        nominal_replicas: int | None = None,
        num_microbatches: int | None = None,
        devices: Sequence[str] | None = None,
        virtual_stages: int = 1,
        sequence_parallel: bool = False,
        work: WorkShape | Mapping | None = None,
        capacity: str = "ranks",
        speeds: Sequence[float] | None = None,
        pattern: Sequence[str] | str = (),
    ) -> ResolvedLayout:
        """The layout of `topology` (nominal TP, replicas, per-slot degrees, stage split, shard alignment:
        the Topology checks that they agree) with the run's options; fills the batch shares.  A
        ValueError names a mismatch."""
        t = topo = topology
        replica_tp = tuple(int(x) for x in t.replica_tp)
        boost = _boost(power_boost)
        m = len(replica_tp) if num_microbatches is None else int(num_microbatches)
        work = WorkShape.of(work)
        capacity = str(capacity)
        if capacity not in CAPACITY_RULES:
            raise ValueError(f"capacity rule {capacity!r}: expected one of {', '.join(CAPACITY_RULES)}")
        speeds = None if speeds is None else tuple(float(v) for v in speeds)
        if speeds is not None and (len(speeds) != len(replica_tp) or not all(0 < v <= 1 for v in speeds)):
            raise ValueError(f"speeds {list(speeds)}: expected one speed in (0, 1] per replica "
                             f"({len(replica_tp)})")
        caps = _with_speeds(_rule_capacities(capacity, work, topo, boost), speeds)
        shard_speeds = getattr(t, "shard_speeds", None)
        if shard_speeds is not None and not all(0 < v <= 1 for v in shard_speeds):
            raise ValueError(f"shard speeds {list(shard_speeds)}: expected speeds in (0, 1]")
        layout = cls(
            tp=int(t.tp),
            replica_tp=replica_tp,
            layer_tp=tuple(int(x) for x in t.layer_tp),
            pp=int(t.pp),
            stage_layers=tuple(int(x) for x in t.stage_layers),
            schedule=str(schedule),
            virtual_stages=int(virtual_stages),
            power_boost=boost,
            nominal_replicas=None if nominal_replicas is None else int(nominal_replicas),
            num_microbatches=m,
            microbatches=tuple(assign_microbatches(m, caps)),
            devices=None if devices is None else tuple(str(d) for d in devices),
            sequence_parallel=bool(sequence_parallel),
            shard_align=int(t.shard_align),
            work=work,
            capacity=capacity,
            speeds=speeds,
            pattern=_patterns(pattern, len(t.layer_tp)),
            shard_speeds=shard_speeds,
        )
        if layout.shard_speeds is not None and layout.pattern:
            raise ValueError("shard speeds weigh row/column shards only: the block pattern's grid splits "
                             f"stay balanced (pattern {list(layout.pattern)})")
        if layout.devices is not None and len(layout.devices) != layout.world_size:
            raise ValueError(f"{len(layout.devices)} devices for a layout of {layout.world_size} ranks")
        return layout

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
        return Topology(self.tp, self.replica_tp, self.layer_tp, self.pp, self.stage_layers, self.shard_align,
                        self.shard_speeds)

    @cached_property
    def _capacities(self) -> tuple[float, ...]:
        return tuple(_with_speeds(_rule_capacities(self.capacity, self.work, self.topology(),
                                                   self.power_boost), self.speeds))

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

    def ranks_of(self, replica: int) -> list[list[int]]:
        """Global ranks of `replica`, one list per pipeline stage (ranks are replica-major, then stage,
        then TP slot, as in `Topology`)."""
        base = self.pp * sum(self.replica_tp[:replica])
        n = self.replica_tp[replica]
        return [list(range(base + s * n, base + (s + 1) * n)) for s in range(self.pp)]

    def replica_of(self, rank: int) -> int:
        for i in range(self.dp):
            if any(rank in stage for stage in self.ranks_of(i)):
                return i
        raise ValueError(f"rank {rank} is not in layout {self.describe()}")

    def lost_per_replica(self, failed: Sequence[int]) -> list[int]:
        """TP ranks each replica loses: the most any of its stages lost (all stages run at one degree)."""
        bad = set(failed)
        return [max(sum(r in bad for r in stage) for stage in self.ranks_of(i)) for i in range(self.dp)]

    def same_ranks(self, other: ResolvedLayout) -> bool:
        """Every global rank has the same place and TP groups in both layouts (saved RNG states carry over);
        its shards are the same too unless the shard weights differ (`same_shards`)."""
        return (self.tp, self.replica_tp, self.layer_tp, self.pp, self.pattern) == (
            other.tp, other.replica_tp, other.layer_tp, other.pp, other.pattern)

    def same_shards(self, other: ResolvedLayout) -> bool:
        """Every global rank holds the same shards in both layouts (a batch split may differ)."""
        return self.same_ranks(other) and self.shard_speeds == other.shard_speeds

    def table(self, num_heads: int, ffn_hidden: int, vocab: int) -> str:
        """Readable layout: rank -> replica, stage, slot, and the units held per layer kind."""
        from rich.console import Console
        from rich.table import Table

        topo = self.topology()
        tbl = Table(title=f"NTP layout {self.describe()} (nominal TP {self.tp}, world {self.world_size})")
        for col in ("rank", "replica", "stage", "slot", "replica TP", "vocab rows", "heads (1st layer)",
                    "ffn cols (1st layer)", "layer degrees"):
            tbl.add_column(col)
        for c in topo.coords:
            degs = sorted({topo.degree(c.replica, s) for s in range(len(self.layer_tp))})
            v = topo.units_held(c.rank, 0, vocab, self.shard_align)
            first = topo.stage_layer_range(c.stage).start + 1  # first transformer layer of this rank's stage
            h = topo.units_held(c.rank, first, num_heads)
            f = topo.units_held(c.rank, first, ffn_hidden, self.shard_align)
            tbl.add_row(str(c.rank), str(c.replica), str(c.stage), str(c.slot),
                        str(self.replica_tp[c.replica]), f"[{v[0]},{v[1]})", f"[{h[0]},{h[1]})",
                        f"[{f[0]},{f[1]})", ",".join(map(str, degs)))
        console = Console(width=140, record=True, force_terminal=False)
        with console.capture() as cap:
            console.print(tbl)
        return cap.get()

    # ---- changes and serialisation -----------------------------------------------------------------
    def with_changes(self, **changes: Any) -> ResolvedLayout:
        """A new layout with some inputs changed and the derived fields recomputed (re-planning)."""
        base = {k: v for k, v in asdict(self).items() if k != "microbatches"}
        if "replica_tp" in changes and "devices" not in changes:
            base["devices"] = None  # the old per-rank devices do not fit the new rank count
        if ("replica_tp" in changes or "pp" in changes) and "shard_speeds" not in changes:
            base["shard_speeds"] = None  # per-rank speeds of other ranks: the new layout starts balanced
        if "pp" in changes and "stage_layers" not in changes:
            base["stage_layers"] = None
        base.update(changes)
        return ResolvedLayout.from_dict(base)

    def shrunk(self, sizes: Sequence[int]) -> ResolvedLayout:
        """Re-planning's result: replica `i` keeps `sizes[i]` active ranks (0: dropped).  Every other
        option carries over (per-layer degrees, schedule, virtual stages, stage split, sequence parallelism,
        shard alignment, the work shape and capacity rule); per-replica power
        boosts follow their replicas; capacity is still counted against the replicas the job was planned
        with.  Unchanged sizes give this very layout."""
        if len(sizes) != self.dp:
            raise ValueError(f"{len(sizes)} replica sizes for a layout of {self.dp} replicas")
        if tuple(sizes) == self.replica_tp:
            return self
        kept = [i for i, n in enumerate(sizes) if n > 0]
        pb = self.power_boost
        return self.with_changes(
            replica_tp=tuple(int(sizes[i]) for i in kept),
            power_boost=tuple(pb[i] for i in kept) if isinstance(pb, tuple) else pb,
            speeds=None if self.speeds is None else tuple(self.speeds[i] for i in kept),
            nominal_replicas=self.nominal_replicas or self.dp,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedLayout:
        """The inverse of `to_dict`; also reads the four keys (tp, replica_tp, layer_tp, pp) that
        checkpoints written before `to_dict` was stored hold."""
        fields = {k: v for k, v in data.items() if k != "microbatches"}
        placement = {k: fields.pop(k) for k in _TOPOLOGY_FIELDS if k in fields}
        return cls.make(Topology(**placement), **fields)

    @classmethod
    def from_checkpoint(cls, recorded: Any) -> ResolvedLayout | None:
        """The layout a checkpoint recorded (its `to_dict`), or None where it recorded none or one this
        version cannot read (a checkpoint written outside a run, e.g. by a Hugging Face import)."""
        if not isinstance(recorded, Mapping) or "replica_tp" not in recorded:
            return None
        try:
            return cls.from_dict(recorded)
        except (TypeError, ValueError):
            return None


__all__ = ["CAPACITY_RULES", "PowerBoost", "ResolvedLayout", "replica_capacities"]
