"""Start-up without wasted draws: a model whose values come from a checkpoint draws nothing, and the
initial weights of a fresh start stay the layout-invariant ones (in-process, one rank, no process group)."""

from __future__ import annotations

import torch

import ntp_nemo.models.init as init
from ntp_nemo.checkpoint.sharded import load, save_checkpoint
from ntp_nemo.models import build_model
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA, SEED


def _runtime(cfg) -> NTPRuntime:
    return NTPRuntime(ResolvedLayout.make(Topology(1, [1], [1] * (cfg.num_layers + 2))), 0)


def test_a_model_built_for_a_checkpoint_draws_nothing_and_takes_the_checkpoints_values(tmp_path, monkeypatch):
    saved = _runtime(LLAMA).build_model(LLAMA, SEED + 1)  # the values the checkpoint holds
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(0.5)  # trained away from any initialisation
    path = save_checkpoint(tmp_path / "step_3", saved, step=3)

    def refuse(*args, **kwargs):
        raise AssertionError("an initial weight was drawn")

    monkeypatch.setattr(init, "slice_init", refuse)
    monkeypatch.setattr(init, "full_init", refuse)
    model = _runtime(LLAMA).build_model(LLAMA, SEED, initialize=False)
    load(path, model)
    want = dict(saved.named_parameters())
    assert sorted(want) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def test_a_fresh_start_keeps_the_layout_invariant_initial_weights():
    """The runtime's build (allocated on its device, cast, then drawn) equals the plain build's draws, in
    float32 and float64 (drawn in float32, then cast: a float64 model starts from the same numbers)."""
    plain = build_model(LLAMA, seed=SEED)
    for dtype in (None, torch.float64):
        model = _runtime(LLAMA).build_model(LLAMA, SEED, dtype)
        got = dict(model.named_parameters())
        for name, p in plain.named_parameters():
            assert got[name].dtype == (dtype or torch.float32)
            assert torch.equal(got[name], p.to(got[name].dtype)), name
