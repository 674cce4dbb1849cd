"""Training runs with the memory/overlap options against the same layout without them (float32, gloo).

One worker runs several variants one after another in the same process group: each builds the model,
attaches it (fragment sync plan), and trains `STEPS` optimizer steps through the real runtime path
(`train_microbatches` for the micro-batches of this replica, `GradientPath` for the sync and clipping,
the optimizer, the warmup-cosine LR schedule), as the Lightning module does.
"""

from __future__ import annotations

import dataclasses

import torch

from ntp_nemo.parallel.step_path import GradientPath, build_optimizer
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.schedules import warmup_cosine
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, SEED, SEQ

STEPS = 5
OPTIM = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
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
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    path: GradientPath


def setup(rt: NTPRuntime, cfg, recompute: str = "none", distributed: bool = False, overlap: bool = False,
          *, bucket_mb: float = BUCKET_MB, dtype: torch.dtype = torch.float32) -> Run:
    """Model, optimizer, LR schedule and gradient path of one run on this rank."""
    model = rt.build_model(dataclasses.replace(cfg, recompute=recompute), SEED, dtype=dtype)
    sync = rt.attach(model, bucket_mb)
    opt = build_optimizer(model, sync, distributed=distributed, **OPTIM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, STEPS, 0.1))
    return Run(model, opt, sched, GradientPath(model, sync, opt, overlap=overlap))


def run_steps(rt: NTPRuntime, run: Run, cfg, start: int, stop: int) -> tuple[list[float], list[float]]:
    """Optimizer steps `start..stop-1` (each on its own global batch); per-step loss and grad norm."""
    losses, norms = [], []
    for step in range(start, stop):
        toks = step_tokens(cfg, step)
        micro = [toks[i : i + 1] for i in rt.my_microbatches(GLOBAL_BATCH)]
        run.path.begin_step(len(micro))
        total = rt.train_microbatches(run.model, micro, toks[:, 1:].numel())
        norms.append(float(run.path.sync_and_clip(CLIP)))
        run.opt.step()
        run.opt.zero_grad(set_to_none=False)
        run.sched.step()
        losses.append(float(rt.global_sum(total)) / toks[:, 1:].numel())
    return losses, norms


def options_worker(rank: int, world: int, cfg, tp: int, replica_tp: list[int], pp: int,
                   stage_layers: list[int] | None, variants: list[str],
                   dtype: torch.dtype = torch.float32) -> dict:
    """Per variant: worst relative loss difference and worst absolute parameter difference against the
    first variant (the baseline), plus the baseline's grad norms (to see that clipping was active)."""
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2), pp=pp, stage_layers=stage_layers)
    rt = NTPRuntime(ResolvedLayout.make(topo), rank)
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
