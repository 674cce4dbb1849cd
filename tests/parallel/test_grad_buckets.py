"""Gradients as views into the DP sync's persistent bucket buffers, and the foreach clipping norm: the same
numbers as the per-step pack/unpack path (float64 within 1e-10), with no flatten copy for a parameter that is
one whole fragment; the overlapped sync and the distributed optimizer (its reduce-scatters read the same kind
of persistent buffers) against the packed sync and the plain AdamW.  One small forked gloo world of replicas
of unequal TP (2 + 1 ranks), so both kinds of fragment occur: the TP-2 ranks hold whole-parameter
fragments, the TP-1 rank parts of its parameters."""

from __future__ import annotations

import torch

from ntp_nemo.launch.workers import run_workers
from ntp_nemo.parallel.grad_sync import _SyncBucket
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, LLAMA, SEED, assembled, tokens


def _norm_sq_by_fragment(sync) -> float:
    """The squared-norm share as the former code took it: one norm per fragment, weighted, summed."""
    total = 0.0
    for f in sync.plan.fragments():
        g = sync.params[f.name].grad
        v = g if g.dim() == 0 else g.narrow(f.dim, f.start, f.length)
        total += float(torch.linalg.vector_norm(v, dtype=torch.float64)) ** 2 * f.norm_weight
    return total


def _passes(rank: int, world: int, cfg) -> dict:
    torch.set_num_threads(1)
    topology = Topology(2, [2, 1], [2] * (cfg.num_layers + 2))
    toks = tokens(cfg)
    out: dict = {}
    for mode in ("views", "packed"):
        rt, model = assembled(ResolvedLayout.make(topology), rank, cfg, dtype=torch.float32)
        sync = rt.sync
        if mode == "packed":  # the per-step pack/unpack path for every bucket (no persistent buffer)
            sync._make_bucket = lambda holders, frags: _SyncBucket(holders, frags, [False] * len(frags))
        model.to(torch.float64)  # cast after the sync was built, as a precision plugin does
        mine = list(rt.my_microbatches(6))
        grads, norms, cats, in_buffer = [], [], [], []
        for step, reset in enumerate(("none", "zero", "none")):
            if reset == "zero":
                for p in model.parameters():
                    p.grad.zero_()  # zero_grad(set_to_none=False)
            else:
                model.zero_grad(set_to_none=True)
            sync.prepare_grads()
            for i in mine[step % 2 :: 2] or mine:
                (model.loss_sum(toks[i : i + 1]) / toks[:, 1:].numel()).backward()
            buffers = {b.buffer.untyped_storage().data_ptr() for b in sync.buckets() if b.buffer is not None}
            whole = {f.name for b in sync.buckets() for f, w in zip(b.frags, b.whole, strict=True) if w}
            in_buffer.append(all(sync.params[n].grad.untyped_storage().data_ptr() in buffers for n in whole)
                             and (mode == "packed" or bool(whole) == bool(buffers)))
            calls: list[int] = []
            _counting_cats(sync.sync, calls)()
            cats.append(len(calls))
            grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})  # by value
            norms.append((float(sync.grad_norm_sq_local()), _norm_sq_by_fragment(sync)))
        partial = sum(not w for b in sync.buckets() for w in b.whole)
        out[mode] = {"grads": grads, "norms": norms, "cats": cats, "in_buffer": in_buffer,
                     "whole": sum(w for b in sync.buckets() for w in b.whole), "partial": partial,
                     "dtype": {str(p.grad.dtype) for p in model.parameters()}}
    return out


