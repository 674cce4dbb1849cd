"""Overlapped gradient sync: buckets launch during the backward and give the blocking sync's gradients.

Replicas (2, 1), float64, small buckets (several per holder set).  Also a step in which one replica
runs no micro-batch (its buckets are launched by `finish()`).
"""

from __future__ import annotations

import time

import pytest
import torch

from ntp_nemo.parallel.launch import run_workers
from ntp_nemo.parallel.overlap import OverlappedGradSync
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, GPT, SEED, tokens


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def overlap_worker(rank: int, world: int) -> dict:
    rt = NTPRuntime(ResolvedLayout.make(Topology(2, [2, 1], [2] * (GPT.num_layers + 2))), rank)
    model = rt.build_model(GPT, SEED, dtype=torch.float64)
    sync = rt.attach(model, bucket_mb=0.002)
    ov = OverlappedGradSync(model, sync.plan, sync.group_of, sync.bucket_bytes)
    toks = tokens(GPT)
    out = {"buckets": len(ov.buckets)}
    for case, count in (("full", GLOBAL_BATCH), ("one-microbatch", 1)):
        micro = [toks[i : i + 1] for i in rt.my_microbatches(count)]
        model.zero_grad(set_to_none=False)
        ov.begin_step(len(micro))
        rt.train_microbatches(model, micro, count * (toks.shape[1] - 1))
        backward_end = time.perf_counter()
        launched = ov.launched_in_backward
        first_launch = min(ov.launch_times, default=float("inf"))
        ov.finish()
        overlapped = _grads(model)
        model.zero_grad(set_to_none=False)
        rt.train_microbatches(model, micro, count * (toks.shape[1] - 1))
        sync.sync()
        err = max(float((overlapped[n] - p.grad).abs().max() / max(float(p.grad.abs().max()), 1e-12))
                  for n, p in model.named_parameters())
        out[case] = {"microbatches": len(micro), "launched_in_backward": launched, "err": err,
                     "first_launch_before_end": first_launch < backward_end}
    ov.remove()
    return out


@pytest.mark.slow
def test_overlapped_sync_launches_in_backward_and_matches_blocking_sync():
    results = run_workers(overlap_worker, 3)
    for rank, res in enumerate(results):
        assert res["buckets"] >= 3, res  # several buckets per rank, so the launch order matters
        for case in ("full", "one-microbatch"):
            assert res[case]["err"] <= 1e-12, (rank, case, res[case])
        # A rank with micro-batches launched every bucket from the backward's hooks, the first one before
        # the backward ended; a rank without any launched them all in finish().
        full = res["full"]
        assert full["launched_in_backward"] == res["buckets"] and full["first_launch_before_end"], res
        one = res["one-microbatch"]
        if one["microbatches"] == 0:
            assert one["launched_in_backward"] == 0, res
        else:
            assert one["launched_in_backward"] == res["buckets"], res
    assert sorted(r["one-microbatch"]["microbatches"] for r in results) == [0, 1, 1]
