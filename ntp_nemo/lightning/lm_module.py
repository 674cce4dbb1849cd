"""LightningModule for NTP language-model training.

The model is built in `configure_model` from the strategy's runtime (its rank's slice of every
layer); one `training_step` is one optimizer step over this replica's share of the global batch
(manual optimisation, since replicas run different numbers of micro-batches), followed by the
fragment gradient sync, the TP-aware clipping, the optimizer and the LR schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ntp_nemo.data.prepare import DataBundle
from ntp_nemo.lightning.adapter import count_skipped_step
from ntp_nemo.lightning.batches import StepBatches, ValBatches
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.compute_time import ComputeTimer
from ntp_nemo.schedules import warmup_cosine


def batch_loader(batches: Any, device: torch.device) -> DataLoader:
    """The loader of a dataset of whole batches (`StepBatches`, `ValBatches`): in this process, and for a
    CUDA device into pinned host memory (Lightning fetches a batch ahead, so the pinning happens before
    its step and `transfer_batch_to_device` copies it asynchronously); on the CPU nothing is pinned."""
    return DataLoader(batches, batch_size=None, shuffle=False, num_workers=0,
                      pin_memory=device.type == "cuda")


class NTPLanguageModule(pl.LightningModule):
    def __init__(
        self,
        model_cfg: ModelConfig,
        optim: dict,
        data: DataBundle,
        *,
        seed: int,
        micro_batch_size: int,
        val_batches: int,
        max_steps: int,
        overlap_grad_sync: bool = False,
        tp_overlap: bool = False,
        tp_chunks: int = 1,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_cfg, self.optim_cfg, self.data = model_cfg, optim, data
        self.seed, self.micro_batch_size, self.val_batches, self.max_steps = (
            seed,
            micro_batch_size,
            val_batches,
            max_steps,
        )
        self.model: torch.nn.Module | None = None  # set by NTPStrategy.adopt only (Lightning's child module)
        self._train_set: StepBatches | None = None
        self.last_step: dict[str, Any] = {}
        self.stop_agreed = False  # some rank asked to stop (from the last step's fused all-reduce)
        self.overlap_grad_sync = overlap_grad_sync
        self.tp_overlap = tp_overlap
        self.tp_chunks = tp_chunks
        self.compile_blocks = compile
        self.weights_drawn = True  # False: `configure_model` built the model for a checkpoint to fill
        # Times each step's compute, every rank's riding on the fused scalars (set by the straggler watch
        # or a `slow` fault; None: untimed) and what the last step gathered (index = global rank).
        self.compute_timer: ComputeTimer | None = None
        self.rank_compute_s: tuple[float, ...] | None = None
        # The integrity watch's per-step check (`train_step`'s `own` and `guard`; None: unchecked) and
        # every rank's own statistic the last step gathered (index = global rank).
        self.integrity_own: Callable[[], torch.Tensor] | None = None
        self.integrity_guard: Callable[[dict], bool] | None = None
        self.rank_own: tuple[float, ...] | None = None

    @property
    def runtime(self):
        """The strategy's current runtime (a live recovery replaces it)."""
        return self.trainer.strategy.runtime

    @property
    def grad_path(self):
        """The strategy's current gradient path: DP sync (blocking or overlapped) and clipping."""
        return self.trainer.strategy.state.grad_path

    def my_microbatches(self, num_microbatches: int) -> range:
        """This replica's share of the micro-batches on the strategy's current layout (the datasets ask
        at every batch, so a live recovery's new split applies from the next one)."""
        return self.trainer.strategy.runtime.my_microbatches(num_microbatches)

    # ---- model and optimizer --------------------------------------------------------------------
    def weights_restored(self) -> bool:
        """Every weight is overwritten before the first step, so `configure_model` draws none: `fit` was
        given a checkpoint directory (`resume`, a restart-path relaunch: `NTPTrainer.resume_from`), or
        this process rejoins a running job (its shards come from the survivors: the strategy's recovery
        hooks say `rejoining`).  A plain Lightning Trainer, or one of Lightning's checkpoint keywords
        (`"last"`, which may find nothing), draws them."""
        trainer = self.trainer
        recovery = getattr(trainer.strategy, "recovery", None)
        return bool(getattr(trainer, "resume_from", None)) or bool(getattr(recovery, "rejoining", False))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from ntp_nemo.runtime.assemble import assemble

        strategy = self.trainer.strategy
        self.weights_drawn = not self.weights_restored()  # else every value is overwritten: none is drawn
        strategy.adopt(assemble(strategy.layout, strategy.global_rank, self.model_cfg, self.optim_cfg,
                                strategy.root_device, seed=self.seed, bucket_mb=strategy.bucket_mb,
                                overlap_grad_sync=self.overlap_grad_sync, tp_overlap=self.tp_overlap,
                                tp_chunks=self.tp_chunks, compile=self.compile_blocks,
                                initialize=self.weights_drawn))
        # Dropout draws from the global generator: seed it from the run's seed, the same on every rank
        # (the TP ranks of a replica must draw the same masks); a resume restores the saved states.
        torch.manual_seed(self.seed)

    def configure_optimizers(self):
        o = self.optim_cfg
        opt = self.trainer.strategy.state.optimizer  # built with the model by `assemble`
        recompute = getattr(self.model_cfg, "recompute", "none")
        if self.trainer.is_global_zero and (recompute != "none" or self.grad_path.distributed
                                            or self.overlap_grad_sync):
            print(f"memory options: recompute={recompute}, optimizer={type(opt).__name__}, gradient sync="
                  f"{'overlapped with the backward' if self.overlap_grad_sync else 'after the backward'}",
                  flush=True)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, warmup_cosine(o["warmup_steps"], self.max_steps, o["min_lr_ratio"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- data -------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        self._train_set = StepBatches(
            self.data.train,
            self.data.sampler,
            self.micro_batch_size,
            self.max_steps,
            self.my_microbatches,
        )
        self._train_set.start_step = self.trainer.global_step
        return batch_loader(self._train_set, self.trainer.strategy.root_device)

    def batch_of_step(self, step: int, device: torch.device) -> dict:
        """The batch of training step index `step` (0-based) as the loader gives it now, on `device`:
        after live recovery changed the layout, the split of a step the loader fetched before."""
        ds = self._train_set
        return self.transfer_batch_to_device(ds[step - ds.start_step], device, 0)

    def validation_batch(self, device: torch.device) -> dict:
        """The validation batch as the loader gives it now, on `device`: after live recovery changed the
        layout, the split of a validation the loader fetched before."""
        ds = ValBatches(self.data.val, self.val_batches, self.micro_batch_size, self.my_microbatches)
        return self.transfer_batch_to_device(ds[0], device, 0)

    def val_dataloader(self) -> DataLoader:
        ds = ValBatches(self.data.val, self.val_batches, self.micro_batch_size, self.my_microbatches)
        return batch_loader(ds, self.trainer.strategy.root_device)

    def on_train_start(self) -> None:
        if not self.weights_drawn and not self.trainer.ckpt_path:  # Lightning read no checkpoint
            raise RuntimeError(
                "the model was built without initial weights for a checkpoint to overwrite them, but no "
                "checkpoint was loaded: pass fit a checkpoint directory, or build the module drawing them")
        # The loops are restored before the first batch is fetched: start from the restored step.
        if self._train_set is not None:
            self._train_set.start_step = self.trainer.global_step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Lets `ntp-export` rebuild the model without the run's Hydra files.
        import dataclasses

        checkpoint["model_config"] = dataclasses.asdict(self.model_cfg)

    # ---- steps ------------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Only the token micro-batches go to the device; the step index and token count stay host
        integers (reading them never waits for the device)."""
        if isinstance(batch, dict) and "micro" in batch:
            micro = batch["micro"]
            if device.type == "cuda" and micro.device.type == "cpu" and not micro.is_pinned():
                micro = micro.pin_memory()  # from pageable memory the copy would hold the host until done
            return {**batch, "micro": micro.to(device, non_blocking=True)}
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _stop_requested(self) -> bool:
        """A preemption/interrupt signal reached this rank (folded into the step's fused all-reduce)."""
        from ntp_nemo.lightning.callbacks import PreemptionCheckpoint

        return any(cb.requested for cb in self.trainer.callbacks if isinstance(cb, PreemptionCheckpoint))

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        """One optimizer step.  Device work only, except one host read of the fused step scalars
        (loss, gradient norm, non-finite and stop flags: one all-reduce), which decides, identically
        on every rank, whether the optimizer steps (a non-finite gradient skips it)."""
        from ntp_nemo.runtime.step import train_step

        t0 = time.perf_counter()
        opt = self.optimizers()
        sched = self.lr_schedulers()
        # the strategy's recovery hooks (`NTPStrategy.recovery`), None under another strategy
        recovery = getattr(getattr(self.trainer, "strategy", None), "recovery", None)
        epoch = recovery.abort_epoch() if recovery is not None else 0
        global_tokens = int(batch["global_tokens"])
        rt = self.runtime
        num_micro = self.data.sampler.global_batch_size // self.micro_batch_size
        mine = rt.my_microbatches(num_micro)
        if "first" in batch and (int(batch["first"]), len(batch["micro"])) != (mine.start, len(mine)):
            batch = self.batch_of_step(int(batch["step"]), rt.device)  # fetched before a rebalance
        timer = self.compute_timer
        if timer is not None:
            timer.device = rt.device
        lr = sched.get_last_lr()[0]
        # A generation aborted meanwhile (NCCL): its results are never applied.
        check = (lambda: recovery.check_generation(epoch)) if recovery is not None else None
        # no update on a skipped step, but Lightning still counts it (global_step stays the batch step)
        result = train_step(self.trainer.strategy.state, batch["micro"], global_tokens,
                            max_norm=self.optim_cfg["grad_clip"], optimizer=opt, scheduler=sched,
                            backward=self.manual_backward, stop=self._stop_requested,
                            before_update=check, on_skip=count_skipped_step, timer=timer,
                            commit_check=check if recovery is not None and recovery.aborts_silently()
                            else None, own=self.integrity_own, guard=self.integrity_guard)
        self.rank_compute_s = result.compute_s
        self.rank_own = result.own
        skipped = result.skipped
        self.stop_agreed = result.stop  # read by PreemptionCheckpoint at the end of the batch
        loss, grad_norm = result.loss, result.grad_norm
        # Host values logged as CPU tensors: a float would become a device tensor (a host-to-device copy,
        # read back for the loggers), twice a step.
        self.log("train/loss", torch.tensor(loss), prog_bar=True, rank_zero_only=True, batch_size=1)
        self.log("train/grad_norm", torch.tensor(grad_norm), rank_zero_only=True, batch_size=1)
        self._log_step(int(batch["step"]) + 1)
        self.last_step = {
            "step": int(batch["step"]) + 1,
            "loss": loss,
            "tokens": global_tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "compute_s": time.perf_counter() - t0,
            "microbatches": rt.microbatch_counts(num_micro),
        }
        if skipped:
            self.last_step["skipped"] = True  # non-finite gradient on some rank: no update this step
        return {"loss": torch.tensor(loss)}

    def step_note(self) -> dict:
        """What this rank says of its last completed step to the survivors of a lost peer who had not
        completed it (`take_step_as_done`): its record and whether a stop was agreed."""
        return {"record": dict(self.last_step), "stop": bool(self.stop_agreed)}

    def take_step_as_done(self, batch: dict, note: dict) -> dict:
        """The step of `batch` was completed by the survivors ahead of this rank when a peer was lost (a
        collective finished on them and not here, or the loss aborted the step here after they had
        applied it); since the reshard this rank holds their state, so the step is not run again: it is
        counted (Lightning's global step, the LR schedule) and reported with what they said of it
        (`note`: a `step_note`)."""
        record = dict(note["record"])
        if record.get("step") != int(batch["step"]) + 1:
            raise RuntimeError(f"the survivors ahead reported step {record.get('step')} as their last, not "
                               f"step {int(batch['step']) + 1}, which this rank was running")
        count_skipped_step(self.optimizers())  # no update here: the state received holds it
        self.rank_compute_s = None  # not timed here
        self.lr_schedulers().step()
        self.stop_agreed = bool(note["stop"])
        self.log("train/loss", torch.tensor(record["loss"]), prog_bar=True, rank_zero_only=True, batch_size=1)
        self.log("train/grad_norm", torch.tensor(record["grad_norm"]), rank_zero_only=True, batch_size=1)
        self._log_step(int(record["step"]))
        self.last_step = record
        return {"loss": torch.tensor(record["loss"])}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        total = self.runtime.eval_microbatches(self.model, list(batch["micro"]))
        loss = float(self.runtime.global_sum(total)) / int(batch["global_tokens"])
        self.log("val/loss", torch.tensor(loss), prog_bar=True, rank_zero_only=True, batch_size=1)
        self._log_step(int(self.trainer.global_step))  # after that many optimizer steps
        self.last_val_loss = loss

    def _log_step(self, step: int) -> None:
        """The loggers' step (Lightning uses a logged `step` as the x-axis): metrics.jsonl's, the count of
        optimizer steps done, where Lightning's own counter is one behind during the training step."""
        self.log("step", torch.tensor(float(step), dtype=torch.float64), rank_zero_only=True, batch_size=1)
