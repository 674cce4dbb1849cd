"""Token batches reach a CUDA device from pinned host memory with an asynchronous copy; on the CPU
nothing is pinned.  No GPU here: the CUDA side is a mocked tensor that records what it is asked
(tests/gpu/ runs the real copy)."""

from __future__ import annotations

from unittest import mock

import torch

from ntp_nemo.lightning.lm_module import NTPLanguageModule, batch_loader

CUDA = torch.device("cuda", 0)


def _transfer(batch: dict, device: torch.device) -> dict:
    return NTPLanguageModule.transfer_batch_to_device(None, batch, device, 0)


def test_a_pageable_batch_is_pinned_then_copied_without_blocking_to_cuda():
    micro = mock.MagicMock(name="micro")
    micro.device = torch.device("cpu")
    micro.is_pinned.return_value = False
    pinned = micro.pin_memory.return_value
    out = _transfer({"micro": micro, "step": 3, "global_tokens": 96}, CUDA)
    micro.pin_memory.assert_called_once_with()
    pinned.to.assert_called_once_with(CUDA, non_blocking=True)
    micro.to.assert_not_called()  # never the pageable copy
    assert out["micro"] is pinned.to.return_value and out["step"] == 3 and out["global_tokens"] == 96


def test_an_already_pinned_batch_is_not_pinned_again():
    micro = mock.MagicMock(name="micro")
    micro.device = torch.device("cpu")
    micro.is_pinned.return_value = True
    _transfer({"micro": micro}, CUDA)
    micro.pin_memory.assert_not_called()
    micro.to.assert_called_once_with(CUDA, non_blocking=True)


def test_the_cpu_path_pins_nothing():
    micro = torch.arange(12).view(2, 6)
    with mock.patch.object(torch.Tensor, "pin_memory", side_effect=AssertionError("pinned on CPU")):
        out = _transfer({"micro": micro, "step": 0}, torch.device("cpu"))
    assert torch.equal(out["micro"], micro) and not out["micro"].is_pinned()


def test_the_loaders_pin_for_cuda_only():
    batches = [{"micro": torch.zeros(2, 3, dtype=torch.long), "step": 0}]
    assert batch_loader(batches, CUDA).pin_memory is True
    cpu = batch_loader(batches, torch.device("cpu"))
    assert cpu.pin_memory is False and cpu.num_workers == 0
    assert [b["step"] for b in cpu] == [0]
