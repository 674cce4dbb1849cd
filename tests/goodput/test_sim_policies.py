"""Policy ordering, the performance model's on-time rule, failure traces and spare-domain search."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ntp_nemo.cli.sim import CONFIG_DIR
from ntp_nemo.goodput.sim.domains import replica_histogram
from ntp_nemo.goodput.sim.failures import FailureSpec, Trace, generate_trace, sample_placements, trace_states
from ntp_nemo.goodput.sim.policy_tables import DP_DROP, NTP, NTP_PW, replica_metrics
from ntp_nemo.goodput.sim.settings import settings_from_config
from ntp_nemo.goodput.sim.studies import policy_tables, replica_perf, run_throughput, run_trace, spares_needed


def sim_settings(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return settings_from_config(compose(config_name="config", overrides=list(overrides)))


def test_policy_ordering_holds_for_every_sampled_placement():
    s = sim_settings("placements.samples=30")
    c = s.cluster
    tables = {t.name: t for t in policy_tables(s)}
    rng = np.random.default_rng(3)
    for p in s.placements.fractions:
        degrees = replica_histogram(c, sample_placements(c.num_cells(), c.cell_size, float(p), 30, rng))
        thr = {
            n: replica_metrics(degrees, t, c.num_replicas, c.tp)["throughput_rel"] for n, t in tables.items()
        }
        assert np.all(thr[NTP_PW] >= thr[NTP]) and np.all(thr[NTP] >= thr[DP_DROP])
        if p > 0.002:  # enough failures that NTP strictly helps and power boost strictly helps more
            assert thr[NTP].mean() > thr[DP_DROP].mean() and thr[NTP_PW].mean() > thr[NTP].mean()


def test_throughput_sweep_records_and_trend():
    s = sim_settings("cluster=small", "placements.samples=40")
    recs = run_throughput(s, np.random.default_rng(0), policy_tables(s))
    assert len(recs) == s.placements.num_fractions * 3
    for policy in (DP_DROP, NTP, NTP_PW):
        rows = [r for r in recs if r["policy"] == policy]
        assert rows[0]["failed_fraction"] == 0 and rows[0]["throughput_rel"] == 1.0
        assert rows[-1]["throughput_rel"] < 1.0 or policy == NTP_PW
        assert all(0 <= r["replicas_available"] <= 1 and 0 <= r["throughput_rel"] <= 1 for r in rows)
    drop = [r["throughput_rel"] for r in recs if r["policy"] == DP_DROP]
    assert drop[-1] < drop[len(drop) // 2] < drop[1]


def test_on_time_batch_and_power_boost_are_consistent():
    s = sim_settings()
    perf = replica_perf(s)
    b, tp = s.local_batch, s.cluster.tp
    nominal = perf.step_time(b, tp)
    for t in (31, 30, 28, 24):
        kept = perf.on_time_batch(t, b)
        assert kept < b  # reduced TP does more work per GPU
        assert perf.step_time(kept, t) <= nominal * (1 + 1e-9)
        assert perf.step_time(kept + 1, t) > nominal
        boost = perf.boost_needed(t, b)
        assert perf.step_time(b, t, boost) == pytest.approx(nominal, rel=1e-5)
    # power boost cannot speed up the links, so it needs more than the compute ratio alone
    compute, comm, _ = perf._stages(tp)
    assert comm.max() > 0 and perf.boost_needed(30, b) > 1.0


def test_trace_statistics_follow_the_failure_spec():
    spec = FailureSpec(days=15.0, steady_state=False, hardware_repair_hours=(72.0, 120.0))
    rng = np.random.default_rng(7)
    pool = 32768
    traces = [generate_trace(pool, spec, 2.0, rng) for _ in range(20)]
    mean_events = np.mean([t.num_events for t in traces])
    expected = spec.rate_per_gpu_hour * 2.0 * pool * spec.horizon_hours
    assert abs(mean_events - expected) < 4 * np.sqrt(expected / 20)
    hw = sum(t.num_hardware for t in traces) / sum(t.num_events for t in traces)
    assert abs(hw - 0.78) < 0.03
    durations = np.round(np.concatenate([t.end - t.start for t in traces]), 6)
    plain = np.isin(durations, [3.0, 72.0, 120.0])  # the rest are repeat failures merged into one interval
    assert plain.mean() > 0.99 and np.all(durations[~plain] > 3.0)


def test_trace_merges_repeat_failures_and_counts_states_exactly():
    spec = FailureSpec(rate_per_gpu_hour=0.05, days=2.0, blast_radius=2, steady_state=False)
    trace = generate_trace(16, spec, 1.0, np.random.default_rng(0))
    for g in np.unique(trace.gpu):
        s, e = trace.start[trace.gpu == g], trace.end[trace.gpu == g]
        assert np.all(s[1:] > e[:-1])  # no overlapping down intervals per GPU
    hand = Trace(
        gpu=np.array([0, 1, 9]),
        start=np.array([-5.0, 2.0, 4.0]),
        end=np.array([3.0, 6.0, 20.0]),
        num_events=3,
        num_hardware=0,
        horizon_hours=10.0,
        pool_gpus=16,
    )
    times, durations, counts = trace_states(hand, cell_size=8, n_cells=2)
    assert times.tolist() == [0.0, 2.0, 3.0, 4.0, 6.0]
    assert durations.tolist() == [2.0, 1.0, 1.0, 2.0, 4.0]
    assert counts.tolist() == [[1, 0], [2, 0], [1, 0], [1, 1], [0, 1]]


def test_spares_needed_on_a_hand_made_trace():
    s = sim_settings(
        "cluster.num_gpus=64",
        "cluster.domain_size=8",
        "cluster.tp=8",
        "cluster.pp=2",
        "cluster.degraded_tp=null",
        "train.tokens_per_batch=1048576",
        "failures.max_spare_domains=8",
    )
    assert s.cluster.num_replicas == 4
    tables = {t.name: t for t in policy_tables(s)}
    # three damaged domains at once during [3, 50) h
    trace = Trace(
        gpu=np.array([0, 8, 16]),
        start=np.array([1.0, 2.0, 3.0]),
        end=np.array([50.0, 50.0, 50.0]),
        num_events=3,
        num_hardware=3,
        horizon_hours=100.0,
        pool_gpus=64 + 8 * 8,
    )
    spares = spares_needed(s, list(tables.values()), trace, 8)
    assert spares[DP_DROP] == 3 and spares[NTP_PW] == 0
    assert spares[NTP] is not None and 0 < spares[NTP] <= 3
    assert spares_needed(s, [tables[DP_DROP]], trace, 2) == {DP_DROP: None}


def test_default_trace_study_orders_spares():
    s = sim_settings()
    recs, timelines = run_trace(s, np.random.default_rng(0), policy_tables(s))
    spares = {r["policy"]: r["spares_needed"] for r in recs}
    assert spares[DP_DROP] >= spares[NTP] >= spares[NTP_PW]
    assert spares[DP_DROP] > 0
    drop = next(r for r in recs if r["policy"] == DP_DROP)
    assert 0 < drop["failed_fraction"] < 0.01 and drop["throughput_rel"] < 1
    assert len(timelines[0].times_h) == len(timelines[0].failed_gpus)


def test_job_failures_do_not_depend_on_the_spare_search_bound():
    a = sim_settings("cluster=small", "failures.max_spare_domains=8")
    b = sim_settings("cluster=small", "failures.max_spare_domains=32")
    ra, _ = run_trace(a, np.random.default_rng(11), policy_tables(a))
    rb, _ = run_trace(b, np.random.default_rng(11), policy_tables(b))
    for x, y in zip(ra, rb, strict=True):
        assert (x["events"], x["throughput_rel"], x["failed_fraction"]) == (
            y["events"],
            y["throughput_rel"],
            y["failed_fraction"],
        )
