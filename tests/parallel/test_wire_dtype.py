"""Pipeline messages in the compute dtype: under bf16-mixed (float32 parameters, CPU autocast) the
activations and gradients sent between stages cross in bfloat16, the same messages as the all-bf16
model the dry run steps, and the receiving stage takes them back into float32."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import LLAMA, assembled, tokens

LLAMA4 = dataclasses.replace(LLAMA, num_layers=4)


def _two_stages(rank: int, world: int, mode: str) -> dict:
    """One step of 2 micro-batches on PP 2 (one rank per stage): every point-to-point message's
    direction, dtype and bytes; `mixed` = float32 parameters under bf16 autocast (forward and backward),
    `bf16` = an all-bf16 model, `fp32` = float32 without autocast."""
    torch.set_num_threads(1)
    topo = Topology(1, [1], [1] * (LLAMA4.num_layers + 2), pp=2, stage_layers=[2, 2])
    dtype = {"mixed": torch.float32, "bf16": torch.bfloat16, "fp32": torch.float32}[mode]
    rt, model = assembled(ResolvedLayout.make(topo, "1f1b"), rank, LLAMA4, dtype=dtype)
    sent: list[tuple[str, str, int]] = []
    originals = {name: getattr(dist, name) for name in ("isend", "irecv")}
    for name, fn in originals.items():
        def wrapped(tensor, *args, _fn=fn, _name=name, **kwargs):
            dtype = str(tensor.dtype).removeprefix("torch.")
            sent.append((_name, dtype, tensor.numel() * tensor.element_size()))
            return _fn(tensor, *args, **kwargs)
        setattr(dist, name, wrapped)
    toks = tokens(LLAMA4)[:2]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "mixed"):
            total = rt.train_microbatches(model, [toks[:1], toks[1:2]], toks[:, 1:].numel())
            trained = len(sent)
            evaluated = float(rt.eval_microbatches(model, [toks[:1], toks[1:2]]))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"sent": sent[:trained], "eval_sent": sent[trained:], "loss": float(total), "eval_loss": evaluated,
            "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
            "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
            "grad_norm": float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))}


def test_bf16_mixed_pipeline_sends_bf16_like_the_all_bf16_model():
    mixed = run_workers(_two_stages, 2, "mixed")
    bf16 = run_workers(_two_stages, 2, "bf16")
    fp32 = run_workers(_two_stages, 2, "fp32")
    hidden_bytes = 1 * 8 * LLAMA4.hidden_size  # one sequence of 8 tokens per micro-batch
    for stage, (m, b, f) in enumerate(zip(mixed, bf16, fp32, strict=True)):
        # Stage 0 sends 2 activations and receives 2 gradients; stage 1 the reverse.
        kinds = sorted(k for k, _, _ in m["sent"])
        assert kinds == ["irecv", "irecv", "isend", "isend"], m["sent"]
        assert {(d, n) for _, d, n in m["sent"]} == {("bfloat16", 2 * hidden_bytes)}, m["sent"]
        assert m["sent"] == b["sent"], (stage, m["sent"], b["sent"])
        # Without autocast the messages stay in the parameters' dtype.
        assert {(d, n) for _, d, n in f["sent"]} == {("float32", 4 * hidden_bytes)}, f["sent"]
        assert m["finite"] and m["grad_dtypes"] == ["torch.float32"], m
        # Validation (forward only) sends its activations in the compute dtype too.
        assert {(d, n) for _, d, n in m["eval_sent"]} == {("bfloat16", 2 * hidden_bytes)}, m["eval_sent"]
        assert len(m["eval_sent"]) == 2 and m["eval_sent"] == b["eval_sent"]
    # The last stage's loss under bf16-mixed follows float32 to bf16 rounding (one rounding of the
    # residual stream at the stage boundary, on top of autocast's own), and so do the gradients.
    assert abs(mixed[1]["loss"] - fp32[1]["loss"]) <= 2e-2 * abs(fp32[1]["loss"])
    assert abs(mixed[1]["eval_loss"] - fp32[1]["eval_loss"]) <= 2e-2 * abs(fp32[1]["eval_loss"])
    for m, f in zip(mixed, fp32, strict=True):
        assert abs(m["grad_norm"] - f["grad_norm"]) <= 5e-2 * f["grad_norm"], (m["grad_norm"], f["grad_norm"])
