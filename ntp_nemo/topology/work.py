"""The per-rank work model: what each rank of a layout computes and sends per token, and the capacities
that follow from it.

A replica runs at the pace of its slowest rank, and a data-parallel step waits for the slowest replica.
Counting active ranks (`7/8` for a TP-7 replica) assumes every survivor does `8/7` of a healthy rank's
work; with whole units (attention heads, vocabulary rows, FFN columns) split as balanced contiguous
intervals, shared grouped-query KV heads and per-layer degrees, the busiest rank can do more.  This
module counts, per rank, the matmul FLOPs of its parameter slices, the attention-score FLOPs of its
query heads and the bytes of its TP all-reduces (one number: FLOPs plus bytes times the device's FLOPs
per link byte), and turns each replica's slowest rank into its capacity.  The batch split
(`ResolvedLayout`), the planner and the simulator all read it, so they agree on who the straggler is.
Shards weighted by measured speed (`Topology.shard_speeds`) are counted as the model splits them
(`shard.shard_interval`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ntp_nemo.topology.shard import shard_interval
from ntp_nemo.topology.topology import Topology

# Device FLOP/s over the TP link's bytes/s: the planner's default device (bf16 H100, 989 TFLOP/s dense at
# 45% efficiency) over its 450 GB/s NVLink.
FLOPS_PER_LINK_BYTE = 989e12 * 0.45 / 450e9
ACT_BYTES = 2  # bf16 activations crossing the TP all-reduces
CE_STAT_BYTES = 4  # cross-entropy statistics per token (fp32): max logit, then sum of exps and target logit


@dataclass(frozen=True)
class WorkShape:
    """What the work model needs of the model and the batch (plain numbers, no model code)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    gated_mlp: bool = True  # SwiGLU (three MLP matrices) or GELU (two)
    tie_embeddings: bool = False
    flops_per_byte: float = FLOPS_PER_LINK_BYTE

    @classmethod
    def of(cls, data: WorkShape | Mapping | None) -> WorkShape | None:
        """A WorkShape from itself, its `asdict` form (a serialised layout) or None."""
        if data is None or isinstance(data, WorkShape):
            return data
        return cls(**dict(data))


