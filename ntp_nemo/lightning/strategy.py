"""NTPStrategy: a Lightning strategy for nonuniform tensor parallelism with data parallelism.

On one machine it forks its worker processes (cheap: Lightning and the data are already imported;
no child re-runs the command line, so Hydra multirun stays clean); under torchrun or SLURM,
Lightning's cluster environment supplies the ranks and nothing is launched.  In every worker it
joins the process group (gloo on CPU, NCCL on GPU), builds the Topology and its groups, and hands
the LightningModule an `NTPRuntime` that shards the model and synchronises gradients across
replicas of unequal TP.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ntp_nemo.launch.loopback import host_loopback_store
from ntp_nemo.lightning.adapter import (
    ForkLauncher,
    StrategyAdapter,
    default_process_group_backend,
    destroy_groups_at_exit,
    distributed_is_initialized,
    init_process_group,
    quiet_sigterm_broadcast,
    sync_ddp_if_available,
    unwrap_optimizer,
    warn_if_unsupported_lightning,
)
from ntp_nemo.lightning.hooks import RecoveryHooks
from ntp_nemo.quant.quant_state import quant_state
from ntp_nemo.runtime.assemble import RankState
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU-side collectives (all_gather_object, a CPU
    flag); gloo alone on CPU."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return default_process_group_backend(device)


class NTPStrategy(StrategyAdapter):
    """Options come with the constructor; recovery behaviour with one `RecoveryHooks` object
    (`ntp_nemo.lightning.hooks`: which hook runs when), the base class's (none) by default."""

    strategy_name = "ntp"

    def __init__(
        self,
        layout: ResolvedLayout,
        bucket_mb: float = 25.0,
        start_method: str = "fork",
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        allow_cross_node_tp: bool = False,
        cpu_tp_backend: str = "ntpdirect",
        recovery: RecoveryHooks | None = None,
        **kwargs: Any,
    ) -> None:
        """`layout`: the run's layout, resolved once from the config before launch
        (`ntp_nemo.config.resolve_layout.resolve_layout`).  `keep_last`, `async_save`: `checkpoint.keep_last`,
        `checkpoint.async_save`; `allow_cross_node_tp`: `ntp.allow_cross_node_tp`; `cpu_tp_backend`:
        `ntp.cpu_tp_backend` (the workers' TP groups on a CPU world, `topology.groups.tp_backend`);
        `recovery`: live
        recovery's hooks (None: none).  Other keywords go to Lightning's `ParallelStrategy`
        (`parallel_devices`: the device of each local rank)."""
        warn_if_unsupported_lightning()
        super().__init__(**kwargs)
        if not isinstance(layout, ResolvedLayout):
            raise TypeError(f"NTPStrategy takes a ResolvedLayout, got {type(layout).__name__}")
        self.layout = layout
        self.topology = layout.topology()
        self.bucket_mb = bucket_mb
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.keep_last = keep_last
        self.async_save = async_save
        self.allow_cross_node_tp = allow_cross_node_tp
        self.cpu_tp_backend = cpu_tp_backend
        self.recovery = recovery if recovery is not None else RecoveryHooks()
        self._saver: Any = None  # the asynchronous checkpoint saver (async_save), made at setup
        self.runtime: NTPRuntime | None = None  # the current state's (kept as an attribute: read per step)
        self.state: RankState | None = None
        self._launch_devices: list[torch.device] | None = None  # every process's device, as launched
        self._own_device: torch.device | None = None  # this process's device, as launched (kept by adopt)
        self.num_nodes = 1
        self._rendezvous_server: dist.TCPStore | None = None  # rank 0 of a local launch (loopback only)

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

    @property
    def collective_timeout_s(self) -> float:
        """The bound of every collective and rendezvous (`fault.collective_timeout_s`)."""
        return self._timeout.total_seconds()

    def make_launcher(self) -> ForkLauncher:
        """The launcher of the workers this strategy forks: the recovery's, else a `ForkLauncher`."""
        launcher = self.recovery.make_launcher(self)
        return launcher if launcher is not None else ForkLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()  # in the worker: torch.cuda.set_device(its own device) on GPU
        if self.world_size != self.topology.world_size:
            raise RuntimeError(
                f"{self.world_size} processes for a layout of {self.topology.world_size} ranks"
            )
        if self.topology.world_size > 1:
            if self.root_device.type == "cpu":
                torch.set_num_threads(1)  # several CPU ranks share the cores: no oversubscription
            from ntp_nemo.launch.cpp_log import quiet_cpp_warnings

            quiet_cpp_warnings()  # a lost store or peer is reported in one line, not c10d's C++ stacks
            from ntp_nemo.topology.groups import CPU_TP_BACKEND_ENV

            os.environ[CPU_TP_BACKEND_ENV] = self.cpu_tp_backend  # read where this process makes TP groups
            self.set_world_ranks()
            self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
            kwargs: dict[str, Any] = {"timeout": self._timeout}
            if self.root_device.type == "cuda" and "nccl" in self._process_group_backend:
                kwargs["device_id"] = self.root_device  # NCCL communicators bound to this rank's GPU
            from ntp_nemo.topology.groups import open_files_needed, raise_open_file_limit

            world = self.topology.world_size  # gloo's sockets: refused here, not at the first save
            raise_open_file_limit(open_files_needed(world), world)
            # A repaired process joins the running job's generation; a cluster task, generation 0 on the
            # coordinator's store (the recovery's rendezvous); else env://.
            if not self.recovery.init_process_group(self):
                self._rendezvous_server = self._loopback_rendezvous_store()
                try:
                    init_process_group(self.cluster_environment, self._process_group_backend, **kwargs)
                except RuntimeError as err:  # DistNetworkError: MASTER_PORT held by another process
                    from ntp_nemo.lightning.environments import port_taken_error

                    taken = port_taken_error(err)
                    if taken is None:
                        raise
                    raise taken from None
            destroy_groups_at_exit(self._process_group_backend)
            if not self.recovery.rejoining and self.cluster_environment.creates_processes_externally:
                self._check_placement()
        # The rank's runtime, model and optimizer come with its RankState (the module's configure_model
        # assembles it; `adopt` installs it).

    def _check_placement(self) -> None:
        """Collective, once at start-up of a launcher-started job: every TP group inside one node (else
        ConfigError), and a warning from rank 0 for tasks that each see one GPU of a larger node."""
        from ntp_nemo.launch.devices import visible_gpus
        from ntp_nemo.launch.node_layout import check_placement

        def warn(text: str) -> None:  # printed before a refusal too (check_placement)
            if self.global_rank == 0:
                print(f"warning: {text}", flush=True)

        check_placement(self.topology, allow_cross_node_tp=self.allow_cross_node_tp,
                        visible_gpus=visible_gpus(self.root_device.type == "cuda"), warn=warn)

    def adopt(self, state: RankState) -> None:
        """Make `state` this rank's: the only place a rank's layout, runtime, model, optimizer and gradient
        path change (start-up, live recovery, rejoin).  A state on another layout or rank (live) also
        moves the rank numbering, the devices, the cluster environment and rank 0's duties (metrics,
        goodput, the console, Lightning's loggers) to whichever process is rank 0 now."""
        old = self.state
        if old is not None and old.grad_path is not state.grad_path:
            old.grad_path.remove()  # its hooks and buckets belong to the old model and groups
        self.state, self.runtime, self.layout = state, state.runtime, state.layout
        self.topology = state.runtime.topology  # the one whose process groups the run uses
        module = self.lightning_module
        module.model = state.model  # Lightning's child module (precision, device moves, checkpoints)
        if old is None:
            self._launch_devices = list(self.parallel_devices or [])
            self._own_device = self.root_device if self._launch_devices else None
            return
        if state.runtime.topology.shares_groups(old.runtime.topology):
            # A rebalance: the same ranks and process groups (another batch split, or the shards re-laid
            # out among them, `resilience.shard_relayout`)
            return
        world = state.layout.world_size
        if isinstance(self.cluster_environment, LightningEnvironment):  # forked here: local rank = rank
            # The process keeps its own device (its tensors, its CUDA context) under its new rank: the
            # launch list at the new rank is another process's GPU once ranks below it are gone.
            self.parallel_devices = [self._own_device if r == state.rank else d
                                     for r, d in enumerate(self._launch_devices[:world])]
            os.environ["LOCAL_RANK"] = str(state.rank)
        # (a cluster task keeps its node-local rank and device; its global rank and world move)
        self.cluster_environment.set_global_rank(state.rank)
        self.cluster_environment.set_world_size(world)
        rank_zero_only.rank = fabric_rank_zero_only.rank = state.rank
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        goodput = GoodputCallback.of(module.trainer)
        if goodput is not None:
            goodput.set_global_zero(state.rank == 0)
        # The asynchronous saver's process group and write plan belong to the old generation: the next
        # save builds new ones.  (A save still in flight when a rank was lost never commits; the one
        # before it stays the latest checkpoint.)
        self._saver = None

    def rebalance(self, layout: ResolvedLayout) -> None:
        """From the next step on, run `layout`: the running layout with other batch shares (a straggler's
        replica measured slower gets less of the global batch, `ResolvedLayout.speeds`).  Every rank holds
        the same shards in the same process groups, so nothing moves; every rank calls it at the same
        step (the straggler watch's verdicts are computed alike on every rank).  Shards that move (other
        `shard_speeds`) are the live re-layout's (`resilience.shard_relayout`, then `adopt`)."""
        if not layout.same_shards(self.layout):
            raise ValueError(f"a rebalance keeps the ranks' shards: {layout.describe()} is not "
                             f"{self.layout.describe()} with the same shard weights")
        runtime = copy.copy(self.runtime)  # the same place, groups, sync and engine, read for a new split
        runtime.layout = layout
        self.adopt(dataclasses.replace(self.state, layout=layout, runtime=runtime))

    def _loopback_rendezvous_store(self) -> dist.TCPStore | None:
        """In rank 0 of workers we forked (their store not hosted by the launching process): the env://
        rendezvous store's server, bound to loopback; torch's rendezvous, asking for a multi-tenant
        server on the same port, serves from it instead of binding every interface."""
        # Not `creates_processes_externally`: Lightning sets LOCAL_RANK in the workers it forks too.
        listener = getattr(self.launcher, "listener", None)  # the port the launcher held over the fork
        if (self.launcher is None or self.global_rank != 0
                or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
            if listener is not None:
                listener.close()  # this worker's inherited copy: rank 0 serves on the port
            return None
        port = self.cluster_environment.main_port
        if listener is None or listener.getsockname()[1] != port:
            listener = None
        return host_loopback_store(port, multi_tenant=True, timeout_s=self._timeout.total_seconds(),
                                   listener=listener)

    def set_world_ranks(self) -> None:
        """Ranks we launched: local rank = global rank (one node).  Under torchrun/SLURM the launcher's
        RANK/SLURM_PROCID stand (nodes may run unequal process counts: no node_rank * devices)."""
        env = self.cluster_environment
        # Not `env.creates_processes_externally`: Lightning sets LOCAL_RANK in the workers it forks too.
        if isinstance(env, LightningEnvironment):
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        quiet_sigterm_broadcast(trainer)
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.async_save and self._saver is None and not self._local():
            from ntp_nemo.checkpoint import AsyncCheckpointSaver

            self._saver = AsyncCheckpointSaver()
            self._saver.prepare()  # its world-sized gloo group now, not at the first save

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        with self.precision_plugin.tensor_init_context():
            yield

    # ---- collectives ----------------------------------------------------------------------------
    def _local(self) -> bool:
        """No collective: not distributed, or a repaired process still starting up (the survivors are
        not running Lightning's start-up with it)."""
        return not distributed_is_initialized() or self.recovery.collectives_local()

    def barrier(self, name: str | None = None) -> None:
        if not self._local():
            self.between_steps(dist.barrier)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._local():
            return obj

        def once() -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src)
            return box[0]

        # Interrupted by a lost peer (live recovery), it is not redone (a peer may have passed it
        # already): this rank keeps its own value, as every rank holds the same one here.
        out = self.between_steps(once)
        return obj if out is None else out

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and not self._local():
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        if self._local():
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    def teardown(self) -> None:
        if self._saver is not None:  # an asynchronous save must commit before the workers exit
            self._saver.wait()
            self._saver.close()
            self._saver = None
        super().teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()

    # ---- checkpoints: topology-independent, sharded (ntp_nemo.checkpoint) -----------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist: its state is resharded in place with the weights

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # written shard by shard in save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    @property
    def torch_optimizer(self) -> Any:
        """The rank's torch optimizer (None before `setup`)."""
        return unwrap_optimizer(self.optimizers[0]) if self.optimizers else None

    @property
    def saver(self) -> Any:
        """The asynchronous checkpoint saver (None without `async_save`, or before the first save); its
        `wait()` returns once the save in flight has committed."""
        return self._saver

    def follow_scheduler_lr(self) -> None:
        """Set every parameter group's learning rate to the one the (restored) LR scheduler gives: a
        repaired process's optimizer was built afresh, its scheduler restored from the survivors."""
        opt = self.torch_optimizer
        for group, lr in zip(opt.param_groups, self.lr_scheduler_configs[0].scheduler.get_last_lr(),
                             strict=True):
            group["lr"] = lr

    def _goodput(self, event: str, **fields: Any) -> None:
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        cb = GoodputCallback.of(trainer) if trainer is not None else None
        if cb is not None:
            cb.record(event, **fields)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None
    ) -> None:
        """Collective; a peer lost during it (live recovery) leaves this save uncommitted."""
        step = int(checkpoint.get("global_step", 0))
        self.between_steps(self._save_checkpoint, checkpoint, filepath,
                           what=f"the checkpoint of step {step} (it never commits; the next save writes "
                                "one)")

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path) -> None:
        """Collective: every rank writes the chunks it owns; Lightning's own state rides along as `extra`.

        With `async_save`, tensors are snapshotted and written by a background thread; the commit
        (manifest + rename) happens when the write is done, and the next save waits for it.
        """
        import time

        from ntp_nemo.checkpoint import AsyncCheckpointSaver, save_checkpoint

        path = Path(self.broadcast(str(filepath)))
        step = int(checkpoint.get("global_step", 0))
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        extra["quant"] = quant_state(self.lightning_module.model)  # None unless the model is quantised
        layout = self.layout.to_dict()
        t0 = time.perf_counter()
        self._goodput("ckpt_save_start", step=step)
        try:
            if self.async_save and self._saver is None:
                self._saver = AsyncCheckpointSaver()
            save = self._saver.save if self.async_save else save_checkpoint
            done = save(path, self.lightning_module.model, self.torch_optimizer, extra, step=step,
                        layout=layout, keep_last=self.keep_last)
        except BaseException as err:  # a lost peer, a full disk, Ctrl-C: the save has an end either way
            self._goodput("ckpt_save_abort", step=step, reason=f"{type(err).__name__}: {err}"[:300])
            raise
        self._goodput("ckpt_save_end", step=step, blocking_s=time.perf_counter() - t0)
        if self.async_save:  # the background commit is its own event
            done.add_done_callback(
                lambda f: self._goodput("ckpt_commit", step=step, ok=f.exception() is None))

    records_checkpoint_events = True  # GoodputCallback leaves save start/end to `_save_checkpoint`

    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Collective: each rank reads exactly the slices its layout needs (any saved layout).

        Data digests are checked while reading.  A corrupt file in a checkpoint of this run's own
        checkpoint directory (resume=auto, failover restarts) makes every rank fall back to the
        previous valid one, with a warning naming the file; one named from elsewhere fails naming it.
        On the layout it was saved from, every rank's RNG states are put back just before the next
        training step (after Lightning has built its data iterators), so randomness continues exactly.
        """
        import sys
        import warnings

        import lightning.pytorch as pl

        from ntp_nemo.checkpoint import CheckpointSkippedWarning, load_with_fallback, read_manifest
        from ntp_nemo.checkpoint.rng import set_rng_state

        restored = self.recovery.restore_state(self)  # a repaired process: from the survivors' memory
        if restored is not None:
            return restored
        path = Path(self.broadcast(str(checkpoint_path)))
        trainer = self.lightning_module.trainer
        own_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
        fallback = own_dir is not None and Path(own_dir).resolve() == path.parent.resolve()
        self._goodput("ckpt_restore_start")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointSkippedWarning)
            loaded = load_with_fallback(
                path, self.lightning_module.model, self.torch_optimizer, fallback=fallback, saver=self._saver
            )
        for w in caught:
            if not issubclass(w.category, CheckpointSkippedWarning):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            elif self.is_global_zero:
                print(f"warning: {w.message}", file=sys.stderr, flush=True)
        if self.is_global_zero:  # announced once the data has passed its check, never before
            step = read_manifest(loaded.path).get("step")
            instead = f"; instead of {path}, whose data failed its check" if loaded.path != path else ""
            print(f"resuming from {loaded.path} (step {step}; data checked as it loaded{instead})",
                  flush=True)
        saved = ResolvedLayout.from_checkpoint(loaded.layout)
        if saved is not None and saved.same_ranks(self.layout) and len(loaded.rng) == self.world_size:
            state = loaded.rng[self.global_rank]

            class _RestoreRNG(pl.Callback):  # once, at the first training step after this load
                def on_train_batch_start(self, *args: Any) -> None:
                    nonlocal state
                    if state is not None:
                        set_rng_state(state)
                        state = None

            trainer.callbacks.append(_RestoreRNG())
        self._goodput("ckpt_restore_end", step=int(loaded.extra.get("global_step", 0)))
        return loaded.extra

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            import shutil

            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                os.remove(path)

    # ---- live recovery (fault.recovery=live): `self.recovery`, a RecoveryHooks --------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The step under the recovery's hooks: live recovery runs it, and on a lost peer replaces this
        strategy's runtime and layout in place (`adopt`) and redoes the step."""
        self.recovery.before_step(self)
        return self.recovery.run_step(self, super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The validation step under the recovery's hooks: live recovery redoes it on the new layout when
        a peer is lost during it."""
        return self.recovery.run_validation_step(self, super().validation_step, *args, **kwargs)

    def between_steps(self, fn: Any, *args: Any, what: str | None = None) -> Any:
        """Run `fn`, a collective outside the training step (barrier, broadcast, checkpoint save, a callback's
        gather): under live recovery a lost peer is recovered from before the next step and `fn` is not
        redone (None): a peer may have passed the collective before the loss and be recovering inside the
        next training step.  Every collective a callback runs between steps goes through here."""
        return self.recovery.run_between_steps(self, fn, *args, what=what)

    def final_save(self, save: Any, committed: Any) -> None:
        """The end of training's checkpoint save, `save(again)`: under live recovery a peer lost during it
        is recovered from and the survivors write it again until `committed()` holds on every rank (no
        next step follows to catch up on it, as a periodic save's next one would)."""
        self.recovery.run_final_save(self, save, committed)

    # ---- reporting ------------------------------------------------------------------------------
    @property
    def layout_info(self) -> dict[str, Any]:
        return {"layout": self.layout.describe(), "capacity": self.layout.capacity_fraction()}
