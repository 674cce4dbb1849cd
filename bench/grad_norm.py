"""The gradient norm on CPU: `weighted_norm_sq` (ntp_nemo/parallel/grad_sync.py) against the float64-output
foreach norm it used before, over the default recipe's gradient shapes.

    python bench/grad_norm.py [--iters 50] [--rounds 3]

One process, one torch thread.  The tensors have the shapes of gpt_tiny's parameters (`build_model`, the
whole unsharded model: float32, random values in place of gradients); the baseline is
`torch._foreach_norm(ts, 2, dtype=torch.float64)`, squared and summed, which is what `weighted_norm_sq`
called on every device before.  Printed: ms per call of each
(medians over the rounds, the two taking turns), their ratio, and the relative difference of the results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import GPT_TINY  # noqa: E402

from ntp_nemo.models import build_model  # noqa: E402
from ntp_nemo.parallel.grad_sync import weighted_norm_sq  # noqa: E402


def baseline(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).square().sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(p.shape, generator=gen) for p in build_model(GPT_TINY, seed=0).parameters()]
    cpu = torch.device("cpu")
    sides = {"float64 foreach norm (before)": baseline,
             "weighted_norm_sq (now)": lambda t: weighted_norm_sq(t, [1.0] * len(t), torch.float64, cpu)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else list(sides)[::-1]:
            fn = sides[name]
            fn(ts)
            c = time.process_time()
            for _ in range(args.iters):
                fn(ts)
            times[name].append((time.process_time() - c) / args.iters)
    before, now = (statistics.median(times[n]) * 1e3 for n in sides)
    a, b = (float(fn(ts)) for fn in sides.values())
    print(f"grad_norm: {len(ts)} tensors, {sum(t.numel() for t in ts):,} float32 values; ms per call, "
          f"medians of {args.rounds} rounds of {args.iters}")
    for name, ms in zip(sides, (before, now), strict=True):
        print(f" {name:32s} {ms:8.3f}")
    print(f" before / now {before / now:.1f}x; relative difference of the squared norms {abs(a - b) / b:.1e}")


if __name__ == "__main__":
    main()
