"""Dry run of one training step for every rank of a layout, on the meta device and a fake process group.

Nothing is computed and nothing is sent: parameters, activations and gradients are meta tensors (shapes
and dtypes only) and the collectives go to torch's fake process-group backend, which accepts any call of
any rank without peers.  What runs is the real code: the `Topology` and all its process groups,
`RankPlace.build_model` (the rank's slice of every layer), `NTPRuntime.train_microbatches` (the
pipeline engine when `pp > 1`), the fragment gradient sync, the fused step-scalar all-reduce, the
clipping and an AdamW step.  So a layout of hundreds of ranks is checked on a laptop CPU, and the
per-rank numbers come from the tensors that code creates:

- `params`: elements of the rank's parameter slices; `param_bytes`, `grad_bytes`: bytes of the parameter
  and gradient tensors after the step; `optimizer_bytes`: bytes of the AdamW state tensors on the
  device (the two moments; the per-parameter step counters torch keeps on the host are left out).
- `activation_bytes`: bytes autograd saves for one micro-batch through the rank's stage (counted with
  `torch.autograd.graph.saved_tensors_hooks`, each storage once, parameters and buffers excluded; the
  stage output a pipeline stage keeps for its backward included); `activation_peak_bytes`: that times
  the most micro-batches the pipeline schedule keeps in flight on the stage.
- `comm_bytes`: payload bytes each kind of group carries for this rank in one step: `tp` (TP
  all-reduces of forward and backward), `pp` (activations and gradients sent and received between
  stages), `dp` (the gradient sync over fragment holder sets), `world` (the fused step scalars).
  Counted by a `TorchDispatchMode` that sees every `c10d` operation; it also refuses any collective
  given a tensor that is not on the runtime's device, so a host tensor slipping into the step fails the
  dry run (as NCCL would reject it on GPUs).

Speed: a rank's model slice depends only on its signature (active ranks of its replica, stage, slot),
so each signature's slice is built once (as its first rank, giving its parameter descriptors); the
forward and backward depend only on the slice's local shapes and TP group sizes, so they run once per
distinct shape class (llama3_8b on (8,...,8,7): 15 signatures, 6 classes), as the class's first rank,
which also runs its gradient sync, fused scalars, clipping and optimizer through the fake group.  Every
rank's sync plan comes from one pass over all ranks' descriptors (`build_sync_plans`), and every rank's
DP bytes and calls from its own plan (`plan_traffic`; checked against the bytes the sync actually sent
for each class's rank).  Forward/backward communication is measured for one micro-batch and multiplied
by the replica's micro-batch count (every micro-batch has the same shapes).  Where the layers of every
stage are alike (one degree for every layer, no interleaved chunks, recomputation of every layer or
none) and every stage holds more than 3, each class's step runs on two short builds of the layout (2
and 3 layers per stage, every rank's slice and sync plan on them) and each figure f is extended to a
stage of L layers as f(2) + (L - 2)(f(3) - f(2)): every added layer saves the same tensors, holds the
same parameters and sends the same collectives (`dry_run(scale_layers=False)` runs the whole stages;
the tests compare the two).  The option report measures its other settings the same way.  On meta, most
kernels are Python reference implementations: `MetaKernelCache` reuses the outputs of repeated
functional kernels and skips repeated in-place ones.

Mixed precision: autocast has no meta backend, so under `bf16-mixed` the forward and backward run on
a copy of the slice in bf16 while parameters, gradients and optimizer state stay in float32.  The TP
bytes counted on that copy are the bytes the mixed-precision step sends: autocast keeps the norms'
outputs in float32, but every TP region entry casts its input to the compute dtype before the wire
(`parallel.comm.to_compute_dtype`, as Megatron does), the vocabulary-parallel embedding sends its rows
in it, and the two float32 exchanges (the cross entropy's per-token statistics, SP's replicated-gradient
sums) are float32 on the copy too (`tests/runtime/test_step_speed_paths.py` compares the two on CPU with
real autocast).
Pipeline messages (the residual stream between stages) are sent in autocast's dtype too
(`pipeline.engine.wire_dtype`; `tests/parallel/test_wire_dtype.py`), as they are counted here.
`scaled_dot_product_attention` is sent to the fused kernel's meta implementation
(`flash_attention_on_meta`), which saves what the CPU and GPU kernels save.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.parallel.grad_sync import (
    SyncPlan,
    build_sync_plan,
    build_sync_plans,
    param_descriptors,
)
from ntp_nemo.runtime.assemble import RankState, assemble
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from ntp_nemo.topology.grid import grid_group_tuples
from ntp_nemo.topology.work import healthy_cost, rank_costs

COMM_KINDS = ("tp", "pp", "dp", "world")
META = torch.device("meta")


# ---- meters ----------------------------------------------------------------------------------------------
def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


class MetaKernelCache:
    """Outputs of functional meta-tensor kernels, by the metadata of their inputs.

    On the meta device most aten kernels are Python reference implementations (broadcasting, type
    promotion, stride computation), about a millisecond of CPU per call, and a model's layers repeat
    the same calls with the same shapes.  A meta kernel's output depends only on its inputs' shapes,
    strides, dtypes and the other arguments, so the second call with equal metadata allocates an empty
    tensor of the recorded layout instead (`torch.empty_strided`: a fresh storage of the same size, as
    the kernel's).  Only ops that neither mutate nor alias (no alias annotation in their schema), whose
    every output is a new dense tensor, are kept this way.

    In-place ops (`add_`, `copy_`, `lerp_`, ...: tagged `inplace`, writing only their first argument and
    returning it) change no metadata (`inplace_view` ops such as `transpose_` and the `resize` family are
    left out) and, on meta, no data: their kernel only checks the arguments.  A second call with the
    same metadata as one that passed returns the first argument without running it (the optimizer's
    update repeats the same few in-place kernels on every parameter of every layer).  Everything else
    runs as before."""

    FUNCTIONAL, INPLACE = 1, 2

    def __init__(self) -> None:
        self._outputs: dict[tuple, tuple | None] = {}
        self._kinds: dict[Any, int] = {}
        self.hits = 0

    @staticmethod
    def _add(key: list, x: Any) -> bool:
        """Append `x`'s part of the key; False when `x` cannot be keyed (the call then runs as is)."""
        if isinstance(x, torch.Tensor):
            if not x.is_meta or x.layout != torch.strided:
                return False
            key.append((x.shape, x.stride(), x.storage_offset(), x.dtype))
        elif isinstance(x, (list, tuple)):
            key.append(len(x))
            return all(MetaKernelCache._add(key, y) for y in x)
        elif x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                         torch.memory_format)):
            key.append((type(x), x))
        else:
            return False
        return True

    def _key(self, func, args, kwargs) -> tuple | None:
        key: list[Any] = [func, len(args)]
        add = self._add
        for a in args:
            if not add(key, a):
                return None
        for name, value in kwargs.items():
            key.append(name)
            if not add(key, value):
                return None
        return tuple(key)

    @classmethod
    def _classify(cls, func) -> int:
        """FUNCTIONAL, INPLACE or 0 (not cached)."""
        if func.namespace != "aten":
            return 0
        schema = func._schema
        args, rets = schema.arguments, schema.returns
        if (not schema.is_mutable and all(r.alias_info is None for r in rets)
                and all(a.alias_info is None for a in args)):
            return cls.FUNCTIONAL
        first = args[0].alias_info if args else None
        if (torch.Tag.inplace in func.tags and torch.Tag.inplace_view not in func.tags
                and "resize" not in func.__name__ and first is not None and first.is_write
                and len(rets) == 1 and rets[0].alias_info is not None
                and set(rets[0].alias_info.before_set) == set(first.before_set)
                and all(a.alias_info is None for a in args[1:])):
            return cls.INPLACE
        return 0

    def call(self, func, args, kwargs):
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = self._classify(func)
        if not kind:
            return func(*args, **kwargs)
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        layout = self._outputs.get(key, ())
        if layout:
            self.hits += 1
            if kind == self.INPLACE:
                return args[0]
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device=META)
                    for shape, stride, dtype in layout[1]]
            return outs[0] if layout[0] else tuple(outs)
        out = func(*args, **kwargs)
        if layout == () and kind == self.INPLACE:  # it passed its checks: equal metadata passes again
            self._outputs[key] = (True, None) if out is args[0] else None
        elif layout == ():  # first call: record the layout when every output is a new dense tensor
            single = isinstance(out, torch.Tensor)
            outs = [out] if single else out
            keep = isinstance(outs, (tuple, list)) and all(
                isinstance(t, torch.Tensor) and t.device.type == "meta" and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == _strided_nbytes(t) for t in outs)
            outputs = [(tuple(t.shape), t.stride(), t.dtype) for t in outs] if keep else None
            self._outputs[key] = (single, outputs) if keep else None
        return out


