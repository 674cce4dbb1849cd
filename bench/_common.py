"""Shared pieces of the benchmarks: config composition, the real `ntp-train` CLI in a subprocess, a
plain GPT-2-style model with the same shapes as ntp_nemo's, a plain PyTorch training loop, and a runner
that lets two training processes take turns step by step.

The plain model's parameter names match `ntp_nemo.models.DecoderLM`, so it starts from exactly the
same (layout-independent) initialisation and the benchmarks can check that both sides do the same
work by comparing loss curves.

Run as a script it is the plain-loop worker (used by throughput.py):

    python bench/_common.py --steps 25 --threads 1 --out plain.jsonl -- mesh.dp=1 mesh.tp=1 ...
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ntp_nemo.schedules import warmup_cosine  # the schedule NTPLanguageModule uses

if __package__ in (None, ""):  # run as `python bench/_common.py` (the plain-loop worker): root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import TINY_DATA, TINY_MODEL, TINY_OPTIM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent

# Overrides every timed run shares: no validation, checkpoints, progress bar or logger inside the timed steps.
QUIET = [
    "trainer.val_every_n_steps=1000000",
    "trainer.progress_bar=false",
    "checkpoint.every_n_steps=0",
    "checkpoint.save_on_end=false",
    "logger=none",
    "callbacks=none",
    "resume=never",
]
SINGLE = ["mesh.dp=1", "mesh.tp=1", "mesh.pp=1", "ntp.replica_tp=null"]

# The toy training job of the CLI benches (the tests' TINY): a 2-layer GPT on the embedded corpus, no
# logger, no validation within a bench's steps.
TOY_JOB = [*TINY_MODEL, *TINY_DATA, *TINY_OPTIM, "trainer.val_every_n_steps=1000000",
           "trainer.progress_bar=false", "logger=none", "callbacks=none"]


# ---- config ---------------------------------------------------------------------------------------
def compose(overrides: Sequence[str]):
    """The DictConfig `ntp-train OVERRIDES` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def model_config(cfg):
    from ntp_nemo.config.model import model_config as of_group

    return of_group(cfg.model)


def build_data_for(cfg):
    from ntp_nemo.data.prepare import build_data

    d = cfg.data
    return build_data(
        d.path,
        d.tokenizer,
        int(d.seq_len),
        int(d.global_batch_size),
        int(cfg.seed),
        float(d.val_fraction),
        int(cfg.model.vocab_size),
    )


def step_tokens(data, step: int, micro_batch_size: int) -> torch.Tensor:
    """All micro-batches of the global batch of `step`: [num_micro, micro_batch_size, seq_len + 1]."""
    import numpy as np

    micro = data.sampler.microbatch_ids(step, micro_batch_size)
    return data.train.batch(np.concatenate(micro)).view(len(micro), micro_batch_size, -1)


# ---- statistics and environment --------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f} (1/5 min) on {os.cpu_count()} CPUs"


