"""Start-up cost of a rank's model slice when its values come from a checkpoint: drawn then overwritten
(the former build) against not drawn at all (`build_model(..., initialize=False)`).

    python bench/init_on_resume.py [--tp 8] [--layers 2] [--rounds 2]

Builds one TP rank's slice of a Llama of the ~1.2B recipe's widths (hidden 2048, 16 heads / 8 KV heads,
MLP 5632, vocabulary 128256, untied head; `--layers` of its layers; no process group: the contexts are
made by hand) for ranks 0 and `tp - 1`, three ways, alternately, `--rounds` times:

- former: construct, cast, `initialize_` (the layout-invariant draws), then move to the device: what every
  rank ran before a checkpoint load, whose values then replaced every drawn one;
- fresh: `build_slice(..., seed)`, the build of a fresh start (allocated on the device, then drawn);
- resume: `build_slice(..., None)`, the build when a checkpoint will be loaded: nothing drawn.

The checkpoint load that follows is the same in every case and not timed.  CPU seconds of the process
(one torch thread; steadier than wall time on a shared machine) and wall seconds; medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import llama_1b_slice  # noqa: E402

from ntp_nemo.models.init import build_slice, initialize_  # noqa: E402


def _former(make, device, seed):
    model = make()
    initialize_(model, seed)
    return model.to(device)


def _timed(fn) -> tuple[float, float, torch.nn.Module]:
    c, w = time.process_time(), time.perf_counter()
    model = fn()
    return time.process_time() - c, time.perf_counter() - w, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device, seed = torch.device("cpu"), 1234
    print(f"init_on_resume: Llama widths of the 1.2B recipe, {args.layers} layers, TP {args.tp}, one thread, "
          f"medians of {args.rounds} rounds")
    print(f" {'rank':>4}  {'params':>10}  {'former CPU-s':>12}  {'fresh CPU-s':>11}  {'resume CPU-s':>12}"
          f"  {'resume/former':>13}  {'former wall-s':>13}  {'resume wall-s':>13}  fresh == former")
    for rank in (0, args.tp - 1):
        make = llama_1b_slice(args.layers, args.tp, rank)
        cases = {"former": lambda make=make: _former(make, device, seed),
                 "fresh": lambda make=make: build_slice(make, device, None, seed),
                 "resume": lambda make=make: build_slice(make, device, None, None)}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        wall: dict[str, list[float]] = {k: [] for k in cases}
        same = True
        for _ in range(args.rounds):
            models = {}
            for name, fn in cases.items():
                c, w, models[name] = _timed(fn)
                cpu[name].append(c)
                wall[name].append(w)
            fresh = dict(models["fresh"].named_parameters())
            same = same and all(torch.equal(p, fresh[n]) for n, p in models["former"].named_parameters())
            numel = sum(p.numel() for p in models["resume"].parameters())
            del models
        med = {k: statistics.median(v) for k, v in cpu.items()}
        medw = {k: statistics.median(v) for k, v in wall.items()}
        print(f" {rank:>4}  {numel:>10,}  {med['former']:>12.2f}  {med['fresh']:>11.2f}"
              f"  {med['resume']:>12.3f}  {med['resume'] / med['former']:>13.3f}  {medw['former']:>13.2f}"
              f"  {medw['resume']:>13.3f}  {same}")


if __name__ == "__main__":
    main()