def _strided_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage `torch.empty_strided` allocates for `t`'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


class CommMeter(TorchDispatchMode):
    """Counts the payload bytes of every `c10d` operation under the current `kind` label, and refuses a
    collective that receives a tensor from another device than `device`.  With `cache`, other meta
    kernels go through it (`MetaKernelCache`)."""

    def __init__(self, device: torch.device, cache: MetaKernelCache | None = None) -> None:
        super().__init__()
        self.device = device
        self.cache = cache
        self.kind = "tp"
        self.bytes: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self.calls: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self.groups: dict[str, set[tuple[int, ...]]] = {k: set() for k in COMM_KINDS}
        # (kind, collective) -> [calls, payload bytes, ring-model bytes on the rank's link]
        self.ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled in a dry run: torch would otherwise wrap every dispatch in dynamo's
        # `disable` (a frame-evaluation switch per aten call).
        return False

    @contextmanager
    def labelled(self, kind: str):
        previous, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            tensors = list(_tensors(args[0])) if args else []
            for t in tensors:
                if t.device != self.device:
                    raise RuntimeError(
                        f"{func.__name__} received a tensor on {t.device} but the runtime's device is "
                        f"{self.device}: every tensor of the training step must live on the runtime's "
                        "device (a collective on a GPU process group cannot take a host tensor)."
                    )
            name = func.__name__.split(".")[0]
            kind = "pp" if name in ("send", "recv_") else self.kind
            op = _collective(name)
            if op in ("all_gather", "reduce_scatter"):  # (output, input, ...): the payload is the input
                tensors = list(_tensors(args[1]))
            payload = sum(t.numel() * t.element_size() for t in tensors)
            self.bytes[kind] += payload
            self.calls[kind] += 1
            pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            ranks: tuple[int, ...] = ()
            if pg is not None:
                try:
                    ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg)))
                except (AttributeError, RuntimeError, ValueError):
                    ranks = ()
                self.groups[kind].add(ranks)
            rec = self.ops[(kind, op)]
            rec[0] += 1
            rec[1] += payload
            rec[2] += _ring_bytes(op, payload, len(ranks) or 1)
        elif self.cache is not None:
            return self.cache.call(func, args, kwargs)
        return func(*args, **kwargs)


def _collective(name: str) -> str:
    """c10d op name -> all_reduce | all_gather | reduce_scatter | send | recv | other name."""
    for key, op in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                    ("reduce_scatter", "reduce_scatter"), ("send", "send"), ("recv", "recv")):
        if key in name:
            return op
    return name


