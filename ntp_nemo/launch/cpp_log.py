"""The threshold of torch's C++ log (c10's) in a training process.

torch reads `TORCH_CPP_LOG_LEVEL` once, when it is imported: a worker forked by `ntp-train` inherits the
launching process's threshold (WARNING by default), and setting the variable afterwards changes
nothing.  At WARNING the c10d store client logs every failed receive with the C++ stack of the call
(`[W ...TCPStore.cpp] recvValue failed ... Connection reset by peer`, then about 20 `frame #` lines):
after `kill -9` of the launcher, which hosts the job's store, every worker waiting on the store during a
live recovery printed one or two of them (40 to 70 lines in all) before its own one-line report.  The
project reports those failures itself (a lost peer is a recovery, a lost launcher or coordinator a stop,
each in one line), so its processes run with the threshold at ERROR, as `TORCH_CPP_LOG_LEVEL=ERROR`
would have set it at the import; errors (an NCCL watchdog's timeout) are still logged.  A
`TORCH_CPP_LOG_LEVEL` in the environment is the user's choice and is left alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_SYMBOL = "FLAGS_caffe2_log_level"  # the threshold c10's LOG and c10d's C10D_WARNING read at each message


def _threshold() -> ctypes.c_int | None:
    """c10's log threshold in the loaded libc10 (None where it cannot be found: no Linux/macOS build of
    torch with that symbol)."""
    import torch

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
            return ctypes.c_int.in_dll(lib, _SYMBOL)
        except (OSError, ValueError):
            return None
    return None


def cpp_log_level() -> int | None:
    """This process's c10 log threshold (None: not readable here)."""
    value = _threshold()
    return None if value is None else int(value.value)


def quiet_cpp_warnings(env: Mapping[str, str] | None = None) -> bool:
    """Raise this process's c10 log threshold to ERROR unless `TORCH_CPP_LOG_LEVEL` is set (see the
    module docstring); returns whether this call raised it."""
    env = os.environ if env is None else env
    if env.get("TORCH_CPP_LOG_LEVEL"):
        return False
    value = _threshold()
    if value is None or value.value >= ERROR:
        return False
    value.value = ERROR
    return True


__all__ = ["ERROR", "cpp_log_level", "quiet_cpp_warnings"]
