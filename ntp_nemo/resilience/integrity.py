"""Silent corruption and non-finite steps: found, attributed, acted on and said (the `integrity` group).

Three detectors, each deciding the same way on every rank (from values every rank holds):

- **non-finite step** (the fused step scalars say some rank's gradient or loss was not finite; the step
  applied no update).  Attribution by replay from the state before the step: each replica evaluates its
  own samples of the step one by one (forward only); a sample whose loss is not finite is evaluated by
  the other replicas too.  Non-finite on two replicas (or on the only one) -> `data`: the sample is
  skipped (`GlobalBatchSampler.skip`, recorded in `integrity/skipped_samples.json` so a rerun skips it
  too) and the step redone without it.  If no sample is, the step is replayed whole on the same ranks,
  each rank's gradient checked before the DP sync: finite -> `transient`, the replay is the step;
  suspect again on one rank -> the cross replay (`cross_replay`: another replica computes the same
  micro-batches): not reproduced -> `device`, that rank leaves and the live path redoes the step without
  it; reproduced -> `reproducible` (the data's, applied as computed).  The per-step check's held steps
  (a rank's own largest gradient element or layer input standing out of its stage's) go the same way.
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

Every action on a finding runs under the live path's guard (`_act`): a peer lost during it leaves each
survivor with its state at the action's start, and the recovery reshards that.

Each finding is one console line (global rank 0), a line of `integrity/incidents.jsonl`
(`goodput.incidents`, read by `ntp-incidents RUN_DIR` and the run summary) and the seconds it took as
an `integrity` goodput event.  Checks that pass cost only their time (the `integrity` badput too).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
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
from ntp_nemo.resilience.cross_replay import CrossVerdict, cross_source, cross_verdict, tolerance
from ntp_nemo.resilience.faults import KILL_EXIT_CODE, FaultInjector

DEVICE_RATIO = 1e6  # one replica (no cross replay): a repeated outlier this many times every other rank's
#                    (or not finite) is a bad device; a smaller one is the data's (kept)
SLOTS = 64  # the per-step check's slots per rank: parameter i of the rank's stage in slot i % SLOTS, then one
#             for the activations entering its layers


@dataclass(frozen=True)
class Suspect:
    """A rank whose own value of a slot (a parameter's largest gradient element before the DP sync, or
    `SLOTS`: the largest activation entering its layers) stands out of its stage's other ranks'."""

    rank: int
    slot: int
    value: float
    others: float  # the largest of the other ranks' values of the slot (NaN: the value is not finite)


def _others_max(own: Sequence[float], stages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [world, width], for each (rank, slot) the largest finite value of the slot among the other
    ranks of its stage holding it: -inf when none).  Vectorised: O(world x width)."""
    world = len(stages)
    vals = torch.tensor(own, dtype=torch.float64).view(world, -1)
    usable = torch.where((vals >= 0) & torch.isfinite(vals), vals, torch.full_like(vals, -float("inf")))
    out = torch.full_like(vals, -float("inf"))
    stage_of = torch.tensor(list(stages))
    for stage in sorted(set(stages)):
        idx = (stage_of == stage).nonzero().flatten()
        if len(idx) < 2:
            continue
        top, arg = usable[idx].topk(2, dim=0)  # the two largest of each slot, and whose
        mine = torch.arange(len(idx)).unsqueeze(1) == arg[0].unsqueeze(0)
        out[idx] = torch.where(mine, top[1].unsqueeze(0), top[0].unsqueeze(0))
    return vals, out


def find_suspects(own: Sequence[float], stages: Sequence[int], ratio: float) -> list[Suspect]:
    """Every (rank, slot) whose value is not finite or more than `ratio` times every other rank's value of
    the slot among the ranks of its pipeline stage (those hold the same parameters, in any sharding).
    `own`: every rank's row of `SLOTS + 1` values, flattened (index = global rank; < 0: not held)."""
    if not own or len(stages) < 2 or ratio <= 0:
        return []
    vals, others = _others_max(own, stages)
    held = ~(vals < 0)  # NaN is held
    bad = held & ~torch.isfinite(vals)
    bad |= held & (others > -float("inf")) & (vals > ratio * others.clamp(min=1e-30))
    return [Suspect(int(r), int(j), float(vals[r, j]),
                    float(others[r, j]) if torch.isfinite(vals[r, j]) else float("nan"))
            for r, j in bad.nonzero().tolist()]


