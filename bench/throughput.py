"""Training throughput: ntp_nemo's tensor parallelism vs Lightning's own ModelParallelStrategy (DTensor),
and ntp_nemo at TP 1 vs a plain PyTorch loop.

    python bench/throughput.py [--rounds 2] [--steps 25] [--warmup 5] [--tp 2] [--pairs tp,tp1]

Sides, all on the default recipe's model (gpt_tiny), data, global batch (12 x 128 tokens in micro-batches
of 2), AdamW + warmup-cosine and initial weights, one torch thread per process, gloo on CPU:
- `ntp TP{n}`: the real `ntp-train` CLI, `mesh.dp=1 mesh.tp=n` (NTPStrategy forks n workers);
- `dtensor TP{n}`: a Lightning Trainer with `ModelParallelStrategy(data_parallel_size=1,
  tensor_parallel_size=n)` under torchrun; `configure_model` applies `parallelize_module` to a plain
  GPT-2-style model of the same shapes (`bench/_common.PlainGPT`: column-parallel q/k/v/fc1,
  row-parallel o/fc2, vocabulary-parallel embedding and tied head, `loss_parallel` cross entropy;
  norms and position embeddings replicated, no sequence parallelism: the same collectives as
  Megatron-style TP). The training step mirrors NTPLanguageModule's (manual optimisation over the
  step's micro-batches, loss normalised by the global token count, gradient clipping at 1.0, AdamW,
  schedule, logging the loss and the gradient norm);
- `ntp TP1` and `plain TP1`: `ntp-train` on one process and the plain loop of `bench/_common.py`;
- pair `sp`: `ntp TP{n}` against `ntp TP{n} SP` (`ntp.sequence_parallel=true`), the same CLI;
- pair `scaling`: `ntp TP{n}` against `ntp TP1`, the same CLI: TP{n}'s efficiency (the TP1 step over n
  times the TP{n} step) and each TP{n} rank's CPU per step over the TP1 step's, both paired step by step.
The two sides of a pair run at once and take turns step by step, so load from other processes falls on
both alike. Each step is timed from `on_train_batch_start` to `on_train_batch_end` (ntp: metrics.jsonl
`step_time_s`); tokens/s = tokens per step / median step time after the warm-up, over all rounds; the
ratios are medians of per-step ratios (each step against the other side's step next to it in time).
The goals ("A fast step"): ntp TP2 / dtensor TP2 >= 2.0, ntp TP1 / plain >= 1.0, TP2 efficiency
>= 0.60 and TP2 rank CPU / TP1 CPU <= 0.6.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path, for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import (  # noqa: E402
    QUIET,
    SINGLE,
    Side,
    adamw,
    build_data_for,
    compose,
    load_average,
    loss_agreement,
    model_config,
    ntp_side,
    paired_ratio,
    plain_model,
    plain_side,
    pooled_median,
    run_side_by_side,
    step_probe,
    step_tokens,
    thread_env,
)


# ---- the DTensor side (runs under torchrun) ---------------------------------------------------------
def parallelize(model, mesh) -> None:
    """Megatron-style TP of PlainGPT with torch's DTensor plans (vocabulary-parallel embedding and head)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in model.blocks:
        plan.update(
            {
                f"blocks.{i}.attn.q_proj": ColwiseParallel(),
                f"blocks.{i}.attn.k_proj": ColwiseParallel(),
                f"blocks.{i}.attn.v_proj": ColwiseParallel(),
                f"blocks.{i}.attn.o_proj": RowwiseParallel(),
                f"blocks.{i}.mlp.up_proj": ColwiseParallel(),
                f"blocks.{i}.mlp.down_proj": RowwiseParallel(),
            }
        )
    parallelize_module(model, mesh, plan)
    model.head.weight = model.embed.weight  # both Shard(0) over the vocabulary: keep them tied


