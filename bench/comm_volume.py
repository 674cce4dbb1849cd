"""Communication volume per rank per optimizer step: measured against the analytical minimum, and the
fragment holder-set DP sync against a Megatron-style gather-to-core sync.

    python bench/comm_volume.py [--model gpt_tiny] [--seq-len 128] [--micro-batch 2] [--global-batch 12]
                                [--layouts tp2,(2,1),...]

Each layout runs one optimizer step of the model on gloo worker processes through `NTPRuntime` (the code
NTPStrategy runs), with `torch.distributed.all_reduce` wrapped to record every call: its payload (the
bytes of the tensor handed to it), its process group and its call site (row-parallel/embedding output,
column-parallel input gradient, vocab-parallel cross entropy, DP gradient sync, scalar reductions).

Accounting ("bytes per rank" = payload a rank hands to its collectives; a ring all-reduce of B bytes
over n ranks puts 2(n-1)/n * B on each rank's link, which the gather-to-core comparison also reports):
- TP minimum (Megatron-LM tensor parallelism without sequence parallelism, fused QKV and fused MLP
  input projections), per micro-batch of b x s tokens and hidden size h, in each layer's TP subgroup
  when its degree is above 1: forward one all-reduce of b*s*h for the vocab-parallel embedding and two
  per transformer layer; backward two per layer plus one for the output head's input; the
  vocab-parallel cross entropy needs the max (b*s) and the two per-token sums (2*b*s) in two calls.
  A rank's replica runs its capacity share of the micro-batches, so the minimum scales with it.
- DP minimum: every gradient element a rank holds is held by every other replica, so with two or more
  replicas the rank all-reduces its whole local gradient once (one call: it fits one 25 MB bucket);
  with one replica nothing has to move.
- Scalars (the squared gradient norm and the loss, 8 bytes each) are listed apart.
The ratio columns divide the measured bytes by these minima.

Gather-to-core (Megatron-LM's NTP DP sync), implemented here: R = the smallest replica's TP degree; in
every larger replica the ranks send the parts of their gradient shards that lie in a core rank's
R-way interval to that core rank (slot k < R); core ranks all-reduce their R-way shards (and the
replicated parameters) with the matching core rank of every other replica; then they send the
reduced parts back. Both syncs are run on the same gradients and must give the same result.

`--sequence-parallel`: each layout runs the same step with `ntp.sequence_parallel` off and on, with
`all_gather_single`/`reduce_scatter_single` wrapped too (ring model: an all-gather of a B-byte piece
puts (n-1) B on a rank's link, a reduce-scatter of B (n-1)/n B), and compares, per rank, the
activation all-reduces of TP without SP (forward and backward, cross entropy apart) with the
reduce-scatters and all-gathers that replace them; the backward's second all-gather of each
column-parallel input (only the slice is kept for the backward), the re-splits between degrees and the
all-reduces of the replicated parameters' gradients are listed apart.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `python bench/comm_volume.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 1234
SITES = {
    ("comm.py", "forward"): "tp_fwd",
    ("comm.py", "backward"): "tp_bwd",
    ("layers.py", "forward"): "tp_ce",
    ("grad_sync.py", "_reduce"): "dp",
    ("grad_sync.py", "_reduce_in_place"): "dp",
    ("grad_sync.py", "clip_grad_norm_"): "scalar",
    ("runtime.py", "global_sum"): "scalar",
    ("comm_volume.py", "gather_to_core"): "g2c",
}


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    replica_tp: tuple[int, ...]
    layer_tp: tuple[int, ...] | None = None  # embedding, each layer, head; None = all at tp

    def degrees(self, num_layers: int) -> list[int]:
        return list(self.layer_tp) if self.layer_tp else [self.tp] * (num_layers + 2)

    @property
    def kind(self) -> str:
        if self.layer_tp and len(set(self.layer_tp)) > 1:
            return "per-layer"
        return "uniform" if len(set(self.replica_tp)) == 1 else "NTP"


LAYOUTS = [
    Layout("tp2", 2, (2,)),
    Layout("tp4", 4, (4,)),
    Layout("dp2", 1, (1, 1)),
    Layout("dp2xtp2", 2, (2, 2)),
    Layout("(2,1)", 2, (2, 1)),
    Layout("(3,2)", 3, (3, 2)),
    Layout("(4,3)", 4, (4, 3)),
    Layout("tp4 layers 4-2-4-2-4-4", 4, (4,), (4, 2, 4, 2, 4, 4)),
    Layout("(4,3) layers 4-2-4-2-4-4", 4, (4, 3), (4, 2, 4, 2, 4, 4)),
]


# ---- counting --------------------------------------------------------------------------------------
class CommLog:
    """Per-rank tally of collectives: (site, in/cross replica) -> [calls, payload bytes, ring-model bytes]."""

    def __init__(self, topology) -> None:
        self.topology = topology
        self.tally: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def scope(self, ranks) -> str:
        return "in" if len({self.topology.coord(r).replica for r in ranks}) == 1 else "cross"

    def add(self, site: str, ranks, nbytes: int, ring: bool = True) -> None:
        n = len(ranks)
        rec = self.tally[(site, self.scope(ranks))]
        rec[0] += 1
        rec[1] += nbytes
        rec[2] += 2 * (n - 1) / n * nbytes if ring else nbytes

    @contextmanager
    def wrapping_all_reduce(self) -> Iterator[None]:
        original = dist.all_reduce

        def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            caller = sys._getframe(1).f_code
            if caller.co_name == "all_reduce_on":  # comm.py's device-checked all-reduce: its caller counts
                caller = sys._getframe(2).f_code
            site = SITES.get(
                (os.path.basename(caller.co_filename), caller.co_name), f"other:{caller.co_name}"
            )
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            self.add(site, list(ranks), tensor.numel() * tensor.element_size())
            return original(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counted
        try:
            yield
        finally:
            dist.all_reduce = original

    @contextmanager
    def wrapping_sequence_collectives(self) -> Iterator[None]:
        """Also count the sequence-parallel all-gathers and reduce-scatters, labelled by what they do."""
        gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

        def site(op: str) -> str:
            caller = sys._getframe(3).f_code  # autograd function -> _all_gather_seq / _reduce_scatter_seq
            name = getattr(caller, "co_qualname", caller.co_name)
            if name == "_GatherProject.backward" and op == "ag":
                return "sp_regather"
            if name in ("_Resplit.forward", "_Resplit.backward") or caller.co_name == "_move":
                return "sp_resplit"
            return f"sp_{op}_{'bwd' if name.endswith('backward') else 'fwd'}"

        def counted_gather(out, inp, group=None, async_op=False):
            ranks = dist.get_process_group_ranks(group)
            self.add(site("ag"), ranks, 0)
            rec = self.tally[(site("ag"), self.scope(ranks))]
            rec[1] += inp.numel() * inp.element_size()
            rec[2] += (len(ranks) - 1) * inp.numel() * inp.element_size()
            return gather(out, inp, group=group, async_op=async_op)

        def counted_scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
            ranks = dist.get_process_group_ranks(group)
            self.add(site("rs"), ranks, 0)
            rec = self.tally[(site("rs"), self.scope(ranks))]
            rec[1] += inp.numel() * inp.element_size()
            rec[2] += (len(ranks) - 1) / len(ranks) * inp.numel() * inp.element_size()
            return scatter(out, inp, op=op, group=group, async_op=async_op)

        dist.all_gather_single, dist.reduce_scatter_single = counted_gather, counted_scatter
        try:
            yield
        finally:
            dist.all_gather_single, dist.reduce_scatter_single = gather, scatter

    def total(self, prefix: str) -> tuple[int, int]:
        recs = [v for (site, _), v in self.tally.items() if site.startswith(prefix)]
        return int(sum(r[0] for r in recs)), int(sum(r[1] for r in recs))


# ---- analytical minimum ----------------------------------------------------------------------------
def tp_minimum(topology, rank: int, cfg, micro: int, b: int, s: int, elem: int) -> dict[str, tuple[int, int]]:
    """(calls, bytes) per TP site of Megatron-style tensor parallelism for `micro` micro-batches."""
    bsh, bs = b * s * cfg.hidden_size * elem, b * s * elem
    sharded = [len(topology.layer_group_ranks(rank, slot)) > 1 for slot in range(cfg.num_layers + 2)]
    head = 0 if cfg.tie_embeddings else cfg.num_layers + 1
    layers = sum(sharded[1:-1])
    fwd = (2 * layers + sharded[0], (2 * layers + sharded[0]) * bsh)
    bwd = (2 * layers + sharded[head], (2 * layers + sharded[head]) * bsh)
    ce = (2, 3 * bs) if sharded[head] else (0, 0)
    return {k: (v[0] * micro, v[1] * micro) for k, v in (("tp_fwd", fwd), ("tp_bwd", bwd), ("tp_ce", ce))}


# ---- gather-to-core sync ---------------------------------------------------------------------------
def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _piece(grad: torch.Tensor, desc: tuple, part: tuple[int, int], base: int) -> torch.Tensor:
    """Units `part` of a tensor holding units from `base` on (a gradient or a core buffer)."""
    _, dim, unit, *_ = desc
    return grad.narrow(dim, (part[0] - base) * unit, (part[1] - part[0]) * unit)


def core_groups(topology) -> list[tuple[int, ...]]:
    r_min = min(topology.replica_tp)
    return [tuple(sorted(topology.stage_ranks(r)[k] for r in range(topology.dp))) for k in range(r_min)]


def gather_to_core(model, topology, rank: int, everyone: list[dict], log: CommLog) -> None:
    """Megatron-style NTP gradient sync (uniform layer degrees); replaces the gradients in place."""
    me = topology.coord(rank)
    mine = topology.stage_ranks(me.replica)
    small = topology.replica_tp.index(min(topology.replica_tp))
    cores = topology.stage_ranks(small)  # their intervals are the R-way layout
    R = len(cores)
    grads = {n: p.grad for n, p in model.named_parameters()}
    dtype = next(iter(grads.values())).dtype
    names = sorted(grads)
    replicated = [n for n in names if all(_is_full(desc[n]) for desc in everyone)]
    sharded = [n for n in names if n not in replicated]

    def interval(r: int, n: str) -> tuple[int, int]:
        return everyone[r][n][3], everyone[r][n][4]

    def target(k: int, n: str) -> tuple[int, int]:
        return interval(cores[k], n)

    def pieces(src_slot: int, k: int) -> list[tuple[str, tuple[int, int]]]:
        """Sharded-parameter parts that slot `src_slot` of this replica holds inside core k's interval."""
        out = []
        for n in sharded:
            part = _overlap(interval(mine[src_slot], n), target(k, n))
            if part is not None:
                out.append((n, part))
        return out

    def exchange(sends: dict[int, torch.Tensor], recv_sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        reqs, bufs = [], {}
        for src, size in recv_sizes.items():
            bufs[src] = torch.empty(size, dtype=dtype)
            reqs.append(dist.irecv(bufs[src], src=src))
        for dst, flat in sends.items():
            reqs.append(dist.isend(flat, dst=dst))
            log.add("g2c_p2p", [rank, dst], flat.numel() * flat.element_size(), ring=False)
        for req in reqs:
            req.wait()
        return bufs

    def numel(parts) -> int:
        return sum(_piece_numel(everyone[rank][n], p) for n, p in parts)

    # 1. Gather: every non-core part of a core interval travels to its core rank (inside the replica).
    k_me = me.slot if me.slot < R else None
    sends, recv_sizes = {}, {}
    for k in range(R):
        if k == me.slot:
            continue
        parts = pieces(me.slot, k)
        if parts:
            sends[mine[k]] = torch.cat(
                [_piece(grads[n], everyone[rank][n], p, interval(rank, n)[0]).reshape(-1) for n, p in parts]
            )
    if k_me is not None:
        for j in range(len(mine)):
            if j != me.slot and pieces(j, k_me):
                recv_sizes[mine[j]] = numel(pieces(j, k_me))
    received = exchange(sends, recv_sizes)

    # 2. Core ranks build their R-way shards and all-reduce them with the other replicas' core ranks.
    if k_me is not None:
        buffers = {}
        for n in sharded:
            lo, hi = target(k_me, n)
            desc = everyone[rank][n]
            shape = list(grads[n].shape)
            shape[desc[1]] = (hi - lo) * desc[2]
            buffers[n] = torch.zeros(shape, dtype=grads[n].dtype)
        for j in range(len(mine)):
            parts = pieces(j, k_me)
            if j == me.slot:
                for n, p in parts:
                    _piece(buffers[n], everyone[rank][n], p, target(k_me, n)[0]).copy_(
                        _piece(grads[n], everyone[rank][n], p, interval(rank, n)[0])
                    )
            elif parts:
                offset, flat = 0, received[mine[j]]
                for n, p in parts:
                    view = _piece(buffers[n], everyone[rank][n], p, target(k_me, n)[0])
                    view.copy_(flat[offset : offset + view.numel()].view(view.shape))
                    offset += view.numel()
        flat = torch.cat(
            [buffers[n].reshape(-1) for n in sharded] + [grads[n].reshape(-1) for n in replicated]
        )
        group_ranks = core_groups(topology)[k_me]
        dist.all_reduce(flat, group=topology.group(group_ranks))
        offset = 0
        for t in [buffers[n] for n in sharded] + [grads[n] for n in replicated]:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        for n, p in pieces(me.slot, k_me):
            _piece(grads[n], everyone[rank][n], p, interval(rank, n)[0]).copy_(
                _piece(buffers[n], everyone[rank][n], p, target(k_me, n)[0])
            )

    # 3. Scatter back: reduced parts (and, for non-core ranks, the replicated parameters) return to holders.
    sends, recv_sizes = {}, {}
    rep_numel = sum(grads[n].numel() for n in replicated)
    if k_me is not None:
        for j in range(len(mine)):
            if j == me.slot:
                continue
            parts = [
                _piece(buffers[n], everyone[rank][n], p, target(k_me, n)[0]).reshape(-1)
                for n, p in pieces(j, k_me)
            ]
            if j >= R and j % R == k_me:
                parts += [grads[n].reshape(-1) for n in replicated]
            if parts:
                sends[mine[j]] = torch.cat(parts)
    for k in range(R):
        if k == me.slot:
            continue
        size = numel(pieces(me.slot, k)) + (rep_numel if me.slot >= R and me.slot % R == k else 0)
        if size:
            recv_sizes[mine[k]] = size
    received = exchange(sends, recv_sizes)
    for k, flat in ((k, received[mine[k]]) for k in range(R) if mine[k] in received):
        offset = 0
        views = [_piece(grads[n], everyone[rank][n], p, interval(rank, n)[0]) for n, p in pieces(me.slot, k)]
        if me.slot >= R and me.slot % R == k:
            views += [grads[n] for n in replicated]
        for v in views:
            v.copy_(flat[offset : offset + v.numel()].view(v.shape))
            offset += v.numel()


def _piece_numel(desc: tuple, part: tuple[int, int]) -> int:
    shape, dim, unit, *_ = desc
    return (part[1] - part[0]) * unit * math.prod(shape) // shape[dim]


def partitioned(topology, everyone: list[dict]) -> bool:
    """Gather-to-core needs every replica to split every sharded parameter into disjoint intervals."""
    for r in range(topology.dp):
        ranks = topology.stage_ranks(r)
        for n, desc in everyone[ranks[0]].items():
            if _is_full(desc):
                continue
            spans = sorted((everyone[q][n][3], everyone[q][n][4]) for q in ranks)
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
                return False
    return True


def _is_full(desc: tuple) -> bool:
    shape, dim, unit, lo, hi, _ = desc
    return lo == 0 and (not shape or hi * unit == shape[dim])


# ---- the worker ------------------------------------------------------------------------------------
def worker(rank: int, world: int, layout: Layout, cfg, batch: tuple[int, int, int], sp: bool = False) -> dict:
    from ntp_nemo.parallel.grad_sync import param_descriptors
    from ntp_nemo.runtime.assemble import assemble
    from ntp_nemo.topology import ResolvedLayout, Topology

    mbs, seq, global_batch = batch
    topo = Topology(layout.tp, layout.replica_tp, layout.degrees(cfg.num_layers))
    # The optimizer's hyperparameters change no byte this bench counts.
    from tests.shapes import adamw

    optim = adamw(1e-4, weight_decay=0.0)
    state = assemble(ResolvedLayout.make(topo, sequence_parallel=sp), rank, cfg, optim, None, seed=SEED)
    rt, model, sync = state.runtime, state.model, state.grad_path.sync
    everyone: list = [None] * world
    dist.all_gather_object(everyone, param_descriptors(model))
    do_g2c = not sp and layout.kind != "per-layer" and topo.dp > 1 and partitioned(topo, everyone)
    if do_g2c:
        topo.build_groups(extra=core_groups(topo))
    hook_bytes = []
    sync.counter = lambda kind, nbytes, holders: hook_bytes.append(nbytes)
    gen = torch.Generator().manual_seed(SEED)
    toks = torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), generator=gen)
    micro = rt.my_microbatches(global_batch // mbs)
    log, g2c_log = CommLog(topo), CommLog(topo)
    with log.wrapping_all_reduce(), log.wrapping_sequence_collectives():
        loss = rt.train_microbatches(
            model, [toks[i * mbs : (i + 1) * mbs] for i in micro], global_batch * seq
        )
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        sync.sync()
        holder_set = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss = float(rt.global_sum(loss)) / (global_batch * seq)
        sync.clip_grad_norm_(1.0)
    diff = None
    if do_g2c:
        for n, p in model.named_parameters():
            p.grad.copy_(before[n])
        with g2c_log.wrapping_all_reduce():
            gather_to_core(model, topo, rank, everyone, g2c_log)
        # Relative to the largest gradient element: some gradients are zero in theory and rounding noise here.
        diff = max(float((p.grad - holder_set[n]).abs().max()) for n, p in model.named_parameters()) / max(
            float(g.abs().max()) for g in holder_set.values()
        )
    elem = next(model.parameters()).element_size()
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": rank,
        "replica": topo.coord(rank).replica,
        "slot": topo.coord(rank).slot,
        "micro": len(micro),
        "loss": loss,
        "tally": {f"{k[0]}|{k[1]}": v for k, v in log.tally.items()},
        "g2c": {f"{k[0]}|{k[1]}": v for k, v in g2c_log.tally.items()},
        "g2c_diff": diff,
        "tp_min": tp_minimum(topo, rank, cfg, len(micro), mbs, seq, elem),
        "dp_min": (1, local_bytes) if topo.dp > 1 else (0, 0),
        "hook_bytes": sum(hook_bytes),
    }


