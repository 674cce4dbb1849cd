"""Checkpoint save/load throughput: NTP sharded checkpoints next to torch.save/torch.load and DCP.

    python bench/checkpoint.py [--hidden 640] [--layers 4] [--vocab 16384] [--repeat 4] [--dir DIR]
                               [--train-repeat 6] [--window 3] [--batch 1] [--seq 64]

The state is a GPT-style model's fp32 weights plus its AdamW moments (what a checkpoint holds), the
same in every row.  Rows, all on one machine in one run:

- `torch.save` of the full state dict (then fsync, the durability of a committed checkpoint) and
  `torch.load` + `load_state_dict`, in one process: the baseline;
- the ntp_nemo sharded checkpoint saved and loaded in one process (xxh3 digests written and
  checked, manifest, commit all included);
- the same chunks through `torch.distributed.checkpoint` (DCP `FileSystemWriter`/`Reader`, no
  integrity check), in one process, for comparison;
- saved from two TP-2 replicas (4 ranks) and loaded on TP 3 (3 ranks, resharding);
- the asynchronous save, seen from a training loop: the same model trains (forward + backward +
  AdamW step on one `--batch` x `--seq` micro-batch) in windows of `--window` steps, in turn
  without a save, with an asynchronous save issued at the window's first step boundary ("staging
  deferred", as shipped), and with one that copies the state inside `save()` and writes at the
  caller's CPU priority ("staging in save()", as before), each save window followed by an untimed
  wait for the commit.  Measured directly: the `save()` call and the wait of the next optimizer
  step for the background staging (the step guard); measured as a difference: the first step after
  the save and the whole window against the save-free ones (this includes the CPU the background
  copy and write take from the training step).  Beside them, without training: the synchronous
  copy of the state into the reused staging buffers, the time from `save()` to the commit, and
  DCP's `async_save` blocking time.

Throughput = state bytes (the torch.save file) / wall time of the slowest rank, best of `--repeat`;
CPU seconds (all threads, summed over ranks) are printed beside every wall time.  Files stay in the
page cache between save and load, so loads measure the read path, not the disk.  The last line is
`ratio save=<x> load=<y> reshard_load=<z> async_blocking=<w>`: x, y, z = ntp_nemo's MB/s over
torch.save's / torch.load's; w = (the `save()` call + the next optimizer step's wait for the
staging), median over the save windows, over the synchronous save's wall time (best of `--repeat`).
The lines before it give, per saver, the same blocked time and the step-time differences (first
step, whole window) over the same denominator.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ntp_nemo.checkpoint import AsyncCheckpointSaver, load_checkpoint, save_checkpoint
from ntp_nemo.checkpoint.dcp_io import load_dcp, save_dcp
from ntp_nemo.checkpoint.sharded import Staging, WritePlan, take_snapshot
from ntp_nemo.checkpoint.storage import Chunk
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology

if __package__ in (None, ""):  # run as `python bench/NAME.py`: the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.shapes import adamw  # noqa: E402

# The optimizer's hyperparameters change nothing this bench measures: its ranks are assembled with these.
OPTIM = adamw(1e-4, weight_decay=0.0)

MB = 1e6


def _model_and_optimizer(rank: int, layout: tuple, cfg: ModelConfig):
    model = RankPlace(ResolvedLayout.make(Topology(*layout)), rank).build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step so the optimizer holds its moments
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _fresh(*paths: Path) -> None:
    """Remove a previous save's output, so every timed save writes new files (as every save of a run
    does) and no method pays for unlinking the last one."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _timed(fn, flush: bool = False, clear: tuple[Path, ...] = ()) -> tuple[float, float]:
    """(wall, CPU) seconds of `fn`, between barriers when distributed; `flush`: start with no dirty
    pages queued for the disk (the previous save's writeback must not land on this one)."""
    _fresh(*clear)
    if flush:
        os.sync()
    if dist.is_initialized():
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0, time.process_time() - c0


def _best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(runs)


