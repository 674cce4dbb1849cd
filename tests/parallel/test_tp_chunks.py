"""`ntp.tp_chunks`: each micro-batch's layers run in chunks of the batch, each chunk's row-parallel
collective launched and waited for only when that chunk needs it (Domino's schedule).

Ranks are built as a run builds them (`runtime.assemble`, `runtime.step.train_step`) in float64 on TP gloo
groups (whose `async_op=True` collectives run while the caller computes; `ntpdirect` completes them before
returning), and train the same model twice from the same seed, unchunked then chunked; every step's loss,
gradient norm and gradients and the parameters after the last step must agree within 1e-10 (the chunks'
GEMMs have fewer rows, so a BLAS may block them differently: the same values up to that rounding).
Layouts: replicas of TP 3 and TP 2 (uneven head and column shards), one replica of 4 ranks whose first
layer runs at degree 2 (a change of degree between layers: under SP the chunks' sequence slices are
re-split), and two pipeline stages of TP 2 (the engine runs each stage's layers); each with and without
sequence parallelism; micro-batches of 3 sequences in 2 chunks (2 + 1 rows) and 3 chunks; GPT with
residual dropout and Llama with grouped-query heads and fused projections. (The chunked layers draw each
dropout mask for the whole micro-batch, as the unchunked ones do; on CPU, whose generator fills a mask
element by element, drawing it chunk by chunk would give the same values, so this test shows the masks'
order, not that choice, which is for CUDA, where a draw's values depend on its launch.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ntp_nemo.config.memory_keys import validate_memory_options
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.compile import validate_compile
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA_KV4, OPTIM, counting_async_launches
from tests.ntp_cases import relative_diff as _diff
from tests.shapes import small_llama

SEQ, MICRO, NUM_MICRO, STEPS, CLIP, SEED = 7, 3, 2, 2, 0.5, 11
GPT_DROPOUT = dataclasses.replace(GPT, dropout=0.2)
# layout -> (topology, the chunk counts run on it: 2 chunks of 2 + 1 rows everywhere, 3 of one row once,
# with `ntp.tp_overlap` on as well: the backward's input-gradient collectives asynchronous too)
LAYOUTS = {
    "replicas 3+2": (Topology(5, [3, 2], [3] * (GPT.num_layers + 2)), (2, 3)),
    "degrees 4,2,4 in one replica": (Topology(4, [4], [4, 2, 4, 4]), (2,)),
    "2 pipeline stages of TP 2": (Topology(2, [2], [2] * (GPT.num_layers + 2), pp=2), (2,)),
}


@pytest.fixture(autouse=True)
def gloo_tp_groups(monkeypatch):
    """TP groups on gloo, whose asynchronous collectives are in flight while the next chunk computes (the
    forked workers inherit the setting)."""
    from ntp_nemo.topology.groups import CPU_TP_BACKEND_ENV

    monkeypatch.setenv(CPU_TP_BACKEND_ENV, "gloo")


def _tokens(step: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, vocab, (MICRO * NUM_MICRO, SEQ + 1), generator=gen)


def _run(rank: int, topo: Topology, cfg, sp: bool, chunks: int, fuse: bool) -> dict:
    layout = ResolvedLayout.make(topo, num_microbatches=NUM_MICRO, sequence_parallel=sp)
    state = assemble(layout, rank, cfg, {**OPTIM, "lr": 2e-2}, "cpu", seed=SEED, param_dtype=torch.float64,
                     tp_chunks=chunks, tp_overlap=chunks == 3)
    for module in state.model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections = fuse
    torch.manual_seed(SEED)  # dropout's generator, the same for both runs (and every rank of a replica)
    named = list(state.model.named_parameters())
    out: dict = {"loss": [], "norm": [], "grads": []}
    for step in range(STEPS):
        toks = _tokens(step, cfg.vocab_size)
        micro = [toks[i * MICRO : (i + 1) * MICRO] for i in state.my_microbatches(NUM_MICRO)]
        result = train_step(state, micro, toks[:, 1:].numel(), max_norm=CLIP, before_update=lambda: out[
            "grads"].append({n: p.grad.detach().clone() for n, p in named}))
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
    out["params"] = {n: p.detach().clone() for n, p in named}
    return out


def chunks_worker(rank: int, world: int, topo: Topology, counts: tuple[int, ...], sp: bool) -> dict:
    torch.set_num_threads(1)
    report = {}
    with counting_async_launches() as launched:
        for name, cfg, fuse in (("gpt+dropout", GPT_DROPOUT, False), ("llama", LLAMA_KV4, True)):
            before = launched["async"]
            ref = _run(rank, topo, cfg, sp, 1, fuse)
            unchunked = launched["async"] - before
            for chunks in counts:
                between = launched["async"]
                got = _run(rank, topo, cfg, sp, chunks, fuse)
                report[f"{name} chunks={chunks}{' tp_overlap' if chunks == 3 else ''}"] = {
                    "async": (unchunked, launched["async"] - between),
                    "loss": max(abs(a - b) / abs(b) for a, b in zip(got["loss"], ref["loss"], strict=True)),
                    "norm": max(abs(a - b) / abs(b) for a, b in zip(got["norm"], ref["norm"], strict=True)),
                    "grad": max(_diff(g, h) for g, h in zip(got["grads"], ref["grads"], strict=True)),
                    "param": _diff(*({n: t for n, t in p.items() if not n.endswith("k_proj.bias")}
                                      for p in (got["params"], ref["params"]))),
                    "clipped": min(ref["norm"]) > CLIP,
                }
    return report


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_layers_train_as_the_unchunked_ones(layout, sp):
    """Float64, 2 AdamW steps with clipping, micro-batches of 3 sequences in 2 (and 3) chunks: losses,
    gradient norms, every gradient and the parameters within 1e-10 of the unchunked run's, with the
    row-parallel exits launched asynchronously (none unchunked)."""
    topo, counts = LAYOUTS[layout]
    results = run_workers(chunks_worker, topo.world_size, topo, counts, sp, timeout_s=300.0)
    for rank, report in enumerate(results):
        for name, r in report.items():
            where = (layout, rank, name, r)
            assert r["clipped"], where
            assert r["async"][0] == 0 and r["async"][1] > 0, where
            assert r["loss"] < 1e-12 and r["norm"] < 1e-10 and r["grad"] < 1e-10 and r["param"] < 1e-10, where


def _model_config(**ntp) -> dict:
    return {"ntp": ntp, "data": {"micro_batch_size": 2}, "model": {"recompute": "none"}}


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_a_tp_chunks_that_is_not_a_positive_integer_is_a_config_error(value):
    with pytest.raises(ConfigError) as err:
        validate_memory_options(_model_config(tp_chunks=value))
    assert "ntp.tp_chunks" in str(err.value) and "positive integer" in str(err.value)


def test_more_chunks_than_sequences_in_a_micro_batch_is_a_config_error():
    validate_memory_options(_model_config(tp_chunks=2))  # two chunks of one sequence each: accepted
    with pytest.raises(ConfigError) as err:
        validate_memory_options(_model_config(tp_chunks=3))
    msg = str(err.value)
    assert "ntp.tp_chunks" in msg and "data.micro_batch_size=2" in msg and "ntp.tp_chunks<=2" in msg


def test_chunks_with_whole_layers_recomputed_or_compiled_blocks_are_config_errors():
    cfg = _model_config(tp_chunks=2)
    cfg["model"]["recompute"] = "full"
    with pytest.raises(ConfigError) as err:
        validate_memory_options(cfg)
    assert "ntp.tp_chunks" in str(err.value) and "model.recompute=full" in str(err.value)
    cfg = {**_model_config(tp_chunks=2), "trainer": {"compile": True}}
    with pytest.raises(ConfigError) as err:
        validate_compile(cfg)
    assert "ntp.tp_chunks" in str(err.value) and "trainer.compile=false" in str(err.value)


def _quantised_grads(rank: int, chunks: int) -> dict:
    """One micro-batch's loss and gradients of an int8-quantised (QAT) Llama on TP 2, float64."""
    from ntp_nemo.quant.calibrate import quantize_model

    layout = ResolvedLayout.make(Topology(2, [2], [2] * (LLAMA_KV4.num_layers + 2)), num_microbatches=1)
    state = assemble(layout, rank, LLAMA_KV4, OPTIM, "cpu", seed=SEED, param_dtype=torch.float64,
                     tp_chunks=chunks)
    toks = _tokens(0, LLAMA_KV4.vocab_size)
    quantize_model(state.model, "int8", [], [toks[:MICRO], toks[MICRO:]])
    loss = state.model.loss_sum(toks)
    loss.backward()
    return {"loss": float(loss), **{n: p.grad.detach().clone() for n, p in state.model.named_parameters()}}


