"""Layout planner: per-layer TP degrees and per-replica batch shares from a cost model (`ntp-plan`)."""

from ntp_nemo.planner.cost import ItemCost, item_cost
from ntp_nemo.planner.layer_tp import effective_degree, parse_layer_tp, validate_layer_tp
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape
from ntp_nemo.planner.solver import Plan, PlanRow, Ranking, plan_layout, rank_layouts

__all__ = [
    "DeviceModel",
    "ItemCost",
    "LinkModel",
    "ModelShape",
    "Plan",
    "PlanRow",
    "Ranking",
    "effective_degree",
    "item_cost",
    "parse_layer_tp",
    "plan_layout",
    "rank_layouts",
    "validate_layer_tp",
]
