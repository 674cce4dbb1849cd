"""20 float32 AdamW steps on PP x TP x DP with a degraded replica follow the single-process loss curve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT
from tests.shapes import adamw as adamw_options

STEPS, MICRO, NUM_MICRO, SEQ, SEED, LR, CLIP = 20, 2, 6, 8, 11, 1e-2, 1.0
GPT4 = dataclasses.replace(GPT, num_layers=4)


def step_tokens(cfg, step: int) -> torch.Tensor:
    """Learnable data: each sequence counts up by a per-sequence stride (1 or 2) from a random start."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (MICRO * NUM_MICRO, 1), generator=gen)
    stride = torch.randint(1, 3, (MICRO * NUM_MICRO, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % cfg.vocab_size


def adamw(params) -> torch.optim.AdamW:
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95))


def reference_curve(cfg) -> list[float]:
    torch.manual_seed(0)
    model = build_model(cfg, seed=SEED)
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        toks = step_tokens(cfg, step)
        loss = model.loss_sum(toks) / toks[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def training_worker(rank: int, world: int, cfg, tp, replica_tp, pp, schedule) -> dict:
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2), pp=pp)
    optim = adamw_options(LR)
    state = assemble(ResolvedLayout.make(topo, schedule), rank, cfg, optim, None, seed=SEED)
    rt, model = state.runtime, state.model
    losses = []
    for step in range(STEPS):
        toks = step_tokens(cfg, step)
        micro = [toks[i * MICRO : (i + 1) * MICRO] for i in state.my_microbatches(NUM_MICRO)]
        losses.append(train_step(state, micro, toks[:, 1:].numel(), max_norm=CLIP).loss)
    embed = model.embed.weight.detach().clone() if model.embed is not None else None
    return {"losses": losses, "embed": embed, "coord": (rt.coord.replica, rt.coord.stage, rt.coord.slot)}


@pytest.mark.slow
def test_pipeline_training_follows_single_process_curve():
    # GPT (tied embedding shared by the first and last stage), PP2 x replicas (2, 1), 1F1B: 6 ranks.
    cfg, tp, replica_tp, pp, schedule = GPT4, 2, [2, 1], 2, "1f1b"
    want = reference_curve(cfg)
    results = run_workers(training_worker, pp * sum(replica_tp), cfg, tp, replica_tp, pp, schedule)
    assert want[-1] < want[0] - 0.05, "the reference run must actually train"
    for rank, res in enumerate(results):
        for step, (got, ref) in enumerate(zip(res["losses"], want, strict=True)):
            assert abs(got - ref) / ref < 1e-5, f"rank {rank} step {step}: loss {got} vs {ref}"
    if cfg.tie_embeddings:
        # The tied embedding copies of the first and the last stage (same replica and slot) stay identical.
        copies: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        for res in results:
            replica, stage, slot = res["coord"]
            if res["embed"] is not None:
                copies.setdefault((replica, slot), {})[stage] = res["embed"]
        assert copies and all(set(c) == {0, pp - 1} for c in copies.values())
        for c in copies.values():
            assert torch.equal(c[0], c[pp - 1])
