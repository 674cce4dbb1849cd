"""GPT-2- and Llama-style decoders as plain PyTorch modules.

The same class runs unsharded and sharded: its linear and embedding layers are the
tensor-parallel layers of `ntp_nemo.parallel`, which degrade to ordinary layers under a
single-device plan.  Attention is sharded by query heads (each rank keeps the grouped-query KV
heads its query heads read; a KV head shared by two ranks is held by both), the MLP by hidden
columns, the vocabulary by rows; norms are replicated.  Under sequence parallelism
(`TPContext.sequence_parallel`) the replicated regions (norms, dropout, residual adds) hold each TP
rank's slice of the sequence, and the hidden state entering layout slot `k` is in the split of slot
`k - 1`'s context (the embedding's for the first layer), re-split where the degree changes
(`ntp_nemo.parallel.sequence`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ntp_nemo.models.families import family_of
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.models.tp_contexts import SingleDevicePlan, TPPlan
from ntp_nemo.parallel.block import (
    BlockEmbedding,
    BlockLinear,
    block_linear,
    feature_param,
    grid_norm,
    grid_sum,
    intervals,
    relayout,
    row_axis,
    rows_of,
)
from ntp_nemo.parallel.chunks import Launched
from ntp_nemo.parallel.comm import copy_to_tp, to_compute_dtype
from ntp_nemo.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    replicated_param,
    vocab_parallel_cross_entropy,
)
from ntp_nemo.parallel.sequence import (
    ReplicatedGradReducer,
    gather_and_project,
    replicated_grad_sum,
    resplit_sequence,
    seq_interval,
    seq_split,
)
from ntp_nemo.topology.grid import is_grid
from ntp_nemo.topology.tp_context import TPContext


class Norm(nn.Module):
    """LayerNorm (GPT-2) or RMSNorm (Llama); replicated on every rank."""

    def __init__(self, dim: int, tp: TPContext, *, rms: bool, eps: float, bias: bool) -> None:
        super().__init__()
        self.rms, self.eps, self.tp, self.dim = rms, eps, tp, dim
        # On a grid (block pattern) the features are split along grid columns, held by every grid row.
        make = (lambda init: feature_param((dim,), 0, tp, init)) if is_grid(tp) else (
            lambda init: replicated_param((dim,), tp, init))
        self.weight = make(("ones",))
        self.bias = make(("zeros",)) if bias else None
        self.grad_reducer = None  # the model's ReplicatedGradReducer under SP (set by the model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_grid(self.tp):
            return grid_norm(x, self.weight, self.bias, self.tp, self.dim, rms=self.rms, eps=self.eps)
        weight = replicated_grad_sum(self.weight, self.tp, self.grad_reducer)
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        bias = replicated_grad_sum(self.bias, self.tp, self.grad_reducer) if self.bias is not None else None
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)


def attention_head_intervals(num_heads: int, num_kv_heads: int, tp: TPContext) -> tuple[tuple, tuple]:
    """(query-head interval, KV-head interval) held by this rank.

    Query heads are the units (balanced contiguous intervals, like every other unit), so no rank of a
    group carries more than one query head above its peers; each rank keeps the KV heads its query
    heads read, and a KV head whose query heads span two ranks is held by both (its gradient is summed
    over its holders by the gradient sync).  Splitting whole KV groups instead would give one of 7 ranks
    two of Llama-3-8B's 8 groups: twice its peers' attention.  With shard weights (`tp.weights`) the query
    heads are split in proportion to them, and the KV heads follow the query heads alike.
    """
    group = num_heads // num_kv_heads
    qlo, qhi = tp.interval(num_heads)
    return (qlo, qhi), (qlo // group, (qhi - 1) // group + 1)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables `apply_rope` takes, [seq_len, head_dim] each: cos(angle) over both halves of a
    head, and sin(angle) with its first half negated (the rotate-half layout's sign, folded into the
    table once instead of a negation of every q and k).  The angles are computed in float64."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv)
    sin = ang.sin()
    return torch.cat([ang, ang], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def rope_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype RoPE computes in: at least float32.  Measured (docs/performance.md, "rope_precision", Llama 3
    8B heads at positions 7936..8192, bfloat16 inputs, against float64 RoPE): computing in bfloat16 gives
    a mean error of 0.00180 on the rotated vectors (1.60x the 0.00112 of rounding the exact result once)
    and 0.00292 on the attention logits (against 0.00186); computing in float32 and rounding the result
    to bfloat16 matches the once-rounded floor (1.00x)."""
    return torch.promote_types(dtype, torch.float32)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


