"""`trainer.dry_run=true`: every rank's step on the meta device and a fake process group, no GPU, no data."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import build_sync_plan, build_sync_plans, param_descriptors
from ntp_nemo.runtime.dry_run import (
    CommMeter,
    StepShape,
    dry_run,
    fake_world,
)
from ntp_nemo.runtime.runtime import NTPRuntime, RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import compose, run_cli
from tests.shapes import small_llama

LLAMA3_8B_PARAMS = 8_030_261_248  # published parameter count of Meta-Llama-3-8B

TINY_LLAMA = small_llama(4)


def meta_count(cfg: ModelConfig) -> int:
    """Parameters of the unsharded model, built here on the meta device."""
    from ntp_nemo.models import DecoderLM

    with torch.device("meta"):
        return sum(p.numel() for p in DecoderLM(cfg).parameters())


def test_llama3_8b_63_ranks_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(["recipe=llama3_8b", "mesh.dp=8", "mesh.tp=8", "mesh.pp=1",
                   "ntp.replica_tp=[8,8,8,8,8,8,8,7]", "trainer.dry_run=true", f"hydra.run.dir={run_dir}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "largest" in res.stdout and "smallest" in res.stdout and "total" in res.stdout
    report = json.loads((run_dir / "dry_run.json").read_text())
    ranks = report["ranks"]
    assert report["world_size"] == len(ranks) == 63
    assert [r["rank"] for r in ranks] == list(range(63))

    # model_params: the unsharded model built on meta here, and the published Llama-3-8B count.
    fields = {k: v for k, v in OmegaConf.to_container(compose(["recipe=llama3_8b"]).model).items()
              if k in {f.name for f in dataclasses.fields(ModelConfig)} and k != "_target_"}
    cfg = ModelConfig(**fields)
    assert report["model_params"] == meta_count(cfg) == LLAMA3_8B_PARAMS

    healthy = [r for r in ranks if r["replica"] == 0]
    degraded = [r for r in ranks if r["replica"] == 7]
    assert len(degraded) == 7 and {r["tp_degree"] for r in degraded} == {7}
    assert {r["tp_degree"] for r in healthy} == {8}
    # ntp.shard_align=128: the 1002 vocabulary blocks give a healthy rank 125 or 126 of them, so healthy
    # ranks differ by one block of embedding and head rows.
    sizes = sorted({r["sharded_params"] for r in healthy})
    assert len(sizes) == 2 and sizes[1] - sizes[0] == 2 * 128 * cfg.hidden_size
    # Each replica holds every sharded element once, except the TP-7 replica's shared KV heads: its query
    # heads [0,4) [4,9) [9,13) [13,18) [18,22) [22,27) [27,32) read 1+2+2+2+2+2+2 = 13 of 8 KV heads, so 5
    # KV heads (k and v, every layer) are held twice.
    kv_head = cfg.num_layers * 2 * (cfg.hidden_size // cfg.num_heads) * cfg.hidden_size
    per_replica = [sum(r["sharded_params"] for r in rs) for rs in (degraded, healthy)]
    assert per_replica[0] - 5 * kv_head == per_replica[1]
    healthy_mean = Fraction(per_replica[1], 8)
    # Per rank: everything but attention is 8/7 of a healthy rank's (the recipe's ntp.shard_align=128 splits
    # the 14336 MLP columns into 2048 per degraded rank, exactly 8/7 of 1792, and the vocabulary rows in
    # blocks of 128: up to one block of embedding and head rows off); attention splits the 32 query heads
    # 4/5/4/5/4/5/5, each rank with the KV heads they read (a KV head whose 4 query heads span two ranks is
    # held by both).
    h, d, L = cfg.hidden_size, cfg.hidden_size // cfg.num_heads, cfg.num_layers
    group = cfg.num_heads // cfg.num_kv_heads
    healthy_attn = L * (2 * group * d * h + 2 * d * h)  # TP 8: 4 query heads and 1 KV head per rank
    healthy_rest = healthy_mean - healthy_attn
    for j, r in enumerate(degraded):
        qlo, qhi = j * 32 // 7, (j + 1) * 32 // 7
        kv = (qhi - 1) // group + 1 - qlo // group
        attn = L * (2 * (qhi - qlo) * d * h + 2 * kv * d * h)
        ratio = float((r["sharded_params"] - attn) / healthy_rest)
        assert ratio == pytest.approx(8 / 7, abs=float(2 * 128 * h / healthy_rest)), (j, ratio)
    # No rank of the TP-7 replica holds more than 1.20x a healthy rank's parameters (whole KV groups: 1.29x),
    # and its modelled work is at most 1.25x; the slowest healthy rank models exactly 1 (the others one
    # vocabulary block less).
    assert max(r["params"] for r in degraded) <= 1.20 * min(r["params"] for r in healthy)
    healthy_work = [r["modelled_work"] for r in ranks if r["replica"] < 7]
    assert max(healthy_work) == 1.0 and min(healthy_work) > 0.99
    slowest = max(r["modelled_work"] for r in degraded)
    assert 1.0 < slowest <= 1.25
    assert "replica 7 (TP 7): slowest rank " in res.stdout and f"models {slowest:.3f}x" in res.stdout
    # Precision bf16-mixed: fp32 parameters (the master weights), fp32 gradients, two fp32 AdamW moments.
    for r in ranks:
        assert r["param_bytes"] == r["grad_bytes"] == 4 * r["params"]
        assert r["optimizer_bytes"] == 2 * r["param_bytes"]
        # Every gradient element is held by several replicas: each is all-reduced exactly once per step.
        assert r["comm_bytes"]["dp"] == r["grad_bytes"]
        assert r["comm_bytes"]["pp"] == 0 and r["activation_bytes"] > 0
        assert r["microbatches"] == (57 if r["replica"] == 7 else 65)  # 512 by capacity 8:...:8:7
    assert report["totals"]["params"] == sum(r["params"] for r in ranks)
    # Shard sizes per degree, 128-aligned (worked out in tests/topology/test_shard_align.py), printed too.
    assert report["shard_sizes"] == {
        "7": {"mlp_columns": [2048] * 7, "vocab_rows": [18304] * 6 + [18432]},
        "8": {"mlp_columns": [1792] * 8, "vocab_rows": [16000, 16000, 16000, 16128] * 2},
    }
    assert "TP 7: MLP columns 2048 x7; vocabulary rows 18304 x6, 18432 x1" in res.stdout
    # gloo: the world group and the checkpoint writer's, 62 peers each; NCCL-only subgroups add none.
    assert report["gloo_sockets_per_rank"]["gpu"] == 2 * 62
    assert "gloo sockets per rank (most): 124 on GPUs" in res.stdout


def test_pp2_ntp_layout_against_independent_counts():
    """A PP2 layout with a degraded replica: stage split, pipeline messages, activations in flight."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * 6, pp=2), num_microbatches=6)
    shape = StepShape(seq_len=32, micro_batch_size=2)
    result = dry_run(layout, TINY_LLAMA, shape)
    ranks = result.ranks
    assert result.model_params == meta_count(TINY_LLAMA)
    assert [(r.replica, r.stage, r.tp_degree) for r in ranks] == [
        (0, 0, 2), (0, 0, 2), (0, 1, 2), (0, 1, 2), (1, 0, 1), (1, 1, 1)]
    # The TP-1 replica's two stages hold the whole model once.
    assert ranks[4].params + ranks[5].params == result.model_params
    counts = layout.microbatch_counts()
    assert counts == [4, 2]
    act = shape.micro_batch_size * shape.seq_len * TINY_LLAMA.hidden_size * 4  # one stage boundary message
    for r in ranks:
        m = counts[r.replica]
        # Each stage sends one activation (or gradient) and receives one gradient (or activation) per mb.
        assert r.comm_bytes["pp"] == 2 * act * m
        assert r.comm_bytes["tp"] == 0 if r.tp_degree == 1 else r.comm_bytes["tp"] > 0
        in_flight = min(m, 2) if r.stage == 0 else 1  # 1F1B keeps pp - stage micro-batches in flight
        assert r.activation_peak_bytes == in_flight * r.activation_bytes
        assert r.comm_bytes["world"] == 4 * 8  # the fused step scalars: 4 float64
    # Memory-saving options, measured on the largest rank.
    opts = result.options
    assert opts["recompute"]["rank"] == opts["distributed_optimizer"]["rank"] == max(
        ranks, key=lambda r: r.memory_bytes).rank
    act = opts["recompute"]["activation_bytes"]
    assert act["none"] == ranks[opts["recompute"]["rank"]].activation_bytes > act["full"]
    # Every fragment has one holder in each of the 2 replicas: each rank keeps about half the moments.
    opt = opts["distributed_optimizer"]["optimizer_bytes"]
    assert opt["adamw"] == ranks[opts["distributed_optimizer"]["rank"]].optimizer_bytes
    assert opt["distributed"] == pytest.approx(opt["adamw"] / 2, rel=0.01)
    # Activations per micro-batch against the pipeline's own estimate for a real (CPU) slice of each stage.
    from ntp_nemo.models import DecoderLM
    from ntp_nemo.pipeline.memory import activation_bytes_per_microbatch

    for stage, r in ((0, ranks[4]), (1, ranks[5])):
        layers = range(0, 2) if stage == 0 else range(2, 4)
        real = DecoderLM(TINY_LLAMA, layers=layers, has_embedding=stage == 0, has_head=stage == 1)
        expected = activation_bytes_per_microbatch(real, shape.micro_batch_size, shape.seq_len)
        assert r.activation_bytes == pytest.approx(expected, rel=1e-3)


