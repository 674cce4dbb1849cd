"""The TP step's collectives: fewer of them, same numbers (float64 against the unsharded model and
against the per-parameter path they replace)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA, SEED, exactness_worker, tokens

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor")


def _count_collectives() -> Counter:
    """Wrap this process's torch.distributed collectives (called in a forked worker only)."""
    counts: Counter = Counter()
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    return counts


def _one_microbatch(rank: int, world: int, cfg, sp: bool, reducer: bool) -> dict:
    """Collectives of one micro-batch's forward + backward on TP `world`, and the gradients."""
    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2))
    layout = ResolvedLayout.make(topology, sequence_parallel=sp)
    rt = RankPlace(layout, rank)
    model = rt.build_model(cfg, SEED, dtype=torch.float64)
    if not reducer:  # the per-parameter path (one all-reduce per replicated parameter)
        for module in model.modules():
            if hasattr(module, "grad_reducer"):
                module.grad_reducer = None
    counts = _count_collectives()
    toks = tokens(cfg)[:2]
    loss = model.loss_sum(toks)
    forward = Counter(counts)
    loss.backward()
    return {"forward": dict(forward), "all": dict(counts), "loss": float(loss),
            "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


def test_cross_entropy_and_tp_regions_take_the_minimum_collectives_without_sp():
    """Per micro-batch, GPT TP2: forward 1 embedding + 2 per layer (row-parallel outputs) + 1 for the
    cross entropy (one all-gather of max, sum of exponentials and target logit; it was a max then a sum
    all-reduce); backward 2 per layer (column-parallel inputs) + 1 (tied head)."""
    res = run_workers(_one_microbatch, 2, GPT, False, True)
    layers = GPT.num_layers
    for r in res:
        assert r["forward"] == {"all_reduce": 1 + 2 * layers, "all_gather_single": 1}
        assert r["all"] == {"all_reduce": 1 + 2 * layers + 2 * layers + 1, "all_gather_single": 1}


def test_sequence_parallel_replicated_gradients_take_one_all_reduce_per_backward():
    """Under SP the norm weights/biases, row-parallel biases and position embedding have their gradients
    summed over the TP group in one all-reduce at the end of the backward (GPT: 2 layers x (2 norms x 2 +
    2 biases) + final norm 2 + position embedding 1 = 15 all-reduces before), with the same gradients."""
    fused = run_workers(_one_microbatch, 2, GPT, True, True)
    per_param = run_workers(_one_microbatch, 2, GPT, True, False)
    for a, b in zip(fused, per_param, strict=True):
        assert a["all"]["all_reduce"] == 1, a["all"]
        assert b["all"]["all_reduce"] == 15, b["all"]
        assert a["all"]["all_gather_single"] == b["all"]["all_gather_single"]
        assert a["loss"] == b["loss"]
        for name, g in b["grads"].items():
            assert abs(a["grads"][name] - g).max() <= 1e-10 * max(abs(g).max(), 1e-6), name


def test_sequence_parallel_uneven_layout_still_matches_unsharded():
    """Replicas of TP 3 and 2 (uneven sequence slices, shared norms synced across replicas) with SP and the
    fused replicated-gradient reduction: loss, gradients and logits of the unsharded model (float64)."""
    results = run_workers(exactness_worker, 5, LLAMA, 3, [3, 2], [3] * (LLAMA.num_layers + 2), 1, 8, True)
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"rank {rank}: {key} rel error {err:.2e}"


def _wire(rank: int, world: int, cfg, sp: bool, mode: str) -> dict:
    """(kind, dtype) -> [calls, bytes] of one micro-batch's TP collectives on TP `world`: `mixed` = float32
    parameters with the forward under bf16 autocast and the backward outside it; `bf16` = an all-bf16
    model (what the dry run steps under bf16-mixed)."""
    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2))
    rt = RankPlace(ResolvedLayout.make(topology, sequence_parallel=sp), rank)
    model = rt.build_model(cfg, SEED, dtype=torch.bfloat16 if mode == "bf16" else None)
    wire: dict = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            t = args[1] if _name != "all_reduce" else args[0]  # the payload: the input of a gather/scatter
            rec = wire.setdefault(f"{_name} {str(t.dtype).removeprefix('torch.')}", [0, 0])
            rec[0] += 1
            rec[1] += t.numel() * t.element_size()
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    toks = tokens(cfg)[:2]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "mixed"):
        loss = model.loss_sum(toks)
    loss.backward()  # outside autocast
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return {"wire": wire, "finite": grads_finite, "grad_dtypes": sorted({str(p.grad.dtype) for p in
                                                                       model.parameters()})}


