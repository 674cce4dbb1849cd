"""The replica fingerprint does not depend on the sharding, and names a flipped bit's replica, rank and
parameter (forked gloo workers on the exactness tests' tiny GPT)."""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.parallel.fingerprint import (
    build_plan,
    compare,
    descriptors,
    gather_fingerprints,
    gather_plan,
    local_fingerprints,
    replica_fingerprints,
)
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, OPTIM, SEED

DTYPES = (torch.float32, torch.bfloat16)


def _flip(t: torch.Tensor, index: int, which: str) -> None:
    """Flip the top (`high`) or lowest (`low`) mantissa bit of element `index` of `t`, in place."""
    bits = 8 * t.element_size()
    bit = {"high": {32: 22, 16: 6}[bits], "low": 0}[which]
    ints = t.detach().view(-1).view({32: torch.int32, 16: torch.int16}[bits])
    ints[index] ^= 1 << bit


def _worker(rank: int, world: int, tp: int, replica_tp: list[int], layer_tp: list[int],
            flips: dict[int, tuple[str, int, int]], pattern: str = "row_column") -> dict:
    topo = Topology(tp, replica_tp, layer_tp)
    out = {}
    for dtype in DTYPES:
        layout = ResolvedLayout.make(topo, pattern=pattern)
        model = assemble(layout, rank, GPT, OPTIM, None, seed=SEED, param_dtype=dtype).model
        plan = gather_plan(model, topo.coord(rank).replica)
        if rank in flips:
            name, index, which = flips[rank]
            _flip(dict(model.named_parameters())[name], index, which)
        got = gather_fingerprints(local_fingerprints(model, plan.fragments[rank]), plan)
        out[str(dtype)] = (replica_fingerprints(plan, got), compare(plan, got))
    return out


def _unsharded(dtype: torch.dtype) -> int:
    model = build_model(GPT, seed=SEED).to(dtype)
    plan = build_plan([descriptors(model)], [0])
    return int(local_fingerprints(model, plan.fragments[0]).sum())


LAYOUTS = {
    "replicas-2-1": (2, [2, 1], [2, 2, 2, 2]),
    "replicas-3-2": (3, [3, 2], [3, 3, 3, 3]),
    "per-layer-2-1": (2, [2, 1], [2, 1, 2, 1]),  # layer 0 and the head replicated inside replica 0
}
# ntp.pattern=block: replica 0 on a 2x2 grid (its weights in 2D blocks), replica 1 row/column at TP 2
BLOCK = (4, [4, 2], [4, 4, 4, 4])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fingerprint_equal_across_replicas_of_any_degree(layout):
    tp, replica_tp, layer_tp = LAYOUTS[layout]
    results = run_workers(_worker, sum(replica_tp), tp, replica_tp, layer_tp, {})
    for dtype in DTYPES:
        want = _unsharded(dtype)
        for rank, res in enumerate(results):
            per_replica, mismatches = res[str(dtype)]
            assert mismatches == [], f"{layout} {dtype} rank {rank}: {mismatches}"
            assert per_replica == {r: want for r in range(len(replica_tp))}, f"{layout} {dtype}"


@pytest.mark.slow
def test_block_grid_fingerprint_equals_row_column_and_names_a_flip():
    """A 2x2 grid's blocks and a TP-2 replica's slices give the unsharded fingerprint; a bit flipped in
    one block of the grid (rank 2: grid row 1, column 0) is named by replica, rank and parameter (two
    replicas: no majority, so the TP-2 replica's holder of that piece, rank 4, is named too)."""
    name = "blocks.0.mlp.up_proj.weight"
    clean = run_workers(_worker, 6, *BLOCK, {}, "block")
    flipped = run_workers(_worker, 6, *BLOCK, {2: (name, 3, "high")}, "block")
    for dtype in DTYPES:
        want = _unsharded(dtype)
        assert all(r[str(dtype)] == ({0: want, 1: want}, []) for r in clean), (dtype, clean[0][str(dtype)])
        _, mismatches = flipped[0][str(dtype)]
        assert [(m.replica, m.rank, m.parameter, m.majority) for m in mismatches] == [
            (0, 2, name, False), (1, 4, name, False)], mismatches


@pytest.mark.slow
def test_flipped_bits_named_by_replica_rank_and_parameter():
    """Three replicas (2, 1, 1): a high mantissa bit on replica 0's second rank and the lowest bit on
    replica 2, each in another parameter, are both found and named; the other replicas are not."""
    name_a, name_b = "blocks.0.mlp.up_proj.weight", "blocks.1.attn.o_proj.weight"
    flips = {1: (name_a, 5, "high"), 3: (name_b, 7, "low")}
    results = run_workers(_worker, 4, 2, [2, 1, 1], [2, 2, 2, 2], flips)
    for dtype in DTYPES:
        _, mismatches = results[0][str(dtype)]
        assert [(m.replica, m.rank, m.parameter, m.majority) for m in mismatches] == [
            (0, 1, name_a, True), (2, 3, name_b, True)], mismatches
        assert all(r[str(dtype)][1] == mismatches for r in results)