def _ring_bytes(op: str, payload: int, n: int) -> float:
    """Bytes on a rank's link in a ring algorithm: an all-reduce of B sends 2(n-1)/n B, a reduce-scatter
    of B (n-1)/n B, an all-gather of a B-byte piece (n-1) B, so AG + RS of a split tensor = one AR."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op == "reduce_scatter":
        return (n - 1) / n * payload
    if op == "all_gather":
        return (n - 1) * payload
    return float(payload)


@contextmanager
def flash_attention_on_meta():
    """On meta tensors `scaled_dot_product_attention` has no fused kernel and decomposes into the math
    path, which saves the full score matrix; on CPU and GPU the fused (flash) kernel runs and saves only
    its output and log-sum-exp.  While active, meta calls go to the fused kernel's meta implementation,
    so the dry run saves what a real step saves.  It replaces the function in `torch.nn.functional` (a
    torch-function mode would not reach the recomputation that activation checkpointing runs in the
    backward) and restores it on exit; other devices and masked calls go to the original."""
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if q.device.type == "meta" and attn_mask is None and set(kwargs) <= {"enable_gqa"}:
            # The fused kernel reads grouped K/V heads as they are (what `enable_gqa` asks for).
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, scale=scale
            )[0]
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class ActivationMeter:
    """Bytes autograd saves for backward while active (each storage once, `exclude`d tensors left out)."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        self._seen: set[StorageWeakRef] = set()
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self._exclude or ref in self._seen:
            return
        self._seen.add(ref)
        self.bytes += t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


# ---- inputs and results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """What one training step looks like, independent of the data (which the dry run never reads)."""

    seq_len: int
    micro_batch_size: int
    param_dtype: torch.dtype = torch.float32  # dtype of parameters, gradients and optimizer state
    compute_dtype: torch.dtype = torch.float32  # dtype of activations (bf16 under bf16-mixed)
    grad_clip: float = 1.0
    bucket_mb: float = 25.0
    seed: int = 0
    tp_chunks: int = 1  # `ntp.tp_chunks`: the layers' collectives per chunk of a micro-batch


@dataclass
class RankResult:
    rank: int
    replica: int
    stage: int
    slot: int
    tp_degree: int  # active TP ranks of the replica
    layer_degrees: list[int]  # distinct effective degrees of the slots this stage holds
    microbatches: int  # micro-batches of the replica in one step
    params: int
    sharded_params: int  # elements of parameters split across the TP group
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # per micro-batch
    activation_peak_bytes: int  # times the micro-batches in flight on this stage
    comm_bytes: dict[str, int]
    comm_calls: dict[str, int]
    comm_groups: dict[str, int]  # distinct process groups of each kind this rank used
    signature: tuple[int, int, int]
    # Modelled time per token of this rank over a healthy rank's (`ntp_nemo.topology.work`; None when the
    # layout carries no model shape).
    modelled_work: float | None = None
    # Peers over all subgroups this rank belongs to (TP groups, holder sets, pipeline links): the
    # sockets gloo would open for them (`ntp_nemo.topology.groups.gloo_sockets`).
    subgroup_peers: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_peak_bytes


@dataclass
class DryRunResult:
    ranks: list[RankResult]
    model_params: int  # the unsharded model, built on meta
    signatures: int  # distinct rank signatures (model slices built)
    timings: dict[str, float] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # memory-saving options (see `option_savings`)
    splits: dict[str, int] = field(default_factory=dict)  # world-wide communicator splits before step 1


# ---- the dry run ----------------------------------------------------------------------------------------
def link_group_lists(topology: Topology, schedule: str) -> list[list[int]]:
    """The rank lists of the pipeline's link groups, each created twice (activations, gradients): one
    per stage pair of each replica (`StageLinks`), plus the two-rank wrap links of the interleaved
    schedule."""
    if topology.pp <= 1:
        return []
    from ntp_nemo.pipeline.p2p import link_groups

    groups = link_groups(topology)
    if schedule == "interleaved_1f1b":
        for rep in range(topology.dp):
            first = topology.stage_ranks(rep, 0)
            last = topology.stage_ranks(rep, topology.pp - 1)
            groups += [[a, first[i % len(first)]] for i, a in enumerate(last)]
    return groups


def subgroup_peers(topology: Topology, plans: Sequence[SyncPlan], schedule: str,
                   patterns: Sequence[str] = ()) -> list[int]:
    """Per rank, the peers it has over every subgroup the runtime creates and it belongs to: its TP
    groups, block grids' rows and columns (`patterns`) and fragment holder sets (one group per distinct
    rank tuple, as `Topology.build_groups`), and the pipeline's link groups (`link_group_lists`, two of
    each)."""
    world = topology.world_size
    member: list[set[tuple[int, ...]]] = [set() for _ in range(world)]
    for g in [*topology.tp_group_tuples(), *grid_group_tuples(topology, patterns)]:
        for r in g:
            member[r].add(g)
    peers = [0] * world
    for r in range(world):
        member[r].update(h for h, frags in plans[r].by_holders.items() if frags and len(h) > 1)
        peers[r] = sum(len(g) - 1 for g in member[r])
    for g in link_group_lists(topology, schedule):
        for r in g:
            peers[r] += 2 * (len(g) - 1)
    return peers


def communicator_splits(topology: Topology, plans: Sequence[SyncPlan], schedule: str,
                        checkpoint_group: bool, patterns: Sequence[str] = ()) -> dict[str, int]:
    """World-wide communicator splits before step 1, by kind: every `new_group` is collective over the
    world (and with `device_id` bound a world-wide `ncclCommSplit`).  The world group itself, the TP
    groups, the rows and columns of block grids (`patterns`, `topology.grid`) that are not TP groups, the
    fragment holder sets that are neither, the pipeline's link groups and the checkpoint writer's group
    (created before step 1 when saves are asynchronous)."""
    tp = set(topology.tp_group_tuples())
    grid = set(grid_group_tuples(topology, patterns)) - tp
    holders = {tuple(h) for p in plans[:1] for h in p.all_holder_sets if len(h) > 1} - tp - grid
    out = {"world": 1 if topology.world_size > 1 else 0, "tp": len(tp), "grid": len(grid),
           "holder_sets": len(holders),
           "pipeline_links": 2 * len(link_group_lists(topology, schedule)),
           "checkpoint_writer": int(checkpoint_group and topology.world_size > 1)}
    out["total"] = sum(out.values())
    return out


