"""`ntp-plan`: rank per-layer TP layouts with the planner's cost model; print the best few and the
`ntp-train` overrides that apply the best one.

Usage: ntp-plan [--all] [--patterns] [key=value ...]

The model, mesh and data shape come from one of
    model=NAME       a training model (conf/model/NAME.yaml: gpt_tiny, llama_tiny, ...) with the
                     default recipe's mesh and data, or a large simulator model (conf/sim/model:
                     gpt_480b, llama3_70b, llama3_8b) with conf/sim/plan.yaml's mesh
    recipe=NAME      a training recipe (recipes/NAME.yaml): its model, mesh, replicas and data
    run=RUN_DIR      a training run's own record (RUN_DIR/.hydra/config.yaml)
and the other keys change them, e.g.
    ntp-plan model=gpt_tiny
    ntp-plan recipe=gpt_tiny_pp hardware=h100
    ntp-plan model=llama3_8b hardware=h100 mesh.tp=8 mesh.pp=1 ntp.replica_tp=[8,8,7] memory_limit_gb=80
Keys: hardware=b200|h100, mesh.tp, mesh.pp, mesh.dp, ntp.replica_tp, data.seq_len,
data.micro_batch_size, memory_limit_gb, recompute=true|false, distributed_optimizer=true|false,
sequence_parallel=true|false;
with a training model or recipe also model.FIELD (e.g. model.num_layers=8, model.init_from=DIR).
Output: top=N rows (default 5), --all for every layout within the memory limit, detail=true for the
best layout's per-item costs and per-replica periods, format=json for all of it as JSON.
--patterns: instead of the ranking, compare row/column (Megatron) with block (2D, SUMMA over a
sqrt(p) x sqrt(p) grid) sharding of every weight matmul at TP mesh.tp on four measures (speed, memory,
bytes moved, work between synchronisations), and map where block sharding wins over degrees and link
bandwidths (a model: ntp_nemo/planner/patterns.py derives it), e.g.
    ntp-plan model=llama3_8b hardware=h100 mesh.tp=64 --patterns
speeds=[...] (one measured speed in (0, 1] per global rank, 1: as fast as the work model says): instead
of the ranking, what the straggler watch would do at those speeds on a training model's or recipe's
layout (the mesh, ntp, data and fault.straggler* keys change it): the ranks it excludes, the batch split
across replicas, the shard weights inside a TP group (a one-replica job, or fault.straggler_shards=on), e.g.
    ntp-plan model=gpt_tiny mesh.dp=2 mesh.tp=2 ntp.replica_tp=[2,2] speeds=[1,0.5,1,1]
    ntp-plan model=gpt_tiny mesh.dp=1 mesh.tp=2 ntp.replica_tp=null speeds=[1,0.5]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ntp_nemo.config.paths import conf_dir, recipes_dir
from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.models import families
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape
from ntp_nemo.planner.solver import Plan, Ranking, rank_layouts, run_length

if TYPE_CHECKING:
    from ntp_nemo.config.resolve import RunSpec

CONFIG_DIR = conf_dir() / "sim"
USAGE = __doc__
DEFAULT_TOP = 5
# Keys of the plan config that a training config also has: a run's or recipe's values are defaults.
LAYOUT_KEYS = ("mesh.tp", "mesh.pp", "mesh.dp", "ntp.replica_tp", "ntp.power_boost", "ntp.capacity",
               "ntp.shard_align", "data.seq_len",
               "data.micro_batch_size", "data.global_batch_size")


def load_config(overrides: Sequence[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name="plan", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("overrides", str(err)) from err
    finally:
        GlobalHydra.instance().clear()


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "__init__")


def _choices() -> str:
    return (
        f"training models (conf/model): {', '.join(_names(conf_dir() / 'model'))}; "
        f"simulator models (conf/sim/model): {', '.join(_names(CONFIG_DIR / 'model'))}; "
        f"or recipe=NAME with one of {', '.join(_names(recipes_dir()))}, or run=RUN_DIR"
    )


def _compose_training(overrides: list[str]) -> DictConfig:
    """The config `ntp-train OVERRIDES` would start from (composed, not validated)."""
    from ntp_nemo.config.register import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("overrides", f"{err} (in the training config: {' '.join(overrides)})") from err
    finally:
        GlobalHydra.instance().clear()


def _training_defaults(spec: RunSpec) -> list[str]:
    """Plan overrides taking a resolved training run's mesh, replicas, data shape and memory options."""
    rtp, pb, layout = spec.ntp.replica_tp, spec.ntp.power_boost, spec.layout
    return [
        f"mesh.tp={layout.tp}",
        f"mesh.pp={layout.pp}",
        f"mesh.dp={len(layout.replica_tp)}",
        f"ntp.replica_tp={list(rtp) if rtp is not None else 'null'}",
        f"data.seq_len={spec.data.seq_len}",
        f"data.micro_batch_size={spec.data.micro_batch_size}",
        f"data.global_batch_size={spec.data.global_batch_size}",
        f"ntp.power_boost={list(pb) if isinstance(pb, tuple) else ('null' if pb is None else pb)}",
        f"ntp.capacity={spec.ntp.capacity}",
        f"ntp.shard_align={spec.ntp.shard_align}",
        f"recompute={spec.model.recompute == 'full'}".lower(),
        f"distributed_optimizer={bool(spec.optim.distributed)}".lower(),
        f"sequence_parallel={bool(spec.ntp.sequence_parallel)}".lower(),
    ]