# ---- report ----------------------------------------------------------------------------------------
TP_SITES = ("tp_fwd", "tp_bwd", "tp_ce")


def _sum(tally: dict, site: str, scope: str | None = None, col: int = 1) -> float:
    """Column `col` (0 calls, 1 payload bytes, 2 ring-model bytes) of one site, optionally one scope."""
    return sum(
        v[col] for k, v in tally.items() if k.split("|")[0] == site and scope in (None, k.split("|")[1])
    )


def _kb(x: float) -> str:
    return f"{x / 1024:9.1f}"


def _ratio(measured: float, minimum: float) -> str:
    if minimum == 0:
        return "   -  " if measured == 0 else "  >min"
    return f"{measured / minimum:6.3f}"


def report(layout: Layout, results: list[dict]) -> dict:
    """Per-rank table; returns the (min, max) over ranks of the TP and DP ratios and the DP excess."""
    print(
        f"\n{layout.name} [{layout.kind}]  replica TP {list(layout.replica_tp)}, "
        f"micro-batches per rank {[r['micro'] for r in results]}"
    )
    print(
        " rank rep slot | TP calls   TP KiB  min calls  min KiB  ratio | DP calls   DP KiB (in-replica)"
        "  min KiB  ratio | scalars"
    )
    ratios: dict[str, list[float]] = {"tp": [], "dp": []}
    excess = 0.0
    for r in results:
        t = r["tally"]
        tp_calls = int(sum(_sum(t, s, col=0) for s in TP_SITES))
        tp_bytes = sum(_sum(t, s) for s in TP_SITES)
        min_calls = sum(v[0] for v in r["tp_min"].values())
        min_bytes = sum(v[1] for v in r["tp_min"].values())
        dp_calls, dp_bytes, dp_in = int(_sum(t, "dp", col=0)), _sum(t, "dp"), _sum(t, "dp", "in")
        if dp_bytes != r["hook_bytes"]:
            raise RuntimeError(
                f"rank {r['rank']}: the all_reduce wrapper saw {dp_bytes} DP bytes, "
                f"GradientSynchronizer.counter {r['hook_bytes']}"
            )
        print(
            f" {r['rank']:4d} {r['replica']:3d} {r['slot']:4d} | {tp_calls:8d} {_kb(tp_bytes)} "
            f"{min_calls:10d} {_kb(min_bytes)} {_ratio(tp_bytes, min_bytes)} | {dp_calls:8d} {_kb(dp_bytes)} "
            f"{_kb(dp_in)}  {_kb(r['dp_min'][1])} {_ratio(dp_bytes, r['dp_min'][1])} | "
            f"{int(_sum(t, 'scalar', col=0))} x 8 B"
        )
        others = sorted(k for k in t if k.startswith("other:"))
        if others:
            print(f"      unclassified collectives: {others}")
        if min_bytes:
            ratios["tp"].append(tp_bytes / min_bytes)
        if r["dp_min"][1]:
            ratios["dp"].append(dp_bytes / r["dp_min"][1])
        else:
            excess = max(excess, dp_bytes)
    first = results[0]
    sites = ", ".join(
        f"{s} {int(_sum(first['tally'], s, col=0))} calls / {_sum(first['tally'], s) / 1024:.1f} KiB "
        f"(min {first['tp_min'][s][0]} / {first['tp_min'][s][1] / 1024:.1f})"
        for s in TP_SITES
    )
    print(f"  rank 0 by site: {sites}")
    out: dict = {k: (min(v), max(v)) if v else None for k, v in ratios.items()}
    out["dp_excess"] = excess
    return out


