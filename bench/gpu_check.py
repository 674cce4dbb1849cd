"""GPU checks of the CUDA path, in one command, each part independent and bounded:

    python bench/gpu_check.py [--steps 20] [--only devices,default,ntp,ckpt,llama] [--json gpu_check.json]
                              [--keep DIR [--rest]] [--part-timeout 420] [--multi]
    python bench/gpu_check.py --rehearse [--visible-gpus 1]     # the same children, on CPU, here

0. `devices` (CPU only, seconds, before any GPU time): the device-typed rehearsal
   (`ntp_nemo.runtime.device_rehearsal`) of the step of the `ntp` part (a gloo world whose tensors are
   CUDA tensors, fp32 and bf16), of the multi-GPU layouts (NCCL, SP, TP chunks; two pipeline stages) and
   of a live recovery's new NCCL generation: a collective handed a tensor its group's backend does not
   move, or an NCCL group created without its device, fails here.
1. `default`: the default recipe (gpt_tiny) through the real `ntp-train` CLI on cuda:0 (world 1,
   `trainer=gpu`: bf16-mixed), against the same run on CPU in float32 (bf16 tolerance); and the GPU
   runs' process-group backend `cpu:gloo,cuda:nccl` on the one GPU (a world-1 group: an NCCL
   all-reduce of a CUDA tensor and a gloo object all-gather; a world-1 run itself needs no group).
2. `ntp`: an NTP layout (2,1) of three processes sharing cuda:0 over gloo with CUDA tensors, against
   the single-process curve on cuda:0, in float32 and in bf16-mixed.  (NCCL refuses two ranks on one
   GPU, so the collectives run over gloo here, the TP groups too: `ntpdirect` moves CPU tensors only.)
3. `ckpt`: a checkpoint saved by a float32 run on cuda:0 (world 1), resumed on CPU and on the GPU
   (world 1 each): the next steps' losses agree.
4. `llama`: training throughput of a ~1.2B-parameter Llama (Llama-3.2-1B shapes: hidden 2048, 16
   layers, 32 heads / 8 KV heads, FFN 8192, vocabulary 128256, tied embeddings) on ntp_nemo's model
   code, bf16 weights with fused AdamW (`bf16-true`) and fp32 weights under bf16 autocast
   (`bf16-mixed`): tokens/s and MFU = tokens/s x training FLOPs per token / the device's dense bf16
   peak (H100/H200 SXM 989 TFLOPS, H100/H200 NVL 835, A100 312; `--peak-tflops` for others).  Each
   precision's micro-batch (at most `--llama-micro-batch`, 8) is sized first on the CPU so that the dry
   run's estimate leaves 25% of an 80 GB GPU free (`size_llama`): bf16-true 8, bf16-mixed 7.

`--multi` (a machine with three GPUs or more) adds `tp2` (the layout (2,1) on three GPUs over NCCL
with sequence parallelism, `ntp.tp_overlap`, `ntp.tp_chunks=2`, the overlapped DP sync and the
distributed optimizer), `tp2_compiled` (the same layout with compiled blocks and the distributed
optimizer), `pp2` (two pipeline stages on two GPUs: NCCL sends) and `live` (a rank killed at step 3,
recovered live on NCCL).

Each part runs under its own bound (`--part-timeout`), prints its progress, and a failure in one leaves
the others to run.  After each part `DIR/gpu_check_summary.json` lists the parts passed so far; with
`--keep DIR --rest` a second try runs only the others (`--only a,b` runs just those).  Not yet timed on a
GPU: the start prints the estimate by reading (`ESTIMATE_S`): 6.7 minutes for the single-GPU parts, 5.2
for the multi-GPU ones.

The launching process never initialises CUDA (devices are counted through NVML): every part runs in
child processes, which bind their own device; they inherit no SLURM_* or torchrun variables (inside an
allocation those would make a child wait for a cluster launch).  Before a child starts, its layout is
checked against the visible GPUs: ranks on distinct GPUs need as many, ranks sharing cuda:0 go over
gloo.  Without a CUDA device it says so and exits 0.

`--rehearse` runs every part, the multi-GPU ones included, with the same children, configurations,
launcher environment and device mapping (checked against `--visible-gpus`, default 1, and 3 simulated
GPUs for the multi parts) on CPU: `trainer.accelerator=cpu`, gloo, float32
or bf16 on the CPU, 4 steps of a smaller model (`REHEARSAL_SIZES`: hidden 64, 2 layers, 12 x 32
tokens).  The llama part keeps its code path and dtypes on a model cut to one layer and a 1024-token
vocabulary (1.2B parameters do not train on a CPU in minutes).  Its last line is
`gpu_check rehearsal: N/N parts ok`.
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
if __package__ in (None, ""):  # run as `python bench/gpu_check.py` (and its workers): the root on the path
    sys.path.insert(0, str(ROOT))
from tests.shapes import TINY_DATA, TINY_MODEL  # noqa: E402  (the suite's tiny model: the rehearsal's sizes)

PARTS = ("devices", "default", "ntp", "ckpt", "llama")

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
# The rehearsal's sizes: a CPU shared with other work runs the default recipe at minutes per step, so
# the rehearsed children train a smaller model on shorter steps; layouts, precisions, launcher
# environment and device mapping stay those of the GPU run.
REHEARSAL_SIZES = [*TINY_MODEL, *TINY_DATA, "optim.warmup_steps=1", "optim.lr=3e-3"]
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


# ---- pure helpers (tested on CPU: tests/house/test_gpu_check.py) ------------------------------------------
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


# Variables of an external launcher: a child that inherits them takes itself for one rank of a job
# started by srun or torchrun and waits for peers nobody starts.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def child_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """The environment of a child: this one without SLURM_*/torchrun variables, unbuffered output."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_") and k not in LAUNCHER_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


