"""`runtime.step.train_step`: the one optimizer step of the Lightning module, the dry run and the tests'
exactness cases.

A rank assembled on an uneven layout and trained through `train_step` follows, in float64, a plain
single-process run (the unsharded model, `loss.backward()`, `torch.nn.utils.clip_grad_norm_`,
`torch.optim.AdamW`); a step whose gradient is not finite is skipped; and the Lightning module's step,
the dry run's and `tests/option_cases.run_steps` each go through `train_step`.
"""

from __future__ import annotations

import types

import pytest
import torch

import ntp_nemo.runtime.step as one_step
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT
from tests.shapes import adamw

SEED, SEQ, BATCH, STEPS, CLIP = 5, 8, 6, 3, 0.5
OPTIM = adamw(2e-2)


def _tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, GPT.vocab_size, (BATCH, SEQ + 1), generator=gen)


def _layout(tp: int, replica_tp: list[int]) -> ResolvedLayout:
    return ResolvedLayout.make(Topology(tp, replica_tp, [tp] * (GPT.num_layers + 2)), num_microbatches=BATCH)


def _plain_run() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The single-process reference: no runtime, no sync, no `train_step`."""
    model = build_model(GPT, seed=SEED).double()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        toks = _tokens(step)
        loss = model.loss_sum(toks) / toks[:, 1:].numel()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def uneven_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    state = assemble(_layout(2, [2, 1]), rank, GPT, OPTIM, "cpu", seed=SEED, param_dtype=torch.float64)
    losses, norms = [], []
    for step in range(STEPS):
        toks = _tokens(step)
        mine = state.my_microbatches(BATCH)
        micro = [toks[i : i + 1] for i in mine]
        result = one_step.train_step(state, micro, toks[:, 1:].numel(), max_norm=CLIP)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    ref_losses, ref_norms, ref_params = _plain_run()
    # A key bias's gradient is zero in theory (softmax ignores a shift shared by a query's scores): Adam
    # turns its reduction-order noise into full-size updates, so it is left out of the comparison.
    param_err = max(float((p.detach() - p.ntp_spec.narrow(ref_params[n])).abs().max()
                          / ref_params[n].abs().max()) for n, p in state.model.named_parameters()
                    if not n.endswith("k_proj.bias"))
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "norm": max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms, strict=True)),
            "param": param_err, "ref_norms": ref_norms, "microbatches": len(mine),
            "shapes": {n: tuple(p.shape) for n, p in state.model.named_parameters()}}


@pytest.mark.slow
def test_train_step_on_uneven_tp_replicas_follows_the_plain_single_process_run():
    """Replicas of TP 2 and TP 1 (5 heads split 2/3, 67 vocabulary rows 33/34; 4 and 2 micro-batches):
    loss, gradient norm (clipping active) and every parameter slice after 3 AdamW steps equal the plain
    run's to float64 reduction order."""
    results = run_workers(uneven_worker, 3)
    assert [r["microbatches"] for r in results] == [4, 4, 2]
    assert results[0]["shapes"] != results[1]["shapes"], "the TP 2 shards must be uneven"
    assert min(results[0]["ref_norms"]) > CLIP, "clipping must be active in every compared step"
    for rank, res in enumerate(results):
        assert res["loss"] < 1e-12 and res["norm"] < 1e-10 and res["param"] < 1e-10, (rank, res)


def _world_one(dtype: torch.dtype = torch.float64):
    return assemble(_layout(1, [1]), 0, GPT, OPTIM, "cpu", seed=SEED, param_dtype=dtype)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_non_finite_gradient_skips_the_update_and_still_steps_the_schedule():
    state = _world_one()
    before = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0 / (1 + step))
    skipped = []
    toks = _tokens(0)
    result = one_step.train_step(state, [toks], toks[:, 1:].numel(), max_norm=CLIP, scheduler=sched,
                                 backward=lambda loss: (loss * float("nan")).backward(),
                                 on_skip=skipped.append)
    assert result.skipped and skipped == [state.optimizer] and 3.0 < result.loss < 6.0
    assert all(torch.equal(p, before[n]) for n, p in state.model.named_parameters())
    assert not state.optimizer.state, "a skipped step leaves no optimizer state"
    assert sched.last_epoch == 1
    result = one_step.train_step(state, [toks], toks[:, 1:].numel(), max_norm=CLIP, scheduler=sched)
    assert not result.skipped and result.grad_norm > 0
    assert any(not torch.equal(p, before[n]) for n, p in state.model.named_parameters())


@pytest.fixture
def calls(monkeypatch):
    """Every `train_step` call, by the kind of runtime device it ran on."""
    seen: list[str] = []
    real = one_step.train_step

    def spy(state, *args, **kwargs):
        seen.append(state.runtime.device.type)
        return real(state, *args, **kwargs)

    monkeypatch.setattr(one_step, "train_step", spy)
    return seen


def test_the_option_cases_step_through_train_step(calls):
    from tests import option_cases

    layout = _layout(1, [1])
    run = option_cases.setup(RankPlace(layout, 0), GPT, dtype=torch.float64)
    losses, norms = option_cases.run_steps(run.state.runtime, run, GPT, 0, 2)
    assert calls == ["cpu", "cpu"] and len(losses) == 2 and norms[0] > 0


def test_the_dry_run_steps_through_train_step(calls):
    from ntp_nemo.runtime.dry_run import StepShape, dry_run

    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * (GPT.num_layers + 2)), num_microbatches=4)
    res = dry_run(layout, GPT, StepShape(seq_len=SEQ, micro_batch_size=1), measure_options=False)
    assert calls and set(calls) == {"meta"}, calls
    assert all(r.optimizer_bytes == 2 * r.param_bytes for r in res.ranks)  # AdamW's moments: it stepped


