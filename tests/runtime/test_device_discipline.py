"""Every tensor of the training step lives on the runtime's device, and the step's scalars travel in
one fused all-reduce.

A `meta` runtime on torch's fake process group runs a whole step's collectives (TP all-reduces,
fragment gradient sync, fused scalars) with no data and no peers: a CPU tensor reaching one of its
collectives -- what the old CPU float64 accumulators did on a GPU run -- raises instead of passing
silently as it would on gloo.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import build_sync_plan, param_descriptors
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import NTPRuntime, RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import OPTIM

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_hidden_size=64, max_seq_len=16)
LAYOUT = ResolvedLayout.make(Topology(tp=2, replica_tp=[2, 1], layer_tp=[2] * 4), num_microbatches=3)
META = torch.device("meta")


@pytest.fixture
def fake_world():
    """Rank 0 of a 3-rank world on torch's fake backend (collectives succeed and move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=LAYOUT.world_size)
    try:
        yield 0
    finally:
        dist.destroy_process_group()


def _assembled(make_model=None) -> tuple[NTPRuntime, torch.nn.Module]:
    """Rank 0's state on a meta runtime, through `assemble`; `make_model` builds its model slice."""
    model = (make_model or (lambda rt: rt.build_model(CFG, seed=0)))(RankPlace(LAYOUT, 0, device=META))
    # Every rank's parameter descriptors, from its own meta model (a fake group cannot exchange them).
    descriptors = [param_descriptors(model)] + _others_descriptors()
    plan = build_sync_plan(0, descriptors, [c.replica for c in LAYOUT.topology().coords])
    state = assemble(LAYOUT, 0, CFG, OPTIM, META, seed=0, sync_plan=plan, make_model=make_model)
    return state.runtime, state.model


def _meta_runtime(rank: int = 0) -> tuple[NTPRuntime, torch.nn.Module]:
    assert rank == 0
    return _assembled()


def _others_descriptors() -> list[dict]:
    return [param_descriptors(RankPlace(LAYOUT, r, device=META).build_model(CFG, 0))
            for r in range(1, LAYOUT.world_size)]


def _meta_step(rt: NTPRuntime, model) -> torch.Tensor:
    micro = [torch.zeros(2, 9, dtype=torch.long, device=META) for _ in rt.my_microbatches(3)]
    loss_sum = rt.train_microbatches(model, micro, global_tokens=3 * 2 * 8)
    rt.sync.sync()
    fused = rt.step_scalars(loss_sum, rt.sync.grad_norm_sq_local(), stop=False)
    rt.sync.clip_to_norm_(fused[1].sqrt(), 1.0)
    return fused


def test_meta_runtime_runs_a_whole_step_on_the_fake_group(fake_world):
    rt, model = _meta_runtime(fake_world)
    assert {p.device for p in model.parameters()} == {META}
    assert rt.my_microbatches(3) == range(0, 2)  # replica 0 (2 ranks) takes 2 of 3 micro-batches
    fused = _meta_step(rt, model)
    assert fused.device == META and fused.shape == (4,) and fused.dtype == torch.float64
    assert {p.grad.device for p in model.parameters()} == {META}


def test_a_cpu_tensor_reaching_a_collective_of_a_meta_runtime_fails(fake_world):
    rt, model = _meta_runtime(fake_world)
    cpu_loss = torch.zeros((), dtype=torch.float64)  # what the old accumulators were
    with pytest.raises(RuntimeError, match="per-replica sum is on cpu but the runtime's device is meta"):
        rt.step_scalars(cpu_loss, torch.zeros((), device=META))
    with pytest.raises(RuntimeError, match="squared gradient norm is on cpu"):
        rt.step_scalars(torch.zeros((), device=META), torch.zeros((), dtype=torch.float64))
    with pytest.raises(RuntimeError, match="global sum|per-replica sum"):
        rt.global_sum(cpu_loss)
    # A model left on the CPU under a meta (or GPU) runtime: its gradients are caught by the gradient
    # sync's bucket all-reduce and by the norm, before any collective takes them.
    _meta_step(rt, model)
    rt, cpu_model = _assembled(lambda _rt: RankPlace(LAYOUT, 0).build_model(CFG, seed=0))
    for p in cpu_model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="gradient bucket is on cpu but the runtime's device is meta"):
        rt.sync.sync()
    with pytest.raises(RuntimeError, match="gradient of .* is on cpu"):
        rt.sync.grad_norm_sq_local()


def _fused_worker(rank: int, world: int) -> dict:
    """gloo, CPU: the fused scalars equal the separate reductions; one rank's flags reach every rank."""
    from tests.ntp_cases import GPT, assembled, tokens

    lay = ResolvedLayout.make(Topology(tp=2, replica_tp=[2, 1], layer_tp=[2] * 4), num_microbatches=4)
    rt, model = assembled(lay, rank, GPT, seed=3)
    toks = tokens(GPT)[:4]
    mine = rt.my_microbatches(4)
    loss_sum = rt.train_microbatches(model, [toks[i: i + 1] for i in mine], toks[:, 1:].numel())
    rt.sync.sync()
    sq = rt.sync.grad_norm_sq_local()
    separate_loss = float(rt.global_sum(loss_sum))
    separate_sq = sq.clone()
    dist.all_reduce(separate_sq)
    fused = rt.step_scalars(loss_sum, sq, stop=rank == 1)
    values = rt.read_step_scalars(fused)
    # Rank 2 finds a non-finite gradient: every rank learns it from the same one all-reduce.
    if rank == 2:
        next(model.parameters()).grad.view(-1)[0] = float("nan")
    flagged = rt.read_step_scalars(rt.step_scalars(loss_sum, rt.sync.grad_norm_sq_local()))
    return {"values": values, "loss": separate_loss, "sq": float(separate_sq), "flagged": flagged,
            "device": str(fused.device)}


def test_fused_scalars_match_the_separate_reductions_and_flags_reach_every_rank():
    results = run_workers(_fused_worker, LAYOUT.world_size)
    for r in results:
        v = r["values"]
        assert r["device"] == "cpu"
        assert math.isclose(v["loss_sum"], r["loss"], rel_tol=1e-12) and v["loss_sum"] > 0
        assert math.isclose(v["grad_norm_sq"], r["sq"], rel_tol=1e-12) and v["grad_norm_sq"] > 0
        assert v["nonfinite"] == 0 and v["stop"] == 1  # rank 1 asked to stop: everyone sees it
        assert r["flagged"]["nonfinite"] == 1 and r["flagged"]["stop"] == 0
    assert len({r["values"]["loss_sum"] for r in results}) == 1


def test_lightning_per_step_sigterm_broadcast_is_switched_off(monkeypatch):
    # Lightning (>= 2.5) broadcasts a SIGTERM flag from rank 0 and reads it on the host before every
    # training step; NTPStrategy.setup switches that off (the stop flag rides in the fused all-reduce).
    import lightning.pytorch as pl
    import torch.distributed as dist

    from ntp_nemo.lightning.strategy import quiet_sigterm_broadcast

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        pytest.skip("this Lightning has no per-step SIGTERM broadcast")
    calls = []
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: calls.append(args))
    loop._broadcast_sigterm_tensor()
    assert len(calls) == 1  # Lightning's own: one broadcast per step
    quiet_sigterm_broadcast(trainer)
    loop._broadcast_sigterm_tensor()
    assert len(calls) == 1
