"""The planner: per-item TP degrees and per-replica batch shares that minimise modelled step time.

Objective. Replica r (n_r active ranks) processes one micro-batch per pipeline period
a_r = max over stages of the summed item times at the items' effective degrees. The trainer splits
the global batch's M micro-batches by capacity (`ResolvedLayout.microbatches`: active ranks over
the nominal degree, NTP-PW boost, largest-remainder rounding), m_r each, so a step takes
max_r m_r * a_r and the time per micro-batch of the global batch is J = max_r (m_r / M) * a_r; the
planner minimises J subject to every (replica, stage) fitting the memory limit. Ties on J (e.g. the
embedding's degree when the other stage is the slower one) go to the layout with the least peak
memory (no unsharded embedding for no gain in step time), then to the least summed stage time.

Search. Start from every item at its highest valid degree (the least memory any layout can
use, so if it does not fit nothing does), then coordinate descent: move one item at a time to
the degree that most lowers (J, peak memory, total time) while staying within memory, until no move
helps.
With tied embeddings the embedding and the head move together (they share one weight).
Fixed per-step costs (pipeline bubble, data-parallel gradient sync) are not in the objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ntp_nemo.errors import ConfigError
from ntp_nemo.planner.cost import ItemCost, item_cost, item_kinds, item_names, stage_of_items, units_of
from ntp_nemo.planner.layer_tp import divisors, effective_degree, validate_layer_tp
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape
from ntp_nemo.topology.layout import ResolvedLayout
from ntp_nemo.topology.topology import Topology
from ntp_nemo.topology.work import WorkShape

GB = 1e9


@dataclass(frozen=True)
class PlanRow:
    """One item of the plan, costed in the smallest replica (the one with the least ranks)."""

    item: str
    degree: int
    effective_degree: int
    flops: float
    comm_bytes: float
    time_s: float
    memory_gb: float


@dataclass(frozen=True)
class Plan:
    """A validated layout: per-item degrees, per-replica batch shares and the costing behind them.

    `batch_shares` are the trainer's: each replica's micro-batches (`microbatches`, the split
    `ResolvedLayout` gives the layout) over the global batch's; without a global batch, the capacity
    quotas that split rounds."""

    layer_tp: list[int]
    batch_shares: list[float]
    table: list[PlanRow]
    tp: int
    replica_tp: list[int]
    microbatch_time_s: list[float] = field(default_factory=list)
    memory_gb: list[float] = field(default_factory=list)
    time_per_microbatch_s: float = 0.0
    microbatches: list[int] = field(default_factory=list)

    def overrides(self) -> list[str]:
        """Hydra overrides that apply this plan to a training run."""
        return [f"layout.layer_tp=[{','.join(str(t) for t in self.layer_tp)}]"]

    def layer_tp_pattern(self) -> str:
        """`layer_tp` as embedding, layers (runs of one degree as DEGREE*COUNT), head: the run-length
        form `parse_layer_tp` reads, e.g. '1,8*32,8'."""
        return ",".join((str(self.layer_tp[0]), run_length(self.layer_tp[1:-1]), str(self.layer_tp[-1])))

    def format_table(self) -> str:
        """Per-item table; consecutive identical layers are merged into one row (e.g. layer0-49)."""
        header = (
            f"{'item':<14} {'tp':>3} {'eff':>3} {'GFLOP':>12} {'comm MB':>10} {'time ms':>10} {'mem GB':>9}"
        )
        lines = [header, "-" * len(header)]
        groups: list[tuple[str, str, PlanRow]] = []
        for r in self.table:
            prev = groups[-1] if groups else None
            same = (
                prev is not None
                and r.item.startswith("layer")
                and prev[2].item.startswith("layer")
                and ((prev[2].degree, prev[2].effective_degree) == (r.degree, r.effective_degree))
            )
            if same:
                groups[-1] = (prev[0], r.item, prev[2])
            else:
                groups.append((r.item, r.item, r))
        for first, last, r in groups:
            name = first if first == last else f"{first}-{last.removeprefix('layer')}"
            lines.append(
                f"{name:<14} {r.degree:>3} {r.effective_degree:>3} {r.flops / 1e9:>12.3f} "
                f"{r.comm_bytes / 1e6:>10.3f} {r.time_s * 1e3:>10.4f} {r.memory_gb:>9.3f}"
            )
        return "\n".join(lines)


def run_length(degrees: Sequence[int]) -> str:
    """'1,8*32,8' for [1, 8, ..., 8, 8]: runs of one degree as DEGREE*COUNT."""
    runs: list[list[int]] = []
    for t in degrees:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return ",".join(str(t) if n == 1 else f"{t}*{n}" for t, n in runs)


def _check_inputs(
    tp: int, replica_tp: Sequence[int], seq_len: int, micro_batch_size: int, pp: int, layers: int
) -> None:
    for key, value in (
        ("mesh.tp", tp),
        ("data.seq_len", seq_len),
        ("data.micro_batch_size", micro_batch_size),
        ("mesh.pp", pp),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value!r}.")
    if pp > layers:
        raise ConfigError("mesh.pp", f"{pp} stages for {layers} layers; use at most one stage per layer.")
    if not replica_tp:
        raise ConfigError("ntp.replica_tp", "is empty; give one entry (active TP ranks) per DP replica.")
    for n in replica_tp:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= tp:
            raise ConfigError("ntp.replica_tp", f"entry {n!r} must be an integer in [1, mesh.tp={tp}].")


@dataclass(frozen=True)
class _CostTables:
    """time[u, i, c], mem[u, i, c]: item i at its candidate degree c inside a replica of sizes[u] ranks."""

    time: np.ndarray
    mem: np.ndarray
    stage_onehot: np.ndarray  # (items, stages)
    shares: np.ndarray  # the largest batch share of a replica of each size
    send_s: float  # per-micro-batch pipeline send + receive of a stage

    def evaluate(self, choice: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
        """(J, summed stage time, period per replica size, peak memory per replica size)."""
        t_items = np.take_along_axis(self.time, choice[None, :, None], axis=2)[..., 0]
        m_items = np.take_along_axis(self.mem, choice[None, :, None], axis=2)[..., 0]
        stage_t = t_items @ self.stage_onehot + self.send_s
        period = stage_t.max(axis=1)
        j = float(np.max(self.shares * period))
        return j, float(stage_t.sum()), period, (m_items @ self.stage_onehot).max(axis=1)


def _descend(
    tables: _CostTables, choice: np.ndarray, variables: list[list[int]], n_cands: list[int], limit: float
) -> np.ndarray:
    """Coordinate descent on (J, peak memory, total time), one variable (a set of items sharing a
    degree) at a time, never leaving the memory limit."""
    best_j, best_total, _, best_mem = tables.evaluate(choice)
    for _ in range(4 * len(variables)):
        improved = False
        for items in variables:
            for c in range(n_cands[items[0]]):
                if c == choice[items[0]]:
                    continue
                trial = choice.copy()
                trial[items] = c
                j, total, _, mem = tables.evaluate(trial)
                if mem.max() > limit:
                    continue
                better = j < best_j * (1 - 1e-12)
                same_j = j <= best_j * (1 + 1e-12)
                less_memory = same_j and mem.max() < best_mem.max() * (1 - 1e-12)
                same_memory = same_j and mem.max() <= best_mem.max() * (1 + 1e-12)
                tie_better = same_memory and total < best_total * (1 - 1e-12)
                if better or less_memory or tie_better:
                    choice, best_j, best_total, best_mem, improved = trial, j, total, mem, True
        if not improved:
            break
    return choice


@dataclass(frozen=True)
class Ranking:
    """Layouts within the memory limit, fastest first (`plans[0]` is what `plan_layout` returns)."""

    plans: list[Plan]
    considered: int  # layouts costed, those over the memory limit included


def plan_layout(
    model: ModelShape,
    tp: int,
    replica_tp: list[int],
    seq_len: int,
    micro_batch_size: int,
    links: LinkModel | None = None,
    memory_limit_gb: float | None = None,
    *,
    pp: int = 1,
    device: DeviceModel | None = None,
    recompute: bool = False,
    distributed_optimizer: bool = False,
    sequence_parallel: bool = False,
    num_microbatches: int | None = None,
    power_boost: float | Sequence[float] | None = None,
    capacity: str = "ranks",
    shard_align: int = 1,
) -> Plan:
    """Choose per-item degrees (layout.layer_tp) and batch shares minimising modelled step time.

    Keyword-only extras: `pp` pipeline stages (memory and period per stage), `device` compute
    speed and bytes per parameter (default: H100-class), `recompute` full activation recomputation,
    `distributed_optimizer` the fp32 master and Adam moments (12 of the per-parameter state bytes)
    split over the replicas holding each fragment (`optim.distributed=true`), `sequence_parallel`
    the replicated regions' activations split over each item's degree (`ntp.sequence_parallel=true`),
    `num_microbatches` (the global batch over the micro-batch size; default one per replica),
    `power_boost` (NTP-PW), `capacity` (`ntp.capacity`: ranks | work) and `shard_align`
    (`ntp.shard_align`) fix the batch split exactly as the trainer does.
    """
    return rank_layouts(
        model, tp, replica_tp, seq_len, micro_batch_size, links, memory_limit_gb, pp=pp, device=device,
        recompute=recompute, distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel,
        num_microbatches=num_microbatches, power_boost=power_boost, capacity=capacity,
        shard_align=shard_align,
    ).plans[0]


def rank_layouts(
    model: ModelShape,
    tp: int,
    replica_tp: list[int],
    seq_len: int,
    micro_batch_size: int,
    links: LinkModel | None = None,
    memory_limit_gb: float | None = None,
    *,
    pp: int = 1,
    device: DeviceModel | None = None,
    recompute: bool = False,
    distributed_optimizer: bool = False,
    sequence_parallel: bool = False,
    num_microbatches: int | None = None,
    power_boost: float | Sequence[float] | None = None,
    capacity: str = "ranks",
    shard_align: int = 1,
) -> Ranking:
    """The planner's candidates, ranked: every layout with one degree for the embedding, one for all
    layers and one for the head (tied embeddings: one for both), and the coordinate descent's
    per-layer layout from the highest degrees (and from the best of the others, when that is
    better). Those within the memory limit, fastest (J, then summed stage time) first. Arguments
    as for `plan_layout`."""
    links = links or LinkModel()
    device = device or DeviceModel()
    replica_tp = list(replica_tp)
    _check_inputs(tp, replica_tp, seq_len, micro_batch_size, pp, model.num_layers)
    kinds, names = item_kinds(model), item_names(model)
    stages = np.array(stage_of_items(model.num_layers, pp))
    sizes = sorted(set(replica_tp))
    # The trainer's split; without a global batch, the capacity quotas it rounds.  Under the `ranks`
    # rule it does not depend on the per-layer degrees; under `work` the search weighs replicas by the
    # uniform layout's split and each plan reports the split of its own degrees (`make_plan`).
    work = WorkShape(
        hidden_size=model.hidden_size, num_layers=model.num_layers, num_heads=model.num_heads,
        num_kv_heads=int(model.num_kv_heads), ffn_hidden_size=int(model.ffn_hidden_size),
        vocab_size=model.vocab_size, seq_len=int(seq_len), gated_mlp=model.gated_mlp,
        tie_embeddings=model.tie_embeddings,
    )

    def trainer_split(layer_tp: Sequence[int]) -> tuple[list[int] | None, list[float]]:
        base = ResolvedLayout.make(Topology(tp, replica_tp, layer_tp, pp, shard_align=shard_align),
                                   power_boost=power_boost, num_microbatches=num_microbatches, work=work,
                                   capacity=capacity)
        split = list(base.microbatches) if num_microbatches is not None else None
        caps = base.capacities()
        return split, [m / sum(split) for m in split] if split is not None else [c / sum(caps) for c in caps]

    split, shares = trainer_split([tp] * (model.num_layers + 2))
    cands = [[d for d in divisors(tp) if d <= units_of(model, k)] for k in kinds]
    cache: dict[tuple[str, int], ItemCost] = {}

    def cost(kind: str, degree: int) -> ItemCost:
        if (kind, degree) not in cache:
            cache[(kind, degree)] = item_cost(
                model, kind, degree, seq_len, micro_batch_size, device, links, recompute, sequence_parallel
            )
        return cache[(kind, degree)]

    sharded = min(12.0, device.state_bytes_per_param) if distributed_optimizer else 0.0
    state_per_param = device.state_bytes_per_param - sharded + sharded / len(replica_tp)
    shape = (len(sizes), len(kinds), max(len(c) for c in cands))
    time, mem = np.full(shape, np.inf), np.full(shape, np.inf)
    for u, n in enumerate(sizes):
        for i, kind in enumerate(kinds):
            in_flight = pp - stages[i]  # 1F1B: stage s holds pp - s micro-batches of activations
            for c, t in enumerate(cands[i]):
                ic = cost(kind, effective_degree(t, n))
                activations = ic.memory_bytes - ic.params * device.state_bytes_per_param
                time[u, i, c] = ic.time_s
                mem[u, i, c] = ic.params * state_per_param + activations * in_flight
    onehot = np.zeros((len(kinds), pp))
    onehot[np.arange(len(kinds)), stages] = 1.0
    act_bytes = micro_batch_size * seq_len * model.hidden_size * device.act_bytes
    tables = _CostTables(
        time=time,
        mem=mem,
        stage_onehot=onehot,
        shares=np.array([max(w for w, r in zip(shares, replica_tp, strict=True) if r == n) for n in sizes]),
        # Under SP a send carries a rank's slice (at the nominal degree; a degraded replica's is larger).
        send_s=2 * links.send_time(act_bytes / (tp if sequence_parallel else 1)) if pp > 1 else 0.0,
    )
    limit = np.inf if memory_limit_gb is None else memory_limit_gb * GB
    highest = np.array([len(c) - 1 for c in cands])  # highest degrees: the least memory any layout uses
    least_mem = tables.evaluate(highest)[3].max()
    if least_mem > limit:
        raise ConfigError(
            "memory_limit_gb",
            f"{memory_limit_gb} GB per GPU is too small: even at the highest degrees the busiest GPU needs "
            f"{least_mem / GB:.2f} GB; raise the limit, add pipeline stages or use more TP ranks.",
        )
    last = len(kinds) - 1
    variables = [[i] for i in range(1, last)] + ([[0, last]] if model.tie_embeddings else [[0], [last]])
    n_cands = [len(c) for c in cands]

    def score(choice: np.ndarray) -> tuple[float, float, float]:
        j, total, _, mem_u = tables.evaluate(choice)
        return j, total, float(mem_u.max())

    def rank(v: tuple[float, float, float]) -> tuple[float, float, float]:
        """J, then peak memory, then summed stage time (equal to 12 digits: float noise is a tie)."""
        return float(f"{v[0]:.12g}"), float(f"{v[2]:.12g}"), v[1]

    scored: dict[tuple[int, ...], tuple[float, float, float]] = {}
    layer_cands = n_cands[1] if last > 1 else 1
    for e in range(n_cands[0]):
        for lc in range(layer_cands):
            for h in [e] if model.tie_embeddings else range(n_cands[last]):
                choice = np.array([e] + [min(lc, n_cands[i] - 1) for i in range(1, last)] + [h])
                scored.setdefault(tuple(int(c) for c in choice), score(choice))
    considered = len(scored)
    starts = [highest]
    fitting = sorted((rank(v), k) for k, v in scored.items() if v[2] <= limit)
    if fitting:
        starts.append(np.array(fitting[0][1]))
    for start in starts:
        choice = _descend(tables, start, variables, n_cands, limit)
        key = tuple(int(c) for c in choice)
        if key not in scored:
            considered += 1
        scored.setdefault(key, score(choice))
    order = sorted((rank(v), k) for k, v in scored.items() if v[2] <= limit)

    def make_plan(choice: Sequence[int]) -> Plan:
        j, _, period, mem_u = tables.evaluate(np.array(choice))
        layer_tp = [cands[i][c] for i, c in enumerate(choice)]
        validate_layer_tp(model, tp, replica_tp, layer_tp)
        plan_split, plan_shares = split, shares
        if capacity == "work":
            plan_split, plan_shares = trainer_split(layer_tp)
            j = max(w * float(period[sizes.index(n)]) for w, n in zip(plan_shares, replica_tp, strict=True))
        table = []
        for name, kind, t in zip(names, kinds, layer_tp, strict=True):
            eff = effective_degree(t, sizes[0])
            ic = cost(kind, eff)
            table.append(PlanRow(name, t, eff, ic.flops, ic.comm_bytes, ic.time_s, ic.memory_bytes / GB))
        return Plan(
            layer_tp=layer_tp,
            batch_shares=list(plan_shares),
            table=table,
            tp=tp,
            replica_tp=replica_tp,
            microbatch_time_s=[float(period[sizes.index(n)]) for n in replica_tp],
            memory_gb=[float(mem_u[sizes.index(n)]) / GB for n in replica_tp],
            time_per_microbatch_s=j,
            microbatches=list(plan_split or []),
        )

    return Ranking([make_plan(k) for _, k in order], considered)
