"""A runtime is complete when `runtime.assemble` returns it; nothing else can complete (or half-complete) one.

`NTPRuntime(layout, rank)` alone is a rank's place (coordinates, device, TP plan) from which the model
slice is built; the gradient sync and the pipeline engine depend on that model, so `assemble` builds the
slice and completes the runtime with it (`NTPRuntime._attach`, called nowhere else).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ntp_nemo.parallel.grad_sync import GradientSynchronizer
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, GPT, OPTIM, SEED, reference, step_against_reference, tokens

ROOT = Path(__file__).resolve().parents[1]
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


def test_a_runtime_constructed_alone_is_a_place_and_refuses_to_sync():
    """Constructed alone it builds the model slice (what the dry run and the checkpoint tests use it
    for), but asking it for the gradient sync names `assemble` instead of handing back None."""
    rt = NTPRuntime(ONE_RANK, 0)
    model = rt.build_model(GPT, SEED)
    assert sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(RuntimeError, match=r"rank 0: this runtime has no gradient sync.*runtime\.assemble"):
        rt.sync  # noqa: B018


def test_the_public_api_cannot_complete_a_runtime_by_hand():
    """No public method attaches a model, and the sync cannot be set from outside."""
    rt = NTPRuntime(ONE_RANK, 0)
    assert not hasattr(rt, "attach")
    public = {n for n in dir(NTPRuntime) if not n.startswith("_")}
    assert not {n for n in public if "attach" in n}, public
    built = assemble(ONE_RANK, 0, GPT, OPTIM, None, seed=SEED).runtime
    with pytest.raises(AttributeError):
        rt.sync = built.sync


def test_only_assemble_completes_a_runtime():
    """Across the package, the tests and the benches, `_attach`/`attach` is called in `runtime/assemble.py`
    only (an `ast` walk over calls, so comments and strings do not count)."""
    callers = []
    for folder in ("ntp_nemo", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("attach", "_attach")):
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [c.split(":")[0] for c in callers] == ["ntp_nemo/runtime/assemble.py"], callers
