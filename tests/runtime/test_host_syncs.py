"""The training step reads the device back once (the fused step scalars), also
after a resume; a step counter placed on the device, as checkpoint loads used to place it, shows up as
one read per parameter.

The counting harness was `bench/host_syncs.py` (it left `bench/` after commit 2e79666; docs/performance.md,
host_syncs): every device tensor lives on the `meta` device (torch's fake process group takes the
collectives, as in the dry run), a dispatch mode counts each read of a meta tensor back to the host and
each host value copied onto the device, and `NTPLanguageModule.training_step` itself runs on the rank's
slice with Lightning's trainer replaced by the few objects the step asks for."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.models.model_config import ModelConfig
from tests.shapes import adamw

MODEL = ModelConfig(arch="llama", name="host_syncs", vocab_size=96, hidden_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=96, max_seq_len=32, tie_embeddings=False)
SEQ, MICRO, GLOBAL_BATCH = 16, 2, 12
OPTIM = adamw(warmup_steps=2, min_lr_ratio=0.1, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    replica_tp: tuple[int, ...] = (2, 1)
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    resume: bool = False
    distributed: bool = False
    overlap: bool = False
    autocast: bool = False


CONFIGS = {c.name: c for c in (
    Config("default"),
    Config("pp2_1f1b", replica_tp=(1, 1), pp=2),
    Config("interleaved", replica_tp=(1, 1), pp=2, schedule="interleaved_1f1b", virtual=2),
    Config("resume", resume=True),
    Config("distributed_optimizer", distributed=True),
    Config("overlap_grad_sync", overlap=True),
    Config("bf16_mixed", autocast=True),
)}


class HostReads(TorchDispatchMode):
    """Counts reads of device (meta) tensors to the host and host values copied to the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter = Counter()
        self.uploads = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            self.reads["item"] += 1
            return False if args[0].dtype == torch.bool else 1  # 1: a step counter, a count
        if func is torch.ops.aten._to_copy.default:
            src, dst = args[0].device.type, (kwargs.get("device") or args[0].device).type
            if src == "meta" and dst == "cpu":
                self.reads["copy_to_host"] += 1
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if src == "cpu" and dst == "meta":
                self.uploads += 1
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0].device.type, args[1].device.type
            if dst == "cpu" and src == "meta":
                self.reads["copy_to_host"] += 1
                return args[0].zero_()
            if dst == "meta" and src == "cpu":
                self.uploads += 1
        if func is torch.ops.aten.lift_fresh.default and args[0].device.type == "meta":
            self.uploads += 1
        return func(*args, **kwargs)


class HostReadMethods(TorchFunctionMode):
    """What no aten op shows: `.tolist()` / `.numpy()` of a meta tensor (a read), and `torch.tensor(x,
    device=...)` / `torch.as_tensor` of host data onto the meta device (an upload)."""

    def __init__(self, counts: HostReads) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and args and args[0].device.type == "meta":
            self.counts.reads[func.__name__] += 1
            return torch.zeros(args[0].shape, dtype=args[0].dtype).tolist()
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == "meta" and not isinstance(args[0], torch.Tensor):
                self.counts.uploads += 1
        return func(*args, **kwargs)


class _Optimizer:
    """What `self.optimizers()` returns in the step: Lightning's wrapper calls (manual optimisation)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def _on_before_step(self) -> None:
        pass

    def _on_after_step(self) -> None:
        pass


def _descriptors(layout, cfg: ModelConfig) -> list[dict]:
    from ntp_nemo.parallel.grad_sync import param_descriptors
    from ntp_nemo.runtime.runtime import RankPlace

    out = []
    for rank in range(layout.world_size):
        rt = RankPlace(layout, rank, device="meta")
        out.append(param_descriptors(rt.build_model(cfg, seed=0)))
    return out


def _resume(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Install optimizer state as a checkpoint load does, from what a save writes."""
    from ntp_nemo.checkpoint.state import install_optimizer_state, load_targets, sharded_state

    stored = {k: (tuple(s.spec.global_shape), s.tensor.dtype) for k, s in sharded_state(model, opt).items()}
    opt.state.clear()  # a fresh process: the state comes from the checkpoint
    targets, problems = load_targets(model, opt, stored)
    assert not problems, problems
    install_optimizer_state(model, opt, targets)