def _check(cfg) -> None:
    results = run_workers(_passes, 3, cfg)
    kinds = {"whole": 0, "partial": 0}
    for rank, res in enumerate(results):
        views, packed = res["views"], res["packed"]
        assert views["dtype"] == {"torch.float64"}
        kinds["whole"] += views["whole"]
        kinds["partial"] += views["partial"]
        for step, (a, b) in enumerate(zip(views["grads"], packed["grads"], strict=True)):
            assert a.keys() == b.keys()
            for name in a:
                a[name], b[name] = torch.from_numpy(a[name]), torch.from_numpy(b[name])
                scale = max(float(b[name].abs().max()), 1e-12)
                assert float((a[name] - b[name]).abs().max()) / scale <= 1e-10, (rank, step, name)
        for foreach, by_fragment in views["norms"] + packed["norms"]:
            assert abs(foreach - by_fragment) <= 1e-10 * by_fragment, (rank, foreach, by_fragment)
        assert all(views["in_buffer"]), rank  # the backward accumulated into the bucket buffers
        assert min(packed["cats"]) > 0 or packed["whole"] + packed["partial"] == 0
        if views["partial"] == 0:
            assert views["cats"] == [0, 0, 0], rank  # no flatten copy at all: the buffer is the gradients
    assert kinds["whole"] > 0 and kinds["partial"] > 0  # both kinds of fragment were exercised


def test_bucket_view_gradients_match_the_packed_sync_gpt():
    _check(GPT)


def test_bucket_view_gradients_match_the_packed_sync_llama():
    _check(LLAMA)