def one_process_worker(rank, world, cfg, layout, root, repeat, train):
    """torch.save/torch.load, the ntp_nemo checkpoint and DCP on the same state, interleaved (each
    repeat runs every method once, so a busy moment of a shared machine hits all of them alike)."""
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    full = Path(root) / "full_state.pt"
    ntp = Path(root) / "one" / "step_000001"
    dcp_dir = Path(root) / "dcp"
    chunks = take_snapshot(model, opt).chunks
    targets = [Chunk(c.key, c.global_shape, c.offsets, torch.empty_like(c.tensor)) for c in chunks]

    def torch_save():
        with open(full, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load():
        state = torch.load(full, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    saves = {"torch": torch_save, "ntp": lambda: save_checkpoint(ntp, model, opt, {"step": 1}, step=1),
             "dcp": lambda: save_dcp(dcp_dir, chunks)}
    loads = {"torch": torch_load, "ntp": lambda: load_checkpoint(ntp, model, opt),
             "dcp": lambda: load_dcp(dcp_dir, targets)}
    outputs = {"torch": (full,), "ntp": (ntp,), "dcp": (dcp_dir,)}
    out: dict[str, dict] = {name: {"save": [], "load": []} for name in saves}
    for _ in range(repeat):
        for name, fn in saves.items():
            out[name]["save"].append(_timed(fn, flush=True, clear=outputs[name]))
    for _ in range(repeat):
        for name, fn in loads.items():
            out[name]["load"].append(_timed(fn))
    assert all(torch.equal(t.tensor, c.tensor) for t, c in zip(targets, chunks, strict=True))
    best = {name: (min(r["save"]), min(r["load"])) for name, r in out.items()}
    sizes = {"torch": full.stat().st_size, "ntp": sum(f.stat().st_size for f in ntp.iterdir())}
    return best, sizes, _async(model, opt, root, repeat), _training_loop(cfg, layout, root, *train)


def _async(model, opt, root, repeat):
    """Without training: the synchronous copy into the reused staging buffers (what an asynchronous
    save blocked for before the copy was deferred), the time from `save()` until the commit, and
    DCP's async_save blocking time."""
    plan, staging = WritePlan(), Staging()
    take_snapshot(model, opt, plan=plan, staging=staging)  # allocates the buffers, as the first save does
    copies = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        take_snapshot(model, opt, plan=plan, staging=staging)
        copies.append((time.perf_counter() - t0, time.process_time() - c0))
    del staging
    saver = AsyncCheckpointSaver()
    saver.save(Path(root) / "async" / "step_000000", model, opt, {"step": 0}, step=0).result()
    total = []
    for i in range(repeat):
        os.sync()
        t0 = time.perf_counter()
        saver.save(Path(root) / "async" / f"step_{i + 1:06d}", model, opt, {"step": i + 1}, step=i + 1,
                   keep_last=1).result()
        total.append(time.perf_counter() - t0)
    saver.close()
    try:  # DCP's own async save of the same tensors (it stages a CPU copy, then writes in a thread)
        import torch.distributed.checkpoint as dcp

        state = {f"{c.key}@{c.offsets}": c.tensor for c in take_snapshot(model, opt).chunks}
        writer = dcp.FileSystemWriter(str(Path(root) / "dcp_async"))
        runs = []
        for _ in range(repeat):
            os.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
            fut.result()
        dcp_blocking = min(runs)
    except Exception as err:  # report, do not hide, a DCP version that cannot do this
        dcp_blocking = f"n/a ({type(err).__name__}: {err})"
    return min(copies), min(total), dcp_blocking


def _training_loop(cfg, layout, root, repeat, window, batch, seq):
    """Train the same model in windows of `window` steps, in turn without a save, with an
    asynchronous save at the window's first step boundary, and with one that copies the state
    inside save() and writes at the caller's CPU priority (as before the copy was deferred); after a
    save window, wait for the commit (untimed).  Returns the first step's and the whole window's
    wall time of the save-free windows, and per saver and save window: the save() call (wall, CPU),
    the guard's wait in the next optimizer step, the first step's and the window's wall time."""
    from ntp_nemo.runtime.step import train_step as one_step

    state = assemble(ResolvedLayout.make(Topology(*layout)), 0, cfg, OPTIM, None, seed=0)
    model, opt = state.model, state.optimizer  # the run's AdamW (lr 1e-4, no decay)
    toks = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def train_step() -> float:
        t0 = time.perf_counter()
        one_step(state, [toks], toks[:, 1:].numel(), max_norm=None)
        return time.perf_counter() - t0

    savers = {"deferred": AsyncCheckpointSaver(),  # as shipped
              "in save()": AsyncCheckpointSaver(defer_staging=False, background_nice=False)}  # before
    train_step()
    train_step()  # warm: optimizer state exists, allocator settled
    for name, saver in savers.items():  # allocates the staging buffers
        saver.save(Path(root) / name / "step_000000", model, opt, {"step": 0}, step=0).result()
    plain: list[tuple[float, float]] = []
    saved: dict[str, list[tuple[float, float, float, float, float]]] = {name: [] for name in savers}
    for i in range(repeat):
        os.sync()
        steps = [train_step() for _ in range(window)]
        plain.append((steps[0], sum(steps)))
        for name, saver in savers.items():
            os.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            saver.save(Path(root) / name / f"step_{i + 1:06d}", model, opt, {"step": i + 1}, step=i + 1,
                       keep_last=1)
            call = (time.perf_counter() - t0, time.process_time() - c0)
            steps = [train_step()]
            guard = saver.guard_wait_s
            steps += [train_step() for _ in range(window - 1)]
            saved[name].append((call[0], call[1], guard, steps[0], sum(steps)))
            saver.wait()
    for saver in savers.values():
        saver.close()
    return plain, saved


def sharded_save_worker(rank, world, cfg, layout, root, repeat):
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    path = Path(root) / "four" / "step_000001"
    runs = [_timed(lambda: save_checkpoint(path, model, opt, {"step": 1}, step=1), flush=True,
                   clear=(path,) if rank == 0 else ()) for _ in range(repeat)]
    written = sum(f.stat().st_size for f in path.glob(f"data_{rank:05d}_*.bin"))
    saver = AsyncCheckpointSaver()  # each rank stages only the share it writes (in the background)
    blocking = []
    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fut = saver.save(Path(root) / "four_async" / f"step_{i:06d}", model, opt, {"step": i}, step=i,
                         keep_last=1)
        blocking.append(time.perf_counter() - t0)
        fut.result()
    saver.close()
    return min(runs), written, min(blocking[1:])  # save() calls; the first allocates the buffers


def reshard_load_worker(rank, world, cfg, layout, root, repeat):
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(rank, layout, cfg)
    path = Path(root) / "four" / "step_000001"
    return min(_timed(lambda: load_checkpoint(path, model, opt)) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--train-repeat", type=int, default=6, help="save windows (and as many save-free ones)")
    ap.add_argument("--window", type=int, default=3, help="training steps per window")
    ap.add_argument("--batch", type=int, default=1, help="sequences per training step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(arch="gpt2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(1, args.hidden // 64), ffn_hidden_size=4 * args.hidden, max_seq_len=256)
    one = (1, [1], [1] * (args.layers + 2))
    replicas = (2, [2, 2], [2] * (args.layers + 2))
    tp3 = (3, [3], [3] * (args.layers + 2))
    root = Path(args.dir or tempfile.mkdtemp(prefix="ntp-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    try:
        best, sizes, (copy, committed, dcp_blocking), (plain, saved) = run_workers(
            one_process_worker, 1, cfg, one, str(root), args.repeat,
            (args.train_repeat, args.window, args.batch, args.seq))[0]
        s4 = run_workers(sharded_save_worker, 4, cfg, replicas, str(root), args.repeat)
        l3 = run_workers(reshard_load_worker, 3, cfg, tp3, str(root), args.repeat)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    size = sizes["torch"]
    rs = (max(s[0][0] for s in s4), sum(s[0][1] for s in s4))  # slowest rank's wall, all ranks' CPU
    rl = (max(r[0] for r in l3), sum(r[1] for r in l3))
    params = sum(p.numel() for p in _model_and_optimizer(0, one, cfg)[0].parameters())
    print(f"model: GPT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {params / 1e6:.2f} M "
          f"params; state = fp32 weights + AdamW moments = {size / MB:.1f} MB (torch.save file); "
          f"best of {args.repeat}; {os.cpu_count()} CPUs; wall s = slowest rank, cpu s = all ranks' threads")
    head = " ".join(f"{h:>{w}s}" for h, w in (("save s", 7), ("cpu s", 6), ("MB/s", 6), ("load s", 7),
                                               ("cpu s", 6), ("MB/s", 6)))
    print(f"{'method':44s} {'ranks':>6s} {head}")

    def row(name, ranks, save, load):
        cells = [f"{name:44s} {ranks:>6s}"]
        for t in (save, load):
            cells.append(f"{t[0]:7.3f} {t[1]:6.2f} {size / MB / t[0]:6.0f}")
        print(" ".join(cells))

    row("torch.save / torch.load (full state)", "1/1", *best["torch"])
    row("ntp sharded, 1 process (xxh3 on write+read)", "1/1", *best["ntp"])
    row("DCP FileSystemWriter/Reader, same chunks", "1/1", *best["dcp"])
    row("ntp sharded, 2xTP2 -> TP3 (resharding)", "4/3", rs, rl)
    per_rank = " / ".join(f"{s[1] / MB:.1f}" for s in s4)
    print(f"on disk: ntp 1 process {sizes['ntp'] / MB:.1f} MB; 2xTP2 data MB written per rank {per_rank}")
    sync_save = best["ntp"][0]
    dcp_b = (f"{dcp_blocking[0]:.3f} s (cpu {dcp_blocking[1]:.2f} s)" if isinstance(dcp_blocking, tuple)
             else dcp_blocking)
    med = statistics.median
    step0, win0 = med(r[0] for r in plain), med(r[1] for r in plain)
    n = args.train_repeat
    print(f"training loop, 1 process ({args.batch}x{args.seq} tokens per step, windows of {args.window} "
          f"steps: {n} without a save, {n} with each async save at the first step boundary, in turn; "
          f"medians): step {step0:.3f} s, window {win0:.3f} s without a save")
    figures = {}
    for name, runs in saved.items():
        call_w, call_c = med(r[0] for r in runs), med(r[1] for r in runs)
        guard, blocked = med(r[2] for r in runs), med(r[0] + r[2] for r in runs)
        step1, win1 = med(r[3] for r in runs), med(r[4] for r in runs)
        figures[name] = (call_w, call_c, blocked, step1 - step0, win1 - win0)
        diffs = " ".join(f"{r[3] - p[0]:+.3f}" for r, p in zip(runs, plain, strict=True))
        print(f"  staging {name:9s}: save() call {call_w:.3f} s (cpu {call_c:.3f} s); next optimizer step "
              f"waited {guard:.3f} s (max {max(r[2] for r in runs):.3f} s); blocked = call + wait "
              f"{blocked:.3f} s (max {max(r[0] + r[2] for r in runs):.3f} s); first step {step1:.3f} s "
              f"(+{step1 - step0:.3f} s), window {win1:.3f} s (+{win1 - win0:.3f} s); first-step "
              f"differences window by window: {diffs}")
    call_w, call_c, blocked, _, _ = figures["deferred"]
    dcp_b = (f"{dcp_blocking[0]:.3f} s (cpu {dcp_blocking[1]:.2f} s)" if isinstance(dcp_blocking, tuple)
             else dcp_blocking)
    print(f"without training: copying the state into the staging buffers (the old blocking) {copy[0]:.3f} s "
          f"(cpu {copy[1]:.2f} s); save() to commit {committed:.3f} s; DCP async_save blocks {dcp_b}; "
          f"synchronous save {sync_save[0]:.3f} s (cpu {sync_save[1]:.2f} s)")
    load_after = os.getloadavg()
    print(f"async save (2xTP2, 4 ranks, slowest rank, no training step): save() returns after "
          f"{max(s[2] for s in s4):.3f} s against the synchronous save's {rs[0]:.3f} s")
    print(f"bench wall time {time.perf_counter() - t_start:.0f} s; load average (1 min) {load_before[0]:.1f} "
          f"before, {load_after[0]:.1f} after, on {os.cpu_count()} CPUs")
    x = best["torch"][0][0] / sync_save[0]
    y = best["torch"][1][0] / best["ntp"][1][0]
    z = best["torch"][1][0] / rl[0]
    w = blocked / sync_save[0]
    cx, cy = best["torch"][0][1] / sync_save[1], best["torch"][1][1] / best["ntp"][1][1]
    print(f"same ratios on CPU seconds (a busy shared machine stretches wall time, not CPU time): "
          f"save={cx:.2f} load={cy:.2f} reshard_load={best['torch'][1][1] / rl[1]:.2f} "
          f"async_call={call_c / sync_save[1]:.3f} (the save() call; the guard's wait is wall time only)")
    for name, (cw, _, blk, ds, dw) in figures.items():
        print(f"over the synchronous save's wall time, staging {name}: blocked={blk / sync_save[0]:.3f} "
              f"first_step_difference={ds / sync_save[0]:.3f} window_difference={dw / sync_save[0]:.3f} "
              f"(+ the save() call: {(cw + ds) / sync_save[0]:.3f} / {(cw + dw) / sync_save[0]:.3f})")
    print(f"over the synchronous save's wall time, without training: "
          f"staging_copy={copy[0] / sync_save[0]:.3f}")
    print(f"ratio save={x:.2f} load={y:.2f} reshard_load={z:.2f} async_blocking={w:.3f}")


if __name__ == "__main__":
    main()
