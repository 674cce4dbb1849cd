"""Process layout under torchrun/SLURM (unequal processes per node), CUDA device counting without a
context, and the devices a failover relaunch binds."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from ntp_nemo.errors import ConfigError
from ntp_nemo.lightning.environments import (
    NTPSLURMEnvironment,
    NTPTorchElasticEnvironment,
    launcher_layout,
    parse_tasks_per_node,
)
from ntp_nemo.resilience.policies import make_policy, replan
from ntp_nemo.resilience.replan import relaunch_devices
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import TINY, compose


def torchrun_env(per_node: list[int], rank: int) -> dict[str, str]:
    """What torchrun exports to global rank `rank` when node i runs per_node[i] processes."""
    node = next(i for i in range(len(per_node)) if rank < sum(per_node[: i + 1]))
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(sum(per_node)),
        "LOCAL_RANK": str(rank - sum(per_node[:node])),
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(len(per_node)),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }


@pytest.mark.parametrize(
    "text,expected",
    [("4,3", [4, 3]), ("4(x2),3", [4, 4, 3]), ("2(x3)", [2, 2, 2]), ("8", [8]), ("1,2(x2),1", [1, 2, 2, 1])],
)
def test_slurm_task_lists_parse(text, expected):
    assert parse_tasks_per_node(text) == expected


def test_bad_slurm_task_list_names_the_variable():
    with pytest.raises(ConfigError) as err:
        parse_tasks_per_node("4x2")
    assert err.value.key == "SLURM_TASKS_PER_NODE" and "4(x2),3" in str(err.value)


def test_torchrun_unequal_nodes_every_rank_agrees_on_the_nodes():
    per_node = [2, 1]
    layouts = [launcher_layout(torchrun_env(per_node, r)) for r in range(3)]
    assert [(x.global_rank, x.local_rank, x.node_rank) for x in layouts] == [(0, 0, 0), (1, 1, 0), (2, 0, 1)]
    assert [x.local_world_size for x in layouts] == [2, 2, 1]
    assert {x.num_nodes for x in layouts} == {2}  # not world // LOCAL_WORLD_SIZE (1 on node 0, 3 on node 1)
    for x in layouts:
        x.check(3)
    with pytest.raises(ConfigError) as err:
        layouts[0].check(4)
    assert err.value.key == "mesh" and "3 processes" in str(err.value)


def test_slurm_heterogeneous_step():
    env = {
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "11",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "3",
        "SLURM_TASKS_PER_NODE": "4(x3)",  # the allocation ...
        "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",  # ... and this srun step: the step's list wins
    }
    x = launcher_layout(env)
    assert (x.launcher, x.global_rank, x.local_world_size, x.num_nodes, x.per_node) == (
        "slurm", 9, 3, 3, (4, 4, 3)
    )
    x.check(11)
    assert launcher_layout({**env, "SLURM_JOB_NAME": "bash"}) is None  # interactive shell: not a launcher
    assert launcher_layout({}) is None


def test_environments_accept_unequal_nodes_where_lightnings_refuse(monkeypatch):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    for k, v in torchrun_env([2, 1], 2).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError):
        TorchElasticEnvironment().validate_settings(num_devices=1, num_nodes=2)  # 1 * 2 != 3
    NTPTorchElasticEnvironment().validate_settings(num_devices=1, num_nodes=2)
    with pytest.raises(ValueError):
        NTPTorchElasticEnvironment().validate_settings(num_devices=1, num_nodes=3)
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "3,1", "SLURM_STEP_ID": "0"}  # a task of an srun step
    for k in list(torchrun_env([1], 0)):
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    NTPSLURMEnvironment(auto_requeue=False).validate_settings(num_devices=1, num_nodes=2)


def test_trainer_on_the_one_process_node_keeps_the_launchers_rank(monkeypatch, tmp_path):
    """Node 1 of a (2,1) torchrun job runs one process: Lightning gets devices=1, num_nodes=2, and the
    strategy's global rank is the launcher's RANK=2 (node_rank * devices + local_rank would say 1)."""
    from hydra.core.global_hydra import GlobalHydra
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.data.prepare import build_data
    from ntp_nemo.lightning.factory import build_trainer

    for tracker in (rank_zero_only, fabric_rank_zero_only):  # the Trainer sets them to rank 2: restore after
        monkeypatch.setattr(tracker, "rank", getattr(tracker, "rank", 0))
    GlobalHydra.instance().clear()
    cfg = compose([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "trainer.max_steps=2"])
    for k, v in torchrun_env([2, 1], 2).items():
        monkeypatch.setenv(k, v)
    d = cfg.data
    data = build_data(d.path, d.tokenizer, int(d.seq_len), int(d.global_batch_size), int(cfg.seed),
                      float(d.val_fraction), int(cfg.model.vocab_size))
    trainer, _, strategy = build_trainer(resolve(cfg), tmp_path, data)
    assert isinstance(strategy.cluster_environment, NTPTorchElasticEnvironment)
    placed = (strategy.num_nodes, strategy.num_processes, strategy.node_rank, strategy.local_rank)
    assert placed == (2, 1, 1, 0)
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.world_size) == (2, 3)
    assert strategy.launcher is None  # torchrun created the processes


def test_device_count_leaves_cuda_uninitialised(monkeypatch):
    """The launching parent counts GPUs through NVML: cudaGetDeviceCount (driver init) is never called."""
    from ntp_nemo.launch import devices

    def forbidden():
        raise AssertionError("cudaGetDeviceCount called in the parent")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", forbidden, raising=False)
    assert devices.cuda_device_count() == 3 and devices.cuda_available()
    assert not torch.cuda.is_initialized()
    # NVML unavailable: counted in a child process, still nothing in this one.
    calls = []
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    monkeypatch.setattr(
        devices.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or types.SimpleNamespace(returncode=0,
                                                                                              stdout="2\n")
    )
    assert devices.cuda_device_count() == 2 and calls and calls[0][1] == "-c"
    assert not torch.cuda.is_initialized()


def test_validation_of_a_gpu_recipe_does_not_touch_cuda(monkeypatch):
    from ntp_nemo.config.validate import check_environment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("torch.cuda.is_available() here"))
    cfg = compose([*TINY, "trainer=gpu"])
    with pytest.raises(ConfigError) as err:  # this machine has no GPU
        check_environment(cfg)
    assert err.value.key == "trainer.accelerator"


# ---- failover relaunch: devices ------------------------------------------------------------------


@pytest.mark.parametrize("failed", [[0], [1], [2], [3], [1, 3]])
def test_relaunch_never_binds_a_lost_device(failed):
    old = list(range(4))  # layout (2,2) on cuda:0..3
    plan = replan(ResolvedLayout.make(Topology(2, (2, 2), [2] * 4)), failed, make_policy("ntp"))
    devices, notes = relaunch_devices(plan, old, set(failed), visible=4)
    assert len(devices) == plan.new.world_size and len(set(devices)) == len(devices)
    assert not set(devices) & set(failed)
    assert devices == [d for d in old if d not in failed]  # survivors keep their GPUs, in rank order
    assert notes == []


def test_restart_policy_takes_a_spare_and_says_when_there_is_none():
    plan = replan(ResolvedLayout.make(Topology(2, (2, 2), [2] * 4)), [1], make_policy("restart"))
    devices, notes = relaunch_devices(plan, [0, 1, 2, 3], {1}, visible=5)
    assert devices == [0, 4, 2, 3] and "spare cuda:4" in notes[0]
    devices, notes = relaunch_devices(plan, [0, 1, 2, 3], {1}, visible=4)
    assert devices == [0, 1, 2, 3] and "no spare GPU" in notes[0]


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.exitcode, self.pid = code, None
        self.sentinel = os.pipe()[0]  # never ready: the monitor sees no exit of its own

    def is_alive(self) -> bool:
        return False


class _Trainer:
    """Stands in for Lightning's Trainer: `fit` either ends, or fails the way a lost worker does."""

    def __init__(self, world: int, lost: list[int]) -> None:
        self.lost, self.world = lost, world
        self.strategy = types.SimpleNamespace(launcher=types.SimpleNamespace(procs=[]))

    def fit(self, module, ckpt_path=None) -> None:
        from torch.multiprocessing import ProcessExitedException

        if self.lost:
            self.strategy.launcher.procs = [_Proc(137 if r in self.lost else -15) for r in range(self.world)]
            raise ProcessExitedException(
                f"process {self.lost[0]} terminated with exit code 137", self.lost[0], 0, 137
            )


