"""Memory saved by activation recomputation and by the distributed optimizer, measured.

    python bench/memory.py [--layers 4] [--hidden 256] [--seq-len 256] [--micro-batch-size 4] [--bucket-mb 1]

1. Saved activation bytes per micro-batch for `model.recompute=none|selective|full` (and full every
   2nd layer), GPT-2- and Llama-style: every tensor autograd saves for the backward during one
   micro-batch's forward is counted once per storage by a `torch.autograd.graph.saved_tensors_hooks`
   pack hook (`ActivationMeter`, the pipeline engine's accounting), parameters and buffers excluded;
   these are the bytes a micro-batch holds between its forward and its backward.  Single rank, TP 1.
   The gradients of the runs are compared with the run without recomputation (they must be identical).
   SDPA "default" lets PyTorch pick the kernel (flash attention on CPU, which saves only q, k, v, the
   output and the log-sum-exp, so selective recomputation has little left to drop); "math" forces the
   unfused kernel, which saves the s x s attention probabilities that selective recomputation removes.
2. Optimizer-state bytes per rank, plain `torch.optim.AdamW` against `DistributedAdamW`, on DP 2 and
   DP 4 (TP 1) and on the degraded layout replicas (2, 1): plain = the tensors in the AdamW state after
   one step; distributed = the moments of the chunks the rank owns.  float32 parameters, so the
   parameters themselves are the master weights in both cases (no extra master copy).
3. Device memory of a checkpoint save, plain AdamW against `DistributedAdamW` side by side, per rank of
   the same layouts after one step: `state` = the optimizer state the device keeps between steps; `save
   extra` = the peak of tensor bytes the save allocates on the device while it takes its snapshot (the
   distributed optimizer gathers the unsharded moments of its buckets; the plain one only hands out
   views of its state); `peak` = state + save extra; `held after` = bytes the save allocated that are
   still alive once the snapshot is written.  Counted by a `TorchDispatchMode` that follows every fresh
   output of an operator until it is freed.  This machine's device is the CPU, which is also where the
   distributed optimizer stages the full moments for the writer (host memory on a GPU): to count the
   device's side alone, the run points that staging at the meta device (shapes only) and measures the
   snapshot, which is all of the save that touches device memory (the writer reads the snapshot).  The
   distributed optimizer gathers one gradient bucket at a time, so its extra is the largest bucket
   (`--bucket-mb`; 25 MiB by default in training, against GiBs of moments on a real model).
4. Saved activation bytes per rank per micro-batch with `ntp.sequence_parallel` off and on, on the
   layouts (3, 2) and (2, 1) (gloo workers, Llama-style, a sequence the degree 3 does not divide), the
   same pack-hook count; "hidden-sized" is the part held in tensors of b x s x hidden (the replicated
   regions: norm inputs, the inputs of the column-parallel projections), which SP divides by the degree.
   `--sections 4` runs only this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.checkpoint.sharded import take_snapshot
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.pipeline.engine import ActivationMeter
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology

if __package__ in (None, ""):  # run as `python bench/memory.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import adamw  # noqa: E402

MiB = float(1 << 20)


def saved_bytes(cfg: ModelConfig, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """(bytes saved for the backward by one micro-batch's forward, gradients after its backward)."""
    model = build_model(cfg, seed=0)
    model._rope(torch.empty(0))  # the rotary tables are cached buffers, not activations
    meter = ActivationMeter()
    meter.exclude(list(model.parameters()) + list(model.buffers())
                  + [t for pair in model._rope_cache.values() for t in pair])
    with meter.recording(0):
        loss = model.loss_sum(tokens)
    saved = meter.live.get(0, 0)
    loss.backward()
    return saved, {n: p.grad for n, p in model.named_parameters()}


def activation_table(base: ModelConfig, mbs: int, seq: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.vocab_size, (mbs, seq + 1), generator=gen)
    for arch, kernel in (("gpt2", "default"), ("llama", "default"), ("gpt2", "math")):
        kv = base.num_heads // 2 if arch == "llama" else None
        cfg = dataclasses.replace(base, arch=arch, num_kv_heads=kv)
        backends = [SDPBackend.MATH] if kernel == "math" else [
            SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            ref_bytes, ref_grads = saved_bytes(cfg, tokens)
            for mode, every in (("none", 1), ("selective", 1), ("full", 2), ("full", 1)):
                if mode == "none":
                    b, same = ref_bytes, True
                else:
                    variant = dataclasses.replace(cfg, recompute=mode, recompute_every=every)
                    b, grads = saved_bytes(variant, tokens)
                    same = all(torch.equal(grads[n], g) for n, g in ref_grads.items())
                rows.append({"arch": arch, "sdpa": kernel,
                             "recompute": mode if mode != "full" or every == 1 else f"full/{every}",
                             "saved_bytes": b, "ratio_vs_none": ref_bytes / b, "grads_identical": same})
    return rows


def optimizer_worker(rank: int, world: int, cfg: ModelConfig, replica_tp: list[int]) -> dict:
    tp = max(replica_tp)
    layout = ResolvedLayout.make(Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2)))
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab_size, (2 * len(replica_tp), 33), generator=gen)
    out = {}
    for distributed in (False, True):
        state = assemble(layout, rank, cfg, adamw(distributed=distributed), None, seed=0)
        model, opt = state.model, state.optimizer
        micro = [toks[i : i + 1] for i in state.my_microbatches(toks.shape[0])]
        train_step(state, micro, toks[:, 1:].numel(), max_norm=1.0)
        if distributed:
            out["distributed"] = opt.state_bytes()
        else:
            out["plain"] = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                               if t.dim() > 0)  # the moments (the 0-dim step counters are negligible)
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors on `device` that operators allocate while active and that are still alive;
    `peak` is the most at any moment.  A fresh output is one whose storage no input shares (views and
    in-place results are not allocations); it is counted until the tensor is freed."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _flat_tensors((args, kwargs))
                  if t.device == self.device}
        for t in _flat_tensors(out):
            if t.device == self.device and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                inputs.add(t.untyped_storage().data_ptr())
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _flat_tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _flat_tensors(x)]
    return []


