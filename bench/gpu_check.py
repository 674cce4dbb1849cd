"""GPU checks of the CUDA path, in one command that fits in about 5 minutes on one GPU:

    python bench/gpu_check.py [--steps 20] [--only default,ntp,ckpt,llama] [--json gpu_check.json]

1. `default`: the default recipe (gpt_tiny) through the real `ntp-train` CLI on cuda:0 (world 1,
   `trainer=gpu`: bf16-mixed), against the same run on CPU in float32 (bf16 tolerance); and the GPU
   runs' process-group backend `cpu:gloo,cuda:nccl` on the one GPU (a world-1 group: an NCCL
   all-reduce of a CUDA tensor and a gloo object all-gather; a world-1 run itself needs no group).
2. `ntp`: an NTP layout (2,1) of three processes sharing cuda:0 over gloo with CUDA tensors, against
   the single-process curve on cuda:0, in float32 and in bf16-mixed.  (NCCL refuses two ranks on one
   GPU, so the collectives run over gloo here; on several GPUs the default is `cpu:gloo,cuda:nccl`.)
3. `ckpt`: a checkpoint saved by a float32 run on cuda:0, resumed on CPU and on the GPU: the next
   steps' losses agree.
4. `llama`: training throughput of a ~1.2B-parameter Llama (Llama-3.2-1B shapes: hidden 2048, 16
   layers, 32 heads / 8 KV heads, FFN 8192, vocabulary 128256, tied embeddings) on ntp_nemo's model
   code, bf16 weights with fused AdamW (`bf16-true`) and fp32 weights under bf16 autocast
   (`bf16-mixed`): tokens/s and MFU = tokens/s x training FLOPs per token / the device's dense bf16
   peak (H100/H200 SXM 989 TFLOPS, H100/H200 NVL 835, A100 312; `--peak-tflops` for others).

The launching process never initialises CUDA (devices are counted through NVML): every part runs in
child processes, which bind their own device.  Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("default", "ntp", "ckpt", "llama")

# Dense (no sparsity) bf16 tensor-core peaks, TFLOPS, by device-name fragment (first match wins).
# NVIDIA's datasheets give the peaks with 2:4 sparsity; dense is half: H200/H100 SXM 1,979 -> 989.5,
# H200 NVL and H100 NVL 1,671 -> 835.5, H100 PCIe 1,513 -> 756.5.  The NVL (PCIe) cards run at a
# lower power and clock than SXM: their names are matched before the bare "H200"/"H100".
BF16_PEAK_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)

# Tolerances (relative, per step) of the curve comparisons.
FP32_RTOL = 1e-4  # same float32 math in another order (TP partial sums, gloo all-reduce)
BF16_RTOL = 3e-2  # bf16 compute against float32 or against another layout's bf16 rounding

QUIET = [
    "trainer.val_every_n_steps=1000000",
    "trainer.progress_bar=false",
    "logger=none",
    "callbacks=none",
    "resume=never",
]
SINGLE = ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "ntp.replica_tp=null"]
LLAMA_1B = {
    "arch": "llama",
    "name": "llama_1b",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "ffn_hidden_size": 8192,
    "max_seq_len": 2048,
    "tie_embeddings": True,
    "rope_theta": 500000.0,
}


# ---- pure helpers (tested on CPU: tests/test_gpu_check.py) ------------------------------------------
def bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its CUDA name, None when unknown."""
    name = device_name.upper()
    for fragment, tflops in BF16_PEAK_TFLOPS:
        if fragment in name:
            return tflops
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def compare_curves(got: Sequence[float], ref: Sequence[float], rtol: float) -> dict:
    """Per-step relative differences of two loss curves of the same length."""
    if len(got) != len(ref) or not ref:
        return {"ok": False, "steps": [len(got), len(ref)], "max_rel_diff": None, "rtol": rtol}
    diffs = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
    worst = max(diffs)
    return {"ok": worst <= rtol, "steps": len(ref), "max_rel_diff": worst, "rtol": rtol}