def test_supervisor_relaunches_on_the_survivors_devices(tmp_path: Path, monkeypatch, capsys):
    """Two losses on a GPU (2,2) layout: each relaunch binds the surviving ranks' GPUs, never a lost one
    (the devices come from the real re-plan and reach the build function and attempts.jsonl)."""
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.launch import devices as devices_mod
    from ntp_nemo.resilience.supervisor import ATTEMPTS_FILE, FAILOVER_DIR, Supervisor

    monkeypatch.setattr(devices_mod, "cuda_device_count", lambda: 4)
    cfg = compose([*TINY, "trainer=gpu", "trainer.precision=32-true", "mesh.dp=2", "mesh.tp=2",
                   "ntp.replica_tp=[2,2]", "trainer.max_steps=12", "checkpoint.every_n_steps=3",
                   "fault.max_restarts=3"])
    losses = [[1], [0]]  # attempt 0 loses rank 1 (cuda:1); attempt 1 (ranks on 0,2,3) loses rank 0 (cuda:0)
    built: list[tuple[str, list[int] | None]] = []

    def build(layout, extra, cuda_devices, stop_at):
        built.append((str(list(layout.replica_tp)), cuda_devices))
        return _Trainer(layout.world_size, losses.pop(0) if losses else []), None, None

    sup = Supervisor(failover_spec(cfg), resolve_layout(cfg), tmp_path, build)
    first = sup.build_first()
    sup.run(first, None)
    assert built == [("[2, 2]", None), ("[1, 2]", [0, 2, 3]), ("[2]", [2, 3])]
    assert sup.lost_devices == {0, 1}
    recs = (tmp_path / FAILOVER_DIR / ATTEMPTS_FILE).read_text().splitlines()
    assert len(recs) == 3 and '"devices": [2, 3]' in recs[2]


