"""`ntp.shard_align`: MLP-column and vocabulary-row shards of whole aligned blocks (sizes worked out by
hand here), attention heads untouched, and a clear config error where no layout fits."""

from __future__ import annotations

import pytest

from ntp_nemo.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ntp_nemo.topology.shard import aligned_interval, aligned_sizes
from ntp_nemo.topology.tp_context import TPContext
from tests.conftest import TINY, run_cli


@pytest.mark.parametrize("n,units,align,sizes", [
    (3, 84, 8, [24, 32, 28]),  # 11 blocks (the last of 4): 3, 4, 4 blocks
    (2, 84, 8, [40, 44]),  # 5, 6 blocks
    (4, 84, 8, [16, 24, 24, 20]),  # 2, 3, 3, 3 blocks
    (3, 67, 8, [24, 24, 19]),  # 9 blocks (the last of 3): 3, 3, 3
    (2, 67, 8, [32, 35]),
    (3, 84, 1, [28, 28, 28]),  # no alignment: balanced to the row
    (8, 14336, 128, [1792] * 8),  # Llama 3 8B MLP: 112 blocks
    (7, 14336, 128, [2048] * 7),
    (8, 128256, 128, [16000, 16000, 16000, 16128] * 2),  # 1002 blocks: 125, 125, 125, 126 twice
    (7, 128256, 128, [18304] * 6 + [18432]),  # 143 x 6, 144
])
def test_aligned_sizes(n, units, align, sizes):
    assert aligned_sizes(n, units, align) == sizes
    bounds = [aligned_interval(i, n, units, align) for i in range(n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == units
    assert all(a[1] == b[0] and a[1] % align == 0 for a, b in zip(bounds, bounds[1:], strict=False))


def test_layers_shard_one_element_units_on_aligned_boundaries():
    for rank, (rows, vocab) in enumerate(zip([24, 32, 28], [24, 24, 19], strict=True)):
        tp = TPContext(size=3, rank=rank, align=8)
        assert ColumnParallelLinear(40, 84, tp).weight.shape == (rows, 40)
        assert RowParallelLinear(84, 40, tp).weight.shape == (40, rows)
        emb = VocabParallelEmbedding(67, 40, tp)
        assert emb.weight.shape == (vocab, 40) and emb.vocab_start == 24 * rank
        # Units of several elements (attention heads of 8) stay whole heads, balanced over heads: 1, 2, 2.
        assert ColumnParallelLinear(40, 40, tp, unit_size=8).weight.shape[0] == 8 * [1, 2, 2][rank]


@pytest.mark.parametrize("overrides,needle", [
    (["ntp.shard_align=64", "mesh.dp=1", "mesh.tp=4", "ntp.replica_tp=null"],
     "into 2 blocks of 64, fewer than the 4 ranks"),
    (["ntp.shard_align=0"], "whole number of elements >= 1"),
])
def test_impossible_alignment_exits_2_before_launch(tmp_path, overrides, needle):
    proc = run_cli([*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ntp.shard_align" in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_layout_carries_the_alignment_to_every_rank():
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.config.validate import validate
    from ntp_nemo.topology import ResolvedLayout
    from tests.conftest import compose

    assert compose(["recipe=llama3_8b"]).ntp.shard_align == 128  # GPU recipes align for tensor cores
    assert compose(["recipe=gpt2_124m"]).ntp.shard_align == 128
    cfg = compose(["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "ntp.shard_align=16"])
    validate(cfg)
    layout = resolve_layout(cfg)
    assert layout.shard_align == 16
    assert ResolvedLayout.from_dict(layout.to_dict()).shard_align == 16  # checkpoint manifests, live launch
    assert layout.with_changes(replica_tp=(2, 2)).shard_align == 16  # failover re-planning
    assert layout.topology().shard_align == 16
