"""Sharding patterns of one matmul compared on four measures: row/column (Megatron, 1D) against block
(2D, SUMMA-style over a q x q grid of p = q^2 devices), the block side as `ntp_nemo.parallel.block` runs
it (`ntp.pattern=block`; `python bench/block_sharding.py` measures both sides against this model).

One matmul `Y = X W` with X [m x k] (m = micro-batch tokens), W [k x n]; forward plus backward
(`dX = dY W^T`, `dW = X^T dY`), so 6 m k n FLOPs in all, split evenly over the p devices by both
patterns: compute time 6 m k n / (p F), F the device's sustained FLOP/s (`DeviceModel.flops_per_s`).
E = activation bytes per element (`act_bytes`), S = bytes of state per parameter
(`state_bytes_per_param`: weight, gradient, optimizer), B = link bandwidth, a = per-hop latency.

Row/column (1D).  Megatron pairs a column-parallel matmul (W split by columns: the input X is
replicated, the output sharded) with a row-parallel one (W split by rows: the input sharded, the output
a partial sum).  Each matmul of a pair owns one all-reduce of m x d activations, d = hidden (the pair's
outer dimension): the column-parallel one in the backward (the partial dX), the row-parallel one in the
forward (the partial Y).  A ring all-reduce of P bytes over p devices sends and receives
2 (p-1)/p P bytes per device in 2 (p-1) steps (`LinkModel.allreduce_time`).  So per matmul:
- bytes moved per device: 2 (p-1)/p * m d E;
- time: compute + 2 (p-1) a + 2 (p-1)/p m d E / B: the all-reduce needs the whole matmul's
  output, so none of it hides behind that matmul (Megatron's default schedule);
- memory: k n / p parameters (x S) plus the input kept for the backward: m k (replicated) for a
  column-parallel matmul, m k / p for a row-parallel one (x E);
- work without synchronisation: one collective per matmul, so all 6 m k n / p FLOPs of it
  (a forward pair runs both matmuls, then synchronises once).

Block (2D, SUMMA over a q x q grid, as `ntp_nemo.parallel.block` runs it).  Activations are split by
tokens along grid rows and by features along grid columns; W's output units over grid rows and its input
units over grid columns, so device (i, j) holds X's block (i, j) and W's block (i, j) (n/q x k/q), and Y
lands in the activations' layout for the next matmul.  In q steps each:
- forward: step l broadcasts W's blocks of grid row l down the grid columns and reduces the partial
  products X_ij W_lj^T of grid row i onto device (i, l): (q-1) kn/p + (q-1) mn/p elements received;
- backward: step l broadcasts dY's blocks of grid column l along the grid rows and W's blocks of grid
  row l down the columns (dX_ij accumulates dY_il W_lj), and reduces the partial weight gradients
  dY_il^T X_ij of grid column j onto device (l, j): (q-1) (mn + 2 kn)/p.
X never moves (it stays where the previous matmul's output landed).  A wide output (2n > 3k: the MLP's up
projection, an untied head) puts W's output units over grid columns and its inputs over grid rows
instead: the forward broadcasts X's blocks along rows and W's down columns (output-stationary), the
backward broadcasts both again and reduces dX along rows and dW down columns: (q-1)(3mk + 3kn)/p
elements in 6 streams of collectives; Y never moves.  So per matmul (the default placement)
- bytes moved per device: (q-1) (3 k n + 2 m n) / p * E (weights counted at E too: they move as bf16
  copies, as activations do).  (An output-stationary SUMMA for all three products, this model's first
  version, gives 2 (q-1)(m k + k n + m n)/p; the measured bytes of the layers that run were 0.63x to
  1.05x of it, `bench/block_sharding.py`, so the model follows the layers.)
- time: the collectives of step l+1 overlap the local product of step l (pipelined SUMMA), so the
  exposed part is the first step's transfer plus whatever of each later step the compute cannot hide:
  exposed = C / q + (q-1)/q * max(0, C - T), C the transfer time (bytes / B, plus 5 (q-1) hops of
  latency: five streams of q collectives (W, Y; dY, W, dW), a ring's q-1 hops each), T the compute time;
- memory: k n / p parameters (x S) plus the input block m k / p (x E): nothing is replicated
  (SUMMA's in-flight panel blocks, one block per operand, are left out, like the 1D pattern's
  all-reduce buffers; measured equal, `bench/block_sharding.py`);
- work without synchronisation: 5 q collectives per matmul (2 per forward step, 3 per backward step),
  so 6 m k n / p / (5 q) FLOPs between two of them.

What follows from the formulas (no measurement behind any of it):
- bytes: block moves less than row/column exactly when (q-1)(3 k n + 2 m n)/p < 2 (p-1)/p m d, i.e.
  3 k n + 2 m n < 2 (q+1) m d.  With d = k (column-parallel, n = r k) the condition is
  q + 1 > r (1 + 3 k / (2 m)); with d = n (row-parallel, k = r n) it is q + 1 > 1 + 3 r n / (2 m):
  1D's bytes per device stay near 2 m d E whatever p, 2D's fall like 1/sqrt(p), so block sharding
  wins on bytes above a degree set by the matmul's aspect ratio r and by the weight's size against the
  tokens (few tokens per micro-batch favour 1D: its bytes are activations only, 2D also moves weights);
- memory: block always keeps less activation memory for a column-parallel matmul
  ((1 - 1/p) m k E less; sequence parallelism gives 1D the same saving), the same for a row-parallel one;
- work without synchronisation: row/column always does 5 q times more FLOPs between collectives;
  block's collectives run in groups of q = sqrt(p) devices instead of p, which is what makes it
  attractive when the degree exceeds one scale-up domain;
- speed: equal compute, so the exposed transfer decides: with the overlap above, block wins wherever
  its bytes are fewer, and also where its transfer hides behind compute (fast links, many tokens).

The matmuls with weights are compared (attention's QKV and output projections, the MLP's up (gate and
up fused when gated) and down projections, the output head); attention's score products are per head
in both patterns and are left out, as are norms (2D needs a row-wise all-reduce of m/q statistics
per norm; small).  Heads are not a unit here: the matrix model ignores the unit rule of the real layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ntp_nemo.planner.shapes import DeviceModel, ModelShape

ROW_COLUMN, BLOCK = "row/column", "block"
COLUMN, ROW = "column", "row"  # the 1D pattern's side of a matmul


@dataclass(frozen=True)
class Matmul:
    """One weight matmul of a layer: X [tokens x k] @ W [k x n], `side` its 1D sharding."""

    name: str
    k: int
    n: int
    side: str  # COLUMN (input replicated, output sharded) or ROW (input sharded, output reduced)
    count: int = 1  # how many of it a model step runs (layers)
    tied: bool = False  # the output head of a tied embedding: its weight keeps the embedding's placement

    @property
    def out_columns(self) -> bool:
        """Block sharding puts W's outputs over grid columns (`parallel.block.out_columns`: 2n > 3k), except
        for a tied head, whose weight is the embedding table (vocabulary over grid rows)."""
        return 2 * self.n > 3 * self.k and not self.tied

    @property
    def outer(self) -> int:
        """The dimension 1D's all-reduce carries: the input's for a column-parallel matmul, the output's
        for a row-parallel one (the hidden size of the pair)."""
        return self.k if self.side == COLUMN else self.n


@dataclass(frozen=True)
class PatternCost:
    """The four measures of one matmul under one pattern, per device, forward plus backward."""

    pattern: str
    degree: int
    compute_s: float
    comm_s: float  # transfer time of the collectives (bandwidth and latency)
    exposed_comm_s: float  # the part of it on the critical path
    bytes_moved: float  # bytes each device receives (and sends)
    memory_bytes: float  # weights with their state plus the activation kept for the backward
    flops: float  # per device
    syncs: int  # collectives (or SUMMA steps) per matmul

    @property
    def time_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def flops_per_sync(self) -> float:
        """Work done without synchronisation: FLOPs per device between two collectives."""
        return self.flops / self.syncs if self.syncs else self.flops


def grid_side(p: int) -> int | None:
    """q with q * q == p, or None: block sharding here needs a square grid."""
    q = math.isqrt(p)
    return q if q * q == p else None


def row_column_cost(mm: Matmul, tokens: int, p: int, device: DeviceModel, link_bw: float,
                    link_latency_s: float) -> PatternCost:
    """Megatron 1D: one all-reduce of tokens x outer activations per matmul (see the module docstring)."""
    flops = 6.0 * tokens * mm.k * mm.n / p
    e = device.act_bytes
    payload = tokens * mm.outer * e
    moved = 2 * (p - 1) / p * payload if p > 1 else 0.0
    comm = (2 * (p - 1) * link_latency_s + moved / link_bw) if p > 1 else 0.0
    kept = tokens * mm.k * (e if mm.side == COLUMN else e / p)
    return PatternCost(
        pattern=ROW_COLUMN, degree=p, compute_s=flops / device.flops_per_s, comm_s=comm, exposed_comm_s=comm,
        bytes_moved=moved, memory_bytes=mm.k * mm.n / p * device.state_bytes_per_param + kept,
        flops=flops, syncs=1 if p > 1 else 0,
    )


def block_cost(mm: Matmul, tokens: int, p: int, device: DeviceModel, link_bw: float,
               link_latency_s: float) -> PatternCost | None:
    """SUMMA over a q x q grid (None when p is not a square); see the module docstring."""
    q = grid_side(p)
    if q is None:
        return None
    m, k, n, e = tokens, mm.k, mm.n, device.act_bytes
    flops = 6.0 * m * k * n / p
    compute = flops / device.flops_per_s
    if mm.out_columns:  # W's outputs over grid columns: X and W move, never Y
        moved, streams = (q - 1) * (3 * m * k + 3 * k * n) / p * e, 6
    else:
        moved, streams = (q - 1) * (3 * k * n + 2 * m * n) / p * e, 5
    comm = (streams * (q - 1) * link_latency_s + moved / link_bw) if q > 1 else 0.0
    exposed = comm / q + (q - 1) / q * max(0.0, comm - compute) if q > 1 else 0.0
    return PatternCost(
        pattern=BLOCK, degree=p, compute_s=compute, comm_s=comm, exposed_comm_s=exposed, bytes_moved=moved,
        memory_bytes=k * n / p * device.state_bytes_per_param + m * k / p * e,
        flops=flops, syncs=streams * q if q > 1 else 0,
    )


def model_matmuls(model: ModelShape) -> list[Matmul]:
    """The weight matmuls of one step of `model`: per layer QKV, attention output, MLP up, MLP down
    (`num_layers` of each), and the output head."""
    h, layers = model.hidden_size, model.num_layers
    kv = model.num_kv_heads * model.head_dim
    up = (2 if model.gated_mlp else 1) * model.ffn_hidden_size
    return [
        Matmul("qkv", h, h + 2 * kv, COLUMN, layers),
        Matmul("attn out", h, h, ROW, layers),
        Matmul("mlp up", h, up, COLUMN, layers),
        Matmul("mlp down", model.ffn_hidden_size, h, ROW, layers),
        Matmul("head", h, model.vocab_size, COLUMN, 1, tied=model.tie_embeddings),
    ]


@dataclass(frozen=True)
class Comparison:
    """Both patterns of one matmul at one degree and link."""

    matmul: Matmul
    row_column: PatternCost
    block: PatternCost | None

    def to_dict(self) -> dict:
        return {"matmul": asdict(self.matmul), "row_column": _cost_dict(self.row_column),
                "block": None if self.block is None else _cost_dict(self.block)}


def _cost_dict(c: PatternCost) -> dict:
    return {**asdict(c), "time_s": c.time_s, "flops_per_sync": c.flops_per_sync}


def compare(model: ModelShape, tokens: int, p: int, device: DeviceModel, link_bw: float,
            link_latency_s: float) -> list[Comparison]:
    """Per weight matmul of `model`: row/column and block costs at degree `p` over a link of `link_bw`
    bytes/s (block: None when p is not a square)."""
    return [Comparison(mm, row_column_cost(mm, tokens, p, device, link_bw, link_latency_s),
                       block_cost(mm, tokens, p, device, link_bw, link_latency_s))
            for mm in model_matmuls(model)]


def step_totals(rows: list[Comparison]) -> dict[str, dict[str, float]] | None:
    """Each pattern's sums over a model step (every matmul times its count): time, bytes, memory
    (weights of every layer, activations kept by every layer), FLOPs per synchronisation (the step's
    FLOPs over its collectives).  None when block sharding has no grid at this degree."""
    if any(r.block is None for r in rows):
        return None
    out: dict[str, dict[str, float]] = {}
    for name, pick in ((ROW_COLUMN, lambda r: r.row_column), (BLOCK, lambda r: r.block)):
        costs = [(pick(r), r.matmul.count) for r in rows]
        syncs = sum(c.syncs * n for c, n in costs)
        out[name] = {
            "time_s": sum(c.time_s * n for c, n in costs),
            "bytes_moved": sum(c.bytes_moved * n for c, n in costs),
            "memory_bytes": sum(c.memory_bytes * n for c, n in costs),
            "flops_per_sync": sum(c.flops * n for c, n in costs) / syncs if syncs else 0.0,
        }
    return out


LAYER_MATMULS = ("qkv", "attn out", "mlp up", "mlp down")


def recommend_patterns(rows: list[Comparison], model: ModelShape) -> tuple[tuple[str, ...], dict[str, dict]]:
    """Per layout slot (embedding, each layer, head), the pattern (`ntp.pattern` names: `row_column`,
    `block`) whose modelled time is lower: a layer by its four matmuls, the head by its own; the
    embedding (no matmul modelled) follows the head when tied, else the first layer.  All row/column
    where there is no square grid.  Also returns the times compared (ms).  Not modelled: the relayout a
    change of pattern between two slots costs (an all-reduce of the hidden state)."""
    times = {ROW_COLUMN: {"layer": 0.0, "head": 0.0}, BLOCK: {"layer": 0.0, "head": 0.0}}
    for r in rows:
        part = "layer" if r.matmul.name in LAYER_MATMULS else "head"
        times[ROW_COLUMN][part] += r.row_column.time_s * 1e3
        times[BLOCK][part] += r.block.time_s * 1e3 if r.block is not None else math.inf

    def pick(part: str) -> str:
        return "block" if times[BLOCK][part] < times[ROW_COLUMN][part] else "row_column"

    layer, head = pick("layer"), pick("head")
    embedding = head if model.tie_embeddings else layer
    return (embedding, *([layer] * model.num_layers), head), times


def block_wins(model: ModelShape, tokens: int, device: DeviceModel, latency_s: float,
               degrees: list[int], bandwidths_gbps: list[float]) -> list[dict[str, float]]:
    """For each square degree and link bandwidth (GB/s): the step's time and bytes of both patterns and
    block's gain (positive: block is faster or moves fewer bytes), the map of where block wins."""
    out = []
    for p in degrees:
        for gbps in bandwidths_gbps:
            totals = step_totals(compare(model, tokens, p, device, gbps * 1e9, latency_s))
            if totals is None:
                continue
            one, two = totals[ROW_COLUMN], totals[BLOCK]
            out.append({
                "degree": p, "gbps": gbps,
                "row_column_time_s": one["time_s"], "block_time_s": two["time_s"],
                "time_gain": one["time_s"] / two["time_s"] - 1.0,
                "bytes_gain": one["bytes_moved"] / two["bytes_moved"] - 1.0,
            })
    return out
