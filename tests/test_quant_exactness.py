"""Fake-quantised sharded layouts reproduce the unsharded quantised model (float32, gloo workers).

After TP/DP-aware calibration every amax equals the unsharded model's, and logits, loss and
gradients match it to 1e-5 relative; a quantisation state saved on one layout and resharded onto
another through the amax ShardSpecs gives the same model again.
"""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.parallel.launch import run_workers
from ntp_nemo.parallel.runtime import NTPRuntime
from ntp_nemo.parallel.shard import ShardSpec
from ntp_nemo.topology import Topology
from tests.ntp_cases import GLOBAL_BATCH, GPT, LLAMA, SEED, tokens

TOL = 1e-5
# name: (nominal tp, replica_tp, layer_tp or None for uniform)
LAYOUTS = {
    "replicas-2-1": (2, [2, 1], None),
    "replicas-3-2": (3, [3, 2], None),
    "tp3-uneven": (3, [3], None),
    "per-layer-degraded": (4, [4, 3], [4, 2, 4, 4]),
}
# GPT ties its head to the embedding (not quantised); Llama's head is a quantised vocab-parallel layer.
CASES = {"gpt": (GPT, ["head"]), "llama": (LLAMA, [])}


def _microbatches(toks: torch.Tensor, mine: range) -> list[torch.Tensor]:
    return [toks[i : i + 1] for i in mine]


def _rel(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-6) -> float:
    return float((got - want).abs().max() / max(float(want.abs().max()), floor))


