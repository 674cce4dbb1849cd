"""Quantisation-aware training vs full precision on the tiny model: validation loss and step-time overhead.

    python bench/qat.py [--steps 150] [--qat-from 100] [--formats int8 fp8] [--json OUT]

One process, one thread, float32, the embedded corpus, `gpt_tiny` (model and optimizer settings of the
default config).  The full-precision run trains all `--steps`; each QAT run branches from it at
`--qat-from` (weights, optimizer and schedule state), max-calibrates on the next `--calib-batches` global
batches (`ntp_nemo.quant.calibrate.quantize_model`, the code the QuantizationCallback runs) and trains the
remaining steps fake-quantised.  Reported side by side at the same step count:

- validation loss: full precision; the full-precision weights quantised after training (PTQ, calibrated
  the same way); QAT (evaluated fake-quantised, as it would be deployed);
- step time of forward+backward on one global batch, fake-quantised vs full precision, measured
  alternately on the same weights (`--timing-reps` pairs; medians), so load from other processes hits both.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from ntp_nemo.data.prepare import build_data
from ntp_nemo.lightning.batches import StepBatches, ValBatches
from ntp_nemo.models import build_model
from ntp_nemo.models.model_config import ModelConfig, OptimConfig


def _optimizer(model: torch.nn.Module, o: OptimConfig, max_steps: int):
    from ntp_nemo.lightning.lm_module import warmup_cosine

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(o.warmup_steps, max_steps, o.min_lr_ratio))
    return opt, sched


class Run:
    """One training run: model, optimizer, schedule and the measured step times."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, o: OptimConfig, max_steps: int) -> None:
        self.model, self.cfg, self.o, self.max_steps = model, cfg, o, max_steps
        self.opt, self.sched = _optimizer(model, o, max_steps)
        self.step_times: list[float] = []

    def fork(self) -> Run:
        """An independent copy at the same point (weights, optimizer moments, schedule position)."""
        run = Run(self.copy_model(), self.cfg, self.o, self.max_steps)
        # A deep copy: load_state_dict keeps the given tensors, so both runs would share Adam's moments.
        run.opt.load_state_dict(copy.deepcopy(self.opt.state_dict()))
        run.sched.load_state_dict(self.sched.state_dict())
        return run

    def copy_model(self) -> torch.nn.Module:
        """A fresh model with these weights (a deep copy would drop the parameters' ShardSpecs)."""
        model = build_model(self.cfg)
        model.load_state_dict(self.model.state_dict())
        return model

    def train_step(self, batch: dict) -> float:
        t0 = time.perf_counter()
        tokens = int(batch["global_tokens"])
        total = 0.0
        for mb in batch["micro"]:
            loss = self.model.loss_sum(mb)
            (loss / tokens).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.o.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step_times.append(time.perf_counter() - t0)
        return total / tokens


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: dict) -> float:
    return sum(float(model.loss_sum(mb)) for mb in val["micro"]) / int(val["global_tokens"])


def _fwd_bwd(model: torch.nn.Module, batch: dict) -> float:
    t0 = time.perf_counter()
    for mb in batch["micro"]:
        (model.loss_sum(mb) / int(batch["global_tokens"])).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def step_time_ratio(fp: torch.nn.Module, q: torch.nn.Module, batch: dict, reps: int) -> tuple[float, float]:
    """Median forward+backward seconds of (full precision, fake-quantised), measured alternately."""
    _fwd_bwd(fp, batch), _fwd_bwd(q, batch)  # warm-up
    pairs = [(_fwd_bwd(fp, batch), _fwd_bwd(q, batch)) for _ in range(reps)]
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def _cell(row: dict, key: str, spec: str, width: int, scale: float = 1.0, unit: str = "") -> str:
    return (format(scale * row[key], spec) + unit if key in row else "-").rjust(width)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--qat-from", type=int, default=100)
    ap.add_argument("--formats", nargs="+", default=["int8", "fp8"])
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--val-batches", type=int, default=8, help="validation micro-batches")
    ap.add_argument("--timing-reps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not 0 <= args.qat_from < args.steps:
        raise SystemExit("--qat-from must be in [0, --steps)")
    torch.set_num_threads(1)
    from ntp_nemo.quant.calibrate import quantize_model

    cfg, o = ModelConfig(), OptimConfig()  # gpt_tiny and the default optimizer
    data = build_data(None, "byte", args.seq_len, args.global_batch, args.seed, 0.05, cfg.vocab_size)
    stream = StepBatches(data.train, data.sampler, args.micro_batch, args.steps, range)
    val = ValBatches(data.val, args.val_batches, args.micro_batch, range)[0]
    fp = Run(build_model(cfg, seed=args.seed), cfg, o, args.steps)

    def calib_batches(step: int) -> list[torch.Tensor]:
        steps = range(step, min(step + args.calib_batches, args.steps))
        return [mb for s in steps for mb in stream[s]["micro"]]

    branches: dict[str, Run] = {}
    for step in range(args.steps):
        if step == args.qat_from:
            for fmt in args.formats:
                branch = fp.fork()
                quantize_model(branch.model, fmt, ["head"], calib_batches(step))
                branches[fmt] = branch
        batch = stream[step]
        fp.train_step(batch)
        for branch in branches.values():
            branch.train_step(batch)

    rows = [{"run": "full precision", "val_loss": val_loss(fp.model, val),
             "step_s": statistics.median(fp.step_times[args.qat_from:])}]
    timing_batch = stream[args.steps - 1]
    for fmt, branch in branches.items():
        ptq = fp.copy_model()
        quantize_model(ptq, fmt, ["head"], calib_batches(args.qat_from))
        t_fp, t_q = step_time_ratio(fp.model, ptq, timing_batch, args.timing_reps)
        rows.append({"run": f"{fmt} PTQ (no QAT)", "val_loss": val_loss(ptq, val)})
        rows.append({"run": f"{fmt} QAT from step {args.qat_from}", "val_loss": val_loss(branch.model, val),
                     "step_s": statistics.median(branch.step_times), "fwd_bwd_fp_s": t_fp, "fwd_bwd_q_s": t_q,
                     "overhead": t_q / t_fp - 1})
    print(f"gpt_tiny, {args.steps} steps of {args.global_batch}x{args.seq_len} tokens, QAT from step "
          f"{args.qat_from}, {args.calib_batches} calibration batches, {args.val_batches}x{args.micro_batch} "
          "validation sequences; 1 thread, float32")
    print(f"{'run':28s} {'val loss':>9s} {'train step s':>13s} {'fwd+bwd fp s':>13s} {'fwd+bwd q s':>12s} "
          f"{'overhead':>9s}")
    for r in rows:
        print(f"{r['run']:28s} {_cell(r, 'val_loss', '.4f', 9)} {_cell(r, 'step_s', '.3f', 13)} "
              f"{_cell(r, 'fwd_bwd_fp_s', '.3f', 13)} {_cell(r, 'fwd_bwd_q_s', '.3f', 12)} "
              f"{_cell(r, 'overhead', '+.0f', 9, 100, '%')}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
