"""Where a tensor-parallel training step's CPU goes: compute, collectives, Python.

    python bench/step_profile.py [--tp 2] [--dp 1] [--overlap] [--distributed-optimizer] [--steps 8]
                                 [--warmup 2] [--sp] [--precision 32|bf16-mixed]

Runs the training step of `NTPLanguageModule.training_step` (`ntp_nemo/runtime/step.py: train_step`, timed
through its `phase` hook: micro-batch forward/backward, the gradient path's sync, the fused step scalars,
clipping, AdamW) on the
default recipe's model (gpt_tiny: 4 layers, hidden 256, sequence 128, 12 sequences per step in
micro-batches of 2) with `--tp` x `--dp` forked gloo processes (`--dp` replicas of TP `--tp`, one torch
thread each), without Lightning.  Every `torch.distributed` collective the step calls is wrapped:
counted by kind and by the code that called it, and its wall and CPU time summed (a collective's CPU
includes the gloo work it does on the calling thread; its wall includes waiting for the peer).  Printed
per step, medians over the timed steps of rank 0: wall, process CPU, collectives (count, wall, CPU),
the rest (compute and Python) = wall - collective wall, and the CPU of what follows the last backward
(DP gradient sync, norm, clipping, AdamW, zero_grad).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.runtime.step import train_step  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from tests.shapes import adamw, gpt_tiny, llama_tiny  # noqa: E402

WRAPPED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
           "reduce_scatter_tensor", "all_gather", "broadcast", "send", "recv")


def _caller() -> str:
    """The first frame outside torch.distributed and this file: who asked for the collective."""
    for frame in traceback.extract_stack()[-3::-1]:
        if "torch/distributed" not in frame.filename and not frame.filename.endswith("step_profile.py"):
            return f"{Path(frame.filename).name}:{frame.name}"
    return "?"


class CollectiveMeter:
    """Wraps torch.distributed's collectives in this process: counts, wall and CPU seconds per kind."""

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.by_caller: Counter = Counter()
        self.wall = 0.0
        self.cpu = 0.0
        self.bytes = 0
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            t, c = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            if kwargs.get("async_op") and out is not None:
                out.wait()  # counted as blocking: the profile attributes its whole cost here
            self.wall += time.perf_counter() - t
            self.cpu += time.process_time() - c
            self.count[name] += 1
            self.by_caller[_caller()] += 1
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if tensor is not None:
                self.bytes += tensor.numel() * tensor.element_size()
            return out

        return wrapped

    def reset(self) -> None:
        self.count.clear()
        self.by_caller.clear()
        self.wall = self.cpu = 0.0
        self.bytes = 0


def _batch(step: int, micro: int, mbs: int, seq: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    toks = torch.randint(0, vocab, (micro * mbs, seq + 1), generator=gen)
    return list(toks.split(mbs))


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    tp = world // args.dp
    topology = Topology(tp, [tp] * args.dp, [tp] * (cfg.num_layers + 2))
    layout = ResolvedLayout.make(topology, sequence_parallel=args.sp)
    optim = adamw(distributed=args.distributed_optimizer)
    state = assemble(layout, rank, cfg, optim, "cpu", seed=1234, overlap_grad_sync=args.overlap)
    rt = state.runtime
    meter = CollectiveMeter()
    micro = args.global_batch // args.micro_batch
    global_tokens = args.global_batch * args.seq
    rows = []
    losses = []
    marks: dict[str, tuple[float, float]] = {}  # phase -> (wall, CPU) when it ended, this step

    @contextmanager
    def phase(name: str):
        # `train_step`'s phase hook: bf16 autocast around the micro-batches; the end of each phase timed
        bf16 = name == "microbatches" and args.precision == "bf16-mixed"
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            yield
        marks[name] = (time.perf_counter(), time.process_time())

    for step in range(args.warmup + args.steps):
        mbs = [mb for i, mb in enumerate(_batch(step, micro, args.micro_batch, args.seq, cfg.vocab_size))
               if i in rt.my_microbatches(micro)]
        meter.reset()
        t, c = time.perf_counter(), time.process_time()
        result = train_step(state, mbs, global_tokens, max_norm=1.0, phase=phase)
        t_fb, c_fb = marks["microbatches"]
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        losses.append(result.loss)
        if step >= args.warmup:
            rows.append({"wall": wall, "cpu": cpu, "fwd_bwd": t_fb - t, "after_cpu": c + cpu - c_fb,
                         "coll_wall": meter.wall,
                         "coll_cpu": meter.cpu, "collectives": sum(meter.count.values()),
                         "bytes": meter.bytes, "kinds": dict(meter.count),
                         "callers": dict(meter.by_caller)})
    return {"rows": rows, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1, help="DP replicas (each of TP --tp)")
    ap.add_argument("--overlap", action="store_true", help="DP gradient sync overlapped with the backward")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="AdamW state sharded over the DP holders (reduce-scatter, update, all-gather)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    ap.add_argument("--model", default="gpt_tiny", choices=["gpt_tiny", "llama_tiny"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    args = ap.parse_args()
    res = run_workers(worker, args.tp * args.dp, args, timeout_s=300.0)
    rows = res[0]["rows"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    wall, cpu, cw, cc = med("wall"), med("cpu"), med("coll_wall"), med("coll_cpu")
    print(f"step_profile: {args.model} TP{args.tp}{f' DP{args.dp}' if args.dp > 1 else ''}"
          f"{' SP' if args.sp else ''}{' overlapped sync' if args.overlap else ''}"
          f"{' distributed optimizer' if args.distributed_optimizer else ''}"
          f" precision {args.precision}, "
          f"{args.global_batch}x{args.seq} tokens per step in micro-batches of {args.micro_batch}; "
          f"medians over {len(rows)} steps of rank 0")
    print(f"  step wall {wall * 1e3:8.1f} ms   process CPU {cpu * 1e3:8.1f} ms   "
          f"(forward/backward {med('fwd_bwd') * 1e3:.1f} ms wall)")
    print(f"  collectives {int(med('collectives')):4d} per step, {med('bytes') / 1e6:.2f} MB sent in: "
          f"wall {cw * 1e3:8.1f} ms ({cw / wall:.0%} of the step), CPU {cc * 1e3:8.1f} ms ({cc / cpu:.0%})")
    print(f"  compute + Python (wall - collective wall) {(wall - cw) * 1e3:8.1f} ms")
    print(f"  after the last backward (DP sync, norm, clipping, AdamW, zero_grad): CPU "
          f"{med('after_cpu') * 1e3:8.1f} ms")
    print(f"  by kind: {rows[-1]['kinds']}")
    callers = defaultdict(int, rows[-1]["callers"])
    print("  by caller: " + ", ".join(f"{k} {v}" for k, v in sorted(callers.items(), key=lambda kv: -kv[1])))
    print(f"  losses (rank 0): {' '.join(f'{x:.6f}' for x in res[0]['losses'])}")


if __name__ == "__main__":
    main()
