"""Silent corruption and non-finite steps: found, attributed, acted on and said (the `integrity` group).

Three detectors, each deciding the same way on every rank (from values every rank holds):

- **non-finite step** (the fused step scalars say some rank's gradient or loss was not finite; the step
  applied no update).  Attribution by replay from the state before the step: each replica evaluates its
  own samples of the step one by one (forward only); a sample whose loss is not finite is evaluated by
  the other replicas too.  Non-finite on two replicas (or on the only one) -> `data`: the sample is
  skipped (`GlobalBatchSampler.skip`, recorded in `integrity/skipped_samples.json` so a rerun skips it
  too) and the step redone without it.  If no sample is, the step is replayed whole on the same ranks,
  each rank's gradient checked before the DP sync: finite -> `transient`, the replay is the step;
  non-finite again on one rank -> `device`: that rank leaves at the next step and the live path goes on
  without it.
- **loss or gradient-norm spike** beyond `spike_zscore` standard deviations of the last `spike_window`
  steps: rolled back to the last verified state and replayed; a spike the replay does not repeat was
  `transient`, one it repeats is kept (`reproducible`) unless one rank's own gradient norm stands out
  (`device`, excluded as above).
- **replica divergence**: every `every_n_steps` steps the replicas' parameter fingerprints
  (`parallel.fingerprint`) are compared; a mismatch names the replica against the majority, its rank and
  parameter.  A corrupted replica's gradients reach every replica through the DP sum within a step, so
  every rank rolls back to the last verified state (`keep_verified`: a copy of the parameters, optimizer
  and schedule taken at each passed check, one more model and optimizer in host memory per rank) and
  replays the steps since; the same rank diverging again is a bad device and is excluded.

Each finding is one console line (global rank 0), a line of `integrity/incidents.jsonl`
(`goodput.incidents`, read by `ntp-incidents RUN_DIR` and the run summary) and the seconds it took as
an `integrity` goodput event.  Checks that pass cost only their time (the `integrity` badput too).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections import Counter, deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from ntp_nemo.config.schema import IntegrityConfig
from ntp_nemo.goodput.incident_log import append_incident, load_skipped, record_skipped
from ntp_nemo.parallel.fingerprint import (
    FingerprintPlan,
    build_plan,
    compare,
    descriptors,
    gather_fingerprints,
    gather_plan,
    local_fingerprints,
    replica_fingerprints,
)
from ntp_nemo.resilience.faults import KILL_EXIT_CODE

OUTLIER = 1e3  # a rank's own gradient norm this many times the others' median: its device is suspect


@dataclass
class Verified:
    """The state at the last passed fingerprint check (`keep_verified`), to roll back to."""

    step: int
    model_id: int
    params: list[torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: tuple
    fingerprint: int


def _rng_state() -> tuple:
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class IntegrityWatch(Callback):
    """The detectors and actions above, in every worker (global rank 0 writes and prints)."""

    def __init__(self, cfg: IntegrityConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        window = max(3, int(cfg.spike_window))
        self.history: dict[str, deque] = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.verified: Verified | None = None
        self._plan: tuple[int, FingerprintPlan] | None = None
        self._before: tuple[dict, tuple] | None = None  # schedule and RNG state at the current step's start
        self._refetch_until = 0  # batches of steps below this were fetched before a skip: rebuild them
        self._exit_next = False  # this rank's device was found bad: leave when the next step starts
        self.divergent: Counter = Counter()  # rank -> divergences found on it
        self.findings: list[dict[str, Any]] = []  # every finding of this process (the same on all ranks)

    # ---- Lightning hooks -------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # First among the callbacks: a redone step's record is what the metrics and the goodput see.
        cbs = trainer.callbacks
        if self in cbs:
            cbs.remove(self)
            cbs.insert(0, self)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        skip = sorted({int(i) for i in self.cfg.skip_samples or ()} | set(load_skipped(self.run_dir)))
        if skip:
            pl_module.data.sampler.skip(skip)
            self._refetch_until = trainer.global_step + 3
            self._say(trainer, f"integrity: skipping {len(skip)} training sample(s) recorded as bad data: "
                               f"{', '.join(map(str, skip[:10]))}{' ...' if len(skip) > 10 else ''}")
        recovery = getattr(trainer.strategy, "recovery", None)
        if getattr(recovery, "rejoining", False):
            return  # a repaired process joining a running job: the survivors are not at a start to check with
        if self.cfg.every_n_steps and self.cfg.keep_verified:
            self._check(trainer, pl_module, int(trainer.global_step))  # the first verified state

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._exit_next:
            os._exit(KILL_EXIT_CODE)  # as a lost GPU: the live path re-plans without this rank
        self._before = (copy.deepcopy(pl_module.lr_schedulers().state_dict()), _rng_state())
        step = int(batch["step"])
        if step < self._refetch_until:  # fetched ahead of a skip: the stream has changed since
            batch.update(pl_module.batch_of_step(step, pl_module.runtime.device))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        rec = pl_module.last_step
        if self.verified is not None and self.verified.model_id != id(pl_module.model):
            self.verified = None  # a live recovery changed the layout: the copy no longer fits
        if rec.get("skipped"):
            self._nonfinite(trainer, pl_module, batch, step)
        else:
            spike = self._spike(rec)
            if spike:
                self._on_spike(trainer, pl_module, batch, step, spike)
        every = int(self.cfg.every_n_steps)
        if every and step % every == 0:
            self._check(trainer, pl_module, step)
        for key in self.history:
            value = pl_module.last_step.get(key)
            if value is not None and value == value and abs(value) != float("inf"):
                self.history[key].append(float(value))

    # ---- helpers ---------------------------------------------------------------------------------
    def _say(self, trainer: Trainer, line: str) -> None:
        if trainer.is_global_zero:
            print(line, flush=True)

    def _finding(self, trainer: Trainer, t0: float, **fields: Any) -> None:
        cost = time.perf_counter() - t0
        finding = {**fields, "cost_s": round(cost, 6)}
        self.findings.append(finding)
        if not trainer.is_global_zero:
            return
        append_incident(self.run_dir, finding)
        where = ", ".join(f"{k} {fields[k]}" for k in ("replica", "rank", "parameter", "sample")
                          if fields.get(k) is not None)
        print(f"integrity: step {fields['step']}: {fields['kind']} ({where or 'no rank named'}): "
              f"{fields['verdict']} -> {fields['action']} ({cost:.2f} s)", flush=True)
        self._goodput(trainer, cost)

    def _goodput(self, trainer: Trainer, seconds: float) -> None:
        from ntp_nemo.lightning.goodput_callback import GoodputCallback

        cb = GoodputCallback.of(trainer)
        if cb is not None:
            cb.record("integrity", seconds=seconds)

    def _gather(self, pl_module: LightningModule, value: Any) -> list[Any]:
        rt = pl_module.runtime
        if not dist.is_initialized():
            return [value]  # one process
        out: list[Any] = [None] * dist.get_world_size(rt.world_group)
        dist.all_gather_object(out, value, group=rt.world_group)
        return out

    def _context(self, trainer: Trainer):
        plugin = getattr(trainer, "precision_plugin", None)
        return plugin.train_step_context() if plugin is not None else nullcontext()

    def _train(self, trainer: Trainer, pl_module: LightningModule, batch: dict, watch: bool = False
               ) -> tuple[Any, torch.Tensor | None]:
        """One optimizer step of `batch` (the module's path, its raw optimizer: Lightning's step count is
        not touched).  `watch`: also this rank's own squared gradient norm before the DP sync (NaN when
        not finite)."""
        from ntp_nemo.runtime.step import train_step

        state = trainer.strategy.state
        params = [p for p in state.model.parameters() if p.requires_grad]
        own: list[torch.Tensor] = []
        backward = pl_module.manual_backward
        if watch:
            def backward(loss: torch.Tensor) -> None:  # after each micro-batch, before the step's DP sync
                pl_module.manual_backward(loss)
                own[:] = [_own_norm(params)]

        with self._context(trainer):
            result = train_step(state, batch["micro"], int(batch["global_tokens"]),
                                max_norm=pl_module.optim_cfg["grad_clip"], optimizer=state.optimizer,
                                scheduler=pl_module.lr_schedulers(), backward=backward)
        return result, (own[0] if own else None)

    def _restore_schedule(self, trainer: Trainer, pl_module: LightningModule, saved: dict) -> None:
        """The LR schedule as `saved`, and the optimizer's learning rates with it (a schedule's state does
        not hold them: its last step wrote them into the optimizer)."""
        sched = pl_module.lr_schedulers()
        sched.load_state_dict(copy.deepcopy(saved))
        for group, lr in zip(trainer.strategy.state.optimizer.param_groups, sched.get_last_lr(), strict=True):
            group["lr"] = lr

    def _record_step(self, pl_module: LightningModule, result: Any, verdict: str) -> None:
        rec = pl_module.last_step
        rec.pop("skipped", None)
        rec.update(loss=result.loss, grad_norm=result.grad_norm, integrity=verdict)
        if result.skipped:
            rec["skipped"] = True

    # ---- non-finite steps ------------------------------------------------------------------------
    def _eval_nonfinite(self, trainer: Trainer, pl_module: LightningModule, ids: list[int]) -> list[bool]:
        """Forward only, sample by sample, on this replica: is each sample's loss not finite?"""
        rt, model = pl_module.runtime, pl_module.model
        flags = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._context(trainer):
                for i in ids:
                    tokens = pl_module.data.train.batch([i])
                    flags.append(~torch.isfinite(rt.eval_microbatches(model, [tokens])))
        finally:
            model.train(was_training)
        return [bool(x) for x in torch.stack(flags).cpu().tolist()] if flags else []

    def _nonfinite(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int) -> None:
        t0 = time.perf_counter()
        rt = pl_module.runtime
        rng = _rng_state()
        sampler, mbs = pl_module.data.sampler, pl_module.micro_batch_size
        micro = sampler.microbatch_ids(int(batch["step"]), mbs)
        mine = [int(i) for j in rt.my_microbatches(len(micro)) for i in micro[j]]
        last = rt.coord.stage == rt.topology.pp - 1
        replica, dp = rt.coord.replica, rt.topology.dp
        seen = self._gather(pl_module, (replica, last, mine, self._eval_nonfinite(trainer, pl_module, mine)))
        suspects = sorted({i for rep, lst, ids, fl in seen if lst for i, f in zip(ids, fl, strict=True) if f})
        if suspects:
            others = [i for i in suspects if i not in mine]
            again = self._gather(pl_module, (replica, last, others,
                                             self._eval_nonfinite(trainer, pl_module, others)))
            bad_on: dict[int, set[int]] = {i: set() for i in suspects}
            for rep, lst, ids, fl in (*seen, *again):
                for i, f in zip(ids, fl, strict=True):
                    if lst and f and i in bad_on:
                        bad_on[i].add(rep)
            data = [i for i in suspects if len(bad_on[i]) >= min(2, dp)]
            _set_rng_state(rng)
            if data:
                self._skip(trainer, pl_module, batch, step, data, bad_on, t0)
            for i in suspects:
                if i not in data:
                    (rep,) = bad_on[i] or {None}
                    self._finding(trainer, t0, step=step, kind="nonfinite", replica=rep, sample=i,
                                  verdict="device", action="reported: the sample's loss is finite on the "
                                  "other replicas, not on this one (no single rank named)")
            return
        _set_rng_state(self._before[1] if self._before else rng)
        self._restore_schedule(trainer, pl_module, self._before[0])
        result, own = self._train(trainer, pl_module, batch, watch=True)
        if not result.skipped:
            self._record_step(pl_module, result, "transient")
            self._finding(trainer, t0, step=step, kind="nonfinite", verdict="transient",
                          action="step replayed from the state before it on the same ranks: finite, kept")
            return
        self._record_step(pl_module, result, "device")
        self._device(trainer, pl_module, step, own, t0, "nonfinite", "the replay was not finite again")

    def _skip(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int, data: list[int],
              bad_on: dict[int, set[int]], t0: float) -> None:
        pl_module.data.sampler.skip(data)
        if trainer.is_global_zero:
            record_skipped(self.run_dir, data)
        self._refetch_until = int(batch["step"]) + 3
        fresh = pl_module.batch_of_step(int(batch["step"]), pl_module.runtime.device)
        batch.update(fresh)
        if self._before is not None:
            _set_rng_state(self._before[1])
            self._restore_schedule(trainer, pl_module, self._before[0])
        result, _ = self._train(trainer, pl_module, fresh)
        self._record_step(pl_module, result, "data")
        for i in data:
            self._finding(trainer, t0, step=step, kind="nonfinite", sample=i, verdict="data",
                          action=f"sample skipped (recorded), step redone without it; not finite on "
                                 f"replica(s) {', '.join(map(str, sorted(bad_on[i])))}")

    def _device(self, trainer: Trainer, pl_module: LightningModule, step: int, own: torch.Tensor | None,
                t0: float, kind: str, why: str) -> None:
        """Name the rank whose own gradient (before the sync) is not finite or stands out; exclude it."""
        norms = self._gather(pl_module, float(own) if own is not None else float("nan"))
        bad = _outliers(norms)
        rt = pl_module.runtime
        if len(bad) == 1:
            (rank,) = bad
            replica = rt.topology.coord(rank).replica
            if rank == trainer.global_rank:
                self._exit_next = True
            self._finding(trainer, t0, step=step, kind=kind, rank=rank, replica=replica, verdict="device",
                          action=f"{why}; rank {rank}'s own gradient is the outlier: it leaves at the next "
                                 "step (the live path continues without it)")
            return
        self._finding(trainer, t0, step=step, kind=kind, verdict="unknown",
                      action=f"{why}; no single rank's own gradient stands out "
                             f"({'ranks ' + ', '.join(map(str, bad)) if bad else 'none'}): reported")

    # ---- spikes ----------------------------------------------------------------------------------
    def _spike(self, rec: dict) -> str | None:
        z = float(self.cfg.spike_zscore)
        if z <= 0:
            return None
        for key, window in self.history.items():
            if len(window) < window.maxlen:
                continue
            value = rec.get(key)
            mean, std = statistics.fmean(window), statistics.pstdev(window)
            if value is not None and std > 0 and (value - mean) / std > z:
                return f"{key} {value:.4g} is {(value - mean) / std:.1f} standard deviations above the " \
                       f"last {len(window)} steps' mean {mean:.4g}"
        return None

    def _on_spike(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int, why: str
                  ) -> None:
        t0 = time.perf_counter()
        if self.verified is None:
            self._finding(trainer, t0, step=step, kind="spike", verdict="unknown", detail=why,
                          action="reported (no verified state to replay from)")
            return
        first = self.verified.step
        before = dict(pl_module.last_step)
        result, own = self._rollback_and_replay(trainer, pl_module, step, watch=True)
        again = self._spike({"loss": result.loss, "grad_norm": result.grad_norm})
        self._record_step(pl_module, result, "spike")
        if not again:
            self._finding(trainer, t0, step=step, kind="spike", verdict="transient", detail=why,
                          action=f"rolled back to verified step {first}, replayed {step - first} step(s): "
                                 f"loss {before['loss']:.6g} -> {result.loss:.6g}")
            return
        norms = self._gather(pl_module, float(own) if own is not None else float("nan"))
        if _outliers(norms):
            self._device(trainer, pl_module, step, own, t0, "spike", f"the replay repeated it ({again})")
            return
        self._finding(trainer, t0, step=step, kind="spike", verdict="reproducible", detail=why,
                      action=f"rolled back to verified step {first} and replayed: the replay repeats it and "
                             "no rank stands out (the data or the model itself): kept")

    # ---- fingerprints, verified state, rollback -------------------------------------------------
    def _fingerprints(self, trainer: Trainer, pl_module: LightningModule) -> tuple[FingerprintPlan, list]:
        model = pl_module.model
        rt = pl_module.runtime
        one = not dist.is_initialized()
        if self._plan is None or self._plan[0] != id(model):
            plan = build_plan([descriptors(model)], [0]) if one else gather_plan(model, rt.coord.replica,
                                                                                 group=rt.world_group)
            self._plan = (id(model), plan)
        plan = self._plan[1]
        local = local_fingerprints(model, plan.fragments[trainer.global_rank])
        if one:
            return plan, [local.cpu().tolist()]
        return plan, gather_fingerprints(local, plan, group=rt.world_group)

    def _check(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        t0 = time.perf_counter()
        gathered = _between_steps(trainer, lambda: self._fingerprints(trainer, pl_module))
        if gathered is None:  # a peer was lost during the check: the survivors recovered, no check this step
            return
        plan, got = gathered
        mismatches = compare(plan, got)
        if not mismatches:
            if self.cfg.keep_verified:
                self._keep(trainer, pl_module, step, replica_fingerprints(plan, got))
            if trainer.is_global_zero:
                self._goodput(trainer, time.perf_counter() - t0)
            return
        ranks = sorted({m.rank for m in mismatches})
        for r in ranks:
            self.divergent[r] += 1
        first = self.verified.step if self.verified is not None else None
        if first is not None:
            result, _ = self._rollback_and_replay(trainer, pl_module, step)
            if result is not None:  # the step's record: its replay (what the state now holds)
                self._record_step(pl_module, result, "replayed")
            _, again = self._fingerprints(trainer, pl_module)
            fixed = not compare(plan, again)
            if fixed:
                self._keep(trainer, pl_module, step, replica_fingerprints(plan, again))
            action = (f"every rank rolled back to verified step {first} and replayed {step - first} step(s); "
                      f"replicas {'agree again' if fixed else 'STILL DISAGREE'}")
        else:
            action = "reported (no verified state: integrity.keep_verified=false)"
        for m in mismatches:
            repeat = self.divergent[m.rank] > 1
            if repeat and m.majority and m.rank == trainer.global_rank:
                self._exit_next = True
            verdict = "device" if repeat and m.majority else "bitflip" if m.majority else "unknown"
            what = action + ("; diverged again: the rank leaves at the next step" if repeat and m.majority
                             else "")
            named = m.majority
            self._finding(trainer, t0, step=step, kind="divergence", replica=m.replica if named else None,
                          rank=m.rank if named else None, parameter=m.parameter, verdict=verdict,
                          action=what, detail=m.describe())

    def _keep(self, trainer: Trainer, pl_module: LightningModule, step: int, fingerprints: dict) -> None:
        state = trainer.strategy.state
        with torch.no_grad():  # in host memory: the device keeps its memory for training
            params = [p.detach().to("cpu", copy=True) for p in state.model.parameters()]
        optimizer = _host_copy(state.optimizer.state_dict())
        self.verified = Verified(step, id(pl_module.model), params, optimizer,
                                 copy.deepcopy(pl_module.lr_schedulers().state_dict()), _rng_state(),
                                 next(iter(fingerprints.values()), 0))

    def _rollback_and_replay(self, trainer: Trainer, pl_module: LightningModule, step: int,
                             watch: bool = False) -> tuple[Any, torch.Tensor | None]:
        """Every rank back to the verified state, then steps `verified.step + 1 .. step` again."""
        v = self.verified
        assert v is not None
        state = trainer.strategy.state
        with torch.no_grad():
            for p, saved in zip(state.model.parameters(), v.params, strict=True):
                p.copy_(saved)
        state.optimizer.load_state_dict(copy.deepcopy(v.optimizer))
        self._restore_schedule(trainer, pl_module, v.scheduler)
        _set_rng_state(v.rng)
        device = pl_module.runtime.device
        result, own = None, None
        for index in range(v.step, step):  # 0-based step indices of steps v+1 .. step
            last = index == step - 1
            result, own = self._train(trainer, pl_module, pl_module.batch_of_step(index, device),
                                      watch=watch and last)
        return result, own


def _between_steps(trainer: Trainer, fn: Any) -> Any:
    """`fn()`, collectives outside the training step, run as the strategy runs its own
    (`NTPStrategy.between_steps`): under live recovery a peer lost during them is recovered from before
    the next step and None is returned (the survivors ahead may have passed them before the loss)."""
    between = getattr(trainer.strategy, "between_steps", None)
    return between(fn) if between is not None else fn()


def _host_copy(value: Any) -> Any:
    """A deep copy of a state dict with every tensor copied to host memory (a load casts them back)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


def _own_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """This rank's squared norm of its own gradients (NaN or inf when one is not finite)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()


def _outliers(norms: list[float]) -> list[int]:
    """Ranks whose own squared gradient norm is not finite, or `OUTLIER` times the others' median."""
    bad = [r for r, n in enumerate(norms) if n != n or n == float("inf")]
    if bad:
        return bad
    out = []
    for r, n in enumerate(norms):
        rest = [m for q, m in enumerate(norms) if q != r]
        if rest and n > OUTLIER * max(statistics.median(rest), 1e-30):
            out.append(r)
    return out


__all__ = ["IntegrityWatch", "Verified"]
