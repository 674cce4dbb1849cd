"""Gradient buckets of a SyncPlan in backward order (for the overlapped sync and the distributed optimizer).

A bucket is a run of fragments of one holder set packed into one flat buffer.  Every holder of the
set builds the same buckets (same fragments, same order, same sizes) from the same plan, because the
order is a pure function of the parameter names: layers from the output head back to the embedding
(the order the backward finishes them), then the plan's order (parameter name, then position).  A
bucket is split into `len(holders)` equal chunks (the flat buffer padded to a multiple of the holder
count); holder `i` of the set owns chunk `i` (the distributed optimizer updates it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ntp_nemo.parallel.grad_sync import Fragment, SyncPlan

_LAYER = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def backward_rank(name: str) -> int:
    """Larger = finished earlier by the backward: head and final norm, then layers from last to first,
    then the embeddings (a tied embedding's gradient is complete only after the first layer's backward)."""
    m = _LAYER.search(name)
    if m is not None:
        return int(m.group(1)) + 1
    if name.startswith(("final_norm", "head")):
        return 1 << 30
    return 0


def fragment_view(t: torch.Tensor, f: Fragment) -> torch.Tensor:
    return t if t.dim() == 0 else t.narrow(f.dim, f.start, f.length)


@dataclass(frozen=True)
class Bucket:
    holders: tuple[int, ...]
    frags: tuple[Fragment, ...]
    sizes: tuple[int, ...]  # elements of each fragment
    index: int  # position among the buckets of its holder set (the launch order inside the set's group)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def chunk(self) -> int:
        """Elements each holder owns (the flat buffer padded to `chunk * len(holders)`)."""
        n = len(self.holders)
        return -(-self.numel // n)

    @property
    def padded(self) -> int:
        return self.chunk * len(self.holders)

    def owned(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat buffer that `rank` owns (hi may reach into the padding)."""
        i = self.holders.index(rank)
        return i * self.chunk, (i + 1) * self.chunk

    def pieces(self, lo: int, hi: int):
        """(fragment, offset inside the fragment's flattened view, offset in [lo, hi), length) of every
        fragment overlapping the flat range [lo, hi)."""
        start = 0
        for f, n in zip(self.frags, self.sizes, strict=True):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                yield f, a - start, a - lo, b - a
            start += n


def build_buckets(plan: SyncPlan, params: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """This rank's buckets: holder sets in the plan's global order, each set's fragments in backward order."""
    out: list[Bucket] = []
    for holders in plan.all_holder_sets:
        frags = plan.by_holders.get(holders)
        if not frags:
            continue
        ordered = sorted(frags, key=lambda f: -backward_rank(f.name))  # stable: plan order within a rank
        run: list[Fragment] = []
        sizes: list[int] = []
        nbytes = 0
        for f in ordered:
            p = params[f.name]
            n = fragment_view(p, f).numel()
            run.append(f)
            sizes.append(n)
            nbytes += n * p.element_size()
            if nbytes >= bucket_bytes:
                out.append(Bucket(holders, tuple(run), tuple(sizes), sum(b.holders == holders for b in out)))
                run, sizes, nbytes = [], [], 0
        if run:
            out.append(Bucket(holders, tuple(run), tuple(sizes), sum(b.holders == holders for b in out)))
    return out


def pack(bucket: Bucket, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's weighted gradient fragments as one flat buffer, zero-padded to `bucket.padded`."""
    parts = [(fragment_view(grads[f.name], f) * f.weight).reshape(-1) for f in bucket.frags]
    pad = bucket.padded - bucket.numel
    if pad:
        parts.append(parts[0].new_zeros(pad))
    return torch.cat(parts)


def unpack(bucket: Bucket, flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a full flat bucket buffer back into the fragments of `tensors` (grads or parameters)."""
    offset = 0
    for f, n in zip(bucket.frags, bucket.sizes, strict=True):
        v = fragment_view(tensors[f.name], f)
        v.copy_(flat[offset : offset + n].view(v.shape))
        offset += n
