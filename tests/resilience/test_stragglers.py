"""Stragglers (issue 48): the `slow` fault's speed factor, the detector's verdicts on the per-rank compute
times a run gathers, the batch split by measured speed, and a rebalance in the middle of training keeping
the loss curve (float64, forked gloo workers)."""

from __future__ import annotations

import random

import pytest
import torch

from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.resilience.straggler import (
    StragglerDetector,
    StragglerSettings,
    decide,
    peer_groups,
    predicted_compute_s,
    replica_speeds,
    share_units,
)
from ntp_nemo.runtime.compute_time import ComputeTimer
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.work import WorkShape
from tests.conftest import compose
from tests.ntp_cases import GPT, OPTIM, SEED

SHAPE = WorkShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                  vocab_size=257, seq_len=32, gated_mlp=False)


def _layout(replica_tp=(2, 2), m=6, speeds=None, work=SHAPE):
    return ResolvedLayout.make(Topology(2, list(replica_tp), [2] * 4), num_microbatches=m, work=work,
                               capacity="work", speeds=speeds)


def _feed(det, layout, steps, speed_of_rank, noise=0.0, rng=None, hiccup=None):
    """Per step, every rank's compute time: its modelled share at its speed, with multiplicative noise."""
    units, peers = share_units(layout), peer_groups(layout)
    out = []
    for step in steps:
        times = []
        for r, u in enumerate(units):
            t = 1e-9 * u / speed_of_rank(r, step)
            if noise:
                t *= rng.lognormvariate(0.0, noise)
            if hiccup == (r, step):
                t *= 10
            times.append(t)
        j = det.observe(step, times, units, peers)
        if j is not None:
            out.append(j)
    return out


def test_a_persistently_slow_rank_is_found_with_its_speed_and_its_recovery():
    det = StragglerDetector(StragglerSettings(every=5, persist=2))
    layout = _layout()
    slow = lambda r, step: 0.5 if r == 1 and 20 <= step < 45 else 1.0  # noqa: E731
    judged = _feed(det, layout, range(1, 71), slow)
    found = [j for j in judged if j.new]
    assert [(j.step, j.new) for j in found] == [(30, (1,))]  # windows 21-25 and 26-30: two in a row
    assert found[0].speed_of(1) == pytest.approx(0.5)
    assert found[0].wait_s > 0
    back = [j for j in judged if j.recovered]
    assert [(j.step, j.recovered) for j in back] == [(55, (1,))]
    assert det.stragglers == set()


def test_a_one_step_hiccup_and_noise_are_not_stragglers():
    """200 steps at +-20% noise per step (lognormal) and a 10x hiccup of one step: no verdict."""
    det = StragglerDetector(StragglerSettings(every=5, persist=2))
    rng = random.Random(3)
    judged = _feed(det, _layout(), range(1, 201), lambda r, s: 1.0, noise=0.2, rng=rng, hiccup=(2, 50))
    assert len(judged) == 40 and not any(j.new for j in judged)


def test_unequal_shares_are_judged_against_the_work_model():
    """Degraded replicas (TP 1 of 2): a rank's modelled work per step differs from a healthy TP rank's (the
    whole model on fewer micro-batches, no TP traffic); at the speed the work model expects none is a
    straggler, and a TP-1 rank at half speed is found against the other TP-1 rank."""
    layout = _layout(replica_tp=(2, 1, 1))
    units = share_units(layout)
    assert units[2] < units[0] / 2
    det = StragglerDetector(StragglerSettings(every=2, persist=1))
    assert not any(j.new for j in _feed(det, layout, range(1, 9), lambda r, s: 1.0))
    judged = _feed(det, layout, range(9, 13), lambda r, s: 0.5 if r == 2 else 1.0)
    assert [j.new for j in judged if j.new] == [(2,)]


def test_a_replica_slow_as_a_whole_is_not_a_straggler():
    """Both TP ranks of replica 0 at half speed for 40 steps (what two processes sharing an overloaded
    machine's CPU looked like in clean runs): judged against their peers, neither is slow."""
    det = StragglerDetector(StragglerSettings(every=5, persist=2))
    judged = _feed(det, _layout(), range(1, 41), lambda r, s: 0.5 if r in (0, 1) else 1.0)
    assert not any(j.new for j in judged) and min(judged[-1].speeds) == 1.0


