"""The distributed optimizer's step is a transaction when a commit check is given: an all-gather that
raises, or a generation aborted between the gathers and the unpack (the check raises), leaves the
parameters, moments, float32 masters and step counters exactly as they were; the step redone after it
gives the same parameters as a run that was never interrupted.

Two gloo ranks, DP 2 (every bucket's holder set is both ranks), small buckets (several per step, so a
gather failing part-way would have unpacked the buckets before it), float32 and bfloat16 parameters
(the second keeps float32 masters).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ntp_nemo.runtime.step as one_step
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GLOBAL_BATCH, LLAMA
from tests.option_cases import CLIP, run_steps, setup, step_tokens


class Aborted(RuntimeError):
    pass


def _kept(run) -> dict[str, torch.Tensor]:
    """Everything the step may write: parameters, and per owned part its moments, master and steps."""
    out = {f"param {n}": p.detach().clone() for n, p in run.model.named_parameters()}
    for i, own in enumerate(run.opt.owned):
        out[f"exp_avg {i}"] = own.exp_avg.clone()
        out[f"exp_avg_sq {i}"] = own.exp_avg_sq.clone()
        if own.master is not None:
            out[f"master {i}"] = own.master.clone()
        out[f"steps {i}"] = torch.stack([s.step.clone() for s in own.segments])
    out["step_count"] = run.opt._step_count.clone()
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return [k for k in before if not torch.equal(before[k], after[k])]


def _step(rt, run, step: int, commit_check) -> None:
    toks = step_tokens(LLAMA, step)
    micro = [toks[i : i + 1] for i in run.state.my_microbatches(GLOBAL_BATCH)]
    one_step.train_step(run.state, micro, toks[:, 1:].numel(), max_norm=CLIP, scheduler=run.sched,
                        commit_check=commit_check)


def commit_worker(rank: int, world: int) -> dict:
    rt = RankPlace(ResolvedLayout.make(Topology(1, [1, 1], [1] * (LLAMA.num_layers + 2))), rank)
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        run = setup(rt, LLAMA, distributed=True, dtype=dtype)
        ref = setup(rt, LLAMA, distributed=True, dtype=dtype)
        run_steps(rt, ref, LLAMA, 0, 2)  # the uninterrupted reference: steps 0 and 1
        _step(rt, run, 0, lambda: None)  # a committed transactional step: moments non-zero
        res: dict = {"buckets": len(run.opt.buckets)}
        before = _kept(run)

        def abort() -> None:  # the generation was aborted between the gathers and the unpack
            raise Aborted("generation aborted during the step")

        try:
            _step(rt, run, 1, abort)
            res["check_raised"] = False
        except Aborted:
            res["check_raised"] = True
        res["changed_after_check"] = _changed(before, _kept(run))
        run.opt.zero_grad(set_to_none=False)  # what the aborted step's end would have done

        real = dist.all_gather_single

        def failing(*args, _real=real, _calls=[], **kwargs):  # noqa: B006 - fails at the second bucket
            _calls.append(1)
            if len(_calls) == 2:
                raise dist.DistError("connection closed by peer")
            return _real(*args, **kwargs)

        dist.all_gather_single = failing
        try:
            _step(rt, run, 1, lambda: None)
            res["gather_raised"] = False
        except dist.DistError:
            res["gather_raised"] = True
        finally:
            dist.all_gather_single = real
        res["changed_after_gather"] = _changed(before, _kept(run))
        run.opt.zero_grad(set_to_none=False)

        _step(rt, run, 1, lambda: None)  # the step redone: as if never interrupted
        res["redo_vs_reference"] = _changed(_kept(ref), _kept(run))
        res["moved"] = bool(_changed(before, _kept(run)))
        out[str(dtype)] = res
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(commit_worker, 2)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_an_aborted_step_leaves_parameters_and_state_unchanged(results, dtype):
    for rank, res in enumerate(results):
        r = res[dtype]
        assert r["buckets"] >= 3, r  # a gather failing at the second bucket follows an unpackable first
        assert r["check_raised"] and r["gather_raised"], r
        assert r["changed_after_check"] == [], (rank, r)
        assert r["changed_after_gather"] == [], (rank, r)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_the_redone_step_matches_an_uninterrupted_run(results, dtype):
    for rank, res in enumerate(results):
        r = res[dtype]
        assert r["moved"], r
        assert r["redo_vs_reference"] == [], (rank, r)