def layout_world(overrides: list[str]) -> int:
    """Ranks of the layout a `ntp-train` command with `overrides` runs (pp x sum of replica degrees)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])
    replicas = cfg.ntp.replica_tp or [cfg.mesh.tp] * int(cfg.mesh.dp)
    return int(cfg.mesh.pp) * sum(int(n) for n in replicas)


def mapping_problem(world: int, cuda_ordinals: list[int] | None, backend: str | None,
                    visible: int) -> str | None:
    """Why `world` ranks cannot run on `visible` GPUs with this mapping (None: they can).

    `cuda_ordinals`: the device each rank binds (None: rank i on cuda:i, Lightning's default); ranks
    sharing a GPU must use gloo (NCCL refuses two ranks on one device)."""
    ordinals = list(range(world)) if cuda_ordinals is None else list(cuda_ordinals)
    if len(ordinals) != world:
        return f"{len(ordinals)} device ordinals for {world} ranks"
    missing = sorted({o for o in ordinals if o >= visible})
    if missing:
        return (f"{world} rank(s) bind cuda:{','.join(map(str, missing))} but {visible} GPU(s) are visible: "
                "run world 1 or share cuda:0 over gloo")
    if len(set(ordinals)) < world and "nccl" in (backend or "cpu:gloo,cuda:nccl"):
        return (f"{world} ranks share {len(set(ordinals))} GPU(s) over NCCL, which refuses two ranks on "
                "one GPU")
    return None


class Plan:
    """One part's children and the device mappings they need, composed once for the GPU run and the
    CPU rehearsal alike."""

    def __init__(self, rehearse: bool, visible: int, timeout_s: float = 900.0) -> None:
        self.rehearse, self.visible = rehearse, visible
        self.problems: list[str] = []
        self.deadline = time.monotonic() + timeout_s  # the part's own bound (`--part-timeout`)

    def left(self, most: float) -> int:
        """Seconds a child may run: `most`, or less where the part's deadline comes first (at least 1)."""
        return max(1, int(min(most, self.deadline - time.monotonic())))

    def check(self, name: str, world: int, ordinals: list[int] | None, backend: str | None) -> bool:
        problem = mapping_problem(world, ordinals, backend, self.visible)
        if problem:
            self.problems.append(f"{name}: {problem}")
            print(f"  {name}: not started: {problem}", flush=True)
        return problem is None

    def accel(self, overrides: list[str]) -> list[str]:
        """The child's overrides: as given on a GPU; on the CPU in a rehearsal (same layout and precision)."""
        return [*overrides, "trainer.accelerator=cpu"] if self.rehearse else overrides

    def sizes(self, overrides: list[str]) -> list[str]:
        """Every `ntp-train` child's overrides: the rehearsal's smaller model and steps appended."""
        return [*overrides, *REHEARSAL_SIZES] if self.rehearse else overrides


# ---- running pieces in child processes --------------------------------------------------------------
def run(cmd: list[str], log: Path, timeout: int = 600, env: dict | None = None,
        plan: Plan | None = None) -> int:
    """Run a child with its output in `log`, bounded by `timeout` and the part's deadline (`plan`);
    124 when it ran out of time."""
    if plan is not None:
        timeout = plan.left(timeout)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                env=child_env(env),
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"  [{time.perf_counter() - t0:5.1f}s rc {rc}] {' '.join(cmd[2:6])} ... (log {log})", flush=True)
    return rc


def cli(overrides: list[str], run_dir: Path, log: Path, env: dict | None = None,
        plan: Plan | None = None) -> int:
    return run([sys.executable, "-m", "ntp_nemo.train", *overrides, f"hydra.run.dir={run_dir}"], log, env=env,
               plan=plan)