def _descriptors(layout: ResolvedLayout, cfg: ModelConfig) -> list[dict]:
    out = []
    for r in range(layout.world_size):
        with fake_world(r, layout.world_size):
            out.append(param_descriptors(RankPlace(layout, r, device="meta").build_model(cfg, 0)))
    return out


@pytest.mark.parametrize("replica_tp,layer_tp,pp", [
    ([4, 3], [4] * 6, 1),  # uneven shards, replicated KV heads (4 ranks, 2 KV heads)
    ([2, 1, 2], [2, 1, 2, 2, 1, 2], 1),  # per-layer degrees
    ([2, 1], [2] * 6, 2),  # pipeline stages
])
def test_all_ranks_sync_plans_equal_the_per_rank_plans(replica_tp, layer_tp, pp):
    layout = ResolvedLayout.make(Topology(max(replica_tp), replica_tp, layer_tp, pp=pp))
    desc = _descriptors(layout, TINY_LLAMA)
    replica_of = [c.replica for c in layout.topology().coords]
    plans = build_sync_plans(desc, replica_of)
    for r in range(layout.world_size):
        assert plans[r] == build_sync_plan(r, desc, replica_of)


def test_a_host_tensor_at_a_collective_fails_the_dry_run(monkeypatch):
    # The meter refuses a collective given a tensor from another device than the runtime's.
    with fake_world(0, 2), CommMeter(torch.device("meta")):
        dist.all_reduce(torch.empty(3, device="meta"))
        with pytest.raises(RuntimeError, match="runtime's device"):
            dist.all_reduce(torch.zeros(3))

    # A step whose loss accumulator stays on the host (the pre-device-discipline runtime) fails the run.
    def host_accumulator(self, model, microbatches, global_tokens, backward=None):
        total = torch.zeros((), dtype=torch.float64)
        for mb in microbatches:
            loss = model.loss_sum(mb)
            loss.backward()
            total += loss.detach().double()
        return total

    monkeypatch.setattr(NTPRuntime, "train_microbatches", host_accumulator)
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * 6), num_microbatches=3)
    with pytest.raises(RuntimeError, match="runtime's device is meta"):
        dry_run(layout, TINY_LLAMA, StepShape(seq_len=32, micro_batch_size=1))


