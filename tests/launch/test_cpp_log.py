"""A training process's C++ log threshold: at ERROR, a store whose host died fails the caller's
operation (the project reports it in one line) without c10d's warning and its C++ stack frames; an
explicit TORCH_CPP_LOG_LEVEL is left as the user set it."""

from __future__ import annotations

import subprocess
import sys

from ntp_nemo.launch.cpp_log import ERROR, quiet_cpp_warnings

STORE_GONE = """
import datetime, sys
import torch.distributed as dist
from ntp_nemo.launch.cpp_log import cpp_log_level, quiet_cpp_warnings
if sys.argv[1] == "quiet":
    quiet_cpp_warnings()
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))
client.set("a", "b")
del server  # the launcher that hosted the store is gone
try:
    client.get("never set")
except dist.DistNetworkError:
    print("failed as it should, threshold", cpp_log_level())
"""


def _run(mode: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", STORE_GONE, mode], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_a_lost_store_prints_no_cpp_frames_at_error():
    quiet, loud = _run("quiet"), _run("loud")
    assert "failed as it should, threshold 2" in quiet.stdout, quiet.stderr
    assert "frame #" not in quiet.stderr and "recvValue failed" not in quiet.stderr, quiet.stderr
    # the inherited threshold (WARNING) logs the failure with its C++ stack: what workers printed
    assert "failed as it should, threshold 1" in loud.stdout, loud.stderr
    assert "frame #" in loud.stderr, loud.stderr


def test_an_explicit_torch_cpp_log_level_is_the_users():
    assert quiet_cpp_warnings({"TORCH_CPP_LOG_LEVEL": "INFO"}) is False
    res = _run("quiet", {"TORCH_CPP_LOG_LEVEL": "WARNING"})
    assert "threshold 1" in res.stdout and "frame #" in res.stderr, res.stdout + res.stderr
    assert ERROR == 2