def gpu_cli(plan: Plan, name: str, overrides: list[str], run_dir: Path, log: Path) -> int:
    """A GPU run of `ntp-train` (every rank on its own GPU, Lightning's mapping), checked first."""
    if not plan.check(name, layout_world(overrides), None, None):
        return 3
    return cli(plan.accel(plan.sizes(overrides)), run_dir, log, plan=plan)


def worker_backend(out: Path, rehearse: bool = False) -> None:
    """In a child process: the GPU runs' process-group backend, `cpu:gloo,cuda:nccl` (world 1, the one
    GPU): an all-reduce of a CUDA tensor (NCCL) and an object all-gather (gloo).  Rehearsed on CPU:
    the same calls over gloo with a CPU tensor (NCCL needs a GPU)."""
    import tempfile as tf

    import torch
    import torch.distributed as dist

    from ntp_nemo.lightning.strategy import default_backend

    device = torch.device("cpu") if rehearse else torch.device("cuda", 0)
    if not rehearse:
        torch.cuda.set_device(0)
    backend = default_backend(torch.device("cuda", 0))
    with tf.TemporaryDirectory() as d:
        extra = {} if rehearse else {"device_id": device}
        dist.init_process_group("gloo" if rehearse else backend, store=dist.FileStore(f"{d}/store", 1),
                                rank=0, world_size=1, **extra)
        t = torch.full((4,), 2.0, device=device)
        dist.all_reduce(t)
        objs = [None]
        dist.all_gather_object(objs, {"rank": 0})
        out.write_text(json.dumps({"backend": backend, "ran_on": "cpu:gloo" if rehearse else backend,
                                   "all_reduce_ok": bool((t == 2.0).all().item()),
                                   "all_gather_object": objs}))
        dist.destroy_process_group()


def part_default(tmp: Path, steps: int, plan: Plan) -> dict:
    gpu, cpu = tmp / "default_gpu", tmp / "default_cpu"
    single = [*tiny_overrides(steps), *SINGLE]  # world 1: the one GPU
    rc_gpu = gpu_cli(plan, "default gpu", [*single, "trainer=gpu"], gpu, tmp / "default_gpu.log")
    rc_cpu = cli(plan.sizes(single), cpu, tmp / "default_cpu.log", plan=plan)
    got, ref = read_losses(gpu), read_losses(cpu)
    cmp = compare_curves(got, ref, BF16_RTOL)
    pg = tmp / "backend.json"
    rc_pg = 3
    if plan.check("default backend", 1, [0], "cpu:gloo,cuda:nccl"):
        rc_pg = run([sys.executable, __file__, "--worker-backend", str(pg), *(["--rehearse"] if plan.rehearse
                                                                               else [])], tmp / "backend.log",
                    plan=plan)
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


def ntp_mesh(layout: str) -> list[str]:
    sizes = [int(x) for x in layout.split(",")]
    return SINGLE if sizes == [1] else [f"mesh.dp={len(sizes)}", f"mesh.tp={max(sizes)}",
                                        "ntp.replica_tp=[" + layout + "]"]


def worker_ntp(run_dir: Path, layout: str, precision: str, steps: int, rehearse: bool = False) -> None:
    """In a child process: train the default recipe on `layout` with every rank on cuda:0 (gloo); on
    the CPU in a rehearsal."""
    from hydra import compose, initialize_config_dir

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs
    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.config.validate import validate
    from ntp_nemo.data.prepare import build_data
    from ntp_nemo.lightning.factory import build_trainer

    sizes = [int(x) for x in layout.split(",")]
    mesh = ntp_mesh(layout)
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=[
            *tiny_overrides(steps), *mesh, f"trainer.accelerator={'cpu' if rehearse else 'gpu'}",
            f"trainer.precision={precision}", *(REHEARSAL_SIZES if rehearse else []),
            "trainer.process_group_backend=gloo",
        ])
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    d = cfg.data
    data = build_data(d.path, d.tokenizer, int(d.seq_len), int(d.global_batch_size), int(cfg.seed),
                      float(d.val_fraction), int(cfg.model.vocab_size))
    world = sum(sizes)
    trainer, module, _ = build_trainer(resolve(cfg), run_dir, data, None, [],
                                       None if rehearse else [0] * world)
    trainer.fit(module)


