"""Every process group the runtime creates carries the run's collective timeout (a hang surfaces at
`fault.collective_timeout_s`, not torch's 30-minute default for gloo and `cpu:gloo,cuda:nccl`), and the
groups are destroyed at exit whatever the backend string."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, assembled

TIMEOUT_S = 77.0  # neither torch's default (1800 s) nor run_workers' own (120 s)


def groups_worker(rank: int, world: int, tp: int, replica_tp: list[int], pp: int, schedule: str,
                  virtual: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ntp_nemo.checkpoint.async_save import AsyncCheckpointSaver
    from ntp_nemo.topology.groups import group_timeout

    cfg = dataclasses.replace(GPT, num_layers=4)
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2), pp=pp)
    layout = ResolvedLayout.make(topo, schedule, virtual_stages=virtual)
    rt, model = assembled(layout, rank, cfg, 0, torch.float32)  # DP fragment holder sets, pipeline links
    saver = AsyncCheckpointSaver()
    saver._checkpoint_group()  # the checkpoint writers' gloo group
    saver.close()
    timeouts = {}
    for pg in list(c10d._world.pg_map):
        ranks = tuple(dist.get_process_group_ranks(pg))
        t = group_timeout(pg)
        timeouts.setdefault(ranks, set()).add(t.total_seconds() if t is not None else None)
    return {"groups": len(c10d._world.pg_map), "timeouts": timeouts}


@pytest.mark.parametrize(
    "tp,replica_tp,pp,schedule,virtual",
    [(2, [2, 1], 1, "1f1b", 1), (1, [1, 1], 2, "interleaved_1f1b", 2)],
    ids=["tp-and-dp-holder-groups", "pp2-interleaved-links"],
)
def test_every_group_the_runtime_creates_has_the_run_timeout(tp, replica_tp, pp, schedule, virtual):
    results = run_workers(groups_worker, pp * sum(replica_tp), tp, replica_tp, pp, schedule, virtual,
                          timeout_s=TIMEOUT_S)
    for rank, res in enumerate(results):
        # The world, the saver's group and at least one runtime group (TP / holder sets / links).
        assert res["groups"] >= 3, (rank, res)
        for ranks, seen in res["timeouts"].items():
            assert seen == {TIMEOUT_S}, (rank, ranks, seen)


def test_groups_are_destroyed_at_exit_on_every_backend_string(monkeypatch):
    import atexit

    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    from ntp_nemo.lightning import adapter

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    for backend in ("gloo", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"):
        assert adapter.destroy_groups_at_exit(backend)
    assert not adapter.destroy_groups_at_exit("nccl")  # Lightning's own `_init_dist_connection` does
    assert registered == [_destroy_dist_connection] * 3


def test_group_timeout_of_a_world_1_group(tmp_path):
    import torch.distributed as dist

    from ntp_nemo.topology.groups import group_timeout, new_group

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        assert group_timeout() == timedelta(seconds=TIMEOUT_S)
        assert group_timeout(dist.new_group([0])) == timedelta(minutes=30)  # torch's own default
        assert group_timeout(new_group([0])) == timedelta(seconds=TIMEOUT_S)
    finally:
        dist.destroy_process_group()