def run_rank(cfg: Config, rank: int, steps: int) -> dict:
    """Steps of one rank; the reads and uploads of the last one."""
    from lightning.pytorch.core.module import LightningModule

    from ntp_nemo.lightning.lm_module import NTPLanguageModule
    from ntp_nemo.parallel.grad_sync import build_sync_plan
    from ntp_nemo.runtime.assemble import assemble
    from ntp_nemo.runtime.dry_run import fake_world, flash_attention_on_meta
    from ntp_nemo.schedules import warmup_cosine
    from ntp_nemo.topology import ResolvedLayout, Topology

    tp = max(cfg.replica_tp)
    topo = Topology(tp, list(cfg.replica_tp), [tp] * (MODEL.num_layers + 2), pp=cfg.pp)
    layout = ResolvedLayout.make(topo, cfg.schedule, virtual_stages=cfg.virtual)

    with fake_world(rank, layout.world_size), flash_attention_on_meta():
        descriptors = _descriptors(layout, MODEL)  # every rank's, as attach would gather them
        plan = build_sync_plan(rank, descriptors, [c.replica for c in topo.coords])
        state = assemble(layout, rank, MODEL, dict(OPTIM, distributed=cfg.distributed), "meta", seed=0,
                         overlap_grad_sync=cfg.overlap, sync_plan=plan)
        rt, model, opt = state.runtime, state.model, state.optimizer
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, 10, 0.1))
        module = NTPLanguageModule(MODEL, dict(OPTIM, distributed=cfg.distributed),
                                   types.SimpleNamespace(sampler=types.SimpleNamespace(
                                       global_batch_size=GLOBAL_BATCH)),
                                   seed=0, micro_batch_size=MICRO, val_batches=1, max_steps=10,
                                   overlap_grad_sync=cfg.overlap)
        module.model = model
        module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(runtime=rt, state=state),
                                                callbacks=[])
        module._device = torch.device("meta")
        wrapped = _Optimizer(opt)
        module.optimizers = lambda: wrapped
        module.lr_schedulers = lambda: sched
        module.manual_backward = lambda t, *a, **k: t.backward(*a, **k)  # Lightning's, minus its hooks
        to_tensor = LightningModule._LightningModule__to_tensor  # Lightning's conversion of a logged value
        module.log = lambda name, value, **kw: to_tensor(module, value, name)
        n_micro = len(rt.my_microbatches(GLOBAL_BATCH // MICRO))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.autocast else contextlib.nullcontext()
        result = {}
        for step in range(steps):
            if cfg.resume and step == steps - 1:
                _resume(model, opt)
            batch = {"micro": torch.zeros(n_micro, MICRO, SEQ + 1, dtype=torch.long, device="meta"),
                     "global_tokens": GLOBAL_BATCH * SEQ, "step": step}
            mode = HostReads()
            with mode, HostReadMethods(mode), autocast:
                module.training_step(batch, step)
            result = {"reads": sum(mode.reads.values()), "kinds": dict(mode.reads), "uploads": mode.uploads}
    return result


@pytest.mark.parametrize("name", ["default", "resume"])
def test_one_host_read_per_step(name):
    res = run_rank(CONFIGS[name], rank=0, steps=2)
    assert res["reads"] == 1 and res["kinds"] == {"tolist": 1}, res  # read_step_scalars
    assert res["uploads"] == 0, res


def test_a_step_counter_on_the_device_is_counted(monkeypatch):
    from ntp_nemo.checkpoint import state

    monkeypatch.setattr(state, "state_device", lambda optimizer, p, shape: p.device)  # the old placement
    res = run_rank(CONFIGS["resume"], rank=0, steps=2)
    params = sum(1 for _ in torch.nn.Module.parameters(_model()))
    assert res["kinds"].get("item", 0) >= params > 10, res


def _model() -> torch.nn.Module:
    from ntp_nemo.models import build_model

    return build_model(MODEL, seed=0)  # unsharded: as many parameters as each rank's slice


def test_a_host_float_logged_is_an_upload():
    from lightning.pytorch.core.module import LightningModule

    module = LightningModule()
    module._device = torch.device("meta")
    to_tensor = LightningModule._LightningModule__to_tensor
    mode = HostReads()
    with mode, HostReadMethods(mode):
        to_tensor(module, 2.5, "x")  # what self.log(float) does: a device tensor from a host float
    assert mode.uploads == 1
    with mode, HostReadMethods(mode):
        to_tensor(module, torch.tensor(2.5), "x")  # a CPU tensor stays on the host
    assert mode.uploads == 1
