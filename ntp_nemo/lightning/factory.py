"""Build the Lightning Trainer, NTPStrategy and LightningModule of one attempt from the run's `RunSpec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate

from ntp_nemo.config.resolve import RunSpec
from ntp_nemo.data.prepare import DataBundle
from ntp_nemo.lightning.callbacks import (
    FinalValidation,
    MemoryReport,
    MetricsJSONL,
    PreemptionCheckpoint,
    RunSummary,
    StepCheckpoint,
    StopAtStep,
)
from ntp_nemo.lightning.environments import cluster_environment, launcher_layout
from ntp_nemo.lightning.goodput_callback import GoodputCallback
from ntp_nemo.lightning.hooks import RecoveryHooks
from ntp_nemo.lightning.lm_module import NTPLanguageModule
from ntp_nemo.lightning.strategy import NTPStrategy
from ntp_nemo.topology.layout import ResolvedLayout


class NTPTrainer(pl.Trainer):
    """Lightning's Trainer, recording the checkpoint `fit` resumes from before Lightning builds the model
    (Lightning sets `ckpt_path` only as it reads the checkpoint, after `configure_model`): the module then
    draws no initial weight that the checkpoint overwrites (`NTPLanguageModule.weights_restored`)."""

    resume_from: str | None = None  # the checkpoint directory of the current `fit`, else None

    def fit(self, model: pl.LightningModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Any = None, ckpt_path: Any = None, weights_only: bool | None = None) -> None:
        # Only a directory (the project's checkpoints): Lightning's keywords ("last", "hpc") may find none.
        self.resume_from = str(ckpt_path) if ckpt_path is not None and Path(ckpt_path).is_dir() else None
        super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)


def process_layout(world_size: int) -> tuple[int, int]:
    """(devices on this node, nodes) for Lightning: from torchrun/SLURM when they launched us (nodes may
    run unequal process counts; see ntp_nemo.lightning.environments), else all on this machine."""
    layout = launcher_layout()
    if layout is None:
        return world_size, 1
    layout.check(world_size)
    return layout.local_world_size, layout.num_nodes


def build_trainer(
    spec: RunSpec,
    run_dir: Path,
    data: DataBundle,
    layout: ResolvedLayout | None = None,
    extra_callbacks: Sequence[Any] = (),
    cuda_devices: Sequence[int] | None = None,
    stop_at_step: int | None = None,
    job_started: bool = False,
) -> tuple[NTPTrainer, NTPLanguageModule, NTPStrategy]:
    """`layout`: the attempt's layout (default the run's, `spec.layout`; the supervisor passes a
    re-planned one). `cuda_devices`: the CUDA ordinal each local rank binds (the supervisor's relaunch
    after a lost GPU); default ranks 0..n-1 on ordinals 0..n-1.  `stop_at_step`: where this attempt
    stops (default `trainer.stop_at_step`). `extra_callbacks`: added to the Trainer's; one that is a
    `RecoveryHooks` (live recovery's) is also the strategy's recovery. `job_started`: the caller
    records the lifetime's `job_start` in goodput.jsonl (else the goodput callback does).

    In stages: the processes and devices (`_placement`) -> the strategy (`_strategy`) -> the callbacks
    (`_callbacks`) and loggers -> the Trainer -> the module (`_module`)."""
    t, ckpt = spec.trainer, spec.checkpoint
    layout = layout if layout is not None else spec.layout
    devices, nodes, parallel_devices = _placement(spec, layout, cuda_devices)
    # Live recovery's hooks come with the callbacks (ntp_nemo.resilience's LiveRecovery is both).
    recovery = next((cb for cb in extra_callbacks if isinstance(cb, RecoveryHooks)), None)
    strategy = _strategy(spec, layout, recovery, parallel_devices)
    env = cluster_environment(launcher_layout())
    callbacks = _callbacks(spec, run_dir, stop_at_step, job_started, extra_callbacks)
    loggers = [instantiate(lg) for lg in spec.loggers]
    trainer = NTPTrainer(
        accelerator="gpu" if t.accelerator in ("gpu", "cuda") else t.accelerator,
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        plugins=[env] if env is not None else None,
        precision=t.precision,
        deterministic=bool(t.deterministic),  # torch.use_deterministic_algorithms in every worker
        max_steps=int(t.max_steps),
        max_epochs=-1,
        val_check_interval=int(t.val_every_n_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=int(t.log_every_n_steps),
        enable_progress_bar=bool(t.progress_bar),
        enable_checkpointing=bool(ckpt.every_n_steps or ckpt.save_on_end),
        callbacks=callbacks,
        logger=loggers or False,
        use_distributed_sampler=False,
        default_root_dir=str(run_dir),
        enable_model_summary=False,
    )
    # After the Trainer, which turned deterministic algorithms on or off (torch fills new memory only while
    # they are on, and by default does): the workers inherit both flags.
    torch.utils.deterministic.fill_uninitialized_memory = bool(t.fill_uninitialized_memory)
    return trainer, _module(spec, data), strategy


def _placement(spec: RunSpec, layout: ResolvedLayout,
               cuda_devices: Sequence[int] | None) -> tuple[Any, int, list[torch.device] | None]:
    """(devices, nodes, parallel_devices) for Lightning: the processes of this node and the node count,
    and on GPU the device each local rank binds (None: Lightning's choice, ranks 0..n-1 on devices
    0..n-1)."""
    devices, nodes = process_layout(layout.world_size)
    if spec.trainer.accelerator not in ("gpu", "cuda"):
        return devices, nodes, None
    if cuda_devices is None and launcher_layout() is not None:
        from ntp_nemo.launch.devices import local_cuda_ordinals

        ordinals = local_cuda_ordinals(devices)  # one GPU per task: every rank binds cuda:0
        # The GPUs Lightning checks exist, and the device of each rank.
        return sorted(set(ordinals)), nodes, [torch.device("cuda", i) for i in ordinals]
    if cuda_devices is not None:
        if len(cuda_devices) != devices or nodes != 1:
            raise ValueError(f"{len(cuda_devices)} CUDA devices for {devices} processes on {nodes} nodes")
        # Local rank i binds cuda:cuda_devices[i] (ranks may share a GPU: gloo only, NCCL refuses that).
        return (sorted(set(int(i) for i in cuda_devices)), nodes,
                [torch.device("cuda", int(i)) for i in cuda_devices])
    return devices, nodes, None


def _strategy(spec: RunSpec, layout: ResolvedLayout, recovery: RecoveryHooks | None,
              parallel_devices: list[torch.device] | None) -> NTPStrategy:
    """The attempt's `NTPStrategy` on `layout`, with the recovery hooks of live recovery (else None)."""
    t, ckpt = spec.trainer, spec.checkpoint
    return NTPStrategy(
        layout,
        bucket_mb=float(spec.ntp.grad_bucket_mb),
        start_method=t.start_method,
        process_group_backend=t.process_group_backend,
        timeout=timedelta(seconds=float(spec.failover.fault.collective_timeout_s)),
        keep_last=int(ckpt.keep_last),
        async_save=bool(ckpt.async_save),
        allow_cross_node_tp=bool(spec.ntp.allow_cross_node_tp),
        cpu_tp_backend=str(spec.ntp.cpu_tp_backend),
        recovery=recovery,
        parallel_devices=parallel_devices,
    )


def _callbacks(spec: RunSpec, run_dir: Path, stop_at_step: int | None, job_started: bool,
               extra_callbacks: Sequence[Any]) -> list[Any]:
    """The Trainer's callbacks, in order: metrics, goodput, the summary, checkpoints, the memory report,
    stop handling, the final validation, the progress line, the config's `callbacks` group, QAT, then
    `extra_callbacks` (the supervisor's: fault injection, heartbeats, live recovery)."""
    t, ckpt = spec.trainer, spec.checkpoint
    metrics = MetricsJSONL(run_dir)
    goodput = GoodputCallback(str(run_dir), job_started=job_started)
    callbacks: list[Any] = [metrics, goodput, RunSummary(run_dir, metrics)]
    if ckpt.every_n_steps or ckpt.save_on_end:
        callbacks.append(StepCheckpoint(run_dir / ckpt.dir, int(ckpt.every_n_steps), bool(ckpt.save_on_end)))
    callbacks.append(MemoryReport(spec.data.micro_batch_size, spec.data.seq_len, spec.num_microbatches))
    callbacks.append(PreemptionCheckpoint())
    callbacks.append(FinalValidation())  # after the last step, whatever trainer.max_steps is
    stop_at_step = stop_at_step if stop_at_step is not None else t.stop_at_step
    if stop_at_step:
        callbacks.append(StopAtStep(int(stop_at_step)))
    if t.progress_bar:
        from ntp_nemo.lightning.callbacks import StepProgress

        callbacks.append(StepProgress())  # steps of max_steps, loss, tokens/s, ETA; plain lines off a TTY
    callbacks += [instantiate(c) for c in spec.callbacks]
    if spec.quant.format != "none":  # ntp_nemo.lightning.qat.QuantizationCallback
        callbacks.append(instantiate(dataclasses.asdict(spec.quant)))
    callbacks += list(extra_callbacks)  # failure injection and heartbeats (ntp_nemo.resilience)
    return callbacks


def _module(spec: RunSpec, data: DataBundle) -> NTPLanguageModule:
    """The `NTPLanguageModule` of the run (it builds the rank's model in `configure_model`)."""
    t = spec.trainer
    return NTPLanguageModule(
        spec.model,
        spec.optim_options(),
        data,
        seed=spec.seed,
        micro_batch_size=int(spec.data.micro_batch_size),
        val_batches=int(spec.data.val_batches),
        max_steps=int(t.max_steps),
        overlap_grad_sync=bool(spec.ntp.overlap_grad_sync),
        tp_overlap=bool(spec.ntp.tp_overlap),
        tp_chunks=int(spec.ntp.tp_chunks),
        compile=bool(t.compile),
    )