def test_sequence_parallel_dry_run_sends_slices_and_counts_its_collectives():
    """PP2 x (2,1) with SP: stage messages of the TP-2 replica carry half the sequence; on a stage-0 rank of
    it the reduce-scatters and all-gathers put the bytes of the all-reduces they replace on the link, plus
    the backward's re-gathers of the column-parallel inputs, and fewer activations are saved."""
    from ntp_nemo.runtime.dry_run import option_savings

    off_layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * 6, pp=2), num_microbatches=6)
    layout = dataclasses.replace(off_layout, sequence_parallel=True)
    shape = StepShape(seq_len=32, micro_batch_size=2)
    ranks = dry_run(layout, TINY_LLAMA, shape, measure_options=False).ranks
    act = shape.micro_batch_size * shape.seq_len * TINY_LLAMA.hidden_size * 4  # whole-sequence message
    for r, m in zip(ranks, (4, 4, 4, 4, 2, 2), strict=True):
        assert r.comm_bytes["pp"] == 2 * m * (act // 2 if r.tp_degree == 2 else act)
    desc = _descriptors(layout, TINY_LLAMA)
    plans = build_sync_plans(desc, [c.replica for c in layout.topology().coords])
    sp = option_savings(layout, 0, TINY_LLAMA, shape, plans[0], 6 * 2 * 32, ranks[0].optimizer_bytes,
                        ranks[0].activation_bytes)["sequence_parallel"]
    off, on = sp["tp_collectives"]["off"], sp["tp_collectives"]["on"]
    # Stage 0 (embedding, 2 layers) in a TP-2 group: 9 all-reduces of `act` (ring: 2(n-1)/n = 1 x act).
    assert off == {"all_reduce": {"calls": 9, "bytes": 9 * act, "ring_bytes": 9 * act}}
    # 9 reduce-scatters of `act` (ring: half of it) and 9 all-gathers of a half piece (ring: the piece),
    # plus 4 re-gathers (the 2 column-parallel entries of 2 layers); the 4 norm-weight gradient sums travel
    # in one all-reduce at the end of the backward.
    assert on["reduce_scatter"] == {"calls": 9, "bytes": 9 * act, "ring_bytes": 9 * act // 2}
    assert on["all_gather"] == {"calls": 13, "bytes": 13 * act // 2, "ring_bytes": 13 * act // 2}
    assert on["reduce_scatter"]["ring_bytes"] + 9 * act // 2 == off["all_reduce"]["ring_bytes"]
    assert on["all_reduce"]["calls"] == 1
    assert ranks[0].activation_bytes == sp["activation_bytes"]["on"] < sp["activation_bytes"]["off"]
