"""The vocabulary-parallel cross entropy read in chunks of tokens (`parallel.layers`): the value and the
gradient of the unsharded softmax cross entropy, and no float32 copy of the whole batch's logits kept
for the backward (docs/performance.md, ce_memory: the peaks measured)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ntp_nemo.parallel.layers import vocab_parallel_cross_entropy
from ntp_nemo.topology.tp_context import TPContext

BATCH, SEQ, VOCAB = 2, 18, 53  # 36 tokens


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(BATCH, SEQ, VOCAB, generator=g) * 4).to(dtype)
    target = torch.randint(0, VOCAB, logits.shape[:-1], generator=g)
    return logits, target


def _reference(logits, target):
    """Today's unsharded loss (F.cross_entropy on the whole float64 logits) and its gradient."""
    x = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(x.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    weights = torch.linspace(0.5, 2.0, loss.numel(), dtype=loss.dtype).view(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad, weights


@pytest.mark.parametrize("chunk_tokens", [None, 1, 5])
def test_chunked_unsharded_loss_and_gradient_match_in_float64(chunk_tokens):
    logits, target = _data()
    ref_loss, ref_grad, weights = _reference(logits, target)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, 0, TPContext(), chunk_tokens=chunk_tokens)
    (loss * weights).sum().backward()
    assert (loss.detach() - ref_loss).abs().max() < 1e-10
    assert (x.grad - ref_grad).abs().max() < 1e-10


def _sharded_worker(rank: int, world: int, store) -> dict:
    import torch.distributed as dist

    from ntp_nemo.resilience.rendezvous import join
    from ntp_nemo.topology.shard import aligned_interval

    torch.set_num_threads(1)
    join(store, 0, rank, world)
    logits, target = _data()
    ref_loss, ref_grad, weights = _reference(logits, target)
    lo, hi = aligned_interval(rank, world, VOCAB, 1)  # uneven: 18/18/17 columns
    x = logits[..., lo:hi].clone().requires_grad_(True)
    tp = TPContext(size=world, rank=rank, group=dist.group.WORLD)
    loss = vocab_parallel_cross_entropy(x, target, lo, tp, chunk_tokens=4)
    (loss * weights).sum().backward()
    out = {"loss": float((loss.detach() - ref_loss).abs().max()),
           "grad": float((x.grad - ref_grad[..., lo:hi]).abs().max())}
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_chunked_sharded_loss_and_gradient_match_in_float64():
    """Three ranks holding 18/18/17 vocabulary columns, chunks of 4 tokens: the unsharded float64 loss
    and each rank's slice of its gradient to 1e-10."""
    from ntp_nemo.resilience.rendezvous import run_elastic

    results, codes = run_elastic(_sharded_worker, 3, watch=False)
    assert codes == [0, 0, 0]
    for r in results.values():
        assert r["loss"] < 1e-10 and r["grad"] < 1e-10, results


def test_bf16_logits_keep_no_float32_copy_for_the_backward():
    """Under bf16 the loss saves the bf16 logits and per-token statistics, not a float32 softmax of the
    whole batch (the whole-batch version saved 2x the logits' bytes); the gradient comes back in bf16
    and equals the float32 softmax gradient rounded to bf16."""
    logits, target = _data(torch.float32)
    x16 = logits.to(torch.bfloat16).requires_grad_(True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(x16, target, 0, TPContext(), chunk_tokens=7)
    big = [t for t in saved if t.numel() >= x16.numel()]
    assert [t.dtype for t in big] == [torch.bfloat16]  # the logits themselves, nothing in float32
    loss.sum().backward()
    ref = x16.detach().float().requires_grad_(True)
    F.cross_entropy(ref.flatten(0, -2), target.flatten(), reduction="sum").backward()
    assert x16.grad.dtype == torch.bfloat16
    assert (x16.grad.float() - ref.grad.to(torch.bfloat16).float()).abs().max() <= 2 ** -9