def test_heartbeats_only_where_a_monitor_reads_them(tmp_path: Path):
    """Forked workers (the supervisor's monitor reads their heartbeat files) write them; processes
    torchrun/SLURM created (no launcher of ours, nothing reads the files) do not."""
    from types import SimpleNamespace

    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.resilience.heartbeat import Heartbeat
    from ntp_nemo.resilience.supervisor import Supervisor

    cfg = compose([*TINY])
    for launcher, expected in ((None, 0), (object(), 1)):
        def build(layout, extra, cuda_devices, stop_at, launcher=launcher):
            trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher), callbacks=list(extra))
            return trainer, None, None

        trainer = Supervisor(failover_spec(cfg), resolve_layout(cfg), tmp_path, build).build_first()[0]
        assert sum(isinstance(cb, Heartbeat) for cb in trainer.callbacks) == expected


def test_process_group_backend_fits_the_device():
    """CUDA workers: NCCL for the training tensors and gloo beside it for CPU-side objects."""
    from ntp_nemo.lightning.strategy import default_backend

    assert default_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert default_backend(torch.device("cpu")) == "gloo"


def _trained_view(layout) -> dict:
    """What the ranks of `layout` train with: batch split, schedule, stages and every replica's degrees."""
    topo = layout.topology()
    return {
        "microbatches": list(layout.microbatches),
        "schedule": (layout.schedule, layout.virtual_stages, list(layout.stage_layers)),
        "degrees": [[topo.degree(r, s) for s in range(len(layout.layer_tp))] for r in range(layout.dp)],
        "layer_tp": list(layout.layer_tp),
    }


def test_live_recovery_keeps_every_layout_option_of_the_restart_path(tmp_path: Path):
    """(2,2) under NTP-PW (power boost 1.3), an interleaved schedule with virtual stages and per-layer
    degrees loses rank 1: the layout the supervisor relaunches on (restart) and the one the survivors'
    next generation trains (live) are the same value, with the boosted split [6, 10] of 16 micro-batches
    (before, the live path rebuilt the layout without the boost and trained [5, 11])."""
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.config.validate import validate
    from ntp_nemo.resilience.recovery import Generation
    from ntp_nemo.resilience.supervisor import Supervisor

    cfg = compose([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "ntp.power_boost=1.3",
                   "mesh.pp=2", "model.num_layers=4", "layout.schedule=interleaved_1f1b",
                   "layout.virtual_stages=2", "layout.layer_tp=[2,1,2,1,2,2]", "data.global_batch_size=32",
                   "trainer.max_steps=12", "checkpoint.every_n_steps=3", "fault.recovery=restart"])
    validate(cfg)
    layout = resolve_layout(cfg)
    built = []

    def build(lay, extra, cuda_devices, stop_at):
        built.append(lay)
        return _Trainer(lay.world_size, [1] if len(built) == 1 else []), None, None

    sup = Supervisor(failover_spec(cfg), layout, tmp_path, build)
    sup.run(sup.build_first(), None)
    restart = built[1]
    live = Generation.first(layout).next([1], sup.policy)[0].layout  # what LiveRecovery builds its ranks on
    assert restart.replica_tp == (1, 2)
    assert _trained_view(live) == _trained_view(restart) == {
        "microbatches": [6, 10],
        "schedule": ("interleaved_1f1b", 2, list(layout.stage_layers)),
        "degrees": [[1, 1, 1, 1, 1, 1], [2, 1, 2, 1, 2, 2]],
        "layer_tp": [2, 1, 2, 1, 2, 2],
    }
    assert live == restart
