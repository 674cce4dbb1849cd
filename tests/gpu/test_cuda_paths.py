"""The CUDA path on a real GPU (skipped without one): each test runs one part of bench/gpu_check.py
in child processes (this process never initialises CUDA) and checks its verdict and numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ntp_nemo.launch.devices import cuda_device_count
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU (run bench/gpu_check.py on one)"),
]


def gpu_check(part: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--only", part, "--json", str(out),
         "--keep", str(tmp_path / "runs"), *extra],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())[part]


def test_default_recipe_on_cuda0_tracks_the_cpu_curve(tmp_path):
    r = gpu_check("default", tmp_path)
    assert r["rc"] == [0, 0] and r["gpu_bf16_vs_cpu_fp32"]["ok"], r
    assert r["final_loss"] < r["first_loss"]


def test_ntp_layout_sharing_one_gpu_matches_one_process(tmp_path):
    r = gpu_check("ntp", tmp_path)
    assert r["32-true"]["ok"] and r["bf16-mixed"]["ok"], r


def test_checkpoint_saved_on_gpu_resumes_on_cpu(tmp_path):
    r = gpu_check("ckpt", tmp_path)
    assert r["saved_on_gpu_rc"] == 0 and r["resumed"] == {"cpu": True, "gpu": True}, r
    assert r["resume_cpu_vs_gpu"]["ok"], r


def test_llama_1b_bf16_trains(tmp_path):
    r = gpu_check("llama", tmp_path, "--llama-micro-batch", "2", "--llama-seq", "1024")
    for precision in ("bf16-true", "bf16-mixed"):
        assert r[precision]["tokens_per_s"] > 0 and r[precision]["final_loss"] > 0, r