def part_ntp(tmp: Path, steps: int, plan: Plan) -> dict:
    out: dict = {}
    ok = True
    for precision, rtol in (("32-true", FP32_RTOL), ("bf16-mixed", BF16_RTOL)):
        curves = {}
        for layout in ("1", "2,1"):
            run_dir = tmp / f"ntp_{layout.replace(',', '-')}_{precision}"
            world = sum(int(x) for x in layout.split(","))
            rc = 3
            if plan.check(f"ntp ({layout}) {precision}", world, [0] * world, "gloo"):  # all on cuda:0
                flags = ["--rehearse"] if plan.rehearse else []
                rc = run([sys.executable, __file__, "--worker-ntp", str(run_dir), layout, precision,
                          str(steps), *flags], tmp / f"{run_dir.name}.log", plan=plan)
            curves[layout] = read_losses(run_dir)
            ok &= rc == 0
        cmp = compare_curves(curves["2,1"], curves["1"], rtol)
        out[precision] = cmp
        ok &= cmp["ok"]
    out["ok"] = ok
    return out


def part_ckpt(tmp: Path, steps: int, plan: Plan) -> dict:
    saved = tmp / "ckpt_gpu"
    first = max(2, steps // 3)
    base = [*QUIET, *SINGLE, "checkpoint.every_n_steps=0", "checkpoint.save_on_end=true",
            "trainer.precision=32-true"]  # world 1: the one GPU
    rc0 = gpu_cli(plan, "ckpt save gpu", [*base, f"trainer.max_steps={first}", "trainer.accelerator=gpu"],
                  saved, tmp / "ckpt_gpu.log")
    more = [s for s in base if s != "resume=never"] + ["resume=auto", f"trainer.max_steps={first + 5}"]
    results = {}
    for name, accel in (("cpu", "cpu"), ("gpu", "gpu")):
        run_dir = tmp / f"ckpt_resume_{name}"
        if saved.exists():
            shutil.copytree(saved, run_dir)
        overrides = [*more, f"trainer.accelerator={accel}"]
        if accel == "gpu":
            rc = gpu_cli(plan, "ckpt resume gpu", overrides, run_dir, tmp / f"ckpt_resume_{name}.log")
        else:
            rc = cli(plan.sizes(overrides), run_dir, tmp / f"ckpt_resume_{name}.log", plan=plan)
        logf = tmp / f"ckpt_resume_{name}.log"
        log = logf.read_text() if logf.exists() else ""
        results[name] = {"rc": rc, "resumed": "resuming from" in log, "losses": read_losses(run_dir)[first:]}
    cmp = compare_curves(results["cpu"]["losses"], results["gpu"]["losses"], FP32_RTOL)
    return {
        "ok": rc0 == 0 and all(r["rc"] == 0 and r["resumed"] for r in results.values()) and cmp["ok"],
        "saved_on_gpu_rc": rc0,
        "resume_cpu_vs_gpu": cmp,
        "resumed": {k: v["resumed"] for k, v in results.items()},
    }


LLAMA_REHEARSAL = {"num_layers": 1, "vocab_size": 1024}  # the 1B's code path and dtypes, at CPU size
GPU_BYTES = 80e9  # an 80 GB H100/H200-class card: the llama part leaves FREE_FRACTION of it free
FREE_FRACTION = 0.25


def llama_estimate(micro_batch: int, seq: int, precision: str) -> dict:
    """Device bytes of one training step of the 1.2B Llama at `micro_batch` x `seq` in `precision`, by the
    dry run (`runtime.dry_run`: parameters, gradients, AdamW state and the activations autograd saves,
    counted on meta tensors) plus what it does not count: the loss's transient gradient of the logits (in
    the compute dtype) with one chunk of float32 temporaries, and under `bf16-mixed` autocast's bf16 copy
    of the weights.  CPU only (meta tensors, torch's fake process group): no CUDA call."""
    import torch

    from ntp_nemo.models import ModelConfig
    from ntp_nemo.parallel.layers import CE_CHUNK_BYTES
    from ntp_nemo.runtime.dry_run import StepShape, dry_run
    from ntp_nemo.topology import ResolvedLayout, Topology

    cfg = ModelConfig(**{**LLAMA_1B, "max_seq_len": seq})
    layout = ResolvedLayout.make(Topology(1, [1], [1] * (cfg.num_layers + 2)), num_microbatches=1)
    param = torch.bfloat16 if precision == "bf16-true" else torch.float32
    shape = StepShape(seq_len=seq, micro_batch_size=micro_batch, param_dtype=param,
                      compute_dtype=torch.bfloat16)
    r = dry_run(layout, cfg, shape, measure_options=False).ranks[0]
    logits_grad = micro_batch * seq * cfg.vocab_size * 2 + 2 * CE_CHUNK_BYTES
    autocast_weights = r.params * 2 if precision == "bf16-mixed" else 0
    total = r.memory_bytes + logits_grad + autocast_weights
    return {"micro_batch": micro_batch, "dry_run_bytes": r.memory_bytes, "loss_transient_bytes": logits_grad,
            "autocast_weight_bytes": autocast_weights, "total_bytes": total,
            "free_fraction_of_80gb": 1 - total / GPU_BYTES}


def size_llama(requested: int, seq: int, precision: str) -> dict:
    """The largest micro-batch up to `requested` whose estimate (`llama_estimate`) leaves FREE_FRACTION
    of an 80 GB GPU free, with its estimate (micro-batch 1 when none does)."""
    est = llama_estimate(requested, seq, precision)
    while est["free_fraction_of_80gb"] < FREE_FRACTION and est["micro_batch"] > 1:
        est = llama_estimate(est["micro_batch"] - 1, seq, precision)
    return {**est, "requested_micro_batch": requested}


def worker_llama(
    out: Path, precision: str, micro_batch: int, seq: int, steps: int, peak: float | None,
    rehearse: bool = False,
) -> None:
    """In a child process: time training steps of the ~1.2B Llama on cuda:0 (a one-layer cut of it on
    the CPU in a rehearsal)."""
    import torch

    from ntp_nemo.models import ModelConfig, build_model, flops_per_token, param_count

    dev = "cpu" if rehearse else "cuda"
    if not rehearse:
        torch.cuda.set_device(0)
    cfg = ModelConfig(**{**LLAMA_1B, "max_seq_len": seq, **(LLAMA_REHEARSAL if rehearse else {})})
    model = build_model(cfg, seed=0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32  # bf16-true: no float32 masters
    model = model.to(device=dev, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), device=dev, generator=gen)
    n_tok = micro_batch * seq

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model.loss_sum(tokens) / n_tok
        loss.backward()
        opt.step()
        return loss.detach()

    sync = (lambda: None) if rehearse else torch.cuda.synchronize
    for _ in range(1 if rehearse else 3):  # warm-up: allocator, kernels
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    secs = (time.perf_counter() - t0) / steps
    name = "cpu (rehearsal)" if rehearse else torch.cuda.get_device_name(0)
    peak = None if rehearse else peak or bf16_peak_tflops(name)
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
        "max_memory_gib": None if rehearse else torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": float(loss),
    }))


