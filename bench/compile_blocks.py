"""Compiled transformer blocks (`trainer.compile=true`) against the eager model, in the same run.

    python bench/compile_blocks.py [--tps 1,2] [--rounds 10] [--warmup 2] [--model gpt_tiny|llama_tiny]
                                   [--seq 128] [--global-batch 12] [--micro-batch 2]

Per TP degree of `--tps`, that many forked gloo processes (one torch thread each) each assemble the model
twice from the same seed, blocks eager and compiled (`runtime.assemble(..., compile=True)`: each `Block`
compiled by inductor, `runtime/compile.py`), and train both through `runtime.step.train_step` (AdamW,
clipping at 1.0) on the same batches, alternating: each round runs one step of each kind, the kind that
goes first swapping from round to round; a barrier precedes every step. The first `--warmup` rounds are
not timed; the compiled model's first step (which compiles the blocks' forward and backward) is printed
on its own: its wall time (the same on every rank, as the step ends in an all-reduce) and each rank's own
process CPU time in it (Dynamo's tracing and AOT autograd; inductor's compile workers and gcc run in
other processes and are not counted). The ranks of a degree share one fresh inductor cache directory, as
the ranks of a run share the default one. A step's wall time is the slowest rank's; printed: medians over
the timed rounds, the ratio of the medians compiled/eager (below 1: compiled is faster), the median of
each round's ratio (`paired`), and the largest relative difference of the two kinds' losses. The load
average before and after is printed: on a shared machine the figures move with it.

`--explain` instead prints, for TP `--tps`' last degree, what `torch._dynamo.explain` makes of one block's
forward (graphs, graph breaks, the first break's reason) in each TP mode: plain, sequence parallel,
`ntp.tp_overlap`, both (Dynamo only, nothing compiled by inductor): why `trainer.compile` refuses the
last three.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.alternate import alternate, compare  # noqa: E402
from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from tests.shapes import adamw, gpt_tiny, llama_tiny  # noqa: E402

KINDS = ("eager", "compiled")


def worker(rank: int, world: int, args: argparse.Namespace, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch.set_num_threads(1)
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    layout = ResolvedLayout.make(Topology(world, [world], [world] * (cfg.num_layers + 2)),
                                 num_microbatches=args.global_batch // args.micro_batch)
    states = {kind: assemble(layout, rank, cfg, adamw(), "cpu", seed=1234, compile=kind == "compiled")
              for kind in KINDS}
    out = alternate(states, cfg.vocab_size, args, 3000)
    return {**out, "first": out["first"]["compiled"]}


MODES = {"tp": (False, False), "sp": (True, False), "tp_overlap": (False, True),
         "sp+tp_overlap": (True, True)}  # mode: (sequence parallel, tp_overlap)


def explain_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch._dynamo

    torch.set_num_threads(1)
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    out = {}
    for mode, (sp, overlap) in MODES.items():
        layout = ResolvedLayout.make(Topology(world, [world], [world] * (cfg.num_layers + 2)),
                                     num_microbatches=1, sequence_parallel=sp)
        model = assemble(layout, rank, cfg, adamw(), "cpu", seed=1234, tp_overlap=overlap).model
        block = model.blocks["0"]
        lo, hi = model.hidden_interval(0, args.seq)
        x = torch.randn(args.micro_batch, hi - lo, cfg.hidden_size, requires_grad=True)
        torch._dynamo.reset()
        ex = torch._dynamo.explain(block.forward)(x, model._rope(x), args.seq)
        lines = [ln.strip() for ln in str(ex.break_reasons[0].reason).splitlines() if ln.strip()] \
            if ex.break_reasons else []
        first = "; ".join(lines[:1] + [ln for ln in lines if "target:" in ln][:1])
        out[mode] = (ex.graph_count, ex.graph_break_count, first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tps", default="1,2", help="comma-separated TP degrees (one replica each)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default="gpt_tiny", choices=["gpt_tiny", "llama_tiny"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--explain", action="store_true", help="graph breaks of one block per TP mode, no timing")
    args = ap.parse_args()
    if args.explain:
        tp = int(args.tps.split(",")[-1])
        res = run_workers(explain_worker, tp, args, timeout_s=600.0)
        print(f"torch._dynamo.explain of block 0's forward, {args.model}, TP{tp}, rank 0 "
              f"(torch {torch.__version__})")
        for mode, (graphs, breaks, first) in res[0].items():
            print(f"{mode:<14} graphs {graphs:>2}  breaks {breaks:>2}  {first}")
        return
    print(f"compile_blocks: {args.model}, {args.global_batch}x{args.seq} tokens per step in micro-batches "
          f"of {args.micro_batch}; gloo, 1 thread per rank; {args.rounds} rounds after {args.warmup} "
          f"warm-up, eager/compiled alternating; torch {torch.__version__}; load average before: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'TP':<4} {'eager ms':>9} {'compiled ms':>12} {'c/e':>6} {'paired':>7}   first compiled step "
          "(s): wall, CPU per rank   losses compiled vs eager")
    for tp in (int(t) for t in args.tps.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            res = run_workers(worker, tp, args, cache, timeout_s=600.0)
        med, paired = compare(res, "eager", "compiled")
        cpus = " ".join(f"r{i} {r['first'][1]:.1f}" for i, r in enumerate(res))
        first = f"{res[0]['first'][0]:.1f}, {cpus}"
        ls = res[0]["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(ls["compiled"], ls["eager"], strict=True))
        print(f"{tp:<4} {med['eager'] * 1e3:>9.1f} {med['compiled'] * 1e3:>12.1f} "
              f"{med['compiled'] / med['eager']:>6.3f} {paired:>7.3f}   {first:<26} max rel diff {rel:.1e}",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
