"""Launch environments told apart by their variables: a batch script without srun is not a SLURM launch
(one node: ntp-train launches its ranks; several: a clear error), one visible GPU per task binds cuda:0,
and CUDA generator states restore whatever the number of visible GPUs.  torch.cuda is mocked where a
count is needed; nothing here calls CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.node_layout import (
    check_not_batch_of_several_nodes,
    launcher_layout,
    slurm_batch_without_srun,
)
from tests.conftest import SINGLE, TINY, read_metrics

# What an sbatch script sees (`#SBATCH --ntasks=4`): the allocation's variables, no task step's.
BATCH = {"SLURM_JOB_ID": "812", "SLURM_JOB_NAME": "train.sh", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
         "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
         "SLURM_JOB_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": "4"}
# What srun adds for each task of its step.
STEP = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4",
        "SLURM_STEP_NUM_NODES": "1"}


def test_a_batch_script_is_not_a_slurm_launch():
    assert launcher_layout(BATCH) is None and slurm_batch_without_srun(BATCH)
    # The batch step's own id (SLURM_BATCH_SCRIPT) or the extern step are no task step either.
    for special in ("4294967291", "4294967292", "batch", "extern"):
        assert launcher_layout({**BATCH, "SLURM_STEP_ID": special}) is None
    task = launcher_layout({**BATCH, **STEP, "SLURM_PROCID": "2", "SLURM_LOCALID": "2"})
    assert (task.launcher, task.global_rank, task.world_size, task.local_world_size) == ("slurm", 2, 4, 4)
    assert not slurm_batch_without_srun({**BATCH, **STEP})
    check_not_batch_of_several_nodes(BATCH)  # one node: ntp-train launches its ranks there
    with pytest.raises(ConfigError) as err:
        check_not_batch_of_several_nodes({**BATCH, "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert err.value.key == "launcher" and "srun python -m ntp_nemo.train" in str(err.value)


def test_lightning_does_not_detect_slurm_from_a_batch_script(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from ntp_nemo.lightning.environments import cluster_environment

    for k, v in BATCH.items():
        monkeypatch.setenv(k, v)
    assert SLURMEnvironment.detect()  # what Lightning would pick by itself: a launch of 4 that never started
    env = cluster_environment(launcher_layout())
    assert isinstance(env, LightningEnvironment) and not env.creates_processes_externally


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK"))}
    return {**env, **extra}


def test_ntp_train_in_a_batch_script_trains_here(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli_env([*TINY, "mesh.dp=2", "mesh.tp=1", "ntp.replica_tp=null", "trainer.max_steps=2",
                        f"hydra.run.dir={run_dir}"], tmp_path, _env(**BATCH))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SLURM batch script without srun" in proc.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


def test_ntp_train_in_a_batch_script_of_two_nodes_stops_with_exit_2(tmp_path):
    env = _env(**{**BATCH, "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"})
    proc = run_cli_env([*TINY, *SINGLE, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                       tmp_path, env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "launcher" in proc.stderr and "srun" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def run_cli_env(args: list[str], cwd, env: dict, timeout: int = 300):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ntp_nemo.train", *args], cwd=cwd, capture_output=True,
                          env={**env, "PYTHONUNBUFFERED": "1"}, text=True, timeout=timeout)


def _visible_gpus(monkeypatch, ids: str) -> None:
    """torch.cuda as a process with CUDA_VISIBLE_DEVICES=`ids` would count it (NVML), without CUDA."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ids)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: len(ids.split(",")))


def test_one_visible_gpu_per_task_binds_cuda_0(monkeypatch):
    from ntp_nemo.launch.devices import local_cuda_ordinals

    _visible_gpus(monkeypatch, "3")  # srun --gpus-per-task=1: this task's GPU is physical GPU 3
    assert local_cuda_ordinals(4) == [0, 0, 0, 0]
    _visible_gpus(monkeypatch, "0,1,2,3")  # srun --gpus-per-node=4 or torchrun: the node's GPUs
    assert local_cuda_ordinals(4) == [0, 1, 2, 3]
    assert local_cuda_ordinals(3) == [0, 1, 2]
    _visible_gpus(monkeypatch, "0,1")
    with pytest.raises(ConfigError) as err:
        local_cuda_ordinals(4)
    assert err.value.key == "CUDA_VISIBLE_DEVICES" and "--gpus-per-task=1" in str(err.value)


def test_trainer_of_an_srun_task_with_one_gpu_binds_cuda_0(monkeypatch, tmp_path):
    """Task 2 of `srun --ntasks-per-node=4 --gpus-per-task=1`: Lightning is given the one GPU the task
    sees, not 4 devices, and the rank's device is cuda:0."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    from hydra.core.global_hydra import GlobalHydra
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.data.prepare import build_data
    from ntp_nemo.lightning.factory import build_trainer
    from tests.conftest import compose

    for tracker in (rank_zero_only, fabric_rank_zero_only):
        monkeypatch.setattr(tracker, "rank", getattr(tracker, "rank", 0))
    for k, v in {**BATCH, **STEP, "SLURM_PROCID": "2", "SLURM_LOCALID": "2"}.items():
        monkeypatch.setenv(k, v)
    _visible_gpus(monkeypatch, "2")
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 1)
    GlobalHydra.instance().clear()
    cfg = compose([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=1",
                   "trainer.accelerator=gpu"])
    d = cfg.data
    data = build_data(d.path, d.tokenizer, int(d.seq_len), int(d.global_batch_size), int(cfg.seed),
                      float(d.val_fraction), int(cfg.model.vocab_size))
    _, _, strategy = build_trainer(resolve(cfg), tmp_path, data)
    assert strategy.parallel_devices == [torch.device("cuda", 0)] * 4
    assert strategy.root_device == torch.device("cuda", 0) and strategy.local_rank == 2


class _FakeCuda:
    """The CUDA generator calls `set_rng_state` makes, on a machine with `count` visible GPUs."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.count, self.calls = count, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda s, device="cuda": self.calls.append(("one", s)))

        def set_all(states):  # torch's: one per visible device, an invalid ordinal raises
            if len(states) > self.count:
                raise RuntimeError(f"CUDA error: invalid device ordinal {self.count}")
            self.calls.append(("all", list(states)))

        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)


def test_cuda_rng_state_restores_when_the_visible_gpu_count_changed(monkeypatch):
    from ntp_nemo.checkpoint.rng import rng_state, set_rng_state

    state = rng_state()  # on CPU: no CUDA entry
    own = torch.arange(16, dtype=torch.uint8)
    cuda = _FakeCuda(monkeypatch, count=1)  # resumed with --gpus-per-task=1
    set_rng_state({**state, "cuda": own})  # this rank's generator goes to its device
    assert len(cuda.calls) == 1 and cuda.calls[0][0] == "one" and torch.equal(cuda.calls[0][1], own)
    cuda.calls.clear()
    set_rng_state({**state, "cuda": [own] * 4})  # an older checkpoint of 4 visible GPUs: no failure
    assert cuda.calls == []
    cuda.count = 4
    set_rng_state({**state, "cuda": [own] * 4})  # same count: every device as saved
    assert [c[0] for c in cuda.calls] == ["all"]
