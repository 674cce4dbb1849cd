"""The TP step's collectives: fewer of them, same numbers (float64 against the unsharded model and
against the per-parameter path they replace)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from ntp_nemo.parallel.launch import run_workers
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA, SEED, exactness_worker, tokens

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor")


def _count_collectives() -> Counter:
    """Wrap this process's torch.distributed collectives (called in a forked worker only)."""
    counts: Counter = Counter()
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    return counts


def _one_microbatch(rank: int, world: int, cfg, sp: bool, reducer: bool) -> dict:
    """Collectives of one micro-batch's forward + backward on TP `world`, and the gradients."""
    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2))
    layout = ResolvedLayout.make(topology, sequence_parallel=sp)
    rt = NTPRuntime(layout, rank)
    model = rt.build_model(cfg, SEED, dtype=torch.float64)
    if not reducer:  # the per-parameter path (one all-reduce per replicated parameter)
        for module in model.modules():
            if hasattr(module, "grad_reducer"):
                module.grad_reducer = None
    counts = _count_collectives()
    toks = tokens(cfg)[:2]
    loss = model.loss_sum(toks)
    forward = Counter(counts)
    loss.backward()
    return {"forward": dict(forward), "all": dict(counts), "loss": float(loss),
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def test_cross_entropy_and_tp_regions_take_the_minimum_collectives_without_sp():
    """Per micro-batch, GPT TP2: forward 1 embedding + 2 per layer (row-parallel outputs) + 1 for the
    cross entropy (one all-gather of max, sum of exponentials and target logit; it was a max then a sum
    all-reduce); backward 2 per layer (column-parallel inputs) + 1 (tied head)."""
    res = run_workers(_one_microbatch, 2, GPT, False, True)
    layers = GPT.num_layers
    for r in res:
        assert r["forward"] == {"all_reduce": 1 + 2 * layers, "all_gather_single": 1}
        assert r["all"] == {"all_reduce": 1 + 2 * layers + 2 * layers + 1, "all_gather_single": 1}


def test_sequence_parallel_replicated_gradients_take_one_all_reduce_per_backward():
    """Under SP the norm weights/biases, row-parallel biases and position embedding have their gradients
    summed over the TP group in one all-reduce at the end of the backward (GPT: 2 layers x (2 norms x 2 +
    2 biases) + final norm 2 + position embedding 1 = 15 all-reduces before), with the same gradients."""
    fused = run_workers(_one_microbatch, 2, GPT, True, True)
    per_param = run_workers(_one_microbatch, 2, GPT, True, False)
    for a, b in zip(fused, per_param, strict=True):
        assert a["all"]["all_reduce"] == 1, a["all"]
        assert b["all"]["all_reduce"] == 15, b["all"]
        assert a["all"]["all_gather_single"] == b["all"]["all_gather_single"]
        assert a["loss"] == b["loss"]
        for name, g in b["grads"].items():
            assert abs(a["grads"][name] - g).max() <= 1e-10 * max(abs(g).max(), 1e-6), name


def test_sequence_parallel_uneven_layout_still_matches_unsharded():
    """Replicas of TP 3 and 2 (uneven sequence slices, shared norms synced across replicas) with SP and the
    fused replicated-gradient reduction: loss, gradients and logits of the unsharded model (float64)."""
    results = run_workers(exactness_worker, 5, LLAMA, 3, [3, 2], [3] * (LLAMA.num_layers + 2), 1, 8, True)
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"rank {rank}: {key} rel error {err:.2e}"
