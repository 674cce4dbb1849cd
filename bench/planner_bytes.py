"""The planner's communicated-bytes model against the TP all-reduce bytes measured on CPU (gloo).

For each layout, one forward+backward of one micro-batch runs on real worker processes through
`NTPRuntime`; `torch.distributed.all_reduce` is wrapped in the workers to count payload bytes and
calls on rank 0. The planner's `item_cost` gives the modelled bytes and calls for the same layout.

    python bench/planner_bytes.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import families
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.planner.cost import item_cost, item_kinds
from ntp_nemo.planner.shapes import DeviceModel, LinkModel
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology, effective_degree

MB, SEQ = 2, 32


def model_config(arch: str) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        vocab_size=257,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2 if arch == "llama" else None,
        ffn_hidden_size=128,
        max_seq_len=SEQ + 1,
        tie_embeddings=False,
    )


def worker(rank: int, world: int, arch: str, layer_tp: list[int], replica_tp: list[int]) -> dict:
    torch.set_num_threads(1)
    topo = Topology(tp=max(replica_tp), replica_tp=replica_tp, layer_tp=layer_tp)
    rt = RankPlace(ResolvedLayout.make(topo), rank)
    model = rt.build_model(model_config(arch), seed=0)
    counts = {"bytes": 0, "calls": 0}
    original = dist.all_reduce

    def counting(t, *args, **kwargs):
        counts["bytes"] += t.numel() * t.element_size()
        counts["calls"] += 1
        return original(t, *args, **kwargs)

    dist.all_reduce = counting
    try:
        ids = torch.randint(0, 257, (MB, SEQ + 1), generator=torch.Generator().manual_seed(0))
        model.loss_sum(ids).backward()
    finally:
        dist.all_reduce = original
    return counts


def modelled(arch: str, layer_tp: list[int], n: int) -> tuple[float, int]:
    shape = families.model_shape(model_config(arch))
    total, calls = 0.0, 0
    for kind, t in zip(item_kinds(shape), layer_tp, strict=True):
        cost = item_cost(shape, kind, effective_degree(t, n), SEQ, MB, DeviceModel(act_bytes=4), LinkModel())
        total += cost.comm_bytes
        calls += cost.num_allreduces
    return total, calls


def main() -> None:
    print("model  layout                        measured B calls  modelled B calls   error")
    for arch in ("gpt2", "llama"):
        for replica_tp, layer_tp in (([2], [2, 2, 2, 2]), ([3], [3, 3, 3, 3]), ([4], [2, 4, 4, 2])):
            meas = run_workers(worker, sum(replica_tp), arch, layer_tp, replica_tp)[0]
            mod, mcalls = modelled(arch, layer_tp, replica_tp[0])
            err = 100 * (mod - meas["bytes"]) / meas["bytes"]
            layout = f"TP{replica_tp[0]} layers {'-'.join(map(str, layer_tp))}"
            row = f"{arch:6} {layout:28} {meas['bytes']:>11} {meas['calls']:>5} {mod:>11.0f} {mcalls:>5}"
            print(f"{row} {err:>+6.1f}%", flush=True)


if __name__ == "__main__":
    main()
