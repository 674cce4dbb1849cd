"""The parts of bench/gpu_check.py that need no GPU: device peaks, MFU, curve comparison, the run-dir
readers, and a clean exit without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu_check
from tests.conftest import ROOT


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


def test_every_part_composes_children_that_fit_one_gpu_and_no_cluster_launch(monkeypatch, tmp_path):
    """Run inside an allocation (SLURM_*/torchrun variables set), every part's children are composed
    without starting them: each GPU child's layout fits one GPU (world 1, or ranks sharing cuda:0 over
    gloo), no child inherits the launcher's variables, and the rehearsal runs the same children on CPU."""
    for k, v in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    started = []

    def start(cmd, **kwargs):
        started.append((cmd, kwargs["env"]))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", start)
    commands = {}
    for rehearse in (False, True):
        plan = gpu_check.Plan(rehearse, visible=1)
        before = len(started)
        gpu_check.part_default(tmp_path, 3, plan)
        gpu_check.part_ntp(tmp_path, 3, plan)
        gpu_check.part_ckpt(tmp_path, 3, plan)
        gpu_check.part_llama(tmp_path, None, 8, 2048, plan)
        assert plan.problems == []
        commands[rehearse] = [cmd for cmd, _ in started[before:]]
    # default: GPU + CPU runs and the backend check; ntp: 2 layouts x 2 precisions; ckpt: 3; llama: 2.
    assert len(commands[False]) == len(commands[True]) == 3 + 4 + 3 + 2
    for cmd, env in started:
        assert not [k for k in env if k.startswith("SLURM_") or k in gpu_check.LAUNCHER_VARS], cmd
    for cmd in commands[False]:
        if "ntp_nemo.train" in cmd and ("trainer=gpu" in cmd or "trainer.accelerator=gpu" in cmd):
            assert gpu_check.layout_world(cmd[3:]) == 1, cmd
    for gpu_cmd, cpu_cmd in zip(commands[False], commands[True], strict=True):  # same children, on CPU
        if "ntp_nemo.train" not in gpu_cmd:
            assert cpu_cmd[:3] == gpu_cmd[:3] and cpu_cmd[-1] == "--rehearse"
        elif "trainer=gpu" in gpu_cmd or "trainer.accelerator=gpu" in gpu_cmd:  # smaller, on the CPU
            sizes = gpu_check.REHEARSAL_SIZES
            assert cpu_cmd == [*gpu_cmd[:-1], *sizes, "trainer.accelerator=cpu", gpu_cmd[-1]]
        else:
            assert cpu_cmd == [*gpu_cmd[:-1], *gpu_check.REHEARSAL_SIZES, gpu_cmd[-1]]


def test_a_layout_that_does_not_fit_the_visible_gpus_is_refused_before_it_starts():
    # What issue 23 found: the default recipe's (2,1), three ranks on their own GPUs, on one GPU.
    assert gpu_check.layout_world([*gpu_check.tiny_overrides(3), "trainer=gpu"]) == 3
    assert "cuda:1,2" in gpu_check.mapping_problem(3, None, None, visible=1)
    assert gpu_check.mapping_problem(3, [0, 0, 0], "gloo", visible=1) is None  # the ntp part's sharing
    assert "NCCL" in gpu_check.mapping_problem(3, [0, 0, 0], "cpu:gloo,cuda:nccl", visible=1)
    assert gpu_check.mapping_problem(1, None, None, visible=1) is None


def test_rehearsal_of_the_llama_part_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--rehearse", "--only", "llama",
           "--keep", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "gpu_check rehearsal: 1/1 parts ok"
    for precision in ("bf16-true", "bf16-mixed"):
        res = json.loads((tmp_path / f"llama_{precision}.json").read_text())
        assert res["device"] == "cpu (rehearsal)" and res["final_loss"] > 0