def device_evidence(repeated: Sequence[Suspect]) -> bool:
    """Whether outliers a replay repeated exactly are a bad device's: some value is not finite or more than
    `DEVICE_RATIO` times every other rank's (what a flipped high exponent bit gives); smaller ones can be
    the data's (a sample unlike the others)."""
    return any(s.value != s.value or s.value == float("inf") or s.value > DEVICE_RATIO * s.others
               for s in repeated)


def largest_ratio(own: Sequence[float], stages: Sequence[int]) -> float:
    """The largest ratio of a rank's finite value to every other rank's of its stage (what the per-step
    check compares with `integrity.outlier_ratio`), over the slots the other ranks' value is > 0 in."""
    if not own or len(stages) < 2:
        return 0.0
    vals, others = _others_max(own, stages)
    ok = (vals >= 0) & torch.isfinite(vals) & (others > 0)
    return float((vals[ok] / others[ok]).max()) if bool(ok.any()) else 0.0


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


class LayerInputs:
    """The largest activation entering a model's layers and final norm (forward pre-hooks), on the device,
    since the last `reset`; `attach` moves the hooks to another model (a live recovery's)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self._model: int | None = None

    def attach(self, model: torch.nn.Module) -> None:
        if id(model) == self._model:
            return
        for h in self._hooks:
            h.remove()
        self._hooks, self._model = [], id(model)
        blocks = getattr(model, "blocks", None)
        for m in [*(blocks.values() if blocks is not None else ()), getattr(model, "final_norm", None)]:
            if isinstance(m, torch.nn.Module):
                self._hooks.append(m.register_forward_pre_hook(self._hook))

    def reset(self) -> None:
        self.value = None

    def _hook(self, mod: Any, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            m = _largest(x)
            self.value = m if self.value is None else torch.maximum(self.value, m)


def _largest(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 0-dim tensor (NaN if any element is NaN): one pass, no temporary."""
    lo, hi = t.detach().aminmax()
    return torch.maximum(-lo, hi).float()


