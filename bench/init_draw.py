"""Start-up cost of the layout-invariant initialisation: each rank's draw, slice-only against full draws.

    python bench/init_draw.py [--tp 8] [--layers 2]

Builds one TP rank's slice of a Llama of the ~1.2B recipe's widths (hidden 2048, 16 heads / 8 KV heads,
MLP 5632, vocabulary 128256; `--layers` of its layers, no process group: the contexts are made by hand)
and times `initialize_` (rows of a leading-dim split drawn as a prefix of the parameter's stream) against
the former rule (every parameter drawn whole, then sliced), for ranks 0 and `tp - 1`, checking the values
are equal.  CPU seconds of the process (one torch thread), steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import llama_1b_slice  # noqa: E402

from ntp_nemo.models.init import full_init, initialize_  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"init_draw: Llama widths of the 1.2B recipe, {args.layers} layers, TP {args.tp}, one thread")
    for rank in (0, args.tp - 1):
        model = llama_1b_slice(args.layers, args.tp, rank)()
        t = time.process_time()
        initialize_(model, 1234)
        new = time.process_time() - t
        t = time.process_time()
        former = {}
        with torch.no_grad():
            for name, p in model.named_parameters():  # the former rule: every normal parameter drawn whole
                spec = p.ntp_spec
                if p.ntp_init[0] == "normal":
                    former[name] = spec.narrow(full_init(name, spec.global_shape, p.ntp_init, 1234, p.dtype))
        old = time.process_time() - t
        params = dict(model.named_parameters())
        same = all(torch.equal(v, params[n]) for n, v in former.items())
        print(f"  rank {rank}: slice-only draws {new:6.2f} CPU-s, full draws then slice {old:6.2f} CPU-s "
              f"({old / new:.2f}x), values equal: {same}")


if __name__ == "__main__":
    main()
