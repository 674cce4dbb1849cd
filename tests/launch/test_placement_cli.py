"""The placement check through the real CLI: two torchrun agents on this machine stand for two nodes,
each task told its node's name the way SLURM tells it (SLURMD_NODENAME).  A layout whose TP group
straddles them is refused at start-up, before any step, naming the group, the nodes and the fix.  Each
task also sees one GPU of a node that SLURM says has 8 (CUDA_VISIBLE_DEVICES=<one id> and
SLURM_GPUS_ON_NODE=8, what `srun --gpus-per-task=1` sets), so the same start-up first warns, on rank 0,
that NCCL cannot use NVLink between such tasks.  This machine has no GPU: the task counts the GPU CUDA
would show it from CUDA_VISIBLE_DEVICES and still runs on the CPU.

The smallest such job, one process per node and TP 2 across them: each process imports Lightning before
the check, so every process more costs about 10 s of CPU. The message for an uneven split (3 processes
on one node, 1 on the other) is checked in process (tests/launch/test_cluster_startup.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ntp_nemo.config.resolve_layout import resolve_layout
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.node_layout import check_tp_within_nodes
from tests.conftest import TINY, compose
from tests.resilience.test_cluster_rehearsal import free_port


@pytest.mark.slow
def test_a_tp_group_split_across_two_nodes_is_refused_before_step_1(tmp_path):
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node, gpu in (("node-a", "3"), ("node-b", "5")):  # rank 0 on node-a, rank 1 on node-b
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SLURMD_NODENAME=node,
                   CUDA_VISIBLE_DEVICES=gpu, SLURM_GPUS_ON_NODE="8")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=placement", "--max-restarts=0",
             "-m", "ntp_nemo.train", *TINY, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null",
             "trainer.max_steps=2", f"hydra.run.dir={run}"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(outs)
    assert all(p.returncode != 0 for p in procs), text[-3000:]
    assert ("the TP group of replica 0 stage 0 (ranks 0-1) spans 2 nodes (node-a: ranks [0], node-b: "
            "ranks [1])") in text, text[-3000:]
    assert "processes per node now: node-a 1, node-b 1" in text and "ntp.allow_cross_node_tp=true" in text
    # each worker: one paragraph naming the key, exit 2 (the traceback around it is torchrun's own report)
    assert "error: invalid configuration: ntp.allow_cross_node_tp: the TP group" in text, text[-3000:]
    assert "exitcode  : 2" in text, text[-3000:]
    # the other placement problem of the same job, from rank 0 before its refusal: one GPU per task
    warning = "warning: each task sees one GPU on 2 node(s) with more: node-a (8 GPUs), node-b (8 GPUs)."
    printed = [o for o in outs if warning in o]
    assert len(printed) == 1 and "--gpus-per-node" in printed[0], text[-3000:]  # once, by rank 0
    assert printed[0].index(warning) < printed[0].index("error: invalid configuration"), printed[0][-3000:]
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == "", metrics.read_text()  # no step ran


def test_an_uneven_split_names_the_straddling_group_and_the_processes_per_node():
    """The job the CLI test ran before it shrank to one process per node: (2,2) with ranks 0-2 on
    node-a and rank 3 on node-b, its topology resolved from the composed config as the strategy does."""
    cfg = compose([*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=null"])
    with pytest.raises(ConfigError) as err:
        check_tp_within_nodes(["node-a"] * 3 + ["node-b"], resolve_layout(cfg).topology())
    text = str(err.value)
    assert err.value.key == "ntp.allow_cross_node_tp"
    assert text.startswith("ntp.allow_cross_node_tp: the TP group"), text
    assert ("the TP group of replica 1 stage 0 (ranks 2-3) spans 2 nodes (node-a: ranks [2], node-b: "
            "ranks [3])") in text, text
    assert "processes per node now: node-a 3, node-b 1" in text and "ntp.allow_cross_node_tp=true" in text