def part_llama(tmp: Path, peak: float | None, micro_batch: int, seq: int, plan: Plan) -> dict:
    """Each precision's micro-batch is first sized on the CPU (`size_llama`, in a child: the dry run's
    estimate must leave 25% of an 80 GB GPU free), then timed on the GPU.  The rehearsal sizes the 1.2B
    shape the same way and trains its one-layer cut at micro-batch 1."""
    out: dict = {"ok": True}
    sized_path = tmp / "llama_size.json"
    rc_size = run([sys.executable, __file__, "--worker-size", str(sized_path), str(micro_batch), str(seq)],
                  tmp / "llama_size.log", timeout=180, plan=plan)
    sizes = json.loads(sized_path.read_text()) if rc_size == 0 and sized_path.exists() else {}
    for precision in ("bf16-true", "bf16-mixed"):
        sized = sizes.get(precision, {"rc": rc_size})
        mb = sized.get("micro_batch")
        if mb is not None:
            free = 100 * sized["free_fraction_of_80gb"]
            print(f"  llama {precision}: micro-batch {mb} (asked {micro_batch}): estimate "
                  f"{sized['total_bytes'] / 1e9:.1f} GB, {free:.0f}% of 80 GB free", flush=True)
        path = tmp / f"llama_{precision}.json"
        rc = 3 if mb is None else rc_size
        if mb is not None and plan.check(f"llama {precision}", 1, [0], None):
            run_mb, run_seq = (1, 32) if plan.rehearse else (mb, seq)
            cmd = [sys.executable, __file__, "--worker-llama", str(path), precision, str(run_mb),
                   str(run_seq), "2" if plan.rehearse else "10", str(peak or 0),
                   *(["--rehearse"] if plan.rehearse else [])]
            rc = run(cmd, tmp / f"llama_{precision}.log", timeout=300, plan=plan)
        res = json.loads(path.read_text()) if rc == 0 and path.exists() else {"rc": rc}
        out[precision] = {**res, "sizing": sized}
        out["ok"] &= rc == 0
    return out


