"""One resolved layout: the config is turned into a ResolvedLayout once, and the lower packages never
import the config layer (or Lightning, or resilience)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ntp_nemo.config.resolve_layout import resolve_layout
from ntp_nemo.config.validate import validate
from ntp_nemo.errors import ConfigError
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import ROOT, compose

LOWER = ("parallel", "topology", "models")
UPWARD = ("ntp_nemo.config", "ntp_nemo.lightning", "ntp_nemo.resilience", "lightning")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (module level or inside functions), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def upward_imports(packages=LOWER) -> list[str]:
    bad = []
    for pkg in packages:
        for path in sorted((ROOT / "ntp_nemo" / pkg).rglob("*.py")):
            for line, mod in _imports(path):
                if any(mod == up or mod.startswith(up + ".") for up in UPWARD):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def test_lower_packages_import_nothing_from_config_lightning_or_resilience(tmp_path):
    assert upward_imports() == []
    # The scan sees imports inside functions too: a planted upward import is reported.
    planted = tmp_path / "ntp_nemo" / "parallel"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text("def f():\n    from ntp_nemo.config.schema import ModelConfig\n")
    assert [(2, "ntp_nemo.config.schema")] == _imports(planted / "bad.py")


def _layout(*overrides: str) -> ResolvedLayout:
    cfg = compose(list(overrides))
    validate(cfg)
    return resolve_layout(cfg)


def test_resolve_layout_ntp_pipeline_and_batch_shares():
    lay = _layout("mesh.dp=2", "mesh.tp=4", "mesh.pp=2", "ntp.replica_tp=[4,2]", "model.num_layers=4",
                  "data.global_batch_size=24", "data.micro_batch_size=2", "ntp.power_boost=1.5",
                  "layout.schedule=gpipe", "layout.stage_layers=[1,3]")
    assert (lay.tp, lay.replica_tp, lay.pp, lay.stage_layers, lay.schedule) == (4, (4, 2), 2, (1, 3), "gpipe")
    assert lay.layer_tp == (4,) * 6 and lay.world_size == 2 * 6 and lay.dp == 2
    # ntp.capacity=ranks (the default): 12 micro-batches; capacities 1.0 and 2/4 * 1.5 = 0.75
    # -> 12 * 4/7 = 6.86 and 5.14 -> 7 and 5.  The layout carries the work model's shape all the same.
    assert lay.capacity == "ranks" and lay.work is not None and lay.capacities() == [1.0, 0.75]
    assert lay.num_microbatches == 12 and lay.microbatches == (7, 5)
    assert lay.microbatch_counts(7) == [4, 3]
    assert lay.power_boost == 1.5 and lay.devices is None
    # The strategy and runtime build their Topology from it.
    topo = lay.topology()
    assert isinstance(topo, Topology) and topo.world_size == 12 and topo.stage_layer_range(1) == range(1, 4)


def test_resolve_layout_capacity_by_modelled_work():
    """ntp.capacity=work: the split by modelled capacity (`ntp_nemo.topology.work`): in this tiny model the
    TP all-reduce bytes outweigh the matmuls, so a TP-2 rank models no more work than a TP-4 rank and both
    replicas get capacity 1 (the boost raises only a reduced capacity)."""
    lay = _layout("mesh.dp=2", "mesh.tp=4", "mesh.pp=2", "ntp.replica_tp=[4,2]", "model.num_layers=4",
                  "data.global_batch_size=24", "data.micro_batch_size=2", "ntp.power_boost=1.5",
                  "layout.schedule=gpipe", "layout.stage_layers=[1,3]", "ntp.capacity=work")
    assert lay.capacity == "work" and lay.capacities() == [1.0, 1.0] and lay.microbatches == (6, 6)
    # The rule survives serialisation and re-planning.
    assert ResolvedLayout.from_dict(lay.to_dict()) == lay
    assert lay.with_changes(power_boost=None).capacity == "work"


def test_capacity_rule_is_validated():
    with pytest.raises(ConfigError, match="ntp.capacity"):
        validate(compose(["ntp.capacity=slots"]))
    with pytest.raises(ValueError, match="capacity rule 'slots'"):
        ResolvedLayout.make(Topology(2, [2], [2, 2, 2]), capacity="slots")


def test_resolve_layout_balanced_split_and_serialisation():
    lay = _layout("mesh.dp=1", "mesh.tp=2", "mesh.pp=2", "ntp.replica_tp=null", "model.num_layers=4")
    assert sum(lay.stage_layers) == 4 and len(lay.stage_layers) == 2 and min(lay.stage_layers) >= 1
    assert ResolvedLayout.from_dict(lay.to_dict()) == lay
    # Re-planning changes inputs and recomputes the derived fields (batch shares, devices cleared).
    placed = lay.with_changes(devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert placed.device_of(3) == "cuda:3"
    smaller = placed.with_changes(replica_tp=(1,))
    assert smaller.world_size == 2 and smaller.devices is None and smaller.microbatches == lay.microbatches
    with pytest.raises(ValueError, match="3 devices for a layout of 4 ranks"):
        lay.with_changes(devices=["cpu"] * 3)


def test_checkpoints_read_back_the_layout_they_recorded():
    lay = _layout("mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "ntp.power_boost=1.3",
                  "model.num_layers=4", "mesh.pp=2", "layout.schedule=interleaved_1f1b",
                  "layout.virtual_stages=2", "ntp.shard_align=4")
    assert ResolvedLayout.from_checkpoint(lay.to_dict()) == lay  # every option, the boost included
    # The four keys checkpoints held before the whole layout was stored: the same ranks hold the same
    # shards, so the saved RNG states carry over.
    old = ResolvedLayout.from_checkpoint({"tp": 2, "replica_tp": [2, 1], "layer_tp": [2] * 6, "pp": 2})
    assert old is not None and old.same_ranks(lay) and not old.same_ranks(lay.shrunk([1, 1]))
    # Nothing recorded, or a layout written by something else: nothing to compare with.
    assert ResolvedLayout.from_checkpoint("(2,1)") is None
    assert ResolvedLayout.from_checkpoint({"replica_tp": [2, 1], "colour": "red"}) is None


def test_shrinking_keeps_every_option_and_follows_per_replica_boosts():
    lay = _layout("mesh.dp=3", "mesh.tp=2", "ntp.replica_tp=[2,1,2]", "ntp.power_boost=[1.0,1.3,1.2]",
                  "model.num_layers=4", "layout.layer_tp=[2,1,2,1,2,2]", "data.global_batch_size=40",
                  "data.micro_batch_size=2", "ntp.shard_align=4")
    assert lay.shrunk([2, 1, 2]) is lay  # nothing lost (the restart policy): the same layout
    new = lay.shrunk([0, 1, 1])  # replica 0 dropped, replica 2 lost a rank
    assert new.replica_tp == (1, 1) and new.power_boost == (1.3, 1.2) and new.nominal_replicas == 3
    assert new.layer_tp == lay.layer_tp and new.num_microbatches == 20
    assert new.shard_align == 4 and new.topology().shard_align == 4
    sp = lay.with_changes(sequence_parallel=True, capacity="work").shrunk([0, 1, 1])
    assert sp.sequence_parallel and sp.capacity == "work" and sp.work == lay.work and sp.shard_align == 4
    # capacities 0.5 * 1.3 = 0.65 and 0.5 * 1.2 = 0.6 of 20 micro-batches: 10.4 and 9.6 -> 10 and 10
    assert new.microbatches == (10, 10) and new.capacity_fraction() == 2 / 6


def test_strategy_takes_the_resolved_layout():
    from ntp_nemo.lightning.strategy import NTPStrategy

    lay = _layout("mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "ntp.nominal_replicas=3")
    strategy = NTPStrategy(lay)
    assert strategy.layout is lay and strategy.topology.world_size == 3
    assert strategy.layout_info == {"layout": "(2,1)", "capacity": 0.5}
    with pytest.raises(TypeError, match="ResolvedLayout"):
        NTPStrategy(lay.topology())
