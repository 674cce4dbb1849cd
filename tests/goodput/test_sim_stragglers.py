"""Stragglers in the simulator against closed forms and figures worked out by hand: the cluster study
(`ntp_nemo.goodput.sim.stragglers`: report costs 1/s over the episode, rebalance recovers the speed-weighted
share, exclude is a lost GPU) and the one-job replay (`ntp_nemo.goodput.sim.replay` with a speed-factor
straggler under report, rebalance and exclude)."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput.sim.replay import (
    EXCLUDE,
    FULL,
    LOSE,
    REBALANCE,
    REPORT,
    SLOW,
    FailureTrace,
    ReplayCosts,
    ReplayPolicy,
    StragglerModel,
    TraceEvent,
    replay,
)
from ntp_nemo.goodput.sim.stragglers import (
    Episodes,
    JobShape,
    StragglerSpec,
    split,
    state_throughput,
    trace_throughput,
)

# 4 replicas of TP2, 6 micro-batches each; a replica short of one GPU keeps 4 on time (the NTP table).
JOB = JobShape(num_replicas=4, tp=2, pp=1, microbatches=6, ntp_batch=(0, 4, 6))


def one_episode(speed: float, start: float = 1.0, end: float = 3.0, horizon: float = 10.0) -> Episodes:
    return Episodes(np.array([2]), np.array([start]), np.array([end]), np.array([speed]), horizon)


@pytest.mark.parametrize("speed", [0.3, 0.5, 0.8])
def test_report_costs_the_job_a_factor_one_over_s_for_the_episode(speed):
    spec = StragglerSpec(detect_minutes=30.0, floor=0.0)
    mean, low, slow = trace_throughput(JOB, spec, one_episode(speed), REPORT)
    # 2 h of 10 at speed s, the rest at 1: every step waits for the slow replica.
    assert low == pytest.approx(speed)
    assert mean == pytest.approx(1 - 0.2 * (1 - speed))
    assert slow == pytest.approx(0.2 / 8)  # one GPU of 8, 2 h of 10


def test_rebalance_recovers_the_speed_weighted_share():
    spec = StragglerSpec(detect_minutes=30.0, floor=0.2)
    mean, low, _ = trace_throughput(JOB, spec, one_episode(0.5), REBALANCE)
    # 0.5 h before the watch names it: speed 0.5.  Then capacities (3, 6, 6, 6) for 24 micro-batches: the
    # best whole split is (3, 7, 7, 7) at 7/6 of a step (the continuous share 3.5/4 would be 8/7).  After
    # the device recovers the split stays 0.5 h more: (3, 7, 7, 7) at full speed, 7/6 again.
    assert low == pytest.approx(0.5)
    assert mean == pytest.approx(1 - (0.5 * 0.5 + 1.5 * (1 - 6 / 7) + 0.5 * (1 - 6 / 7)) / 10)
    assert list(split(np.array([3.0, 6, 6, 6]), 24)) == [3, 7, 7, 7]
    # With fine micro-batches the split reaches the continuous share (R - 1 + s) / R.
    fine = JobShape(4, 2, 1, 600, (0, 400, 600))
    assert state_throughput(fine, REBALANCE, {2: 0.5}, {2: 0.5}) == pytest.approx(3.5 / 4, rel=2e-3)
    assert state_throughput(fine, REPORT, {2: 0.5}, {2: 0.5}) == pytest.approx(0.5)


# One replica of TP 8, 6 micro-batches: no other replica can take a share of the batch.
ONE = JobShape(num_replicas=1, tp=8, pp=1, microbatches=6, ntp_batch=(0, 1, 1, 2, 3, 4, 4, 5, 6))


def test_rebalance_weighs_a_one_replica_jobs_shards_by_speed():
    # GPU 2 at 0.5, named: its 8 shards weighed 1 x 7 : 0.5, it holds 0.5/7.5 of the work and takes
    # (0.5/7.5)/0.5 = 1/7.5 of a balanced step's 1/8 x 8: the group runs at 7.5/8, its mean speed.
    assert state_throughput(ONE, REBALANCE, {2: 0.5}, {2: 0.5}, shards=True) == pytest.approx(7.5 / 8)
    assert state_throughput(ONE, REBALANCE, {2: 0.5}, {2: 0.5}, shards=False) == pytest.approx(0.5)
    assert state_throughput(ONE, REPORT, {2: 0.5}, {2: 0.5}, shards=True) == pytest.approx(0.5)
    # The device recovered, the watch not yet: the others carry 7 of 7.5, at full speed: 7.5/8 again.
    assert state_throughput(ONE, REBALANCE, {}, {2: 0.5}, shards=True) == pytest.approx(7.5 / 8)
    # Slower than believed (0.3, weighed 0.5): it takes (0.5/7.5)/0.3 against 1/8: 0.3 x 7.5/8 / 0.5.
    assert state_throughput(ONE, REBALANCE, {2: 0.3}, {2: 0.5}, shards=True) == pytest.approx(0.5625)
    # Two stages of TP 4 (GPUs 0-3, 4-7), GPU 5 at 0.5: stage 2 runs at 3.5/4, stage 1 at 1.
    two = JobShape(num_replicas=1, tp=4, pp=2, microbatches=6, ntp_batch=(0, 1, 3, 4, 6))
    assert state_throughput(two, REBALANCE, {5: 0.5}, {5: 0.5}, shards=True) == pytest.approx(3.5 / 4)


def test_the_shards_setting_follows_fault_straggler_shards():
    assert StragglerSpec().weighs_shards(1) and not StragglerSpec().weighs_shards(4)  # auto: one replica
    assert StragglerSpec(shards="on").weighs_shards(4) and not StragglerSpec(shards="off").weighs_shards(1)
    # Over a trace: 2 h of 10 at 0.5, named after 0.5 h, the weights kept 0.5 h after it recovers:
    # 0.5 h at 0.5, 1.5 h + 0.5 h at 7.5/8.
    ep = Episodes(np.array([2]), np.array([1.0]), np.array([3.0]), np.array([0.5]), 10.0)
    mean, low, _ = trace_throughput(ONE, StragglerSpec(detect_minutes=30.0), ep, REBALANCE)
    assert low == pytest.approx(0.5)
    assert mean == pytest.approx(1 - (0.5 * 0.5 + 2.0 * (1 - 7.5 / 8)) / 10)
    off, _, _ = trace_throughput(ONE, StragglerSpec(detect_minutes=30.0, shards="off"), ep, REBALANCE)
    assert off == pytest.approx(1 - 2.0 * 0.5 / 10)  # no other replica: rebalance changes nothing


@pytest.mark.parametrize("speed", [0.1, 0.5, 0.9])
def test_exclude_equals_a_lost_gpu(speed):
    # Named: the GPU is out whatever its speed; its replica keeps the NTP table's 4 micro-batches on time.
    # Capacities (4, 6, 6, 6) for 24: (4, 7, 7, 6) at 7/6 of a step, as a lost GPU (believed and out at
    # speed 1) gives.
    assert state_throughput(JOB, EXCLUDE, {2: speed}, {2: speed}) == pytest.approx(6 / 7)
    assert state_throughput(JOB, EXCLUDE, {}, {2: 1.0}) == pytest.approx(6 / 7)
    # rebalance below the floor excludes too
    assert state_throughput(JOB, REBALANCE, {2: 0.1}, {2: 0.1}, floor=0.2) == pytest.approx(6 / 7)


def test_exclude_matches_the_failure_studies_ntp_on_a_fine_batch():
    """On a batch of many micro-batches the excluded GPU's replica costs what the failure studies' NTP
    policy says a replica with one failed GPU costs: its on-time batch over the nominal."""
    from ntp_nemo.goodput.sim.perf import ReplicaPerf
    from ntp_nemo.goodput.sim.policy_tables import NTP, policy_table, replica_metrics
    from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape

    shape = ModelShape(name="m", hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=14336,
                       vocab_size=128256, num_kv_heads=8, seq_len=8192)
    perf = ReplicaPerf(shape, DeviceModel(), LinkModel(), tp=8, pp=1, seq_len=8192, num_replicas=4)
    table = policy_table(NTP, perf, 512)
    job = JobShape(4, 8, 1, 512, tuple(int(b) for b in table.batch))
    hist = np.zeros((1, 9), dtype=np.int64)
    hist[0, 8], hist[0, 7] = 3, 1
    ntp = replica_metrics(hist, table, 4, 8)["throughput_rel"][0]
    assert ntp < 1
    assert state_throughput(job, EXCLUDE, {3: 0.4}, {3: 0.4}) == pytest.approx(ntp, abs=2 / 512)


def sim_settings(*overrides: str):
    from ntp_nemo.cli.sim import CONFIG_DIR
    from ntp_nemo.goodput.sim.settings import settings_from_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return settings_from_config(compose(config_name="config", overrides=list(overrides)))


def test_the_straggler_study_orders_its_policies():
    from ntp_nemo.goodput.sim.studies import run_all

    s = sim_settings("cluster=small", "studies=[stragglers]", "stragglers.rate_per_gpu_hour=2e-3")
    recs = {r["policy"]: r for r in run_all(s).records}
    assert set(recs) == {REPORT, REBALANCE, EXCLUDE} and recs[REPORT]["episodes"] > 100
    assert recs[REPORT]["throughput_rel"] < recs[EXCLUDE]["throughput_rel"] < 1
    assert recs[REPORT]["throughput_rel"] < recs[REBALANCE]["throughput_rel"] < 1
    # the same seed, the same numbers
    assert run_all(s).records == list(recs.values())


@pytest.mark.parametrize("override,key", [
    ("stragglers.speed=[0.5,1.5]", "stragglers.speed"),
    ("stragglers.policies=[report,skip]", "stragglers.policies"),
    ("stragglers.rate_per_gpu_hour=-1", "stragglers.rate_per_gpu_hour"),
    ("stragglers.shards=sometimes", "stragglers.shards"),
    ("++stragglers.sped=1", "stragglers"),
])
def test_bad_straggler_settings_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        sim_settings(override)
    assert err.value.key == key


# ---- the one-job replay -------------------------------------------------------------------------------
# 30 steps of 1 s, of which the busiest rank computes 0.5 s; rank 1 (replica 0 of two, 6 micro-batches
# each) at half speed for steps 6-20; the watch judges every 2 steps and acts after 2 slow judgements.
SLOWTRACE = FailureTrace(30, 100, 0, (TraceEvent(SLOW, 6, 1, steps=15, factor=0.5),))
SCOSTS = ReplayCosts(step_s={FULL: 1.0, "(1,2)": 1.2}, startup_s=0.0, compute_s=0.5,
                     detect_s={LOSE: 0.3}, reshard_s=0.2)


def _policy(policy: str) -> ReplayPolicy:
    def by_speed(speeds):  # replica 0 at 0.45: 4 of 12 micro-batches
        return [4, 8] if speeds[0] < 1 else [6, 6]

    watch = StragglerModel(policy, every=2, persist=2, nominal=(6, 6), replica_of=lambda r: r // 2,
                           split=by_speed)
    return ReplayPolicy(policy, "live", lambda lost: "(1,2)" if lost else FULL, watch)


def test_replay_of_a_reported_straggler_costs_one_over_s():
    r = replay(SLOWTRACE, _policy(REPORT), SCOSTS)
    # 15 slow steps, each 0.5 s of compute stretched to 1 s: +0.5 s.
    assert r.time_to_last_step_s == pytest.approx(30 + 15 * 0.5)
    assert r.straggler_s == pytest.approx(7.5) and r.rebalanced_steps == 0
    # judged after steps 6 (window 5-6: half slow, not most), 8 and 10: named after step 10
    assert r.straggler_named == (10,)


def test_replay_of_a_rebalanced_straggler():
    r = replay(SLOWTRACE, _policy(REBALANCE), SCOSTS)
    # Steps 6-10 unmitigated (+0.5 each).  From step 11 the split is (4, 8), believed speed 0.45 (0.5 is
    # measured a hair under): steps 11-20 take 0.5 + 0.5 * max(4/0.5, 8)/6 = 1.1667 s.  The device is fine
    # from step 21; the judgement after step 22 (window 21-22 fast) puts the even split back.  Steps 21-22:
    # 0.5 + 0.5 * 8/6.
    extra = 5 * 0.5 + 10 * (0.5 * 8 / 6 - 0.5) + 2 * (0.5 * 8 / 6 - 0.5)
    assert r.time_to_last_step_s == pytest.approx(30 + extra)
    assert r.straggler_s == pytest.approx(extra) and r.rebalanced_steps == 12
    assert r.straggler_named == (10,)


def test_replay_of_an_excluded_straggler_is_a_lost_rank():
    r = replay(SLOWTRACE, _policy(EXCLUDE), SCOSTS)
    # Steps 6-10 unmitigated; the rank leaves after step 10: a loss's detection and reshard at step 11,
    # then steps 11-30 on (1,2) (no repair within the run).
    assert r.time_to_last_step_s == pytest.approx(10 + 5 * 0.5 + 0.3 + 0.2 + 20 * 1.2)
    assert r.layouts == {FULL: 10, "(1,2)": 20} and r.straggler_named == (10,)
    lost = replay(FailureTrace(30, 100, 0, (TraceEvent(LOSE, 11, 1),)), _policy(REPORT), SCOSTS)
    assert r.time_to_last_step_s - lost.time_to_last_step_s == pytest.approx(5 * 0.5)
