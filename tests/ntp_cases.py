"""Shared tiny models and the exactness worker used by the NTP tests (float64 on CPU/gloo)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ntp_nemo.models import build_model
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.shapes import adamw

GPT = ModelConfig(
    arch="gpt2",
    vocab_size=67,
    hidden_size=40,
    num_layers=2,
    num_heads=5,
    ffn_hidden_size=84,
    max_seq_len=16,
    tie_embeddings=True,
)
LLAMA = ModelConfig(
    arch="llama",
    vocab_size=67,
    hidden_size=48,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden_size=70,
    max_seq_len=16,
    tie_embeddings=False,
)
# 8 query heads over 4 KV heads: on 3 ranks the query heads split 2/3/3 and KV heads 1 and 2 are each held
# by two ranks (the balanced split of a degree at most the KV-head count that does not divide it).
LLAMA_KV4 = ModelConfig(
    arch="llama",
    vocab_size=67,
    hidden_size=48,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=70,
    max_seq_len=16,
    tie_embeddings=False,
)
SEQ, GLOBAL_BATCH, SEED = 8, 6, 7
OPTIM = adamw(1e-3)


def assembled(layout: ResolvedLayout, rank: int, cfg: ModelConfig, seed: int = SEED,
              dtype: torch.dtype | None = torch.float64, bucket_mb: float = 25.0
              ) -> tuple[NTPRuntime, torch.nn.Module]:
    """Rank `rank`'s runtime and model slice on `layout`, assembled as a run assembles them
    (`runtime.assemble`: process groups, fragment sync plan, pipeline engine, optimizer)."""
    state = assemble(layout, rank, cfg, OPTIM, None, seed=seed, param_dtype=dtype, bucket_mb=bucket_mb)
    return state.runtime, state.model


def tokens(cfg: ModelConfig, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, seq + 1), generator=gen)


def reference(cfg: ModelConfig, seq: int = SEQ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Unsharded loss (per token), gradients and logits of the whole global batch."""
    model = build_model(cfg, seed=SEED).double()
    toks = tokens(cfg, seq)
    loss = model.loss_sum(toks) / toks[:, 1:].numel()
    loss.backward()
    with torch.no_grad():
        logits = model(toks[:, :-1])
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, logits


def step_against_reference(rt: NTPRuntime, model, cfg: ModelConfig, seq: int = SEQ) -> tuple[range, dict]:
    """One optimizer step's forward/backward + sync of this replica's share of the global batch, and the
    relative errors of the loss and of this rank's gradient slices against the unsharded model."""
    ref_loss, ref_grads, _ = reference(cfg, seq)
    toks = tokens(cfg, seq)
    mine = rt.my_microbatches(GLOBAL_BATCH)  # micro-batch size 1
    total = rt.train_microbatches(model, [toks[i : i + 1] for i in mine], toks[:, 1:].numel())
    rt.sync.sync()
    loss = rt.global_sum(total) / toks[:, 1:].numel()
    grad_err = 0.0
    for name, p in model.named_parameters():
        want = p.ntp_spec.narrow(ref_grads[name])
        # Floor: some gradients are exactly zero in theory (a key bias under softmax) and pure noise here.
        grad_err = max(grad_err, float((p.grad - want).abs().max() / max(float(want.abs().max()), 1e-6)))
    return mine, {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "grad": grad_err}


def exactness_worker(
    rank: int, world: int, cfg: ModelConfig, tp: int, replica_tp: list[int], layer_tp: list[int],
    shard_align: int = 1, seq: int = SEQ, sequence_parallel: bool = False,
) -> dict:
    topo = Topology(tp, replica_tp, layer_tp, shard_align=shard_align)
    rt, model = assembled(ResolvedLayout.make(topo, sequence_parallel=sequence_parallel), rank, cfg)
    mine, worst = step_against_reference(rt, model, cfg, seq)
    if len(mine):
        toks, ref_logits = tokens(cfg, seq), reference(cfg, seq)[2]
        with torch.no_grad():
            logits = model(toks[mine.start : mine.stop, :-1])
        vs = model.vocab_start
        want = ref_logits[mine.start : mine.stop, :, vs : vs + logits.shape[-1]]
        worst["logits"] = float((logits - want).abs().max() / want.abs().max())
    return worst


def relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference of `a`'s tensors from `b`'s, relative to the largest value of the same tensor.  A
    key bias's gradient is zero in theory (softmax ignores a shift shared by a query's scores): it is
    compared in absolute terms (its values are rounding noise, around 1e-20); callers leave its parameter
    out (Adam turns that noise into full-size updates)."""
    return max(float((a[n] - b[n]).abs().max() / (1.0 if n.endswith("k_proj.bias") else b[n].abs().max()))
               for n in b)


@contextlib.contextmanager
def counting_async_launches() -> Iterator[dict[str, int]]:
    """While open, `dist.all_reduce` and `dist.reduce_scatter_single` count their `async_op=True` calls in
    the yielded dict's "async" (in this process: a forked worker's)."""
    calls = {"async": 0}
    original = dist.all_reduce, dist.reduce_scatter_single

    def counting(fn):
        def wrapped(*args, **kwargs):
            calls["async"] += bool(kwargs.get("async_op"))
            return fn(*args, **kwargs)
        return wrapped

    dist.all_reduce, dist.reduce_scatter_single = (counting(f) for f in original)
    try:
        yield calls
    finally:
        dist.all_reduce, dist.reduce_scatter_single = original
