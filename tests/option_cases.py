"""Training runs with the memory/overlap options against the same layout without them (float32, gloo).

One worker runs several variants one after another in the same process group: each assembles the rank
as a run does (`runtime.assemble`: model slice, fragment sync plan, optimizer, gradient path) and trains
`STEPS` optimizer steps through `runtime.step.train_step` (the step of the Lightning module: this
replica's micro-batches, the sync, the fused step scalars, the clipping, the optimizer) with the
warmup-cosine LR schedule.
"""

from __future__ import annotations

import dataclasses

import torch

import ntp_nemo.runtime.step as one_step
from ntp_nemo.parallel.step_path import GradientPath
from ntp_nemo.runtime.assemble import RankState, assemble
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.schedules import warmup_cosine
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, SEED, SEQ
from tests.shapes import adamw

STEPS = 5
OPTIM = adamw(3e-3)
CLIP = 1.0
BUCKET_MB = 0.002  # small buckets: several per holder set, launched one by one during the backward

# name -> (recompute, distributed optimizer, overlapped sync)
VARIANTS = {
    "baseline": ("none", False, False),
    "selective": ("selective", False, False),
    "full": ("full", False, False),
    "distributed": ("none", True, False),
    "overlap": ("none", False, True),
    "all": ("full", True, True),
}


def step_tokens(cfg, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)


@dataclasses.dataclass
class Run:
    state: RankState
    sched: torch.optim.lr_scheduler.LRScheduler

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def path(self) -> GradientPath:
        return self.state.grad_path


def setup(rt: RankPlace, cfg, recompute: str = "none", distributed: bool = False, overlap: bool = False,
          *, bucket_mb: float = BUCKET_MB, dtype: torch.dtype = torch.float32) -> Run:
    """Rank `rt.rank`'s state on `rt.layout`, assembled as a run assembles it, and its LR schedule."""
    state = assemble(rt.layout, rt.rank, dataclasses.replace(cfg, recompute=recompute),
                     {**OPTIM, "distributed": distributed}, rt.device, seed=SEED, bucket_mb=bucket_mb,
                     overlap_grad_sync=overlap, param_dtype=dtype)
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, warmup_cosine(2, STEPS, 0.1))
    return Run(state, sched)


def run_steps(rt: RankPlace, run: Run, cfg, start: int, stop: int) -> tuple[list[float], list[float]]:
    """Optimizer steps `start..stop-1` (each on its own global batch) through `train_step`; per-step loss
    and grad norm (before clipping)."""
    losses, norms = [], []
    for step in range(start, stop):
        toks = step_tokens(cfg, step)
        micro = [toks[i : i + 1] for i in run.state.my_microbatches(GLOBAL_BATCH)]
        result = one_step.train_step(run.state, micro, toks[:, 1:].numel(), max_norm=CLIP,
                                     scheduler=run.sched)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return losses, norms


def options_worker(rank: int, world: int, cfg, tp: int, replica_tp: list[int], pp: int,
                   stage_layers: list[int] | None, variants: list[str],
                   dtype: torch.dtype = torch.float32) -> dict:
    """Per variant: worst relative loss difference and worst absolute parameter difference against the
    first variant (the baseline), plus the baseline's grad norms (to see that clipping was active)."""
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2), pp=pp, stage_layers=stage_layers)
    rt = RankPlace(ResolvedLayout.make(topo), rank)
    base = None
    out: dict = {}
    for name in variants:
        run = setup(rt, cfg, *VARIANTS[name], dtype=dtype)
        losses, norms = run_steps(rt, run, cfg, 0, STEPS)
        run.path.remove()
        model = run.model
        state_bytes = (run.opt.state_bytes() if hasattr(run.opt, "state_bytes") else sum(
            t.numel() * t.element_size() for st in run.opt.state.values() for t in st.values()))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        if base is None:
            base = (losses, params, state_bytes)
            out["norms"] = norms
            out["moved"] = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(
                params.values(), rt.build_model(cfg, SEED, dtype=dtype).parameters(), strict=True))
            continue
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, base[0], strict=True))
        param_err = max(float((params[n] - base[1][n]).abs().max()) for n in params)
        out[name] = {"loss": loss_err, "param": param_err, "state_ratio": state_bytes / base[2]}
    return out