def training_overrides(argv: Sequence[str]) -> tuple[list[str], DictConfig | None, str | None]:
    """Split off the training side: `run=RUN_DIR`, `recipe=NAME`, `model=NAME` of a training model
    and, with those, `model.FIELD=VALUE`. Returns (plan overrides, training model config or None,
    what to select it with in `ntp-train`, e.g. 'recipe=gpt_tiny')."""
    pairs = [(a.partition("=")[0], a.partition("=")[2], a) for a in argv]
    given = {k for k, _, _ in pairs}
    selected = {k: v for k, v, _ in pairs if k in ("run", "recipe", "model")}
    if "run" in selected and len(selected) > 1:
        raise ConfigError("run", "takes the run's own model and recipe; drop model=/recipe= or run=.")
    model_name = selected.get("model")
    sim_model = model_name is not None and (CONFIG_DIR / "model" / f"{model_name}.yaml").is_file()
    train_model = model_name is not None and (conf_dir() / "model" / f"{model_name}.yaml").is_file()
    if model_name is not None and not (sim_model or train_model):
        raise ConfigError("model", f"unknown model {model_name!r}; choose one of the {_choices()}.")
    if "recipe" in selected and not (recipes_dir() / f"{selected['recipe']}.yaml").is_file():
        raise ConfigError("recipe", f"unknown recipe {selected['recipe']!r}; use one of the {_choices()}.")
    if sim_model and "recipe" in selected:
        raise ConfigError("model", f"{model_name!r} is a simulator model; with recipe= name a training model "
                          f"({', '.join(_names(conf_dir() / 'model'))}) or drop model=.")
    if not selected or (sim_model and len(selected) == 1):  # a simulator model with plan.yaml's mesh
        return list(argv), None, f"model={model_name}" if train_model else None

    if "run" in selected:
        record = Path(selected["run"]).expanduser() / ".hydra" / "config.yaml"
        if not record.is_file():
            raise ConfigError(
                "run", f"{selected['run']!r} is not a training run directory (no .hydra/config.yaml)."
            )
        train = OmegaConf.load(record)
        model_args = [a for k, _, a in pairs if k.startswith("model.")]
        if model_args:
            train.model = OmegaConf.merge(train.model, OmegaConf.from_dotlist([a for a in model_args]).model)
        select = None  # the run's own overrides, plus these
        training_keys = ("run",)
    else:
        model_args = [a for k, _, a in pairs if k.startswith("model.")]
        train_args = [f"{k}={selected[k]}" for k in ("recipe", "model") if k in selected] + model_args
        train = _compose_training(train_args)
        select = " ".join(f"{k}={selected[k]}" for k in ("recipe", "model") if k in selected)
        training_keys = ("recipe", "model")
    spec = _resolved(train)
    pre = _training_defaults(spec)
    if ({"mesh.tp", "mesh.dp"} & given) and "ntp.replica_tp" not in given:
        pre = [p for p in pre if not p.startswith("ntp.replica_tp=")]  # the given mesh's healthy replicas
    rest = [a for k, _, a in pairs if k not in training_keys and not k.startswith("model.")]
    return pre + rest, OmegaConf.structured(spec.model), select


