"""Start-up without wasted draws: a model whose values come from a checkpoint draws nothing, and the
initial weights of a fresh start stay the layout-invariant ones (in-process, one rank, no process group)."""

from __future__ import annotations

import pytest
import torch

import ntp_nemo.models.init as init
from ntp_nemo.checkpoint.sharded import load, save_checkpoint
from ntp_nemo.models import build_model
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA, SEED


def _runtime(cfg) -> RankPlace:
    return RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * (cfg.num_layers + 2))), 0)


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


# ---- the Lightning path: the module decides from what `fit` was given ---------------------------------


def _built_by_fit(monkeypatch, tmp_path, ckpt_path, extra_callbacks=()):
    """`build_trainer`'s trainer and module on the one-process layout, after `trainer.fit(module,
    ckpt_path=...)` has run Lightning's start-up as far as the model (Lightning's own `fit` replaced by
    what its `_run` does first: connect the module, `configure_model`), with every call of the initial
    draw (`models.init.initialize_`) counted."""
    import lightning.pytorch as pl

    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.lightning.factory import build_trainer
    from tests.conftest import SINGLE, TINY, compose

    def up_to_the_model(trainer, model, *args):
        trainer.strategy.connect(model)
        model.trainer = trainer
        model.configure_model()

    draws = []
    real = init.initialize_

    def counted(model, seed):
        draws.append(seed)
        real(model, seed)

    monkeypatch.setattr(pl.Trainer, "fit", up_to_the_model)
    monkeypatch.setattr(init, "initialize_", counted)
    spec = resolve(compose([*TINY, *SINGLE]))
    trainer, module, _ = build_trainer(spec, tmp_path, None, extra_callbacks=extra_callbacks)
    trainer.fit(module, ckpt_path=ckpt_path)
    return spec, trainer, module, draws


def test_a_trainer_given_a_checkpoint_builds_the_model_without_drawing(tmp_path, monkeypatch):
    ckpt = save_checkpoint(tmp_path / "step_3", build_model(LLAMA, seed=SEED), step=3)
    _, trainer, module, draws = _built_by_fit(monkeypatch, tmp_path, str(ckpt))
    assert draws == [] and module.weights_drawn is False and trainer.resume_from == str(ckpt)
    assert module.model is trainer.strategy.state.model  # built and adopted, only not drawn
    # Lightning read no checkpoint here (its `fit` stopped at the model): the first step refuses to train
    # on values nobody wrote.
    with pytest.raises(RuntimeError, match="without initial weights.*no checkpoint was loaded"):
        module.on_train_start()


@pytest.mark.parametrize("ckpt_path", [None, "last"])
def test_a_trainer_starting_afresh_draws_the_layout_invariant_weights(tmp_path, monkeypatch, ckpt_path):
    """No checkpoint, or one of Lightning's keywords that may find none: the model is drawn, and equals
    the plain unsharded build of the same seed."""
    spec, trainer, module, draws = _built_by_fit(monkeypatch, tmp_path, ckpt_path)
    assert draws == [spec.seed] and module.weights_drawn is True and trainer.resume_from is None
    plain = dict(build_model(spec.model, seed=spec.seed).named_parameters())
    got = dict(module.model.named_parameters())
    assert sorted(got) == sorted(plain)
    for name, p in got.items():
        assert torch.equal(p, plain[name]), name
    module.on_train_start()  # nothing to refuse


def test_a_rejoining_process_builds_the_model_without_drawing(tmp_path, monkeypatch):
    """A repaired process (its recovery hooks say `rejoining`) receives every shard from the survivors:
    nothing is drawn, whatever `fit` was given (the live launcher's replacement inherits the first
    attempt's trainer)."""
    import lightning.pytorch as pl

    from ntp_nemo.lightning.hooks import RecoveryHooks

    class Rejoining(pl.Callback, RecoveryHooks):
        rejoining = True

    _, _, module, draws = _built_by_fit(monkeypatch, tmp_path, None, extra_callbacks=[Rejoining()])
    assert draws == [] and module.weights_drawn is False