def report_g2c(layout: Layout, results: list[dict]) -> None:
    print(
        f"  DP sync of {layout.name}: fragment holder-set vs gather-to-core (per rank: KiB payload, "
        "[KiB sent in a ring model])"
    )
    print(
        "   rank slot | holder-set in-replica       cross-replica | gather-to-core in-replica (p2p)"
        "       cross-replica"
    )
    tot: dict[str, float] = defaultdict(float)
    for r in results:
        h, g = r["tally"], r["g2c"]
        h_in, h_cross = _sum(h, "dp", "in"), _sum(h, "dp", "cross")
        h_in_w, h_cross_w = _sum(h, "dp", "in", 2), _sum(h, "dp", "cross", 2)
        g_p2p, g_cross, g_cross_w = _sum(g, "g2c_p2p"), _sum(g, "g2c", "cross"), _sum(g, "g2c", "cross", 2)
        for key, val in (("h_in", h_in_w), ("h_cross", h_cross_w), ("g_in", g_p2p), ("g_cross", g_cross_w)):
            tot[key] += val
        print(
            f"   {r['rank']:4d} {r['slot']:4d} | {_kb(h_in)} [{_kb(h_in_w)}] {_kb(h_cross)} "
            f"[{_kb(h_cross_w)}] | {_kb(g_p2p)} [{_kb(g_p2p)}]      {_kb(g_cross)} [{_kb(g_cross_w)}]"
        )
    print(
        f"   all ranks, KiB sent (ring model): holder-set in-replica {tot['h_in'] / 1024:.1f}, cross-replica "
        f"{tot['h_cross'] / 1024:.1f}; gather-to-core in-replica {tot['g_in'] / 1024:.1f}, cross-replica "
        f"{tot['g_cross'] / 1024:.1f}"
    )
    diff = max(r["g2c_diff"] for r in results)
    print(
        f"   same gradients: max difference between the two syncs {diff:.1e} of the largest gradient element"
    )
    if diff > 1e-6:
        raise RuntimeError(f"gather-to-core and holder-set syncs disagree on {layout.name}: {diff:.2e}")