def test_bf16_mixed_sends_what_the_all_bf16_model_sends_and_runs_its_backward_outside_autocast():
    """Under bf16-mixed the norms' float32 outputs are cast at the TP region boundary: the SP all-gathers,
    reduce-scatters and the input-gradient all-reduces move bf16, the same calls and bytes as the all-bf16
    model the dry run steps (float32 in both: see below).  A
    backward outside autocast (SP's fused gather-and-project used to raise a dtype mismatch) works, and the
    gradients stay in the parameters' float32."""
    for sp in (True, False):
        mixed = run_workers(_wire, 2, LLAMA, sp, "mixed")
        bf16 = run_workers(_wire, 2, LLAMA, sp, "bf16")
        for m, b in zip(mixed, bf16, strict=True):
            assert m["finite"] and m["grad_dtypes"] == ["torch.float32"], m
            assert m["wire"] == b["wire"], (sp, m["wire"], b["wire"])
            # float32 in both: the cross entropy's per-token statistics, and under SP the replicated
            # parameters' gradient sums (a gradient reduction, in at least float32).
            float32 = {"all_gather_single float32"} | ({"all_reduce float32"} if sp else set())
            assert {k for k in m["wire"] if "float32" in k} == float32, m["wire"]


def test_slice_init_draws_the_numbers_of_the_full_draw():
    """A rank's slice of a row-split parameter comes from a prefix of the generator's stream, and equals
    the slice of the full draw bit for bit, for every rank of every split (uneven, aligned, by heads, the
    redrawn tail of a size that is not a multiple of 16), and for splits along other dims (full draw)."""
    from ntp_nemo.models.init import full_init, normal_prefix_length, slice_init
    from ntp_nemo.topology.shard import ShardSpec, aligned_interval

    cases = [((257, 40), 1, 1), ((67, 40), 1, 1), ((84, 40), 1, 4), ((40, 40), 8, 1), ((13, 3), 1, 1),
             ((1, 17), 1, 1), ((257, 40), 1, 8)]
    for shape, unit, align in cases:
        for n in range(1, 8):
            units = shape[0] // unit
            if n > units:
                continue
            for i in range(n):
                lo, hi = aligned_interval(i, n, units, align if unit == 1 else 1)
                spec = ShardSpec.split(shape, 0, unit, lo, hi)
                for dtype in (torch.float32, torch.float64):
                    want = spec.narrow(full_init("w", shape, ("normal", 0.02), 3, dtype))
                    assert torch.equal(slice_init("w", spec, ("normal", 0.02), 3, dtype), want), (shape, n, i)
        spec = ShardSpec.split(shape, 1, 1, 0, 1)  # a column split draws the whole tensor
        assert torch.equal(slice_init("w", spec, ("normal", 0.02), 3, torch.float32),
                           spec.narrow(full_init("w", shape, ("normal", 0.02), 3, torch.float32)))
    assert normal_prefix_length(257 * 40, 40) == 48  # rank 0 of a vocabulary split: its rows, rounded
    assert normal_prefix_length(100, 90) == 100  # reaches the redrawn tail: everything
    assert normal_prefix_length(10, 1) == 10


def test_init_from_draws_no_initial_weights(tmp_path, monkeypatch):
    """With `model.init_from` every parameter comes from the HF files: nothing is drawn first."""
    import ntp_nemo.models.init as init

    pytest.importorskip("transformers")
    from tests.hf.test_import import make_hf_dir, resolved

    path = make_hf_dir(tmp_path / "hf", "llama")
    cfg = resolved(path)

    def refuse(*args, **kwargs):
        raise AssertionError("an initial weight was drawn")

    monkeypatch.setattr(init, "slice_init", refuse)
    monkeypatch.setattr(init, "full_init", refuse)
    rt = RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * (cfg.num_layers + 2))), 0)
    model = rt.build_model(cfg, SEED)
    from safetensors.torch import load_file

    stored = load_file(str(next(path.glob("*.safetensors"))))
    assert torch.equal(model.blocks["0"].attn.q_proj.weight, stored["model.layers.0.self_attn.q_proj.weight"])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _after_failed_backward(rank: int, world: int, cfg) -> dict:
    """A backward that raises part-way (after some replicated gradients were collected), then a full one:
    the second pass's gradients, with the fused reduction and with the per-parameter path."""
    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2))
    out = {}
    for fused in (True, False):
        rt = RankPlace(ResolvedLayout.make(topology, sequence_parallel=True), rank)
        model = rt.build_model(cfg, SEED, dtype=torch.float64)
        if not fused:
            for module in model.modules():
                if hasattr(module, "grad_reducer"):
                    module.grad_reducer = None
        toks = tokens(cfg)[:2]

        def fail(grad):
            raise RuntimeError("injected")

        def on_embedding(module, inputs, output) -> None:
            output.register_hook(fail)  # raises in the backward, after the layers' gradients

        handle = model.embed.register_forward_hook(on_embedding)
        try:
            model.loss_sum(toks).backward()
        except RuntimeError as e:
            assert "injected" in str(e)
        handle.remove()
        model.zero_grad(set_to_none=True)
        model.loss_sum(toks).backward()
        out[fused] = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return {n: float(abs(out[True][n] - g).max() / max(abs(g).max(), 1e-6)) for n, g in out[False].items()}


def test_a_backward_that_raises_leaves_no_stale_replicated_gradients():
    for errors in run_workers(_after_failed_backward, 2, GPT):
        assert max(errors.values()) <= 1e-10, errors
