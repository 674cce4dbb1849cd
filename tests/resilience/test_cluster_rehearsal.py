"""The cluster restart path of docs/failover.md, rehearsed on this machine: two torchrun agents (2 and 2
processes, gloo, c10d rendezvous) train (2,2); global rank 3, a worker of the second node, dies at step
5; the per-node commands printed by `python -m ntp_nemo.resilience.replan` (2 and 1 processes) resume
from the latest committed checkpoint with resume=auto, and the run ends on the failure-free loss curve."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ntp_nemo.resilience.replan import cli as replan_cli
from tests.conftest import TINY, read_metrics

STEPS = 8
BASE = [*TINY, "mesh.tp=2", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2",
        "fault.heartbeat_timeout_s=4", "fault.collective_timeout_s=8", "fault.step_timeout_s=60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agents(torchrun_args: list[list[str]], overrides: list[str], cwd, timeout: int = 240):
    """Start one torchrun agent per node (all on this machine), wait for all; (return codes, outputs)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args, *overrides],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for args in torchrun_args
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


@pytest.mark.slow
def test_two_node_torchrun_loses_a_gpu_and_resumes_on_the_replan(tmp_path, reference_losses, monkeypatch,
                                                                capsys):
    reference = reference_losses(f"single-{STEPS}")  # the failure-free curve (conftest)

    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    first = [
        ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
         "--rdzv-id=rehearsal-1", "--max-restarts=0", "-m", "ntp_nemo.train"]
        for _ in range(2)
    ]
    codes, outs = agents(
        first,
        [*BASE, "mesh.dp=2", "ntp.replica_tp=[2,2]", "fault=kill_rank", "fault.rank=3", "fault.step=5",
         f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert all(c != 0 for c in codes), outs  # both nodes' jobs fail: the cluster restarts the job
    fired = json.loads((run / "failover" / "faults" / "fired_0.json").read_text())
    assert fired["rank"] == 3 and fired["step"] == 5
    # The step-4 save may be cut short by the loss (then it stays a .tmp directory and step 2 is the
    # latest valid checkpoint): resume=auto picks whichever is committed.
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    assert committed[-1] in ("step_000002", "step_000004"), committed
    resumed = int(committed[-1].split("_")[1])

    # The replan's console function, called in this process with its words as sys.argv (its process
    # and exit codes are tested end to end in tests/resilience/test_failover_plan.py).
    monkeypatch.setattr(sys, "argv", [
        "python -m ntp_nemo.resilience.replan", "--tp", "2", "--replica-tp", "2,2", "--failed", "3",
        "--policy", "ntp", "--gpus-per-node", "2", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--json"])
    with pytest.raises(SystemExit) as exited:
        replan_cli()
    plan = capsys.readouterr()
    assert exited.value.code == 0, plan.err
    doc = json.loads(plan.out)
    assert doc["new_layout"] == "(2,1)"
    nodes = list(doc["nodes"].values())
    assert [len(n["devices"]) for n in nodes] == [2, 1]
    codes, outs = agents(
        [n["torchrun_args"] for n in nodes], [*BASE, f"hydra.run.dir={run}"], tmp_path
    )
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    text = "".join(outs)
    assert f"resuming from {run / 'checkpoints' / committed[-1]}" in text and text.count("run summary") == 1

    metrics = read_metrics(run)
    assert sorted({m["step"] for m in metrics}) == list(range(1, STEPS + 1))  # every step finished
    got = {m["step"]: m for m in metrics}  # the last execution of each step
    layouts = [got[s]["layout"] for s in range(1, STEPS + 1)]
    assert layouts == ["(2,2)"] * resumed + ["(2,1)"] * (STEPS - resumed)
    for step, loss in reference.items():
        assert abs(got[step]["loss"] - loss) <= 1e-4 * abs(loss), (step, got[step]["loss"], loss)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["layout"] == "(2,1)"