def quantised_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    ref, got = _quantised_grads(rank, 1), _quantised_grads(rank, 2)
    return {"loss": abs(got.pop("loss") - ref["loss"]) / abs(ref.pop("loss")), "grad": _diff(got, ref)}


@pytest.mark.slow
def test_chunked_layers_with_quantisation_aware_training_match_the_unchunked_ones():
    """A quantised row-parallel layer runs its own (quantiser-wrapped) forward in each chunk, so the
    chunked model computes what the unchunked one does: loss and every gradient within 1e-10."""
    pytest.importorskip("modelopt")
    import ntp_nemo.quant.modules  # noqa: F401  (imported once here, inherited by the forked workers)

    for rank, r in enumerate(run_workers(quantised_worker, 2, timeout_s=240.0)):
        assert r["loss"] < 1e-12 and r["grad"] < 1e-10, (rank, r)


def test_the_config_key_reaches_the_model_through_the_lightning_module(tmp_path, monkeypatch):
    """`ntp.tp_chunks=2` -> `build_trainer` -> the module -> `assemble`: the model the module builds runs
    its layers in 2 chunks (one-process layout, Lightning's `fit` stopped at the model)."""
    import lightning.pytorch as pl

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.lightning.factory import build_trainer
    from tests.conftest import SINGLE, TINY, compose

    def up_to_the_model(trainer, model, *args, **kwargs):
        trainer.strategy.connect(model)
        model.trainer = trainer
        model.configure_model()

    monkeypatch.setattr(pl.Trainer, "fit", up_to_the_model)
    trainer, module, _ = build_trainer(resolve(compose([*TINY, *SINGLE, "data.micro_batch_size=2",
                                                        "ntp.tp_chunks=2"])), tmp_path, None)
    trainer.fit(module)
    assert module.tp_chunks == 2 and module.model.tp_chunks == 2


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-mixed"])
def test_the_dry_run_counts_each_chunks_collectives_and_the_same_bytes(compute_dtype):
    """`ntp-train --dry-run` with `ntp.tp_chunks=2` (`StepShape.tp_chunks`): on TP 2 without SP each chunk of
    each layer sends its own 2 forward exits (attention, MLP) and 2 backward input-gradient all-reduces,
    so the TP calls of a step grow by micro-batches x layers x 4, and the TP bytes do not change (the
    chunks split the same tensors)."""
    from ntp_nemo.runtime.dry_run import StepShape, dry_run

    cfg = small_llama(6)
    layout = ResolvedLayout.make(Topology(2, [2], [2] * (cfg.num_layers + 2)), num_microbatches=2)
    shapes = {chunks: StepShape(seq_len=32, micro_batch_size=2, compute_dtype=compute_dtype, tp_chunks=chunks)
              for chunks in (1, 2)}
    ranks = {chunks: dry_run(layout, cfg, shape, measure_options=False).ranks
             for chunks, shape in shapes.items()}
    for one, two in zip(ranks[1], ranks[2], strict=True):
        assert two.comm_bytes == one.comm_bytes
        assert two.comm_calls["tp"] == one.comm_calls["tp"] + 2 * cfg.num_layers * 4, (one.comm_calls,
                                                                                      two.comm_calls)
