"""layout.layer_tp: pattern parsing, validity rules and effective degrees in shrunk replicas."""

from __future__ import annotations

import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.planner import ModelShape, effective_degree, parse_layer_tp, validate_layer_tp
from ntp_nemo.planner.cost import EMBEDDING, HEAD, LAYER, attention_fractions, item_cost, shard_fraction
from ntp_nemo.planner.shapes import DeviceModel, LinkModel

MODEL = ModelShape(
    vocab_size=96, hidden_size=64, num_layers=6, num_heads=8, num_kv_heads=4, ffn_hidden_size=256
)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (None, [4] * 8),
        (2, [2] * 8),
        ("4", [4] * 8),
        ("emb=2,layers=4,head=1", [2] + [4] * 6 + [1]),
        ("layers=2", [4] + [2] * 6 + [4]),
        ("2,4*6,2", [2] + [4] * 6 + [2]),
        ("1, 2*3, 4*3, 1", [1, 2, 2, 2, 4, 4, 4, 1]),
        ("[1,2,2,2,4,4,4,1]", [1, 2, 2, 2, 4, 4, 4, 1]),
        ([1, 2, 2, 2, 4, 4, 4, 1], [1, 2, 2, 2, 4, 4, 4, 1]),
    ],
)
def test_parse_layer_tp_forms(spec, expected):
    assert parse_layer_tp(spec, num_layers=6, tp=4) == expected


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("3", "divisors of mesh.tp=4"),
        ("2,4*5,2", "gives 7 degrees"),
        ([4] * 9, "gives 9 degrees"),
        ("emb=2,mlp=4", "bad part"),
        ("2,x,2", "bad part"),
        ("auto", "planner"),
        ("", "empty"),
        (8, "divisors"),
        ([4, "a", 4, 4, 4, 4, 4, 4], "not an integer"),
        (True, "expected degrees"),
    ],
)
def test_parse_layer_tp_rejects_bad_specs(spec, fragment):
    with pytest.raises(ConfigError) as err:
        parse_layer_tp(spec, num_layers=6, tp=4)
    assert err.value.key == "layout.layer_tp" and fragment in str(err.value)


def test_effective_degree_rule():
    assert effective_degree(4, 8) == 4  # divides: unchanged
    assert effective_degree(4, 6) == 3  # largest divisor of 6 not above 4
    assert effective_degree(8, 7) == 7
    assert effective_degree(4, 7) == 1
    assert effective_degree(2, 5) == 1
    for n in range(1, 17):
        for t in (1, 2, 4, 8, 16):
            e = effective_degree(t, n)
            assert n % e == 0 and 1 <= e <= t


def test_validate_layer_tp_rules():
    validate_layer_tp(MODEL, 4, [4, 3], [4, 4, 2, 1, 4, 4, 4, 2])
    validate_layer_tp(MODEL, 8, [8], [8] * 8)  # 8 query heads over 4 KV heads: KV heads replicated
    with pytest.raises(ConfigError, match="layer0 has degree 16 but only 8 attention heads"):
        validate_layer_tp(MODEL, 16, [16], [16] + [16] * 6 + [16])
    with pytest.raises(ConfigError, match="divisors of mesh.tp=4"):
        validate_layer_tp(MODEL, 4, [4], [4, 3, 4, 4, 4, 4, 4, 4])
    with pytest.raises(ConfigError, match="needs 8"):
        validate_layer_tp(MODEL, 4, [4], [4] * 7)
    with pytest.raises(ConfigError) as err:
        validate_layer_tp(MODEL, 4, [5], [4] * 8)
    assert err.value.key == "ntp.replica_tp"
    small_vocab = ModelShape(vocab_size=3, hidden_size=64, num_layers=1, num_heads=8)
    with pytest.raises(ConfigError, match="embedding has degree 4 but only 3 vocabulary rows"):
        validate_layer_tp(small_vocab, 4, [4], [4, 4, 4])


def test_cost_model_counts_the_documented_collectives():
    dev, links = DeviceModel(act_bytes=2), LinkModel()
    b, s, h = 2, 32, MODEL.hidden_size
    act = b * s * h * 2
    layer = item_cost(MODEL, LAYER, 4, s, b, dev, links)
    assert layer.num_allreduces == 4 and layer.comm_bytes == 4 * act
    emb = item_cost(MODEL, EMBEDDING, 4, s, b, dev, links)
    assert emb.num_allreduces == 1 and emb.comm_bytes == act and emb.flops == 0
    head = item_cost(MODEL, HEAD, 4, s, b, dev, links)
    assert head.num_allreduces == 3 and head.comm_bytes == act + 3 * b * s * 4
    assert head.flops == 3 * 2 * b * s * h * MODEL.vocab_size * shard_fraction(96, 4)
    for kind in (EMBEDDING, LAYER, HEAD):
        solo = item_cost(MODEL, kind, 1, s, b, dev, links)
        assert solo.comm_bytes == 0 and solo.comm_s == 0
    # uneven shards: query heads split 2/3/3 over 3 ranks (not whole GQA groups 1/1/2, which would give one
    # rank 4 of 8 query heads); ranks 1 and 2 read 2 of the 4 KV heads each (KV heads 1 and 2 are shared)
    assert shard_fraction(4, 3) == 0.5 and attention_fractions(MODEL, 3) == (3 / 8, 2 / 4)
    assert attention_fractions(MODEL, 4) == (2 / 8, 1 / 4)
    # a rank keeps every KV head its query heads read
    assert attention_fractions(MODEL, 8) == (1 / 8, 1 / 4)
    assert attention_fractions(MODEL, 6) == (2 / 8, 1 / 4)
    assert attention_fractions(MODEL, 5) == (2 / 8, 2 / 4)
    assert (
        item_cost(MODEL, LAYER, 3, s, b, dev, links).flops
        > item_cost(MODEL, LAYER, 4, s, b, dev, links).flops
    )
