"""The in-TP-group straggler rebalance (issue 48): the `rebalance` policy weighs a one-replica job's shards
by measured speed and puts them back when the device recovers (`straggler.decide`), and the live re-layout
(`shard_relayout.relayout`: the same ranks take their new shards from each other's memory, no restart, no
disk) in the middle of training keeps the single-process loss curve (float64, forked gloo workers)."""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.resilience.shard_relayout import relayout
from ntp_nemo.resilience.straggler import (
    StragglerDetector,
    StragglerSettings,
    decide,
    judged_units,
    peer_groups,
    share_units,
)
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.work import WorkShape
from tests.ntp_cases import LLAMA_KV4, OPTIM, SEED

SHAPE = WorkShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                  vocab_size=257, seq_len=32, gated_mlp=False)
WEIGHTS = (1.0, 0.5, 0.75)  # LLAMA_KV4's 8 query heads 3/2/3 over 3 ranks; KV heads 1 and 2 shared


def _judge(det, layout, steps, speed_of_rank):
    """The detector's judgements of `steps` whose compute times are the balanced shares at these speeds (a
    TP group's ranks wait for each other inside every layer: their times follow the group's pace, and a
    slow device's own slowness on top, whatever the weights)."""
    units, peers = judged_units(layout), peer_groups(layout)
    out = [det.observe(s, [1e-9 * u / speed_of_rank(r) for r, u in enumerate(units)], units, peers)
           for s in steps]
    return [j for j in out if j is not None]


def test_where_the_timer_leaves_out_the_tp_exchanges_a_weighted_rank_is_judged_on_its_own_shard():
    """`own_work` (CPU ranks, ntpdirect TP groups: a rank's time is its own shard's work): each rank's time
    is divided by the work of the shards it holds on the weighted layout, so the slow rank on weights
    (1, 0.5), still at half speed, is judged at half speed and the healthy one at full speed; otherwise
    the balanced shares (a GPU's or gloo's times follow the group's pace)."""
    settings = StragglerSettings(every=2, persist=1)
    layout = ResolvedLayout.make(Topology(2, [2], [2] * 4), num_microbatches=6, work=SHAPE, capacity="work")
    weighted = layout.with_changes(shard_speeds=(1.0, 0.5))
    own = judged_units(weighted, own_work=True)
    assert own == share_units(weighted) and judged_units(weighted) == share_units(layout)
    assert own[0] > own[1]  # the healthy rank holds more
    det = StragglerDetector(settings)
    times = [1e-9 * u / (0.5 if r == 1 else 1.0) for r, u in enumerate(own)]
    j = [det.observe(s, times, own, peer_groups(weighted)) for s in (1, 2)][-1]
    assert j.speeds == pytest.approx((1.0, 0.5), rel=1e-6) and j.stragglers == (1,)


def test_rebalance_weighs_a_one_replica_jobs_shards_and_puts_them_back():
    settings = StragglerSettings(every=2, persist=1)
    layout = ResolvedLayout.make(Topology(2, [2], [2] * 4), num_microbatches=6, work=SHAPE, capacity="work")
    det = StragglerDetector(settings)
    (j,) = _judge(det, layout, [1, 2], lambda r: 0.5 if r == 1 else 1.0)
    d = decide(settings, layout, j)
    assert d.layout.shard_speeds == (1.0, 0.5) and d.layout.same_ranks(layout)
    assert d.layout.microbatches == layout.microbatches == (6,)  # one replica: the whole batch
    heads = [d.layout.topology().units_held(r, 1, SHAPE.ffn_hidden_size) for r in range(2)]
    assert heads == [(0, 85), (85, 128)]  # FFN columns 2:1
    # on the weighted layout the slow rank, still at half speed, is judged as it was: nothing changes
    (j,) = _judge(det, d.layout, [3, 4], lambda r: 0.5 if r == 1 else 1.0)
    assert j.stragglers == (1,) and abs(j.speeds[1] - 0.5) < 0.01
    assert decide(settings, d.layout, j).layout is None
    # between the margins (not slow, not yet recovered: 0.8 against 1/1.4 and 1/1.2), the weight stays
    (j,) = _judge(det, d.layout, [5, 6], lambda r: 0.8 if r == 1 else 1.0)
    assert j.stragglers == (1,) and decide(settings, d.layout, j).layout is None
    (j,) = _judge(det, d.layout, [7, 8], lambda r: 1.0)  # the device recovers: balanced again
    assert j.recovered == (1,)
    assert decide(settings, d.layout, j).layout.shard_speeds is None
    # `fault.straggler_shards=off`: nothing a one-replica job can do; two replicas with `on`: both apply,
    # the slow replica's share following its mean speed (0.75), and `auto` there moves the batch only
    assert decide(StragglerSettings(every=2, persist=1, shards="off"), layout, j).layout is None
    two = ResolvedLayout.make(Topology(2, [2, 2], [2] * 4), num_microbatches=7, work=SHAPE, capacity="work")
    (j,) = _judge(StragglerDetector(settings), two, [1, 2], lambda r: 0.5 if r == 1 else 1.0)
    both = decide(StragglerSettings(every=2, persist=1, shards="on"), two, j).layout
    assert both.shard_speeds == (1.0, 0.5, 1.0, 1.0) and both.speeds == (0.75, 1.0)
    assert both.microbatches == (3, 4)
    auto = decide(settings, two, j).layout
    assert auto.shard_speeds is None and auto.speeds == (0.5, 1.0)