@dataclass(frozen=True)
class RankWork:
    """One rank's work per token of a micro-batch, forward plus backward."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    comm_bytes: float = 0.0

    def __add__(self, other: RankWork) -> RankWork:
        return RankWork(self.matmul_flops + other.matmul_flops, self.attention_flops + other.attention_flops,
                        self.comm_bytes + other.comm_bytes)

    def cost(self, flops_per_byte: float) -> float:
        """Modelled time in FLOP-equivalents (bytes weighted by the device's FLOPs per link byte)."""
        return self.matmul_flops + self.attention_flops + self.comm_bytes * flops_per_byte


def _allreduce_bytes(payload: float, degree: int) -> float:
    """Bytes a rank sends in a ring all-reduce of `payload` bytes over `degree` ranks."""
    return 0.0 if degree <= 1 else 2.0 * (degree - 1) / degree * payload


Weights = Sequence[float] | None  # a TP group's shard weights (None: balanced)


def attention_heads(position: int, degree: int, num_heads: int, num_kv_heads: int,
                    weights: Weights = None) -> tuple[int, int]:
    """(query heads, KV heads) held by `position` of a `degree`-rank group: query heads in balanced (or
    weighted) contiguous intervals, with every KV head they read (the model's split,
    `attention_head_intervals`)."""
    group = num_heads // num_kv_heads
    qlo, qhi = shard_interval(position, degree, num_heads, 1, weights)
    return qhi - qlo, (qhi - 1) // group + 1 - qlo // group


def layer_work(shape: WorkShape, degree: int, position: int, align: int = 1, weights: Weights = None
               ) -> RankWork:
    """A transformer layer on position `position` of a `degree`-rank group: its query heads (balanced
    intervals, or by the group's `weights`), the KV heads they read, its FFN columns (blocks of `align`,
    `ntp.shard_align`) and the layer's four all-reduces."""
    h, nh, nkv = shape.hidden_size, shape.num_heads, shape.num_kv_heads
    d = h // nh
    nq, kv = attention_heads(position, degree, nh, nkv, weights)
    flo, fhi = shard_interval(position, degree, shape.ffn_hidden_size, align, weights)
    params = h * d * (2 * nq + 2 * kv) + (3 if shape.gated_mlp else 2) * h * (fhi - flo)
    # Causal scores: QK^T and AV over half the sequence on average (2 * 2 * s/2 * d per head), x3 with
    # the backward.
    scores = 6.0 * 2 * nq * d * shape.seq_len
    return RankWork(6.0 * params, scores, 4 * _allreduce_bytes(h * ACT_BYTES, degree))


def vocab_work(shape: WorkShape, degree: int, position: int, head: bool, align: int = 1,
               weights: Weights = None) -> RankWork:
    """The embedding (one all-reduce of its output) or the output head (its matmul, the input gradient's
    all-reduce and the cross entropy's statistics) on a vocabulary slice."""
    h = shape.hidden_size
    if not head:
        return RankWork(comm_bytes=_allreduce_bytes(h * ACT_BYTES, degree))
    lo, hi = shard_interval(position, degree, shape.vocab_size, align, weights)
    comm = _allreduce_bytes(h * ACT_BYTES, degree) + _allreduce_bytes(3 * CE_STAT_BYTES, degree)
    return RankWork(6.0 * h * (hi - lo), 0.0, comm)


def rank_work(shape: WorkShape, topology: Topology, rank: int) -> RankWork:
    """Work per token of `rank`: every slot its pipeline stage holds, at the slot's effective degree."""
    c = topology.coord(rank)
    total = RankWork()
    last = topology.num_layers + 1
    slots = [0] * (c.stage == 0) + [i + 1 for i in topology.stage_layer_range(c.stage)]
    slots += [last] * (c.stage == topology.pp - 1)
    for slot in slots:
        shards = 0 if slot == last and shape.tie_embeddings else slot  # a tied head is the table's split
        group = topology.layer_group_ranks(rank, shards)
        t, pos, weights = len(group), group.index(rank), topology.group_weights(group)
        if slot in (0, last):
            total = total + vocab_work(shape, t, pos, head=slot == last, align=topology.shard_align,
                                       weights=weights)
        else:
            total = total + layer_work(shape, t, pos, topology.shard_align, weights)
    return total


def rank_costs(shape: WorkShape, topology: Topology) -> list[float]:
    """Modelled time per token of every global rank (FLOP-equivalents)."""
    return [rank_work(shape, topology, r).cost(shape.flops_per_byte) for r in range(topology.world_size)]


def healthy_cost(shape: WorkShape, topology: Topology) -> float:
    """The slowest rank's cost in a healthy replica (all `tp` ranks) of the same layer degrees."""
    healthy = Topology(topology.tp, [topology.tp], topology.layer_tp, topology.pp, topology.stage_layers,
                       topology.shard_align)
    return max(rank_costs(shape, healthy))


def replica_costs(shape: WorkShape, topology: Topology) -> list[float]:
    """Per replica, its slowest rank's modelled time per token."""
    costs = rank_costs(shape, topology)
    return [max(costs[r] for p in range(topology.pp) for r in topology.stage_ranks(i, p))
            for i in range(topology.dp)]


def modelled_capacities(shape: WorkShape, topology: Topology,
                        power_boost: float | Sequence[float] | None = None) -> list[float]:
    """Per replica: a healthy replica's slowest-rank time over this replica's (at most 1), times the power
    boost of a degraded replica (NTP-PW)."""
    base = healthy_cost(shape, topology)
    caps = []
    for r, cost in enumerate(replica_costs(shape, topology)):
        boost = 1.0
        if power_boost is not None and topology.replica_tp[r] < topology.tp:
            boost = power_boost[r] if isinstance(power_boost, Sequence) else float(power_boost)
        caps.append(min(1.0, base / cost * boost))
    return caps
