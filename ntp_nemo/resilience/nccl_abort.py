"""Ending a generation's NCCL communicators at once, so that the survivors of a lost rank stop waiting.

On gloo a broken generation is stopped by shutting its sockets down (`sockets.sever`).  NCCL
communicators are not sockets: a collective whose peer is gone waits in a CUDA kernel until its
communicator is aborted (`ncclCommAbort`), and only then does the collective, or the wait on its work,
fail.  `abort_generation` does that for every process group of the current generation:

- **abort** (the path the live recovery takes): `torch.distributed`'s `_abort_process_group()` aborts
  every group, the default one included, inside one NCCL group call (aborting communicators one at a
  time can deadlock: pytorch#119797), and forgets them; the next generation's groups are then created
  afresh on its own `PrefixStore` (`rendezvous.join`), with the re-planned ranks.
- **shrink** (only when the caller names the lost ranks and the installed torch and NCCL support it:
  `torch.distributed.shrink_group`, NCCL >= 2.27, a backend reporting `supports_shrinking`):
  `shrink_group(lost, shrink_flags=SHRINK_ABORT)` aborts what is in flight on the default communicator,
  aborts every other group, and leaves a default group of the survivors, renumbered in their old order,
  built from the old communicator without a new rendezvous.  It is collective over the survivors (each
  must call it with the same `lost`; a lost rank must not) and keeps only the NCCL half of a
  `cpu:gloo,cuda:nccl` world.  `rendezvous.leave` never takes it: it runs before the launcher's word says
  who is lost, and a re-plan may leave survivors idle or renumber them (`dp_drop`, a rejoin), which a
  shrunk group of every survivor cannot express.

Every survivor must abort, not only some: a peer still inside the old communicator (on the same node,
over NVLink or shared memory) would wait for one that left.  The function is meant to be called from a
thread other than the one blocked in the collective (a watcher acting on the coordinator's failure
notice): the blocked thread then sees its collective fail and finds no process group left.

None of this has run on a GPU yet (`tests/gpu/test_live_nccl.py` is written for two or more GPUs and has
never run); on CPU the tests check the choice of path and the gloo half of a mixed world.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ntp_nemo.resilience.sockets import sever

SHRINK_MIN_NCCL = (2, 27, 0)  # ncclCommShrink
# ProcessGroupNCCL's watchdog: 2 = on an error or timeout abort the communicators and let the process
# live (the default, 3, tears the whole process down, which would take a survivor with the lost rank)
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"


def world_backend() -> str | None:
    """The default group's backend string (`nccl`, `cpu:gloo,cuda:nccl`, `gloo`), None when none exists."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.get_backend())


def uses_nccl(backend: str | None) -> bool:
    return backend is not None and "nccl" in backend.lower()


def prepare_nccl_env() -> None:
    """Before a generation's NCCL groups are created: a lost peer must not make the watchdog end this
    process (set only when the user has not chosen a value)."""
    os.environ.setdefault(ASYNC_ERROR_HANDLING, CLEAN_UP_ONLY)


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL torch is linked with, None without one (a CPU build)."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, ImportError):
        return None
    if isinstance(v, int):  # older torch: an integer code (2.27.3 -> 22703)
        return (v // 10000, v // 100 % 100, v % 100)
    return tuple(int(x) for x in v)[:3]  # type: ignore[return-value]


def _nccl_backend(group: Any = None) -> Any:
    """The NCCL backend object of `group` (default: the default group), None if it has none."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None


def nccl_errors() -> list[str]:
    """Process groups of the current generation whose NCCL backend reports an error (`Backend.get_error`:
    a timeout or a communicator error that NCCL's watchdog met and, under
    `TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, aborted the communicator for, without anyone calling
    `abort_generation`): a step whose collectives ran on such a group may hold garbage.  Empty without
    NCCL or without a group."""
    if not dist.is_available() or not dist.is_initialized() or not uses_nccl(world_backend()):
        return []
    from torch._C._distributed_c10d import ErrorType

    ok = ErrorType.SUCCESS
    found = []
    for pg in list(dist.distributed_c10d._world.pg_map):
        backend = _nccl_backend(pg)
        try:
            error = backend.get_error() if backend is not None else ok
        except Exception:  # noqa: BLE001 - a backend without the query, or one already destroyed
            continue
        if error != ok:
            found.append(f"{getattr(pg, 'group_name', '?')}: {getattr(error, 'name', error)}")
    return found


def drain_device(timeout_s: float = 60.0) -> bool:
    """After an abort: wait, at most `timeout_s`, until no work of this process's GPU is in flight (every
    stream: the aborted collectives' kernels end with their communicators; an optimizer step's or an
    all-gather's writes into the parameters must not land after the recovery read them).  True when the
    device is idle (or CUDA was never initialised here), False when it did not drain in time."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return True
    import threading

    done = threading.Event()

    def sync() -> None:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - an aborted communicator's error surfaces here: the work ended
            pass
        finally:
            done.set()

    threading.Thread(target=sync, name="ntp-drain-device", daemon=True).start()
    return done.wait(timeout_s)


def can_shrink() -> bool:
    """Whether `torch.distributed.shrink_group` can end this generation: present in torch, NCCL >= 2.27
    and the default group's NCCL backend supports shrinking."""
    if not hasattr(dist, "shrink_group") or not hasattr(dist.distributed_c10d, "SHRINK_ABORT"):
        return False
    version = nccl_version()
    if version is None or version < SHRINK_MIN_NCCL:
        return False
    backend = _nccl_backend()
    try:
        return bool(backend is not None and backend.supports_shrinking)
    except Exception:  # noqa: BLE001 - an older backend without the attribute
        return False


def abort_generation(store: Any = None, lost: Sequence[int] | None = None) -> str:
    """Abort every NCCL process group of the current generation; returns the path taken.

    `none`: the default group's backend has no NCCL (gloo: `sockets.sever` stops it) or no group
    exists; nothing is touched.  `abort`: every group aborted and forgotten (`dist.is_initialized()` is
    then False).  `shrink`: with `lost` (ranks of the default group that are gone) where `can_shrink()`,
    the survivors' shrunk default group remains (see the module docstring).  `store` (the job's store):
    the gloo half of a `cpu:gloo,cuda:nccl` world is severed too, so a CPU collective in flight fails as
    well.  Safe to call from any thread; an already broken group that refuses to abort is destroyed."""
    backend = world_backend()
    if not uses_nccl(backend):
        return "none"
    if store is not None and "gloo" in str(backend):
        sever(store)
    if lost and can_shrink():
        dist.shrink_group(sorted({int(r) for r in lost}), shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
        return "shrink"
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - a broken group may refuse to abort; destroy it anyway
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
    return "abort"


__all__ = ["abort_generation", "can_shrink", "drain_device", "nccl_errors", "nccl_version",
           "prepare_nccl_env", "uses_nccl", "world_backend"]