def test_a_rank_alone_of_its_degree_is_not_judged_by_the_device_constants():
    """The work model weighs a TP rank's traffic with an H100's FLOPs per NVLink byte; on another machine
    a TP-1 rank's time per unit differs from a TP-2 rank's.  Alone of its degree (layout (2,1)) it is
    compared with no one: 1.7 times the model's time is no straggler."""
    det = StragglerDetector(StragglerSettings(every=2, persist=1))
    judged = _feed(det, _layout(replica_tp=(2, 1)), range(1, 9), lambda r, s: 1 / 1.7 if r == 2 else 1.0)
    assert not any(j.new for j in judged) and judged[-1].speeds[2] == 1.0


def test_measured_speeds_shrink_the_replica_share_and_go_back():
    layout = _layout()
    assert layout.microbatches == (3, 3)
    det = StragglerDetector(StragglerSettings(every=2, persist=1))
    j = _feed(det, layout, [1, 2], lambda r, s: 0.5 if r == 1 else 1.0)[0]
    speeds = replica_speeds(layout, j, j.stragglers)
    assert speeds == (0.5, 1.0)
    slow = layout.with_changes(speeds=speeds)
    assert slow.microbatches == (2, 4) and slow.same_ranks(layout)
    assert sum(slow.microbatches) == sum(layout.microbatches)  # the global batch is kept
    # the work model's compute time of a step: the longest share at its rank's speed
    before = predicted_compute_s(layout, j.unit_s, [1, 0.5, 1, 1])
    after = predicted_compute_s(slow, j.unit_s, [1, 0.5, 1, 1])
    assert after == pytest.approx(before * 4 / 6)  # 2 micro-batches at half speed vs 3: 4 vs 6 units
    assert ResolvedLayout.from_dict(slow.to_dict()) == slow
    assert slow.shrunk([2, 1]).speeds == (0.5, 1.0)
    assert slow.shrunk([0, 2]).speeds == (1.0,)
    assert layout.with_changes(speeds=None).microbatches == (3, 3)
    with pytest.raises(ValueError, match="speeds"):
        layout.with_changes(speeds=(0.5,))


@pytest.mark.parametrize("policy,speed,want", [
    ("report", 0.5, "nothing"),
    ("rebalance", 0.5, "split"),
    ("rebalance", 0.1, "exclude"),  # below the floor (0.2)
    ("exclude", 0.5, "exclude"),
])
def test_policies_decide(policy, speed, want):
    settings = StragglerSettings(policy=policy, every=2, persist=1)
    layout = _layout()
    det = StragglerDetector(settings)
    (j,) = _feed(det, layout, [1, 2], lambda r, s: speed if r == 1 else 1.0)
    d = decide(settings, layout, j)
    assert d.exclude == ((1,) if want == "exclude" else ())
    assert (d.layout is not None) == (want == "split")
    if want == "split":
        assert d.layout.microbatches == (2, 4) and d.layout.speeds == (0.5, 1.0)
        # the device recovers: once the detector lets it go, the nominal split comes back
        (j2,) = _feed(det, d.layout, [3, 4], lambda r, s: 1.0)
        assert j2.recovered == (1,)
        assert decide(settings, d.layout, j2).layout.microbatches == (3, 3)
        assert decide(settings, d.layout, j2).layout.speeds is None


def test_slowdown_stretches_the_ranks_own_work_not_its_waits(monkeypatch):
    """factor f: the phase is followed by (1/f - 1) times the thread's CPU work in it (0.1 s of the phase's
    0.25 s of wall: the rest is other processes having the cores), and the figure is that work plus the
    sleep: what the slow device would have taken."""
    clock = {"t": 100.0, "cpu": 7.0}
    slept = []
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.perf_counter", lambda: clock["t"])
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.thread_time", lambda: clock["cpu"])

    def sleep(s):
        slept.append(s)
        clock["t"] += s

    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.sleep", sleep)
    timer = ComputeTimer()
    for factor, want_sleep in ((1.0, []), (0.5, [0.1]), (0.25, [0.3])):
        slept.clear()
        timer.slowdown(factor)
        with timer.phase("grad_sync"):
            clock["t"] += 5.0  # not measured
            clock["cpu"] += 1.0
        with timer.phase("microbatches"):
            clock["t"] += 0.25
            clock["cpu"] += 0.1
        assert slept == pytest.approx(want_sleep)
        assert timer.last_s == pytest.approx(0.1 + sum(want_sleep))  # its CPU work, then the sleeps