def own_row(model: torch.nn.Module, activations: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A rank's row of the per-step check, on the device, before the DP sync: slot i % SLOTS holds the
    largest gradient element of the rank's parameter i (NaN when one is not finite), the last slot the
    largest activation that entered a layer (`LayerInputs.value`); -1: nothing held there."""
    out = torch.full((SLOTS + 1,), -1.0, dtype=torch.float32, device=device)
    for i, p in enumerate(model.parameters()):
        if p.grad is None or p.grad.numel() == 0:
            continue
        m = _largest(p.grad)
        j = i % SLOTS
        out[j] = m if i < SLOTS else torch.maximum(out[j], m)
    if activations is not None:
        out[SLOTS] = activations
    return out


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
        self._inputs = LayerInputs()  # this rank's largest activation entering a layer, this step
        self._model: int | None = None  # id of the model the watch's state belongs to

    # ---- Lightning hooks -------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # First among the callbacks: a redone step's record is what the metrics and the goodput see.
        cbs = trainer.callbacks
        if self in cbs:
            cbs.remove(self)
            cbs.insert(0, self)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if float(self.cfg.outlier_ratio) > 0:  # the per-step check rides on every step's fused scalars
            pl_module.integrity_own = lambda: self._own(pl_module)
            pl_module.integrity_guard = lambda values: self._guard(pl_module, values)
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
        if float(self.cfg.outlier_ratio) > 0 and pl_module.model is not None:
            self._inputs.attach(pl_module.model)
        self._inputs.reset()
        step = int(batch["step"])
        if step < self._refetch_until:  # fetched ahead of a skip: the stream has changed since
            batch.update(pl_module.batch_of_step(step, pl_module.runtime.device))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        rec = pl_module.last_step
        self._follow_model(pl_module)
        if pl_module.rank_own:  # the per-step check's margin, in metrics.jsonl: how near a clean step came
            rec["outlier_ratio"] = round(largest_ratio(pl_module.rank_own, self._stages(pl_module)), 3)
        if rec.get("skipped"):
            self._suspect_step(trainer, pl_module, batch, step)
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
    def _follow_model(self, pl_module: LightningModule) -> None:
        """A live re-layout (a recovery or a rejoin) gave this process a new model: the verified copy no
        longer fits, and the spike detector's window starts again, so that every rank decides from the
        same steps (a process that joined has seen none of the earlier ones: a decision from a window
        only some ranks hold would run a rollback's collectives on those ranks alone)."""
        if id(pl_module.model) == self._model:
            return
        if self._model is not None:
            self.verified = None
            self.divergent.clear()  # counted by the old layout's rank numbers
            for window in self.history.values():
                window.clear()
        self._model = id(pl_module.model)

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

    def _train(self, trainer: Trainer, pl_module: LightningModule, batch: dict, guard: bool = True) -> Any:
        """One optimizer step of `batch` (the module's path, its raw optimizer: Lightning's step count is
        not touched), under the per-step check when it is on (a suspect step applies no update; its
        `StepResult.own` names the ranks)."""
        from ntp_nemo.runtime.step import train_step

        state = trainer.strategy.state
        self._inputs.reset()
        with self._context(trainer):
            return train_step(state, batch["micro"], int(batch["global_tokens"]),
                              max_norm=pl_module.optim_cfg["grad_clip"], optimizer=state.optimizer,
                              scheduler=pl_module.lr_schedulers(), backward=pl_module.manual_backward,
                              own=pl_module.integrity_own, guard=pl_module.integrity_guard if guard else None)

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

    # ---- the per-step check: each rank's own gradients and activations against its stage's others ----
    def _own(self, pl_module: LightningModule) -> torch.Tensor:
        return own_row(pl_module.model, self._inputs.value, pl_module.runtime.device)

    def _stages(self, pl_module: LightningModule) -> list[int]:
        topo = pl_module.runtime.topology
        return [topo.coord(r).stage for r in range(topo.world_size)]

    def _suspects_of(self, pl_module: LightningModule, own: Sequence[float] | None) -> list[Suspect]:
        return find_suspects(own or (), self._stages(pl_module), float(self.cfg.outlier_ratio))

    def _guard(self, pl_module: LightningModule, values: dict) -> bool:
        """`train_step`'s guard: a step where some rank stands out applies no update (every rank alike)."""
        return bool(self._suspects_of(pl_module, values.get("own")))

    def _slot_name(self, pl_module: LightningModule, slot: int) -> str:
        if slot == SLOTS:
            return "activations"
        names = [n for n, _ in pl_module.model.named_parameters()]
        return "/".join(names[slot::SLOTS]) or f"parameter slot {slot}"

    def _where(self, pl_module: LightningModule, suspects: list[Suspect]) -> dict[str, Any]:
        """The finding's rank, replica and parameter when the suspects name one rank, else nothing."""
        # A corrupted activation corrupts the gradients computed from it (on its TP peers too, through
        # the TP collectives): the rank whose activation stands out names the cause.
        slots = [s for s in suspects if s.slot == SLOTS] or suspects
        ranks = sorted({s.rank for s in slots})
        if len(ranks) != 1:
            return {}
        worst = max(slots, key=lambda s: (s.value != s.value, s.value / max(s.others, 1e-30)
                                          if s.others == s.others else float("inf")))
        return {"rank": ranks[0], "replica": pl_module.runtime.topology.coord(ranks[0]).replica,
                "parameter": self._slot_name(pl_module, worst.slot)}

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

    def _suspect_step(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int) -> None:
        """The step applied no update: some rank's gradient or loss was not finite, or the per-step check
        found a rank standing out.  Attributed (`_attribute`) as one action under the live path's guard
        (`_act`); a peer lost during it leaves every survivor with the state before the step: the step is
        redone on the new layout (and attributed again if it is suspect again), nothing is classified."""
        t0 = time.perf_counter()
        first = self._suspects_of(pl_module, pl_module.rank_own)
        nonfinite = not first or any(s.value != s.value or s.value == float("inf") for s in first)
        kind = "nonfinite" if nonfinite else "outlier"
        detail = "; ".join(self._describe(pl_module, x) for x in first[:4]) or None
        if self._act(trainer, pl_module, lambda: self._attribute(trainer, pl_module, batch, step)):
            return
        batch.update(pl_module.batch_of_step(int(batch["step"]), pl_module.runtime.device))
        if self._before is not None:
            _set_rng_state(self._before[1])
            self._restore_schedule(trainer, pl_module, self._before[0])
        recovery = trainer.strategy.recovery
        result = recovery.run_step(trainer.strategy, lambda b: self._train(trainer, pl_module, b), batch)
        pl_module.rank_own = result.own
        self._record_step(pl_module, result, "redone")
        self._finding(trainer, t0, step=step, kind=kind, verdict="interrupted", detail=detail,
                      action="no update applied; a peer was lost during the attribution: every survivor kept "
                             f"the state before the step, and the step was redone on layout "
                             f"{trainer.strategy.layout.describe()}: "
                             + ("suspect again, attributed anew" if result.skipped else "clean, kept"))
        if result.skipped:
            self._suspect_step(trainer, pl_module, batch, step)

    def _attribute(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int) -> None:
        """Non-finite samples are looked for first (data); else the step is replayed from the state before
        it on the same ranks: clean -> transient (the replay is the step), the same rank again -> the
        cross replay tells its device (excluded, the step redone without it) from the data (kept)."""
        t0 = time.perf_counter()
        rt = pl_module.runtime
        first = self._suspects_of(pl_module, pl_module.rank_own)
        nonfinite = not first or any(s.value != s.value or s.value == float("inf") for s in first)
        kind = "nonfinite" if nonfinite else "outlier"
        rng = _rng_state()
        if nonfinite:
            sampler, mbs = pl_module.data.sampler, pl_module.micro_batch_size
            micro = sampler.microbatch_ids(int(batch["step"]), mbs)
            mine = [int(i) for j in rt.my_microbatches(len(micro)) for i in micro[j]]
            last = rt.coord.stage == rt.topology.pp - 1
            replica, dp = rt.coord.replica, rt.topology.dp
            flags = self._eval_nonfinite(trainer, pl_module, mine)
            seen = self._gather(pl_module, (replica, last, mine, flags))
            suspects = sorted({i for rep, lst, ids, fl in seen if lst
                               for i, f in zip(ids, fl, strict=True) if f})
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
                                          verdict="device", action="reported: the sample's loss is finite on "
                                          "the other replicas, not on this one (no single rank named)")
                    return
                # Not finite on one replica only: not the data's.  The replay below decides (transient, or
                # the device a cross replay names, excluded and the step redone without it).
        _set_rng_state(self._before[1] if self._before else rng)
        self._restore_schedule(trainer, pl_module, self._before[0])
        result = self._train(trainer, pl_module, batch)
        where = self._where(pl_module, first)
        detail = "; ".join(self._describe(pl_module, x) for x in first[:4]) or None
        if not result.skipped:
            self._record_step(pl_module, result, "transient")
            self._finding(trainer, t0, step=step, kind=kind, **where, verdict="transient", detail=detail,
                          action="no update applied; the step replayed from the state before it on the same "
                                 "ranks: clean, kept")
            return
        again = self._suspects_of(pl_module, result.own)
        self._repeated(trainer, pl_module, batch, step, result, first, again, t0, kind,
                       "no update applied; the replay on the same ranks was suspect again")

    def _repeated(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int, result: Any,
                  first: list[Suspect], again: list[Suspect], t0: float, kind: str, why: str) -> None:
        """The replay of step `step` (its update not applied) was suspect again.  The suspect replica's
        micro-batches are computed by another replica too (`_cross_replay`): what it reproduces within the
        dtype's rounding is the data's (a sample unlike the others), and the step is applied as computed,
        `reproducible`; what it does not is the rank's device (`_exclude`).  With one replica, nothing to
        compare with: outliers finite and below `DEVICE_RATIO` are kept as the data's."""
        cross = self._cross_replay(trainer, pl_module, batch, result, again) if again else None
        if cross is not None:
            verdict, q_of, tol = cross
            device = bool(verdict.unreproduced)
            confirmed = [s for s in again if (s.rank, s.slot) in set(verdict.unreproduced)]
            said = (f"replica(s) {q_of} computed the same micro-batches: the suspect value(s) "
                    f"{'not ' if device else ''}reproduced (relative difference {verdict.suspect_diff:.3g}, "
                    f"tolerance {tol:.2g}; the replica's other slots within {verdict.honest_diff:.2g})")
            evidence = {"cross": {"suspect_diff": verdict.suspect_diff, "honest_diff": verdict.honest_diff,
                                  "tolerance": tol}}
        else:
            device = not again or device_evidence(again)
            confirmed = again
            said = f"by {'more' if device else 'less'} than {DEVICE_RATIO:.0e}x the other ranks (one " \
                   "replica: no other to compute the same micro-batches)"
            evidence = {}
        if not device:
            if self._before is not None:
                _set_rng_state(self._before[1])
                self._restore_schedule(trainer, pl_module, self._before[0])
            redo = self._train(trainer, pl_module, batch, guard=False)
            self._record_step(pl_module, redo, "reproducible")
            self._finding(trainer, t0, step=step, kind=kind, **self._where(pl_module, again),
                          verdict="reproducible",
                          detail="; ".join(self._describe(pl_module, x) for x in again[:4]), **evidence,
                          action=f"{why}; {said}: the data's, the step applied as computed")
            return
        self._record_step(pl_module, result, "device")
        self._exclude(trainer, pl_module, batch, step, first, confirmed, t0, kind, f"{why}; {said}", evidence)

    def _compute_dtype(self, trainer: Trainer, pl_module: LightningModule) -> torch.dtype:
        precision = str(getattr(trainer, "precision", ""))
        if "bf16" in precision:
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return next((p.dtype for p in pl_module.model.parameters()), torch.float32)

    def _cross_replay(self, trainer: Trainer, pl_module: LightningModule, batch: dict, result: Any,
                      again: list[Suspect]) -> tuple[CrossVerdict, str, float] | None:
        """Collective over the world: each replica computes the gradients of the next replica's
        micro-batches of this step (forward and backward from the state before the step, no DP sync, no
        update; `cross_replay.cross_source`) and every rank's row of the per-step check is gathered and
        compared with the replay's (`cross_replay.cross_verdict`).  None with one replica, or when the
        gradient sync overlaps the backward (its hooks would start the sync on one replica alone)."""
        rt, state = pl_module.runtime, trainer.strategy.state
        topo = rt.topology
        if topo.dp < 2 or not dist.is_initialized() or result.own is None \
                or getattr(state.grad_path, "overlap", None) is not None:
            return None
        mbs = pl_module.micro_batch_size
        micro = pl_module.data.sampler.microbatch_ids(int(batch["step"]), mbs)
        counts = rt.microbatch_counts(len(micro))
        src = cross_source(rt.coord.replica, topo.dp)
        start = sum(counts[:src])
        ids = [int(i) for j in range(start, start + counts[src]) for i in micro[j]]
        tokens = pl_module.data.train.batch(ids).view(counts[src], mbs, -1) if ids else []
        rng = _rng_state()
        self._inputs.reset()
        state.grad_path.begin_step(len(tokens))
        with self._context(trainer):
            rt.train_microbatches(state.model, list(tokens), int(batch["global_tokens"]),
                                  pl_module.manual_backward)
        row = self._own(pl_module).cpu().tolist()
        state.grad_path.zero_grad()
        _set_rng_state(rng)
        crossed = [x for r in self._gather(pl_module, row) for x in r]
        stages = self._stages(pl_module)
        replicas = [topo.coord(r).replica for r in range(topo.world_size)]
        tol = tolerance(self._compute_dtype(trainer, pl_module))
        verdict = cross_verdict([(s.rank, s.slot) for s in again], result.own, crossed, stages, replicas,
                                topo.dp, tol)
        q_of = ", ".join(sorted({str((replicas[s.rank] - 1) % topo.dp) for s in again}))
        return verdict, q_of, tol

    def _describe(self, pl_module: LightningModule, s: Suspect) -> str:
        what = "largest activation" if s.slot == SLOTS \
            else f"largest gradient of {self._slot_name(pl_module, s.slot)}"
        if s.others != s.others:
            return f"rank {s.rank}: {what} is {s.value}"
        return f"rank {s.rank}: {what} {s.value:.3g}, the other ranks' at most {s.others:.3g}"

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
        result = self._train(trainer, pl_module, fresh)
        self._record_step(pl_module, result, "data")
        for i in data:
            self._finding(trainer, t0, step=step, kind="nonfinite", sample=i, verdict="data",
                          action=f"sample skipped (recorded), step redone without it; not finite on "
                                 f"replica(s) {', '.join(map(str, sorted(bad_on[i])))}")

    def _exclude(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int,
                 first: list[Suspect], again: list[Suspect], t0: float, kind: str, why: str,
                 evidence: dict | None = None) -> None:
        """The replay of step `step` repeated what the step showed: the one rank named by both (or by the
        replay alone) is a bad device.  Its update was not applied; the rank leaves now and, under live
        recovery, the survivors redo the step from the state before it on the new layout (the curve stays
        the failure-free one); else the restart path takes over at the next collective."""
        named = sorted({s.rank for s in again} & {s.rank for s in first}) or sorted({s.rank for s in again})
        if len(named) != 1:
            self._finding(trainer, t0, step=step, kind=kind, verdict="unknown",
                          detail="; ".join(self._describe(pl_module, x) for x in again[:4]) or None,
                          action=f"{why}; no single rank stands out "
                                 f"({'ranks ' + ', '.join(map(str, named)) if named else 'none'}): reported")
            return
        (rank,) = named
        recovery = getattr(trainer.strategy, "recovery", None)
        live = recovery is not None and getattr(recovery, "store", None) is not None
        where = self._where(pl_module, [s for s in again if s.rank == rank])
        self._finding(trainer, t0, step=step, kind=kind, **where, verdict="device",
                      detail="; ".join(self._describe(pl_module, x) for x in again[:4]), **(evidence or {}),
                      action=f"{why}; rank {rank} is excluded: it leaves now and "
                             + ("the survivors redo the step on the live path's new layout" if live
                                else "the run goes on without it by the restart path"))
        if rank == trainer.global_rank:
            sys.stdout.flush()
            os._exit(KILL_EXIT_CODE)  # as a lost GPU: the live path re-plans without this rank
        if not live:
            return
        if self._before is not None:  # the step again, from the state before it (its update was not applied)
            _set_rng_state(self._before[1])
            self._restore_schedule(trainer, pl_module, self._before[0])
        result = recovery.run_step(trainer.strategy, lambda b: self._train(trainer, pl_module, b), batch)
        self._record_step(pl_module, result, "device")
        self._say(trainer, f"integrity: step {step} redone without rank {rank} on the new layout: "
                           f"loss {result.loss:.6g}")

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
        if not self._act(trainer, pl_module,
                         lambda: self._spike_replay(trainer, pl_module, batch, step, why, t0)):
            self._finding(trainer, t0, step=step, kind="spike", verdict="interrupted", detail=why,
                          action="a peer was lost during the rollback and replay: every survivor kept the "
                                 "state after the step (applied as computed) and goes on on layout "
                                 f"{trainer.strategy.layout.describe()}")

    def _spike_replay(self, trainer: Trainer, pl_module: LightningModule, batch: dict, step: int, why: str,
                      t0: float) -> None:
        first = self.verified.step
        before = dict(pl_module.last_step)
        result = self._rollback_and_replay(trainer, pl_module, step)
        again = self._spike({"loss": result.loss, "grad_norm": result.grad_norm})
        suspects = self._suspects_of(pl_module, result.own)
        self._record_step(pl_module, result, "spike")
        if result.skipped and suspects:  # the replay's last step stood out on a rank: applied no update
            self._repeated(trainer, pl_module, batch, step, result, suspects, suspects, t0, "spike",
                           f"rolled back to verified step {first} and replayed: step {step} stood out again")
            return
        if not again:
            self._finding(trainer, t0, step=step, kind="spike", verdict="transient", detail=why,
                          action=f"rolled back to verified step {first}, replayed {step - first} step(s): "
                                 f"loss {before['loss']:.6g} -> {result.loss:.6g}")
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
        bad = sorted({m.rank for m in mismatches if m.majority})  # against a majority: the others are good
        first = self.verified.step if self.verified is not None else None
        if first is not None or bad:
            done: dict[str, Any] = {}

            def repair() -> None:
                result, moved = self._rollback_and_replay(trainer, pl_module, step, repair=bad) \
                    if first is not None else (None, self._repair_from_peers(trainer, pl_module, bad))
                _, again = self._fingerprints(trainer, pl_module)
                done.update(result=result, moved=moved, again=again)

            named_here = trainer.global_rank in bad  # this process's memory disagreed with a majority
            if not self._act(trainer, pl_module, repair):
                self._repair_after_loss(trainer, pl_module, step, mismatches, named_here, t0)
                return
            result, moved, again = done["result"], done["moved"], done["again"]
            if result is not None:  # the step's record: its replay (what the state now holds)
                self._record_step(pl_module, result, "replayed")
            fixed = not compare(plan, again)
            if fixed and first is not None:
                self._keep(trainer, pl_module, step, replica_fingerprints(plan, again))
            took = (f"rank(s) {', '.join(map(str, bad))} took their parameters and optimizer state from the "
                    f"good replicas' memory ({moved} bytes moved)") if bad else ""
            if first is not None:
                action = (f"every rank rolled back to verified step {first}"
                          f"{' (' + took + ')' if took else ''} and replayed {step - first} step(s); ")
            else:
                action = f"{took} (no verified state to roll back to: the update since stays); "
            action += f"replicas {'agree again' if fixed else 'STILL DISAGREE'}"
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

    def _repair_after_loss(self, trainer: Trainer, pl_module: LightningModule, step: int, mismatches: list,
                           named_here: bool, t0: float) -> None:
        """A peer was lost during a divergence's rollback and repair: every survivor holds the state after
        the step again (the divergence in it), on the new layout, where no verified copy fits.  The
        processes the fingerprint named against a majority (each knows it was) take their parameters and
        optimizer state from the others' memory on the new layout; the updates since the last check are
        not replayed.  Then the replicas are compared again."""
        flags = _between_steps(trainer, lambda: self._gather(pl_module, bool(named_here)))
        named = [r for r, f in enumerate(flags or []) if f]
        moved: dict[str, int] = {}

        def repair() -> None:
            moved["n"] = self._repair_from_peers(trainer, pl_module, named)

        if named and not self._act(trainer, pl_module, repair):
            named = []  # lost again: the next comparison finds what is left
        took = (f"rank(s) {', '.join(map(str, named))} (the process(es) named) took their parameters and "
                f"optimizer state from the others' memory there ({moved.get('n', 0)} bytes moved)") if named \
            else "the process(es) named were not repaired (lost, or the repair was interrupted)"
        self._finding(trainer, t0, step=step, kind="divergence", verdict="interrupted",
                      detail="; ".join(m.describe() for m in mismatches[:4]),
                      action="a peer was lost during the rollback and repair: every survivor kept the state "
                             f"after the step, on layout {trainer.strategy.layout.describe()}; {took}; the "
                             "updates since the last check are not replayed; the replicas are compared again")
        self._check(trainer, pl_module, step)

    def _act(self, trainer: Trainer, pl_module: LightningModule, fn: Any) -> bool:
        """Run `fn()`, an integrity action after the step (replays, sample evaluation, cross replay,
        rollback, repair: collectives over the world), under the live path's guard
        (`NTPStrategy.between_steps`).  Each rank keeps its state at the action's start (what every
        survivor holds, wherever in the action, or before it, a peer was lost) and restores it when the
        action fails, so that the live recovery reshards that state and never a half-applied one.
        Returns whether the action ran to its end (False: a peer was lost and the survivors recovered;
        the caller redoes what it must on the new layout).  Without live recovery `fn` runs as it is."""
        for cb in trainer.callbacks:
            if isinstance(cb, FaultInjector):
                cb.integrity_action(trainer)  # a `kill_rank` fault of phase `integrity`
        recovery = getattr(trainer.strategy, "recovery", None)
        if getattr(recovery, "store", None) is None:
            fn()
            return True
        saved = self._snapshot(trainer, pl_module)

        def guarded() -> bool:
            try:
                fn()
            except BaseException:
                self._restore(trainer, pl_module, saved)
                raise
            return True

        if _between_steps(trainer, guarded) is not None:
            return True
        self._follow_model(pl_module)
        return False

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule) -> tuple[Verified, frozenset]:
        """This rank's state now (parameters and optimizer state in host memory, LR schedule, RNG) and the
        samples skipped so far."""
        state = trainer.strategy.state
        with torch.no_grad():
            params = [p.detach().to("cpu", copy=True) for p in state.model.parameters()]
        return (Verified(int(trainer.global_step), id(pl_module.model), params,
                         _host_copy(state.optimizer.state_dict()),
                         copy.deepcopy(pl_module.lr_schedulers().state_dict()), _rng_state(), 0),
                pl_module.data.sampler.skipped)

    def _restore(self, trainer: Trainer, pl_module: LightningModule, saved: tuple[Verified, frozenset]
                 ) -> None:
        """Back to `_snapshot`'s state (no collective); nothing when the model was replaced since."""
        v, skipped = saved
        if v.model_id != id(pl_module.model):
            return
        self._load(trainer, pl_module, v)
        sampler = pl_module.data.sampler
        if sampler.skipped != skipped:
            sampler.skipped = skipped
            sampler._perms.clear()

    def _load(self, trainer: Trainer, pl_module: LightningModule, v: Verified) -> None:
        state = trainer.strategy.state
        with torch.no_grad():
            for p, saved in zip(state.model.parameters(), v.params, strict=True):
                p.copy_(saved)
        state.optimizer.load_state_dict(copy.deepcopy(v.optimizer))
        self._restore_schedule(trainer, pl_module, v.scheduler)
        _set_rng_state(v.rng)

    def _keep(self, trainer: Trainer, pl_module: LightningModule, step: int, fingerprints: dict) -> None:
        state = trainer.strategy.state
        with torch.no_grad():  # in host memory: the device keeps its memory for training
            params = [p.detach().to("cpu", copy=True) for p in state.model.parameters()]
        optimizer = _host_copy(state.optimizer.state_dict())
        self.verified = Verified(step, id(pl_module.model), params, optimizer,
                                 copy.deepcopy(pl_module.lr_schedulers().state_dict()), _rng_state(),
                                 next(iter(fingerprints.values()), 0))

    def _repair_from_peers(self, trainer: Trainer, pl_module: LightningModule, bad: list[int]) -> int:
        """Collective over the world: the ranks `bad` take every parameter and optimizer state tensor they
        hold from the other ranks' memory (the live path's reshard, `resilience.live`: a TP peer of their
        own replica first, else a good replica; their own memory is not a source).  Returns the bytes
        moved."""
        from ntp_nemo.checkpoint.state import install_optimizer_state, load_targets, sharded_state
        from ntp_nemo.resilience.live import reshard_state, stored_shapes

        state, rt = trainer.strategy.state, pl_module.runtime
        mine = trainer.global_rank in bad
        held = {} if mine else sharded_state(state.model, state.optimizer)
        stored = stored_shapes(rt.world_group, held)
        targets, problems = load_targets(state.model, state.optimizer, stored) if mine else ({}, [])
        result = reshard_state(held, targets, rt.coord.replica, group=rt.world_group, problems=problems)
        if mine:
            install_optimizer_state(state.model, state.optimizer, targets)
        return int(result.moved_bytes)

    def _rollback_and_replay(self, trainer: Trainer, pl_module: LightningModule, step: int,
                             repair: list[int] | None = None) -> Any:
        """Every rank back to the verified state, then steps `verified.step + 1 .. step` again.  `repair`:
        ranks whose memory disagreed with the majority: they take the verified state from the good ranks'
        memory (`_repair_from_peers`) instead of their own copy; then returns (result, bytes moved)."""
        v = self.verified
        assert v is not None
        self._load(trainer, pl_module, v)
        moved = self._repair_from_peers(trainer, pl_module, repair) if repair else 0
        device = pl_module.runtime.device
        result = None
        for index in range(v.step, step):  # 0-based step indices of steps v+1 .. step
            result = self._train(trainer, pl_module, pl_module.batch_of_step(index, device))
        return (result, moved) if repair is not None else result


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


__all__ = ["DEVICE_RATIO", "SLOTS", "IntegrityWatch", "LayerInputs", "Suspect", "Verified", "device_evidence",
           "find_suspects", "largest_ratio", "own_row"]
