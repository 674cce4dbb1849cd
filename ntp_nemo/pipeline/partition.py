"""Cost-balanced contiguous split of the transformer layers into pipeline stages.

The slowest stage sets the pipeline's pace, so the split minimises the largest stage cost.  Stage 0
also carries the embedding and the last stage the output head (with a large vocabulary the head
alone can outweigh a layer), so both count towards their stage.  Costs are the planner's modelled
forward+backward time of one micro-batch per item at its nominal TP degree (`planner.cost`), which
weighs FLOPs and TP all-reduces the same way the layout planner does.
"""

from __future__ import annotations

from collections.abc import Sequence

from ntp_nemo.planner.cost import EMBEDDING, HEAD, LAYER, item_cost
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape


def item_costs(shape: ModelShape, layer_tp: Sequence[int], seq_len: int,
               micro_batch_size: int) -> list[float]:
    """Modelled seconds per micro-batch of [embedding, layer 0..L-1, head] at the given degrees."""
    device, links = DeviceModel(), LinkModel()
    kinds = [EMBEDDING] + [LAYER] * shape.num_layers + [HEAD]
    return [item_cost(shape, kind, int(t), seq_len, micro_batch_size, device, links).time_s
            for kind, t in zip(kinds, layer_tp, strict=True)]


def balanced_partition(costs: Sequence[float], pp: int) -> list[int]:
    """Layers per stage minimising the largest stage cost.

    `costs` = [embedding, layer 0, ..., layer L-1, head]; every stage gets at least one layer.
    Exact dynamic programme over split points, O(pp * L^2).
    """
    emb, layers, head = costs[0], list(costs[1:-1]), costs[-1]
    n = len(layers)
    if not 1 <= pp <= n:
        raise ValueError(f"cannot split {n} layers into {pp} stages")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (emb if s == 0 else 0.0) + (head if s == pp - 1 else 0.0)

    inf = float("inf")
    # best[s][i]: smallest bottleneck of stages 0..s covering layers [0, i); cut[s][i]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for i in range(1, n + 1):
        best[0][i] = stage_cost(0, 0, i)
    tol = 1e-12 * (sum(costs) or 1.0)
    for s in range(1, pp):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], stage_cost(s, j, i))
                if value < best[s][i] - tol:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(pp - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
