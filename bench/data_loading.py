"""Cost of the data side: building the built-in corpus, reopening it, and gathering batches.

    python bench/data_loading.py [--seq-len 256] [--batch 32] [--tokenizer byte]

Builds the corpus in a fresh temporary cache (cold), then again from the cache (warm), and compares
`TokenDataset.batch` (one vectorised gather from the memmap) with stacking `dataset[i]` one by one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _timeit(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokenizer", default="byte")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["NTP_NEMO_CACHE"] = cache
        from ntp_nemo.data.prepare import build_data

        t0 = time.perf_counter()
        data = build_data(None, args.tokenizer, args.seq_len, args.batch, seed=0)
        cold = time.perf_counter() - t0
        warm = _timeit(lambda: build_data(None, args.tokenizer, args.seq_len, args.batch, seed=0), 5)
        ids = [data.sampler.batch_ids(s) for s in range(50)]
        gather = _timeit(lambda: [data.train.batch(b) for b in ids], 3) / len(ids)
        stack = _timeit(lambda: [torch.stack([data.train[int(i)] for i in b]) for b in ids], 3) / len(ids)
        sample = _timeit(lambda: [data.sampler.batch_ids(s) for s in range(1000, 1050)], 3) / 50
    print(f"corpus: {data.num_tokens} tokens ({data.tokenizer_name}), {len(data.train)} train / "
          f"{len(data.val)} val samples of {args.seq_len}")
    print(f"build_data cold (tokenize + cache): {cold:.3f} s")
    print(f"build_data warm (cached):           {warm * 1e3:.1f} ms")
    print(f"sampler.batch_ids per step:         {sample * 1e6:.0f} us")
    print(f"batch gather [{args.batch}x{args.seq_len + 1}]:         {gather * 1e6:.0f} us "
          f"(stacking items: {stack * 1e6:.0f} us, {stack / gather:.1f}x slower)")


if __name__ == "__main__":
    main()
