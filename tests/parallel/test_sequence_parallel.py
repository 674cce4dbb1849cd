"""Sequence parallelism on uneven TP degrees: the split, its collectives, and exactness against the
unsharded model (float64, gloo) with sequence lengths the degrees do not divide."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.parallel.sequence import seq_interval, seq_lengths
from ntp_nemo.runtime.runtime import NTPRuntime, RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.tp_context import TPContext
from tests.conftest import TINY, run_cli
from tests.ntp_cases import GPT, LLAMA, SEED, assembled, reference, step_against_reference, tokens
from tests.option_cases import STEPS, VARIANTS, run_steps, setup

SEQ_LEN = 100  # 3 does not divide it: slices of 33, 33 and 34 tokens
GPT_SP = dataclasses.replace(GPT, max_seq_len=128)
LLAMA_SP = dataclasses.replace(LLAMA, max_seq_len=128)


def test_slices_are_balanced_intervals_uneven_by_one():
    assert seq_lengths(7, 8192) == [1170, 1170, 1170, 1171, 1170, 1170, 1171]
    sp3 = [TPContext(3, i, None, 1, True) for i in range(3)]
    assert [seq_interval(ctx, 100) for ctx in sp3] == [(0, 33), (33, 66), (66, 100)]
    # Without SP (or at degree 1) every rank holds the whole sequence.
    assert seq_interval(TPContext(3, 2, None, 1, False), 100) == (0, 100)


# name: (tp, replica_tp, layer_tp, seq_len, tokens each rank's embedding output holds); worlds <= 5 ranks.
LAYOUTS = {
    "replicas-3-2": (3, [3, 2], [3, 3, 3, 3], SEQ_LEN, [33, 33, 34, 50, 50]),
    # Degree 1 between degree-3 (degree-2 in the second replica) slots: the sequence is re-split twice.
    "per-layer-3-1-3": (3, [3, 2], [3, 1, 3, 3], SEQ_LEN, [33, 33, 34, 50, 50]),
    # 99 divides by neither 2 nor 4; a degree change at every slot (embedding at degree 2: two copies).
    "per-layer-2-4-2-4": (4, [4], [2, 4, 2, 4], 99, [49, 50, 49, 50]),
}


def sp_worker(rank: int, world: int, cfg, tp: int, replica_tp: list[int], layer_tp: list[int], seq: int):
    torch.set_num_threads(1)
    layout = ResolvedLayout.make(Topology(tp, replica_tp, layer_tp), sequence_parallel=True)
    rt, model = assembled(layout, rank, cfg)
    _, worst = step_against_reference(rt, model, cfg, seq)
    with torch.no_grad():
        held = model.embed_tokens(tokens(cfg, seq)[:1, :-1]).shape[1]
    return worst, held


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT_SP, LLAMA_SP], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sequence_parallel_matches_unsharded(cfg, layout):
    tp, replica_tp, layer_tp, seq, held = LAYOUTS[layout]
    results = run_workers(sp_worker, sum(replica_tp), cfg, tp, replica_tp, layer_tp, seq)
    assert [h for _, h in results] == held  # the replicated regions hold only the rank's slice
    for rank, (worst, _) in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"{layout} rank {rank}: {key} rel error {err:.2e}"


def test_logits_of_the_whole_sequence_match_unsharded():
    """The vocabulary-parallel head sees the whole sequence (gathered), so logits match (one process,
    float64: degree 1 makes SP a no-op, which the model must accept)."""
    cfg = LLAMA_SP
    rt = RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 4), sequence_parallel=True), 0)
    model = rt.build_model(cfg, SEED, dtype=torch.float64)
    toks = tokens(cfg, SEQ_LEN)
    assert torch.allclose(model(toks[:, :-1]), reference(cfg, SEQ_LEN)[2], rtol=0, atol=1e-12)


def dropout_worker(rank: int, world: int, cfg, tp: int, replica_tp: list[int], seq: int) -> dict:
    """The same step with SP off and on: dropout draws the same masks, so loss and gradients agree."""
    torch.set_num_threads(1)
    out = {}
    for sp in (False, True):
        topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2))
        rt, model = assembled(ResolvedLayout.make(topo, sequence_parallel=sp), rank, cfg)
        toks = tokens(cfg, seq)
        torch.manual_seed(5)
        total = rt.train_microbatches(model, [toks[i : i + 1] for i in rt.my_microbatches(len(toks))],
                                      toks[:, 1:].numel())
        rt.sync.sync()
        out[sp] = (float(rt.global_sum(total)), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_off, grads_off), (loss_on, grads_on) = out[False], out[True]
    return {"loss_off": loss_off, "loss_on": loss_on,
            "grad": max(float((grads_on[n] - g).abs().max() / g.abs().max().clamp_min(1e-6))
                        for n, g in grads_off.items())}


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_sequence_parallelism():
    cfg = dataclasses.replace(LLAMA_SP, dropout=0.3)
    results = run_workers(dropout_worker, 3, cfg, 3, [3], SEQ_LEN)
    for res in results:
        assert abs(res["loss_on"] - res["loss_off"]) < 1e-10 * abs(res["loss_off"])
        assert res["grad"] < 1e-10


GPT4_SP = dataclasses.replace(GPT_SP, num_layers=4)
LLAMA4_SP = dataclasses.replace(LLAMA_SP, num_layers=4)

# name: (replica_tp, layer_tp, schedule, virtual_stages); PP2, nominal TP 2, sequence of 99 tokens.
PP_LAYOUTS = {
    "pp2-replicas-2-1-1f1b": ([2, 1], [2] * 6, "1f1b", 1),
    # Layer 1 (last of stage 0) at degree 2 sends a 49/50-token slice; layer 2 at degree 1 re-gathers it.
    "pp2-per-layer-boundary-gpipe": ([2, 1], [2, 2, 2, 1, 2, 2], "gpipe", 1),
    "pp2-interleaved-v2": ([2, 1], [2] * 6, "interleaved_1f1b", 2),
}


def pp_worker(rank: int, world: int, cfg, replica_tp: list[int], layer_tp: list[int], schedule: str, v: int):
    torch.set_num_threads(1)
    layout = ResolvedLayout.make(Topology(2, replica_tp, layer_tp, pp=2), schedule=schedule, virtual_stages=v,
                                 sequence_parallel=True)
    rt, model = assembled(layout, rank, cfg)
    _, worst = step_against_reference(rt, model, cfg, 99)
    first = min(int(k) for k in model.blocks.keys())
    lo, hi = model.hidden_interval(first, 99)
    return worst, hi - lo


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT4_SP, LLAMA4_SP], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", list(PP_LAYOUTS))
def test_sequence_parallel_pipeline_matches_unsharded(cfg, layout):
    replica_tp, layer_tp, schedule, v = PP_LAYOUTS[layout]
    results = run_workers(pp_worker, 6, cfg, replica_tp, layer_tp, schedule, v)
    # Ranks 2, 3 (replica 0, stage 1) receive a 49- and a 50-token slice; replica 1 (one rank at degree 1)
    # holds all 99 tokens.
    received = [h for _, h in results]
    assert received[2:4] == [49, 50] and received[5] == 99
    for rank, (worst, _) in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"{layout} rank {rank}: {key} rel error {err:.2e}"


def options_worker(rank: int, world: int, variants: list[str]) -> dict:
    """Five AdamW steps (clipping, warmup-cosine) on (3,2) with 8-token sequences (slices of 2, 3, 3):
    the plain run without SP against each memory/overlap option with SP (float64)."""
    torch.set_num_threads(1)
    topo = Topology(3, [3, 2], [3] * (LLAMA.num_layers + 2))
    out: dict = {}

    def train(rt: NTPRuntime, name: str) -> tuple[list[float], dict]:
        run = setup(rt, LLAMA, *VARIANTS[name], dtype=torch.float64)
        losses, _ = run_steps(rt, run, LLAMA, 0, STEPS)
        run.path.remove()
        return losses, {n: p.detach().clone() for n, p in run.model.named_parameters()}

    base_losses, base_params = train(RankPlace(ResolvedLayout.make(topo), rank), "baseline")
    sp = RankPlace(ResolvedLayout.make(topo, sequence_parallel=True), rank)
    for name in variants:
        losses, params = train(sp, name)
        out[name] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses, strict=True)),
                     "param": max(float((params[n] - base_params[n]).abs().max()) for n in params)}
    return out


@pytest.mark.slow
def test_sequence_parallel_with_recompute_distributed_optimizer_and_overlap():
    variants = ["baseline", "selective", "full", "distributed", "overlap", "all"]
    for rank, res in enumerate(run_workers(options_worker, 5, variants)):
        for name in variants:
            assert res[name]["loss"] < 1e-10 and res[name]["param"] < 1e-10, (rank, name, res[name])


def test_sequence_parallel_with_qat_exits_2_before_launch(tmp_path):
    proc = run_cli([*TINY, "mesh.dp=1", "mesh.tp=2", "ntp.sequence_parallel=true", "quant=int8",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ntp.sequence_parallel" in proc.stderr and "quant=none" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_planner_cost_model_counts_sp_activations_and_the_backward_regather():
    from ntp_nemo.planner.cost import LAYER, item_cost
    from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape

    shape = ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       ffn_hidden_size=14336, seq_len=8192)
    dev, links = DeviceModel(), LinkModel()
    off = item_cost(shape, LAYER, 7, 8192, 1, dev, links)
    on = item_cost(shape, LAYER, 7, 8192, 1, dev, links, sequence_parallel=True)
    state = off.params * dev.state_bytes_per_param
    # Korthikanti et al. (bf16, flash attention): s*b*h*(10 + 24/t) bytes per layer, s*b*h*34/t with SP.
    assert off.memory_bytes - state == pytest.approx(8192 * 4096 * (10 + 24 / 7) * dev.act_bytes / 2)
    assert on.memory_bytes - state == pytest.approx(8192 * 4096 * 34 / 7 * dev.act_bytes / 2)
    # Same bytes for the replaced all-reduces, plus two half all-reduces (the backward re-gathers).
    assert on.comm_bytes == pytest.approx(off.comm_bytes * 5 / 4) and on.comm_s > off.comm_s
    assert item_cost(shape, LAYER, 1, 8192, 1, dev, links, sequence_parallel=True) == item_cost(
        shape, LAYER, 1, 8192, 1, dev, links)


def test_ntp_plan_with_sequence_parallelism_fits_in_less_memory(capsys):
    from ntp_nemo.cli.plan import run

    base = ["model=llama3_8b", "hardware=h100", "mesh.tp=8", "mesh.pp=1", "ntp.replica_tp=[8,8,7]",
            "recompute=false"]
    peaks = {}
    for sp in ("false", "true"):
        assert run([*base, f"sequence_parallel={sp}", "format=json"]) == 0
        peaks[sp] = max(json.loads(capsys.readouterr().out)["memory_gb"])
    # The TP-7 replica's 32 layers keep 10/7 instead of 10 bytes per s*h of replicated activations:
    # 32 * 8192 * 4096 * (10 - 10/7) bytes = 9.2e9 less (the parameters and optimizer state are the same).
    assert peaks["false"] - peaks["true"] > 8.0
    assert run([*base, "sequence_parallel=true"]) == 0
    assert "ntp.sequence_parallel=true" in capsys.readouterr().out