class _Rotate(torch.autograd.Function):
    """y = x * cos + swap(x) * sin (`sin` signed, `rope_tables`); its gradient is the inverse rotation,
    dx = dy * cos + swap(dy * sin) (swapping the halves is its own inverse): 3 kernels each way, where
    autograd's own graph of the former forward ran 7 in the backward.  Saves only the tables."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.addcmul(x * cos, _swap_halves(x), sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return torch.addcmul(_swap_halves(grad * sin), grad, cos), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout (as Llama's Hugging Face weights expect), computed in
    the tables' dtype (`rope_dtype`) and returned in `x`'s, so attention reads the input dtype.

    x * cos + rotate_half(x) * sin with the sign of rotate_half in the table (`rope_tables`): the halves
    swapped (one copy), one multiply, one fused multiply-add (`addcmul`), and the same three for the
    gradient (`_Rotate`): 3 kernels each way in float32, 5 with bfloat16's casts (tests/models/
    test_rope.py counts them; the former form ran 5 forward and 7 backward in float32, 7 and 9 in
    bfloat16)."""
    return _Rotate.apply(x.to(cos.dtype), cos, sin).to(x.dtype)


def fused_here(setting: bool | None, x: torch.Tensor) -> bool:
    """Whether a layer's column-parallel projections run as one GEMM: `setting`, or by default on CUDA."""
    return x.is_cuda if setting is None else setting


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, out_std: float) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        nkv = cfg.num_kv_heads or nh
        self.head_dim = h // nh
        self.group = nh // nkv
        bias, o_bias = family_of(cfg).attention_bias  # (q/k/v, o): biases column-sharded with their rows
        # On a grid (block pattern) the heads are split along grid columns as over a 1D group of q ranks.
        heads = TPContext(rank=tp.col, size=tp.q) if is_grid(tp) else tp
        (qlo, qhi), (klo, khi) = attention_head_intervals(nh, nkv, heads)
        self.q_lo, self.kv_lo = qlo, klo
        if is_grid(tp):
            self._block_projections(cfg, tp, out_std, bias, o_bias)
        else:
            self._projections(cfg, tp, out_std, bias, o_bias, (qlo, qhi), (klo, khi))
        # Local KV head each local query head reads.
        kv_of_q = torch.tensor([q // self.group - klo for q in range(qlo, qhi)], dtype=torch.long)
        self.register_buffer("kv_of_q", kv_of_q, persistent=False)
        # Whole KV groups held (every local KV head read by `group` local query heads, in order).
        self.regular_gqa = qlo % self.group == 0 and qhi % self.group == 0
        self.tp = tp
        self.recompute_core = getattr(cfg, "recompute", "none") == "selective"
        # q, k and v as one GEMM over their stacked local rows (`gather_and_project`); the parameters stay
        # three, so checkpoints and Hugging Face names do not change.  None: fused on CUDA (larger GEMMs
        # for tensor cores, fewer launches: Megatron's layout), one GEMM each on CPU, where the fused
        # step measured slower (docs/performance.md, "Fused projections"); True/False force it.
        self.fuse_projections: bool | None = None

    def _block_projections(self, cfg: ModelConfig, grid, out_std: float, bias: bool, o_bias: bool) -> None:
        """q, k, v and o in blocks over the grid (`parallel.block.BlockLinear`): each grid column's query
        heads and the KV heads they read, as a 1D group of q ranks would hold them."""
        nh, nkv, d, h = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, self.head_dim, cfg.hidden_size
        split = [attention_head_intervals(nh, nkv, TPContext(rank=p, size=grid.q)) for p in range(grid.q)]
        qiv, kiv = [s[0] for s in split], [s[1] for s in split]
        std = cfg.init_std
        self.q_proj = BlockLinear(h, nh * d, grid, out_unit=d, out_intervals=qiv, bias=bias, std=std)
        self.k_proj = BlockLinear(h, nkv * d, grid, out_unit=d, out_intervals=kiv, bias=bias, std=std)
        self.v_proj = BlockLinear(h, nkv * d, grid, out_unit=d, out_intervals=kiv, bias=bias, std=std)
        self.o_proj = BlockLinear(nh * d, h, grid, in_unit=d, in_intervals=qiv, bias=o_bias, std=out_std)

    def _projections(self, cfg: ModelConfig, tp: TPContext, out_std: float, bias: bool, o_bias: bool,
                     qiv: tuple[int, int], kiv: tuple[int, int]) -> None:
        h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, self.head_dim
        (qlo, qhi), (klo, khi) = qiv, kiv
        self.q_proj = ColumnParallelLinear(
            h, nh * d, tp, unit_size=d, interval=(qlo, qhi), bias=bias, std=cfg.init_std, copy_input=False
        )
        self.k_proj = ColumnParallelLinear(
            h, nkv * d, tp, unit_size=d, interval=(klo, khi), bias=bias, std=cfg.init_std, copy_input=False
        )
        self.v_proj = ColumnParallelLinear(
            h, nkv * d, tp, unit_size=d, interval=(klo, khi), bias=bias, std=cfg.init_std, copy_input=False
        )
        self.o_proj = RowParallelLinear(
            nh * d, h, tp, unit_size=d, interval=(qlo, qhi), bias=o_bias, std=out_std
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, seq_len: int
    ) -> torch.Tensor:
        return self.o_proj(self.local(x, rope, seq_len))

    def local(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, seq_len: int
    ) -> torch.Tensor:
        """Everything before the output projection: the local heads' attention, [b, S, local heads x d]."""
        # One TP region entry for q, k and v (under SP: one all-gather to the whole sequence).
        fuse = fused_here(self.fuse_projections, x) and not is_grid(self.tp)
        if is_grid(self.tp):  # on a grid each projection is its own SUMMA (no region to enter)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = gather_and_project(x, self.tp, seq_len, (self.q_proj, self.k_proj, self.v_proj),
                                         fuse=fuse)
        if fuse and rope is not None and not self.recompute_core:
            # Fused, q, k and v are views of one output; RoPE saves neither q nor k, so a copy of v (what
            # attention saves) lets the rest of that output go instead of living until the backward.
            v = v.contiguous()
        b, s, d = x.shape[0], seq_len, self.head_dim
        q = q.view(b, s, -1, d).transpose(1, 2)
        k = k.view(b, s, -1, d).transpose(1, 2)
        v = v.view(b, s, -1, d).transpose(1, 2)
        cos_sin = (rope[0][:s], rope[1][:s]) if rope is not None else ()
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, *cos_sin, use_reentrant=False)
        else:
            y = self.core(q, k, v, *cos_sin)
        return y.transpose(1, 2).reshape(b, s, -1)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cos_sin: torch.Tensor) -> torch.Tensor:
        """RoPE, GQA expansion and softmax(QK^T)V of the local heads: no communication inside, so
        selective recomputation reruns only local math."""
        if cos_sin:
            cos, sin = cos_sin
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not self.regular_gqa:  # query heads split inside a KV group: each reads its KV head
            k, v = k.index_select(1, self.kv_of_q), v.index_select(1, self.kv_of_q)
        elif self.group > 1 and sdpa_reads_groups(q):  # SDPA's grouped-query attention: no K/V copies
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.group > 1:  # each query head's KV head expanded, so a fused kernel runs
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_reads_groups(q: torch.Tensor) -> bool:
    """Whether `scaled_dot_product_attention(..., enable_gqa=True)` runs a fused kernel for `q`: on the
    CPU (its flash kernel takes grouped K/V in every dtype) and on CUDA in half precision (flash).  On
    CUDA in float32 only the math kernel takes grouped K/V, which holds the whole score matrix
    (`b x heads x s x s` floats, saved for the backward); with K/V expanded the memory-efficient kernel
    runs instead."""
    return not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, out_std: float) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.gated = family_of(cfg).gated_mlp
        bias = family_of(cfg).linear_bias
        self.tp = tp
        self.fuse_projections: bool | None = None  # gate and up as one GEMM (see `Attention`'s)
        if is_grid(tp):  # in blocks over the grid, the hidden columns aligned as a 1D split aligns them
            cols, std = intervals(tp.q, f, tp.align), cfg.init_std
            if self.gated:
                self.gate_proj = BlockLinear(h, f, tp, out_intervals=cols, bias=False, std=std)
            self.up_proj = BlockLinear(h, f, tp, out_intervals=cols, bias=bias, std=std)
            self.down_proj = BlockLinear(f, h, tp, in_intervals=cols, bias=bias, std=out_std)
            return
        if self.gated:
            self.gate_proj = ColumnParallelLinear(h, f, tp, bias=False, std=cfg.init_std, copy_input=False)
        self.up_proj = ColumnParallelLinear(h, f, tp, bias=bias, std=cfg.init_std, copy_input=False)
        self.tp = tp
        self.down_proj = RowParallelLinear(f, h, tp, bias=bias, std=out_std)
        self.fuse_projections: bool | None = None  # gate and up as one GEMM (see `Attention`'s)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        return self.down_proj(self.local(x, seq_len))

    def local(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Everything before the down projection: the local hidden columns' activations."""
        if is_grid(self.tp):
            if self.gated:
                return F.silu(self.gate_proj(x)) * self.up_proj(x)
            return F.gelu(self.up_proj(x), approximate="tanh")
        # One TP region entry for the MLP input.
        if self.gated:
            gate, up = gather_and_project(x, self.tp, seq_len, (self.gate_proj, self.up_proj),
                                          fuse=fused_here(self.fuse_projections, x))
            return F.silu(gate) * up
        (up,) = gather_and_project(x, self.tp, seq_len, (self.up_proj,))
        return F.gelu(up, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        rms = family_of(cfg).rms_norm
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.attn_norm = Norm(cfg.hidden_size, tp, rms=rms, eps=cfg.norm_eps, bias=not rms)
        self.attn = Attention(cfg, tp, out_std)
        self.mlp_norm = Norm(cfg.hidden_size, tp, rms=rms, eps=cfg.norm_eps, bias=not rms)
        self.mlp = MLP(cfg, tp, out_std)
        self.dropout = cfg.dropout
        self.tp = tp

    def drop_mask(self, y: torch.Tensor, seq_len: int, batch: int | None = None) -> torch.Tensor | None:
        """The dropout mask (scaled by 1/keep) of a sublayer output like `y` for `batch` sequences (default:
        `y`'s), or None without dropout.  Replicated activations: every TP rank of a replica draws the
        same mask (same generator state).

        The mask is drawn for the whole sequence and narrowed to this rank's slice, so it does not depend
        on sequence parallelism (the loss curve is the same with it on or off), and for the whole
        micro-batch, so it does not depend on `ntp.tp_chunks` (each chunk reads its rows); drawn
        explicitly rather than by `F.dropout`, whose fused CUDA kernel draws differently from the same
        generator."""
        if not (self.dropout and self.training):
            return None
        if is_grid(self.tp):
            raise NotImplementedError("dropout on a block-sharded layer (ntp.pattern=block): "
                                      "set model.dropout=0")
        lo, hi = seq_interval(self.tp, seq_len)
        keep = 1.0 - self.dropout
        rows = y.shape[0] if batch is None else batch
        mask = torch.empty((rows, seq_len, *y.shape[2:]), dtype=y.dtype, device=y.device)
        return mask.bernoulli_(keep)[:, lo:hi].div_(keep)

    def _drop(self, y: torch.Tensor, seq_len: int) -> torch.Tensor:
        mask = self.drop_mask(y, seq_len)
        return y if mask is None else y * mask

    def forward(self, x: torch.Tensor, rope=None, seq_len: int | None = None) -> torch.Tensor:
        """`x`: this rank's slice (`seq_interval(self.tp, seq_len)`) of the hidden state; `seq_len` is the
        whole sequence's length (default: `x`'s, without sequence parallelism)."""
        seq_len = x.shape[1] if seq_len is None else seq_len
        x = x + self._drop(self.attn(self.attn_norm(x), rope, seq_len), seq_len)
        return x + self._drop(self.mlp(self.mlp_norm(x), seq_len), seq_len)

    def launch(self, sublayer: int, x: torch.Tensor, rope, seq_len: int) -> Launched:
        """Sublayer `sublayer` (0: attention, 1: MLP) of `x` up to its output projection's exit, whose
        collective is launched and not waited for (`ntp.tp_chunks`); `finish` completes it."""
        if sublayer == 0:
            return self.attn.o_proj.launch(self.attn.local(self.attn_norm(x), rope, seq_len))
        return self.mlp.down_proj.launch(self.mlp.local(self.mlp_norm(x), seq_len))

    def finish(self, sublayer: int, launched: Launched) -> torch.Tensor:
        """The output of sublayer `sublayer` launched by `launch` (before dropout and the residual add)."""
        return (self.attn.o_proj if sublayer == 0 else self.mlp.down_proj).finish(launched)


class DecoderLM(nn.Module):
    """Decoder-only language model; `layers` may be a contiguous range (a pipeline stage).

    Slots of the layout: 0 = embedding, 1..L = transformer layers, L+1 = output head.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        plan: TPPlan | None = None,
        *,
        layers: range | None = None,
        has_embedding: bool = True,
        has_head: bool = True,
    ) -> None:
        super().__init__()
        plan = plan or SingleDevicePlan()
        self.cfg = cfg
        self.layer_range = layers if layers is not None else range(cfg.num_layers)
        fam = family_of(cfg)
        self.uses_rope, self.learned_positions, self.rms_norm = fam.rope, fam.learned_positions, fam.rms_norm
        # Every slot's context (also of layers held by other stages: their groups on this stage give the
        # sequence split of the hidden state a pipeline send carries).
        self.contexts = [plan.context(slot) for slot in range(cfg.num_layers + 2)]
        emb_tp = self.contexts[0]
        head_tp = self.contexts[-1]
        self.emb_tp = emb_tp
        self.tied = cfg.tie_embeddings
        embedding = BlockEmbedding if is_grid(emb_tp) else VocabParallelEmbedding
        self.embed = (
            embedding(cfg.vocab_size, cfg.hidden_size, emb_tp, std=cfg.init_std)
            if (has_embedding or (has_head and self.tied))
            else None
        )
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding and self.learned_positions:
            shape = (cfg.max_seq_len, cfg.hidden_size)
            self.pos_embed = (feature_param(shape, 1, emb_tp, ("normal", 0.01)) if is_grid(emb_tp)
                              else replicated_param(shape, emb_tp, ("normal", 0.01)))
        # Keyed by global layer index so parameter names do not depend on the pipeline split.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, plan.context(i + 1)) for i in self.layer_range})
        if has_head:
            self.head_tp = emb_tp if self.tied else head_tp
            self.final_norm = Norm(
                cfg.hidden_size, self.head_tp, rms=self.rms_norm, eps=cfg.norm_eps, bias=not self.rms_norm
            )
            if not self.tied and is_grid(head_tp):
                vocab = intervals(head_tp.q, cfg.vocab_size, head_tp.align)
                self.head = BlockLinear(cfg.hidden_size, cfg.vocab_size, head_tp, bias=False,
                                        std=cfg.init_std, out_intervals=vocab)
            elif not self.tied:
                self.head = ColumnParallelLinear(
                    cfg.hidden_size, cfg.vocab_size, head_tp, bias=False, std=cfg.init_std
                )
        self._rope_cache: dict = {}
        # `ntp.tp_chunks`: each micro-batch's layers run in this many chunks along the batch, each chunk's
        # row-parallel collective running while the next chunk computes (`run_blocks`).
        self.tp_chunks = 1
        # Under SP the replicated parameters' gradient sums over the TP group travel together, once per
        # backward pass (one all-reduce per group instead of one per parameter).
        self.grad_reducer = (ReplicatedGradReducer(list(self.named_parameters()))
                             if self.sequence_parallel else None)
        for module in self.modules():
            if module is not self and hasattr(module, "grad_reducer"):
                module.grad_reducer = self.grad_reducer

    def _rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.uses_rope:
            return None
        key = (x.device, rope_dtype(x.dtype))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(
                self.cfg.max_seq_len,
                self.cfg.hidden_size // self.cfg.num_heads,
                self.cfg.rope_theta,
                x.device,
                key[1],
            )
        return self._rope_cache[key]

    def hidden_interval(self, layer: int, seq_len: int) -> tuple[int, int]:
        """Tokens of a `seq_len` sequence this rank holds of the hidden state entering global layer `layer`
        (`num_layers`: the head's input) under sequence parallelism; the whole sequence without it."""
        return seq_interval(self.contexts[layer], seq_len)

    @property
    def sequence_parallel(self) -> bool:
        return any(seq_split(c) > 1 for c in self.contexts)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `ids` ([b, S]); under sequence parallelism this rank's slice of them."""
        x = self.embed(ids)
        if self.learned_positions and is_grid(self.emb_tp):
            return x + self.pos_embed[: ids.shape[1]]
        if self.learned_positions:
            seq_len = ids.shape[1]
            lo, hi = seq_interval(self.emb_tp, seq_len)
            x = x + replicated_grad_sum(self.pos_embed, self.emb_tp, self.grad_reducer)[lo:hi]
        return x

    def recomputes_layer(self, index: int) -> bool:
        """Whether layer `index` (global) is recomputed whole in the backward (`recompute=full`)."""
        return getattr(self.cfg, "recompute", "none") == "full" and index % max(
            1, int(getattr(self.cfg, "recompute_every", 1))) == 0

    def relayout(self, x: torch.Tensor, src: TPContext, dst: TPContext, seq_len: int,
                 batch: int | None) -> torch.Tensor:
        """The hidden state from slot context `src`'s layout to `dst`'s: the sequence re-split between
        row/column slots, a block of it or the whole of it where a block slot (a grid) is on either side
        (`batch`: the micro-batch's sequences, needed to leave a grid)."""
        if not (is_grid(src) or is_grid(dst)):
            return resplit_sequence(x, src, dst, seq_len)
        if batch is None and is_grid(src):
            raise ValueError("leaving a block-sharded layer needs the micro-batch size (batch=)")
        return relayout(x, src, dst, batch or x.shape[0], self.cfg.hidden_size,
                        lambda t, a, b: resplit_sequence(t, a, b, seq_len))

    def run_blocks(self, x: torch.Tensor, layers=None, seq_len: int | None = None,
                   batch: int | None = None) -> torch.Tensor:
        """The transformer layers held here, in order, or only `layers` (global indices: one model chunk
        of an interleaved pipeline stage).  `seq_len`: the whole sequence's length (required under
        sequence parallelism, where `x` holds `hidden_interval(first layer, seq_len)`); `batch`: the
        micro-batch's sequences (required where a block-sharded slot hands over to a row/column one)."""
        if seq_len is None:
            if self.sequence_parallel:
                raise ValueError("run_blocks needs seq_len under sequence parallelism")
            seq_len = x.shape[1]
        rope = self._rope(x)
        keys = list(self.blocks.keys()) if layers is None else [str(i) for i in layers]
        split = self.contexts[int(keys[0])] if keys else None
        if self._chunked(x, keys):
            return self._run_chunked(x, keys, rope, seq_len, split)
        for key in keys:
            block = self.blocks[key]
            x = self.relayout(x, split, block.tp, seq_len, batch)  # a change of degree or pattern
            split = block.tp
            if self.recomputes_layer(int(key)) and torch.is_grad_enabled():
                # Non-reentrant: the backward reruns the layer's forward, TP collectives included, in the
                # same order on every rank of the TP group, then differentiates it.
                x = checkpoint(block, x, rope, seq_len, use_reentrant=False)
            else:
                x = block(x, rope, seq_len)
        return x

    def _chunked(self, x: torch.Tensor, keys: list[str]) -> bool:
        """Whether `run_blocks` runs `x` in chunks: `tp_chunks` > 1, more than one sequence, some layer
        sharded, none recomputed whole (its checkpoint reruns a whole layer; the config refuses both)."""
        return (self.tp_chunks > 1 and x.shape[0] > 1
                and any(self.blocks[k].tp.sharded for k in keys)
                and not any(is_grid(self.blocks[k].tp) for k in keys)
                and not any(self.recomputes_layer(int(k)) for k in keys))

    def _run_chunked(self, x: torch.Tensor, keys: list[str], rope, seq_len: int, split) -> torch.Tensor:
        """`run_blocks` over `tp_chunks` chunks of the batch, Domino's schedule: sublayer by sublayer, each
        chunk waits for its previous sublayer's exit collective (then dropout and the residual add), then
        computes this sublayer and launches its exit, so every collective but the last runs while another
        chunk computes.  The same operations on each row as the unchunked loop (dropout masks are drawn
        for the whole batch, in the same order), so the same values up to the GEMMs' blocking."""
        chunks = list(x.tensor_split(min(self.tp_chunks, x.shape[0])))
        rows = [0]
        for c in chunks:
            rows.append(rows[-1] + c.shape[0])
        launched: list[Launched | None] = [None] * len(chunks)
        last: tuple[Block, int] | None = None  # the sublayer whose exits are in flight

        def complete(i: int) -> None:
            nonlocal mask
            block, sub = last  # type: ignore[misc]
            y = block.finish(sub, launched[i])  # type: ignore[arg-type]
            if i == 0:  # drawn once for the whole batch, as the unchunked layer draws it
                mask = block.drop_mask(y, seq_len, batch=rows[-1])
            chunks[i] = chunks[i] + (y if mask is None else y * mask[rows[i]:rows[i + 1]])
            launched[i] = None

        mask: torch.Tensor | None = None
        for key in keys:
            block = self.blocks[key]
            for sub in (0, 1):
                for i in range(len(chunks)):
                    if last is not None:
                        complete(i)
                    if sub == 0:  # a change of degree re-splits the sequence
                        chunks[i] = resplit_sequence(chunks[i], split, block.tp, seq_len)
                    launched[i] = block.launch(sub, chunks[i], rope, seq_len)
                last = (block, sub)
            split = block.tp
        for i in range(len(chunks)):
            complete(i)
        return torch.cat(chunks, dim=0)

    def logits_local(self, x: torch.Tensor, seq_len: int | None = None, batch: int | None = None
                     ) -> torch.Tensor:
        """This rank's vocabulary slice of the logits of the whole sequence (`x`: the last layer's output,
        this rank's slice of it under sequence parallelism, where `seq_len` is required)."""
        if seq_len is None:
            if self.sequence_parallel:
                raise ValueError("logits_local needs seq_len under sequence parallelism")
            seq_len = x.shape[1]
        x = self.relayout(x, self.contexts[self.cfg.num_layers], self.head_tp, seq_len, batch)
        x = self.final_norm(x)
        if is_grid(self.head_tp):  # a block-sharded head: this rank's sequences and its column's vocabulary
            if self.tied:
                return block_linear(x, self.embed.weight, self.head_tp, self.embed.out_lens)
            return self.head(x)
        if seq_split(self.head_tp) > 1:  # gathered once, only the slice saved for the backward
            return gather_and_project(x, self.head_tp, seq_len, (self.embed if self.tied else self.head,))[0]
        if self.tied:
            return F.linear(copy_to_tp(to_compute_dtype(x), self.head_tp), self.embed.weight)
        return self.head(x)

    @property
    def vocab_start(self) -> int:
        if self.tied:
            return self.embed.vocab_start
        if is_grid(self.head_tp):
            return self.head.out_intervals[self.head_tp.col][0]
        return self.head.weight.ntp_spec.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-model forward to local logits (for one-stage layouts)."""
        seq_len, batch = ids.shape[1], ids.shape[0]
        return self.logits_local(self.run_blocks(self.embed_tokens(ids), seq_len=seq_len, batch=batch),
                                 seq_len, batch)

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token losses of `targets` [b, s]; with a block-sharded head those of this rank's grid row's
        sequences (`rows_of`), the loss combined over the grid row (its vocabulary columns)."""
        logits = self.logits_local(hidden, targets.shape[1], targets.shape[0])
        tp = self.head_tp
        if is_grid(tp):
            lo, hi = rows_of(tp, targets.shape[0])
            targets, tp = targets[lo:hi], row_axis(tp)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, tp)

    def loss_sum(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sum of per-token losses of a [b, s+1] token batch (inputs = tokens[:, :-1]); with a
        block-sharded head summed over the grid rows (every rank holds the micro-batch's sum)."""
        hidden = self.run_blocks(self.embed_tokens(tokens[:, :-1]), seq_len=tokens.shape[1] - 1,
                                 batch=tokens.shape[0])
        total = self.token_losses(hidden, tokens[:, 1:]).sum()
        return grid_sum(total, self.head_tp.col_group) if is_grid(self.head_tp) else total