def _resolved(train: DictConfig) -> RunSpec:
    """The training run as `ntp-train` resolves it (`resolve`, without reading its data): the model
    with `model.init_from`'s sizes, the recipe's layout and batch."""
    from ntp_nemo.config.resolve import resolve

    return resolve(train, reads_data=False)  # a recipe's `model.init_from=???` is asked for here


def _options(cfg: DictConfig, show_all: bool) -> tuple[int | None, bool]:
    top = cfg.get("top", DEFAULT_TOP)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ConfigError("top", f"must be a positive number of rows, got {top!r}; or pass --all.")
    detail = cfg.get("detail", False)
    if not isinstance(detail, bool):
        raise ConfigError("detail", f"must be true or false, got {detail!r}.")
    return (None if show_all else top), detail


def rank_from_config(cfg: DictConfig, train_model: DictConfig | None = None) -> Ranking:
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    if train_model is None:
        model = ModelShape.from_dict(raw["model"])
    else:
        model = families.model_shape(train_model)
    device = DeviceModel.from_dict(raw["hardware"]["device"], "hardware.device")
    links = LinkModel.from_dict(raw["hardware"]["links"], "hardware.links")
    mesh, data = raw["mesh"], raw["data"]
    dp = mesh.get("dp", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError("mesh.dp", f"must be a positive integer, got {dp!r}.")
    replica_tp = raw["ntp"].get("replica_tp") or [mesh["tp"]] * dp
    if not isinstance(replica_tp, list):
        raise ConfigError(
            "ntp.replica_tp", f"must be a list of active ranks per replica, got {replica_tp!r}."
        )
    gbs, mbs = data.get("global_batch_size"), data["micro_batch_size"]
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ConfigError("data.global_batch_size", f"must be a positive number of sequences, got {gbs!r}.")
    return rank_layouts(
        model,
        mesh["tp"],
        replica_tp,
        data["seq_len"],
        data["micro_batch_size"],
        links,
        raw.get("memory_limit_gb"),
        pp=mesh.get("pp", 1),
        device=device,
        recompute=bool(raw.get("recompute", False)),
        distributed_optimizer=bool(raw.get("distributed_optimizer", False)),
        sequence_parallel=bool(raw.get("sequence_parallel", False)),
        num_microbatches=max(1, gbs // mbs) if isinstance(mbs, int) and mbs > 0 else None,
        power_boost=raw["ntp"].get("power_boost"),
        capacity=_capacity(raw["ntp"].get("capacity", "ranks")),
        shard_align=int(raw["ntp"].get("shard_align", 1)),
    )


def _capacity(value: object) -> str:
    from ntp_nemo.topology.layout import CAPACITY_RULES

    if value not in CAPACITY_RULES:
        raise ConfigError("ntp.capacity", f"{value!r} is not a capacity rule; use ranks or work.")
    return str(value)


def plan_from_config(cfg: DictConfig, train_model: DictConfig | None = None) -> Plan:
    """The planner's choice (the first of `rank_from_config`)."""
    return rank_from_config(cfg, train_model).plans[0]


def train_overrides(cfg: DictConfig, plan: Plan, select: str | None) -> str:
    """The `ntp-train` arguments that run `plan` (shell-quoted where Hydra needs it)."""
    rtp = ",".join(str(n) for n in plan.replica_tp)
    pb = cfg.ntp.get("power_boost")
    args = [
        *([select] if select else []),
        f"mesh.tp={plan.tp}",
        f"mesh.pp={cfg.mesh.pp}",
        f"mesh.dp={len(plan.replica_tp)}",
        f"ntp.replica_tp=[{rtp}]",
        f"\"layout.layer_tp='{plan.layer_tp_pattern()}'\"",
        f"data.global_batch_size={cfg.data.global_batch_size}",
        f"data.micro_batch_size={cfg.data.micro_batch_size}",
        *([f"ntp.power_boost={list(pb) if OmegaConf.is_list(pb) else pb}"] if pb is not None else []),
        *([f"ntp.capacity={cap}"] if (cap := cfg.ntp.get("capacity", "ranks")) != "ranks" else []),
    ]
    if cfg.get("sequence_parallel", False):  # the plan's memory and time assume it
        args.append("ntp.sequence_parallel=true")
    return " ".join(args)


def _row(rank: int, plan: Plan, best: Plan) -> list[str]:
    layers = plan.layer_tp[1:-1]
    slower = plan.time_per_microbatch_s / best.time_per_microbatch_s - 1
    return [
        str(rank),
        str(plan.layer_tp[0]),
        run_length(layers),
        str(plan.layer_tp[-1]),
        f"{plan.time_per_microbatch_s * 1e3:.3f}",
        "best" if rank == 1 else f"+{100 * slower:.1f}%",
        f"{max(plan.memory_gb):.2f}",
        "/".join(f"{w:.3f}" for w in plan.batch_shares) + " (" + "/".join(map(str, plan.microbatches)) + ")",
    ]


def format_ranking(rows: list[Plan]) -> str:
    header = ["#", "embedding", "layers", "head", "ms/micro-batch", "vs best", "peak GB", "batch shares"]
    cells = [header, *(_row(i + 1, p, rows[0]) for i, p in enumerate(rows))]
    widths = [max(len(r[c]) for r in cells) for c in range(len(header))]
    left = {1, 2, 3, 7}  # degrees and shares read left to right; numbers right-aligned
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if c in left else v.rjust(w) for c, (v, w) in
                               enumerate(zip(r, widths, strict=True))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(m: Any, cfg: DictConfig, plan: Plan) -> str:
    limit = cfg.memory_limit_gb
    return (
        f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, seq {cfg.data.seq_len}, micro-batch "
        f"{cfg.data.micro_batch_size}; {cfg.hardware.device.name}, tp={plan.tp}, pp={cfg.mesh.pp}, "
        f"replica_tp={plan.replica_tp}, memory limit {'none' if limit is None else f'{limit} GB'}"
    )


def run(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    show_all = "--all" in argv
    patterns = "--patterns" in argv
    argv = [a for a in argv if a not in ("--all", "--patterns")]
    unknown = [a for a in argv if a.startswith("-")]
    if unknown:
        raise ConfigError("argv", f"unknown option(s) {unknown}; use --all or --patterns, or pass settings "
                          "as key=value.")
    if any(a.startswith("speeds=") for a in argv):
        return print_speed_split(argv)
    argv, train_model, select = training_overrides(argv)
    cfg = load_config(argv)
    fmt = cfg.get("format", "table")
    if fmt not in ("table", "json"):
        raise ConfigError("format", f"{fmt!r}; use table or json.")
    top, detail = _options(cfg, show_all)
    if patterns:
        return print_patterns(cfg, train_model, fmt)
    ranking = rank_from_config(cfg, train_model)
    plan = ranking.plans[0]
    shown = ranking.plans if top is None else ranking.plans[:top]
    command = "ntp-train " + train_overrides(cfg, plan, select)
    if fmt == "json":
        print(
            json.dumps(
                {
                    "layer_tp": plan.layer_tp,
                    "batch_shares": plan.batch_shares,
                    "microbatches": plan.microbatches,
                    "overrides": plan.overrides(),
                    "microbatch_time_s": plan.microbatch_time_s,
                    "memory_gb": plan.memory_gb,
                    "command": command,
                    "considered": ranking.considered,
                    "within_memory_limit": len(ranking.plans),
                    "candidates": [
                        {
                            "layer_tp": p.layer_tp_pattern(),
                            "time_per_microbatch_s": p.time_per_microbatch_s,
                            "memory_gb": p.memory_gb,
                            "batch_shares": p.batch_shares,
                        }
                        for p in shown
                    ],
                }
            )
        )
        return 0
    m = cfg.model if train_model is None else train_model
    print(_describe(m, cfg, plan))
    fits = len(ranking.plans)
    over = ranking.considered - fits
    beyond = f" ({over} more over it)" if over else ""
    if len(shown) == fits:
        print(f"all {fits} layouts within the memory limit{beyond}, fastest first")
    else:
        print(f"the {len(shown)} fastest of {fits} layouts within the memory limit{beyond}")
    print(
        "(TP degree of the embedding, the layers as DEGREE*COUNT, and the head; modelled time per\n"
        "micro-batch of the global batch; the busiest GPU's memory; each replica's share of the batch\n"
        "and, in brackets, its micro-batches: the split the command below runs)\n"
    )
    print(format_ranking(shown))
    if len(shown) < fits:
        print(f"({fits - len(shown)} more: top=N or --all)")
    if detail:
        print("\nbest layout, per micro-batch, forward+backward, busiest rank of the smallest replica "
              "(mem excludes in-flight copies):")
        print(plan.format_table())
        print("\nreplica  ranks  period ms  share   mem GB")
        for r, (n, t, w, mem) in enumerate(
            zip(plan.replica_tp, plan.microbatch_time_s, plan.batch_shares, plan.memory_gb, strict=True)
        ):
            print(f"{r:>7} {n:>6} {t * 1e3:>10.3f} {w:>6.3f} {mem:>8.2f}")
    print("\nto train with the best layout:")
    print(f"  {command}")
    if train_model is None and select is None:
        print(f"  ({m.name} is a simulator model with no training config: add the model of a training "
              "config with its shape)")
    return 0


PATTERN_DEGREES = (4, 9, 16, 25, 36, 49, 64, 100, 144, 256)  # square grids: 2x2 ... 16x16
PATTERN_GBPS = (25.0, 50.0, 100.0, 200.0, 450.0, 900.0, 1800.0)


def print_speed_split(argv: Sequence[str]) -> int:
    """`speeds=[...]`: what the straggler watch makes of a training layout at measured per-rank speeds,
    by the policy's own decision (`straggler.decide`, the run's `fault.straggler*` keys): the ranks it
    would exclude, the batch split across replicas, the shard weights inside a TP group."""
    from ntp_nemo.resilience.straggler import Judgement, StragglerSettings, decide, predicted_compute_s

    pairs = [(a.partition("=")[0], a.partition("=")[2], a) for a in argv]
    raw = next(v for k, v, _ in pairs if k == "speeds")
    rest = [a for k, _, a in pairs if k != "speeds"]
    if any(k == "run" for k, _, _ in pairs) or training_overrides(rest)[1] is None:
        raise ConfigError("speeds", "needs a training model or recipe (model=NAME or recipe=NAME, with the "
                          "mesh, ntp and data keys of the layout), e.g. ntp-plan model=gpt_tiny mesh.dp=2 "
                          "mesh.tp=2 ntp.replica_tp=[2,2] speeds=[1,0.5,1,1].")
    try:
        speeds = [float(v) for v in OmegaConf.from_dotlist([f"s={raw}"]).s]
    except Exception as err:  # noqa: BLE001 - any parse failure is the key's error
        raise ConfigError("speeds", f"{raw!r} is not a list of numbers, e.g. speeds=[1,0.5,1,1].") from err
    spec = _resolved(_compose_training(rest))
    layout = spec.layout
    if len(speeds) != layout.world_size or not all(0 < v <= 1 for v in speeds):
        raise ConfigError("speeds", f"needs one speed in (0, 1] per global rank of layout "
                          f"{layout.describe()} ({layout.world_size} ranks), got {raw}.")
    settings = StragglerSettings.from_config(spec.failover.fault)
    slow = tuple(r for r, v in enumerate(speeds) if v < settings.slow_below)
    decision = decide(settings, layout, Judgement(0, tuple(speeds), slow, slow, slow, (), 0.0, 1.0))
    new = decision.layout or layout
    full = predicted_compute_s(layout, 1.0, [1.0] * layout.world_size)
    named = ", ".join(f"rank {r} at {speeds[r]:g}" for r in slow) or "none"
    lines = [f"layout {layout.describe()}, {sum(layout.microbatches)} micro-batches per step, "
             f"fault.straggler={settings.policy}; stragglers (speed below 1/(1+margin) = "
             f"{settings.slow_below:.3f}): {named}"]
    if decision.exclude:
        lines.append(f"  excluded: ranks {list(decision.exclude)} (exclude policy, or below "
                     f"fault.straggler_floor={settings.floor:g}); the survivors re-form by fault.policy="
                     f"{spec.failover.fault.policy}, as after a lost rank")
    else:
        speeds_of = list(new.speeds) if new.speeds is not None else [1.0] * layout.dp
        weights = "balanced" if new.shard_speeds is None else str(list(new.shard_speeds))
        after = predicted_compute_s(new, 1.0, speeds)
        lines += [f"  replica speeds for the batch split {speeds_of}",
                  f"  micro-batches per replica: {list(layout.microbatches)} -> {list(new.microbatches)}",
                  f"  shard weights inside the TP groups (fault.straggler_shards={settings.shards}): "
                  f"{weights}",
                  f"  modelled compute per step (the work model, relative to full speed): "
                  f"{predicted_compute_s(layout, 1.0, speeds) / full:.3f} -> {after / full:.3f}"]
    print("\n".join(lines))
    return 0


def print_patterns(cfg: DictConfig, train_model: DictConfig | None, fmt: str) -> int:
    """`--patterns`: row/column against block sharding of each weight matmul at TP mesh.tp."""
    from ntp_nemo.planner import patterns as pt

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    model = (ModelShape.from_dict(raw["model"]) if train_model is None
             else families.model_shape(train_model))
    device = DeviceModel.from_dict(raw["hardware"]["device"], "hardware.device")
    links = LinkModel.from_dict(raw["hardware"]["links"], "hardware.links")
    p = raw["mesh"]["tp"]
    if isinstance(p, bool) or not isinstance(p, int) or p < 2:
        raise ConfigError("mesh.tp", "--patterns compares sharding over mesh.tp devices; give a degree "
                          f"of at least 2, got {p!r}.")
    tokens = int(raw["data"]["seq_len"]) * int(raw["data"]["micro_batch_size"])
    up = (links.scale_up_gbps * 1e9, links.scale_up_latency_us * 1e-6)
    out = (links.scale_out_gbps * 1e9, links.scale_out_latency_us * 1e-6)
    rows = pt.compare(model, tokens, p, device, *up)
    totals = {name: pt.step_totals(pt.compare(model, tokens, p, device, *link))
              for name, link in (("scale_up", up), ("scale_out", out))}
    wins = pt.block_wins(model, tokens, device, up[1], list(PATTERN_DEGREES), list(PATTERN_GBPS))
    if fmt == "json":
        recommended, compared = pt.recommend_patterns(rows, model)
        print(json.dumps({"model": model.name, "degree": p, "tokens": tokens, "grid_side": pt.grid_side(p),
                          "matmuls": [r.to_dict() for r in rows], "step_totals": totals, "block_wins": wins,
                          "recommended_pattern": list(recommended), "pattern_times_ms": compared}))
        return 0
    print(format_patterns(model, device, links, p, tokens, rows, totals, wins))
    return 0


def _recommendation(model: ModelShape, rows: list[Any]) -> list[str]:
    """The per-slot `ntp.pattern` the model recommends at this degree and link, and why."""
    from ntp_nemo.planner import patterns as pt

    chosen, ms = pt.recommend_patterns(rows, model)
    if all(c == "row_column" for c in chosen):
        setting = "row_column"
    elif len(set(chosen)) == 1:
        setting = chosen[0]
    else:
        setting = "[" + ",".join(chosen) + "]"
    why = [f"{part} {ms['block'][part]:.3f} ms on the grid against {ms['row/column'][part]:.3f} ms "
           f"row/column" for part in ("layer", "head")] if ms["block"]["layer"] != float("inf") else [
        "no square grid"]
    return ["", f"recommended: ntp.pattern={setting} (per slot: embedding, {model.num_layers} layers, head; "
            f"{'; '.join(why)}; the relayout between slots of different patterns is not modelled)"]


def format_patterns(model: ModelShape, device: DeviceModel, links: LinkModel, p: int, tokens: int,
                    rows: list[Any], totals: dict[str, Any], wins: list[dict[str, float]]) -> str:
    from ntp_nemo.planner import patterns as pt

    q = pt.grid_side(p)
    grid = f"a {q}x{q} grid" if q else f"no square grid ({p} is not a square)"
    lines = [
        f"{model.name} at TP {p}: row/column (Megatron) against block (SUMMA) sharding over {grid}; per "
        f"device, forward+backward, one micro-batch of {tokens} tokens; {device.name} "
        f"({device.flops_per_s / 1e12:.0f} TFLOP/s sustained), link {links.scale_up_gbps:g} GB/s "
        f"(scale-up), {links.scale_up_latency_us:g} us per hop",
        "(time = compute + exposed transfer; 1D's all-reduce waits for the whole matmul, SUMMA's next "
        "panel overlaps the current block product; memory = weights x "
        f"{device.state_bytes_per_param} B + the input kept for the backward; work = GFLOP per device "
        "between two collectives)",
        "",
    ]
    header = ["matmul", "k x n", "count", "pattern", "ms", "comm ms", "MB moved", "memory MB", "GFLOP/sync"]
    cells = [header]
    for r in rows:
        for c in (r.row_column, r.block):
            name = r.matmul.name if c is r.row_column else ""
            dims = f"{r.matmul.k}x{r.matmul.n}" if c is r.row_column else ""
            count = str(r.matmul.count) if c is r.row_column else ""
            if c is None:  # no square grid: the 1D rows alone
                continue
            label = c.pattern + (f" ({r.matmul.side})" if c.pattern == pt.ROW_COLUMN else "")
            cells.append([name, dims, count, label, f"{c.time_s * 1e3:.3f}", f"{c.exposed_comm_s * 1e3:.3f}",
                          f"{c.bytes_moved / 1e6:.1f}", f"{c.memory_bytes / 1e6:.1f}",
                          f"{c.flops_per_sync / 1e9:.2f}"])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths,
                                                                                              strict=True))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if q is None:
        lines.append(f"TP {p}: no block rows: block sharding is modelled on a square grid only (SUMMA's "
                     "transposed products need one, as in Optimus); the map below gives the square degrees "
                     f"around {p}.")
    else:
        lines.append(f"a step's {model.num_layers} layers and head at TP {p} (block against row/column):")
        for link, gbps in (("scale_up", links.scale_up_gbps), ("scale_out", links.scale_out_gbps)):
            one, two = totals[link][pt.ROW_COLUMN], totals[link][pt.BLOCK]
            where = f"{gbps:g} GB/s ({link.replace('_', '-')})"
            lines.append(f"  speed at {where}: {_gain(one['time_s'], two['time_s'])} "
                         f"({one['time_s'] * 1e3:.1f} ms -> {two['time_s'] * 1e3:.1f} ms)")
        one, two = totals["scale_up"][pt.ROW_COLUMN], totals["scale_up"][pt.BLOCK]
        moved, memory = one["bytes_moved"], one["memory_bytes"]
        lines.append(f"  bytes moved per device: {_gain(moved, two['bytes_moved'], 'fewer', 'more')} "
                     f"({one['bytes_moved'] / 1e9:.2f} GB -> {two['bytes_moved'] / 1e9:.2f} GB)")
        lines.append(f"  memory per device: {_gain(memory, two['memory_bytes'], 'less', 'more')} "
                     f"({one['memory_bytes'] / 1e9:.2f} GB -> {two['memory_bytes'] / 1e9:.2f} GB; 1D keeps "
                     "column-parallel inputs replicated)")
        lines.append(f"  work between collectives: {one['flops_per_sync'] / 1e9:.1f} -> "
                     f"{two['flops_per_sync'] / 1e9:.1f} GFLOP (block synchronises {5 * q} to {6 * q} times "
                     f"per matmul, in groups of {q} instead of {p})")
        better = [r.matmul.name for r in rows if r.block is not None
                  and r.block.bytes_moved < r.row_column.bytes_moved]
        lines.append(f"  matmuls where block moves fewer bytes: {', '.join(better) or 'none'} (it wins on "
                     "bytes on large grids, with many tokens and small weights: docs/sharding_patterns.md)")
    lines += _recommendation(model, rows)
    lines += ["", "where block sharding wins: a step's time, block against row/column, by degree (rows) and "
              "link bandwidth (GB/s); + = block faster, [bytes] = block's bytes against 1D's"]
    gbps = sorted({w["gbps"] for w in wins})
    lines.append("degree  grid   " + "".join(f"{g:>9g}" for g in gbps) + "    [bytes]")
    for degree in sorted({int(w["degree"]) for w in wins}):
        mine = {w["gbps"]: w for w in wins if w["degree"] == degree}
        side = pt.grid_side(degree)
        bytes_gain = next(iter(mine.values()))["bytes_gain"]
        gains = "".join(f"{100 * mine[g]['time_gain']:>+8.0f}%" for g in gbps)
        moved = _gain(1 + bytes_gain, 1.0, "fewer", "more")
        lines.append(f"{degree:>6}  {side}x{side:<4}{gains}    [{moved}]")
    return "\n".join(lines)


def _gain(one: float, two: float, good: str = "faster", bad: str = "slower") -> str:
    """Block (`two`) against row/column (`one`): 'block 1.52x faster' or 'block 1.10x slower'."""
    if two <= one:
        return f"block {one / two:.2f}x {good}" if two > 0 else f"block {good}"
    return f"block {two / one:.2f}x {bad}"


def _main() -> int:
    return run(sys.argv[1:])


main = cli_main(_main)

if __name__ == "__main__":
    main()