SP_SITES = ("sp_ag_fwd", "sp_rs_fwd", "sp_ag_bwd", "sp_rs_bwd")


def report_sp(layout: Layout, off: list[dict], on: list[dict]) -> list[float]:
    """Per rank: TP activation all-reduce bytes without SP against the SP collectives replacing them
    (ring model, KiB per step); returns the ratios."""
    print(f"\n{layout.name} [{layout.kind}] sequence parallelism: KiB on each rank's link per step "
          "(ring model)")
    print(" rank | AR fwd+bwd (off) | AG+RS fwd+bwd (on)  ratio | bwd re-gather  re-split  param AR "
          "| loss off-on")
    ratios = []
    for a, b in zip(off, on, strict=True):
        ar = _sum(a["tally"], "tp_fwd", col=2) + _sum(a["tally"], "tp_bwd", col=2)
        sp = sum(_sum(b["tally"], s, col=2) for s in SP_SITES)
        if ar:
            ratios.append(sp / ar)
        regather, resplit = _sum(b["tally"], "sp_regather", col=2), _sum(b["tally"], "sp_resplit", col=2)
        print(f" {a['rank']:4d} | {_kb(ar):>16s} | {_kb(sp):>18s} {_ratio(sp, ar)} | "
              f"{_kb(regather):>13s} {_kb(resplit)} {_kb(_sum(b['tally'], 'tp_bwd', col=2))} | "
              f"{abs(a['loss'] - b['loss']):.1e}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_tiny", help="model config group option (conf/model)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument(
        "--layouts",
        default=",".join(lay.name for lay in LAYOUTS),
        help="comma-separated names from: " + "; ".join(lay.name for lay in LAYOUTS),
    )
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="compare each layout's TP traffic with ntp.sequence_parallel off and on")
    args = ap.parse_args()
    from _common import compose, model_config

    from ntp_nemo.launch.workers import run_workers

    cfg = model_config(compose([f"model={args.model}"]))
    names = _split_names(args.layouts)
    unknown = names - {lay.name for lay in LAYOUTS}
    if unknown:
        ap.error(f"unknown layouts {sorted(unknown)}")
    batch = (args.micro_batch, args.seq_len, args.global_batch)
    print(
        f"comm volume: model {cfg.name} (h={cfg.hidden_size}, L={cfg.num_layers}, heads={cfg.num_heads}, "
        f"vocab={cfg.vocab_size}), float32, micro-batch {args.micro_batch} x seq {args.seq_len}, "
        f"global batch {args.global_batch}; bytes per rank per optimizer step"
    )
    if args.sequence_parallel:
        sp_summary = []
        for lay in (lay for lay in LAYOUTS if lay.name in names):
            off = run_workers(worker, sum(lay.replica_tp), lay, cfg, batch, False)
            on = run_workers(worker, sum(lay.replica_tp), lay, cfg, batch, True)
            sp_summary.append((lay, report_sp(lay, off, on)))
        print("\nsummary: SP all-gather + reduce-scatter / the all-reduces they replace (min..max over "
              "ranks)")
        for lay, ratios in sp_summary:
            span = f"{min(ratios):6.3f}..{max(ratios):6.3f}" if ratios else "-"
            print(f" {lay.name:28s} {span}")
        return
    summary = []
    for lay in (lay for lay in LAYOUTS if lay.name in names):
        res = run_workers(worker, sum(lay.replica_tp), lay, cfg, batch)
        summary.append((lay, report(lay, res)))
        if res[0]["g2c_diff"] is not None:
            report_g2c(lay, res)
    print("\nsummary: measured / minimum bytes per rank (min..max over ranks)")
    print(f" {'layout':28s} {'kind':9s} {'TP':>15s} {'DP':>15s}")

    def fmt(pair) -> str:
        return f"{'-':>15s}" if pair is None else f"{pair[0]:6.3f}..{pair[1]:6.3f}"

    for lay, ratios in summary:
        excess = f"+{ratios['dp_excess'] / 1024:.1f} KiB"
        dp = fmt(ratios["dp"]) if ratios["dp"] else f"{excess:>15s}"
        print(f" {lay.name:28s} {lay.kind:9s} {fmt(ratios['tp'])} {dp}")
    print(" (DP '+X KiB': one replica, so nothing has to move, yet X KiB per rank are all-reduced inside it)")


def _split_names(text: str) -> set[str]:
    """Layout names contain commas inside parentheses: split only at top-level commas."""
    names, depth, cur = set(), 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            names.add(cur.strip())
            cur = ""
        else:
            cur += ch
    names.add(cur.strip())
    return names


if __name__ == "__main__":
    main()
