"""Injected silent corruption: the `bitflip` and `poison_sample` fault kinds, made to happen inside the
workers (a Lightning callback next to `faults.FaultInjector`, whose once-per-run markers it shares).

- `bitflip`, `target=param`: global rank `rank` flips bit `bit` of one of its parameter elements when
  step `step` starts.  Nothing fails: only the replica fingerprint (`resilience.integrity`) sees it.
- `target=grad`: the bit is flipped in that element's gradient as the backward of step `step` computes
  it (before the DP sync); `target=activation`: in one element of the output of the rank's first layer
  in the forward of step `step`.
- `persistent=true`: the same flip on every step from `step` on, replays included (a bad device: it stays
  with the process that held rank `rank` at step `step`, whatever rank a live re-layout gives it since,
  and leaves with it); else once per run.
- `poison_sample`: training sample `sample` (a data-set id; unset: one of the samples of step `step`,
  drawn from the seed) gives a non-finite loss on whatever rank sees it: its embeddings become NaN.

The element (parameter and index) is drawn from the fault's seeded `draw`, the same on every attempt.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from ntp_nemo.resilience.fault_config import Fault
from ntp_nemo.resilience.faults import FaultInjector

CORRUPTING = ("bitflip", "poison_sample")


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The flat elements of `t` as signed integers of the same width (a view: writes reach `t`)."""
    return t.detach().view(-1).view(_WORDS[t.element_size()])


