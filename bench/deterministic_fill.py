"""What `trainer.fill_uninitialized_memory` costs: the default recipe's TP1 training step with deterministic
algorithms off, on without torch's fill of new memory (the default on CPU), and on with it.

    python bench/deterministic_fill.py [--steps 30] [--warmup 4]

One process, one torch thread, gpt_tiny (4 layers, hidden 256, 12 sequences of 128 tokens per step in
micro-batches of 2) assembled at TP 1 on a one-rank gloo group, stepped as `NTPLanguageModule` steps it
(micro-batch forward/backward, gradient path, fused scalars, clipping, AdamW) without Lightning.  The three
settings take turns step by step (the flags are switched between steps), so load on the machine falls on
them alike.  Printed: the median process CPU per step of each setting after the warm-up, and the median
of the per-step ratios against "off" (each step against the "off" step next to it in time).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import GPT_TINY, OPTIM, _batch  # noqa: E402

from ntp_nemo.runtime.assemble import assemble  # noqa: E402
from ntp_nemo.runtime.step import train_step  # noqa: E402
from ntp_nemo.topology import ResolvedLayout, Topology  # noqa: E402

SETTINGS = {"off": (False, False), "on, no fill": (True, False), "on, fill": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="steps of each setting")
    ap.add_argument("--warmup", type=int, default=4, help="steps of each setting left out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = GPT_TINY
    layout = ResolvedLayout.make(Topology(1, [1], [1] * (cfg.num_layers + 2)))
    state = assemble(layout, 0, cfg, OPTIM, "cpu", seed=1234)
    cpu: dict[str, list[float]] = {name: [] for name in SETTINGS}
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    try:
        for step in range(args.steps):
            micro = _batch(step, 6, 2, 128, cfg.vocab_size)
            names = list(SETTINGS) if step % 2 == 0 else list(SETTINGS)[::-1]
            for name in names:
                deterministic, fill = SETTINGS[name]
                torch.use_deterministic_algorithms(deterministic)
                torch.utils.deterministic.fill_uninitialized_memory = fill
                c = time.process_time()
                train_step(state, micro, 12 * 128, max_norm=1.0)
                cpu[name].append(time.process_time() - c)
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
        dist.destroy_process_group()
    w = args.warmup
    print(f"deterministic_fill: gpt_tiny TP1 step, {args.steps - w} steps per setting after {w} of warm-up, "
          "settings in turns")
    print(f" {'setting':14s} {'CPU ms/step':>12s} {'/ off (paired)':>15s}")
    for name, values in cpu.items():
        ratio = statistics.median(a / b for a, b in zip(values[w:], cpu["off"][w:], strict=True))
        print(f" {name:14s} {statistics.median(values[w:]) * 1e3:12.1f} {ratio:15.3f}")


if __name__ == "__main__":
    main()
