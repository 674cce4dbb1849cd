"""Topology: ranks -> (replica, stage, tp slot), per-layer degrees, process groups."""

from ntp_nemo.topology.layout import ResolvedLayout
from ntp_nemo.topology.topology import RankCoord, RankPlan, Topology, effective_degree

__all__ = ["RankCoord", "RankPlan", "ResolvedLayout", "Topology", "effective_degree"]