def worker_devices(out: Path) -> None:
    """In a child process, on the CPU: the device-typed rehearsal (`ntp_nemo.runtime.device_rehearsal`:
    meta tensors stand for CUDA tensors, every process group keeps its real backend's device types) of
    the step each GPU part runs, and of a live recovery's new generation on NCCL."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from ntp_nemo.models import ModelConfig
    from ntp_nemo.runtime.device_rehearsal import DeviceTypedWorld
    from ntp_nemo.runtime.dry_run import StepShape, dry_run
    from ntp_nemo.topology import ResolvedLayout, Topology

    cfg = ModelConfig(arch="llama", name="rehearsal", vocab_size=101, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, ffn_hidden_size=96, max_seq_len=33)
    ntp21 = ResolvedLayout.make(Topology(2, [2, 1], [2] * (cfg.num_layers + 2)), num_microbatches=3)
    sp = dataclasses.replace(ntp21, sequence_parallel=True)
    cases = {  # name: (world backend, layout, step shape)
        "ntp (2,1) on one GPU over gloo, fp32": ("gloo", ntp21, StepShape(seq_len=16, micro_batch_size=1)),
        "ntp (2,1) on one GPU over gloo, bf16": ("gloo", ntp21, StepShape(
            seq_len=16, micro_batch_size=1, compute_dtype=torch.bfloat16)),
        "(2,1) on 3 GPUs, NCCL, SP, 2 chunks": ("cpu:gloo,cuda:nccl", sp, StepShape(
            seq_len=16, micro_batch_size=1, compute_dtype=torch.bfloat16, tp_chunks=2)),
        "2 pipeline stages on 2 GPUs, NCCL sends": ("cpu:gloo,cuda:nccl", ResolvedLayout.make(
            Topology(1, [1], [1] * (cfg.num_layers + 2), pp=2, stage_layers=[1, 1]), num_microbatches=2),
            StepShape(seq_len=16, micro_batch_size=1, compute_dtype=torch.bfloat16)),
    }
    results: dict = {}
    for name, (backend, layout, shape) in cases.items():
        try:
            with DeviceTypedWorld(backend):
                dry_run(layout, cfg, shape, measure_options=False)
            results[name] = {"ok": True}
        except Exception as err:  # noqa: BLE001 - reported per case
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    # A live recovery's generation on NCCL: every group bound to this process's GPU (mocked ordinal 1).
    from ntp_nemo.resilience import rendezvous
    from ntp_nemo.resilience.store_auth import JobStore
    from ntp_nemo.runtime.runtime import RankPlace

    current, auth = torch.cuda.current_device, rendezvous.authenticate_group
    torch.cuda.current_device, rendezvous.authenticate_group = (lambda: 1), (lambda *a, **k: None)
    world = DeviceTypedWorld()
    try:
        with world:
            rendezvous.join(JobStore(dist.HashStore(), b"k" * 32), 1, 0, 2, backend="cpu:gloo,cuda:nccl")
            try:
                RankPlace(ResolvedLayout.make(Topology(1, [2], [2] * 4), num_microbatches=2), 0,
                          device=torch.device("meta"))
            finally:
                dist.destroy_process_group()
        unbound = [f"{r.how} {list(r.ranks)}" for r in world.unbound_nccl()]
        results["live generation on NCCL: groups bound"] = {"ok": not unbound, "unbound": unbound}
    except Exception as err:  # noqa: BLE001
        results["live generation on NCCL: groups bound"] = {"ok": False,
                                                             "error": f"{type(err).__name__}: {err}"}
    finally:
        torch.cuda.current_device, rendezvous.authenticate_group = current, auth
    out.write_text(json.dumps(results))


def part_devices(tmp: Path, plan: Plan) -> dict:
    """On the CPU before any GPU time: the device-typed rehearsal of every part's step (`worker_devices`)."""
    path = tmp / "devices.json"
    rc = run([sys.executable, __file__, "--worker-devices", str(path)], tmp / "devices.log", timeout=300,
             plan=plan)
    cases = json.loads(path.read_text()) if rc == 0 and path.exists() else {}
    for name, r in cases.items():
        print(f"  {'ok' if r['ok'] else 'FAILED'}: {name}{'' if r['ok'] else ': ' + str(r)}", flush=True)
    return {"ok": rc == 0 and bool(cases) and all(r["ok"] for r in cases.values()), "rc": rc, "cases": cases}


# Multi-GPU parts (`--multi`): each rank on its own GPU, NCCL (`cpu:gloo,cuda:nccl`).
NTP21_GPUS = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "trainer=gpu"]
MULTI = {
    # TP 2 with every TP feature, the overlapped DP sync and the distributed optimizer (reduce-scatter)
    "tp2": [*NTP21_GPUS, "ntp.sequence_parallel=true", "ntp.tp_overlap=true", "ntp.tp_chunks=2",
            "optim.distributed=true", "ntp.overlap_grad_sync=true"],
    "tp2_compiled": [*NTP21_GPUS, "trainer.compile=true", "optim.distributed=true"],
    # two pipeline stages on two GPUs: NCCL point-to-point sends of activations and gradients
    "pp2": ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null", "mesh.pp=2", "trainer=gpu"],
    "live": [*NTP21_GPUS, "fault=kill_rank", "fault.rank=2", "fault.step=3", "fault.recovery=live"],
}
MULTI_GPUS = 3  # the most GPUs a multi part needs (the (2,1) layout); a rehearsal simulates as many

