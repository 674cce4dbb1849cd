"""`ntp.tp_overlap`: the input gradient's TP collective overlapped with the weight gradients.

Ranks are built as a run builds them (`runtime.assemble`, `runtime.step.train_step`) on replicas of
TP 3 and TP 2 (uneven shards: GPT's 5 heads split 1/2/2, Llama's 8 query heads 2/3/3 over 4 KV heads,
two of them held by two ranks), in float64, with and without sequence parallelism (the sequence of 7
tokens split 2/2/3 and 3/4: padded collectives).  Each process trains the same model twice from the
same seed, `tp_overlap` off then on, and compares every step's loss, gradient norm and gradients and
the parameters after the last step.  GPT runs its projections one GEMM each (the CPU default), Llama
fused (q/k/v and gate/up as one GEMM each, the CUDA default), so both forms of the function are covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ntp_nemo.parallel.sequence as sequence
from ntp_nemo.config.memory_keys import validate_memory_options
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA_KV4, OPTIM, counting_async_launches
from tests.ntp_cases import relative_diff as _diff

SEQ, BATCH, STEPS, CLIP, SEED = 7, 5, 2, 0.5, 11
REPLICAS = [3, 2]


@pytest.fixture(autouse=True)
def gloo_tp_groups(monkeypatch):
    """TP groups on gloo, whose `async_op=True` collectives run while the caller computes (the forked
    workers inherit the setting): the default `ntpdirect` backend completes a collective before returning
    its work, which would leave the asynchronous path, and its wait, untested."""
    from ntp_nemo.topology.groups import CPU_TP_BACKEND_ENV

    monkeypatch.setenv(CPU_TP_BACKEND_ENV, "gloo")


def _tokens(step: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)


def _run(rank: int, cfg, sp: bool, overlap: bool, fuse: bool) -> dict:
    """`STEPS` optimizer steps through `train_step`; the losses, norms, every step's final gradients
    (after the DP sync and clipping) and the parameters after the last step."""
    layout = ResolvedLayout.make(Topology(3, REPLICAS, [3] * (cfg.num_layers + 2)), num_microbatches=BATCH,
                                 sequence_parallel=sp)
    state = assemble(layout, rank, cfg, {**OPTIM, "lr": 2e-2}, "cpu", seed=SEED, param_dtype=torch.float64,
                     tp_overlap=overlap)
    for module in state.model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections = fuse
    named = list(state.model.named_parameters())
    out: dict = {"loss": [], "norm": [], "grads": []}
    for step in range(STEPS):
        toks = _tokens(step, cfg.vocab_size)
        micro = [toks[i : i + 1] for i in state.my_microbatches(BATCH)]
        result = train_step(state, micro, toks[:, 1:].numel(), max_norm=CLIP, before_update=lambda: out[
            "grads"].append({n: p.grad.detach().clone() for n, p in named}))
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
    out["params"] = {n: p.detach().clone() for n, p in named}
    return out


def equality_worker(rank: int, world: int, sp: bool) -> dict:
    torch.set_num_threads(1)
    report = {}
    with counting_async_launches() as calls:
        for name, cfg, fuse in (("gpt", GPT, False), ("llama", LLAMA_KV4, True)):
            before = calls["async"]
            off = _run(rank, cfg, sp, False, fuse)
            between = calls["async"]
            on = _run(rank, cfg, sp, True, fuse)
            report[name] = {
                "async": (between - before, calls["async"] - between),
                "loss": max(abs(a - b) / abs(b) for a, b in zip(on["loss"], off["loss"], strict=True)),
                "norm": max(abs(a - b) / abs(b) for a, b in zip(on["norm"], off["norm"], strict=True)),
                "grad": max(_diff(g, h) for g, h in zip(on["grads"], off["grads"], strict=True)),
                "param": _diff(*({n: t for n, t in p.items() if not n.endswith("k_proj.bias")}
                                  for p in (on["params"], off["params"]))),
                "bitwise": on["loss"] == off["loss"] and on["norm"] == off["norm"]
                and all(torch.equal(g[n], h[n])
                        for g, h in zip(on["grads"], off["grads"], strict=True) for n in h)
                and all(torch.equal(on["params"][n], t) for n, t in off["params"].items()),
                "clipped": min(off["norm"]) > CLIP,
            }
    return report


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tp_overlap_trains_as_the_serial_path_on_uneven_replicas(sp):
    """Replicas (3, 2), float64, 2 AdamW steps with clipping: with `tp_overlap` the losses, gradient
    norms, every gradient and the parameters equal the serial path's bit for bit (the relative figures
    first, for a readable failure), and the input gradients' collectives were launched asynchronously
    (none without the option)."""
    results = run_workers(equality_worker, sum(REPLICAS), sp, timeout_s=240.0)
    for rank, report in enumerate(results):
        for name, r in report.items():
            where = (rank, name, r)
            assert r["clipped"], where
            assert r["async"][0] == 0 and r["async"][1] > 0, where
            assert r["loss"] < 1e-12 and r["norm"] < 1e-10 and r["grad"] < 1e-10 and r["param"] < 1e-10, where
            assert r["bitwise"], where


def test_an_input_gradient_used_before_its_collective_ends_is_wrong():
    """The wait is what makes the function exact: a `Pending.wait` that returns the buffer without waiting
    (the collective still running when the gradient is used) gives other gradients (TP 2 with SP)."""
    results = run_workers(no_wait_worker, 2, timeout_s=120.0)
    assert all(r["with_wait"] for r in results), results
    assert not all(r["without_wait"] for r in results), results


def _grads_once(rank: int, overlap: bool) -> dict[str, torch.Tensor]:
    layout = ResolvedLayout.make(Topology(2, [2], [2] * (GPT.num_layers + 2)), num_microbatches=1,
                                 sequence_parallel=True)
    state = assemble(layout, rank, GPT, OPTIM, "cpu", seed=SEED, param_dtype=torch.float64,
                     tp_overlap=overlap)
    toks = torch.randint(0, GPT.vocab_size, (4, 15), generator=torch.Generator().manual_seed(3))
    state.runtime.train_microbatches(state.model, [toks], toks[:, 1:].numel())
    return {n: p.grad.detach().clone() for n, p in state.model.named_parameters()}


def no_wait_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    ref = _grads_once(rank, False)
    with_wait = _grads_once(rank, True)
    real_wait = sequence.Pending.wait

    def no_wait(self):
        # The collective is waited for only after the result was taken (so the process group stays
        # usable): what a missing wait returns is whatever the buffer held at that moment.
        result = self.finish().clone()
        real_wait(self)
        return result

    sequence.Pending.wait = no_wait
    try:
        without = _grads_once(rank, True)
    finally:
        sequence.Pending.wait = real_wait
    # Under SP every collective of the function runs on the same operands as the serial path's: equal bit
    # for bit with the wait; without it at least one gradient differs (or holds what the buffer held).
    return {"with_wait": all(torch.equal(with_wait[n], ref[n]) for n in ref),
            "without_wait": all(torch.equal(without[n], ref[n]) for n in ref)}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_tp_overlap_that_is_not_a_bool_is_a_config_error(value):
    cfg = {"ntp": {"tp_overlap": value}}
    with pytest.raises(ConfigError) as err:
        validate_memory_options(cfg)
    assert "ntp.tp_overlap" in str(err.value) and "true or false" in str(err.value)


def test_the_config_key_reaches_the_layers_through_the_lightning_module(tmp_path, monkeypatch):
    """`ntp.tp_overlap=true` -> `build_trainer` -> the module -> `assemble`: every column-parallel layer
    of the model the module builds has the option on (one-process layout, Lightning's `fit` stopped at the
    model, as `tests/runtime/test_startup_draws.py` does)."""
    import lightning.pytorch as pl

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.lightning.factory import build_trainer
    from ntp_nemo.parallel.layers import ColumnParallelLinear
    from tests.conftest import SINGLE, TINY, compose

    def up_to_the_model(trainer, model, *args, **kwargs):
        trainer.strategy.connect(model)
        model.trainer = trainer
        model.configure_model()

    monkeypatch.setattr(pl.Trainer, "fit", up_to_the_model)
    for value in (True, False):
        trainer, module, _ = build_trainer(resolve(compose([*TINY, *SINGLE, f"ntp.tp_overlap={value}"])),
                                           tmp_path / str(value), None)
        trainer.fit(module)
        layers = [m for m in module.model.modules() if isinstance(m, ColumnParallelLinear)]
        assert module.tp_overlap is value and layers and all(m.tp_overlap is value for m in layers)


def _autocast_grads(rank: int, sp: bool, overlap: bool, backward_inside: bool, wire: list) -> dict:
    layout = ResolvedLayout.make(Topology(2, [2], [2] * (LLAMA_KV4.num_layers + 2)), num_microbatches=1,
                                 sequence_parallel=sp)
    state = assemble(layout, rank, LLAMA_KV4, OPTIM, "cpu", seed=SEED, tp_overlap=overlap)
    wire.clear()
    toks = torch.randint(0, LLAMA_KV4.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = state.model.loss_sum(toks)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return {n: p.grad.detach().clone() for n, p in state.model.named_parameters()}


def autocast_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    wire: list = []
    original = dist.all_reduce, dist.reduce_scatter_single

    def recording(fn):
        def wrapped(tensor, *args, **kwargs):
            if kwargs.get("async_op"):
                wire.append(tensor.dtype)
            return fn(tensor, *args, **kwargs)
        return wrapped

    out = {}
    for sp in (False, True):
        ref = _autocast_grads(rank, sp, False, True, wire)
        for inside in (True, False):
            dist.all_reduce, dist.reduce_scatter_single = (recording(f) for f in original)
            try:
                grads = _autocast_grads(rank, sp, True, inside, wire)
            finally:
                dist.all_reduce, dist.reduce_scatter_single = original
            out[f"sp={sp} backward {'inside' if inside else 'outside'} autocast"] = {
                "wire": sorted({str(d) for d in wire}),
                "equal": all(torch.equal(grads[n], ref[n]) for n in ref),
                "diff": _diff(grads, ref),
            }
    return out


def test_under_autocast_bfloat16_crosses_the_wire_and_the_gradients_are_the_serial_paths():
    """Llama (GQA), TP 2, float32 parameters, forward under bfloat16 autocast, backward inside or outside
    it: the input gradients' asynchronous collectives move bfloat16 (the compute dtype, as the serial
    path's), and every gradient equals the serial path's bit for bit, with and without SP."""
    for rank, report in enumerate(run_workers(autocast_worker, 2, timeout_s=120.0)):
        for case, r in report.items():
            assert r["wire"] == ["torch.bfloat16"] and r["equal"], (rank, case, r)
