"""Row/column against block (SUMMA) sharding on the four measures: hand-computed numbers for small
matmuls, the model's matmul list, and `ntp-plan --patterns` for llama3_8b at TP 8 and TP 64."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_nemo.planner.patterns import (
    BLOCK,
    COLUMN,
    ROW,
    ROW_COLUMN,
    Matmul,
    block_cost,
    compare,
    grid_side,
    model_matmuls,
    row_column_cost,
    step_totals,
)
from ntp_nemo.planner.shapes import DeviceModel, ModelShape

REPO = Path(__file__).resolve().parents[2]
# 1e12 FLOP/s sustained, 2-byte activations, 16 bytes of state per parameter.
DEVICE = DeviceModel(name="toy", peak_tflops=1.0, efficiency=1.0, act_bytes=2, state_bytes_per_param=16)
BW = 1e9  # bytes/s


def test_grid_side() -> None:
    assert [grid_side(p) for p in (1, 4, 8, 9, 64)] == [1, 2, None, 3, 8]


def test_column_parallel_matmul_by_hand() -> None:
    # X [8 x 4] @ W [4 x 16] on p = 4 devices (q = 2), no latency.
    mm = Matmul("up", k=4, n=16, side=COLUMN)
    one = row_column_cost(mm, tokens=8, p=4, device=DEVICE, link_bw=BW, link_latency_s=0.0)
    # FLOPs: 6*8*4*16 / 4 = 768 per device -> 768e-12 s.
    assert one.flops == 768 and one.compute_s == pytest.approx(768e-12)
    # One all-reduce of X's gradient, 8*4 values of 2 bytes = 64 B; a ring moves 2*3/4*64 = 96 B.
    assert one.bytes_moved == pytest.approx(96.0)
    assert one.comm_s == one.exposed_comm_s == pytest.approx(96e-9)
    assert one.time_s == pytest.approx(96e-9 + 768e-12)
    # W: 4*16/4 = 16 parameters x 16 B = 256 B; the replicated input 8*4*2 = 64 B.
    assert one.memory_bytes == pytest.approx(320.0)
    assert (one.syncs, one.flops_per_sync) == (1, 768)

    two = block_cost(mm, tokens=8, p=4, device=DEVICE, link_bw=BW, link_latency_s=0.0)
    assert two is not None and two.pattern == BLOCK
    # A wide output (2n > 3k): W's outputs over grid columns, (q-1)(3mk + 3kn)/p elements received:
    # (3*8*4 + 3*4*16)/4 = 72 -> 144 B.
    assert mm.out_columns and two.bytes_moved == pytest.approx(144.0)
    assert two.comm_s == pytest.approx(144e-9)
    # Exposed: 144/2 ns for the first step + (1/2)*(144 - 0.768) ns not hidden by the block products.
    assert two.exposed_comm_s == pytest.approx(72e-9 + 71.616e-9)
    assert two.time_s == pytest.approx(144.384e-9)
    # W: 256 B as above; the input block 8*4/4 = 8 values x 2 B = 16 B.
    assert two.memory_bytes == pytest.approx(272.0)
    # 6 collectives per step (forward: X's and W's broadcasts; backward: both again, dX's and dW's
    # reductions) x 2 steps: 768 / 12 FLOPs between two.
    assert (two.syncs, two.flops_per_sync) == (12, 64)
    # The same shape as a tied head keeps the embedding's placement: (3*4*16 + 2*8*16)/4 = 112 -> 224 B.
    tied = block_cost(Matmul("head", k=4, n=16, side=COLUMN, tied=True), 8, 4, DEVICE, BW, 0.0)
    assert not Matmul("head", 4, 16, COLUMN, tied=True).out_columns
    assert tied.bytes_moved == pytest.approx(224.0)
    assert tied.syncs == 10


def test_row_parallel_matmul_and_latency_by_hand() -> None:
    # X [8 x 16] @ W [16 x 8] row-parallel on 4 devices, 1 us per hop.
    mm = Matmul("down", k=16, n=8, side=ROW)
    one = row_column_cost(mm, tokens=8, p=4, device=DEVICE, link_bw=BW, link_latency_s=1e-6)
    # The forward all-reduce of Y: 8*8*2 = 128 B, ring 2*3/4*128 = 192 B in 2*3 hops of 1 us.
    assert one.bytes_moved == pytest.approx(192.0)
    assert one.comm_s == pytest.approx(6e-6 + 192e-9)
    # W 16*8/4 = 32 params x 16 B = 512 B; the sharded input 8*16/4 values x 2 B = 64 B.
    assert one.memory_bytes == pytest.approx(576.0)
    assert one.flops == 6 * 8 * 16 * 8 / 4 == 1536
    two = block_cost(mm, tokens=8, p=4, device=DEVICE, link_bw=BW, link_latency_s=1e-6)
    # Not wide (2n < 3k): (3*16*8 + 2*8*8)/4 = 128 elements = 256 B; 5 streams of collectives x 1 hop.
    assert two.bytes_moved == pytest.approx(256.0)
    assert two.comm_s == pytest.approx(5e-6 + 256e-9)


def test_block_moves_fewer_bytes_for_many_tokens_on_a_large_grid() -> None:
    # X [64 x 8] @ W [8 x 8] on 16 devices (q = 4): 3kn + 2mn = 1216 < 2 (q + 1) m k = 5120.
    mm = Matmul("square", k=8, n=8, side=COLUMN)
    one = row_column_cost(mm, tokens=64, p=16, device=DEVICE, link_bw=BW, link_latency_s=0.0)
    two = block_cost(mm, tokens=64, p=16, device=DEVICE, link_bw=BW, link_latency_s=0.0)
    assert one.bytes_moved == pytest.approx(2 * 15 / 16 * 64 * 8 * 2)  # 1920 B
    assert two.bytes_moved == pytest.approx(3 * (3 * 64 + 2 * 512) / 16 * 2)  # 456 B
    assert two.bytes_moved < one.bytes_moved
    # On a 2 x 2 grid with 8 tokens block moves 160 B ((3*64 + 2*64)/4 values x 2 B) against 1D's 192 B
    # (2*3/4*8*8*2); with 4 tokens 3kn + 2mn = 256 > 2 (q + 1) m k = 192: block moves more.
    assert block_cost(mm, 8, 4, DEVICE, BW, 0.0).bytes_moved == pytest.approx(160.0)
    assert row_column_cost(mm, 8, 4, DEVICE, BW, 0.0).bytes_moved == pytest.approx(192.0)
    assert block_cost(mm, 4, 4, DEVICE, BW, 0.0).bytes_moved == pytest.approx((3 * 64 + 2 * 32) / 4 * 2)
    assert row_column_cost(mm, 4, 4, DEVICE, BW, 0.0).bytes_moved == pytest.approx(96.0)


def test_no_block_sharding_without_a_square_grid() -> None:
    mm = Matmul("up", k=4, n=16, side=COLUMN)
    assert block_cost(mm, 8, 8, DEVICE, BW, 0.0) is None
    model = ModelShape(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2)
    assert step_totals(compare(model, 8, 8, DEVICE, BW, 0.0)) is None


def test_model_matmuls_and_step_totals() -> None:
    model = ModelShape(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                       ffn_hidden_size=16, gated_mlp=True)
    got = [(m.name, m.k, m.n, m.side, m.count) for m in model_matmuls(model)]
    assert got == [("qkv", 8, 8 + 2 * 4, COLUMN, 2), ("attn out", 8, 8, ROW, 2), ("mlp up", 8, 32, COLUMN, 2),
                   ("mlp down", 16, 8, ROW, 2), ("head", 8, 100, COLUMN, 1)]
    totals = step_totals(compare(model, 8, 4, DEVICE, BW, 0.0))
    # 1D: every matmul all-reduces 8 tokens x hidden 8 x 2 B = 128 B, a ring moves 192 B; 9 matmuls a step.
    assert totals[ROW_COLUMN]["bytes_moved"] == pytest.approx(9 * 192.0)
    # FLOPs per device: 6*8*(8*16 + 8*8 + 8*32 + 16*8)*2/4 + 6*8*8*100/4 = 13824 + 9600, over 9 collectives.
    assert totals[ROW_COLUMN]["flops_per_sync"] == pytest.approx((13824 + 9600) / 9)
    # qkv (n = 16 > 1.5 k), mlp up and the head put W's outputs over grid columns: 6 q collectives each,
    # attn out and mlp down 5 q: 2 * (12 + 10 + 12 + 10) + 12 over a step.
    assert totals[BLOCK]["flops_per_sync"] == pytest.approx((13824 + 9600) / 100)


def _ntp_plan(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "ntp_nemo.cli.plan", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_ntp_plan_patterns_llama3_8b_tp64() -> None:
    proc = _ntp_plan("model=llama3_8b", "hardware=h100", "mesh.tp=64", "--patterns", "format=json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["degree"], data["grid_side"], data["tokens"]) == (64, 8, 8192)
    qkv = data["matmuls"][0]
    # By hand: 1D all-reduces 8192 x 4096 bf16 values: 2*63/64*8192*4096*2 B; block on the 8 x 8 grid
    # receives 7*(3*4096*6144 + 2*8192*6144)/64 values of 2 B.
    assert qkv["row_column"]["bytes_moved"] == pytest.approx(2 * 63 / 64 * 8192 * 4096 * 2)
    values = 7 * (3 * 4096 * 6144 + 2 * 8192 * 6144) / 64
    assert qkv["block"]["bytes_moved"] == pytest.approx(values * 2)
    assert qkv["block"]["syncs"] == 40
    # Per slot: the 32 layers on the grid (1.26 ms against 4.07 ms) and the untied head (its outputs over
    # grid columns: 1.14 against 1.83 ms), the untied embedding with the first layer.
    assert data["recommended_pattern"] == ["block"] * 34
    table = _ntp_plan("model=llama3_8b", "hardware=h100", "mesh.tp=64", "--patterns")
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "8x8 grid" in out
    assert "speed at 450 GB/s (scale-up)" in out and "speed at 50 GB/s (scale-out)" in out
    for measure in ("bytes moved per device", "memory per device", "work between collectives"):
        assert measure in out
    assert "matmuls where block moves fewer bytes: qkv, attn out, mlp up, mlp down" in out
    assert "where block sharding wins" in out and " 64  8x8" in out
    assert "recommended: ntp.pattern=block (per slot" in out


def test_ntp_plan_patterns_llama3_8b_tp8_and_bad_degree() -> None:
    proc = _ntp_plan("model=llama3_8b", "hardware=h100", "mesh.tp=8", "--patterns")
    assert proc.returncode == 0, proc.stderr
    assert "8 is not a square" in proc.stdout and "row/column (column)" in proc.stdout
    assert "where block sharding wins" in proc.stdout and "  9  3x3" in proc.stdout
    assert "recommended: ntp.pattern=row_column (" in proc.stdout and "no square grid" in proc.stdout
    bad = _ntp_plan("model=llama3_8b", "mesh.tp=1", "--patterns")
    assert bad.returncode == 2 and "mesh.tp" in bad.stderr and "Traceback" not in bad.stderr


def test_recommended_patterns_per_slot() -> None:
    """A layer goes on the grid where its four matmuls are modelled faster there, the head by its own
    matmul; a tied embedding follows the head, an untied one the first layer; no grid, no block.  A tied
    head keeps the embedding's placement (vocabulary over grid rows), whose 2mn term loses at TP 64."""
    from ntp_nemo.planner.patterns import recommend_patterns

    for tied in (False, True):
        model = ModelShape(vocab_size=128256, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                           ffn_hidden_size=14336, gated_mlp=True, tie_embeddings=tied)
        chosen, ms = recommend_patterns(compare(model, 8192, 64, DeviceModel(), 450e9, 5e-6), model)
        assert ms[BLOCK]["layer"] < ms[ROW_COLUMN]["layer"]
        assert (ms[BLOCK]["head"] > ms[ROW_COLUMN]["head"]) == tied
        assert chosen == (("row_column", "block", "block", "row_column") if tied else ("block",) * 4)
    assert recommend_patterns(compare(model, 8192, 8, DeviceModel(), 450e9, 5e-6), model)[0] == (
        "row_column",) * 4
