"""Structured-config schemas: types and defaults of every config group.

Registered in Hydra's ConfigStore (see `register.py`) as the base of each group's YAML files, so
a typo'd key or a wrong type fails at composition time; `validate.py` then checks the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.quant.qat_config import QuantConfig
from ntp_nemo.sealed import Sealable

__all__ = ["ModelConfig", "RootConfig"]


@dataclass
class MeshConfig(Sealable):
    dp: int = 1  # DP replicas
    tp: int = 1  # nominal (healthy) TP degree
    pp: int = 1  # pipeline stages per replica


@dataclass
class NTPConfig(Sealable):
    replica_tp: list[int] | None = None  # active TP ranks per replica; None = all at mesh.tp
    power_boost: Any = None  # float or per-replica list; NTP-PW capacity multiplier of degraded replicas
    min_replica_tp: int = 1
    # Replicas the job was planned with: after replicas are dropped (failover), capacity is counted
    # against these. None = mesh.dp.
    nominal_replicas: int | None = None  # failover drops a replica below this many ranks
    grad_bucket_mb: float = 25.0
    # Launch each gradient bucket's DP sync from the backward as soon as its gradients are final.
    overlap_grad_sync: bool = False
    # Overlap each column-parallel layer's input-gradient TP collective with its weight gradients.
    tp_overlap: bool = False
    # Domino-style chunks: each micro-batch's layers run in this many chunks along the batch, each chunk's
    # row-parallel TP collective running while the next chunk computes (1: unchunked).
    tp_chunks: int = 1
    # Sequence parallelism: the TP-replicated regions (norms, dropout, residual adds) hold each TP rank's
    # slice of the sequence (uneven by one token where the degree does not divide data.seq_len).
    sequence_parallel: bool = False
    # Elements per block of MLP-column and vocabulary-row splits: shard boundaries on its multiples.
    shard_align: int = 1
    # Capacity rule of the batch split: ranks (active TP ranks / nominal) or work (the work model's
    # slowest-rank time of a healthy replica over this one's).
    capacity: str = "ranks"
    # A TP group spanning nodes stops the job at start-up; true: a warning instead (TP over the network).
    allow_cross_node_tp: bool = False
    # Backend of the TP groups of a CPU world: ntpdirect (direct TCP connections on the calling thread,
    # topology/direct_group.py) or gloo. GPU worlds use the device backend whatever this says.
    cpu_tp_backend: str = "ntpdirect"
    # Sharding pattern: row_column (Megatron rows and columns) or block (SUMMA on a q x q grid, degree q*q),
    # for every layout slot or a list of one per slot (config/pattern_keys.py).
    pattern: Any = "row_column"


@dataclass
class LayoutConfig(Sealable):
    layer_tp: Any = None  # None | int | list (embedding, each layer, head) | compact pattern string | "auto"
    stage_layers: list[int] | None = None  # explicit layers per pipeline stage
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    virtual_stages: int = 1  # model chunks per pipeline stage with schedule=interleaved_1f1b


@dataclass
class DataConfig(Sealable):
    path: str | None = None  # None = embedded corpus; text file/dir or pre-tokenised .bin
    # byte | bpe | tokenizer.json | HF dir; None = init_from's tokenizer.json, else the token file's own
    tokenizer: str | None = None
    eos_token: str | None = None  # a token of the tokenizer ending each document; None = the tokenizer's own
    blend: Any = None  # [[weight, path], ...] instead of path
    val_path: str | None = None  # held-out token file (instead of data.val_fraction of the documents)
    vocab_multiple: int = 1  # model vocabulary = tokenizer's rounded up to a multiple of this
    seq_len: int = 128
    global_batch_size: int = 16
    micro_batch_size: int = 4
    val_fraction: float = 0.05
    val_batches: int = 4


@dataclass
class OptimConfig(Sealable):
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    grad_clip: float = 1.0
    distributed: bool = False  # shard AdamW state across the holders of each gradient fragment


@dataclass
class TrainerConfig(Sealable):
    max_steps: int = 200
    stop_at_step: int | None = (
        None  # end this invocation early (checkpoint saved); schedules still use max_steps
    )
    precision: str = "32-true"  # 32-true | 64-true | bf16-mixed | bf16-true (16-mixed is refused)
    accelerator: str = "cpu"
    log_every_n_steps: int = 1
    val_every_n_steps: int = 50  # and after the last step, whatever max_steps is
    progress_bar: bool = True
    deterministic: bool = True  # torch.use_deterministic_algorithms (Lightning's Trainer(deterministic=...))
    # With deterministic algorithms on, torch also fills every new tensor's memory with NaN (or the
    # integer maximum) before use: a debugging aid for code that reads memory it never wrote, costing
    # 0-1.5% of a CPU step (docs/performance.md). Off unless asked for; determinism does
    # not depend on it.
    fill_uninitialized_memory: bool = False
    process_group_backend: str | None = None  # None: gloo on CPU, nccl on GPU
    start_method: str = "fork"
    # One step of every rank on the meta device and a fake process group (no GPU, no data): writes
    # dry_run.json (per-rank memory and communication) in the run directory and exits.
    dry_run: bool = False
    # Compile each transformer block with torch.compile (regional: the embedding, head and loss stay
    # eager); refused with ntp.sequence_parallel, ntp.tp_overlap, ntp.tp_chunks and QAT (runtime/compile.py).
    compile: bool = False


@dataclass
class CheckpointConfig(Sealable):
    every_n_steps: int = 50
    keep_last: int = 2
    save_on_end: bool = True
    async_save: bool = True  # training blocks only for the snapshot; write and commit in the background
    dir: str = "checkpoints"


@dataclass
class FaultSpec(Sealable):
    """One injected fault (see ntp_nemo.resilience.faults); unset step/rank are drawn from `seed`."""

    kind: str = "kill_rank"  # kill_rank | hang | slow | kill_during_save | corrupt_checkpoint
    rank: int | None = None  # global rank in the layout running at the time
    step: int | None = None
    seconds: float = 1.0  # slow: extra seconds per step
    steps: int | None = None  # slow: for this many steps (None: to the end)
    factor: float | None = None  # slow: speed factor in (0, 1) in place of `seconds` (0.5: half speed)
    phase: str = "step_start"  # kill_rank: step_start | backward | optimizer
    target: str = "param"  # bitflip: param | grad | activation
    bit: int | None = None  # bitflip: bit flipped (None: 22, the top fp32 mantissa bit; 30 grad/activation)
    persistent: bool = False  # bitflip: the same flip on every step from `step` on (a bad device)
    sample: int | None = None  # poison_sample: the training sample id (None: one of step `step`'s, drawn)


@dataclass
class FaultConfig(Sealable):
    kind: str = "none"  # none | kill_rank | hang | slow | kill_during_save | corrupt_checkpoint
    rank: int | None = None
    step: int | None = None
    seconds: float = 1.0  # slow: extra seconds per step
    steps: int | None = None  # slow: for this many steps (None: to the end)
    factor: float | None = None  # slow: speed factor in (0, 1) in place of `seconds` (0.5: half speed)
    phase: str = "step_start"  # kill_rank: step_start | backward | optimizer | ... | integrity (when it dies)
    target: str = "param"  # bitflip: param | grad | activation
    bit: int | None = None  # bitflip: bit flipped (None: 22, the top fp32 mantissa bit; 30 grad/activation)
    persistent: bool = False  # bitflip: the same flip on every step from `step` on (a bad device)
    sample: int | None = None  # poison_sample: the training sample id (None: one of step `step`'s, drawn)
    more: list[FaultSpec] = field(default_factory=list)  # further faults in the same run
    policy: str = "ntp"  # ntp | dp_drop | restart
    recovery: str = "auto"  # auto (live where it can work) | live (survivors reshard in memory) | restart
    repair_after_steps: int | None = None
    # Hot spares (live recovery under ntp-train): processes started with the job, initialised and waiting;
    # a replacement takes one instead of starting a process (resilience/spares.py, docs/failover.md)
    spares: int = 0
    max_restarts: int = 3
    # Timeout hierarchy (docs/failover.md): heartbeat < collective < whole step.
    heartbeat_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    step_timeout_s: float = 1800.0
    startup_timeout_s: float = 600.0  # a worker's start to its first training step (supervisor)
    # Stragglers (ntp_nemo.resilience.straggler): what to do with a rank measured persistently slower than
    # its share (report | rebalance | exclude), judged every `straggler_every` steps over that many steps
    # (0: no detection), when `straggler_margin` slower than the work model says for `straggler_persist`
    # judgements in a row; below `straggler_floor` speed, `rebalance` excludes the rank too.
    # `straggler_shards`: `rebalance` also weighs the shards inside the straggler's TP group by speed
    # (auto: in a one-replica job | on | off).
    straggler: str = "rebalance"
    straggler_every: int = 5
    straggler_margin: float = 0.4
    straggler_persist: int = 3
    straggler_floor: float = 0.2
    straggler_shards: str = "auto"


@dataclass
class IntegrityConfig(Sealable):
    """Silent-corruption checks (ntp_nemo.resilience.integrity): replicas' parameter fingerprints compared
    every `every_n_steps` steps (0: never), loss and gradient-norm spikes beyond `spike_zscore` standard
    deviations of the last `spike_window` steps (0: no spike detection), non-finite steps attributed."""

    every_n_steps: int = 50
    spike_zscore: float = 8.0
    spike_window: int = 20
    # Every step, each rank's own largest gradient element per parameter (before the DP sync) and largest
    # activation entering its layers ride on the step's fused all-reduce; a rank whose value is this many
    # times every other rank of its stage holds the step suspect: no update, replayed (0: off).
    outlier_ratio: float = 1000.0
    # Keep a copy of the parameters and optimizer state at each passed check, so a finding rolls back to
    # it and replays the steps since (memory: one more copy of the model and optimizer state per rank).
    keep_verified: bool = True
    skip_samples: list[int] = field(default_factory=list)  # training sample ids never used (bad data)


@dataclass
class DashboardConfig(Sealable):
    """`ntp-dashboard` beside the run (`ntp_nemo/dashboard/launch.py`): started by the launching process
    (never a worker) with the job, stopped when the job ends; its URL (with its token) is printed once."""

    port: int | None = None  # None: no dashboard; 0: any free port
    host: str = "127.0.0.1"  # loopback; another address serves the page beyond this machine


@dataclass
class SweepConfig(Sealable):
    """What a sweep (`ntp-train -m`) does when one of its jobs fails at run time (`ntp_nemo/sweep.py`)."""

    on_failure: str = "stop"  # stop: the later jobs do not run | continue: every job runs


@dataclass
class RootConfig(Sealable):
    recipe: str = "gpt_tiny"
    seed: int = 1234
    resume: str = "auto"  # auto | never | PATH
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    ntp: NTPConfig = field(default_factory=NTPConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
