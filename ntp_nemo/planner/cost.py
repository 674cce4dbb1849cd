"""Per-item cost model: FLOPs, all-reduce bytes, time and memory of one model item at a TP degree.

An *item* is the embedding, one transformer layer, or the output head. Costs are per rank and
per micro-batch (`micro_batch_size` sequences of `seq_len` tokens), forward plus backward.

Sharding follows the project's unit rule: a degree-t group splits each item's units (attention
heads, FFN columns for the MLP, vocabulary rows for embedding/head) into balanced contiguous
intervals, so the busiest rank holds ceil(U/t) units; that rank sets the time. Attention splits
query heads, and each rank keeps the GQA KV heads its query heads read (a KV head whose query heads
span two ranks is held by both).

Communication (Megatron-style, payload per rank, each an all-reduce inside the t-rank group):
- transformer layer: 2 all-reduces of b*s*h activations forward, 2 of their gradients backward;
- embedding: 1 all-reduce of b*s*h forward (vocab-parallel lookup), none backward;
- head: 1 all-reduce of the b*s*h input gradient backward, plus the vocab-parallel cross
  entropy's forward all-reduces of b*s fp32 values: the max logit, then the sum of exps and the
  target logit fused into one all-reduce of 2*b*s values.
With sequence parallelism each all-reduce of activations becomes a reduce-scatter and an all-gather
(the same bytes in a ring), and the backward gathers each column-parallel input again (only the slice
is kept): half an all-reduce more per column-parallel entry (two per layer, one for the head).  The
replicated regions' activations are divided by the degree (Korthikanti et al.: s*b*h*34/t bytes per
layer in bf16 with flash attention), a recomputed layer keeps its input slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape
from ntp_nemo.topology.work import attention_heads

EMBEDDING, LAYER, HEAD = "embedding", "layer", "head"
CE_STAT_BYTES = 4  # cross-entropy statistics are reduced in fp32 (or wider, for fp64 runs)
ACT_REPLICATED, ACT_SHARDED = 10.0, 24.0  # selective-recompute activation bytes per s*b*h (bf16)


@dataclass(frozen=True)
class ItemCost:
    """Cost of one item at one degree for one micro-batch on the busiest rank."""

    kind: str
    degree: int
    flops: float
    comm_bytes: float
    num_allreduces: int
    compute_s: float
    comm_s: float
    params: float
    memory_bytes: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def shard_fraction(units: int, degree: int) -> float:
    """Fraction of `units` on the busiest of `degree` ranks (balanced contiguous intervals)."""
    return -(-units // degree) / units


def attention_fractions(model: ModelShape, degree: int) -> tuple[float, float]:
    """(query heads, KV heads) on the busiest rank as fractions of all, at TP `degree` (the per-rank
    work model's head split, `ntp_nemo.topology.work.attention_heads`)."""
    nh, kv = model.num_heads, model.num_kv_heads
    held = [attention_heads(p, degree, nh, kv) for p in range(degree)]
    return max(q for q, _ in held) / nh, max(k for _, k in held) / kv


def units_of(model: ModelShape, kind: str) -> int:
    """How many shardable units an item has: the most ranks it can be split over."""
    if kind == LAYER:
        return min(model.num_heads, model.ffn_hidden_size)
    return model.vocab_size


def item_cost(
    model: ModelShape,
    kind: str,
    degree: int,
    seq_len: int,
    micro_batch_size: int,
    device: DeviceModel,
    links: LinkModel,
    recompute: bool = False,
    sequence_parallel: bool = False,
) -> ItemCost:
    """FLOPs, all-reduce payload, modelled seconds and memory of `kind` at TP `degree`.

    Activations per layer follow the selective-recompute estimate s*b*h*(10 + 24/t) bytes
    (bf16, flash attention), s*b*h*34/t under `sequence_parallel`; with full `recompute` a layer
    keeps only its input (s*b*h values, 1/t of them under SP) and re-runs its forward in the backward
    pass (4 instead of 3 passes).
    """
    sp = sequence_parallel and degree > 1
    tokens = micro_batch_size * seq_len
    h = model.hidden_size
    act = tokens * h * device.act_bytes
    if kind == LAYER:
        fq, fkv = attention_fractions(model, degree)
        fm = shard_fraction(model.ffn_hidden_size, degree)
        kv_params = 2 * h * model.num_kv_heads * model.head_dim
        params = (model.attention_params - kv_params) * fq + kv_params * fkv + model.mlp_params * fm
        fwd = 2 * tokens * params + 4 * micro_batch_size * seq_len * seq_len * h * fq
        payloads = [act] * 4 + [act / 2] * (2 if sp else 0)  # SP: the backward re-gathers, half an AR
        replicated = ACT_REPLICATED / degree if sp else ACT_REPLICATED
        activations = (
            act / (degree if sp else 1) if recompute
            else tokens * h * (replicated + ACT_SHARDED / degree) * device.act_bytes / 2
        )
    elif kind in (EMBEDDING, HEAD):
        fv = shard_fraction(model.vocab_size, degree)
        params = model.embedding_params * fv
        if kind == EMBEDDING:
            fwd = 0.0
            payloads = [act]
            activations = act / degree if sp else act
        else:
            fwd = 2 * tokens * h * model.vocab_size * fv
            stat = tokens * max(CE_STAT_BYTES, device.act_bytes)
            payloads = [act, stat, 2 * stat]  # input grad; max logit; fused (sum of exps, target logit)
            if sp:
                payloads.append(act / 2)  # the backward re-gathers the input
            activations = tokens * model.vocab_size * fv * max(CE_STAT_BYTES, device.act_bytes)
            if model.tie_embeddings:
                params = 0.0  # the head reuses the embedding's shard
    else:
        raise ValueError(f"unknown item kind {kind!r}")
    if degree <= 1:
        payloads = []
    flops = (4 if recompute and kind == LAYER else 3) * fwd
    comm_s = sum(links.allreduce_time(p, degree) for p in payloads)
    return ItemCost(
        kind=kind,
        degree=degree,
        flops=flops,
        comm_bytes=float(sum(payloads)),
        num_allreduces=len(payloads),
        compute_s=flops / device.flops_per_s,
        comm_s=comm_s,
        params=float(params),
        memory_bytes=params * device.state_bytes_per_param + activations,
    )


def item_kinds(model: ModelShape) -> list[str]:
    """Kinds of the layout items in order: embedding, each transformer layer, head."""
    return [EMBEDDING] + [LAYER] * model.num_layers + [HEAD]


def item_names(model: ModelShape) -> list[str]:
    return ["embedding"] + [f"layer{i}" for i in range(model.num_layers)] + ["head"]


def stage_of_items(num_layers: int, pp: int) -> list[int]:
    """Pipeline stage of each item: layers in balanced contiguous intervals, embedding first, head last."""
    stages = [0]
    for i in range(num_layers):
        stages.append(next(s for s in range(pp) if i < (s + 1) * num_layers // pp))
    stages.append(pp - 1)
    return stages
