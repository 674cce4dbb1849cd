"""A rehearsal that sees devices: process groups that keep the device types of their real backends, on
a CPU without a GPU.

Why: on CPU every tensor is a CPU tensor and every backend (gloo, `ntpdirect`, the fake one) takes it,
so a GPU run's device mistakes cannot show: a CPU-only backend handed CUDA tensors (`ntpdirect` as the
TP group of a gloo world on GPUs), a host tensor handed to an NCCL group, an NCCL group created without
its device bound (a lazy communicator: the first call of a point-to-point exchange then needs every
rank).  Here the `meta` device stands for the accelerator (`stands_for`, "cuda"): the step's tensors are
meta tensors (the dry run's), host tensors stay CPU tensors, and every process group carries the
backend the code asked for, with the device types that backend moves:

- `gloo`: cpu and cuda; `nccl`: cuda only; `ntpdirect` (`topology.direct_group`): cpu only; a mixed
  string (`cpu:gloo,cuda:nccl`) the device types it names.

While `DeviceTypedWorld` is active, `torch.distributed.init_process_group` and `new_group` create
torch's fake process groups (no peers, nothing moves) but record what was asked (`GroupRecord`: ranks,
backend, `device_id`), `get_backend` answers the asked backend, and every `c10d` operation is checked:
a tensor whose device type (meta read as `stands_for`) the group's backend does not move raises
`DeviceTypeError`, as the real backend would on the GPU (NCCL: "No backend type associated with device
type cpu"; `ntpdirect`: "moves CPU tensors only").  `unbound_nccl()` lists the NCCL groups created without
`device_id`.  `init_process_group("fake")` (the dry run's `fake_world`) is recorded as `world_backend`:
the whole dry run then runs as on the GPU run's world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Device types each backend's collectives move (torch: gloo takes CPU and CUDA tensors, NCCL CUDA only).
BACKEND_DEVICE_TYPES = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "ntpdirect": ("cpu",),
    "fake": ("cpu", "cuda"),
}


class DeviceTypeError(RuntimeError):
    """A collective handed a tensor of a device type its group's backend does not move."""


def device_types(backend: str) -> tuple[str, ...]:
    """Device types a backend string moves: `gloo` -> (cpu, cuda), `cpu:gloo,cuda:nccl` -> (cpu, cuda),
    `cuda:nccl` -> (cuda,)."""
    parts = [p.strip() for p in str(backend).lower().split(",") if p.strip()]
    out: list[str] = []
    for part in parts:
        if ":" in part:
            device, name = part.split(":", 1)
            if device in BACKEND_DEVICE_TYPES.get(name, (device,)):
                out.append(device)
        else:
            out.extend(BACKEND_DEVICE_TYPES.get(part, ("cpu",)))
    return tuple(dict.fromkeys(out))


def uses_nccl_backend(backend: str) -> bool:
    return "nccl" in str(backend).lower()


@dataclass(frozen=True)
class GroupRecord:
    """What a process group was asked to be: `how` (init_process_group | new_group), its global ranks,
    backend string and bound device (None: unbound)."""

    how: str
    ranks: tuple[int, ...]
    backend: str
    device_id: Any = None


class DeviceTypedWorld(TorchDispatchMode):
    """Fake process groups with the device types of the backends asked for (module docstring).

    `world_backend`: the backend an `init_process_group("fake")` stands for (the GPU run's world:
    `gloo` when ranks share a GPU, `cpu:gloo,cuda:nccl` otherwise); `stands_for`: the device type meta
    tensors stand for."""

    def __init__(self, world_backend: str = "cpu:gloo,cuda:nccl", stands_for: str = "cuda") -> None:
        super().__init__()
        self.world_backend = world_backend
        self.stands_for = stands_for
        self.records: list[GroupRecord] = []
        self._by_group: dict[int, tuple[Any, GroupRecord]] = {}
        self._saved: dict[str, Any] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # ---- recording ------------------------------------------------------------------------------
    def _remember(self, group: Any, record: GroupRecord) -> None:
        self.records.append(record)
        if group is not None:
            self._by_group[id(group)] = (group, record)

    def record_of(self, group: Any = None) -> GroupRecord | None:
        pg = dist.group.WORLD if group is None else group
        entry = self._by_group.get(id(pg))
        return entry[1] if entry else None

    def unbound_nccl(self) -> list[GroupRecord]:
        """NCCL groups created without `device_id` (lazy communicators)."""
        return [r for r in self.records if uses_nccl_backend(r.backend) and r.device_id is None]

    def _init_process_group(self, backend: str | None = None, *args: Any, rank: int = -1,
                            world_size: int = -1, device_id: Any = None, **kwargs: Any) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        asked = self.world_backend if backend in (None, "fake") else str(backend)
        self._saved["init_process_group"]("fake", store=FakeStore(), rank=rank, world_size=world_size)
        self._remember(dist.group.WORLD, GroupRecord("init_process_group", tuple(range(world_size)), asked,
                                                     device_id))

    def _new_group(self, ranks: Any = None, timeout: Any = None, backend: str | None = None,
                   *args: Any, device_id: Any = None, **kwargs: Any) -> Any:
        world = self.record_of()
        asked = str(backend) if backend not in (None, "fake") else (world.backend if world else "fake")
        if device_id is None and world is not None:
            device_id = world.device_id  # torch: a subgroup of a bound world is bound too
        members = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
        group = self._saved["new_group"](list(members), timeout=timeout, backend="fake")
        self._remember(group, GroupRecord("new_group", members, asked, device_id))
        return group

    def _get_backend(self, group: Any = None) -> str:
        record = self.record_of(group)
        return record.backend if record is not None else self._saved["get_backend"](group)

    def __enter__(self) -> DeviceTypedWorld:
        for name, fn in (("init_process_group", self._init_process_group), ("new_group", self._new_group),
                         ("get_backend", self._get_backend)):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            for name, fn in self._saved.items():
                setattr(dist, name, fn)
            self._saved.clear()

    # ---- the check ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            record = None
            if pg is not None:
                try:
                    record = self.record_of(dist.ProcessGroup.unbox(pg))
                except (AttributeError, RuntimeError):
                    record = None
            if record is not None:
                moves = device_types(record.backend)
                for t in _tensors(list(args) + list(kwargs.values())):
                    kind = self.stands_for if t.device.type == "meta" else t.device.type
                    if kind not in moves:
                        raise DeviceTypeError(
                            f"{func.__name__} on a process group of backend {record.backend!r} (ranks "
                            f"{list(record.ranks)}) received a {kind} tensor ({t.device} stands for "
                            f"{kind}); {record.backend} moves {', '.join(moves)} tensors only: on the GPU "
                            "this collective fails.")
        return func(*args, **kwargs)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
