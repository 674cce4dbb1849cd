"""The dry run of a block-sharded layout (`ntp.pattern=block`, a 2x2 grid): it counts the grids' row and
column groups among the communicator splits the assembly makes, and its short builds (2 and 3 layers per
stage, extended) give every rank the figures of the whole stage."""

from __future__ import annotations

import dataclasses

import torch

from ntp_nemo.runtime.dry_run import StepShape, dry_run
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.shapes import small_llama


def test_block_layout_dry_run_counts_its_grid_and_scales_its_layers():
    cfg = small_llama(6)
    layout = ResolvedLayout.make(Topology(4, [4], [4] * 8), num_microbatches=2, pattern="block")
    shape = StepShape(seq_len=32, micro_batch_size=2, compute_dtype=torch.bfloat16)
    said: list[str] = []
    fast = dry_run(layout, cfg, shape, progress=said.append)
    reference = dry_run(layout, cfg, shape, scale_layers=False)
    assert fast.splits["grid"] == 4  # two rows and two columns, none of them a TP group
    assert all(m.endswith("(on 2 and 3 layers per stage)") for m in said if m.startswith("step shape"))
    assert [dataclasses.asdict(r) for r in fast.ranks] == [dataclasses.asdict(r) for r in reference.ranks]
    # every rank holds a quarter of every weight: the same parameter count within the uneven blocks
    params = [r.params for r in fast.ranks]
    assert max(params) - min(params) < 0.05 * max(params)
