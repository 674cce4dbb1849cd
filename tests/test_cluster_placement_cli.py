"""The placement check through the real CLI: two torchrun agents on this machine stand for two nodes,
each task told its node's name the way SLURM tells it (SLURMD_NODENAME).  A layout whose TP group
straddles them is refused at start-up, before any step, naming the group, the nodes and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import TINY
from tests.test_cluster_rehearsal import free_port


@pytest.mark.slow
def test_a_tp_group_split_across_two_nodes_is_refused_before_step_1(tmp_path):
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node, nproc in (("node-a", 3), ("node-b", 1)):  # ranks 0-2 on node-a, rank 3 on node-b
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SLURMD_NODENAME=node)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=placement", "--max-restarts=0",
             "-m", "ntp_nemo.train", *TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=null",
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
    assert ("the TP group of replica 1 stage 0 (ranks 2-3) spans 2 nodes (node-a: ranks [2], node-b: "
            "ranks [3])") in text, text[-3000:]
    assert "processes per node now: node-a 3, node-b 1" in text and "ntp.allow_cross_node_tp=true" in text
    # each worker: one paragraph naming the key, exit 2 (the traceback around it is torchrun's own report)
    assert "error: invalid configuration: ntp.allow_cross_node_tp: the TP group" in text, text[-3000:]
    assert "exitcode  : 2" in text, text[-3000:]
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == "", metrics.read_text()  # no step ran
