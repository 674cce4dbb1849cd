"""Validation pass run before anything is launched.

Every impossible or inconsistent value raises `ConfigError(key, message)`: one paragraph naming the
key, the value and the fix.  The CLI turns it into exit code 2 with no traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ntp_nemo.config.memory_keys import validate_memory_options
from ntp_nemo.config.quant_keys import validate_quant
from ntp_nemo.errors import ConfigError
from ntp_nemo.models import families
from ntp_nemo.runtime.compile import validate_compile

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true")  # 16-mixed: refused below
DEFAULT_MODEL_TARGET = "ntp_nemo.models.build_model"
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


def _positive(cfg: DictConfig, key: str) -> None:
    value = cfg
    for part in key.split("."):
        value = value[part]
    if value is None or int(value) < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}. Set {key}=<n> with n >= 1.")


def resolved_replica_tp(cfg: DictConfig) -> list[int]:
    rtp = cfg.ntp.replica_tp
    return [int(cfg.mesh.tp)] * int(cfg.mesh.dp) if rtp is None else [int(x) for x in rtp]


def validate_model(m: DictConfig) -> None:
    target = m.get("_target_", DEFAULT_MODEL_TARGET)
    if target != DEFAULT_MODEL_TARGET:
        raise ConfigError(
            "model._target_",
            f"{target!r} is not supported: every rank builds its own slice of the NTP decoder "
            f"({DEFAULT_MODEL_TARGET}), so a custom model class cannot be sharded. Drop the key (or set "
            f"model._target_={DEFAULT_MODEL_TARGET}) and choose the architecture with {families.choices()}.",
        )
    fam = families.family_of(m)
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "max_seq_len"):
        if m[key] is None or int(m[key]) < 1:
            raise ConfigError(f"model.{key}", f"must be a positive integer, got {m[key]!r}.")
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            "model.num_heads",
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_heads={m.num_heads}; choose a head count that divides the hidden size.",
        )
    kv = m.num_kv_heads or m.num_heads
    if kv < 1 or m.num_heads % kv:
        raise ConfigError(
            "model.num_kv_heads",
            f"model.num_heads={m.num_heads} must be a multiple of "
            f"model.num_kv_heads={m.num_kv_heads} (grouped-query attention); use a divisor of it.",
        )
    fam.validate(m)


def resolve_init_from(cfg: DictConfig) -> dict[str, Any]:
    """With `model.init_from`, the architecture comes from the Hugging Face `config.json`: returns the
    model's keys as it gives them ({"model.KEY": value}; {} without `init_from`), which `resolve` sets
    before the checks so that every check sees the imported model's values; `cfg` is not changed."""
    if OmegaConf.is_missing(cfg.model, "init_from") or cfg.model.get("init_from") is None:
        return {}  # (a missing one is validate's to report)
    import dataclasses

    from ntp_nemo.config.model import model_config

    resolved = model_config(cfg.model)  # a directory without a usable config.json: answered before torch
    from ntp_nemo.hf.safetensors_files import HFWeightsReader

    with HFWeightsReader(str(cfg.model.init_from)) as weights:
        weights.check_headers()  # a crafted header: exit 2 naming the file, before any worker starts
    return {f"model.{k}": v for k, v in dataclasses.asdict(resolved).items() if k != "_target_"}


