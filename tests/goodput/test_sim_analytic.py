"""Cluster simulator against closed forms: availability (1-p)^g, one-failure throughput, packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ntp_nemo.cli.sim import CONFIG_DIR
from ntp_nemo.goodput.sim.domains import ClusterSpec, form_replicas, replica_histogram
from ntp_nemo.goodput.sim.failures import sample_placements
from ntp_nemo.goodput.sim.perf import ReplicaPerf
from ntp_nemo.goodput.sim.policy_tables import DP_DROP, NTP, NTP_PW, policy_table, replica_metrics
from ntp_nemo.goodput.sim.settings import settings_from_config
from ntp_nemo.goodput.sim.studies import expected_availability, run_availability
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape


def sim_settings(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return settings_from_config(compose(config_name="config", overrides=list(overrides)))


def test_expected_availability_closed_forms():
    assert expected_availability(32768, 64, 0.001, "bernoulli") == pytest.approx(0.999**64, rel=1e-12)
    # exact count: k = round(p N) failed GPUs; P(no failure among g) = C(N-g, k) / C(N, k)
    n, g, p = 1000, 10, 0.02
    exact = math.comb(n - g, 20) / math.comb(n, 20)
    assert expected_availability(n, g, p, "exact") == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("sampling", ["exact", "bernoulli"])
@pytest.mark.parametrize("group", [8, 64])
def test_sampled_availability_matches_expectation(sampling, group):
    n, p, samples = 32768, 0.001, 200
    spec = ClusterSpec(num_gpus=n, domain_size=group, tp=group)
    fails = sample_placements(
        spec.num_cells(), spec.cell_size, p, samples, np.random.default_rng(1), sampling
    )
    available = (form_replicas(spec, fails) == group).mean()
    expected = expected_availability(n, group, p, sampling)
    stderr = math.sqrt(expected * (1 - expected) / (samples * n // group))
    assert abs(available - expected) < 5 * stderr + 1e-12


def test_exact_sampling_fails_exactly_the_requested_gpus():
    fails = sample_placements(1024, 32, 0.005, 50, np.random.default_rng(0), "exact", blast_radius=2)
    assert np.all(fails.sum(axis=1) == 2 * round(0.005 * 32768 / 2))
    assert np.all(fails % 2 == 0)


def test_tp64_reference_within_one_point():
    """Paper reference: 32K GPUs, 0.1% failed, TP64 keeps about 94% (expected (1-p)^64 = 0.938)."""
    s = sim_settings("studies=[availability]")
    recs = run_availability(s, np.random.default_rng(s.seed))
    tp64 = next(r for r in recs if r["tp"] == 64 and r["policy"] == DP_DROP)
    assert tp64["num_gpus"] == 32768 and tp64["failed_fraction"] == 0.001
    assert abs(tp64["replicas_available"] - 0.999**64) <= 0.01
    ntp64 = next(r for r in recs if r["tp"] == 64 and r["policy"] == NTP)
    assert ntp64["replicas_available"] >= tp64["replicas_available"]


def _compute_only_perf(tp: int, replicas: int) -> ReplicaPerf:
    """A replica whose time is pure compute split evenly: units divisible by tp and tp-1, free links."""
    units = 168  # divisible by 3, 4, 7 and 8: even shards at every degree the tests use
    model = ModelShape(
        vocab_size=units * 40,
        hidden_size=units * 8,
        num_layers=4,
        num_heads=units,
        ffn_hidden_size=units * 10,
        seq_len=64,
    )
    links = LinkModel(math.inf, 0.0, math.inf, 0.0)
    return ReplicaPerf(model, DeviceModel(), links, tp=tp, pp=1, seq_len=64, num_replicas=replicas)


@pytest.mark.parametrize("tp,local_batch", [(8, 8), (4, 8), (8, 12)])
def test_one_failed_gpu_closed_form(tp, local_batch):
    """One failed GPU in one replica: NTP keeps floor(b (T-1)/T); NTP-PW keeps b if T/(T-1) <= 1.3."""
    replicas = 16
    spec = ClusterSpec(num_gpus=tp * replicas, domain_size=tp, tp=tp, pp=1)
    perf = _compute_only_perf(tp, replicas)
    fails = np.zeros((1, spec.num_cells()), dtype=int)
    fails[0, 3] = 1
    degrees = replica_histogram(spec, fails)
    got = {
        p: replica_metrics(degrees, policy_table(p, perf, local_batch, 0.3), replicas, tp)
        for p in (DP_DROP, NTP, NTP_PW)
    }
    b_ntp = (local_batch * (tp - 1)) // tp
    need = tp / (tp - 1)
    b_pw = local_batch if need <= 1.3 else math.floor(local_batch * (tp - 1) * 1.3 / tp + 1e-9)
    assert got[DP_DROP]["throughput_rel"][0] == pytest.approx((replicas - 1) / replicas)
    assert got[NTP]["throughput_rel"][0] == pytest.approx((replicas - 1 + b_ntp / local_batch) / replicas)
    assert got[NTP_PW]["throughput_rel"][0] == pytest.approx((replicas - 1 + b_pw / local_batch) / replicas)
    assert got[NTP]["gpus_useful"][0] == pytest.approx((replicas * tp - 1) / (replicas * tp))
    if need <= 1.3:
        assert got[NTP_PW]["power_boost"][0] == pytest.approx(need, rel=1e-5)


def test_packing_puts_damaged_domains_into_one_replica():
    fails = np.zeros((1, 8), dtype=int)
    fails[0, [0, 2]] = 1  # one failed GPU in domains 0 and 2 (replicas 0 and 1 without packing)
    static = ClusterSpec(num_gpus=64, domain_size=8, tp=8, pp=2, packing=False)
    packed = ClusterSpec(num_gpus=64, domain_size=8, tp=8, pp=2, packing=True)
    assert sorted(form_replicas(static, fails)[0].tolist()) == [7, 7, 8, 8]
    assert form_replicas(packed, fails)[0].tolist() == [8, 8, 8, 7]


def test_manager_rebuilds_groups_inside_and_across_domains():
    inside = ClusterSpec(num_gpus=64, domain_size=32, tp=8, pp=1)
    fails = np.array([[1, 5]])  # 31 working GPUs -> 3 x TP8 + TP7; 27 working -> 3 x TP8 + (3 < 4: idle)
    assert form_replicas(inside, fails)[0].tolist() == [8, 8, 8, 8, 8, 8, 7, 0]
    across = ClusterSpec(num_gpus=64, domain_size=4, tp=8, pp=1)
    fails = np.zeros((1, 16), dtype=int)
    fails[0, [1, 9]] = 1  # two damaged 4-GPU domains are paired into one TP group of 6
    assert form_replicas(across, fails)[0].tolist() == [8] * 7 + [6]


def reference_replicas(spec: ClusterSpec, fails: list[int]) -> list[int]:
    """Plain-Python resource manager: build groups per domain, sort best-first, cut into replicas."""
    dmap = spec.degree_map()
    groups = []
    if spec.tp <= spec.domain_size:
        k = spec.domain_size // spec.tp
        for f in fails:
            healthy = spec.domain_size - f
            domain = [spec.tp] * (healthy // spec.tp)
            if len(domain) < k:
                domain.append(int(dmap[healthy % spec.tp]))
            groups += domain + [0] * (k - len(domain))
    else:
        per = spec.tp // spec.domain_size
        ordered = sorted(fails)
        groups = [int(dmap[spec.tp - sum(ordered[i : i + per])]) for i in range(0, len(ordered), per)]
    groups.sort(reverse=True)
    return [min(groups[i : i + spec.pp]) for i in range(0, len(groups) - spec.pp + 1, spec.pp)]


@pytest.mark.parametrize(
    "spec",
    [
        ClusterSpec(num_gpus=512, domain_size=32, tp=32, pp=4, degraded_tp=(30, 28)),
        ClusterSpec(num_gpus=512, domain_size=32, tp=8, pp=2, min_degraded_fraction=0.75),
        ClusterSpec(num_gpus=512, domain_size=8, tp=16, pp=2),
        ClusterSpec(num_gpus=512, domain_size=16, tp=16, pp=1, spare_domains=3),
    ],
)
def test_histogram_manager_matches_a_plain_reference(spec):
    rng = np.random.default_rng(5)
    fails = sample_placements(spec.num_cells(), spec.cell_size, 0.02, 40, rng, "bernoulli")
    explicit = form_replicas(spec, fails)
    hist = replica_histogram(spec, fails)
    for row, degrees, counts in zip(fails, explicit, hist, strict=True):
        expected = reference_replicas(spec, row.tolist())
        assert degrees.tolist() == expected
        assert counts.tolist() == np.bincount(expected, minlength=spec.tp + 1).tolist()