class _CountedOptimizer:
    """What Lightning's manual optimisation hands the module (`LightningOptimizer`): `step` runs the
    update between `_on_before_step` and `_on_after_step`, the latter advancing the global step."""

    def __init__(self, optimizer) -> None:
        self.optimizer, self.counted = optimizer, 0

    def _on_before_step(self) -> None:
        pass

    def _on_after_step(self) -> None:
        self.counted += 1

    def step(self, closure=None) -> None:
        self._on_before_step()
        self.optimizer.step()
        self._on_after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _module_on_world_one():
    from ntp_nemo.lightning.lm_module import NTPLanguageModule

    state = _world_one()
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0 / (1 + step))
    module = NTPLanguageModule(GPT, {**OPTIM, "grad_clip": CLIP},
                               types.SimpleNamespace(sampler=types.SimpleNamespace(global_batch_size=BATCH)),
                               seed=SEED, micro_batch_size=1, val_batches=1, max_steps=STEPS)
    module.model = state.model
    strategy = types.SimpleNamespace(runtime=state.runtime, state=state)
    module._trainer = types.SimpleNamespace(strategy=strategy, callbacks=[])
    opt = _CountedOptimizer(state.optimizer)
    module.optimizers = lambda: opt
    module.lr_schedulers = lambda: sched
    module.manual_backward = lambda loss: loss.backward()
    logged = []
    module.log = lambda name, value, **kwargs: logged.append((name, float(value)))
    return types.SimpleNamespace(module=module, state=state, sched=sched, opt=opt, logged=logged)


def _batch(step: int) -> dict:
    toks = _tokens(step)
    return {"micro": toks.unsqueeze(1), "global_tokens": toks[:, 1:].numel(), "step": step}


def test_the_lightning_module_steps_through_train_step(calls):
    """The module's `training_step` on a world of one (Lightning's trainer reduced to what the step
    reads) gives the loss, gradient norm and parameters of `train_step` on an identical state."""
    side, twin = _module_on_world_one(), _world_one()
    sched = torch.optim.lr_scheduler.LambdaLR(twin.optimizer, lambda step: 1.0 / (1 + step))
    for step in range(2):
        toks = _tokens(step)
        side.module.training_step(_batch(step), step)
        want = one_step.train_step(twin, list(toks.unsqueeze(1)), toks[:, 1:].numel(), max_norm=CLIP,
                                   scheduler=sched)
        got = side.module.last_step
        assert (got["loss"], got["grad_norm"]) == (want.loss, want.grad_norm)
    assert calls == ["cpu"] * 4
    pairs = zip(side.state.model.parameters(), twin.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_a_step_taken_as_done_leaves_the_module_where_running_it_would():
    """Live recovery's survivor one step behind: it receives the tensors of a rank that completed the step
    (as the reshard writes them: parameters and AdamW state, not the optimizer's hyperparameters) and takes
    the step as done.  Lightning counts the step, the schedule advances, the loss and gradient norm logged
    are the other rank's, and the next step gives the same loss, gradient norm and parameters, bit for
    bit, as on the rank that ran both steps.  A note about another step is refused."""
    ran, behind = _module_on_world_one(), _module_on_world_one()
    for step in range(2):
        ran.module.training_step(_batch(step), step)
    behind.module.training_step(_batch(0), 0)
    with torch.no_grad():  # the reshard
        for p, q in zip(behind.state.model.parameters(), ran.state.model.parameters(), strict=True):
            p.copy_(q)
            behind.state.optimizer.state[p] = {k: v.clone() for k, v in ran.state.optimizer.state[q].items()}
    with pytest.raises(RuntimeError, match="reported step 2 as their last, not step 3"):
        behind.module.take_step_as_done(_batch(2), ran.module.step_note())
    out = behind.module.take_step_as_done(_batch(1), ran.module.step_note())
    assert torch.equal(out["loss"], torch.tensor(ran.module.last_step["loss"]))  # as training_step
    assert behind.module.last_step == ran.module.last_step
    assert behind.logged[-2:] == ran.logged[-2:]
    assert (behind.opt.counted, behind.sched.last_epoch) == (ran.opt.counted, ran.sched.last_epoch) == (2, 2)
    assert behind.state.optimizer.param_groups[0]["lr"] == ran.state.optimizer.param_groups[0]["lr"]
    for side in (ran, behind):
        side.module.training_step(_batch(2), 2)
    untimed = [{k: v for k, v in side.module.last_step.items() if k != "compute_s"} for side in (behind, ran)]
    assert untimed[0] == untimed[1] and untimed[0]["step"] == 3
    pairs = zip(behind.state.model.parameters(), ran.state.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_a_pipeline_rank_trains_through_its_engine_only():
    """On a pipeline layout a stage's slice is not the model: its place has no micro-batch methods to run
    it as if it were, and the runtime constructed from it carries the pipeline engine at once."""
    from ntp_nemo.parallel.grad_sync import param_descriptors
    from ntp_nemo.pipeline.engine import PipelineEngine
    from ntp_nemo.runtime.dry_run import fake_world
    from ntp_nemo.runtime.runtime import NTPRuntime

    layout = ResolvedLayout.make(Topology(1, [1], [1] * (GPT.num_layers + 2), pp=2))
    with fake_world(0, 2):
        place = RankPlace(layout, 0, device="meta")
        model = place.build_model(GPT, SEED)
        assert not hasattr(place, "train_microbatches") and not hasattr(place, "eval_microbatches")
        everyone = [param_descriptors(RankPlace(layout, r, device="meta").build_model(GPT, SEED))
                    for r in range(2)]
        rt = NTPRuntime(place, model, descriptors=everyone)
        assert isinstance(rt.pipeline, PipelineEngine) and rt.pipeline.model is model