def _train_worker(rank: int, world: int, steps: int, plan: dict, qat_at: int = 0) -> dict:
    """`steps` steps of LLAMA_KV4 in float64 (AdamW, clipping) on one replica of `world` TP ranks
    (ntp.shard_align=8); before step `s` of `plan`, a live re-layout to shard weights `plan[s]`
    (None: balanced); before step `qat_at` (and any re-layout then), int8 fake quantisation (QAT)
    calibrated on one fixed batch.  Losses, bytes moved and the FFN columns this rank held at every
    step."""
    from ntp_nemo.runtime.assemble import assemble
    from ntp_nemo.runtime.step import train_step

    cfg = LLAMA_KV4
    layout = ResolvedLayout.make(Topology(world, [world], [world] * 4, shard_align=8), num_microbatches=6)
    state = assemble(layout, rank, cfg, OPTIM, None, seed=SEED, param_dtype=torch.float64)
    losses, moved, held = [], [], []
    for step in range(1, steps + 1):
        if step == qat_at:
            from ntp_nemo.quant.calibrate import quantize_model

            calib = torch.randint(0, cfg.vocab_size, (6, 9), generator=torch.Generator().manual_seed(7))
            mine = state.runtime.my_microbatches(6)
            quantize_model(state.model, "int8", [], [calib[i : i + 1] for i in mine])
        if world > 1 and step in plan:
            old = state

            def build(new_layout, r, old=old):
                return assemble(new_layout, r, cfg, OPTIM, None, seed=SEED, param_dtype=torch.float64,
                                keep=(old.optimizer, old.model), initialize=False,
                                groups_from=old.runtime.topology)

            state, result = relayout(old, old.layout.with_changes(shard_speeds=plan[step]), build)
            old.grad_path.remove()
            moved.append((result.moved_bytes, result.needed_bytes))
        gen = torch.Generator().manual_seed(1000 + step)
        toks = torch.randint(0, cfg.vocab_size, (6, 9), generator=gen)
        mine = state.runtime.my_microbatches(6)
        result = train_step(state, [toks[i : i + 1] for i in mine], toks[:, 1:].numel(), max_norm=1.0)
        losses.append(result.loss)
        spec = next(p.ntp_spec for n, p in state.model.named_parameters() if n.endswith("up_proj.weight"))
        held.append((spec.start, spec.start + spec.length))
    return {"losses": losses, "moved": moved, "held": held}


@pytest.mark.slow
def test_live_relayout_to_weighted_shards_and_back_keeps_the_loss_curve_float64():
    """Balanced at step 1, weighted from step 2, int8 QAT calibrated on the weighted shards from step 3,
    balanced again at step 4: the quantised model's shards are quantised alike on the new layout and its
    amax resharded with the weights (`quant_state.restore_quant_state`, as a checkpoint load)."""
    steps, plan = 4, {2: WEIGHTS, 4: None}
    (single,) = run_workers(_train_worker, 1, steps, plan, 3)
    ranks = run_workers(_train_worker, 3, steps, plan, 3)
    for r in ranks:
        rel = [abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"], strict=True)]
        assert max(rel[:2]) < 1e-10 and max(rel[2:]) < 1e-9, rel  # QAT: tests/quant's float64 bar
    # 70 FFN columns in 9 blocks of 8: balanced 3/3/3 blocks, weighted 1 : 0.5 : 0.75 -> 4/2/3, then balanced
    assert [r["held"][0] for r in ranks] == [(0, 24), (24, 48), (48, 70)]
    assert [r["held"][1] for r in ranks] == [(0, 32), (32, 48), (48, 70)]
    assert [r["held"][3] for r in ranks] == [r["held"][0] for r in ranks]
    for r in ranks:  # only what a rank did not hold moved: the plan's lower bound, both ways
        assert all(0 < m == need for m, need in r["moved"]) and len(r["moved"]) == 2

