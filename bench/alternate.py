"""Kinds of one training stepped in turns on the same batches, in a forked rank (the side-by-side loop of
`bench/tp_overlap.py` and `bench/compile_blocks.py`), and their comparison across ranks.

Each round runs one step of each kind, the kind that goes first swapping from round to round, a barrier
before every step; a step's wall time and process CPU are taken around `runtime.step.train_step`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ntp_nemo.runtime.step import train_step


def batch(step: int, n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """The tokens of round `step`, the same for every kind and rank."""
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, vocab, (n, seq + 1), generator=gen)


def alternate(states: dict[str, Any], vocab: int, args: Any, seed: int,
              before: Callable[[str], None] | None = None,
              after: Callable[[str, int], None] | None = None) -> dict:
    """Step every kind of `states` (name -> an assembled `RankState`) `args.warmup + args.rounds` times in
    turns on `args.global_batch` sequences of `args.seq` tokens in micro-batches of `args.micro_batch`.
    `before(kind)` runs just before a step's clock starts, `after(kind, step)` just after it stops.
    Returns per kind: `wall` and `cpu` of the rounds after the warm-up, every step's `losses`, and `first`
    (wall, CPU) of the first step."""
    kinds = tuple(states)
    micro = args.global_batch // args.micro_batch
    out: dict[str, dict[str, Any]] = {key: {k: [] for k in kinds} for key in ("wall", "cpu", "losses")}
    out["first"] = {}
    for step in range(args.warmup + args.rounds):
        toks = batch(step, args.global_batch, args.seq, vocab, seed)
        for kind in kinds if step % 2 == 0 else kinds[::-1]:
            state = states[kind]
            mb = args.micro_batch
            mbs = [toks[i * mb : (i + 1) * mb] for i in state.my_microbatches(micro)]
            dist.barrier()
            if before is not None:
                before(kind)
            t, c = time.perf_counter(), time.process_time()
            result = train_step(state, mbs, toks[:, 1:].numel(), max_norm=1.0)
            w, u = time.perf_counter() - t, time.process_time() - c
            if after is not None:
                after(kind, step)
            out["losses"][kind].append(result.loss)
            if step == 0:
                out["first"][kind] = (w, u)
            if step >= args.warmup:
                out["wall"][kind].append(w)
                out["cpu"][kind].append(u)
    return out


def compare(results: Sequence[dict], base: str, other: str) -> tuple[dict[str, float], float]:
    """(median step time per kind, median of each round's other/base ratio) over the ranks' `alternate`
    results: a step's time is its slowest rank's."""
    steps = {kind: [max(ts) for ts in zip(*(r["wall"][kind] for r in results), strict=True)]
             for kind in (base, other)}
    med = {kind: statistics.median(ts) for kind, ts in steps.items()}
    return med, statistics.median(a / b for a, b in zip(steps[other], steps[base], strict=True))
