"""A runtime is complete when constructed: `NTPRuntime(place, model)` holds the rank's place, its model
slice's gradient sync and (pp > 1) its pipeline engine; a `RankPlace` alone builds the slice and trains
nothing; ranks are built through `runtime.assemble`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ntp_nemo.parallel.grad_sync import GradientSynchronizer
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import NTPRuntime, RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, GPT, OPTIM, SEED, reference, step_against_reference, tokens

ROOT = Path(__file__).resolve().parents[2]
ONE_RANK = ResolvedLayout.make(Topology(1, [1], [1] * (GPT.num_layers + 2)))


def test_an_assembled_runtime_trains_and_evaluates_on_the_unsharded_model():
    """The runtime `assemble` returns is usable at once: its sync is the gradient path's, one step's
    loss and gradients equal the unsharded model's (float64), and evaluation gives the same loss."""
    state = assemble(ONE_RANK, 0, GPT, OPTIM, None, seed=SEED, param_dtype=torch.float64)
    rt = state.runtime
    assert isinstance(rt.sync, GradientSynchronizer)
    assert rt.sync is state.grad_path.sync
    mine, errors = step_against_reference(rt, state.model, GPT)
    assert list(mine) == list(range(GLOBAL_BATCH))
    assert errors["loss"] < 1e-12 and errors["grad"] < 1e-10, errors
    toks = tokens(GPT)
    with torch.no_grad():
        evaluated = rt.eval_microbatches(state.model, [toks[i : i + 1] for i in mine])
    ref_loss = float(reference(GPT)[0])
    assert abs(float(evaluated) / toks[:, 1:].numel() - ref_loss) / ref_loss < 1e-12


def test_a_place_builds_the_slice_and_trains_nothing():
    """A place builds the model slice (what the dry run and the checkpoint tests use it for); it has no
    gradient sync, no pipeline engine and no micro-batch methods to run half-wired."""
    place = RankPlace(ONE_RANK, 0)
    model = place.build_model(GPT, SEED)
    assert sum(p.numel() for p in model.parameters()) > 0
    for missing in ("sync", "pipeline", "train_microbatches", "eval_microbatches"):
        assert not hasattr(place, missing), missing


def test_a_runtime_is_complete_when_constructed():
    """`NTPRuntime(place, model)` has its sync at once, shares the place's coordinates and groups, and
    cannot be constructed from a layout alone (the old half-built form) nor have its sync replaced."""
    place = RankPlace(ONE_RANK, 0)
    model = place.build_model(GPT, SEED)
    rt = NTPRuntime(place, model)
    assert isinstance(rt.sync, GradientSynchronizer) and rt.pipeline is None
    assert (rt.layout, rt.rank, rt.coord, rt.plan) == (place.layout, place.rank, place.coord, place.plan)
    with pytest.raises(TypeError, match="RankPlace"):
        NTPRuntime(ONE_RANK, 0)
    built = assemble(ONE_RANK, 0, GPT, OPTIM, None, seed=SEED).runtime
    with pytest.raises(AttributeError):
        rt.sync = built.sync
    twin = rt.for_model(place.build_model(GPT, SEED))  # another copy of the slice: the same sync
    assert twin.sync is rt.sync and twin.layout is rt.layout


def test_ranks_are_built_through_assemble():
    """Across the package, the tests and the benches, `NTPRuntime(...)` is constructed in
    `runtime/assemble.py` (and by `NTPRuntime.for_model` in `runtime/runtime.py`) only, besides the tests of
    the constructor itself: an `ast` walk over calls, so comments and strings do not count."""
    callers = []
    for folder in ("ntp_nemo", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "NTPRuntime"):
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert sorted({c.split(":")[0] for c in callers}) == [
        "ntp_nemo/runtime/assemble.py", "ntp_nemo/runtime/runtime.py",
        "tests/runtime/test_runtime_complete.py", "tests/runtime/test_train_step.py",
    ], callers