def _overlapped(rank: int, world: int, cfg) -> dict:
    """The overlapped sync (small buckets: several per holder set) with its bucket views, against the
    packed blocking sync on the same model and micro-batches, two steps."""
    from ntp_nemo.parallel.overlap import OverlappedGradSync

    torch.set_num_threads(1)
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * (cfg.num_layers + 2)))
    rt, model = assembled(layout, rank, cfg, bucket_mb=0.002)
    packed = rt.sync
    packed._make_bucket = lambda holders, frags: _SyncBucket(holders, frags, [False] * len(frags))
    ov = OverlappedGradSync(model, packed.plan, packed.group_of, packed.bucket_bytes)
    toks = tokens(cfg)
    errs, in_buffer = [], []
    for step in range(2):
        micro = [toks[i : i + 1] for i in rt.my_microbatches(6)][step:]
        model.zero_grad(set_to_none=step == 0)
        ov.begin_step(len(micro))
        rt.train_microbatches(model, micro, 6 * (toks.shape[1] - 1))
        storages = {buf.untyped_storage().data_ptr() for buf, _, _ in ov.buffers.all()}
        whole = [f.name for b, (_, _, w) in zip(ov.buckets, ov.buffers.all(), strict=True)
                 for f, x in zip(b.frags, w, strict=True) if x]
        in_buffer.append(all(model.get_parameter(n).grad.untyped_storage().data_ptr() in storages
                             for n in whole))
        ov.finish()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        rt.train_microbatches(model, micro, 6 * (toks.shape[1] - 1))
        packed.sync()
        errs.append(max(float((got[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-12)
                        for n, p in model.named_parameters()))
    ov.remove()
    return {"errs": errs, "in_buffer": in_buffer, "whole": len(whole), "buckets": len(ov.buckets)}


def test_overlapped_sync_with_bucket_views_matches_the_packed_sync():
    results = run_workers(_overlapped, 3, GPT)
    for rank, res in enumerate(results):
        assert res["buckets"] >= 3, res
        assert max(res["errs"]) <= 1e-10, (rank, res)
        assert all(res["in_buffer"]), (rank, res)
    assert sum(r["whole"] for r in results) > 0


def _adamw_against_foreach(dtype: torch.dtype, steps: int = 5) -> tuple[bool, float]:
    """`build_optimizer`'s AdamW against torch's foreach AdamW with the same groups, same gradients."""
    from ntp_nemo.models import build_model
    from ntp_nemo.parallel.dist_optimizer import adamw_param_groups
    from ntp_nemo.parallel.step_path import build_optimizer

    fused_model = build_model(LLAMA, seed=SEED).to(dtype)
    plain_model = build_model(LLAMA, seed=SEED).to(dtype)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    fused = build_optimizer(fused_model, None, weight_decay=0.1, **hyper)
    plain = torch.optim.AdamW(adamw_param_groups(plain_model, 0.1), foreach=True, **hyper)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    worst = max(float(((p - q).abs() / q.abs().clamp(min=1e-3)).max().detach())
                for p, q in zip(fused_model.parameters(), plain_model.parameters(), strict=True))
    return bool(fused.defaults["fused"]), worst


def test_adamw_is_fused_on_cpu_within_the_stated_tolerance_of_foreach():
    fused64, err64 = _adamw_against_foreach(torch.float64)
    fused32, err32 = _adamw_against_foreach(torch.float32)
    assert fused64 and fused32
    assert err64 <= 1e-14 and err32 <= 1e-5, (err64, err32)  # 5 steps: a few units in the last place


def test_adamw_on_meta_parameters_is_not_fused():
    """The dry run's meta parameters have no fused kernel: the foreach AdamW is built (and steps)."""
    from ntp_nemo.parallel.step_path import build_optimizer

    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, None, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert not opt.defaults["fused"]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()


def _counting_cats(fn, cats: list[int]):
    """`fn` with every `torch.cat` it calls appended to `cats`."""
    real_cat = torch.cat

    def counting(*args, **kwargs):
        cats.append(1)
        return real_cat(*args, **kwargs)

    def wrapped(*args, **kwargs):
        torch.cat = counting
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cat = real_cat

    return wrapped


def _distributed_optimizer(rank: int, world: int, cfg) -> dict:
    """Three float64 steps of the plain AdamW path and of the distributed optimizer (blocking and overlapped
    sync), the `.grad`s set to None before the second step; the distributed runs count the `torch.cat`
    calls of their reduce-scatters (the former pack) and where the whole-fragment gradients lie."""
    from tests.option_cases import run_steps, setup

    torch.set_num_threads(1)
    rt = RankPlace(ResolvedLayout.make(Topology(2, [2, 1], [2] * (cfg.num_layers + 2))), rank)
    out: dict = {}
    for name, (distributed, overlap) in {"plain": (False, False), "distributed": (True, False),
                                         "distributed+overlap": (True, True)}.items():
        run = setup(rt, cfg, "none", distributed, overlap, dtype=torch.float64)
        cats: list[int] = []
        if distributed:
            for method in ("reduce_scatter_grads", "bucket_launch"):
                setattr(run.opt, method, _counting_cats(getattr(run.opt, method), cats))
        losses = run_steps(rt, run, cfg, 0, 1)[0]
        run.model.zero_grad(set_to_none=True)
        losses += run_steps(rt, run, cfg, 1, 3)[0]
        res = {"losses": losses,  # parameters by value (a tensor would travel as a shared-memory handle)
               "params": {n: p.detach().numpy().copy() for n, p in run.model.named_parameters()}}
        if distributed:
            bufs = run.opt.grad_buffers
            storages = {buf.untyped_storage().data_ptr() for buf, _, _ in bufs.all()}
            whole = [f.name for b, (_, _, w) in zip(bufs.buckets, bufs.all(), strict=True)
                     for f, x in zip(b.frags, w, strict=True) if x]
            res.update(cats=len(cats), whole=len(whole), buckets=len(bufs.buckets),
                       in_buffer=all(run.model.get_parameter(n).grad.untyped_storage().data_ptr() in storages
                                     for n in whole))
        run.path.remove()
        out[name] = res
    return out


def test_distributed_optimizer_accumulates_in_its_buckets_and_matches_plain_adamw():
    """The distributed optimizer's persistent gradient buckets (whole-fragment `.grad`s as views, no pack
    copy), blocking and overlapped, against the plain AdamW path: float64 within 1e-10 on a 2 + 1-rank
    world (both kinds of fragment), small buckets (several per holder set)."""
    results = run_workers(_distributed_optimizer, 3, LLAMA)
    for rank, res in enumerate(results):
        plain = res["plain"]
        for name in ("distributed", "distributed+overlap"):
            got = res[name]
            assert got["buckets"] >= 3, (rank, name, got["buckets"])
            for a, b in zip(got["losses"], plain["losses"], strict=True):
                assert abs(a - b) <= 1e-10 * abs(b), (rank, name, got["losses"], plain["losses"])
            for n, p in plain["params"].items():
                err = float(abs(got["params"][n] - p).max()) / max(float(abs(p).max()), 1e-12)
                assert err <= 1e-10, (rank, name, n, err)
            assert got["cats"] == 0, (rank, name)  # nothing packed: the buffers are the gradients
            assert got["in_buffer"], (rank, name)
    assert sum(r["distributed"]["whole"] for r in results) > 0
