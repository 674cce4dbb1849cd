"""Sharding rules of quantizer state: amax ShardSpecs and block-format alignment with shard boundaries."""

from __future__ import annotations

import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.quant.sharding import TensorSharding, amax_spec, split_block
from ntp_nemo.topology.shard import ShardSpec
from ntp_nemo.topology.tp_context import TPContext


def test_amax_spec_follows_channel_sharding():
    """Per-channel amax of a column-parallel weight is split like its rows; reduced dims are whole."""
    rows = TensorSharding(dim=0, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((4, 1), 0, rows, is_global=False) == ShardSpec((10, 1), 0, 2, 1, 3)
    assert amax_spec((10, 1), 0, rows, is_global=True).local_shape == (4, 1)
    assert amax_spec((), None, rows, is_global=False).is_full
    cols = TensorSharding(dim=1, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((6, 1), 0, cols, is_global=False) == ShardSpec.full((6, 1))
    last = TensorSharding(dim=-1, size=10, unit_size=2, lo=1, hi=3)
    assert amax_spec((1, 1, 4), -1, last, is_global=False) == ShardSpec((1, 1, 10), 2, 2, 1, 3)
    assert amax_spec((4,), None, None, is_global=False) == ShardSpec.full((4,))
    with pytest.raises(ValueError):
        amax_spec((5, 1), 0, rows, is_global=False)


def test_split_block_finds_boundaries_inside_blocks():
    nvfp4 = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
    # Columns [32, 64) of 96 along the blocked (last) dim: whole blocks.
    assert split_block(TensorSharding(1, 96, 16, 2, 4), nvfp4, 2) is None
    # Columns [8, 16) of 40: the boundary at 8 cuts the first block.
    assert split_block(TensorSharding(1, 40, 8, 1, 2), nvfp4, 2) == 16
    # The last shard may end on a partial block at the end of the tensor.
    assert split_block(TensorSharding(-1, 40, 8, 2, 5), nvfp4, 3) is None
    # Rows are not the blocked dim; whole tensors and block-free formats are always fine.
    assert split_block(TensorSharding(0, 40, 8, 1, 2), nvfp4, 2) is None
    assert split_block(None, nvfp4, 2) is None
    assert split_block(TensorSharding(1, 40, 8, 1, 2), None, 2) is None


class _Rank0Of2:
    def context(self, slot: int) -> TPContext:
        return TPContext(size=2, rank=0)


@pytest.mark.slow  # imports modelopt (~10 s) for its NVFP4 preset
@pytest.mark.parametrize(("head_dim", "heads", "ok"), [(16, 4, True), (8, 6, False)])
def test_nvfp4_refuses_layouts_whose_shards_cut_blocks(head_dim, heads, ok):
    from ntp_nemo.models import DecoderLM
    from ntp_nemo.quant.calibrate import check_block_alignment
    from ntp_nemo.quant.qat_config import modelopt_config

    cfg = ModelConfig(hidden_size=heads * head_dim, num_heads=heads, num_layers=1, ffn_hidden_size=128,
                      vocab_size=64, max_seq_len=16)
    model = DecoderLM(cfg, _Rank0Of2())  # rank 0 of TP 2: o_proj holds columns [0, heads/2 * head_dim)
    config = modelopt_config("nvfp4", ["head"])
    if ok:
        check_block_alignment(model, "nvfp4", config)
    else:
        with pytest.raises(ConfigError, match="attn.o_proj") as err:
            check_block_alignment(model, "nvfp4", config)
        assert err.value.key == "quant.format"
    check_block_alignment(model, "int8", modelopt_config("int8", ["head"]))  # no blocks: any layout