def thread_env(threads: int) -> dict[str, str]:
    """Environment that fixes torch's thread count in every process (Lightning leaves OMP_NUM_THREADS alone
    once it is set, and NTPStrategy sets no thread count for a one-process run)."""
    path = os.pathsep.join(filter(None, [str(BENCH), str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=path)


# ---- taking turns ----------------------------------------------------------------------------------
GO_ENV, DONE_ENV = "NTP_BENCH_GO", "NTP_BENCH_DONE"


class Turn:
    """One rank's side of the lockstep (see `run_side_by_side`): wait for a go before each step, report
    after it. Does nothing when the environment names no FIFOs (a run outside the lockstep)."""

    def __init__(self) -> None:
        go, done = os.environ.get(GO_ENV), os.environ.get(DONE_ENV)
        # O_RDWR: opening a FIFO this way never blocks, and writes never fail while this process holds it.
        self._go = os.open(go, os.O_RDWR) if go else None
        self._done = os.open(done, os.O_RDWR) if done else None

    def wait(self) -> None:
        if self._go is not None:
            os.read(self._go, 1)

    def step_done(self) -> None:
        """Report the step and wait for the next go (outside every timed window)."""
        if self._done is not None:
            os.write(self._done, b".")
        self.wait()


def step_probe(path: str):
    """Hydra `_target_` (or direct use) for a callback that records on global rank 0, per training step, the
    wall time and process CPU time from `on_train_batch_start` to `on_train_batch_end` (the window of
    ntp_nemo's `step_time_s`; CPU time is less disturbed by other load on a shared box) and the torch
    thread count, writes them to `path` when training ends, and takes turns (`Turn`) on every rank."""
    from lightning.pytorch.callbacks import Callback

    class StepProbe(Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t0 = self._c0 = 0.0
            self.turn: Turn | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.turn = Turn()  # opened in the worker process, after the launcher forked it
            self.turn.wait()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._c0
            self.steps.append({"step_time_s": wall, "cpu_s": cpu, "time": time.time()})
            # Callbacks run in list order: ntp_nemo's MetricsJSONL has already taken its step time.
            self.turn.step_done()

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                Path(path).write_text(json.dumps({"threads": torch.get_num_threads(), "steps": self.steps}))

    return StepProbe()


@dataclass
class Side:
    """One contender of a side-by-side run: its command, process count and how to read its results."""

    name: str
    ranks: int
    command: list[str]
    env: dict[str, str]
    collect: Callable[[], dict[str, Any]]


def run_side_by_side(sides: Sequence[Side], steps: int, workdir: Path, timeout: float = 1200.0) -> dict:
    """Start every side at once and let them take turns step by step (A B, B A, A B, ...).

    At any moment one side computes while the others wait between steps, and the sides' steps are
    seconds apart, so load from other processes on the machine falls on them alike; alternating who goes
    first avoids always following the same side. Returns each side's collected results.
    """
    fds: dict[tuple[str, str], int] = {}
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    deadline = time.monotonic() + timeout
    try:
        for side in sides:
            for kind in ("go", "done"):
                path = workdir / f"{side.name}.{kind}.fifo"
                os.mkfifo(path)
                fds[side.name, kind] = os.open(path, os.O_RDWR)
            env = {
                **side.env,
                GO_ENV: str(workdir / f"{side.name}.go.fifo"),
                DONE_ENV: str(workdir / f"{side.name}.done.fifo"),
            }
            log = (workdir / f"{side.name}.log").open("w")
            logs.append(log)
            procs[side.name] = subprocess.Popen(
                side.command,
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        for step in range(steps + 1):  # the extra go lets every side finish after its last step
            for side in sides if step % 2 == 0 else sides[::-1]:
                os.write(fds[side.name, "go"], b"." * side.ranks)
                if step < steps:
                    _await(fds[side.name, "done"], side.ranks, procs, side.name, deadline)
        for name, proc in procs.items():
            if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{_tail(workdir / f'{name}.log')}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for fd in fds.values():
            os.close(fd)
        for log in logs:
            log.close()
    return {side.name: side.collect() for side in sides}


def _await(fd: int, count: int, procs: dict[str, subprocess.Popen], name: str, deadline: float) -> None:
    got = 0
    while got < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not finish its step in time")
        exited = [n for n, p in procs.items() if p.poll() is not None]
        if exited:
            raise RuntimeError(f"{exited} exited before the side-by-side run ended (see the logs)")
        if select.select([fd], [], [], 1.0)[0]:
            got += len(os.read(fd, count - got))


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text()[-chars:] if path.exists() else ""


# ---- the sides ------------------------------------------------------------------------------------
def ntp_side(name: str, overrides: Sequence[str], workdir: Path, ranks: int, threads: int) -> Side:
    """The real `ntp-train` CLI; its results are metrics.jsonl's records (plus the probe's CPU times)."""
    run_dir, probe = workdir / name, workdir / f"{name}.probe.json"
    args = [
        *overrides,
        f"hydra.run.dir={run_dir}",
        f"+callbacks.probe._target_={__name__}.step_probe",
        f"+callbacks.probe.path={probe}",
    ]

    def collect() -> dict[str, Any]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        probed = json.loads(probe.read_text())
        for rec, probed_step in zip(records, probed["steps"], strict=True):
            rec["cpu_s"] = probed_step["cpu_s"]
        return {"records": records, "threads": probed["threads"]}

    return Side(name, ranks, [sys.executable, "-m", "ntp_nemo.train", *args], thread_env(threads), collect)


def plain_side(name: str, overrides: Sequence[str], steps: int, workdir: Path, threads: int) -> Side:
    """The plain PyTorch loop of this module in a fresh process."""
    out = workdir / f"{name}.jsonl"
    cmd = [
        sys.executable,
        str(Path(__file__)),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--out",
        str(out),
        "--",
        *overrides,
    ]

    def collect() -> dict[str, Any]:
        lines = out.read_text().splitlines()
        return {
            "records": [json.loads(line) for line in lines[1:]],
            "threads": json.loads(lines[0])["threads"],
        }

    return Side(name, 1, cmd, thread_env(threads), collect)


def paired_ratio(runs_a: Sequence[dict], runs_b: Sequence[dict], key: str, warmup: int) -> float:
    """Median over steps after `warmup` of a[step] / b[step], pairing the steps the sides took in turn."""
    return median(
        [
            x[key] / y[key]
            for a, b in zip(runs_a, runs_b, strict=True)
            for x, y in list(zip(a["records"], b["records"], strict=True))[warmup:]
        ]
    )


def pooled_median(runs: Sequence[dict], key: str, warmup: int) -> float:
    return median([x[key] for run in runs for x in run["records"][warmup:]])


def loss_agreement(runs_a: Sequence[dict], runs_b: Sequence[dict], first: int = 10) -> str:
    """Largest relative loss difference between paired runs, over the first `first` steps and over all
    steps (float32 rounding differences grow over training, most after a loss spike)."""

    def worst(n: int | None) -> float:
        return max(
            abs(x["loss"] - y["loss"]) / abs(y["loss"])
            for a, b in zip(runs_a, runs_b, strict=True)
            for x, y in list(zip(a["records"], b["records"], strict=False))[:n]
        )

    steps = len(runs_a[0]["records"])
    return (
        f"loss curves agree to {worst(first):.1e} over the first {first} steps, "
        f"{worst(None):.1e} over all {steps}"
    )


# ---- the plain model -------------------------------------------------------------------------------
class PlainAttention(nn.Module):
    def __init__(self, h: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = h // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        # `-1` heads: under tensor parallelism the projections hold only this rank's heads.
        q, k, v = (p(x).view(b, s, -1, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class PlainMLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class PlainBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.attn_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.attn = PlainAttention(h, cfg.num_heads)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.mlp = PlainMLP(h, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class PlainGPT(nn.Module):
    """GPT-2-style decoder from stock torch.nn modules (tied embeddings), named like DecoderLM."""

    def __init__(self, cfg) -> None:
        super().__init__()
        if cfg.arch != "gpt2" or not cfg.tie_embeddings:
            raise ValueError("the plain benchmark model covers the GPT-2 architecture with tied embeddings")
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.max_seq_len, h))
        self.blocks = nn.ModuleDict({str(i): PlainBlock(cfg) for i in range(cfg.num_layers)})
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos_embed[: ids.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.final_norm(x))

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def plain_model(cfg, seed: int) -> PlainGPT:
    """A PlainGPT holding exactly ntp_nemo's initialisation for `seed`."""
    from ntp_nemo.models import build_model

    state = build_model(cfg, seed=seed).state_dict()
    model = PlainGPT(cfg)
    model.load_state_dict({**state, "head.weight": state["embed.weight"]})
    return model




def adamw(params: Sequence[nn.Parameter], o, max_steps: int):
    """AdamW with NTPLanguageModule's grouping (weight decay on matrices only) and its LR schedule."""
    params = list(params)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(o.warmup_steps, max_steps, o.min_lr_ratio))
    return opt, sched


# ---- the plain loop --------------------------------------------------------------------------------
def plain_loop(overrides: Sequence[str], steps: int, out: Path) -> None:
    """Train PlainGPT with the config `ntp-train OVERRIDES` would use; one JSON line per step.

    The timed window matches NTPStrategy's `step_time_s` (metrics.jsonl): from the first forward of the
    step's micro-batches to after the optimizer and schedule steps and the loss read-out; fetching the
    batch is outside it, as Lightning fetches before `on_train_batch_start`.
    """
    cfg = compose(overrides)
    data = build_data_for(cfg)
    model = plain_model(model_config(cfg), int(cfg.seed))
    opt, sched = adamw(model.parameters(), cfg.optim, int(cfg.trainer.max_steps))
    mbs = int(cfg.data.micro_batch_size)
    global_tokens = int(cfg.data.global_batch_size) * int(cfg.data.seq_len)
    records = []
    turn = Turn()
    turn.wait()
    for step in range(steps):
        micro = step_tokens(data, step, mbs)
        t0, c0 = time.perf_counter(), time.process_time()
        total = torch.zeros((), dtype=torch.float64)
        for mb in micro:
            loss_sum = model.loss_sum(mb)
            (loss_sum / global_tokens).backward()
            total += loss_sum.detach().double()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        loss = float(total) / global_tokens
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        records.append(
            {
                "step": step + 1,
                "loss": loss,
                "tokens": global_tokens,
                "step_time_s": dt,
                "cpu_s": cpu,
                "time": time.time(),
            }
        )
        turn.step_done()
    lines = [{"threads": torch.get_num_threads()}, *records]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))


def main() -> None:
    ap = argparse.ArgumentParser(description="plain PyTorch training loop worker")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain_loop(args.overrides, args.steps, args.out)


if __name__ == "__main__":
    main()
