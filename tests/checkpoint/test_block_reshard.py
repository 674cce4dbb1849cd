"""Checkpoints across sharding patterns: saved on a 2x2 grid (`ntp.pattern=block`, weights in 2D blocks)
and loaded on row/column TP 3, and the reverse; and saved on TP 3 whose shards a straggler rebalance
weighed by speed (`ResolvedLayout.shard_speeds`: uneven heads and columns) and loaded on balanced TP 3.
The loading ranks (another seed: every value must come from the checkpoint) hold exactly the saved
logical parameters and continue the saved run's loss curve (float64, AdamW moments carried over)."""

from __future__ import annotations

import pytest
import torch

from ntp_nemo.checkpoint import load_checkpoint, save_checkpoint
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA, OPTIM

SEED, SEQ, BATCH, BEFORE, AFTER = 5, 6, 4, 1, 2
BLOCK = ((4, [4], [4] * 4), "block")
TP3 = ((3, [3], [3] * 4), "row_column")
# Two replicas of different patterns: a 2x2 grid beside a row/column TP-2 replica (degree 2 is no
# square), one micro-batch of 2 sequences each; the grid's norms are split, the TP-2 replica's whole.
MIXED = ((4, [4, 2], [4] * 4), "block", 2)
# TP 3 with shards weighed 1 : 0.4 : 0.6 (LLAMA's 6 query heads 3/1/2, its 2 KV heads following them;
# its 70 FFN columns in blocks of 4: 36/12/22), as `fault.straggler=rebalance` leaves a one-replica job
# with a slow rank.
WEIGHTED = ((3, [3], [3] * 4), "row_column", 1, (1.0, 0.4, 0.6))


def _tokens(cfg: ModelConfig, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(600 + step)
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)


def worker(rank: int, world: int, cfg: ModelConfig, side: tuple, path: str, save: bool) -> tuple:
    """Saving side: one step, save, then the continuation; loading side (seed + 1): load, continuation.
    Returns this rank's parameter slices right after the save / load, and the continuation's losses."""
    torch.set_num_threads(1)
    topology, pattern = side[:2]
    micro, speeds = (side[2] if len(side) > 2 else 1), (side[3] if len(side) > 3 else None)
    weighed = {"shard_align": 4, "shard_speeds": speeds} if speeds else {}
    layout = ResolvedLayout.make(Topology(*topology, **weighed), num_microbatches=micro, pattern=pattern)
    state = assemble(layout, rank, cfg, OPTIM, "cpu", seed=SEED + (not save), param_dtype=torch.float64)

    def step(s: int) -> float:
        toks = _tokens(cfg, s)
        mine = [toks.chunk(micro)[i] for i in state.my_microbatches(micro)]
        return train_step(state, mine, toks[:, 1:].numel(), max_norm=None).loss

    if save:
        for s in range(BEFORE):
            step(s)
        save_checkpoint(path, state.model, state.optimizer, {"step": BEFORE}, step=BEFORE)
    else:
        load_checkpoint(path, state.model, state.optimizer)
    held = {n: (p.ntp_spec, p.detach().numpy().copy()) for n, p in state.model.named_parameters()}
    return held, [step(s) for s in range(BEFORE, BEFORE + AFTER)]


def _exports_as_unsharded(cfg: ModelConfig, path: str, full: dict[str, torch.Tensor], tmp) -> None:
    """`ntp-export`'s reader on the grid's checkpoint writes the tensors the unsharded model holding the
    same logical values exports."""
    from safetensors.torch import load_file

    from ntp_nemo.hf.export import export_checkpoint, export_model
    from ntp_nemo.models import build_model

    model = build_model(cfg).to(torch.float64)
    model.load_state_dict(full)
    export_checkpoint(path, tmp / "from_grid", cfg=cfg, tokenizer=False)
    export_model(model, tmp / "unsharded")
    read = [{k: v for f in sorted((tmp / d).glob("*.safetensors")) for k, v in load_file(f).items()}
            for d in ("from_grid", "unsharded")]
    assert read[0].keys() == read[1].keys() and read[0]
    assert all(torch.equal(read[0][k], read[1][k]) for k in read[0])


@pytest.mark.slow
@pytest.mark.parametrize("cfg,saved_on,loaded_on",
                         [(LLAMA, BLOCK, TP3), (GPT, TP3, BLOCK), (GPT, MIXED, TP3), (LLAMA, WEIGHTED, TP3)],
                         ids=["llama-block-to-tp3", "gpt-tp3-to-block", "gpt-grid-beside-tp2-to-tp3",
                              "llama-weighted-tp3-to-balanced"])
def test_checkpoint_moves_between_patterns(tmp_path, cfg, saved_on, loaded_on):
    path = str(tmp_path / "ckpt")
    saved = run_workers(worker, sum(saved_on[0][1]), cfg, saved_on, path, True)
    loaded = run_workers(worker, sum(loaded_on[0][1]), cfg, loaded_on, path, False)
    full: dict[str, torch.Tensor] = {}
    for held, _ in saved:
        for name, (spec, value) in held.items():
            full.setdefault(name, torch.full(spec.global_shape, float("nan"), dtype=torch.float64))
            spec.narrow(full[name]).copy_(torch.from_numpy(value))
    assert not any(t.isnan().any() for t in full.values())
    if len(saved_on) > 3:  # the saved shards are the weighed ones: rank 1 holds the fewest heads and columns
        for suffix in ("q_proj.weight", "up_proj.weight"):
            rows = [next(spec.length for n, (spec, _) in held.items() if n.endswith(suffix))
                    for held, _ in saved]
            assert rows[1] < rows[2] < rows[0], (suffix, rows)
    if saved_on[1] == "block":  # Hugging Face export reads a grid's checkpoint as any other
        _exports_as_unsharded(cfg, path, full, tmp_path)
    for held, _ in loaded:
        for name, (spec, value) in held.items():
            assert torch.equal(torch.from_numpy(value), spec.narrow(full[name])), name
    want = saved[0][1]
    for rank, (_, curve) in enumerate(loaded):
        assert max(abs(a - b) / b for a, b in zip(curve, want, strict=True)) < 1e-10, (rank, curve, want)
