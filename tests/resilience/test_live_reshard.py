"""Live reshard after a lost rank equals, bit for bit, a checkpoint load on the new layout.

Every worker trains two AdamW steps on the old layout (float32; ranks built by `assemble`, steps by
`train_step`) and writes a real sharded checkpoint at that step; the lost rank then leaves.  The
survivors join the next generation of process groups on the same store with their new ranks (policy
`ntp`), build the new layout's model from a *different* seed and reshard into it from each other's
memory.  The reference is a third model on the same new layout loaded from the checkpoint with
`load_checkpoint` (the restart path): parameters, Adam moments and steps, and the optimizer
hyperparameters must be identical.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ntp_nemo.checkpoint import load_checkpoint, save_checkpoint
from ntp_nemo.models import build_model
from ntp_nemo.resilience.live import Holding, NoLiveCopy, live_reshard, plan_reshard
from ntp_nemo.resilience.policies import make_policy, replan
from ntp_nemo.resilience.recovery import Generation, recover
from ntp_nemo.resilience.rendezvous import join, leave, run_elastic
from ntp_nemo.runtime.assemble import RankState, assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.shard import ShardSpec
from tests.ntp_cases import GPT, LLAMA, OPTIM

SEED, SEQ, GLOBAL_BATCH, LR, STEPS = 7, 8, 6, 1e-2, 2


def _batch(cfg, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def _setup(layout: ResolvedLayout, rank: int, cfg, seed: int, lr: float, keep=None) -> RankState:
    """Rank `rank` as a run builds it (`assemble`: AdamW with decay and no-decay groups); `keep`: an
    existing (optimizer, old model) re-pointed at the new parameters, as live recovery does."""
    return assemble(layout, rank, cfg, {**OPTIM, "lr": lr}, None, seed=seed, param_dtype=torch.float32,
                    keep=keep)


def _train_step(state: RankState, cfg, step: int, **kwargs):
    toks = _batch(cfg, step)
    micro = [toks[i : i + 1] for i in state.my_microbatches(GLOBAL_BATCH)]
    return train_step(state, micro, toks[:, 1:].numel(), max_norm=None, **kwargs)


def _differences(a_model, a_opt, b_model, b_opt) -> list[str]:
    out = []
    b_params = dict(b_model.named_parameters())
    for name, p in a_model.named_parameters():
        q = b_params[name]
        if p.ntp_spec != q.ntp_spec or not torch.equal(p, q):
            out.append(f"{name} param")
        sa, sb = a_opt.state[p], b_opt.state[q]
        if sorted(sa) != sorted(sb):
            out.append(f"{name} state keys {sorted(sa)} vs {sorted(sb)}")
            continue
        for k in sa:
            if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k]):
                out.append(f"{name} {k}")
    if [g["lr"] for g in a_opt.param_groups] != [g["lr"] for g in b_opt.param_groups]:
        out.append("learning rates")
    return out


def reshard_worker(rank, world, store, cfg, tp, replica_tp, pp, failed, path, align=1):
    layer_tp = [tp] * (cfg.num_layers + 2)
    old = ResolvedLayout.make(Topology(tp, replica_tp, layer_tp, pp, shard_align=align))
    join(store, 0, rank, world)
    state = _setup(old, rank, cfg, SEED, LR)
    model, opt = state.model, state.optimizer
    # The checkpoint's writer and the live source of an element may be different replicas (case
    # pp2-2.1-to-1.1): the run's optimizer keeps every replica's copy bit for bit (on an uneven CPU layout
    # the foreach AdamW, tests/parallel/test_replica_bits.py).
    for step in range(STEPS):
        _train_step(state, cfg, step)
    save_checkpoint(path, model, opt, {"step": STEPS}, step=STEPS)
    plan = replan(old, failed, make_policy("ntp"))
    leave()
    if rank not in plan.assignment:  # the lost rank, or a survivor the new layout leaves idle
        return None
    new_rank = plan.assignment.index(rank)
    join(store, 1, new_rank, len(plan.assignment))
    live = _setup(plan.new, new_rank, cfg, SEED + 1, lr=0.5)  # every value must move
    live_model, live_opt = live.model, live.optimizer
    result = live_reshard(model, opt, live_model, live_opt, old.replica_of(rank))
    ref = _setup(plan.new, new_rank, cfg, SEED + 2, lr=0.5)
    ref_model, ref_opt = ref.model, ref.optimizer
    load_checkpoint(path, ref_model, ref_opt)
    return {
        "new_rank": new_rank,
        "diffs": _differences(live_model, live_opt, ref_model, ref_opt),
        "moved": result.moved_bytes,
        "needed": result.needed_bytes,
        "sent": result.sent_bytes,
        "received": result.received_bytes,
        "params": sum(p.numel() for p in live_model.parameters()),
    }


CASES = {
    "2.2-to-2.1": (LLAMA, 2, [2, 2], 1, [3], 3),
    "3.3-to-3.2": (LLAMA, 3, [3, 3], 1, [4], 5),
    "pp2-2.1-to-1.1": (GPT, 2, [2, 1], 2, [1], 4),  # rank 3 (replica 0, stage 1) is left idle
    "3.3-to-3.2-aligned-16": (LLAMA, 3, [3, 3], 1, [4], 5, 16),  # ntp.shard_align=16
}


@pytest.mark.parametrize("case", list(CASES))
def test_live_reshard_equals_checkpoint_load(case, tmp_path):
    cfg, tp, replica_tp, pp, failed, new_world, *align = CASES[case]
    world = pp * sum(replica_tp)
    results, codes = run_elastic(reshard_worker, world, cfg, tp, replica_tp, pp, failed,
                                 str(tmp_path / "step_000002"), *align, watch=False)
    assert codes == [0] * world
    live = [r for r in results.values() if r is not None]
    assert sorted(r["new_rank"] for r in live) == list(range(new_world))
    for r in live:
        assert r["diffs"] == [], f"new rank {r['new_rank']}: {r['diffs']}"
    # Every rank agrees on the plan's totals; a rank only receives what it lacked, so nothing beyond the
    # lower bound moves, and the sends and receives of all ranks add up to it.
    assert len({(r["moved"], r["needed"]) for r in live}) == 1
    moved = live[0]["moved"]
    assert moved == live[0]["needed"] > 0
    assert sum(r["sent"] for r in live) == sum(r["received"] for r in live) == moved


def _h(lo: int, hi: int, units: int = 4) -> Holding:
    return Holding(ShardSpec.split((units, 3), 0, 1, lo, hi), "float32", 4)


def test_plan_prefers_self_then_own_replica_then_least_loaded_healthy_replica():
    # Old layout (2,2) of a 4-row tensor, plus a third replica: participants 0,1 = replica 0 (rows [0,2),
    # [2,4)), 2 = survivor of replica 1 (rows [0,2)), 3,4 = replica 2. New: participant 2 needs all rows.
    held = [{"w": _h(0, 2)}, {"w": _h(2, 4)}, {"w": _h(0, 2)}, {"w": _h(0, 2)}, {"w": _h(2, 4)}]
    wanted = [{"w": _h(0, 2)}, {"w": _h(2, 4)}, {"w": _h(0, 4)}, {"w": _h(0, 2)}, {"w": _h(2, 4)}]
    plan = plan_reshard(held, wanted, [0, 0, 1, 2, 2])
    into_2 = sorted((p.start, p.stop, p.src) for p in plan.pieces if p.dst == 2)
    assert into_2[0] == (0, 2, 2)  # its own rows stay local
    assert into_2[1][:2] == (2, 4) and into_2[1][2] in (1, 4)  # the lost rows from a healthy holder
    assert plan.moved_bytes == plan.needed_bytes == 2 * 3 * 4
    # Own replica first: a survivor of replica 1 at new position 3 holding rows [2,4) serves participant 2.
    held2 = held[:4] + [{"w": _h(2, 4)}]
    plan2 = plan_reshard(held2, wanted, [0, 0, 1, 2, 1])
    assert {p.src for p in plan2.pieces if p.dst == 2 and p.start == 2} == {4}


def test_no_live_copy_is_reported():
    with pytest.raises(NoLiveCopy, match=r"no survivor holds w elements \[2,4\)"):
        plan_reshard([{"w": _h(0, 2)}], [{"w": _h(0, 4)}], [0])


# ---- in-process recovery: a worker dies mid-run, the survivors finish every step ---------------------
TRAIN_STEPS = 6


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _loss_step(state: RankState, sched, cfg, step: int, die: bool, phase: str, abort: bool = False) -> float:
    backwards = []
    expected = len(state.my_microbatches(GLOBAL_BATCH))

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        backwards.append(1)
        if die and phase == "backward" and len(backwards) == expected:
            os._exit(137)  # gradients computed, the data-parallel sync not started

    def before_update() -> None:  # what `LiveRecovery.check_generation` raises when the word came meanwhile
        raise RuntimeError("generation 0 was aborted during this step; it is not applied and is redone")

    result = _train_step(state, cfg, step, scheduler=sched, backward=backward,
                         before_update=before_update if abort else None)
    if die and phase == "optimizer":  # the step is complete everywhere; the next one finds the rank gone
        os._exit(137)
    return result.loss


def training_worker(pid, world, store, cfg, tp, replica_tp, kills, aborts=frozenset()):
    layer_tp = [tp] * (cfg.num_layers + 2)
    gen = Generation.first(ResolvedLayout.make(Topology(tp, replica_tp, layer_tp)))
    join(store, 0, pid, world)

    def rebuild(layout, rank):  # the same optimizer object, on the new parameters: the scheduler goes on
        return _setup(layout, rank, cfg, SEED, LR, keep=(opt, state.model))

    state = _setup(gen.layout, pid, cfg, SEED, LR)
    opt = state.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    losses, recoveries, step = {}, [], 0
    while step < TRAIN_STEPS:
        kill = kills.get((step, pid))
        try:
            losses[step] = _loss_step(state, sched, cfg, step, kill is not None, kill or "",
                                      abort=(step, pid) in aborts)
            step += 1
        except RuntimeError:  # a peer is gone: gloo reports the closed connection
            try:
                rec = recover(store, gen, pid, step, (state.model, opt), rebuild, make_policy("ntp"),
                              note=losses.get(step - 1))
            except NoLiveCopy as err:  # the caller's cue for the restart path
                return {"fallback": str(err)}
            if rec is None:
                return None
            assert rec.optimizer is opt and isinstance(rec.state, RankState)
            if rec.behind:  # the others completed the step: their state holds it; take it as done
                assert rec.step == step + 1 and rec.reshard.moved_bytes > 0
                losses[step] = rec.note
                sched.step()
            gen, state, step = rec.generation, rec.state, rec.step
            recoveries.append({"layout": gen.layout.describe(), "step": step, "failed": rec.failed,
                               "moved": rec.reshard.moved_bytes, "needed": rec.reshard.needed_bytes,
                               "behind": rec.behind})
    return losses, recoveries


def _reference_losses(cfg) -> list[float]:
    """The failure-free curve, written independently of the runtime: the unsharded model, the whole global
    batch, `torch.optim.AdamW` with weight decay on the matrices only (as a run's optimizer) and the same
    LR warmup."""
    model = build_model(cfg, seed=SEED).float()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    out = []
    for step in range(TRAIN_STEPS):
        toks = _batch(cfg, step)
        loss = model.loss_sum(toks) / toks[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append(float(loss.detach()))
    return out


RECOVERY_CASES = {
    # (layout, {(step, process): phase}, layouts after each failure)
    "backward": ((2, [2, 2]), {(3, 3): "backward"}, ["(2,1)"]),
    "optimizer": ((2, [2, 2]), {(2, 0): "optimizer"}, ["(1,2)"]),
    "two-failures": ((2, [2, 2]), {(1, 3): "backward", (3, 1): "optimizer"}, ["(2,1)", "(1,1)"]),
}


@pytest.mark.parametrize("case", list(RECOVERY_CASES))
def test_survivors_recover_in_process_and_follow_the_failure_free_curve(case):
    (tp, replica_tp), kills, layouts = RECOVERY_CASES[case]
    world = sum(replica_tp)
    results, codes = run_elastic(training_worker, world, LLAMA, tp, replica_tp, kills)
    victims = {pid for _, pid in kills}
    assert [codes[p] for p in sorted(victims)] == [137] * len(victims)
    assert all(codes[p] == 0 for p in range(world) if p not in victims)
    reference = _reference_losses(LLAMA)
    survivors = [results[p] for p in range(world) if p not in victims]
    assert survivors and all(s is not None for s in survivors)
    for losses, recoveries in survivors:
        assert sorted(losses) == list(range(TRAIN_STEPS))
        curve = [losses[s] for s in range(TRAIN_STEPS)]
        assert max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True)) < 1e-4, curve
        assert [r["layout"] for r in recoveries] == layouts
        assert all(r["moved"] == r["needed"] > 0 for r in recoveries)
    failed_at = min(s for s, _ in kills)
    expect_step = failed_at if kills[min(kills)] == "backward" else failed_at + 1
    assert survivors[0][1][0]["step"] == expect_step  # the interrupted step is redone, none skipped


def test_survivors_a_step_apart_agree_and_the_one_behind_takes_the_step_as_done():
    """Process 3 completes step 2 and dies; process 0's step 2 is aborted after its host read and before
    its update (the launcher's word reaching it then, as `LiveRecovery.check_generation` raises), while
    processes 1 and 2 apply step 2 and fail in step 3.  The survivors agree on 3 completed steps; process
    0 holds stale state, is filled from the others (none of its fragments comes from itself), takes step 2
    as done with the loss they report, and every survivor follows the failure-free curve, each step once."""
    results, codes = run_elastic(training_worker, 4, LLAMA, 2, [2, 2], {(2, 3): "optimizer"},
                                 frozenset({(2, 0)}))
    assert codes == [0, 0, 0, 137]
    reference = _reference_losses(LLAMA)
    for pid in (0, 1, 2):
        losses, recoveries = results[pid]
        assert sorted(losses) == list(range(TRAIN_STEPS))
        curve = [losses[s] for s in range(TRAIN_STEPS)]
        assert max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True)) < 1e-4, curve
        assert [(r["layout"], r["step"], r["behind"]) for r in recoveries] == [("(2,1)", 3, pid == 0)]
    assert results[0][0][2] == results[1][0][2]  # the loss process 0 reports is the one computed ahead


def test_no_live_copy_with_one_replica_falls_back():
    # One replica of TP 2: the lost rank's half of every sharded tensor exists nowhere else.
    results, codes = run_elastic(training_worker, 2, LLAMA, 2, [2], {(1, 1): "backward"})
    assert codes == [0, 137]
    assert "no survivor holds" in results[0]["fallback"]


def test_pieces_on_two_devices_travel_in_one_batch_per_device(monkeypatch):
    """On a GPU run AdamW's 0-dim `step` stays on the CPU while the moments are on the GPU: the pieces for
    one peer must not be concatenated across devices, and each device's sends go in a batch of their own
    (gloo carries the CPU half of a `cpu:gloo,cuda:nccl` group, NCCL the other). The meta device stands in
    for the second device here: concatenating a CPU and a meta tensor fails as a CPU and a CUDA one do."""
    import torch.distributed as dist

    from ntp_nemo.checkpoint.state import NamedSlice
    from ntp_nemo.resilience.live import Piece, ReshardPlan, execute_plan
    from ntp_nemo.topology.shard import ShardSpec

    held = {
        "optim/w/exp_avg": NamedSlice(ShardSpec.full((4,)), torch.ones(4, device="meta")),
        "optim/w/step": NamedSlice(ShardSpec.full(()), torch.tensor(3.0)),
        "optim/v/step": NamedSlice(ShardSpec.full(()), torch.tensor(3.0)),
    }
    plan = ReshardPlan([Piece("optim/w/exp_avg", 0, 1, 0, 0, 4, 16), Piece("optim/w/step", 0, 1, 0, 0, 1, 4),
                        Piece("optim/v/step", 0, 1, 0, 0, 1, 4)], 24)
    batches: list[list] = []

    def batch(ops):
        batches.append([(op.tensor.device.type, op.tensor.numel(), op.tag) for op in ops])
        return []

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0: SimpleNamespace(
        tensor=tensor, peer=peer, tag=tag))
    assert execute_plan(plan, 0, held, {}) == (24, 0)
    assert all(len(b) == 1 for b in batches)
    assert sorted(b[0][:2] for b in batches) == [("cpu", 2), ("meta", 4)]  # the two steps, the moment
    assert batches[0][0][2] != batches[1][0][2]  # tags differ by device: one pair, two messages
