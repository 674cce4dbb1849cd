"""Sharded NTP layouts reproduce the unsharded model's logits, loss and gradients (float64)."""

from __future__ import annotations

import pytest

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.transformer import attention_head_intervals
from ntp_nemo.topology.tp_context import TPContext
from tests.ntp_cases import GPT, LLAMA, LLAMA_KV4, exactness_worker

LAYOUTS = {
    "tp1": (1, [1], None),
    "tp2": (2, [2], None),
    "tp3-uneven": (3, [3], None),
    "tp4": (4, [4], None),
    "dp2-uniform": (2, [2, 2], None),
    "replicas-2-1": (2, [2, 1], None),
    "replicas-3-2": (3, [3, 2], None),
    "replicas-4-3": (4, [4, 3], None),
    "per-layer-4-2": (4, [4], [2, 4, 2, 4]),
    "per-layer-degraded": (4, [4, 3], [4, 2, 4, 4]),
}


def _layer_tp(tp, spec):
    return spec if spec is not None else [tp] * 4


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_unsharded(cfg, layout):
    tp, replica_tp, layer_tp = LAYOUTS[layout]
    results = run_workers(exactness_worker, sum(replica_tp), cfg, tp, replica_tp, _layer_tp(tp, layer_tp))
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"{layout} rank {rank}: {key} rel error {err:.2e}"


@pytest.mark.slow
def test_three_replicas_4_4_2_llama():
    results = run_workers(exactness_worker, 10, LLAMA, 4, [4, 4, 2], [4, 4, 4, 4])
    assert max(max(w.values()) for w in results) < 1e-10


def test_query_heads_split_evenly_with_shared_kv_heads():
    """8 query heads / 4 KV heads over 3 ranks: 2/3/3 query heads (not whole groups 2/2/4), each rank with
    the KV heads its query heads read; over 7 ranks 32/8 heads give 4 or 5 query heads, never 8."""
    def split(nh, nkv, n):
        return [attention_head_intervals(nh, nkv, TPContext(rank=i, size=n)) for i in range(n)]

    assert split(8, 4, 3) == [((0, 2), (0, 1)), ((2, 5), (1, 3)), ((5, 8), (2, 4))]
    seven = split(32, 8, 7)
    assert sorted(hi - lo for (lo, hi), _ in seven) == [4, 4, 4, 5, 5, 5, 5]
    assert max(khi - klo for _, (klo, khi) in seven) == 2
    assert split(32, 8, 8) == [((4 * i, 4 * i + 4), (i, i + 1)) for i in range(8)]  # divisible: unchanged


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp3-uneven", "replicas-3-2", "per-layer-degraded"])
def test_uneven_query_heads_with_shared_kv_heads_match_unsharded(layout):
    tp, replica_tp, layer_tp = LAYOUTS[layout]
    layers = _layer_tp(tp, layer_tp)
    results = run_workers(exactness_worker, sum(replica_tp), LLAMA_KV4, tp, replica_tp, layers)
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"{layout} rank {rank}: {key} rel error {err:.2e}"


# ntp.shard_align=8 on GPT's 84 MLP columns and 67 vocabulary rows: shards of whole 8-element blocks
# (tests/topology/test_shard_align.py pins the sizes), the last one short.
ALIGNED = {
    "replicas-3-2": (3, [3, 2], None),
    "per-layer-degraded": (4, [4, 3], [4, 2, 4, 4]),
}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", list(ALIGNED))
def test_aligned_shards_match_unsharded(cfg, layout):
    tp, replica_tp, layer_tp = ALIGNED[layout]
    results = run_workers(exactness_worker, sum(replica_tp), cfg, tp, replica_tp, _layer_tp(tp, layer_tp), 8)
    for rank, worst in enumerate(results):
        for key, err in worst.items():
            assert err < 1e-10, f"{layout} aligned rank {rank}: {key} rel error {err:.2e}"