def flip_bit_(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` (modulo the element's width) of flat element `index` of `t`, in place."""
    width = 8 * t.element_size()
    ints = _words(t)
    b = bit % width
    ints[index] ^= (1 << b) if b < width - 1 else -(1 << b)  # the sign bit as a signed constant


def bit_of(t: torch.Tensor, index: int, bit: int) -> int:
    """Bit `bit` (modulo the element's width) of flat element `index` of `t`."""
    width = 8 * t.element_size()
    ints = _words(t)
    return int((int(ints[index]) >> (bit % width)) & 1)


def flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of `t` with bit `bit` of flat element `index` flipped."""
    out = t.detach().clone()
    flip_bit_(out, index, bit)
    return out


def poisoned_sample(fault: Fault, data: Any) -> int:
    """The sample id a `poison_sample` fault poisons: `sample`, else one of step `step`'s samples in the
    stream of the run's seed with nothing skipped (the same id on every attempt and rerun)."""
    if fault.sample is not None:
        return int(fault.sample) % len(data.train)
    from ntp_nemo.data.sampler import GlobalBatchSampler

    s = data.sampler
    clean = GlobalBatchSampler(s.num_samples, s.global_batch_size, s.seed, tag_epochs=s.tag_epochs)
    ids = clean.batch_ids(fault.step - 1)
    return int(ids[fault.draw % len(ids)]) % s.num_samples


class CorruptionInjector(FaultInjector):
    """Fires the `bitflip` and `poison_sample` faults (given only those) in the worker holding the rank."""

    def __init__(self, faults: list[Fault], fault_dir: Any, ckpt_dir: Any) -> None:
        super().__init__([f for f in faults if f.kind in CORRUPTING], fault_dir, ckpt_dir)
        self._hooks: list[Any] = []  # (model id, handle) of the hooks on the current model
        self._hooked: int | None = None  # id of the model the hooks sit on
        self.fired: list[dict[str, Any]] = []  # what fired in this process: {step, kind, target, rank, ...}
        self._stuck: dict[int, int] = {}  # persistent param faults: fault index -> the stuck bit's value
        self._armed_on: dict[int, int] = {}  # persistent grad/activation faults: fault index -> model id
        # A persistent fault is a bad device: it stays with the process that held its rank when it started
        # (fault index -> whether this process is that one), whatever rank a re-layout gives it since.
        self._device: dict[int, bool] = {}

    # ---- hooks on the model (re-registered when a live recovery adopts a new one) ----------------
    def _hook_model(self, trainer: Trainer, module: LightningModule) -> None:
        model = module.model
        if model is None or id(model) == self._hooked:
            return
        for h in self._hooks:
            h.remove()
        self._hooks, self._hooked = [], id(model)
        for f in self.faults:
            if f.kind == "poison_sample" and getattr(model, "embed", None) is not None \
                    and getattr(model, "has_embedding", True):
                self._hooks.append(model.embed.register_forward_hook(self._poison_hook(f, module)))

    def _poison_hook(self, fault: Fault, module: LightningModule):
        sample = poisoned_sample(fault, module.data)
        tokens = module.data.train.batch([sample])[0]
        inputs: dict[torch.device, torch.Tensor] = {}

        def hook(mod: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
            ids = args[0]
            if ids.dim() != 2 or ids.shape[1] > tokens.numel() - 1:
                return output
            want = inputs.get(ids.device)
            if want is None:
                want = inputs[ids.device] = tokens[:-1].to(ids.device)
            hit = (ids == want[: ids.shape[1]]).all(dim=1)  # rows holding the poisoned sample, on the device
            return output.masked_fill(hit.view(-1, *([1] * (output.dim() - 1))), float("nan"))

        return hook

    # ---- firing -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._hook_model(trainer, pl_module)
        step = trainer.global_step + 1
        for f in [f for f in self.faults if f.kind == "bitflip"]:
            if f.persistent:
                if step < f.step or not self._device.setdefault(f.index, f.rank == trainer.global_rank):
                    continue
                if f.target != "param" and self._armed_on.get(f.index) == id(pl_module.model):
                    continue  # a persistent grad/activation hook, once armed on this model, stays
            elif f.rank != trainer.global_rank or step != f.step or not self._claim(f, step):
                continue
            params = [(n, p) for n, p in pl_module.model.named_parameters() if p.numel() > 0]
            name, p = params[f.draw % len(params)]
            index = (f.draw // len(params)) % p.numel()
            if f.target == "param":
                self._flip_param(f, p, index)
            elif f.target == "grad":
                self._arm_grad(f, p, index)
            else:
                name = self._arm_activation(f, pl_module.model, index)
            if f.persistent and f.target != "param":
                self._armed_on[f.index] = id(pl_module.model)
            if f.persistent and f.index in {x["fault"] for x in self.fired}:
                continue  # a bad device: said once, when it starts
            self.fired.append({"fault": f.index, "step": step, "kind": "bitflip", "target": f.target,
                               "rank": f.rank, "parameter": name, "index": index, "bit": f.bit,
                               "persistent": f.persistent})
            where = name if f.target == "activation" else f"{f.target} {name}[{index}]"
            print(f"fault: bitflip of bit {f.bit} in {where} on rank {f.rank} at step "
                  f"{step}{' (persistent)' if f.persistent else ''}", flush=True)

    def _flip_param(self, fault: Fault, p: torch.Tensor, index: int) -> None:
        """Flip the bit; a persistent fault keeps it stuck at the flipped value (set again each step)."""
        if not fault.persistent:
            flip_bit_(p.data, index, fault.bit)
            return
        value = int(bit_of(p.data, index, fault.bit))
        stuck = self._stuck.setdefault(fault.index, value ^ 1)
        if value != stuck:
            flip_bit_(p.data, index, fault.bit)

    def _arm_grad(self, fault: Fault, p: torch.Tensor, index: int) -> None:
        handles: list[Any] = []

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not fault.persistent:
                for h in handles:
                    h.remove()
            return flipped(grad, index, fault.bit)

        handles.append(p.register_hook(hook))

    def _arm_activation(self, fault: Fault, model: torch.nn.Module, index: int) -> str:
        """Arm the flip in the output of the rank's first layer; returns what it strikes, in words."""
        blocks = getattr(model, "blocks", None)
        key = next(iter(blocks.keys())) if blocks is not None and len(blocks) else None
        if key is None:
            return "nothing (no layer on this rank)"
        first = blocks[key]
        handles: list[Any] = []

        def hook(mod: Any, args: tuple, output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or output.numel() == 0:
                return output
            if not fault.persistent:
                for h in handles:
                    h.remove()
            # The flipped value enters as a constant difference: the backward still flows through the layer.
            return output + (flipped(output, index % output.numel(), fault.bit) - output.detach())

        handles.append(first.register_forward_hook(hook))
        return f"the output of blocks.{key}"


__all__ = ["CORRUPTING", "CorruptionInjector", "bit_of", "flip_bit_", "flipped", "poisoned_sample"]
