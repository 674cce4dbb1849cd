"""The parts of bench/gpu_check.py that need no GPU: device peaks, MFU, curve comparison, the run-dir
readers, and a clean exit without CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),  # the PCIe card: 1,671 TFLOPS sparse on NVIDIA's datasheet
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_bf16_peaks_by_device_name(name, peak):
    assert gpu_check.bf16_peak_tflops(name) == peak


def test_mfu_of_the_1b_llama_against_hand_computed_figures():
    from ntp_nemo.models import ModelConfig, flops_per_token, param_count

    cfg = ModelConfig(**gpu_check.LLAMA_1B)
    assert 1.1e9 < param_count(cfg) < 1.3e9  # "~1B": Llama-3.2-1B shapes, tied embeddings
    # By hand, h=2048, 32 heads of 64, 8 KV heads, FFN 8192, 16 layers, vocabulary 128256, s=2048:
    # per layer q,o 2*2048*2048 = 8,388,608 + k,v 2*2048*512 = 2,097,152 + MLP 3*2048*8192 =
    # 50,331,648 -> 60,817,408; x16 = 973,078,528; + head 128256*2048 = 262,668,288 -> 1,235,746,816
    # matmul parameters, x6 = 7,414,480,896; attention 12*16*2048*2048 = 805,306,368.
    assert flops_per_token(cfg, 2048) == 8_219_787_264
    # 40,000 tokens/s: 40,000 * 8,219,787,264 = 328.79 TFLOP/s; on an H200 SXM (989) 33.24%,
    # on an H200 NVL (835) 39.38%.
    assert gpu_check.mfu(40_000, 8_219_787_264, 989.0) == pytest.approx(0.33245, abs=1e-5)
    assert gpu_check.mfu(40_000, 8_219_787_264, 835.0) == pytest.approx(0.39376, abs=1e-5)


def test_curve_comparison_and_metrics_reader(tmp_path):
    rows = [{"step": 1, "loss": 5.0, "tokens_per_s": 10.0}, {"step": 2, "loss": 4.0, "tokens_per_s": 30.0},
            {"step": 2, "loss": 4.5, "tokens_per_s": 20.0}]  # step 2 redone: the last one counts
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_check.read_losses(tmp_path) == [5.0, 4.5]
    assert gpu_check.median_tokens_per_s(tmp_path, skip=1) == 25.0
    ok = gpu_check.compare_curves([5.0, 4.5], [5.0004, 4.5], 1e-4)
    assert ok["ok"] and ok["max_rel_diff"] == pytest.approx(0.0004 / 5.0004)
    assert not gpu_check.compare_curves([5.0, 4.6], [5.0, 4.5], 1e-2)["ok"]
    assert not gpu_check.compare_curves([5.0], [5.0, 4.5], 1.0)["ok"]  # a run that stopped early
    assert gpu_check.read_losses(tmp_path / "missing") == []


def test_without_cuda_it_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "no CUDA device visible" in proc.stdout, proc.stderr