def test_a_slow_device_sleeps_what_it_owes_over_short_segments_and_late_wake_ups(monkeypatch):
    """Segments shorter than 1 ms of owed sleep are added up before a sleep, and a wake-up that comes
    late (0.4 ms here) is taken off the next sleep: over the step the device sleeps what it owes."""
    from types import SimpleNamespace

    clock = {"t": 0.0, "cpu": 0.0}
    slept = []

    def sleep(s):
        slept.append(round(s, 9))
        clock["t"] += s + 0.0004

    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.perf_counter", lambda: clock["t"])
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.thread_time", lambda: clock["cpu"])
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.sleep", sleep)
    group = SimpleNamespace(watch=None)
    timer = ComputeTimer()
    timer.watch([group])
    timer.slowdown(0.5)
    with timer.phase("microbatches"):
        for _ in range(10):  # 0.3 ms of work per segment: a sleep every fourth exchange
            clock["cpu"] += 0.0003
            clock["t"] += 0.0003
            group.watch.before_exchange()
            group.watch.after_exchange()
    # 1.2 ms owed after four segments; the 0.4 ms overslept is off the next: 1.1 ms after five more
    assert slept == [0.0012, 0.0011]
    actual = sum(slept) + 0.0004 * len(slept)  # 3 ms of work at half speed owes 3 ms
    assert abs(actual - 0.003) <= 0.0004 + 1e-12  # within one late wake-up (its rest: off the next step)


def test_the_timer_counts_work_not_tp_exchanges_and_a_slow_rank_sleeps_before_each(monkeypatch):
    """A watched TP group reports its exchanges: their time (transfer, waiting for a slower peer) is not
    the rank's compute.  A slow rank sleeps before each exchange for its work since the previous one (so
    its peers wait for it inside the layer, in proportion to its share) and at the phase's end for the
    rest; an exchange outside the measured phase counts for nothing; a group let go is left alone."""
    from types import SimpleNamespace

    clock = {"t": 0.0, "cpu": 0.0}
    slept = []

    def sleep(s):
        slept.append(round(s, 9))
        clock["t"] += s

    def work(s):
        clock["t"] += s
        clock["cpu"] += s

    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.perf_counter", lambda: clock["t"])
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.thread_time", lambda: clock["cpu"])
    monkeypatch.setattr("ntp_nemo.runtime.compute_time.time.sleep", sleep)
    group, other = SimpleNamespace(watch=None), SimpleNamespace(watch=None)
    timer = ComputeTimer()
    timer.watch([group])
    assert group.watch is timer
    for factor, want_sleeps, want_s in ((1.0, [], 0.15), (0.5, [0.1, 0.05], 0.3)):
        slept.clear()
        timer.slowdown(factor)
        group.watch.before_exchange()  # between steps: nothing measured
        clock["t"] += 1.0
        group.watch.after_exchange()
        with timer.phase("microbatches"):
            work(0.1)
            group.watch.before_exchange()
            clock["t"] += 0.3  # in the exchange: waiting for a peer
            group.watch.after_exchange()
            work(0.05)
        assert slept == want_sleeps
        assert timer.last_s == pytest.approx(want_s)
    timer.watch([other])
    assert group.watch is None and other.watch is timer


def _cfg(*overrides):
    from ntp_nemo.config.failover import failover_spec

    return failover_spec(compose(["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=10",
                                  *overrides]))


@pytest.mark.parametrize("overrides,key,words", [
    (["fault=slow", "fault.factor=0"], "fault.factor", "(0, 1)"),
    (["fault=slow", "fault.factor=1.5"], "fault.factor", "(0, 1)"),
    (["fault=kill_rank", "fault.factor=0.5"], "fault.factor", "kind slow only"),
    (["fault=slow", "fault.factor=0.5", "fault.steps=0"], "fault.steps", "steps >= 1"),
    (["fault.more=[{kind:slow,rank:1,step:3,factor:2}]"], "fault.more[0].factor", "(0, 1)"),
    (["fault.straggler=ignore"], "fault.straggler", "report"),
    (["fault.straggler_every=-1"], "fault.straggler_every", ">= 0"),
    (["fault.straggler_margin=0"], "fault.straggler_margin", "> 0"),
    (["fault.straggler_persist=0"], "fault.straggler_persist", ">= 1"),
    (["fault.straggler_floor=0.9"], "fault.straggler_floor", "[0, 0.714)"),
])
def test_bad_straggler_config(overrides, key, words):
    from ntp_nemo.resilience.fault_config import validate_fault_config

    with pytest.raises(ConfigError) as err:
        validate_fault_config(_cfg(*overrides))
    assert err.value.key == key and words in str(err.value)


