"""plan_layout: always a valid layout, sensible choices at the extremes of the cost model, the CLI."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from ntp_nemo.cli.plan import run
from ntp_nemo.errors import ConfigError
from ntp_nemo.planner import (
    DeviceModel,
    LinkModel,
    ModelShape,
    parse_layer_tp,
    plan_layout,
    validate_layer_tp,
)

SLOW_LINKS = LinkModel(
    scale_up_gbps=1.0, scale_up_latency_us=700.0, scale_out_gbps=1.0, scale_out_latency_us=700.0
)
FAST_LINKS = LinkModel(scale_up_gbps=1e6, scale_up_latency_us=0.0)
SMALL = ModelShape(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256, seq_len=64)


def test_planner_never_returns_an_invalid_layout():
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        heads = rng.choice([2, 3, 4, 6, 8, 12, 16])
        kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        model = ModelShape(
            vocab_size=rng.choice([5, 50, 1000, 32000]),
            hidden_size=heads * rng.choice([8, 16, 64]),
            num_layers=rng.randint(1, 12),
            num_heads=heads,
            num_kv_heads=kv,
            ffn_hidden_size=rng.choice([3, 16, 4096]),
            gated_mlp=rng.random() < 0.5,
            tie_embeddings=rng.random() < 0.3,
        )
        tp = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
        replica_tp = [rng.randint(1, tp) for _ in range(rng.randint(1, 4))]
        links = rng.choice([SLOW_LINKS, FAST_LINKS, LinkModel()])
        pp = rng.randint(1, min(3, model.num_layers))
        limit = rng.choice([None, 0.001, 0.05, 10.0])
        try:
            plan = plan_layout(
                model, tp, replica_tp, rng.choice([16, 128, 2048]), rng.randint(1, 4), links, limit, pp=pp
            )
        except ConfigError as err:
            assert err.key == "memory_limit_gb" and limit is not None
            continue
        checked += 1
        validate_layer_tp(model, tp, replica_tp, plan.layer_tp)
        assert parse_layer_tp(plan.overrides()[0].split("=", 1)[1], model.num_layers, tp) == plan.layer_tp
        assert sum(plan.batch_shares) == pytest.approx(1.0)
        if limit is not None:
            assert max(plan.memory_gb) <= limit * (1 + 1e-9)
        # The trainer's shares: active ranks over the nominal degree, whatever the per-layer degrees.
        assert plan.batch_shares == pytest.approx([n / sum(replica_tp) for n in replica_tp])
    assert checked >= 30


def test_link_speed_drives_the_degree():
    slow = plan_layout(SMALL, 4, [4, 4], 64, 1, SLOW_LINKS)
    fast = plan_layout(SMALL, 4, [4, 4], 64, 1, FAST_LINKS)
    assert slow.layer_tp == [1] * 6  # all-reduces cost more than the compute they split
    assert fast.layer_tp[1:-1] == [4] * 4 and fast.layer_tp[-1] == 4


def test_memory_limit_forces_higher_degrees_and_fits():
    dev = DeviceModel(peak_tflops=1.0, efficiency=1.0)
    free = plan_layout(SMALL, 4, [4], 64, 1, SLOW_LINKS, device=dev)
    assert free.layer_tp == [1] * 6
    limit = 0.8 * max(free.memory_gb)
    tight = plan_layout(SMALL, 4, [4], 64, 1, SLOW_LINKS, limit, device=dev)
    assert max(tight.memory_gb) <= limit and tight.layer_tp != free.layer_tp
    assert tight.time_per_microbatch_s >= free.time_per_microbatch_s
    with pytest.raises(ConfigError, match="too small"):
        plan_layout(SMALL, 4, [4], 64, 1, SLOW_LINKS, 1e-6, device=dev)


def test_degraded_replica_gets_a_smaller_batch_share():
    plan = plan_layout(SMALL, 4, [4, 4, 3], 64, 2, FAST_LINKS)
    assert plan.batch_shares[0] == plan.batch_shares[1] > plan.batch_shares[2]
    assert plan.microbatch_time_s[2] > plan.microbatch_time_s[0]
    rows = {r.item: r for r in plan.table}
    assert rows["layer0"].effective_degree == 3  # table rows cost the smallest replica


def test_bad_inputs_are_config_errors():
    with pytest.raises(ConfigError, match="ntp.replica_tp"):
        plan_layout(SMALL, 4, [5], 64, 1)
    with pytest.raises(ConfigError, match="mesh.pp"):
        plan_layout(SMALL, 4, [4], 64, 1, pp=5)
    with pytest.raises(ConfigError, match="model.num_kv_heads"):
        ModelShape(vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3)


def test_ntp_plan_cli(capsys):
    assert (
        run(
            [
                "model=llama3_8b",
                "hardware=h100",
                "mesh.tp=8",
                "mesh.pp=1",
                "ntp.replica_tp=[8,8,7]",
                "recompute=false",
                "memory_limit_gb=80",
                "detail=true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "layer0-31" in out and "\"layout.layer_tp='1,8*32,8'\"" in out
    assert run(["model=llama3_8b", "mesh.tp=8", "mesh.pp=2", "format=json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layer_tp"]) == 34 and len(data["batch_shares"]) == 2
    exe = shutil.which("ntp-plan")
    cmd = [exe] if exe else [sys.executable, "-m", "ntp_nemo.cli.plan"]
    proc = subprocess.run(cmd + ["mesh.tp=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "mesh.tp" in proc.stderr and "Traceback" not in proc.stderr


def test_tied_embeddings_share_one_degree():
    tied = ModelShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, tie_embeddings=True)
    for links in (SLOW_LINKS, FAST_LINKS):
        plan = plan_layout(tied, 4, [4, 3], 64, 1, links)
        assert plan.layer_tp[0] == plan.layer_tp[-1]
    with pytest.raises(ConfigError, match="share their weights"):
        validate_layer_tp(tied, 4, [4], [1, 4, 4, 4])