def signature(topology: Topology, rank: int) -> tuple[int, int, int]:
    """(active ranks of the replica, stage, slot): ranks with equal signatures hold equal model slices."""
    c = topology.coord(rank)
    return (topology.replica_tp[c.replica], c.stage, c.slot)


def unsharded_param_count(cfg: ModelConfig) -> int:
    """Parameters of the whole model, counted on a meta-device build of the unsharded `DecoderLM`."""
    from ntp_nemo.models import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(cfg)
    return sum(p.numel() for p in model.parameters())


@contextmanager
def fake_world(rank: int, world_size: int):
    """The default process group as `rank` of `world_size` on torch's fake backend (no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state_exclusions(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and the cached rotary tables: long-lived, not activations."""
    p = next(model.parameters())
    if getattr(model, "uses_rope", False):
        model._rope(torch.empty(0, dtype=p.dtype, device=p.device))  # the engine builds them up front too
    rope = [t for pair in getattr(model, "_rope_cache", {}).values() for t in pair]
    return list(model.parameters()) + list(model.buffers()) + rope


class _EngineMeter:
    """Stands in for `PipelineEngine.meter` during the dry run: the engine's own meter keys storages by
    address, which is 0 for every meta tensor; this one passes the stage outputs the engine keeps to the
    dry run's `ActivationMeter` and leaves the saved tensors to its hooks."""

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter

    def exclude(self, tensors) -> None:
        pass

    def recording(self, microbatch: int):
        return nullcontext()

    def add(self, microbatch: int, t: torch.Tensor) -> None:
        self.meter.add(t)

    def release(self, microbatch: int) -> None:
        pass


# The optimizer's hyperparameters change no memory: the dry run assembles its ranks with these.
_DRY_OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def _assemble(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape, plan: SyncPlan,
              distributed: bool = False) -> RankState:
    """The rank's state as a run assembles it (`runtime.assemble`), on meta, with its sync plan computed
    up front (`build_sync_plans`)."""
    return assemble(layout, rank, cfg, {**_DRY_OPTIM, "distributed": distributed}, META, seed=shape.seed,
                    bucket_mb=shape.bucket_mb, param_dtype=shape.param_dtype, sync_plan=plan,
                    tp_chunks=shape.tp_chunks)


def plan_traffic(plan: SyncPlan, descriptors: dict[str, tuple], element_size: int,
                 bucket_bytes: int) -> tuple[int, int]:
    """(payload bytes, all-reduce calls) `GradientSynchronizer.sync` sends for `plan`, from the shapes
    alone: the same buckets, filled in the same order.  The dry run checks it against the bytes the
    sync sends through the fake process group for one rank of every slice class."""
    total = calls = 0
    for holders in plan.all_holder_sets:
        size = 0
        for f in plan.by_holders.get(holders, ()):
            shape, dim = descriptors[f.name][0], descriptors[f.name][1]
            per_unit = 1
            for d, n in enumerate(shape):
                per_unit *= f.length if d == dim else n
            size += per_unit * element_size
            total += per_unit * element_size
            if size >= bucket_bytes:
                calls, size = calls + 1, 0
        calls += 1 if size else 0
    return total, calls


@dataclass
class _Slice:
    """One rank signature's model slice (built in the first pass, as its first rank)."""

    descriptors: dict[str, tuple]
    params: int
    sharded_params: int
    param_bytes: int
    key: tuple  # local shapes, dtypes and TP sizes: slices with equal keys run identical steps


@dataclass
class _ClassStep:
    """What one training step measured on the first rank of a slice class, shared by the class."""

    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    per_microbatch: dict[str, int]  # tp/pp comm bytes of one micro-batch
    per_microbatch_calls: dict[str, int]
    groups: dict[str, int]
    world_bytes: int
    world_calls: int
    new_groups: int  # `new_group` calls of the rank's assembly (every rank makes the same ones)
    # TP collectives of one micro-batch: {op: [calls, payload bytes, ring-model bytes]}
    tp_raw: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tp_ops(self) -> dict[str, dict[str, float]]:
        return _ops_figures(self.tp_raw)


def _slice_key(model: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.ntp_spec.is_full) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape)) for n, b in model.named_buffers())
    tps = tuple(sorted({(m.tp.size, m.tp.copies) for m in model.modules() if hasattr(m, "tp")}))
    return params, buffers, tps


def _build_slice(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape) -> _Slice:
    place = RankPlace(layout, rank, device=META)
    model = place.build_model(cfg, shape.seed, shape.param_dtype)
    params = list(model.parameters())
    return _Slice(
        descriptors=param_descriptors(model),
        params=sum(p.numel() for p in params),
        sharded_params=sum(p.numel() for p in params if not p.ntp_spec.is_full),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        key=(place.coord.stage, _slice_key(model)),
    )


