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
    if t.dim() == 0:
        return t
    out = t.narrow(f.dim, f.start, f.length)
    return out.narrow(f.dim2, f.start2, f.length2) if f.dim2 >= 0 else out


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


class BucketBuffers:
    """Persistent flat buffers of a list of buckets, one per bucket (padded to `bucket.padded`, zero
    padding), with one view per fragment: a parameter that is one whole fragment gets its `.grad` as that
    view (`adopt`), so the backward accumulates where the collective reads and no per-step pack copy is
    made; a fragment that is part of its parameter is copied in (`fill`).  Made again when a parameter's
    dtype or device changed (a precision plugin casting the model after the buckets were planned)."""

    def __init__(self, buckets: list[Bucket], params: dict[str, torch.Tensor]) -> None:
        self.buckets, self.params = buckets, params
        self._made: list[tuple[torch.Tensor, list[torch.Tensor], list[bool]]] | None = None
        self._made_for: tuple | None = None

    def all(self) -> list[tuple[torch.Tensor, list[torch.Tensor], list[bool]]]:
        """Per bucket: (flat buffer, one view per fragment, whether the fragment is its whole parameter)."""
        made_for = tuple((p.dtype, p.device) for p in self.params.values())
        if self._made is not None and made_for == self._made_for:
            return self._made
        out = []
        for b in self.buckets:
            params = [self.params[f.name] for f in b.frags]
            buf = torch.zeros(b.padded, dtype=params[0].dtype, device=params[0].device)
            views, whole, offset = [], [], 0
            for f, p, n in zip(b.frags, params, b.sizes, strict=True):
                shape = fragment_view(p, f).shape
                views.append(buf[offset : offset + n].view(shape))
                whole.append(shape == p.shape and p.dtype == buf.dtype and p.device == buf.device)
                offset += n
            out.append((buf, views, whole))
        self._made, self._made_for = out, made_for
        return out

    def adopt(self, name: str, view: torch.Tensor) -> None:
        """`name`'s `.grad` becomes `view`, keeping what it held (zero if it had none)."""
        p = self.params[name]
        if p.grad is view:
            return
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad)
        p.grad = view

    def adopt_all(self) -> None:
        """Point every whole-fragment parameter's `.grad` at its view (before a step's first backward)."""
        for b, (_, views, whole) in zip(self.buckets, self.all(), strict=True):
            for f, v, w in zip(b.frags, views, whole, strict=True):
                if w:
                    self.adopt(f.name, v)

    @torch.no_grad()
    def fill(self, i: int) -> torch.Tensor:
        """Bucket `i`'s buffer holding its weighted gradient fragments (whole fragments in place, parts
        copied in; a missing `.grad` is made, zero); returns the flat buffer."""
        buf, views, whole = self.all()[i]
        for f, v, w in zip(self.buckets[i].frags, views, whole, strict=True):
            p = self.params[f.name]
            if w:
                self.adopt(f.name, v)
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                v.copy_(fragment_view(p.grad, f))
            if f.weight != 1.0:
                v.mul_(f.weight)
        return buf


def unpack(bucket: Bucket, flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a full flat bucket buffer back into the fragments of `tensors` (grads or parameters)."""
    offset = 0
    for f, n in zip(bucket.frags, bucket.sizes, strict=True):
        v = fragment_view(tensors[f.name], f)
        v.copy_(flat[offset : offset + n].view(v.shape))
        offset += n
