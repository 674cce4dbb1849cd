"""Peak memory of the loss on the ~1.2B Llama's head shape: the chunked vocabulary-parallel cross entropy
against the whole-batch versions it replaced, side by side.

    python bench/ce_memory.py [--tokens 2048] [--vocab 128256] [--dtype bf16|fp32] [--baseline-commit REV]

The logits of `--tokens` tokens over `--vocab` columns (the 1.2B head at TP 1: 128256; gpu_check's llama
part holds 8 x 2048 = 16384 tokens of them, 4.2 GB in bf16; the default here is one 2048-token sequence,
so three variants fit a shared CPU box) in `--dtype`, then forward and backward of the summed loss. Each
variant runs in its own fresh process; its figure is the process's peak resident memory (`ru_maxrss`)
during the loss's forward and backward minus its resident memory just before (the logits and targets
already made): what the loss itself needs on top of its input. Large allocations go straight to the
system (glibc's mmap threshold), so the high-water mark sees each one.

Variants: `F.cross_entropy` (the TP 1 path before this change: float32 upcast, log-softmax saved),
`whole` (the TP > 1 path before it: `_VocabParallelCrossEntropy` of `--baseline-commit`, read from git,
run without a group: three whole-batch float32 tensors at its forward's peak, the softmax saved) and
`chunked` (today's `vocab_parallel_cross_entropy`).  Also printed: the largest difference of each
variant's loss and gradient from `F.cross_entropy` in float64 on a smaller shape.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BASELINE_COMMIT = "b091799"  # the last commit with the whole-batch loss


def _baseline_module(rev: str) -> types.ModuleType:
    """`ntp_nemo.parallel.layers` as it was at `rev` (its source from git, run as a module)."""
    src = subprocess.run(["git", "show", f"{rev}:ntp_nemo/parallel/layers.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("layers_baseline")
    exec(compile(src, f"{rev}:ntp_nemo/parallel/layers.py", "exec"), mod.__dict__)  # noqa: S102
    return mod


def loss_fn(variant: str, rev: str):
    from ntp_nemo.parallel.layers import vocab_parallel_cross_entropy
    from ntp_nemo.topology.tp_context import TPContext

    if variant == "F.cross_entropy":
        return lambda x, t: F.cross_entropy(x.float() if x.dtype == torch.bfloat16 else x, t,
                                            reduction="none")
    if variant == "whole":
        old = _baseline_module(rev)._VocabParallelCrossEntropy
        return lambda x, t: old.apply(x, t, 0, None)
    return lambda x, t: vocab_parallel_cross_entropy(x, t, 0, TPContext())


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(variant: str, tokens: int, vocab: int, dtype: str, rev: str) -> None:
    torch.set_num_threads(1)
    fn = loss_fn(variant, rev)
    g = torch.Generator().manual_seed(0)
    # drawn in its own dtype: a float32 draw cast to bf16 would raise the high-water mark before the loss
    x = torch.randn(tokens, vocab, generator=g, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    x.requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    before = rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loss = fn(x, t).sum()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if peak_before > peak - 1:
        print(f"warning: the high-water mark was already {peak_before:.0f} MB before the loss",
              file=sys.stderr)
    print(f"{peak - before:.1f} {x.numel() * x.element_size() / 2**20:.1f} {float(loss.detach()):.6f}")


def exactness(rev: str) -> dict[str, tuple[float, float]]:
    """Largest |loss - ref| and |grad - ref| of each variant against F.cross_entropy in float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 1000, generator=g, dtype=torch.float64) * 4
    t = torch.randint(0, 1000, (300,), generator=g)
    w = torch.linspace(0.5, 2, 300, dtype=torch.float64)
    out = {}
    ref_x = x.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_x, t, reduction="none")
    (ref * w).sum().backward()
    for variant in ("whole", "chunked"):
        xi = x.clone().requires_grad_(True)
        from ntp_nemo.parallel.layers import _VocabParallelCrossEntropy

        if variant == "chunked":
            loss = _VocabParallelCrossEntropy.apply(xi, t, 0, None, 64)  # 5 chunks of 64 tokens
        else:
            loss = loss_fn(variant, rev)(xi, t)
        (loss * w).sum().backward()
        out[variant] = (float((loss.detach() - ref.detach()).abs().max()),
                        float((xi.grad - ref_x.grad).abs().max()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens, args.vocab, args.dtype, args.baseline_commit)
        return 0
    print(f"loss of {args.tokens} tokens x {args.vocab} columns, {args.dtype} logits; baseline "
          f"{args.baseline_commit}; memory on top of the logits, forward + backward, each in a fresh process")
    rows = {}
    for variant in ("F.cross_entropy", "whole", "chunked"):
        res = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab), "--dtype", args.dtype, "--baseline-commit",
                              args.baseline_commit], capture_output=True, text=True, check=True)
        extra, logits_mb, loss = res.stdout.split()
        rows[variant] = float(extra)
        print(f"  {variant:16s} peak extra {float(extra):8.1f} MB  (logits {float(logits_mb):.1f} MB, "
              f"loss {float(loss):.4f}){res.stderr.strip() and '  ' + res.stderr.strip()}")
    for base in ("F.cross_entropy", "whole"):
        print(f"  chunked / {base}: {rows['chunked'] / rows[base]:.3f}")
    for variant, (dl, dg) in exactness(args.baseline_commit).items():
        print(f"  float64 vs F.cross_entropy, {variant}: max |loss diff| {dl:.2e}, max |grad diff| {dg:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
