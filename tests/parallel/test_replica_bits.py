"""Replicas of different TP degree hold the same parameters bit for bit after training.

On an uneven layout an element sits at different offsets of its tensor in a TP-2 replica and in a TP-1
replica.  torch's fused CPU AdamW rounds a tensor's vectorised body and its scalar tail differently, so
the two copies drifted apart by units in the last place (caught when a live reshard read one replica's
copy and a checkpoint held the other's); the run's optimizer must update every copy alike.
"""

from __future__ import annotations

import torch

import ntp_nemo.runtime.step as one_step
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT
from tests.shapes import adamw

SEED, SEQ, BATCH, STEPS = 3, 8, 6, 6
OPTIM = adamw(3e-2)


def _worker(rank: int, world: int, replica_tp: list[int]) -> dict:
    torch.set_num_threads(1)
    tp = max(replica_tp)
    topology = Topology(tp, replica_tp, [tp] * (GPT.num_layers + 2))
    layout = ResolvedLayout.make(topology, num_microbatches=BATCH)
    state = assemble(layout, rank, GPT, OPTIM, "cpu", seed=SEED, param_dtype=torch.float32)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        toks = torch.randint(0, GPT.vocab_size, (BATCH, SEQ + 1), generator=gen)
        micro = [toks[i : i + 1] for i in state.my_microbatches(BATCH)]
        one_step.train_step(state, micro, toks[:, 1:].numel(), max_norm=1.0)
    return {"fused": bool(state.optimizer.defaults.get("fused")),
            "params": {n: (p.ntp_spec, p.detach().numpy().copy()) for n, p in state.model.named_parameters()}}


def _whole(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """One replica's parameters put back together (each rank's slice copied into the full tensor)."""
    out = {}
    for name, (spec, _) in ranks[0]["params"].items():
        full = torch.zeros(spec.global_shape, dtype=torch.float32)
        for r in ranks:
            s, a = r["params"][name]
            s.narrow(full).copy_(torch.from_numpy(a))
        out[name] = full
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters that differ between two replicas in any bit."""
    assert a.keys() == b.keys()
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def test_uneven_replicas_hold_every_element_bit_for_bit():
    results = run_workers(_worker, 3, [2, 1])
    assert not any(r["fused"] for r in results)  # uneven on CPU: the foreach AdamW
    assert _differing(_whole(results[:2]), _whole(results[2:])) == []


def test_even_replicas_keep_the_fused_adamw_and_agree():
    results = run_workers(_worker, 4, [2, 2])
    assert all(r["fused"] for r in results)
    assert _differing(_whole(results[:2]), _whole(results[2:])) == []