def _held_after(meter: LiveBytes, settle_s: float = 2.0) -> int:
    """Bytes the snapshot still holds once it is gone: what is referenced after a collection counts (a
    reference cycle's tensors go at one).  The byte tensors of `all_gather_object` are released by the
    process group's own thread shortly after the collective returns (its work object drops them then):
    they are waited for, at most `settle_s`, so that what is counted is what the save keeps."""
    deadline = time.monotonic() + settle_s
    gc.collect()
    while meter.live and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    return meter.live


def save_memory_worker(rank: int, world: int, cfg: ModelConfig, replica_tp: list[int],
                       bucket_mb: float = 25.0) -> dict:
    """Per optimizer kind: (device state bytes, extra bytes the snapshot allocates at its peak on the
    device, bytes of those still alive after it)."""
    tp = max(replica_tp)
    layout = ResolvedLayout.make(Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2)))
    gen = torch.Generator().manual_seed(0)
    seq = min(32, cfg.max_seq_len)
    toks = torch.randint(0, cfg.vocab_size, (2 * len(replica_tp), seq + 1), generator=gen)
    out = {}
    for distributed in (False, True):
        st = assemble(layout, rank, cfg, adamw(distributed=distributed), None, seed=0,
                      bucket_mb=bucket_mb)
        model, opt = st.model, st.optimizer
        train_step(st, [toks[i : i + 1] for i in st.my_microbatches(toks.shape[0])], toks[:, 1:].numel(),
                   max_norm=1.0)
        if distributed:
            state = opt.state_bytes()
            opt.host = torch.device("meta")  # count the device's side only (see the module doc)
        else:
            state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                        if t.dim() > 0)
        meter = LiveBytes(torch.device("cpu"))
        with meter:
            snap = take_snapshot(model, opt)
            del snap
            held = _held_after(meter)
        out["distributed" if distributed else "plain"] = {"state": state, "save_extra": meter.peak,
                                                          "held_after": held}
    return out


