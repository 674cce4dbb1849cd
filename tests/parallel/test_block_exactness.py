"""Block (2D, SUMMA) sharding on a q x q grid reproduces the unsharded model (float64): the loss, the
gradients, the gradient norm and the parameters after two AdamW steps, GPT (tied head, learned
positions, biases) and Llama (GQA, untied head), on a 2x2 grid with per-layer mixes of patterns, on a
2x2 grid beside a row/column TP-2 replica, and on a 3x3 grid.  Blocks are uneven where q does not divide:
GPT's 5 heads and 67 vocabulary rows over 2, the 3x3 Llama's 41 vocabulary rows, 20 MLP columns and the
micro-batch's 5 sequences over 3 (which also shares a KV head between two grid columns).  Both weight
placements run: GPT's MLP up projection (84 x 40) and the 3x3 Llama's untied head (41 x 24) put their
outputs over grid columns (`parallel.block.out_columns`), the other weights over grid rows."""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.grid import BLOCK, ROW_COLUMN, GridContext
from tests.ntp_cases import GPT, LLAMA
from tests.shapes import adamw

SEED, SEQ, BATCH, STEPS = 3, 6, 5, 2
OPTIM = adamw(2e-2)
MICRO = ((0, 5),)  # one micro-batch of 5 sequences: grid rows of 2 and 3 (2x2), 1, 2 and 2 (3x3)
# A smaller Llama for the 3x3 grid (9 processes on 2 cores): 6 query heads over 3 KV heads: columns hold
# query heads 2/2/2 and KV heads {0}, {0, 1}, {1, 2}... shared between neighbouring columns.
LLAMA_3X3 = ModelConfig(arch="llama", vocab_size=41, hidden_size=24, num_layers=1, num_heads=6,
                        num_kv_heads=2, ffn_hidden_size=20, max_seq_len=8, tie_embeddings=False)


def _tokens(cfg: ModelConfig, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(400 + step)
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)


def _plain_run(cfg: ModelConfig) -> tuple[list[float], list[float], list[dict], dict[str, torch.Tensor]]:
    """The single-process reference: losses, gradient norms and gradients of each step, final parameters."""
    model = build_model(cfg, seed=SEED).double()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    losses, norms, grads = [], [], []
    for step in range(STEPS):
        toks = _tokens(cfg, step)
        loss = model.loss_sum(toks) / toks[:, 1:].numel()
        loss.backward()
        loss = loss.detach()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor, name: str) -> float:
    # A key bias's gradient is zero in theory (softmax ignores a shift shared by a query's scores): its values
    # are rounding noise, compared in absolute terms (and Adam turns that noise into full-size updates).
    return float((a - b).abs().max() / (1.0 if name.endswith("k_proj.bias") else b.abs().max()))


def block_worker(rank: int, world: int, cfg: ModelConfig, pattern: tuple[str, ...],
                 replica_tp: tuple[int, ...] | None = None, micro: tuple = MICRO) -> dict:
    """Rank `rank` of replicas `replica_tp` (default: one of `world` ranks) on per-slot `pattern`, trained
    through `train_step` on its replica's share of the micro-batches `micro`, against the plain run."""
    torch.set_num_threads(1)
    slots = cfg.num_layers + 2
    replica_tp = list(replica_tp or [world])
    tp = max(replica_tp)
    layout = ResolvedLayout.make(Topology(tp, replica_tp, [tp] * slots), num_microbatches=len(micro),
                                 pattern=pattern)
    state = assemble(layout, rank, cfg, OPTIM, "cpu", seed=SEED, param_dtype=torch.float64)
    ref_losses, ref_norms, ref_grads, ref_params = _plain_run(cfg)
    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0}
    for step in range(STEPS):
        toks = _tokens(cfg, step)

        def check_grads(step=step) -> None:
            for n, p in state.model.named_parameters():
                worst["grad"] = max(worst["grad"], _rel(p.grad, p.ntp_spec.narrow(ref_grads[step][n]), n))

        mine = [toks[a:b] for a, b in (micro[i] for i in state.my_microbatches(len(micro)))]
        result = train_step(state, mine, toks[:, 1:].numel(), max_norm=None, before_update=check_grads)
        worst["loss"] = max(worst["loss"], abs(result.loss - ref_losses[step]) / ref_losses[step])
        worst["norm"] = max(worst["norm"], abs(result.grad_norm - ref_norms[step]) / ref_norms[step])
    worst["param"] = max(_rel(p.detach(), p.ntp_spec.narrow(ref_params[n]), n)
                         for n, p in state.model.named_parameters() if not n.endswith("k_proj.bias"))
    worst["grid_slots"] = sum(isinstance(c, GridContext) for c in state.model.contexts)
    worst["blocks"] = sum(p.ntp_spec.is_block for p in state.model.parameters())
    return worst


def _check(results: list[dict], grid_slots: int, grid_ranks: int | None = None) -> None:
    """Every rank within 1e-10; the first `grid_ranks` ranks (default: all) on grids of `grid_slots`
    slots, the others row/column."""
    grid_ranks = len(results) if grid_ranks is None else grid_ranks
    for rank, worst in enumerate(results):
        on_grid = rank < grid_ranks
        assert worst.pop("grid_slots") == (grid_slots if on_grid else 0)
        assert (worst.pop("blocks") > 0) == on_grid
        for key, err in worst.items():
            assert err < 1e-10, f"rank {rank}: {key} rel error {err:.2e}"


# Per-layer mixes, the grid left and entered at every slot boundary: GPT's embedding (and its tied head)
# and layer 1 on the grid, layer 0 row/column; Llama's embedding and layer 1 row/column.  Every slot on
# the grid: GPT beside a TP-2 replica (below) and Llama on the 3x3 grid.
CASES = {
    "gpt-mix": (GPT, (BLOCK, ROW_COLUMN, BLOCK, ROW_COLUMN)),
    "llama-mix": (LLAMA, (ROW_COLUMN, BLOCK, ROW_COLUMN, BLOCK)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_2x2_grid_matches_unsharded(name):
    cfg, pattern = CASES[name]
    _check(run_workers(block_worker, 4, cfg, pattern), sum(p == BLOCK for p in pattern))


@pytest.mark.slow
def test_3x3_grid_matches_unsharded():
    _check(run_workers(block_worker, 9, LLAMA_3X3, (BLOCK,) * 3), 3)


@pytest.mark.slow
def test_2x2_grid_beside_a_tp2_replica_matches_unsharded():
    """Replicas (4, 2) under ntp.pattern=block: the 4-rank replica on a 2x2 grid, the 2-rank one row/column
    (2 is not a square); their gradients sync across patterns (boxes against 1D intervals) and both
    follow the unsharded model.  Micro-batches of 2 sequences: the grid takes 2 of them, TP 2 the third."""
    micro = ((0, 2), (2, 4), (4, 5))
    _check(run_workers(block_worker, 6, GPT, (BLOCK,) * 4, (4, 2), micro), 4, grid_ranks=4)