def read_losses(run_dir: Path) -> list[float]:
    """Loss of the last execution of each step in `metrics.jsonl`, in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            by_step[m["step"]] = m
    return [by_step[s]["loss"] for s in sorted(by_step)]


def median_tokens_per_s(run_dir: Path, skip: int = 3) -> float | None:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][skip:]
    return statistics.median(r["tokens_per_s"] for r in rows) if rows else None


def tiny_overrides(steps: int) -> list[str]:
    """The default recipe, shortened to `steps` steps (its model, data and batch unchanged)."""
    return [*QUIET, f"trainer.max_steps={steps}", "checkpoint.every_n_steps=0",
            "checkpoint.save_on_end=false"]


# ---- running pieces in child processes --------------------------------------------------------------
def run(cmd: list[str], log: Path, timeout: int = 240, env: dict | None = None) -> int:
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"  [{time.perf_counter() - t0:5.1f}s rc {rc}] {' '.join(cmd[2:6])} ... (log {log})", flush=True)
    return rc


def cli(overrides: list[str], run_dir: Path, log: Path, env: dict | None = None) -> int:
    return run([sys.executable, "-m", "ntp_nemo.train", *overrides, f"hydra.run.dir={run_dir}"], log, env=env)


def worker_backend(out: Path) -> None:
    """In a child process: the GPU runs' process-group backend, `cpu:gloo,cuda:nccl` (world 1, the one
    GPU): an all-reduce of a CUDA tensor (NCCL) and an object all-gather (gloo)."""
    import tempfile as tf

    import torch
    import torch.distributed as dist

    from ntp_nemo.lightning.strategy import default_backend

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    backend = default_backend(device)
    with tf.TemporaryDirectory() as d:
        dist.init_process_group(backend, store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1,
                                device_id=device)
        t = torch.full((4,), 2.0, device=device)
        dist.all_reduce(t)
        objs = [None]
        dist.all_gather_object(objs, {"rank": 0})
        out.write_text(json.dumps({"backend": backend, "all_reduce_ok": bool((t == 2.0).all().item()),
                                   "all_gather_object": objs}))
        dist.destroy_process_group()


def part_default(tmp: Path, steps: int) -> dict:
    gpu, cpu = tmp / "default_gpu", tmp / "default_cpu"
    rc_gpu = cli([*tiny_overrides(steps), "trainer=gpu"], gpu, tmp / "default_gpu.log")
    rc_cpu = cli([*tiny_overrides(steps)], cpu, tmp / "default_cpu.log")
    got, ref = read_losses(gpu), read_losses(cpu)
    cmp = compare_curves(got, ref, BF16_RTOL)
    pg = tmp / "backend.json"
    rc_pg = run([sys.executable, __file__, "--worker-backend", str(pg)], tmp / "backend.log")
    backend = json.loads(pg.read_text()) if rc_pg == 0 and pg.exists() else {"rc": rc_pg}
    return {
        "ok": rc_gpu == 0 and rc_cpu == 0 and cmp["ok"] and len(got) == steps and got[-1] < got[0]
        and backend.get("all_reduce_ok") is True,
        "rc": [rc_gpu, rc_cpu],
        "process_group": backend,
        "gpu_bf16_vs_cpu_fp32": cmp,
        "first_loss": got[0] if got else None,
        "final_loss": got[-1] if got else None,
        "tokens_per_s_gpu": median_tokens_per_s(gpu),
        "tokens_per_s_cpu": median_tokens_per_s(cpu),
    }


def worker_ntp(run_dir: Path, layout: str, precision: str, steps: int) -> None:
    """In a child process: train the default recipe on `layout` with every rank on cuda:0 (gloo)."""
    from hydra import compose, initialize_config_dir

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs
    from ntp_nemo.config.validate import resolve_layer_tp, validate
    from ntp_nemo.data.module import build_data
    from ntp_nemo.lightning.factory import build_trainer

    sizes = [int(x) for x in layout.split(",")]
    mesh = SINGLE if sizes == [1] else [
        f"mesh.dp={len(sizes)}", f"mesh.tp={max(sizes)}", "ntp.replica_tp=[" + layout + "]"
    ]
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=[
            *tiny_overrides(steps), *mesh, "trainer.accelerator=gpu", f"trainer.precision={precision}",
            "trainer.process_group_backend=gloo",
        ])
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    d = cfg.data
    data = build_data(d.path, d.tokenizer, int(d.seq_len), int(d.global_batch_size), int(cfg.seed),
                      float(d.val_fraction), int(cfg.model.vocab_size))
    world = sum(sizes)
    trainer, module, _ = build_trainer(cfg, run_dir, data, resolve_layer_tp(cfg), [], [0] * world)
    trainer.fit(module)


def part_ntp(tmp: Path, steps: int) -> dict:
    out: dict = {}
    ok = True
    for precision, rtol in (("32-true", FP32_RTOL), ("bf16-mixed", BF16_RTOL)):
        curves = {}
        for layout in ("1", "2,1"):
            run_dir = tmp / f"ntp_{layout.replace(',', '-')}_{precision}"
            rc = run([sys.executable, __file__, "--worker-ntp", str(run_dir), layout, precision, str(steps)],
                     tmp / f"{run_dir.name}.log")
            curves[layout] = read_losses(run_dir)
            ok &= rc == 0
        cmp = compare_curves(curves["2,1"], curves["1"], rtol)
        out[precision] = cmp
        ok &= cmp["ok"]
    out["ok"] = ok
    return out


def part_ckpt(tmp: Path, steps: int) -> dict:
    saved = tmp / "ckpt_gpu"
    first = max(2, steps // 3)
    base = [*QUIET, "checkpoint.every_n_steps=0", "checkpoint.save_on_end=true", "trainer.precision=32-true"]
    rc0 = cli([*base, f"trainer.max_steps={first}", "trainer.accelerator=gpu"], saved, tmp / "ckpt_gpu.log")
    more = [s for s in base if s != "resume=never"] + ["resume=auto", f"trainer.max_steps={first + 5}"]
    results = {}
    for name, accel in (("cpu", "cpu"), ("gpu", "gpu")):
        run_dir = tmp / f"ckpt_resume_{name}"
        if saved.exists():
            shutil.copytree(saved, run_dir)
        rc = cli([*more, f"trainer.accelerator={accel}"], run_dir, tmp / f"ckpt_resume_{name}.log")
        log = (tmp / f"ckpt_resume_{name}.log").read_text()
        results[name] = {"rc": rc, "resumed": "resuming from" in log, "losses": read_losses(run_dir)[first:]}
    cmp = compare_curves(results["cpu"]["losses"], results["gpu"]["losses"], FP32_RTOL)
    return {
        "ok": rc0 == 0 and all(r["rc"] == 0 and r["resumed"] for r in results.values()) and cmp["ok"],
        "saved_on_gpu_rc": rc0,
        "resume_cpu_vs_gpu": cmp,
        "resumed": {k: v["resumed"] for k, v in results.items()},
    }


def worker_llama(
    out: Path, precision: str, micro_batch: int, seq: int, steps: int, peak: float | None
) -> None:
    """In a child process: time training steps of the ~1.2B Llama on cuda:0."""
    import torch

    from ntp_nemo.models import ModelConfig, build_model, flops_per_token, param_count

    torch.cuda.set_device(0)
    cfg = ModelConfig(**{**LLAMA_1B, "max_seq_len": seq})
    model = build_model(cfg, seed=0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    model = model.to(device="cuda", dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), device="cuda", generator=gen)
    n_tok = micro_batch * seq

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model.loss_sum(tokens) / n_tok
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(3):  # warm-up: allocator, kernels
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / steps
    name = torch.cuda.get_device_name(0)
    peak = peak or bf16_peak_tflops(name)
    fpt = flops_per_token(cfg, seq)
    tps = n_tok / secs
    out.write_text(json.dumps({
        "device": name,
        "precision": precision,
        "params": param_count(cfg),
        "micro_batch": micro_batch,
        "seq_len": seq,
        "step_s": secs,
        "tokens_per_s": tps,
        "tflops": tps * fpt / 1e12,
        "peak_tflops": peak,
        "mfu": mfu(tps, fpt, peak) if peak else None,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": float(loss),
    }))


def part_llama(tmp: Path, peak: float | None, micro_batch: int, seq: int) -> dict:
    out: dict = {"ok": True}
    for precision in ("bf16-true", "bf16-mixed"):
        path = tmp / f"llama_{precision}.json"
        cmd = [sys.executable, __file__, "--worker-llama", str(path), precision, str(micro_batch), str(seq),
               "10", str(peak or 0)]
        rc = run(cmd, tmp / f"llama_{precision}.log", timeout=300)
        res = json.loads(path.read_text()) if rc == 0 and path.exists() else {"rc": rc}
        out[precision] = res
        out["ok"] &= rc == 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps of the curve comparisons")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device (default: by its name)")
    ap.add_argument("--llama-micro-batch", type=int, default=8)
    ap.add_argument("--llama-seq", type=int, default=2048)
    ap.add_argument("--keep", help="keep run directories and logs here (default: a temporary directory)")
    ap.add_argument("--worker-ntp", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--worker-llama", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--worker-backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_ntp:
        d, layout, precision, steps = args.worker_ntp
        worker_ntp(Path(d), layout, precision, int(steps))
        return 0
    if args.worker_backend:
        worker_backend(Path(args.worker_backend))
        return 0
    if args.worker_llama:
        p, precision, mb, seq, steps, peak = args.worker_llama
        worker_llama(Path(p), precision, int(mb), int(seq), int(steps), float(peak) or None)
        return 0

    sys.path.insert(0, str(ROOT))
    from ntp_nemo.parallel.devices import cuda_device_count  # NVML: no CUDA context in this process

    parts = [p for p in args.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"error: unknown part(s) {bad}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    n = cuda_device_count()
    if n == 0:
        print("gpu_check: no CUDA device visible; nothing was run (this check needs one GPU).")
        return 0
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {n} CUDA device(s) visible; using cuda:0; logs in {tmp}", flush=True)
    results: dict = {}
    t0 = time.perf_counter()
    for part in parts:
        print(f"[{part}]", flush=True)
        if part == "default":
            results[part] = part_default(tmp, args.steps)
        elif part == "ntp":
            results[part] = part_ntp(tmp, args.steps)
        elif part == "ckpt":
            results[part] = part_ckpt(tmp, args.steps)
        else:
            results[part] = part_llama(tmp, args.peak_tflops, args.llama_micro_batch, args.llama_seq)
        print(json.dumps(results[part], indent=2), flush=True)
    results["wall_s"] = time.perf_counter() - t0
    print(f"\ngpu_check: {time.perf_counter() - t0:.0f}s")
    for part in parts:
        print(f"  {part:8s} {'ok' if results[part]['ok'] else 'FAILED'}")
    for precision in ("bf16-true", "bf16-mixed"):
        r = results.get("llama", {}).get(precision)
        if r and "tokens_per_s" in r:
            mfu_text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (unknown peak)"
            print(f"  llama {r['params'] / 1e9:.2f}B {precision}: {r['tokens_per_s']:.0f} tokens/s, "
                  f"{r['tflops']:.0f} TFLOPS, MFU {mfu_text} on {r['device']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(results[p]["ok"] for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