def save_table(cfg: ModelConfig, bucket_mb: float) -> list[dict]:
    rows = []
    for name, replica_tp in (("DP2 x TP1", [1, 1]), ("DP4 x TP1", [1, 1, 1, 1]), ("replicas (2,1)", [2, 1])):
        results = run_workers(save_memory_worker, sum(replica_tp), cfg, replica_tp, bucket_mb)
        for rank, r in enumerate(results):
            rows.append({"layout": name, "rank": rank, **r})


class _HiddenMeter(ActivationMeter):
    """ActivationMeter that also sums the storages of tensors of rows of `hidden` elements (b x s x h
    or its (b*s) x h view: the replicated regions and the column-parallel inputs)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden_size, self.hidden_bytes = hidden, 0

    def add(self, mb: int, t: torch.Tensor) -> None:
        before = self.live.get(mb, 0)
        super().add(mb, t)
        if self.live.get(mb, 0) > before and t.dim() >= 2 and t.shape[-1] == self.hidden_size:
            self.hidden_bytes += self.live[mb] - before


def sp_worker(rank: int, world: int, cfg: ModelConfig, replica_tp: list[int], mbs: int, seq: int) -> dict:
    torch.set_num_threads(1)
    tp = max(replica_tp)
    topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (mbs, seq + 1), generator=gen)
    out = {"degree": replica_tp[topo.coord(rank).replica]}
    for sp in (False, True):
        rt = RankPlace(ResolvedLayout.make(topo, sequence_parallel=sp), rank)
        model = rt.build_model(cfg, 0)
        model._rope(torch.empty(0))
        meter = _HiddenMeter(cfg.hidden_size)
        meter.exclude(list(model.parameters()) + list(model.buffers())
                      + [t for pair in model._rope_cache.values() for t in pair])
        with meter.recording(0):
            loss = model.loss_sum(tokens)
        loss.backward()
        out["on" if sp else "off"] = {"saved": meter.live[0], "hidden": meter.hidden_bytes,
                                      "loss": loss.item()}
    return out


def sp_table(cfg: ModelConfig, mbs: int, seq: int) -> list[dict]:
    rows = []
    for name, replica_tp in (("(3,2)", [3, 2]), ("(2,1)", [2, 1])):
        for rank, r in enumerate(run_workers(sp_worker, sum(replica_tp), cfg, replica_tp, mbs, seq)):
            off, on = r["off"], r["on"]
            rows.append({"layout": name, "rank": rank, "degree": r["degree"], "saved_off": off["saved"],
                         "saved_on": on["saved"], "hidden_off": off["hidden"], "hidden_on": on["hidden"],
                         "same_loss": off["loss"] == on["loss"]})
            print(f"{name:<7} {rank:>4} {r['degree']:>6} {off['saved'] / MiB:>10.2f} "
                  f"{on['saved'] / MiB:>10.2f} {on['saved'] / off['saved']:>8.3f} "
                  f"{off['hidden'] / MiB:>11.2f} {on['hidden'] / MiB:>10.2f} "
                  f"{on['hidden'] / max(off['hidden'], 1):>8.3f} {1 / r['degree']:>6.3f} "
                  f"{abs(on['loss'] - off['loss']) / abs(off['loss']):>9.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size (part 3)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--sections", default="1,2,3,4", help="which of the four tables to print, e.g. 4")
    ap.add_argument("--sp-seq-len", type=int, default=250, help="sequence of table 4 (250 = 83+83+84)")
    args = ap.parse_args()
    sections = {int(x) for x in args.sections.split(",")}
    torch.set_num_threads(2)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(2, args.hidden // 64), ffn_hidden_size=4 * args.hidden,
                      max_seq_len=args.seq_len, tie_embeddings=True)
    act, opt_rows, save_rows, sp_rows = [], [], [], []
    if 1 in sections:
        print(f"1. saved activations per micro-batch: {args.layers} layers, hidden {args.hidden}, "
              f"seq {args.seq_len}, micro-batch {args.micro_batch_size}, vocab {args.vocab}, float32, TP 1")
        print(f"{'arch':<6} {'SDPA':<8} {'recompute':<10} {'saved MiB':>10} {'none / this':>12} "
              f"{'grads identical':>16}")
        act = activation_table(cfg, args.micro_batch_size, args.seq_len)
    for r in act:
        print(f"{r['arch']:<6} {r['sdpa']:<8} {r['recompute']:<10} {r['saved_bytes'] / MiB:>10.2f} "
              f"{r['ratio_vs_none']:>12.2f} {r['grads_identical']!s:>16}", flush=True)
    if 2 in sections:
        print(f"\n2. optimizer state per rank (AdamW moments), same model ({args.layers} layers, hidden "
              f"{args.hidden}), float32")
        print(f"{'layout':<14} {'rank':>4} {'params MiB':>10} {'plain MiB':>10} {'distributed MiB':>16} "
              f"{'dist / plain':>12} {'1/holders':>10}")
    for name, replica_tp in (("DP2 x TP1", [1, 1]), ("DP4 x TP1", [1, 1, 1, 1]), ("replicas (2,1)", [2, 1])):
        if 2 not in sections:
            break
        res = run_workers(optimizer_worker, sum(replica_tp), cfg, replica_tp)
        for rank, r in enumerate(res):
            ratio = r["distributed"] / r["plain"]
            ideal = 1 / len(replica_tp)
            opt_rows.append({"layout": name, "rank": rank, **r, "ratio": ratio, "ideal": ideal})
            print(f"{name:<14} {rank:>4} {r['param_bytes'] / MiB:>10.2f} {r['plain'] / MiB:>10.2f} "
                  f"{r['distributed'] / MiB:>16.2f} {ratio:>12.3f} {ideal:>10.3f}", flush=True)
    if 3 in sections:
        print(f"\n3. device memory of a checkpoint save (optimizer state + what the save allocates), same "
              f"model, float32, gradient buckets of {args.bucket_mb} MiB, MiB")
        print(f"{'layout':<14} {'rank':>4} | {'plain: state':>12} {'save extra':>10} {'peak':>7} | "
              f"{'distributed: state':>18} {'save extra':>10} {'peak':>7} {'held after':>10} | "
              f"{'peak dist/plain':>15}")
        save_rows = save_table(cfg, args.bucket_mb)
        for r in save_rows:
            p, d = r["plain"], r["distributed"]
            pp, dp = p["state"] + p["save_extra"], d["state"] + d["save_extra"]
            print(f"{r['layout']:<14} {r['rank']:>4} | {p['state'] / MiB:>12.2f} "
                  f"{p['save_extra'] / MiB:>10.2f} {pp / MiB:>7.2f} | {d['state'] / MiB:>18.2f} "
                  f"{d['save_extra'] / MiB:>10.2f} {dp / MiB:>7.2f} {d['held_after'] / MiB:>10.2f} | "
                  f"{dp / pp:>15.3f}", flush=True)
    if 4 in sections:
        llama = dataclasses.replace(cfg, arch="llama", num_kv_heads=cfg.num_heads // 2,
                                    max_seq_len=max(cfg.max_seq_len, args.sp_seq_len))
        print(f"\n4. saved activations per rank per micro-batch, ntp.sequence_parallel off / on: "
              f"Llama-style, {args.layers} layers, hidden {args.hidden}, seq {args.sp_seq_len}, micro-batch "
              f"{args.micro_batch_size}, float32")
        print(f"{'layout':<7} {'rank':>4} {'degree':>6} {'off MiB':>10} {'on MiB':>10} {'on/off':>8} "
              f"{'hidden off':>11} {'hidden on':>10} {'on/off':>8} {'1/deg':>6} {'loss diff':>9}")
        sp_rows = sp_table(llama, args.micro_batch_size, args.sp_seq_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"activations": act, "optimizer": opt_rows, "save": save_rows,
                       "sequence_parallel": sp_rows}, f, indent=1)


if __name__ == "__main__":
    main()