# Each part's time on one H100-class GPU, seconds, by reading (no GPU has run it yet): an `ntp-train`
# child starts in about 20 s (the imports, CUDA's context, Hydra, the data), a forked world adds about 10 s
# per process group; gpt_tiny's steps take milliseconds.  devices: one CPU child of dry runs on meta;
# default: two runs and the backend child; ntp: four runs, two of three processes; ckpt: three runs;
# llama: the sizing child (dry runs of the 1.2B on meta, about 30 s), then per precision the model's
# build and initialisation on the GPU (about 15 s) and 13 steps of 8 x 2048 tokens (about 0.4 s each).
# Multi parts: a three-rank run each; compiled blocks compile every block on the first step.
ESTIMATE_S = {"devices": 30, "default": 65, "ntp": 125, "ckpt": 70, "llama": 110,
              "tp2": 50, "tp2_compiled": 150, "pp2": 40, "live": 70}


def estimate_s(parts: Sequence[str]) -> int:
    """The estimated seconds of `parts` on one H100-class GPU (`ESTIMATE_S`)."""
    return sum(ESTIMATE_S[p] for p in parts)


def multi_overrides(part: str, steps: int) -> list[str]:
    return [*tiny_overrides(max(steps, 6)), *MULTI[part]]


def part_multi(part: str, tmp: Path, steps: int, plan: Plan) -> dict:
    """One multi-GPU part: `ntp-train` with each rank on its own GPU over NCCL, with the part's layout and
    features (`MULTI`); it passes when it trains every step and its loss falls."""
    run_dir = tmp / part
    rc = gpu_cli(plan, part, multi_overrides(part, steps), run_dir, tmp / f"{part}.log")
    losses = read_losses(run_dir)
    want = max(steps, 6)
    return {"ok": rc == 0 and len(losses) == want and losses[-1] < losses[0], "rc": rc,
            "steps": len(losses), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None}


SUMMARY = "gpu_check_summary.json"


