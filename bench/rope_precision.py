"""Precision of rotary embeddings in bfloat16 against float32, measured against a float64 reference.

    python bench/rope_precision.py [--position 8192] [--head-dim 128] [--theta 500000]

Under `bf16-mixed` the query and key leave their projections in bfloat16 and attention reads them in
bfloat16, so RoPE can run either in bfloat16 (tables and products in the input dtype) or in float32
(then rounded to bfloat16 for attention).  For bfloat16 inputs q, k at positions around `--position`
(Llama 3 8B's head size and theta by default) this prints the error of both against RoPE computed in
float64 from the same inputs, next to the floor (the float64 result rounded once to bfloat16), for the
rotated vectors and for the attention logits q.k / sqrt(d) between a query at the position and keys at
every earlier position of a window.  The angles are computed in float64 in every variant (as
`rope_tables` does), so what differs is only the dtype of the tables and of the products.
"""

from __future__ import annotations

import argparse

import torch

from ntp_nemo.models.transformer import apply_rope, rope_tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--position", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--theta", type=float, default=500000.0)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--window", type=int, default=256, help="positions [position - window, position]")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    lo, hi = args.position - args.window, args.position + 1
    shape = (1, args.heads, hi - lo, args.head_dim)
    q = torch.randn(shape, generator=gen).to(torch.bfloat16)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)

    def rope(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cos, sin = rope_tables(hi, args.head_dim, args.theta, "cpu", dtype)
        return apply_rope(x.to(dtype), cos[lo:], sin[lo:])

    ref_q, ref_k = rope(q, torch.float64), rope(k, torch.float64)
    variants = {
        "floor (float64, rounded once)": (ref_q.to(torch.bfloat16), ref_k.to(torch.bfloat16)),
        "float32, then bfloat16": (rope(q, torch.float32).to(torch.bfloat16),
                                   rope(k, torch.float32).to(torch.bfloat16)),
        "bfloat16": (rope(q, torch.bfloat16), rope(k, torch.bfloat16)),
    }

    def logits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # last query against the window's keys
        return (a[:, :, -1:].double() @ b.double().transpose(-1, -2)) / args.head_dim ** 0.5

    ref_logits = logits(ref_q, ref_k)
    scale = ref_q.abs().mean()
    print(f"RoPE at positions {lo}..{hi - 1}, head dim {args.head_dim}, theta {args.theta:g}, "
          f"{args.heads} heads, bfloat16 inputs; errors against float64 RoPE of the same inputs")
    print(f"{'variant':<30} {'vector max abs':>15} {'vector mean abs':>16} {'logit max abs':>14} "
          f"{'logit mean abs':>15} {'mean / floor':>13}")
    floor = None
    for name, (vq, vk) in variants.items():
        err = (vq.double() - ref_q).abs()
        lerr = (logits(vq, vk) - ref_logits).abs()
        floor = floor if floor is not None else float(err.mean())
        print(f"{name:<30} {float(err.max()):>15.5f} {float(err.mean()):>16.6f} {float(lerr.max()):>14.5f} "
              f"{float(lerr.mean()):>15.6f} {float(err.mean()) / floor:>13.2f}")
    print(f"(mean |q| after RoPE: {float(scale):.4f}; bfloat16 spacing near 1: {2 ** -7:.5f})")


if __name__ == "__main__":
    main()
