"""bench/host_syncs.py: the training step reads the device back once (the fused step scalars), also
after a resume; a step counter placed on the device, as checkpoint loads used to place it, shows up as
one read per parameter."""

from __future__ import annotations

import pytest
import torch

from bench import host_syncs


@pytest.mark.parametrize("name", ["default", "resume"])
def test_one_host_read_per_step(name):
    res = host_syncs.run_rank(host_syncs.CONFIGS[name], rank=0, steps=2)
    assert res["reads"] == 1 and res["kinds"] == {"tolist": 1}, res  # read_step_scalars
    assert res["uploads"] == 0, res


def test_a_step_counter_on_the_device_is_counted(monkeypatch):
    from ntp_nemo.checkpoint import state

    monkeypatch.setattr(state, "state_device", lambda optimizer, p, shape: p.device)  # the old placement
    res = host_syncs.run_rank(host_syncs.CONFIGS["resume"], rank=0, steps=2)
    params = sum(1 for _ in torch.nn.Module.parameters(_model()))
    assert res["kinds"].get("item", 0) >= params > 10, res


def _model() -> torch.nn.Module:
    from ntp_nemo.models import build_model

    return build_model(host_syncs.MODEL, seed=0)  # unsharded: as many parameters as each rank's slice


def test_a_host_float_logged_is_an_upload():
    from lightning.pytorch.core.module import LightningModule

    module = LightningModule()
    module._device = torch.device("meta")
    to_tensor = LightningModule._LightningModule__to_tensor
    mode = host_syncs.HostReads()
    with mode, host_syncs.HostReadMethods(mode):
        to_tensor(module, 2.5, "x")  # what self.log(float) does: a device tensor from a host float
    assert mode.uploads == 1
    with mode, host_syncs.HostReadMethods(mode):
        to_tensor(module, torch.tensor(2.5), "x")  # a CPU tensor stays on the host
    assert mode.uploads == 1
