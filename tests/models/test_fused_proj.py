"""Fused projections: q/k/v and gate/up as one GEMM per rank over the layers' stacked local rows
(`parallel/sequence.py: _FusedProject`), against the same layout with one GEMM per projection and
against the unsharded model (float64), on uneven shards and on aligned shards with duplicated KV heads."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA, SEED, assembled, step_against_reference, tokens

COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")
GEMMS = {"mm", "addmm", "bmm"}


def set_fused(model: torch.nn.Module, fuse: bool) -> None:
    for module in model.modules():
        if hasattr(module, "fuse_projections"):
            module.fuse_projections = fuse


def _forward_backward(model, toks) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss_sum(toks)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6))


def _fused_against_separate(rank: int, world: int, cfg, align: int, sp: bool) -> dict:
    """The fused step against the unsharded model (float64), then one micro-batch fused and with one GEMM
    per projection: loss and every gradient slice against each other, and the collectives each called."""
    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2), shard_align=align)
    rt, model = assembled(ResolvedLayout.make(topology, sequence_parallel=sp), rank, cfg)
    # The global batch's loss and gradients of the fused model, summed over the TP holders of shared KV
    # heads by the gradient sync, against the unsharded model (one GEMM per projection: the CPU default).
    set_fused(model, True)
    _, against_unsharded = step_against_reference(rt, model, cfg)
    toks = tokens(cfg)[:2]
    calls: dict[bool, Counter] = {}
    results = {}
    for fuse in (False, True):
        set_fused(model, fuse)
        counts: Counter = Counter()
        originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in originals.items():
            def wrapped(*args, _fn=fn, _name=name, _counts=counts, **kwargs):
                _counts[_name] += 1
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapped)
        try:
            results[fuse] = _forward_backward(model, toks)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        calls[fuse] = counts
    (loss_f, grads_f), (loss_s, grads_s) = results[True], results[False]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {
        "loss_vs_separate": abs(loss_f - loss_s) / abs(loss_s),
        "grad_vs_separate": max(_rel(grads_f[n], g) for n, g in grads_s.items()),
        "loss_vs_unsharded": against_unsharded["loss"],
        "grad_vs_unsharded": against_unsharded["grad"],
        "calls": {k: dict(v) for k, v in calls.items()},
        "shapes": shapes,
        "kv_rows": shapes["blocks.0.attn.k_proj.weight"][0],
    }


# LLAMA: 6 query heads over 2 KV heads, MLP 70 columns, vocabulary 67.  TP 3 (uneven: MLP 23/23/24,
# vocabulary 22/22/23): each rank's query heads 2/2/2 read KV heads {0}, {0, 1}, {1}: the middle rank holds
# both.  TP 4 with shard_align=8 (MLP 16/16/16/22, vocabulary 16/16/16/19): more ranks than KV heads,
# query heads 1/2/1/2, every KV head held by two ranks (duplicated).
CASES = {
    "tp3-uneven": (3, 1, False),
    "tp4-aligned-duplicated-kv": (4, 8, False),
    "tp3-uneven-sp": (3, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_projections_match_separate_gemms_and_the_unsharded_model(case):
    world, align, sp = CASES[case]
    results = run_workers(_fused_against_separate, world, LLAMA, align, sp)
    if world == 4:  # duplicated KV heads: every rank holds exactly one of the two (head dim 8)
        assert [r["kv_rows"] for r in results] == [8, 8, 8, 8]
    else:
        assert [r["kv_rows"] for r in results] == [8, 16, 8]
    for rank, r in enumerate(results):
        for key in ("loss_vs_separate", "loss_vs_unsharded", "grad_vs_separate", "grad_vs_unsharded"):
            assert r[key] < 1e-10, f"{case} rank {rank}: {key} rel error {r[key]:.2e}"
        # The same TP collectives either way: each projection group already entered the TP region once.
        assert r["calls"][True] == r["calls"][False], r["calls"]
        layers = LLAMA.num_layers
        if sp:  # per layer: all-gathers 2 forward (q/k/v, gate/up inputs), 2 again backward (only the
            # slice is saved), 2 backward of the row-parallel outputs' reduce-scatters (2 forward, 2
            # backward of the inputs); the embedding's reduce-scatter and its backward gather, the head's
            # gather forward and backward and its input's reduce-scatter, the cross entropy's gather,
            # the replicated parameters' one gradient all-reduce
            assert r["calls"][True] == {"all_gather_single": 6 * layers + 2 + 1 + 1,
                                        "reduce_scatter_single": 4 * layers + 1 + 1, "all_reduce": 1}
        else:  # embedding forward 1, per layer forward 2 all-reduces (o, down) and backward 2 (one for
            # q/k/v, one for gate/up), the head's input backward 1; the cross entropy's one all-gather
            assert r["calls"][True] == {"all_reduce": 1 + 2 * layers + 2 * layers + 1, "all_gather_single": 1}


class _GemmCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _gemms(fuse: bool | None) -> tuple[int, int]:
    model = build_model(LLAMA, seed=SEED).double()
    if fuse is not None:
        set_fused(model, fuse)
    toks = tokens(LLAMA)[:2]
    with _GemmCounter() as fwd:
        loss = model.loss_sum(toks)
    with _GemmCounter() as bwd:
        loss.backward()
    return fwd.count, bwd.count


def test_fused_projections_issue_one_gemm_per_group():
    """Per Llama layer: forward q/k/v 3 -> 1 GEMM and gate/up 2 -> 1; backward (input and weight
    gradients) 6 -> 2 and 4 -> 2.  On CPU the default is one GEMM per projection."""
    fwd_f, bwd_f = _gemms(True)
    fwd_s, bwd_s = _gemms(False)
    assert _gemms(None) == (fwd_s, bwd_s)
    layers = LLAMA.num_layers
    assert fwd_s - fwd_f == 3 * layers
    assert bwd_s - bwd_f == 6 * layers


def test_fused_run_follows_the_separate_run_in_float32():
    """Same parameters and initial draws (the fused GEMM adds no parameter: names and shapes unchanged),
    so five AdamW steps in float32 follow the one-GEMM-per-projection run to rounding."""
    curves = []
    names = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = build_model(LLAMA, seed=SEED)
        set_fused(model, fuse)
        names.append([(n, tuple(p.shape)) for n, p in model.named_parameters()])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(5):
            toks = tokens(LLAMA)[step % 3 * 2: step % 3 * 2 + 2]
            opt.zero_grad()
            loss = model.loss_sum(toks) / toks[:, 1:].numel()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        curves.append(losses)
    assert names[0] == names[1]
    assert any(n.endswith("q_proj.weight") for n, _ in names[0])
    assert losses[-1] < losses[0]  # it trains
    for a, b in zip(*curves, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), curves


def _saved_bytes(rank: int, world: int, cfg, tp: int, tp_rank: int) -> dict[bool, int]:
    """Bytes autograd saves for one layer's forward (each storage once, parameters excluded, as the
    pipeline engine's meter counts them) as TP rank `tp_rank` of `tp` holds the layer, fused and not."""
    from ntp_nemo.models.transformer import Block, rope_tables
    from ntp_nemo.topology.tp_context import TPContext

    out = {}
    for fuse in (False, True):
        block = Block(cfg, TPContext(size=tp, rank=tp_rank, group=dist.group.WORLD)).double()
        set_fused(block, fuse)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        seen: dict[int, int] = {}

        def pack(t, _seen=seen, _params=params):
            storage = t.untyped_storage()
            if storage.data_ptr() not in _params:
                _seen[storage.data_ptr()] = storage.nbytes()
            return t

        x = torch.randn(1, 8, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
        rope = rope_tables(16, cfg.hidden_size // cfg.num_heads, cfg.rope_theta, "cpu", torch.float64)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, rope)
        out[fuse] = sum(seen.values())
    return out


def test_fused_projections_keep_no_more_activations_than_separate_ones():
    """q, k and v are views of one GEMM output; were v saved as such a view, the whole output (q and k
    rows too) would live until the backward.  Same saved bytes as one GEMM per projection, at TP 1 and as
    rank 0 of TP 2 (its collectives on a one-process group)."""
    for tp in (1, 2):
        (saved,) = run_workers(_saved_bytes, 1, LLAMA, tp, 0)
        assert saved[True] == saved[False], (tp, saved)


def _mixed_backward_outside_autocast(rank: int, world: int, sp: bool) -> dict:
    """Float32 parameters, forward under bf16 autocast, backward outside it (as a caller may run it):
    the fused and the separate paths' TP messages (kind, dtype, bytes) and gradients."""
    from ntp_nemo.runtime.runtime import RankPlace

    torch.set_num_threads(1)
    topology = Topology(world, [world], [world] * (LLAMA.num_layers + 2))
    rt = RankPlace(ResolvedLayout.make(topology, sequence_parallel=sp), rank)
    out = {}
    for fuse in (True, False):
        model = rt.build_model(LLAMA, SEED)
        set_fused(model, fuse)
        wire: Counter = Counter()
        originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in originals.items():
            def wrapped(*args, _fn=fn, _name=name, _wire=wire, **kwargs):
                t = args[1] if _name != "all_reduce" else args[0]
                _wire[f"{_name} {t.dtype}"] += t.numel() * t.element_size()
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapped)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss_sum(tokens(LLAMA)[:2])
            loss.backward()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        grads = [p.grad for p in model.parameters()]
        out[fuse] = {"wire": dict(wire), "dtypes": sorted({str(g.dtype) for g in grads}),
                     "finite": all(bool(torch.isfinite(g).all()) for g in grads),
                     "loss": float(loss.detach())}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_fused_bf16_mixed_sends_what_separate_gemms_send_with_the_backward_outside_autocast(sp):
    for r in run_workers(_mixed_backward_outside_autocast, 2, sp):
        fused, separate = r[True], r[False]
        assert fused["wire"] == separate["wire"], (fused["wire"], separate["wire"])
        assert fused["finite"] and fused["dtypes"] == ["torch.float32"], fused
        assert abs(fused["loss"] - separate["loss"]) <= 1e-2 * abs(separate["loss"])


def test_fused_weights_are_stacked_once_per_optimizer_step(monkeypatch):
    """Four micro-batches of a step (forward and backward each) read one stacked copy of each fused group's
    weights (q/k/v and gate/up of every layer), made again after the optimizer step updated them: 4 copies a
    step for the 4 groups of the two-layer model, where every micro-batch's forward and backward made its
    own (32 a step)."""
    from ntp_nemo.parallel import sequence

    made = []
    original = sequence._cat_rows
    monkeypatch.setattr(sequence, "_cat_rows", lambda ts, dt: made.append(len(ts)) or original(ts, dt))
    model = build_model(LLAMA, seed=SEED)
    set_fused(model, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step = []
    for _step in range(2):
        made.clear()
        opt.zero_grad()
        for mb in range(4):
            model.loss_sum(tokens(LLAMA)[mb : mb + 1]).backward()
        opt.step()
        per_step.append(sorted(made))
    assert per_step == [[2, 2, 3, 3]] * 2  # gate/up and q/k/v of each layer, once a step