def validate(cfg: DictConfig) -> None:
    if OmegaConf.is_missing(cfg.model, "init_from"):
        raise ConfigError(
            "model.init_from",
            "this recipe continues from a Hugging Face model directory; pass "
            "model.init_from=PATH (a directory with config.json and *.safetensors).",
        )
    validate_model(cfg.model)
    validate_quant(cfg)
    validate_memory_options(cfg)
    validate_compile(cfg)
    for key in (
        "mesh.dp",
        "mesh.tp",
        "mesh.pp",
        "trainer.max_steps",
        "data.seq_len",
        "data.global_batch_size",
        "data.micro_batch_size",
    ):
        _positive(cfg, key)
    d = cfg.data
    if d.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            "data.seq_len",
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len="
            f"{cfg.model.max_seq_len}; lower data.seq_len or raise model.max_seq_len.",
        )
    if d.global_batch_size % d.micro_batch_size:
        raise ConfigError(
            "data.global_batch_size",
            f"data.global_batch_size={d.global_batch_size} is not a "
            f"multiple of data.micro_batch_size={d.micro_batch_size}; the global batch must split into "
            "whole micro-batches.",
        )
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError("data.val_fraction", f"must be in (0, 0.5), got {d.val_fraction}.")
    if d.path not in (None, "") and not Path(str(d.path)).expanduser().exists():
        raise ConfigError(
            "data.path",
            f"{d.path!r} does not exist. Point data.path at a text file, a directory of "
            "text files or a token file written by ntp-preprocess, or drop it to use the embedded corpus.",
        )
    _validate_mesh(cfg)
    from ntp_nemo.config.pattern_keys import validate_pattern

    validate_pattern(cfg, resolve_layer_tp)
    o = cfg.optim
    if not o.lr > 0:
        raise ConfigError("optim.lr", f"learning rate must be > 0, got {o.lr}.")
    if o.warmup_steps < 0 or o.warmup_steps > cfg.trainer.max_steps:
        raise ConfigError(
            "optim.warmup_steps",
            f"optim.warmup_steps={o.warmup_steps} must be >= 0 and at most "
            f"trainer.max_steps={cfg.trainer.max_steps}.",
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}.")
    if o.grad_clip is not None and o.grad_clip < 0:
        raise ConfigError("optim.grad_clip", f"must be >= 0 (0 disables clipping), got {o.grad_clip}.")
    t = cfg.trainer
    if t.precision not in PRECISIONS:
        raise ConfigError(
            "trainer.precision", f"unknown precision {t.precision!r}; use one of {', '.join(PRECISIONS)}."
        )
    if t.precision == "16-mixed":
        raise ConfigError(
            "trainer.precision",
            "16-mixed (float16 with a loss scaler) is not supported: the NTP gradient sync and clipping "
            "run on the scaled gradients, and the scaler's overflow check is not agreed across ranks. "
            "Use trainer.precision=bf16-mixed (bfloat16 compute, float32 weights and optimizer state; "
            "no loss scaling needed), or 32-true.",
        )
    if t.accelerator not in ACCELERATORS:
        raise ConfigError("trainer.accelerator", f"unknown accelerator {t.accelerator!r}; use cpu or gpu.")
    if t.start_method not in ("fork", "spawn", "forkserver"):
        raise ConfigError(
            "trainer.start_method", f"unknown start method {t.start_method!r}; use fork or spawn."
        )
    c = cfg.checkpoint
    if c.every_n_steps < 0:
        raise ConfigError(
            "checkpoint.every_n_steps", f"must be >= 0 (0 disables periodic saves), got {c.every_n_steps}."
        )
    if c.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", f"must be >= 1, got {c.keep_last}.")
    for name, cb in (cfg.callbacks or {}).items():
        if cb is not None and str(cb.get("_target_", "")).endswith("LearningRateMonitor") and not cfg.logger:
            raise ConfigError(
                f"callbacks.{name}",
                "LearningRateMonitor needs a logger but logger=none; choose "
                "logger=csv (or tensorboard), or drop the callback with callbacks=none.",
            )
    r = str(cfg.resume)
    if r not in ("auto", "never") and not Path(r).expanduser().exists():
        raise ConfigError(
            "resume",
            f"{r!r} is neither auto, never nor an existing checkpoint path. Use resume=auto "
            "(latest checkpoint in the run directory), resume=never, or resume=PATH of a checkpoint.",
        )


def check_environment(cfg: DictConfig) -> None:
    """Checks against this machine (not the config's consistency): run just before launching."""
    from ntp_nemo.launch.node_layout import check_not_batch_of_several_nodes

    check_not_batch_of_several_nodes()  # sbatch without srun: one node's ranks only
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        from ntp_nemo.launch.devices import cuda_available  # no CUDA context in the launching parent

        if not cuda_available():
            raise ConfigError(
                "trainer.accelerator",
                f"recipe {cfg.recipe!r} asks for GPUs but CUDA is not available "
                "on this machine; run it on a GPU node (torchrun/SLURM) or override "
                "trainer=default (CPU, 32-true) here.",
            )


