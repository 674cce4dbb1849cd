"""Checkpoint save/load throughput: NTP sharded checkpoints next to torch.save/torch.load.

    python bench/checkpoint.py [--hidden 320] [--layers 6] [--vocab 8192] [--repeat 3] [--dir DIR]

The state is a GPT-style model's fp32 weights plus its AdamW moments (what a checkpoint holds).
Rows: `torch.save` of the full state dict (then fsync, for the same durability as a committed
checkpoint) and `torch.load` + `load_state_dict`, in one process; the sharded checkpoint saved
and loaded in one process; saved from two TP-2 replicas (4 ranks) and loaded on TP 3 (3 ranks,
resharding).  Throughput = logical state bytes / wall time of the slowest rank (best of
`--repeat`); sharded saves include writing, fsync, sha256 of every file and the commit.  The
files stay in the page cache between save and load, so loads measure deserialisation, not the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ntp_nemo.checkpoint import AsyncCheckpointSaver, load_checkpoint, save_checkpoint
from ntp_nemo.checkpoint.manifest import file_digest
from ntp_nemo.config.schema import ModelConfig
from ntp_nemo.parallel.launch import run_workers
from ntp_nemo.parallel.runtime import NTPRuntime
from ntp_nemo.topology import Topology

MB = 1e6


def _model_and_optimizer(rank: int, layout: tuple, cfg: ModelConfig):
    model = NTPRuntime(Topology(*layout), rank).build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step so the optimizer holds its moments
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _timed(fn) -> float:
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def torch_save_worker(rank, world, cfg, layout, root, repeat):
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    target = Path(root) / "full_state.pt"

    def save():
        with open(target, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load():
        state = torch.load(target, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    saves = [_timed(save) for _ in range(repeat)]
    loads = [_timed(load) for _ in range(repeat)]
    return min(saves), min(loads), target.stat().st_size


def sharded_save_worker(rank, world, cfg, layout, root, repeat):
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    path = Path(root) / "sharded" / "step_000001"
    saves = [_timed(lambda: save_checkpoint(path, model, opt, {"step": 1}, step=1)) for _ in range(repeat)]
    hash_s = None
    if rank == 0:
        t0 = time.perf_counter()
        for f in path.iterdir():
            file_digest(f)
        hash_s = time.perf_counter() - t0
    blocking, total = None, None
    if world == 1:  # async: time until `save` returns (the snapshot) and until the commit
        saver = AsyncCheckpointSaver()
        t0 = time.perf_counter()
        fut = saver.save(Path(root) / "async" / "step_000001", model, opt, {"step": 1}, step=1)
        blocking = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        saver.close()
    return min(saves), hash_s, _dir_bytes(path), blocking, total


def sharded_load_worker(rank, world, cfg, layout, root, repeat):
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    path = Path(root) / "sharded" / "step_000001"
    return min(_timed(lambda: load_checkpoint(path, model, opt)) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(arch="gpt2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(1, args.hidden // 64), ffn_hidden_size=4 * args.hidden, max_seq_len=256)
    one = (1, [1], [1] * (args.layers + 2))
    replicas = (2, [2, 2], [2] * (args.layers + 2))
    tp3 = (3, [3], [3] * (args.layers + 2))
    root = Path(args.dir or tempfile.mkdtemp(prefix="ntp-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        save_s, load_s, size = run_workers(torch_save_worker, 1, cfg, one, str(root), args.repeat)[0]
        state_bytes = size  # reference: the full state dict on disk (weights + moments + a few KB of pickle)
        rows.append(("torch.save / torch.load (full state)", "1 / 1", save_s, load_s, size))
        s1 = run_workers(sharded_save_worker, 1, cfg, one, str(root), args.repeat)[0]
        l1 = run_workers(sharded_load_worker, 1, cfg, one, str(root), args.repeat)[0]
        rows.append(("ntp sharded, 1 process -> 1 process", "1 / 1", s1[0], l1, s1[2]))
        s4 = run_workers(sharded_save_worker, 4, cfg, replicas, str(root), args.repeat)
        l3 = run_workers(sharded_load_worker, 3, cfg, tp3, str(root), args.repeat)
        rows.append(("ntp sharded, replicas (2,2) -> TP 3", "4 / 3", s4[0][0], max(l3), s4[0][2]))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in _model_and_optimizer(0, one, cfg)[0].parameters())
    print(f"model: GPT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {params / 1e6:.2f} M "
          f"params; state = fp32 weights + AdamW moments = {state_bytes / MB:.1f} MB (torch.save file)")
    print(f"{'method':40s} {'ranks save/load':>15s} {'save s':>8s} {'save MB/s':>10s} {'load s':>8s} "
          f"{'load MB/s':>10s} {'on disk MB':>11s}")
    for name, ranks, save_s, load_s, size in rows:
        print(f"{name:40s} {ranks:>15s} {save_s:8.3f} {state_bytes / MB / save_s:10.0f} {load_s:8.3f} "
              f"{state_bytes / MB / load_s:10.0f} {size / MB:11.1f}")
    print(f"of the 1-process sharded save: sha256 of all files {s1[1]:.3f} s; "
          f"async save blocks for {s1[3]:.3f} s (CPU snapshot), committed after {s1[4]:.3f} s")


if __name__ == "__main__":
    main()
