"""Cluster goodput simulator: NTP policies under GPU failures at 10K+ GPU scale (`ntp-sim`)."""

from ntp_nemo.goodput.sim.domains import ClusterSpec, form_replicas, replica_histogram
from ntp_nemo.goodput.sim.failures import FailureSpec, Trace, generate_trace, sample_placements, trace_states
from ntp_nemo.goodput.sim.perf import ReplicaPerf
from ntp_nemo.goodput.sim.policy_tables import POLICIES, PolicyTable, policy_table, replica_metrics
from ntp_nemo.goodput.sim.settings import SimSettings, settings_from_config
from ntp_nemo.goodput.sim.studies import SimResults, expected_availability, run_all

__all__ = [
    "POLICIES",
    "ClusterSpec",
    "FailureSpec",
    "PolicyTable",
    "ReplicaPerf",
    "SimResults",
    "SimSettings",
    "Trace",
    "expected_availability",
    "form_replicas",
    "generate_trace",
    "policy_table",
    "replica_histogram",
    "replica_metrics",
    "run_all",
    "sample_placements",
    "settings_from_config",
    "trace_states",
]
