"""NTPStrategy: a Lightning strategy for nonuniform tensor parallelism with data parallelism.

On one machine it forks its worker processes (cheap: Lightning and the data are already imported;
no child re-runs the command line, so Hydra multirun stays clean); under torchrun or SLURM,
Lightning's cluster environment supplies the ranks and nothing is launched.  In every worker it
joins the process group (gloo on CPU, NCCL on GPU), builds the Topology and its groups, and hands
the LightningModule an `NTPRuntime` that shards the model and synchronises gradients across
replicas of unequal TP.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ntp_nemo.parallel.runtime import NTPRuntime
from ntp_nemo.topology import Topology


class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher without shipping rank 0's weights back to the parent
    (the model is sharded; checkpoints and run-directory files carry the results)."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))


class NTPStrategy(ParallelStrategy):
    strategy_name = "ntp"

    def __init__(
        self,
        tp: int,
        replica_tp: Sequence[int],
        layer_tp: Sequence[int],
        pp: int = 1,
        power_boost: Any = None,
        bucket_mb: float = 25.0,
        start_method: str = "fork",
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.topology = Topology(tp, replica_tp, layer_tp, pp)
        self.power_boost = power_boost
        self.bucket_mb = bucket_mb
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.runtime: NTPRuntime | None = None
        self.num_nodes = 1

    # ---- processes ----------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        c = self.topology.coord(self.global_rank)
        return {"num_replicas": self.topology.dp, "rank": c.replica}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _ForkLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size != self.topology.world_size:
            raise RuntimeError(f"{self.world_size} processes for a layout of {self.topology.world_size} ranks")
        if self.topology.world_size > 1:
            torch.set_num_threads(max(1, torch.get_num_threads() if self.root_device.type == "cuda" else 1))
            self.set_world_ranks()
            self._process_group_backend = (self._process_group_backend
                                           or _get_default_process_group_backend_for_device(self.root_device))
            kwargs: dict[str, Any] = {"timeout": self._timeout}
            if self.root_device.type != "cpu":
                kwargs["device_id"] = self.root_device
            _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self.runtime = NTPRuntime(self.topology, self.global_rank, self.power_boost)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        with self.precision_plugin.tensor_init_context():
            yield

    # ---- collectives ----------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if not _distributed_is_initialized():
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    def teardown(self) -> None:
        super().teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # ---- reporting ------------------------------------------------------------------------------
    @property
    def layout_info(self) -> dict[str, Any]:
        topo = self.topology
        return {"layout": topo.describe(), "capacity": topo.capacity_fraction}

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            import shutil

            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                os.remove(path)
