"""Which operators of the training step halve at TP 2 and which do not: torch.profiler, TP 1 against TP 2.

    python bench/op_share.py [--steps 3] [--warmup 2] [--top 25] [--hidden 256]

Runs the training step of `bench/step_profile.py` (gpt_tiny, 12 sequences of 128 tokens in micro-batches
of 2, fp32, AdamW; ntpdirect TP groups as a CPU run has them) on TP 1 (one process) and then on TP 2 (two
forked processes, one torch thread each), each under torch.profiler for `--steps` steps after `--warmup`.
`--hidden` widens the model (FFN 4x, heads of 64), the rest of the step unchanged.  Prints, for rank 0
of each, the self CPU time per step of the operators in three classes and of the
`--top` operators, with the ratio TP2 / TP1 (ideal: 0.5):

- GEMMs and attention (aten::mm, addmm, bmm, the scaled-dot-product kernels): the work that is sharded;
- ntp's autograd functions (the TP regions' forward/backward, the vocabulary-parallel cross entropy):
  their Python, the collectives they call and the waiting for the peer (self time is wall time);
- everything else (norms, activations, adds, copies, views, autograd bookkeeping, the optimizer).

The profiler's own overhead inflates small operators alike at both degrees; the process CPU per step of
the profiled steps is printed beside the sums.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import GPT_TINY, OPTIM, _batch  # noqa: E402

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402

GEMM = ("aten::mm", "aten::addmm", "aten::bmm")


def op_class(key: str) -> str:
    if key in GEMM or "scaled_dot_product" in key:
        return "GEMMs and attention"
    if not key.startswith(("aten::", "autograd::", "torch::", "Optimizer.", "cudaStream", "[")) \
            and key.lstrip("_")[:1].isupper():
        return "ntp autograd functions (Python, collectives, waiting)"
    return "everything else"


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    cfg = dataclasses.replace(GPT_TINY, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                              num_heads=args.hidden // 64)
    layout = ResolvedLayout.make(Topology(world, [world], [world] * (cfg.num_layers + 2)))
    state = assemble(layout, rank, cfg, OPTIM, "cpu", seed=1234)
    rt, model, opt, path = state.runtime, state.model, state.optimizer, state.grad_path
    micro = 12 // 2

    def step(s: int) -> None:
        mbs = _batch(s, micro, 2, 128, cfg.vocab_size)
        path.begin_step(len(mbs))
        loss_sum = rt.train_microbatches(model, mbs, 12 * 128)
        path.finish_sync()
        fused = rt.step_scalars(loss_sum, path.grad_norm_sq_local())
        path.clip_to_norm_(fused[1].sqrt(), 1.0)
        rt.read_step_scalars(fused)
        opt.step()
        opt.zero_grad(set_to_none=False)

    for s in range(args.warmup):
        step(s)
    c = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(args.warmup, args.warmup + args.steps):
            step(s)
    cpu = time.process_time() - c
    ops = {e.key: (e.count / args.steps, e.self_cpu_time_total / 1e3 / args.steps)
           for e in prof.key_averages()}
    return {"ops": ops, "cpu_ms": cpu * 1e3 / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=GPT_TINY.hidden_size)
    args = ap.parse_args()
    one, two = (run_workers(worker, tp, args, timeout_s=600.0)[0] for tp in (1, 2))
    print(f"op_share: gpt_tiny (hidden {args.hidden}), 12x128 tokens per step in micro-batches of 2, fp32; "
          f"rank 0, per step, {args.steps} profiled steps after {args.warmup}")
    print(f"  process CPU (profiled): TP1 {one['cpu_ms']:.1f} ms, TP2 {two['cpu_ms']:.1f} ms, "
          f"ratio {two['cpu_ms'] / one['cpu_ms']:.3f}")
    classes: dict[str, list[float]] = {}
    for side, res in enumerate((one, two)):
        for key, (_, ms) in res["ops"].items():
            classes.setdefault(op_class(key), [0.0, 0.0])[side] += ms
    total = [sum(v[i] for v in classes.values()) for i in (0, 1)]
    print(f"  {'class':56s} {'TP1 ms':>8s} {'TP2 ms':>8s} {'TP2/TP1':>8s} {'TP2 - TP1/2':>12s}")
    for name, (a, b) in sorted(classes.items(), key=lambda kv: -kv[1][1]) + [("all (self time)", total)]:
        ratio = f"{b / a:8.3f}" if a else "       -"
        print(f"  {name:56s} {a:8.1f} {b:8.1f} {ratio} {b - a / 2:12.1f}")
    print(f"  top {args.top} operators by TP2 self time:  calls TP1, TP2   ms TP1, TP2   ratio")
    keys = sorted(set(one["ops"]) | set(two["ops"]), key=lambda k: -two["ops"].get(k, (0, 0.0))[1])
    for key in keys[: args.top]:
        (ca, ma), (cb, mb) = one["ops"].get(key, (0, 0.0)), two["ops"].get(key, (0, 0.0))
        ratio = f"{mb / ma:6.2f}" if ma else "     -"
        print(f"  {key[:48]:48s} {ca:7.0f} {cb:6.0f} {ma:8.1f} {mb:6.1f} {ratio}")


if __name__ == "__main__":
    main()