def _class_step(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape, plan: SyncPlan,
                descriptors: dict[str, tuple], global_tokens: int, grad_norm: bool = True,
                cache: MetaKernelCache | None = None) -> _ClassStep:
    """Inside a fake world as `rank`: one training step through `train_step` (the step of a run): one
    micro-batch's forward and backward (the pipeline engine when pp > 1) with its saved tensors and
    communication counted, the gradient sync of the rank's own plan, the fused step scalars, the
    clipping and an AdamW step.  `grad_norm=False` hands the fused scalars a zero squared norm instead
    of the per-fragment norm (no figure comes from it; the dry run runs it for its first class)."""
    from ntp_nemo.runtime.step import train_step
    from ntp_nemo.topology.groups import counting_new_groups

    with counting_new_groups() as new_groups:
        state = _assemble(layout, rank, cfg, shape, plan)
    runtime, model, sync = state.runtime, state.model, state.grad_path.sync
    if param_descriptors(model) != descriptors:
        raise RuntimeError(f"rank {rank}: its model slice differs between two builds")
    # Autocast has no meta backend: under mixed precision the forward and backward run on a copy of
    # the slice in the compute dtype (activations and TP/PP messages in that dtype, as under autocast).
    mixed = shape.compute_dtype != shape.param_dtype
    step_model = runtime.build_model(cfg, shape.seed, shape.compute_dtype) if mixed else model
    if mixed and hasattr(step_model, "tp_chunks"):
        step_model.tp_chunks = shape.tp_chunks  # as `assemble` set it on the slice
    meter = ActivationMeter(_state_exclusions(step_model))
    step_runtime = runtime.for_model(step_model) if mixed else runtime
    if step_runtime.pipeline is not None:
        step_runtime.pipeline.meter = _EngineMeter(meter)
    tokens = torch.zeros((shape.micro_batch_size, shape.seq_len + 1), dtype=torch.long, device=META)
    comm = CommMeter(META, cache)
    counted: dict[str, dict[str, int]] = {}

    @contextmanager
    def microbatches():
        with meter.recording(), flash_attention_on_meta():
            yield
        counted["bytes"] = {k: comm.bytes[k] for k in ("tp", "pp")}
        counted["calls"] = {k: comm.calls[k] for k in ("tp", "pp")}
        counted["groups"] = {k: len(comm.groups[k]) for k in ("tp", "pp")}
        if mixed:
            for p in model.parameters():  # autocast's gradients: in the parameters' dtype
                p.grad = torch.zeros_like(p)

    def phase(name: str):
        if name == "microbatches":
            return microbatches()
        if name == "optimizer":  # plain AdamW: no collective (its meta kernels go through the cache)
            return nullcontext()
        return comm.labelled({"grad_sync": "dp", "scalars": "world"}[name])

    opt = state.optimizer
    if isinstance(opt, torch.optim.AdamW):
        # The per-tensor step: the same state as the multi-tensor one, and its in-place kernels repeat
        # on equal shapes (the cache skips them); on meta the multi-tensor kernels are Python loops.
        for group in opt.param_groups:
            group["foreach"] = False
    with comm:
        train_step(dataclasses.replace(state, model=step_model, runtime=step_runtime), [tokens],
                   global_tokens, max_norm=shape.grad_clip, phase=phase, grad_norm=grad_norm,
                   read_scalars=False)
    per_mb, per_mb_calls, groups = counted["bytes"], counted["calls"], counted["groups"]
    element = next(model.parameters()).element_size()
    expected = plan_traffic(plan, descriptors, element, sync.bucket_bytes)
    if expected != (comm.bytes["dp"], comm.calls["dp"]):
        raise RuntimeError(f"rank {rank}: gradient sync sent {comm.bytes['dp']} bytes in {comm.calls['dp']} "
                           f"calls, its plan gives {expected}")
    return _ClassStep(
        # one gradient per parameter, in its shape and dtype (set to None after the step: GradientPath)
        grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        optimizer_bytes=sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.device == META
        ),
        activation_bytes=meter.bytes,
        per_microbatch=per_mb,
        per_microbatch_calls=per_mb_calls,
        groups=groups,
        world_bytes=comm.bytes["world"],
        world_calls=comm.calls["world"],
        new_groups=len(new_groups),
        tp_raw={op: list(v) for (kind, op), v in comm.ops.items() if kind == "tp"},
    )


def _saved_bytes(place: RankPlace, cfg: ModelConfig, shape: StepShape, global_tokens: int,
                 comm: CommMeter | None = None, cache: MetaKernelCache | None = None) -> int:
    """Activation bytes of one micro-batch of `place`'s slice built from `cfg` (a fresh model, through its
    pipeline engine when pp > 1); `comm` (optional) counts its collectives."""
    model = place.build_model(cfg, shape.seed, shape.compute_dtype)
    meter = ActivationMeter(_state_exclusions(model))
    engine = place.pipeline_for(model)
    if engine is not None:
        engine.meter = _EngineMeter(meter)
    tokens = torch.zeros((shape.micro_batch_size, shape.seq_len + 1), dtype=torch.long, device=META)
    with comm or CommMeter(META, cache), meter.recording(), flash_attention_on_meta():
        if engine is not None:
            engine.train([tokens], global_tokens, None)
        else:
            (model.loss_sum(tokens) / global_tokens).backward()
    return meter.bytes


