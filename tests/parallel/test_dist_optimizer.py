"""Recomputation, the distributed optimizer and the overlapped sync train exactly like the plain run.

Every variant trains 5 AdamW steps (weight-decay groups, warmup-cosine LR, clipping by the global norm
active) on the same NTP layout through the real runtime path; the baseline is the same layout without
options.  float32, Llama-style model (no parameter with an identically-zero gradient, whose float32
noise Adam would amplify), small gradient buckets (several per holder set).  The checkpoint test saves
with the distributed optimizer and resumes on other layouts without it and the reverse.
"""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.checkpoint import load, save_checkpoint
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA
from tests.option_cases import CLIP, STEPS, VARIANTS, options_worker, run_steps, setup

SAVE_AT = 3

# name: (tp, replica_tp, pp, stage_layers)
LAYOUTS = {
    "replicas-2-1": (2, [2, 1], 1, None),
    "replicas-3-2": (3, [3, 2], 1, None),
    "pp2-replicas-2-1": (2, [2, 1], 2, [1, 1]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_option_and_all_together_match_the_baseline(layout):
    tp, replica_tp, pp, stage_layers = LAYOUTS[layout]
    # Selective recomputation has no communication inside: checked on (2, 1) only (TP 2 and TP 1 layers).
    variants = [v for v in VARIANTS if v != "selective" or layout == "replicas-2-1"]
    results = run_workers(options_worker, pp * sum(replica_tp), LLAMA, tp, replica_tp, pp, stage_layers,
                          variants)
    for rank, res in enumerate(results):
        assert res["norms"][0] > CLIP, "clipping must be active in the compared steps"
        assert res["moved"] > 1e-3, "the parameters must have moved"
        for name in variants[1:]:
            assert res[name]["loss"] <= 1e-4, (layout, rank, name, res[name])
            assert res[name]["param"] <= 1e-6, (layout, rank, name, res[name])


def _topology(replica_tp: list[int]) -> Topology:
    tp = max(replica_tp)
    return Topology(tp, replica_tp, [tp] * (LLAMA.num_layers + 2))


def resume_worker(rank: int, world: int, replica_tp: list[int], distributed: bool, load_from: str | None,
                  save_to: str | None, start: int, stop: int) -> dict:
    """Train steps start..stop-1, resuming from `load_from` (if given), saving to `save_to` at step
    `SAVE_AT`; with `load_from`, also continue a second copy resumed without the optimizer state."""
    rt = RankPlace(ResolvedLayout.make(_topology(replica_tp)), rank)
    out = {}
    for key, with_optimizer in (("losses", True), ("without_state", False)):
        if key == "without_state" and load_from is None:
            break
        run = setup(rt, LLAMA, distributed=distributed)
        for _ in range(start):
            run.sched.step()  # the LR schedule's position (the scheduler is not part of this checkpoint)
        if load_from is not None:
            load(load_from, run.model, run.opt if with_optimizer else None)
        losses = []
        for step in range(start, stop):
            if step == SAVE_AT and save_to is not None and with_optimizer:
                save_checkpoint(save_to, run.model, run.opt, step=step)
            losses += run_steps(rt, run, LLAMA, step, step + 1)[0]
        out[key] = losses
    return out


@pytest.mark.slow
def test_checkpoint_is_topology_independent_with_and_without_the_distributed_optimizer(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # Distributed optimizer on replicas (2, 1): 5 uninterrupted steps, saved after 3.
    ref = run_workers(resume_worker, 3, [2, 1], True, None, a, 0, STEPS)[0]["losses"]
    # Resumed without it on DP 2 x TP 1, where the plain optimizer saves again right away ...
    cont = run_workers(resume_worker, 2, [1, 1], False, a, b, SAVE_AT, STEPS)[0]
    # ... and that plain checkpoint resumed with the distributed optimizer on (2, 1).
    back = run_workers(resume_worker, 3, [2, 1], True, b, None, SAVE_AT, STEPS)[0]
    for losses in (cont["losses"], back["losses"]):
        assert len(losses) == STEPS - SAVE_AT
        for got, want in zip(losses, ref[SAVE_AT:], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, ref)
    # Resuming the weights without the optimizer state continues differently: the state mattered.
    for losses in (cont["without_state"], back["without_state"]):
        assert abs(losses[-1] - ref[-1]) > 1e-5 * abs(ref[-1]), (losses, ref)


def test_planner_counts_the_sharded_optimizer_state():
    from ntp_nemo.planner import DeviceModel, plan_layout
    from tests.planner.test_plan import SLOW_LINKS, SMALL

    dev = DeviceModel(peak_tflops=1.0, efficiency=1.0)
    free = plan_layout(SMALL, 4, [4, 4, 4, 4], 64, 1, SLOW_LINKS, device=dev)
    free_dist = plan_layout(SMALL, 4, [4, 4, 4, 4], 64, 1, SLOW_LINKS, device=dev, distributed_optimizer=True)
    assert free.layer_tp == free_dist.layer_tp == [1] * 6  # slow links: no TP unless memory forces it
    # 4 + 12 / 4 of the 16 state bytes per parameter (activations unchanged)
    assert max(free_dist.memory_gb) < 0.6 * max(free.memory_gb)
    limit = 0.7 * max(free.memory_gb)
    tight = plan_layout(SMALL, 4, [4, 4, 4, 4], 64, 1, SLOW_LINKS, limit, device=dev)
    relaxed = plan_layout(SMALL, 4, [4, 4, 4, 4], 64, 1, SLOW_LINKS, limit, device=dev,
                          distributed_optimizer=True)
    assert tight.layer_tp != free.layer_tp and relaxed.layer_tp == free.layer_tp
    assert relaxed.time_per_microbatch_s < tight.time_per_microbatch_s


def low_precision_worker(rank: int, world: int) -> dict:
    rt = RankPlace(ResolvedLayout.make(_topology([2, 1])), rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        run = setup(rt, LLAMA, distributed=True, dtype=dtype)
        out[str(dtype)] = run_steps(rt, run, LLAMA, 0, STEPS)[0]
        out[f"{dtype} masters"] = sorted({str(o.master.dtype) for o in run.opt.owned if o.master is not None})
    return out


@pytest.mark.slow
def test_bfloat16_parameters_update_through_float32_master_shards():
    for res in run_workers(low_precision_worker, 3):
        assert res["torch.float32 masters"] == [] and res["torch.bfloat16 masters"] == ["torch.float32"]
        for got, want in zip(res["torch.bfloat16"], res["torch.float32"], strict=True):
            assert abs(got - want) <= 1e-3 * abs(want), res


@pytest.mark.slow
def test_save_adds_one_bucket_of_device_memory_not_the_unsharded_moments():
    """bench/memory.py's save measurement on DP 2: the distributed optimizer's snapshot allocates at most
    a small part of the unsharded moments on the device (it stages bucket by bucket into host memory)
    and keeps nothing after the save; the plain optimizer's snapshot allocates almost nothing."""
    from bench import memory
    param_bytes = sum(p.numel() * 4 for p in build_model(LLAMA, seed=0).parameters())
    moments = 2 * param_bytes  # the unsharded exp_avg and exp_avg_sq of a TP-1 rank
    for res in run_workers(memory.save_memory_worker, 2, LLAMA, [1, 1], 0.004):
        plain, dist = res["plain"], res["distributed"]
        assert plain["state"] == moments and dist["state"] == moments // 2, res
        assert dist["save_extra"] <= moments // 8, (moments, res)  # buckets of 4 KiB (plus padding)
        assert dist["held_after"] == 0 and plain["held_after"] == 0, res
        assert plain["save_extra"] <= moments // 8, res
