"""Between steps the gradients are set to None where no collective reads them in place, and only the
bucket buffers (whose views are `.grad`s the backward accumulates into) are zeroed: the same parameters,
bit for bit, as zero-filling every gradient (the former `zero_grad(set_to_none=False)`), and no zero-fill
of the gradients at all on a layout without DP buckets (one replica).  Two gloo ranks: TP 2 (one
replica) and DP 2 (two TP-1 replicas: every fragment in a bucket), plain and distributed AdamW."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.parallel.step_path import GradientPath
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA
from tests.option_cases import run_steps, setup

STEPS = 2
ZEROING = ("zero_", "_foreach_zero_", "fill_")


class Zeroed(TorchDispatchMode):
    """Elements written with zeros (`zero_`, `_foreach_zero_`, `fill_`) while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ZEROING:
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.elements += sum(t.numel() for t in tensors)
        return func(*args, **(kwargs or {}))


def zero_worker(rank: int, world: int, replica_tp: list[int], distributed: bool) -> dict:
    tp = max(replica_tp)
    rt = RankPlace(ResolvedLayout.make(Topology(tp, replica_tp, [tp] * (LLAMA.num_layers + 2))), rank)
    out = {}
    former = GradientPath.zero_grad
    for name in ("zero-filled", "set to None"):
        if name == "zero-filled":  # the former step's end: every gradient filled with zeros
            GradientPath.zero_grad = lambda self: self.optimizer.zero_grad(set_to_none=False)
        run = setup(rt, LLAMA, distributed=distributed)
        try:
            run_steps(rt, run, LLAMA, 0, STEPS - 1)
            with Zeroed() as z:
                run_steps(rt, run, LLAMA, STEPS - 1, STEPS)
        finally:
            GradientPath.zero_grad = former
        out[name] = {"params": {n: p.detach().clone() for n, p in run.model.named_parameters()},
                     "zeroed": z.elements, "param_elements": sum(p.numel() for p in run.model.parameters()),
                     "none_after": sum(p.grad is None for p in run.model.parameters())}
    a, b = out["zero-filled"], out["set to None"]
    return {"same": [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])] == [],
            "zeroed": {k: v["zeroed"] for k, v in out.items()}, "param_elements": a["param_elements"],
            "none_after": {k: v["none_after"] for k, v in out.items()},
            "params": len(a["params"])}


CASES = {"tp2": ([2], False), "tp2-distributed": ([2], True), "dp2": ([1, 1], False)}


def cases_worker(rank: int, world: int) -> dict:
    return {name: zero_worker(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(cases_worker, 2)


@pytest.mark.parametrize("case", ["tp2", "tp2-distributed"])
def test_one_replica_fills_no_gradient_with_zeros_and_trains_the_same(results, case):
    for res in (r[case] for r in results):
        assert res["same"], res
        # the former end of step zero-filled every gradient element; now none is, and no `.grad` is held
        assert res["zeroed"]["zero-filled"] >= res["param_elements"], res
        assert res["zeroed"]["set to None"] == 0, res
        assert res["none_after"] == {"zero-filled": 0, "set to None": res["params"]}, res


def test_two_replicas_zero_only_their_bucket_buffers_and_train_the_same(results):
    for res in (r["dp2"] for r in results):
        assert res["same"], res
        # every fragment is in a bucket: its buffer is zeroed as the gradients were (no saving here)
        assert res["zeroed"]["set to None"] >= res["param_elements"], res
        assert res["none_after"]["set to None"] == 0, res