def _ops_figures(ops: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """{collective: [calls, payload, ring-model bytes]} -> the report's figures, by collective name."""
    return {op: {"calls": int(v[0]), "bytes": int(v[1]), "ring_bytes": int(round(v[2]))}
            for op, v in sorted(ops.items())}


def _microbatch(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape, global_tokens: int,
                cache: MetaKernelCache | None) -> tuple[int, dict[str, list[float]]]:
    """Inside a fake world as `rank`: (activation bytes, TP collectives {op: [calls, payload, ring bytes]})
    of one micro-batch through `rank`'s stage of `layout` with the model `cfg`."""
    comm = CommMeter(META, cache)
    act = _saved_bytes(RankPlace(layout, rank, device=META), cfg, shape, global_tokens, comm)
    return act, {op: list(v) for (kind, op), v in comm.ops.items() if kind == "tp"}


# Layers per stage of the two short builds `_microbatch_scaled` measures a long stage from.
_SHORT_STAGES = (2, 3)


def _short_layout(layout: ResolvedLayout, cfg: ModelConfig, rank: int | None,
                  layers: int) -> tuple[ResolvedLayout, ModelConfig] | None:
    """`layout` and `cfg` with `layers` transformer layers in every stage, or None where the layers of
    `rank`'s stage (every stage: `rank=None`) are not all alike, so that its figures would not be
    affine in its layer count: per-layer degrees that differ, `model.recompute=full` on every k-th layer
    only (k > 1), model chunks interleaved over the stages; or where a stage is no longer than the
    short builds."""
    inner = set(layout.layer_tp[1:-1])
    lengths = layout.stage_layers if rank is None else [
        layout.stage_layers[layout.topology().coord(rank).stage]]
    every = int(getattr(cfg, "recompute_every", 1)) if getattr(cfg, "recompute", "none") == "full" else 1
    if (len(inner) != 1 or layout.schedule == "interleaved_1f1b" or layout.virtual_stages != 1
            or min(lengths) <= max(_SHORT_STAGES) or every != 1):
        return None
    n = layers * layout.pp
    degrees = (layout.layer_tp[0], *[inner.pop()] * n, layout.layer_tp[-1])
    pattern = layout.pattern
    if pattern:  # per-slot sharding patterns (`ntp.pattern`): the layers' must be alike too
        if len(set(pattern[1:-1])) != 1:
            return None
        pattern = (pattern[0], *[pattern[1]] * n, pattern[-1])
    short = dataclasses.replace(layout, layer_tp=degrees, stage_layers=(layers,) * layout.pp, pattern=pattern)
    return short, dataclasses.replace(cfg, num_layers=n)


def _extended(a: float, b: float, extra: int) -> float:
    """A figure of a stage `extra` layers longer than the first short build: f(2) + extra (f(3) - f(2))."""
    return a + extra * (b - a)


def _extended_ops(a: dict[str, list[float]], b: dict[str, list[float]],
                  extra: int) -> dict[str, list[float]]:
    zero = [0, 0, 0.0]
    return {op: [_extended(x, y, extra) for x, y in zip(a.get(op, zero), b.get(op, zero), strict=True)]
            for op in sorted(set(a) | set(b))}


def _microbatch_scaled(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape,
                       global_tokens: int,
                       cache: MetaKernelCache | None) -> tuple[int, dict[str, list[float]]]:
    """`_microbatch`'s figures, measured on two short builds of the stage and extended to its length.

    Where the layers of the stage are alike (`_short_layout`), every layer saves the same tensors and
    sends the same collectives, so each figure of a stage of L layers is f(2) + (L - 2)(f(3) - f(2)),
    exactly: the embedding, the head and the stage's ends are in both short builds, and each added
    layer adds the same.  Elsewhere the stage runs as it is (`_microbatch`)."""
    shorts = [_short_layout(layout, cfg, rank, k) for k in _SHORT_STAGES]
    if shorts[0] is None or shorts[1] is None:
        return _microbatch(layout, rank, cfg, shape, global_tokens, cache)
    (a2, ops2), (a3, ops3) = (_microbatch(lay, rank, c, shape, global_tokens, cache) for lay, c in shorts)
    extra = layout.stage_layers[layout.topology().coord(rank).stage] - _SHORT_STAGES[0]
    return int(_extended(a2, a3, extra)), _extended_ops(ops2, ops3, extra)


@dataclass
class _ShortBuild:
    """The layout and model with a few layers in every stage (`_short_layout`), every rank's parameter
    descriptors and sync plan on it, and the process groups an assembly creates on it."""

    layout: ResolvedLayout
    cfg: ModelConfig
    descriptors: list[dict[str, tuple]]
    plans: dict[int, SyncPlan]  # of the ranks that run a step
    made: int


def _short_builds(layout: ResolvedLayout, cfg: ModelConfig, shape: StepShape,
                  by_signature: dict[tuple[int, int, int], list[int]],
                  leaders: Sequence[int]) -> list[_ShortBuild] | None:
    """One `_ShortBuild` per length of `_SHORT_STAGES` (sync plans for the ranks `leaders`), or None
    where the stages' layers are not alike."""
    out = []
    for k in _SHORT_STAGES:
        short = _short_layout(layout, cfg, None, k)
        if short is None:
            return None
        lay, c = short
        topo = lay.topology()
        desc: dict[tuple[int, int, int], dict[str, tuple]] = {}
        for sig, ranks in by_signature.items():
            with fake_world(ranks[0], topo.world_size):
                model = RankPlace(lay, ranks[0], device=META).build_model(c, shape.seed, shape.param_dtype)
                desc[sig] = param_descriptors(model)
        descriptors = [desc[signature(topo, r)] for r in range(topo.world_size)]
        plans = build_sync_plans(descriptors, [co.replica for co in topo.coords], ranks=leaders)
        splits = communicator_splits(topo, plans, lay.schedule, False, lay.pattern)
        made = splits["tp"] + splits["grid"] + splits["holder_sets"] + splits["pipeline_links"]
        out.append(_ShortBuild(lay, c, descriptors, dict(zip(leaders, plans, strict=True)), made))
    return out


def _class_step_scaled(shorts: list[_ShortBuild], layout: ResolvedLayout, rank: int, shape: StepShape,
                       global_tokens: int, grad_norm: bool,
                       cache: MetaKernelCache | None) -> _ClassStep | None:
    """`_class_step`'s figures for `rank` on `layout`, from its steps on the two short builds: bytes and
    calls per micro-batch, activations, gradients and optimizer state extended to the stage's length
    (`_extended`: every layer of the stage adds the same), the groups used and the step scalars taken as
    they are (equal in both).  None where those two differ (the caller runs the whole stage).  Each
    short step checks its gradient sync against its plan and its assembly's groups against the count
    of its layout, as the whole step does."""
    runs = []
    for sb in shorts:
        with fake_world(rank, sb.layout.world_size):
            step = _class_step(sb.layout, rank, sb.cfg, shape, sb.plans[rank], sb.descriptors[rank],
                               global_tokens, grad_norm=grad_norm, cache=cache)
        if step.new_groups != sb.made:
            raise RuntimeError(f"rank {rank}: its assembly created {step.new_groups} process groups, "
                               f"the dry run counts {sb.made}")
        runs.append(step)
    a, b = runs
    if (a.groups, a.world_bytes, a.world_calls) != (b.groups, b.world_bytes, b.world_calls):
        return None
    extra = layout.stage_layers[layout.topology().coord(rank).stage] - _SHORT_STAGES[0]

    def ext(x: int, y: int) -> int:
        return int(_extended(x, y, extra))

    return _ClassStep(
        grad_bytes=ext(a.grad_bytes, b.grad_bytes),
        optimizer_bytes=ext(a.optimizer_bytes, b.optimizer_bytes),
        activation_bytes=ext(a.activation_bytes, b.activation_bytes),
        per_microbatch={k: ext(v, b.per_microbatch[k]) for k, v in a.per_microbatch.items()},
        per_microbatch_calls={k: ext(v, b.per_microbatch_calls[k])
                              for k, v in a.per_microbatch_calls.items()},
        groups=b.groups,
        world_bytes=b.world_bytes,
        world_calls=b.world_calls,
        new_groups=b.new_groups,
        tp_raw=_extended_ops(a.tp_raw, b.tp_raw, extra),
    )


def option_savings(layout: ResolvedLayout, rank: int, cfg: ModelConfig, shape: StepShape, plan: SyncPlan,
                   global_tokens: int, optimizer_bytes: int, activation_bytes: int,
                   tp_ops: dict[str, dict[str, float]] | None = None,
                   cache: MetaKernelCache | None = None, scale_layers: bool = True) -> dict[str, Any]:
    """Memory each optional saving would bring on `rank` (the dry run passes its largest rank).

    One entry per option, each `{"rank", <what it changes>: {setting: bytes}, "saved_bytes": ...}`:
    - `recompute` (`model.recompute`): activation bytes per micro-batch with none / selective / full.
      Non-reentrant checkpointing keeps each recomputed region's inputs outside autograd's saved
      tensors, so `full` is counted without the layer inputs it holds (b x s x h per layer);
    - `distributed_optimizer` (`DistributedAdamW`): optimizer state with the moments (and low-precision
      masters) sharded over each fragment's holders, against `torch.optim.AdamW`'s.
    - `sequence_parallel` (`ntp.sequence_parallel`): activation bytes per micro-batch with SP off / on,
      and the TP collectives of one micro-batch per kind (calls, payload, ring-model bytes on the link).
    `tp_ops`: the TP collectives the step measured on `rank` itself (with the layout's own SP
    setting), which is then not run again.  `scale_layers`: each other setting's micro-batch is
    measured on two short builds of the stage and extended to its length where its layers are alike
    (`_microbatch_scaled`, the same figures); False runs every one on the whole stage.  A new option
    adds its entry here.
    """
    measure = _microbatch_scaled if scale_layers else _microbatch
    out: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cfg)}
    # A layout with block-sharded slots (`ntp.pattern`) runs neither SP nor the distributed optimizer (the
    # config refuses both): no what-if of them.
    block = "block" in layout.pattern
    with fake_world(rank, layout.world_size):
        sp_act, sp_ops = {}, {}
        for on in () if block else (False, True):
            key = "on" if on else "off"
            if on == layout.sequence_parallel and tp_ops is not None:  # measured by the step on this rank
                sp_act[key], sp_ops[key] = activation_bytes, tp_ops
                continue
            sp_layout = dataclasses.replace(layout, sequence_parallel=on)
            sp_act[key], ops = measure(sp_layout, rank, cfg, shape, global_tokens, cache)
            sp_ops[key] = _ops_figures(ops)
        if not block:
            out["sequence_parallel"] = {"rank": rank, "activation_bytes": sp_act, "tp_collectives": sp_ops,
                                        "saved_bytes": sp_act["off"] - sp_act["on"]}
        if "recompute" in names:
            measured = {mode: activation_bytes if mode == cfg.recompute else measure(
                layout, rank, dataclasses.replace(cfg, recompute=mode), shape, global_tokens, cache)[0]
                for mode in ("none", "selective", "full")}  # the configured one ran in the step
            out["recompute"] = {"rank": rank, "activation_bytes": measured,
                                "saved_bytes": {m: measured["none"] - b for m, b in measured.items()
                                                if m != "none"}}
        if block:
            return out
        with CommMeter(META, cache):
            opt = _assemble(layout, rank, cfg, shape, plan, distributed=True).optimizer
        distributed = opt.state_bytes()
        out["distributed_optimizer"] = {
            "rank": rank,
            "optimizer_bytes": {"adamw": optimizer_bytes, "distributed": distributed},
            "saved_bytes": optimizer_bytes - distributed,
        }
    return out


