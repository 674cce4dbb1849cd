"""The rehearsal that sees devices (`runtime.device_rehearsal`): meta tensors stand for CUDA tensors and
every process group keeps the device types of the backend asked for, so the GPU run's device mistakes
fail here, on CPU, in the paths `bench/gpu_check.py` and the live recovery take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ntp_nemo.runtime.device_rehearsal import DeviceTypedWorld, DeviceTypeError, device_types
from ntp_nemo.runtime.dry_run import StepShape, dry_run, fake_world
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.groups import tp_backend
from tests.shapes import small_llama

LLAMA = small_llama(2)


def test_backends_move_the_device_types_of_their_real_backends():
    assert device_types("gloo") == ("cpu", "cuda")
    assert device_types("nccl") == ("cuda",)
    assert device_types("ntpdirect") == ("cpu",)
    assert device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert device_types("cuda:nccl") == ("cuda",)
    with DeviceTypedWorld("cpu:gloo,cuda:nccl"), fake_world(0, 2):
        g = dist.new_group([0, 1], backend="cuda:nccl")
        dist.all_reduce(torch.zeros(2, device="meta"), group=g)  # meta: a CUDA tensor
        dist.all_reduce(torch.zeros(2))  # the world's gloo side takes host tensors
        with pytest.raises(DeviceTypeError, match="received a cpu tensor"):
            dist.all_reduce(torch.zeros(2), group=g)  # NCCL refuses a host tensor


def test_tp_groups_of_gpu_ranks_never_take_the_cpu_backend():
    """`ntpdirect` moves CPU tensors only: a gloo world of ranks on GPUs (gpu_check's ntp part: three
    ranks sharing cuda:0) keeps gloo for its TP groups, a mixed world takes NCCL."""
    assert tp_backend("gloo", torch.device("cpu")) == "ntpdirect"
    assert tp_backend("gloo", torch.device("cuda", 0)) is None  # the world's gloo
    assert tp_backend("cpu:gloo,cuda:nccl", torch.device("cuda", 1)) == "cuda:nccl"


@pytest.mark.parametrize("world_backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_gpu_check_ntp_layout_rehearsed_with_device_types(world_backend):
    """gpu_check's NTP layout (2,1), every rank's step (TP collectives, fragment gradient sync, fused step
    scalars) on a world of the GPU run's backend.  Before the TP backend followed the runtime's device,
    the gloo world failed here as on the GPU: "allreduce_.default on a process group of backend
    'ntpdirect' (ranks [0, 1]) received a cuda tensor (meta stands for cuda); ntpdirect moves cpu
    tensors only"."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * (LLAMA.num_layers + 2)), num_microbatches=3)
    world = DeviceTypedWorld(world_backend)
    with world:
        dry_run(layout, LLAMA, StepShape(seq_len=16, micro_batch_size=1), measure_options=False)
    tp = [r for r in world.records if r.how == "new_group" and r.ranks == (0, 1)]
    assert tp and all("ntpdirect" not in r.backend for r in tp)


def test_live_rendezvous_binds_the_device_of_every_nccl_group(monkeypatch):
    """A live recovery's generation (`rendezvous.join`) on a world with NCCL: the world and every group
    split from it bound to this process's GPU (eager communicators); unbound before."""
    from ntp_nemo.resilience import rendezvous
    from ntp_nemo.resilience.store_auth import JobStore

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    proved = []
    monkeypatch.setattr(rendezvous, "authenticate_group", lambda store, ctx, device: proved.append(device))
    world = DeviceTypedWorld()
    with world:
        rendezvous.join(JobStore(dist.HashStore(), b"k" * 32), 1, 0, 2, backend="cpu:gloo,cuda:nccl")
        try:
            layout = ResolvedLayout.make(Topology(1, [2], [2] * (LLAMA.num_layers + 2)), num_microbatches=2)
            from ntp_nemo.runtime.runtime import RankPlace

            RankPlace(layout, 0, device=torch.device("meta"))  # the new generation's groups
        finally:
            dist.destroy_process_group()
    assert [r.how for r in world.records][:2] == ["init_process_group", "new_group"]
    assert world.unbound_nccl() == []
    assert world.records[0].device_id == torch.device("cuda", 1)
    assert proved == [torch.device("cuda", 1)]  # the proof is the NCCL communicator's first call


def test_adopt_keeps_each_process_on_its_own_device(monkeypatch):
    """Three processes forked on cuda:0..2; the one on cuda:2 survives as rank 1 of two: it keeps cuda:2
    (the launch list at rank 1 is another process's GPU)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from ntp_nemo.lightning import strategy as strategy_mod
    from ntp_nemo.lightning.strategy import NTPStrategy

    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(strategy_mod.rank_zero_only, "rank", 0)
    monkeypatch.setattr(strategy_mod.fabric_rank_zero_only, "rank", 0)
    layout = ResolvedLayout.make(Topology(1, [3], [3] * 4), num_microbatches=3)
    env = LightningEnvironment()
    s = NTPStrategy(layout, parallel_devices=[torch.device("cuda", i) for i in range(3)],
                    cluster_environment=env)
    env.set_world_size(3)
    env.set_global_rank(2)
    s._lightning_module = SimpleNamespace(model=None, trainer=SimpleNamespace(callbacks=[]))

    def state(lay, rank):
        return SimpleNamespace(layout=lay, rank=rank, model=object(),
                               grad_path=SimpleNamespace(remove=lambda: None),
                               runtime=SimpleNamespace(topology=lay.topology()))

    s.adopt(state(layout, 2))
    assert s.root_device == torch.device("cuda", 2)
    s.adopt(state(layout.shrunk([2]), 1))  # rank 1 (on cuda:1) was lost
    assert s.local_rank == 1 and s.root_device == torch.device("cuda", 2)