def clip_grad_norm_(params, max_norm: float) -> float:
    """Clip by the norm of the whole (unsharded) gradient; DTensor and plain gradients are summed apart
    because torch's norm utilities do not mix the two types."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    dist_grads = [g for g in grads if isinstance(g, DTensor)]
    local = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.nn.utils.get_total_norm(local).double() ** 2 if local else torch.zeros((), dtype=torch.float64)
    if dist_grads:
        sq = sq + torch.nn.utils.get_total_norm(dist_grads).full_tensor().double() ** 2
    norm = float(sq.sqrt())
    if norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def dtensor_worker(overrides: list[str], steps: int, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.data import DataLoader, Dataset

    torch.set_num_threads(1)
    cfg = compose(overrides)
    data = build_data_for(cfg)
    mbs = int(cfg.data.micro_batch_size)
    global_tokens = int(cfg.data.global_batch_size) * int(cfg.data.seq_len)

    class Steps(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, step: int) -> torch.Tensor:
            return step_tokens(data, step, mbs)

    class DTensorGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = plain_model(model_config(cfg), int(cfg.seed))
                parallelize(self.model, self.device_mesh["tensor_parallel"])

        def configure_optimizers(self):
            opt, sched = adamw(self.model.parameters(), cfg.optim, int(cfg.trainer.max_steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Steps(), batch_size=None, shuffle=False, num_workers=0)

        def training_step(self, micro: torch.Tensor, batch_idx: int) -> dict:
            opt, sched = self.optimizers(), self.lr_schedulers()
            total = torch.zeros((), dtype=torch.float64)
            for mb in micro:
                with loss_parallel():
                    logits = self.model(mb[:, :-1])
                    loss_sum = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), mb[:, 1:].flatten(), reduction="sum"
                    )
                    self.manual_backward(loss_sum / global_tokens)
                total += loss_sum.detach().full_tensor().double()
            grad_norm = clip_grad_norm_(list(self.model.parameters()), float(cfg.optim.grad_clip))
            opt.step()
            opt.zero_grad()
            sched.step()
            loss = float(total) / global_tokens
            self.losses.append(loss)
            self.log("train/loss", loss, prog_bar=True, rank_zero_only=True, batch_size=1)
            self.log("train/grad_norm", grad_norm, rank_zero_only=True, batch_size=1)
            return {"loss": torch.tensor(loss)}

    tp = int(os.environ["WORLD_SIZE"])
    probe_path = out.with_suffix(".probe.json")
    probe = step_probe(str(probe_path))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=tp,
        strategy=ModelParallelStrategy(1, tp),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[probe],
        default_root_dir=str(out.parent),
    )
    module = DTensorGPT()
    trainer.fit(module)
    if trainer.is_global_zero:
        probed = json.loads(probe_path.read_text())
        records = [
            {**s, "step": i + 1, "loss": loss, "tokens": global_tokens}
            for i, (s, loss) in enumerate(zip(probed["steps"], module.losses, strict=True))
        ]
        out.write_text(json.dumps({"threads": probed["threads"], "records": records}))


def dtensor_side(name: str, overrides: list[str], steps: int, tp: int, work: Path) -> Side:
    """Lightning + ModelParallelStrategy under torchrun (which also sets one thread per process)."""
    out = work / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        str(Path(__file__).resolve()),
        "--dtensor-worker",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--",
        *overrides,
    ]
    return Side(name, tp, cmd, thread_env(1), lambda: json.loads(out.read_text()))


# ---- the comparison ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="side-by-side runs of each pair")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the figures")
    ap.add_argument("--tp", type=int, default=2, help="TP degree (= processes) of the ntp and DTensor sides")
    ap.add_argument("--pairs", default="tp,tp1,scaling",
                    help="tp: ntp vs DTensor at --tp; tp1: ntp vs plain loop; sp: ntp with SP vs without; "
                         "scaling: ntp at --tp vs ntp TP1")
    ap.add_argument("--dtensor-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra ntp-train overrides applied to every side")
    args = ap.parse_args()
    if args.dtensor_worker:
        dtensor_worker(args.overrides, args.steps, args.out)
        return
    base = [*QUIET, f"trainer.max_steps={args.steps}", *args.overrides]
    tp_overrides = ["mesh.dp=1", f"mesh.tp={args.tp}", "mesh.pp=1", "ntp.replica_tp=null", *base]
    one_overrides = [*SINGLE, *base]
    pairs = {
        "tp": lambda w: [
            ntp_side(f"ntp TP{args.tp}", tp_overrides, w, args.tp, 1),
            dtensor_side(f"dtensor TP{args.tp}", tp_overrides, args.steps, args.tp, w),
        ],
        "tp1": lambda w: [
            ntp_side("ntp TP1", one_overrides, w, 1, 1),
            plain_side("plain TP1", one_overrides, args.steps, w, 1),
        ],
        "sp": lambda w: [
            ntp_side(f"ntp TP{args.tp} SP", [*tp_overrides, "ntp.sequence_parallel=true"], w, args.tp, 1),
            ntp_side(f"ntp TP{args.tp}", tp_overrides, w, args.tp, 1),
        ],
        "scaling": lambda w: [
            ntp_side(f"ntp TP{args.tp}", tp_overrides, w, args.tp, 1),
            ntp_side("ntp TP1", one_overrides, w, 1, 1),
        ],
    }
    chosen = [p for p in args.pairs.split(",") if p]
    print(
        f"throughput: pairs {chosen}, {args.rounds} rounds x {args.steps} steps taken in turns "
        f"(warm-up {args.warmup}); TP overrides {' '.join(tp_overrides)}; load average {load_average()}",
        flush=True,
    )
    runs: dict[tuple[str, str], list[dict]] = {}  # (pair, side): one result per round
    for r in range(args.rounds):
        for pair in chosen if r % 2 == 0 else chosen[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                sides = pairs[pair](Path(tmp))
                result = run_side_by_side(sides if r % 2 == 0 else sides[::-1], args.steps, Path(tmp))
            for name, res in result.items():
                runs.setdefault((pair, name), []).append(res)
                step, cpu = (pooled_median([res], key, args.warmup) * 1e3 for key in ("step_time_s", "cpu_s"))
                print(
                    f"  round {r} {pair:8s} {name:12s}: step {step:7.1f} ms  cpu {cpu:7.1f} ms  "
                    f"(threads {res['threads']})",
                    flush=True,
                )
    print(
        f"\nresult: medians over {args.rounds} x {args.steps - args.warmup} steps per side; "
        f"load average now {load_average()}"
    )
    print(f" {'pair':8s} {'side':14s} {'step ms':>9s} {'tokens/s':>9s} {'rank-0 CPU ms':>14s} "
          f"{'tokens/CPU-s':>13s}")
    for (pair, name), results in runs.items():
        step, cpu = (pooled_median(results, key, args.warmup) for key in ("step_time_s", "cpu_s"))
        tokens = results[0]["records"][0]["tokens"]
        print(f" {pair:8s} {name:14s} {step * 1e3:9.1f} {tokens / step:9.0f} {cpu * 1e3:14.1f} "
              f"{tokens / cpu:13.0f}")
    tp, one = f"ntp TP{args.tp}", "ntp TP1"
    for pair, a, b, goal in (
        ("tp", tp, f"dtensor TP{args.tp}", " (goal >= 2.0)"),
        ("tp1", one, "plain TP1", " (goal >= 1.0)"),
        ("sp", f"{tp} SP", tp, " (sequence parallelism on / off)"),
    ):
        if (pair, a) in runs:
            # tokens/s ratio a/b = step time b/a, paired step by step.
            ratio = paired_ratio(runs[pair, b], runs[pair, a], "step_time_s", args.warmup)
            cpu_ratio = paired_ratio(runs[pair, b], runs[pair, a], "cpu_s", args.warmup)
            print(
                f" {a} / {b}: tokens/s ratio {ratio:.3f}{goal}, by CPU time {cpu_ratio:.3f}; "
                f"{loss_agreement(runs[pair, a], runs[pair, b])}"
            )
    if ("scaling", tp) in runs:
        one_runs, tp_runs = runs["scaling", one], runs["scaling", tp]
        efficiency = paired_ratio(one_runs, tp_runs, "step_time_s", args.warmup) / args.tp
        cpu_share = paired_ratio(tp_runs, one_runs, "cpu_s", args.warmup)
        print(
            f" {tp} against {one}: efficiency (TP1 step / ({args.tp} x TP{args.tp} step)) {efficiency:.3f} "
            f"(goal >= 0.60); rank-0 CPU per step / TP1 step's {cpu_share:.3f} (goal <= 0.6); "
            f"{loss_agreement(tp_runs, one_runs)}"
        )


if __name__ == "__main__":
    main()
