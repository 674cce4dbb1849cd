"""The parts of bench/gpu_check.py that need no GPU: device peaks, MFU, curve comparison, the run-dir
readers, and a clean exit without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
        if "--worker-size" in cmd:  # the llama part's sizing child (CPU only): what it writes
            sized = {"micro_batch": 7, "total_bytes": 56.8e9, "free_fraction_of_80gb": 0.29}
            Path(cmd[cmd.index("--worker-size") + 1]).write_text(json.dumps(
                {"bf16-true": sized, "bf16-mixed": sized}))
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
    # default: GPU + CPU runs and the backend check; ntp: 2 layouts x 2 precisions; ckpt: 3; llama: the
    # sizing and 2 runs.
    assert len(commands[False]) == len(commands[True]) == 3 + 4 + 3 + 3
    llama = [cmd for cmd in commands[False] if "--worker-llama" in cmd]
    assert [cmd[cmd.index("--worker-llama") + 3] for cmd in llama] == ["7", "7"]  # the sized micro-batch
    for cmd, env in started:
        assert not [k for k in env if k.startswith("SLURM_") or k in gpu_check.LAUNCHER_VARS], cmd
    for cmd in commands[False]:
        if "ntp_nemo.train" in cmd and ("trainer=gpu" in cmd or "trainer.accelerator=gpu" in cmd):
            assert gpu_check.layout_world(cmd[3:]) == 1, cmd
    for gpu_cmd, cpu_cmd in zip(commands[False], commands[True], strict=True):  # same children, on CPU
        if "--worker-size" in gpu_cmd:  # on the CPU in both
            assert cpu_cmd == gpu_cmd
        elif "--worker-llama" in gpu_cmd:  # the one-layer cut at micro-batch 1 on the CPU
            assert cpu_cmd[:4] == gpu_cmd[:4] and cpu_cmd[-1] == "--rehearse"
        elif "ntp_nemo.train" not in gpu_cmd:
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
    sizes = json.loads((tmp_path / "llama_size.json").read_text())
    for precision in ("bf16-true", "bf16-mixed"):
        res = json.loads((tmp_path / f"llama_{precision}.json").read_text())
        assert res["device"] == "cpu (rehearsal)" and res["final_loss"] > 0
        # sized on the 1.2B shape by the dry run's estimate: a quarter of an 80 GB GPU left free
        assert sizes[precision]["free_fraction_of_80gb"] >= 0.25 and sizes[precision]["micro_batch"] >= 1
    assert sizes["bf16-true"]["micro_batch"] == 8  # 49 GB
    assert sizes["bf16-mixed"]["micro_batch"] == 7  # 8 would need 62 GB, 23% free


def test_a_second_try_runs_only_the_parts_that_did_not_pass(monkeypatch, tmp_path, capsys):
    """Each part independent: one that raises fails alone; the summary lists the parts passed, and
    `--keep DIR --rest` runs only the others."""
    ran = []

    def part(name, ok):
        def fn(*args, **kwargs):
            ran.append(name)
            if ok is None:
                raise RuntimeError("boom")
            return {"ok": ok}
        return fn

    monkeypatch.setattr(gpu_check, "part_devices", part("devices", True))
    monkeypatch.setattr(gpu_check, "part_default", part("default", None))
    monkeypatch.setattr(gpu_check, "part_ntp", part("ntp", False))
    argv = ["gpu_check.py", "--rehearse", "--keep", str(tmp_path), "--only", "devices,default,ntp"]
    monkeypatch.setattr(sys, "argv", argv)
    assert gpu_check.main() == 1 and ran == ["devices", "default", "ntp"]
    summary = json.loads((tmp_path / gpu_check.SUMMARY).read_text())
    assert summary == {"passed": ["devices"], "failed": ["default", "ntp"]}
    assert "--rest" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "part_default", part("default", True))
    monkeypatch.setattr(sys, "argv", [*argv, "--rest"])
    ran.clear()
    assert gpu_check.main() == 1 and ran == ["default", "ntp"]
    assert json.loads((tmp_path / gpu_check.SUMMARY).read_text())["passed"] == ["devices", "default"]


@pytest.mark.parametrize(("part", "world"), [("tp2", 3), ("tp2_compiled", 3), ("pp2", 2), ("live", 3)])
def test_multi_gpu_parts_are_valid_runs_with_each_rank_on_its_own_gpu(part, world):
    """`--multi`: each part's command is a valid `ntp-train` config (the checks a run makes before it
    starts), each rank on its own GPU over NCCL, within the GPUs a multi part may use."""
    from ntp_nemo.train import check_config
    from tests.conftest import compose

    overrides = gpu_check.multi_overrides(part, 4)
    rehearsed = gpu_check.Plan(True, 3).accel(gpu_check.Plan(True, 3).sizes(overrides))  # no CUDA here
    spec = check_config(compose(rehearsed), {o.split("=")[0] for o in rehearsed})
    assert gpu_check.layout_world(overrides) == world <= gpu_check.MULTI_GPUS
    assert gpu_check.mapping_problem(world, None, None, visible=gpu_check.MULTI_GPUS) is None
    assert spec is not None


def test_the_multi_parts_cover_the_gpu_features_the_review_listed():
    """Issue 53: NCCL with TP > 1, compiled blocks, tp_overlap, tp_chunks, SP, the overlapped sync, the
    distributed optimizer, PP, and a live recovery."""
    every = [o for overrides in gpu_check.MULTI.values() for o in overrides]
    for wanted in ("mesh.tp=2", "trainer.compile=true", "ntp.tp_overlap=true", "ntp.tp_chunks=2",
                   "ntp.sequence_parallel=true", "ntp.overlap_grad_sync=true", "optim.distributed=true",
                   "mesh.pp=2", "fault.recovery=live"):
        assert wanted in every, wanted


def test_the_single_gpu_estimate_is_at_most_seven_minutes_and_printed(monkeypatch, tmp_path, capsys):
    assert gpu_check.estimate_s(gpu_check.PARTS) <= 7 * 60
    for name in (*gpu_check.PARTS, "multi"):  # every part passes at once: only the printing is checked
        monkeypatch.setattr(gpu_check, f"part_{name}", lambda *a, **k: {"ok": True})
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--rehearse", "--keep", str(tmp_path)])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    minutes = gpu_check.estimate_s(gpu_check.PARTS) / 60
    assert f"estimate on one H100-class GPU (by reading, not timed on a GPU yet): {minutes:.1f} min" in out
    # the rehearsal runs the part list of a `--multi` GPU run: every single-GPU and multi-GPU part
    ran = json.loads((tmp_path / gpu_check.SUMMARY).read_text())["passed"]
    assert ran == [*gpu_check.PARTS, *gpu_check.MULTI]
    assert out.strip().splitlines()[-1] == f"gpu_check rehearsal: {len(ran)}/{len(ran)} parts ok"