def passed_before(keep: Path) -> list[str]:
    """Parts an earlier run into `keep` passed (its summary), so `--rest` runs only the others."""
    path = keep / SUMMARY
    return list(json.loads(path.read_text()).get("passed", [])) if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, help="training steps of the curve comparisons (20; 4 rehearsed)")
    ap.add_argument("--only", help=f"comma-separated parts of {PARTS} (and {tuple(MULTI)} with several GPUs)")
    ap.add_argument("--multi", action="store_true",
                    help=f"also the multi-GPU parts {tuple(MULTI)} (three ranks on three GPUs over NCCL)")
    ap.add_argument("--rest", action="store_true",
                    help="run only the parts the summary in --keep DIR does not list as passed")
    ap.add_argument("--part-timeout", type=int,
                    help="seconds each part may take (420 on a GPU; 1800 rehearsed on a shared CPU)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device (default: by its name)")
    ap.add_argument("--llama-micro-batch", type=int, default=8)
    ap.add_argument("--llama-seq", type=int, default=2048)
    ap.add_argument("--keep", help="keep run directories and logs here (default: a temporary directory)")
    ap.add_argument("--rehearse", action="store_true",
                    help="run every part's children on CPU (same configurations and device mapping)")
    ap.add_argument("--visible-gpus", type=int, default=1, help="GPUs the rehearsal maps the ranks onto")
    ap.add_argument("--worker-ntp", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--worker-llama", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--worker-backend", help=argparse.SUPPRESS)
    ap.add_argument("--worker-size", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--worker-devices", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_devices:
        worker_devices(Path(args.worker_devices))
        return 0
    if args.worker_size:
        p, mb, seq = args.worker_size
        Path(p).write_text(json.dumps({prec: size_llama(int(mb), int(seq), prec)
                                       for prec in ("bf16-true", "bf16-mixed")}))
        return 0
    if args.worker_ntp:
        d, layout, precision, steps = args.worker_ntp
        worker_ntp(Path(d), layout, precision, int(steps), args.rehearse)
        return 0
    if args.worker_backend:
        worker_backend(Path(args.worker_backend), args.rehearse)
        return 0
    if args.worker_llama:
        p, precision, mb, seq, steps, peak = args.worker_llama
        worker_llama(Path(p), precision, int(mb), int(seq), int(steps), float(peak) or None, args.rehearse)
        return 0

    from ntp_nemo.launch.devices import cuda_device_count  # NVML: no CUDA context in this process

    args.steps = args.steps or (4 if args.rehearse else 20)
    args.part_timeout = args.part_timeout or (1800 if args.rehearse else 420)
    known = (*PARTS, *MULTI)
    every = PARTS + (tuple(MULTI) if args.multi or args.rehearse else ())  # a rehearsal runs them all
    parts = [p for p in (args.only or ",".join(every)).split(",") if p]
    bad = [p for p in parts if p not in known]
    if bad:
        print(f"error: unknown part(s) {bad}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    if args.rest and not args.keep:
        print("error: --rest reads the summary of an earlier run: give its --keep DIR", file=sys.stderr)
        return 2
    n = args.visible_gpus if args.rehearse else cuda_device_count()
    if n == 0:
        print("gpu_check: no CUDA device visible; nothing was run (this check needs one GPU; "
              "`--rehearse` runs its children on CPU).")
        return 0
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    tmp.mkdir(parents=True, exist_ok=True)
    done = passed_before(tmp) if args.rest else []
    todo = [p for p in parts if p not in done]
    what = f"rehearsal on CPU of {n} simulated GPU(s)" if args.rehearse else f"{n} CUDA device(s) visible"
    print(f"gpu_check: {what}; using cuda:0; logs in {tmp}", flush=True)
    single = [p for p in todo if p in PARTS]
    print(f"gpu_check: parts {', '.join(todo)}; estimate on one H100-class GPU (by reading, not timed on a "
          f"GPU yet): {estimate_s(single) / 60:.1f} min for the single-GPU parts"
          + (f", {estimate_s([p for p in todo if p in MULTI]) / 60:.1f} min for the multi-GPU parts"
             if len(single) < len(todo) else ""), flush=True)
    if done:
        print(f"gpu_check: passed before ({tmp / SUMMARY}), not run again: {', '.join(done)}", flush=True)
    results: dict = {}
    t0 = time.perf_counter()
    for i, part in enumerate(todo, 1):
        print(f"[{i}/{len(todo)} {part}] at {time.perf_counter() - t0:.0f}s (bound {args.part_timeout}s)",
              flush=True)
        # A rehearsal maps a multi part's ranks on MULTI_GPUS simulated GPUs, as a `--multi` machine has.
        visible = max(n, MULTI_GPUS) if args.rehearse and part in MULTI else n
        plan = Plan(args.rehearse, visible, args.part_timeout)
        started = time.perf_counter()
        try:
            if part == "devices":
                results[part] = part_devices(tmp, plan)
            elif part == "default":
                results[part] = part_default(tmp, args.steps, plan)
            elif part == "ntp":
                results[part] = part_ntp(tmp, args.steps, plan)
            elif part == "ckpt":
                results[part] = part_ckpt(tmp, args.steps, plan)
            elif part == "llama":
                results[part] = part_llama(tmp, args.peak_tflops, args.llama_micro_batch, args.llama_seq,
                                           plan)
            else:
                results[part] = part_multi(part, tmp, args.steps, plan)
        except Exception as err:  # noqa: BLE001 - one part's failure leaves the others to run
            results[part] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        if plan.problems:
            results[part].update(ok=False, mapping_problems=plan.problems)
        results[part]["part_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(results[part], indent=2), flush=True)
        passed_now = [p for p in parts if p in done or results.get(p, {}).get("ok")]
        (tmp / SUMMARY).write_text(json.dumps({"passed": passed_now, "failed": [
            p for p in todo if p in results and not results[p]["ok"]]}, indent=2) + "\n")
    results["wall_s"] = time.perf_counter() - t0
    print(f"\ngpu_check: {time.perf_counter() - t0:.0f}s")
    for part in parts:
        verdict = "ok (earlier run)" if part in done else ("ok" if results[part]["ok"] else "FAILED")
        print(f"  {part:12s} {verdict}")
    for precision in ("bf16-true", "bf16-mixed"):
        r = results.get("llama", {}).get(precision)
        if r and "tokens_per_s" in r:
            mfu_text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (unknown peak)"
            print(f"  llama {r['params'] / 1e9:.2f}B {precision}: {r['tokens_per_s']:.0f} tokens/s, "
                  f"{r['tflops']:.0f} TFLOPS, MFU {mfu_text} on {r['device']}")
    failed = [p for p in todo if not results[p]["ok"]]
    if failed:
        print(f"  rerun only the rest: python bench/gpu_check.py --keep {tmp} --rest"
              f"{' --multi' if args.multi else ''}{' --rehearse' if args.rehearse else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    passed = len(parts) - len(failed)
    if args.rehearse:
        print(f"gpu_check rehearsal: {passed}/{len(parts)} parts ok")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
