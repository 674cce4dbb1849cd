"""The per-layer TP contexts a model is built with (one rank's view of the layout)."""

from __future__ import annotations

from typing import Protocol

from ntp_nemo.topology.tp_context import SINGLE, TPContext


class TPPlan(Protocol):
    """Maps a layout slot (0 = embedding, 1..L = transformer layers, L+1 = output head) to a TPContext."""

    def context(self, slot: int) -> TPContext: ...


class SingleDevicePlan:
    """Every layer unsharded: the reference the sharded layouts must reproduce."""

    def context(self, slot: int) -> TPContext:
        return SINGLE
