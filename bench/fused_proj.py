"""Fused projections side by side: the TP training step with q/k/v and gate/up as one GEMM per rank
against the same step with one GEMM per projection (the baseline: `fuse_projections=False`).

    python bench/fused_proj.py [--tp 2] [--model llama_tiny|gpt_tiny] [--sp] [--precision 32|bf16-mixed]
                               [--steps 8] [--warmup 2]
    python bench/fused_proj.py --layer-1b [--tp 8] [--seq 2048] [--precision 32|bf16-mixed] [--steps 8]

Each of `--tp` forked gloo processes (one torch thread) assembles two copies of its model slice from the
same seed (`runtime.assemble`, as a run does), one fused and one not, and runs their training steps
(`runtime/step.py: train_step`, timed through its phase hook: micro-batches, gradient path, step scalars,
clipping, AdamW) alternately on the same batches, so
load on the machine falls on both sides alike.  Printed: medians over the timed steps of rank 0's wall and
process CPU per step, of the forward/backward alone, the GEMM calls per step (counted with a dispatch
mode in one extra untimed step of each side), and how far the two loss curves are apart.

`--layer-1b`: one process, one transformer layer of the ~1.2B Llama recipe's widths (hidden 2048, 16 heads
/ 8 KV heads, MLP 5632) as TP rank 0 of `--tp` holds it (its collectives on a one-process gloo group, so
they cost the same on both sides), forward and backward of one `--seq`-token sequence, the sides
alternating: the GEMM shapes of a real width, where the tiny models' steps are dominated by other work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_nemo.launch.workers import run_workers  # noqa: E402
from ntp_nemo.models.model_config import ModelConfig  # noqa: E402
from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.runtime.step import train_step  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402
from tests.shapes import adamw, gpt_tiny, llama_tiny  # noqa: E402

SIDES = ("fused", "separate")


class GemmCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _batch(step: int, micro: int, mbs: int, seq: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return list(torch.randint(0, vocab, (micro * mbs, seq + 1), generator=gen).split(mbs))


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    cfg = llama_tiny() if args.model == "llama_tiny" else gpt_tiny()
    topology = Topology(world, [world], [world] * (cfg.num_layers + 2))
    layout = ResolvedLayout.make(topology, sequence_parallel=args.sp)
    states = {side: assemble(layout, rank, cfg, adamw(), "cpu", seed=1234) for side in SIDES}
    for side, state in states.items():
        for module in state.model.modules():
            if hasattr(module, "fuse_projections"):
                module.fuse_projections = side == "fused"
    micro = args.global_batch // args.micro_batch
    global_tokens = args.global_batch * args.seq

    def step(side: str, index: int) -> tuple[float, float, float, float]:
        state = states[side]
        mbs = [mb for i, mb in enumerate(_batch(index, micro, args.micro_batch, args.seq, cfg.vocab_size))
               if i in state.runtime.my_microbatches(micro)]
        ended: dict[str, float] = {}  # phase -> process CPU time when it ended

        @contextmanager
        def phase(name: str):
            # `train_step`'s phase hook: bf16 autocast around the micro-batches; the end of each phase timed
            with torch.autocast("cpu", dtype=torch.bfloat16,
                                enabled=name == "microbatches" and args.precision == "bf16-mixed"):
                yield
            ended[name] = time.process_time()

        t, c = time.perf_counter(), time.process_time()
        result = train_step(state, mbs, global_tokens, max_norm=1.0, phase=phase)
        return time.perf_counter() - t, time.process_time() - c, ended["microbatches"] - c, result.loss

    rows: dict[str, list] = {side: [] for side in SIDES}
    losses: dict[str, list] = {side: [] for side in SIDES}
    for index in range(args.warmup + args.steps):
        order = SIDES if index % 2 == 0 else SIDES[::-1]  # alternate which side runs first
        for side in order:
            wall, cpu, fb_cpu, loss = step(side, index)
            losses[side].append(loss)
            if index >= args.warmup:
                rows[side].append((wall, cpu, fb_cpu))
    gemms = {}
    for side in SIDES:
        with GemmCounter() as counter:
            step(side, args.warmup + args.steps)
        gemms[side] = counter.count
    return {"rows": rows, "losses": losses, "gemms": gemms}


def layer_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from ntp_nemo.models.transformer import Block
    from ntp_nemo.topology.tp_context import TPContext

    torch.set_num_threads(1)
    cfg = ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=16,
                      num_kv_heads=8, ffn_hidden_size=5632, max_seq_len=args.seq, tie_embeddings=False)
    ctx = TPContext(size=args.tp, rank=0, group=dist.group.WORLD)
    block = Block(cfg, ctx)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, args.seq, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    from ntp_nemo.models.transformer import rope_tables

    rope = rope_tables(args.seq, cfg.hidden_size // cfg.num_heads, cfg.rope_theta, "cpu", torch.float32)
    cpu: dict[str, list] = {side: [] for side in SIDES}
    for index in range(args.warmup + args.steps):
        for side in (SIDES if index % 2 == 0 else SIDES[::-1]):
            block.attn.fuse_projections = block.mlp.fuse_projections = side == "fused"
            block.zero_grad(set_to_none=True)
            c = time.process_time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
                y = block(x, rope, args.seq)
            y.float().square().mean().backward()
            if index >= args.warmup:
                cpu[side].append(time.process_time() - c)
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters() if p.dim() == 2}
    return {"cpu": cpu, "shapes": shapes}


def layer_main(args: argparse.Namespace) -> None:
    res = run_workers(layer_worker, 1, args, timeout_s=300.0)[0]
    print(f"fused_proj --layer-1b: one Llama layer (hidden 2048, 16/8 heads, MLP 5632) as TP rank 0 of "
          f"{args.tp}, {args.seq} tokens, precision {args.precision}, forward + backward CPU, medians of "
          f"{args.steps}, the sides alternating")
    shapes = res["shapes"].items()
    print("  local weights: " + ", ".join(f"{n.split('.')[-2]} {s[0]}x{s[1]}" for n, s in shapes))
    med = {side: statistics.median(res["cpu"][side]) * 1e3 for side in SIDES}
    for side in SIDES:
        print(f"  {side:10s} {med[side]:8.1f} ms")
    print(f"  fused / separate: {med['fused'] / med['separate']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="llama_tiny", choices=["llama_tiny", "gpt_tiny"])
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--layer-1b", action="store_true", help="one layer of the 1.2B widths, one process")
    args = ap.parse_args()
    if args.layer_1b:
        layer_main(args)
        return
    res = run_workers(worker, args.tp, args, timeout_s=300.0)[0]
    print(f"fused_proj: {args.model} TP{args.tp}{' SP' if args.sp else ''} precision {args.precision}, "
          f"{args.global_batch}x{args.seq} tokens per step in micro-batches of {args.micro_batch}; "
          f"medians over {args.steps} steps of rank 0, the sides alternating")
    print(f" {'side':10s} {'step wall ms':>12s} {'step CPU ms':>12s} {'fwd+bwd CPU ms':>15s} "
          f"{'GEMMs/step':>11s}")
    med = {}
    for side in SIDES:
        rows = res["rows"][side]
        med[side] = [statistics.median(r[i] for r in rows) * 1e3 for i in range(3)]
        print(f" {side:10s} {med[side][0]:12.1f} {med[side][1]:12.1f} {med[side][2]:15.1f} "
              f"{res['gemms'][side]:11d}")
    f, s = med["fused"], med["separate"]
    curves = zip(res["losses"]["fused"], res["losses"]["separate"], strict=True)
    gap = max(abs(a - b) / abs(b) for a, b in curves)
    print(f" fused / separate: step CPU {f[1] / s[1]:.3f}, fwd+bwd CPU {f[2] / s[2]:.3f}, "
          f"wall {f[0] / s[0]:.3f}; loss curves agree to {gap:.1e} (relative) over "
          f"{len(res['losses']['fused'])} steps")


if __name__ == "__main__":
    main()