def _validate_mesh(cfg: DictConfig) -> None:
    tp, dp = int(cfg.mesh.tp), int(cfg.mesh.dp)
    m = cfg.model
    rtp = cfg.ntp.replica_tp
    if rtp is not None:
        if len(rtp) != dp:
            raise ConfigError(
                "ntp.replica_tp",
                f"has {len(rtp)} entries {list(rtp)} but mesh.dp={dp}; give one "
                "active TP degree per DP replica, e.g. ntp.replica_tp=[" + ",".join([str(tp)] * dp) + "], "
                "or ntp.replica_tp=null (every replica at mesh.tp).",
            )
        for i, n in enumerate(rtp):
            if not 1 <= int(n) <= tp:
                raise ConfigError(
                    "ntp.replica_tp",
                    f"replica {i} has {n} active ranks; each entry must be between 1 and mesh.tp={tp}: "
                    f"e.g. ntp.replica_tp=[" + ",".join([str(tp)] * dp) + "], or ntp.replica_tp=null "
                    "(every replica at mesh.tp).",
                )
            if int(n) < int(cfg.ntp.min_replica_tp):
                raise ConfigError(
                    "ntp.replica_tp",
                    f"replica {i} has {n} active ranks, below ntp.min_replica_tp="
                    f"{cfg.ntp.min_replica_tp}; drop the replica (mesh.dp) or lower ntp.min_replica_tp.",
                )
    if tp > m.num_heads:
        raise ConfigError(
            "mesh.tp",
            f"mesh.tp={tp} exceeds model.num_heads={m.num_heads}: attention is sharded by "
            "heads, so use mesh.tp <= the head count.",
        )
    if tp > m.ffn_hidden_size or tp > m.vocab_size:
        raise ConfigError("mesh.tp", f"mesh.tp={tp} exceeds the MLP width or vocabulary size.")
    _validate_shard_align(cfg, tp)
    from ntp_nemo.topology.layout import CAPACITY_RULES

    capacity = cfg.ntp.get("capacity", "ranks")
    if capacity not in CAPACITY_RULES:
        raise ConfigError(
            "ntp.capacity",
            f"{capacity!r} is not a capacity rule; use ranks (active TP ranks / nominal) or work (the "
            "per-rank work model's slowest rank).",
        )
    from ntp_nemo.topology.layout import CPU_TP_BACKENDS

    cpu_tp = cfg.ntp.get("cpu_tp_backend", "ntpdirect")
    if cpu_tp not in CPU_TP_BACKENDS:
        raise ConfigError(
            "ntp.cpu_tp_backend",
            f"{cpu_tp!r} is not a backend for the TP groups of a CPU world; use ntpdirect (direct TCP "
            "connections, the default) or gloo.",
        )
    pb = cfg.ntp.power_boost
    if pb is not None:
        values = list(pb) if not isinstance(pb, (int, float)) else [pb]
        if not isinstance(pb, (int, float)) and len(values) != dp:
            raise ConfigError(
                "ntp.power_boost", f"needs one entry per replica (mesh.dp={dp}) or a single number."
            )
        for v in values:
            if not 1.0 <= float(v) <= 2.0:
                raise ConfigError(
                    "ntp.power_boost",
                    f"{v} is not a valid boost factor; use a value in [1.0, 2.0] "
                    "(1.3 = +30% per surviving GPU).",
                )
    from ntp_nemo.config.pipeline_keys import validate_pipeline

    validate_pipeline(cfg)
    resolve_layer_tp(cfg)  # raises on an impossible per-layer layout


def _validate_shard_align(cfg: DictConfig, tp: int) -> None:
    """`ntp.shard_align`: a whole number of elements, and small enough that every rank of the largest TP
    group still gets a block of MLP columns and of vocabulary rows."""
    align = cfg.ntp.get("shard_align", 1)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ConfigError(
            "ntp.shard_align",
            f"must be a whole number of elements >= 1, got {align!r}; use 1 (shards balanced to the row) "
            "or a multiple of 64 such as 128 on GPUs.",
        )
    m = cfg.model
    for key, units in (("model.ffn_hidden_size", m.ffn_hidden_size), ("model.vocab_size", m.vocab_size)):
        if align == 1 or units is None:
            continue
        blocks = -(-int(units) // align)
        if blocks < tp:
            raise ConfigError(
                "ntp.shard_align",
                f"ntp.shard_align={align} cuts {key}={units} into {blocks} blocks of {align}, fewer than "
                f"the {tp} ranks of a TP group (mesh.tp), so a rank would hold none. Lower ntp.shard_align "
                f"to at most {int(units) // tp}, or use mesh.tp <= {blocks}.",
            )


def resolve_layer_tp(cfg: DictConfig) -> list[int]:
    """Per-slot degrees (embedding, each layer, head), validated against the model and mesh."""
    from ntp_nemo.planner.layer_tp import parse_layer_tp, validate_layer_tp

    tp = int(cfg.mesh.tp)
    spec = cfg.layout.layer_tp
    m = cfg.model
    shape = families.model_shape(m)
    if spec == "auto":
        from ntp_nemo.planner import plan_layout

        pb = cfg.ntp.power_boost
        plan = plan_layout(
            shape, tp, resolved_replica_tp(cfg), cfg.data.seq_len, cfg.data.micro_batch_size,
            num_microbatches=int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size),
            power_boost=OmegaConf.to_container(pb) if OmegaConf.is_list(pb) else pb,
            sequence_parallel=bool(cfg.ntp.get("sequence_parallel", False)),
            capacity=str(cfg.ntp.get("capacity", "ranks")),
            shard_align=int(cfg.ntp.get("shard_align", 1)),
        )
        layer_tp = list(plan.layer_tp)
    else:
        layer_tp = parse_layer_tp(
            spec if spec is None or isinstance(spec, (str, int)) else list(spec), m.num_layers, tp
        )
    validate_layer_tp(shape, tp, resolved_replica_tp(cfg), layer_tp)
    return layer_tp
