"""`ntp-plan`: print the planner's per-layer table and the overrides that apply it to `ntp-train`.

Takes Hydra-style overrides of `conf/sim/plan.yaml`, whose keys mirror the training config:
    ntp-plan model=llama3_8b hardware=h100 mesh.tp=8 mesh.pp=1 ntp.replica_tp=[8,8,7] memory_limit_gb=80
or plans for a training run's own model, mesh and data (its `.hydra/config.yaml`), or for a model of the
training config group (`conf/model/NAME.yaml`, e.g. gpt_tiny):
    ntp-plan run=outputs/gpt_tiny/2026-01-01_00-00-00 hardware=h100
    ntp-plan model=gpt_tiny mesh.tp=2 ntp.replica_tp=[2,1]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ntp_nemo.config.paths import conf_dir
from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.planner.plan import Plan, plan_layout
from ntp_nemo.planner.shapes import DeviceModel, LinkModel, ModelShape

CONFIG_DIR = conf_dir() / "sim"
USAGE = (
    __doc__
    + "\nOther keys: mesh.dp, data.seq_len, data.micro_batch_size, recompute=true|false,\n"
    + "distributed_optimizer=true|false, format=json.\n"
)


def load_config(overrides: Sequence[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name="plan", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError("overrides", str(err)) from err
    finally:
        GlobalHydra.instance().clear()


def training_overrides(argv: Sequence[str]) -> tuple[list[str], DictConfig | None]:
    """Split off `run=RUN_DIR` / `model=NAME` of a training model: (plan overrides, training model).

    A run's mesh, replica_tp and data shape become defaults the other overrides can still change."""
    rest, model, pre = [], None, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "run":
            record = Path(value).expanduser() / ".hydra" / "config.yaml"
            if not record.is_file():
                raise ConfigError("run", f"{value!r} is not a training run directory (no .hydra/config.yaml)")
            run = OmegaConf.load(record)
            model = run.model
            rtp = run.ntp.get("replica_tp")
            pre += [f"mesh.tp={run.mesh.tp}", f"mesh.pp={run.mesh.pp}", f"mesh.dp={run.mesh.dp}",
                    f"ntp.replica_tp={list(rtp) if rtp is not None else 'null'}",
                    f"data.seq_len={run.data.seq_len}", f"data.micro_batch_size={run.data.micro_batch_size}"]
        elif key == "model" and not (CONFIG_DIR / "model" / f"{value}.yaml").is_file():
            path = conf_dir() / "model" / f"{value}.yaml"
            if not path.is_file():
                known = sorted(p.stem for p in (*(CONFIG_DIR / "model").glob("*.yaml"),
                                                *(conf_dir() / "model").glob("*.yaml")))
                raise ConfigError("model", f"unknown model {value!r}; use one of {known}.")
            model = OmegaConf.load(path)
            pre.append(f"data.seq_len={model.max_seq_len}")
        else:
            rest.append(arg)
    return pre + rest, model


def _with_defaults(model: DictConfig) -> DictConfig:
    """A training model config with the schema's defaults for the keys its YAML leaves out."""
    import dataclasses

    from ntp_nemo.models.config import ModelConfig

    fields = dataclasses.fields(ModelConfig)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    return OmegaConf.merge(OmegaConf.create(defaults), model)


def plan_from_config(cfg: DictConfig, train_model: DictConfig | None = None) -> Plan:
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    if train_model is None:
        model = ModelShape.from_dict(raw["model"])
    else:
        model = ModelShape.of_model_config(_with_defaults(train_model))
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
    return plan_layout(
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
    )


def run(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    unknown = [a for a in argv if a.startswith("-")]
    if unknown:
        raise ConfigError("argv", f"unknown option(s) {unknown}; pass settings as key=value overrides.")
    argv, train_model = training_overrides(argv)
    cfg = load_config(argv)
    fmt = cfg.get("format", "table")
    if fmt not in ("table", "json"):
        raise ConfigError("format", f"{fmt!r}; use table or json.")
    plan = plan_from_config(cfg, train_model)
    if fmt == "json":
        print(
            json.dumps(
                {
                    "layer_tp": plan.layer_tp,
                    "batch_shares": plan.batch_shares,
                    "overrides": plan.overrides(),
                    "microbatch_time_s": plan.microbatch_time_s,
                    "memory_gb": plan.memory_gb,
                }
            )
        )
        return 0
    m = cfg.model if train_model is None else train_model
    print(
        f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, seq {cfg.data.seq_len}, micro-batch "
        f"{cfg.data.micro_batch_size}; {cfg.hardware.device.name}, tp={plan.tp}, pp={cfg.mesh.pp}, "
        f"replica_tp={plan.replica_tp}, memory limit {cfg.memory_limit_gb} GB"
    )
    print(
        "(per micro-batch, forward+backward, busiest rank of the smallest replica; "
        "mem excludes in-flight copies)"
    )
    print(plan.format_table())
    print("\nreplica  ranks  period ms  share   mem GB")
    for r, (n, t, w, mem) in enumerate(
        zip(plan.replica_tp, plan.microbatch_time_s, plan.batch_shares, plan.memory_gb, strict=True)
    ):
        print(f"{r:>7} {n:>6} {t * 1e3:>10.3f} {w:>6.3f} {mem:>8.2f}")
    print(f"\ntime per micro-batch of the global batch: {plan.time_per_microbatch_s * 1e3:.3f} ms")
    print("overrides: " + " ".join(plan.overrides()))
    return 0


def _main() -> int:
    return run(sys.argv[1:])


main = cli_main(_main)

if __name__ == "__main__":
    main()