def test_slow_fault_factor_resolves():
    from ntp_nemo.resilience.fault_config import resolve_faults

    (f,) = resolve_faults(_cfg("fault=slow", "fault.rank=1", "fault.step=4", "fault.factor=0.5",
                               "fault.steps=3"))
    assert (f.kind, f.rank, f.factor) == ("slow", 1, 0.5)
    assert [s for s in range(1, 11) if f.active_at(s)] == [4, 5, 6]  # then the device is fine again


def _train_worker(rank: int, world: int, switch_at: int, steps: int) -> dict:
    """`steps` steps of GPT in float64 on a 2x2 layout (one process: TP 1), the batch split by speed
    (0.5, 1) from step `switch_at` on the way `NTPStrategy.rebalance` does it (a shallow copy of the
    runtime reading the new layout); losses and what the fused scalars gathered of the compute times."""
    import copy
    import dataclasses

    from ntp_nemo.runtime.assemble import assemble
    from ntp_nemo.runtime.step import train_step

    replica_tp = [2, 2] if world == 4 else [1]
    layout = ResolvedLayout.make(Topology(max(replica_tp), replica_tp, [max(replica_tp)] * 4),
                                 num_microbatches=6)
    state = assemble(layout, rank, GPT, OPTIM, None, seed=SEED, param_dtype=torch.float64)
    timer = ComputeTimer()
    losses, gathered, splits = [], [], []
    for step in range(1, steps + 1):
        if step == switch_at and world > 1:
            new = layout.with_changes(speeds=(0.5, 1.0))
            runtime = copy.copy(state.runtime)
            runtime.layout = new
            state = dataclasses.replace(state, layout=new, runtime=runtime)
        gen = torch.Generator().manual_seed(1000 + step)
        toks = torch.randint(0, GPT.vocab_size, (6, 9), generator=gen)
        mine = state.runtime.my_microbatches(6)
        splits.append(len(mine))
        result = train_step(state, [toks[i : i + 1] for i in mine], toks[:, 1:].numel(), max_norm=1.0,
                            timer=timer)
        losses.append(result.loss)
        gathered.append((result.compute_s[rank], timer.last_s, len(result.compute_s)))
    return {"losses": losses, "gathered": gathered, "splits": splits}


def test_rebalance_mid_run_keeps_the_loss_curve_float64():
    steps, switch = 4, 3
    (single,) = run_workers(_train_worker, 1, switch, steps)
    ranks = run_workers(_train_worker, 4, switch, steps)
    assert ranks[0]["splits"] == [3, 3, 2, 2] and ranks[2]["splits"] == [3, 3, 4, 4]
    for r in ranks:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"], strict=True)) < 1e-10
    for rank, r in enumerate(ranks):  # every rank's compute time, each in its own slot of the fused scalars
        assert all(mine == own > 0 and n == 4 for mine, own, n in r["gathered"]), (rank, r["gathered"])


def test_the_slow_device_stays_with_its_process_when_ranks_are_renumbered(tmp_path):
    """`fault=slow fault.factor=0.5 fault.rank=1 fault.step=3 fault.steps=4`: the process at rank 1 when
    step 3 starts computes at half speed through step 6, even as rank 0 after a straggler before it was
    excluded; the process that becomes rank 1 does not."""
    from types import SimpleNamespace

    from ntp_nemo.resilience.faults import Fault, FaultInjector

    fault = Fault(0, "slow", rank=1, step=3, steps=4, factor=0.5)
    procs = {name: (FaultInjector([fault], tmp_path, tmp_path), SimpleNamespace(compute_timer=None))
             for name in ("slow", "other")}

    def step(name, rank, at):
        injector, module = procs[name]
        injector.on_train_batch_start(SimpleNamespace(global_rank=rank, global_step=at - 1), module, None, 0)
        return None if module.compute_timer is None else module.compute_timer.factor

    assert (step("slow", 1, 2), step("other", 2, 2)) == (None, None)  # before the fault: untimed
    assert (step("slow", 1, 3), step("other", 2, 3)) == (0.5, 1.0)
    assert (step("slow", 0, 5), step("other", 1, 5)) == (0.5, 1.0)  # renumbered
    assert (step("slow", 0, 7), step("other", 1, 7)) == (1.0, 1.0)  # the device is fine again


def test_bad_factor_exits_2_naming_the_key(tmp_path):
    from tests.conftest import run_cli

    proc = run_cli(["fault=slow", "fault.factor=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2 and "fault.factor" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