class _PhaseClock:
    """Wall and CPU seconds of the dry run's phases into `timings` (`<phase>_s`, `<phase>_cpu_s`): on a
    loaded machine the CPU seconds say where the time goes, the wall seconds how long it took."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings
        self.start = self.last = (time.perf_counter(), time.process_time())

    def lap(self, phase: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.timings[f"{phase}_s"] = now[0] - self.last[0]
        self.timings[f"{phase}_cpu_s"] = now[1] - self.last[1]
        self.last = now

    def total(self) -> None:
        self.timings["total_s"] = time.perf_counter() - self.start[0]
        self.timings["total_cpu_s"] = time.process_time() - self.start[1]


def dry_run(
    layout: ResolvedLayout,
    cfg: ModelConfig,
    shape: StepShape,
    progress: Callable[[str], None] | None = None,
    measure_options: bool = True,
    group_ranks: bool = True,
    checkpoint_group: bool = False,
    scale_layers: bool = True,
) -> DryRunResult:
    """One training step of every rank of `layout` on meta tensors and a fake process group; with
    `measure_options`, also what each memory-saving option would save on the largest rank.
    `group_ranks=False` runs every rank's step and derives every rank's sync plan on its own (the
    baseline `bench/dry_run.py` compares against; same results, slower).  `checkpoint_group`: saves
    are asynchronous (`checkpoint.async_save`), so the checkpoint writer's group is one more split.
    `scale_layers` (with `group_ranks`): where the layers of every stage are alike, each step shape runs
    on two short builds (2 and 3 layers per stage) and its figures are extended to the stage's length
    (`_class_step_scaled`; the option report likewise); False runs every step on the whole stage (the
    reference, same figures)."""
    from ntp_nemo.pipeline.memory import in_flight

    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    clock = _PhaseClock(timings)
    topo = layout.topology()
    world = topo.world_size
    by_signature: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r in range(world):
        by_signature[signature(topo, r)].append(r)
    slices: dict[tuple[int, int, int], _Slice] = {}
    for sig, ranks in by_signature.items():
        with fake_world(ranks[0], world):
            slices[sig] = _build_slice(layout, ranks[0], cfg, shape)
    classes: dict[tuple, list[int]] = defaultdict(list)
    for r in range(world):
        classes[slices[signature(topo, r)].key if group_ranks else r].append(r)
    say(f"{world} ranks: {len(by_signature)} distinct model slices, {len(classes)} distinct step shapes")
    clock.lap("build")

    descriptors = [slices[signature(topo, r)].descriptors for r in range(world)]
    replica_of = [c.replica for c in topo.coords]
    if group_ranks:
        plans = build_sync_plans(descriptors, replica_of)
    else:
        plans = [build_sync_plan(r, descriptors, replica_of) for r in range(world)]
    clock.lap("sync_plans")
    splits = communicator_splits(topo, plans, layout.schedule, checkpoint_group, layout.pattern)
    say(splits_line(splits))

    counts = layout.microbatch_counts()
    cache = MetaKernelCache()  # the classes' layers repeat the same kernels on the same shapes
    global_tokens = layout.num_microbatches * shape.micro_batch_size * shape.seq_len
    steps: dict[Any, _ClassStep] = {}
    shorts = _short_builds(layout, cfg, shape, by_signature, [ranks[0] for ranks in classes.values()]) if (
        group_ranks and scale_layers) else None
    for i, (key, ranks) in enumerate(classes.items()):
        r = ranks[0]
        step = _class_step_scaled(shorts, layout, r, shape, global_tokens, i == 0, cache) if shorts else None
        how = f"on {' and '.join(map(str, _SHORT_STAGES))} layers per stage" if step else "whole stage"
        if step is None:
            with fake_world(r, world):
                step = _class_step(layout, r, cfg, shape, plans[r], descriptors[r], global_tokens,
                                   grad_norm=i == 0, cache=cache)
            made = splits["tp"] + splits["grid"] + splits["holder_sets"] + splits["pipeline_links"]
            if step.new_groups != made:
                raise RuntimeError(f"rank {r}: its assembly created {step.new_groups} process groups, "
                                   f"the dry run counts {made}")
        steps[key] = step
        say(f"step shape {i + 1}/{len(classes)} ({len(ranks)} ranks): ran on rank {r} ({how})")
    clock.lap("steps")

    element = shape.param_dtype.itemsize
    bucket = int(shape.bucket_mb * (1 << 20))
    results: list[RankResult] = []
    work = None
    if layout.work is not None:
        base = healthy_cost(layout.work, topo)
        work = [c / base for c in rank_costs(layout.work, topo)]
    peers = subgroup_peers(topo, plans, layout.schedule, layout.pattern)
    for r in range(world):
        c = topo.coord(r)
        sig = signature(topo, r)
        sl = slices[sig]
        step = steps[sl.key if group_ranks else r]
        m = counts[c.replica]
        dp_bytes, dp_calls = plan_traffic(plans[r], descriptors[r], element, bucket)
        stage_slots = [0] * (c.stage == 0) + [i + 1 for i in topo.stage_layer_range(c.stage)]
        stage_slots += [topo.num_layers + 1] * (c.stage == topo.pp - 1)
        results.append(RankResult(
            rank=r,
            replica=c.replica,
            stage=c.stage,
            slot=c.slot,
            tp_degree=topo.replica_tp[c.replica],
            layer_degrees=sorted({topo.degree(c.replica, s) for s in stage_slots}),
            microbatches=m,
            params=sl.params,
            sharded_params=sl.sharded_params,
            param_bytes=sl.param_bytes,
            grad_bytes=step.grad_bytes,
            optimizer_bytes=step.optimizer_bytes,
            activation_bytes=step.activation_bytes,
            activation_peak_bytes=step.activation_bytes * in_flight(layout.schedule, c.stage, topo.pp, m),
            comm_bytes={**{k: v * m for k, v in step.per_microbatch.items()}, "dp": dp_bytes,
                        "world": step.world_bytes},
            comm_calls={**{k: v * m for k, v in step.per_microbatch_calls.items()}, "dp": dp_calls,
                        "world": step.world_calls},
            comm_groups={**step.groups, "dp": len([h for h in plans[r].by_holders if plans[r].by_holders[h]]),
                         "world": 1 if world > 1 else 0},
            signature=sig,
            modelled_work=None if work is None else work[r],
            subgroup_peers=peers[r],
        ))
    clock.lap("ranks")

    options: dict[str, Any] = {}
    if measure_options:
        big = max(results, key=lambda r: r.memory_bytes).rank
        ran = next(k for k, ranks in classes.items() if big in ranks)
        options = option_savings(layout, big, cfg, shape, plans[big], global_tokens,
                                 results[big].optimizer_bytes, results[big].activation_bytes,
                                 tp_ops=steps[ran].tp_ops if classes[ran][0] == big else None, cache=cache,
                                 scale_layers=scale_layers)
    clock.lap("options")
    model_params = unsharded_param_count(cfg)
    clock.lap("unsharded")
    clock.total()
    return DryRunResult(ranks=results, model_params=model_params, signatures=len(by_signature),
                        timings=timings, options=options, splits=splits)


def splits_line(splits: dict[str, int]) -> str:
    return (f"communicator splits before step 1 (each new_group is collective over the world): "
            f"{splits['total']} (world {splits['world']}, TP groups {splits['tp']}, "
            + (f"grid rows and columns {splits['grid']}, " if splits.get("grid") else "")
            + f"fragment holder sets "
            f"{splits['holder_sets']}, pipeline links {splits['pipeline_links']}, checkpoint writer "
            f"{splits['checkpoint_writer']})")