def _reference(cfg, fmt: str, exclude: list[str]) -> dict:
    """Unsharded fake-quantised model: its amax, per-token loss, gradients and logits."""
    from ntp_nemo.models import build_model
    from ntp_nemo.quant.calibrate import quantize_model
    from ntp_nemo.quant.sharding import quantizer_buffers

    model = build_model(cfg, seed=SEED)
    toks = tokens(cfg)
    quantize_model(model, fmt, exclude, _microbatches(toks, range(GLOBAL_BATCH)))
    loss = model.loss_sum(toks) / toks[:, 1:].numel()
    loss.backward()
    with torch.no_grad():
        logits = model(toks[:, :-1])
    return {"amax": {n: b.clone() for n, b in quantizer_buffers(model).items()}, "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}, "logits": logits}


def _compare(rt: NTPRuntime, model, cfg, ref: dict) -> dict:
    """Worst relative errors of this rank's amax, loss, gradients and logits against the reference."""
    from ntp_nemo.quant.sharding import quantizer_buffers

    bufs = quantizer_buffers(model)
    assert sorted(bufs) == sorted(ref["amax"]), "quantizer set differs from the unsharded model's"
    worst = {"amax": max(_rel(b, b.ntp_spec.narrow(ref["amax"][n])) for n, b in bufs.items())}
    toks = tokens(cfg)
    mine = rt.my_microbatches(GLOBAL_BATCH)
    total = rt.train_microbatches(model, _microbatches(toks, mine), toks[:, 1:].numel())
    rt.sync.sync()
    loss = rt.global_sum(total) / toks[:, 1:].numel()
    worst["loss"] = abs(float(loss) - float(ref["loss"])) / abs(float(ref["loss"]))
    # Floor: a key bias's gradient is zero in theory (softmax shift invariance) and float32 noise
    # (~1e-11) here, so errors are measured against 1e-4 of the model's largest gradient at least.
    floor = 1e-4 * max(float(g.abs().max()) for g in ref["grads"].values())
    worst["grad"] = max(_rel(p.grad, p.ntp_spec.narrow(ref["grads"][n]), floor) for n, p in model.named_parameters())
    if len(mine):
        with torch.no_grad():
            logits = model(toks[mine.start : mine.stop, :-1])
        vs = model.vocab_start
        worst["logits"] = _rel(logits, ref["logits"][mine.start : mine.stop, :, vs : vs + logits.shape[-1]])
    return worst


def _runtime(tp: int, replica_tp: list[int], layer_tp: list[int] | None, rank: int, cfg):
    topo = Topology(tp, replica_tp, layer_tp or [tp] * (cfg.num_layers + 2))
    rt = NTPRuntime(topo, rank)
    model = rt.build_model(cfg, SEED)
    rt.attach(model)
    return rt, model


def calibrate_worker(rank: int, world: int, cfg, fmt: str, exclude: list[str], layout: tuple, ref: dict) -> dict:
    from ntp_nemo.quant.calibrate import quantize_model
    from ntp_nemo.quant.sharding import quantizer_buffers
    from ntp_nemo.quant.state import quant_state

    rt, model = _runtime(*layout, rank, cfg)
    quantize_model(model, fmt, exclude, _microbatches(tokens(cfg), rt.my_microbatches(GLOBAL_BATCH)))
    saved = {n: (b.ntp_spec, b.clone()) for n, b in quantizer_buffers(model).items()}
    state = quant_state(model)
    return {"worst": _compare(rt, model, cfg, ref), "amax": saved, "state": state}


def restore_worker(rank: int, world: int, cfg, layout: tuple, state: dict, amax: dict, ref: dict) -> dict:
    from ntp_nemo.quant.sharding import quantizer_buffers
    from ntp_nemo.quant.state import restore_quant_state

    rt, model = _runtime(*layout, rank, cfg)
    restore_quant_state(model, state)
    with torch.no_grad():
        for name, buf in quantizer_buffers(model).items():
            buf.copy_(buf.ntp_spec.narrow(amax[name]))
    return _compare(rt, model, cfg, ref)


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Logical amax tensors from every rank's annotated slices (what a sharded checkpoint stores)."""
    out: dict[str, torch.Tensor] = {}
    for saved in per_rank:
        for name, (spec, local) in saved.items():
            full = out.setdefault(name, torch.full(spec.global_shape, float("nan"), dtype=local.dtype))
            region = spec.narrow(full)
            assert torch.isnan(region).all() or torch.equal(region, local), f"replicas disagree on {name}"
            region.copy_(local)
    for name, full in out.items():
        assert not torch.isnan(full).any(), f"{name}: no rank holds part of it"
    return out


def _check(results: list[dict], label: str) -> None:
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < TOL, f"{label} rank {rank}: {key} rel error {err:.2e}"


@pytest.fixture(scope="module")
def references() -> dict:
    torch.manual_seed(0)
    return {}


def _ref(references: dict, case: str, fmt: str) -> dict:
    if (case, fmt) not in references:
        cfg, exclude = CASES[case]
        references[(case, fmt)] = _reference(cfg, fmt, exclude)
    return references[(case, fmt)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_int8_calibration_matches_unsharded(references, case, layout):
    cfg, exclude = CASES[case]
    ref = _ref(references, case, "int8")
    tp, replica_tp, layer_tp = LAYOUTS[layout]
    out = run_workers(calibrate_worker, sum(replica_tp), cfg, "int8", exclude, (tp, replica_tp, layer_tp), ref)
    _check([o["worst"] for o in out], f"{case}/{layout}")


@pytest.mark.slow
def test_fp8_calibration_matches_unsharded(references):
    cfg, exclude = CASES["llama"]
    ref = _ref(references, "llama", "fp8")
    out = run_workers(calibrate_worker, 5, cfg, "fp8", exclude, (3, [3, 2], None), ref)
    _check([o["worst"] for o in out], "fp8 llama/replicas-3-2")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resharded_reload_keeps_quantised_model(references, case):
    """Calibrate on replicas (2, 1), reload the state and amax slices on replicas (3, 2) uncalibrated."""
    cfg, exclude = CASES[case]
    ref = _ref(references, case, "int8")
    out = run_workers(calibrate_worker, 3, cfg, "int8", exclude, (2, [2, 1], None), ref)
    amax = _assemble([o["amax"] for o in out])
    for name, full in amax.items():
        assert torch.allclose(full, ref["amax"][name], rtol=TOL, atol=0), name
    states = [o["state"] for o in out]
    assert all(s == states[0] for s in states[1:]), "the saved quantisation state depends on the rank"
    results = run_workers(restore_worker, 5, cfg, (3, [3, 2], None), states[0], amax, ref)
    _check(results, f"{case} reload (2,1)->(3,2)")


def test_amax_spec_follows_channel_sharding():
    """Per-channel amax of a column-parallel weight is split like its rows; reduced dims are whole."""
    from ntp_nemo.quant.sharding import TensorSharding, amax_spec

    rows = TensorSharding(dim=0, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((4, 1), 0, rows, is_global=False) == ShardSpec((10, 1), 0, 2, 1, 3)
    assert amax_spec((10, 1), 0, rows, is_global=True).local_shape == (4, 1)
    assert amax_spec((), None, rows, is_global=False).is_full
    cols = TensorSharding(dim=1, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((6, 1), 0, cols, is_global=False) == ShardSpec.full((6, 1))
    last = TensorSharding(dim=-1, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((1, 1, 4), -1, last, is_global=False) == ShardSpec((1, 1, 10), 2, 2, 1, 3)
    with pytest.raises(ValueError):
        amax_spec((5, 1), 0, rows, is_global=False)
